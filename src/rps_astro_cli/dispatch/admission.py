"""Per-request SLOs and admission (issue 33): headroom-aware dispatch and refusal.

A request may carry an SLO (`RequestSlo`: TTFT and TPOT targets in ms, a priority where
lower = more important, as vLLM's `priority`) from the headers `x-slo-ttft-ms`,
`x-slo-tpot-ms` (llm-d's names), the body's `priority`, and per-class defaults
(`x-slo-class: NAME`, or a class named like the request's model) — `parse_request_slo`,
the one parser of the front door, the endpoint picker and `astro bench`.

Admission (`judge`, pure) runs inside `dispatch.decide` / `decide_async` between the
predictions and the scorers, only for a request with a TTFT target and a policy that
reads `PREDICTIONS`:

- a candidate *meets* the SLO when its predicted TTFT × (1 + `margin_frac`) ≤ the
  target (margin 10 % by default: the Astrolabe paper's 10–15 % prediction error) and
  (`require_room`, default) it has room now — after the waiting queue's, the in-flight
  and this request, at least `room_reserve_frac` (5 %) of its batch slots and of its KV
  blocks stay free (`room_of`, the KV gate's counts). Why: with predicted lengths the
  look-ahead is reliable on when a prefill starts only when it need not wait for
  running requests to end or be preempted (ARCHITECTURE.md §2). Measured
  (benchmarks/slo_admission.py, 4 × llama-2-7b-a30, held-out ShareGPT, predicted
  lengths): at 120 % load, seed 0, without the room check 772 of 1,049 admitted
  interactive requests were predicted ≤ 0.91 s and took > 1 s (20 of 1,154 with room
  at reserve 0); interactive P99 TTFT over seeds 0, 3, 4 at 120 %: 1.3–3.5 s at reserve
  0, 0.19–0.20 s at 5 %;
- lower priority is shed first: a request of priority p > 0 needs `p ×
  priority_reserve_frac` (5 %) more room, so as the fleet fills, the less important
  class is refused while the more important one still gets in (same benchmark, seeds 0
  and 3, interactive goodput without → with it: 6.8 → 7.4 req/s at 120 %, 7.1 → 8.4 at
  150 %, total goodput within ±0.4; 10 % gives 7.8 / 9.1 but refused 2 batch requests
  at 80 % load, where nothing should be);
- headroom-aware dispatch: when some candidates meet it, only those are scored. Tie rule
  `prefer`: ``"most"`` (default) = the policy's own scorer over the feasible set
  (power_of_k's lowest predicted TTFT = the most headroom); ``"least"`` = the feasible
  candidate with the least headroom (highest predicted TTFT; best-fit packing, keeps the
  fast instances for tight requests), ties by lowest index;
- when none meets it, by `mode`: ``"off"`` = dispatch as if no SLO (the scorers over
  every candidate), ``"reject"`` = refuse (`AdmissionVerdict.admit` False, reason
  ``"slo_ttft_unmeetable"``); the live scheduler answers HTTP 429 with `Retry-After`.
  ``"queue"`` = refuse the same way when no candidate's predicted TTFT meets the target
  (waiting cannot shorten a look-ahead that already counts the queue ahead), but when
  some does and only lacks room now (reason ``"slo_no_room"``), hold the request in a
  bounded router queue (`RouterQueue`: more important priority first, then earliest
  deadline) and decide again every `queue_retry_s` against what is left of its target
  (`remaining_slo`), until it is admitted, its deadline can no longer be met (refused
  ``"slo_ttft_unmeetable"``), or a more important arrival takes its place in a full
  queue (refused ``"router_queue_full"``). The virtual cluster and the live front door
  (hence the endpoint picker) run this same loop.
- no candidate's prediction arrived (Predictors down or late): admitted (fail open),
  reason ``"no_prediction"`` — astro cannot tell, and refusing on no evidence would turn
  a Predictor outage into an outage.

Requests without a TTFT target are never judged: dispatch is bit-identical to before
(`scripts/dispatch_equivalence.py`).

"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rps_astro_cli.errors import AstroUserError

ADMISSION_MODES = ("off", "reject", "queue")
PREFER = ("most", "least")
MARGIN_FRAC = 0.1  # predicted TTFT × (1 + margin) must be ≤ the target
TTFT_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"
CLASS_HEADER = "x-slo-class"
REFUSED_TTFT = "slo_ttft_unmeetable"  # the refusal reason (Prometheus label, decision record)
NO_ROOM = "slo_no_room"  # queue mode: a candidate's TTFT meets the target, none has room now: wait
QUEUE_FULL = "router_queue_full"  # queue mode: shed from a full router queue


@dataclass(frozen=True)
class RequestSlo:
    """One request's service-level objective and priority."""

    # time-to-first-token target (milliseconds); None = none (not judged at admission)
    ttft_ms: float | None = None
    # time-per-output-token target (milliseconds); None = none (measured, not admitted on)
    tpot_ms: float | None = None
    # scheduling priority; lower = more important (vLLM's `priority`), 0 default
    priority: int = 0
    # the class it came from (`x-slo-class` or the model name), None = per-request only
    slo_class: str | None = None

    @property
    def ttft_s(self) -> float | None:
        """The TTFT target in seconds, or None."""
        return None if self.ttft_ms is None else self.ttft_ms / 1000.0


@dataclass(frozen=True)
class Admission:
    """How the dispatcher treats requests with a TTFT target."""

    # "off" | "reject" | "queue" (module docstring)
    mode: str = "reject"
    # predicted TTFT × (1 + margin_frac) must be ≤ the target (fraction ≥ 0)
    margin_frac: float = MARGIN_FRAC
    # tie rule among the candidates that meet the target: "most" | "least" headroom
    prefer: str = "most"
    # a candidate meets the target only if it also has room now: a batch slot and the
    # KV blocks for the waiting queue's and this prompt (`room_of`); where it has none,
    # the TTFT depends on when running requests end, which predicted lengths get wrong
    require_room: bool = True
    # room keeps this fraction of the batch slots and KV blocks free after this request
    # (0 = it just fits); more absorbs the running requests' growth past their predictions
    room_reserve_frac: float = 0.05
    # lower priority is shed first: a request of priority p > 0 needs this much more room
    # per priority level (its reserve = room_reserve_frac + p × priority_reserve_frac)
    priority_reserve_frac: float = 0.05
    # queue mode: requests held at most (a full queue sheds its least important)
    queue_max: int = 256
    # queue mode: seconds between decisions for the held requests
    queue_retry_s: float = 0.05

    def __post_init__(self) -> None:
        if self.mode not in ADMISSION_MODES:
            raise AstroUserError(f"unknown admission mode {self.mode!r}", field="admission",
                                 fix=f"use one of {', '.join(ADMISSION_MODES)}")
        if self.queue_max < 1:
            raise AstroUserError(f"must be ≥ 1, got {self.queue_max}", field="admission_queue_max")
        if not (self.queue_retry_s > 0 and math.isfinite(self.queue_retry_s)):
            raise AstroUserError(f"must be a finite number > 0, got {self.queue_retry_s}",
                                 field="admission_queue_retry_s")
        if self.prefer not in PREFER:
            raise AstroUserError(f"unknown headroom rule {self.prefer!r}", field="admission_prefer",
                                 fix=f"use one of {', '.join(PREFER)}")
        if not 0 <= self.priority_reserve_frac < 1:
            raise AstroUserError(f"must be in [0, 1), got {self.priority_reserve_frac}",
                                 field="admission_priority_reserve")
        if not 0 <= self.room_reserve_frac < 1:
            raise AstroUserError(f"must be in [0, 1), got {self.room_reserve_frac}", field="admission_room_reserve")
        if not (self.margin_frac >= 0 and math.isfinite(self.margin_frac)):
            raise AstroUserError(f"must be a finite number ≥ 0, got {self.margin_frac}", field="admission_margin")


DEFAULT_ADMISSION = Admission()  # reject, margin 10 %, most headroom


@dataclass(frozen=True)
class AdmissionVerdict:
    """What admission decided for one request."""

    # dispatch it (True) or refuse it (False)
    admit: bool
    # candidates predicted to meet the TTFT target (with the margin), in candidate order
    feasible: tuple[int, ...]
    # "headroom" (some meet it), "no_headroom_off" (none, mode off), "no_prediction",
    # or REFUSED_TTFT
    reason: str
    # for a refusal: seconds after which a retry might succeed (≥ 1, the shortest
    # predicted overshoot of the target, rounded up), else 0
    retry_after_s: int = 0


def judge(slo: RequestSlo, candidates: Sequence[int], predicted_ttft_s: Mapping[int, float],
          admission: Admission, room: Mapping[int, bool] | None = None) -> AdmissionVerdict:
    """Admission for a request with a TTFT target (module docstring).

    predicted_ttft_s: candidate index → predicted TTFT (seconds from now), for those
        whose prediction arrived. room: candidate → whether it has room now (`room_of`);
        with `admission.require_room` one without room never meets the target (absent
        = unknown = room).
    """
    target = slo.ttft_s
    assert target is not None, "judge() is for requests with a TTFT target"
    answered = [i for i in candidates if i in predicted_ttft_s]
    if not answered:
        return AdmissionVerdict(True, (), "no_prediction")
    k = 1.0 + admission.margin_frac
    gate = room if room is not None and admission.require_room else {}
    feasible = tuple(i for i in answered if predicted_ttft_s[i] * k <= target and gate.get(i, True))
    if feasible:
        return AdmissionVerdict(True, feasible, "headroom")
    if admission.mode == "off":
        return AdmissionVerdict(True, (), "no_headroom_off")
    best = min(predicted_ttft_s[i] for i in answered)
    if admission.mode == "queue" and best * k <= target:  # in time, only no room now: wait for it
        return AdmissionVerdict(False, (), NO_ROOM, 1)
    return AdmissionVerdict(False, (), REFUSED_TTFT, max(1, math.ceil(best * k - target)))


def remaining_slo(slo: RequestSlo, arrival_s: float, now_s: float) -> RequestSlo | None:
    """The request's SLO with its TTFT target cut to what is left at `now_s` of the one
    it arrived with at `arrival_s` (same clock); None when nothing is left."""
    assert slo.ttft_ms is not None
    left_ms = slo.ttft_ms - (now_s - arrival_s) * 1000.0
    return replace(slo, ttft_ms=left_ms) if left_ms > 0 else None


class RouterQueue:
    """The bounded router queue of `Admission` mode "queue" (module docstring): items in
    the order they should be decided again — lower `priority` value (more important)
    first, then earliest deadline, then arrival. Pure bookkeeping: the virtual cluster
    and the live front door own the clock and the decisions."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self._heap: list[tuple[int, float, int, Any]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._heap)

    def offer(self, item: Any, priority: int, deadline_s: float) -> Any | None:
        """Hold `item`; when the queue is full, the least important of the held ones and
        `item` (highest priority value, then latest deadline, then latest arrival) is
        shed and returned (possibly `item` itself); None when nothing was shed."""
        self._seq += 1
        entry = (priority, deadline_s, self._seq, item)
        if len(self._heap) < self.max_len:
            heapq.heappush(self._heap, entry)
            return None
        worst = max(self._heap, key=lambda e: e[:3])
        if entry[:3] >= worst[:3]:
            return item
        self._heap.remove(worst)
        heapq.heapify(self._heap)
        heapq.heappush(self._heap, entry)
        return worst[3]

    def take_all(self) -> list[Any]:
        """Every held item, in decision order; the queue is left empty."""
        out = [heapq.heappop(self._heap)[3] for _ in range(len(self._heap))]
        return out


def room_of(free_slots: int | None, free_blocks: int | None, min_slots: float = 0.0,
            min_blocks: float = 0.0) -> bool:
    """Room now: the batch slots and KV blocks left after the running and waiting
    requests, the in-flight ones and this one are ≥ `min_slots` / `min_blocks`
    (`stages.KvHeadroomFilter`'s counts; unknown = room)."""
    return (free_slots is None or free_slots >= min_slots) and (free_blocks is None or free_blocks >= min_blocks)


def least_headroom(feasible: Sequence[int], predicted_ttft_s: Mapping[int, float]) -> int:
    """The feasible candidate with the highest predicted TTFT (ties: lowest index)."""
    return max(feasible, key=lambda i: (predicted_ttft_s[i], -i))


def _number(value: Any, name: str, *, integer: bool = False) -> float:
    """A header / field value as a finite number (> 0 for targets)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        v = int(value) if integer else float(value)
    except (TypeError, ValueError):
        kind = "an integer" if integer else "a number of milliseconds"
        raise AstroUserError(f"{name} must be {kind}, got {value!r}", field=name) from None
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise AstroUserError(f"{name} must be an integer, got {value!r}", field=name)
        return float(v)
    if not (math.isfinite(v) and v > 0):
        raise AstroUserError(f"{name} must be a finite number > 0 (milliseconds), got {value!r}", field=name)
    return float(v)


def parse_slo_class(spec: Mapping[str, Any], name: str, where: str = "scheduler.slo_classes") -> RequestSlo:
    """One class of the recipe's `scheduler.slo_classes` ({ttft_ms, tpot_ms, priority}).

    Raises:
        AstroUserError: an unknown key or a bad value (names `where.name.key`).
    """
    if not isinstance(spec, Mapping):
        raise AstroUserError(f"{where}.{name} must be a mapping of ttft_ms, tpot_ms, priority", field=f"{where}.{name}")
    unknown = set(spec) - {"ttft_ms", "tpot_ms", "priority"}
    if unknown:
        raise AstroUserError(f"{where}.{name}: unknown key(s) {sorted(unknown)}", field=f"{where}.{name}",
                             fix="use ttft_ms, tpot_ms, priority")
    ttft = spec.get("ttft_ms")
    tpot = spec.get("tpot_ms")
    pri = spec.get("priority", 0)
    return RequestSlo(None if ttft is None else _number(ttft, f"{where}.{name}.ttft_ms"),
                      None if tpot is None else _number(tpot, f"{where}.{name}.tpot_ms"),
                      int(_number(pri, f"{where}.{name}.priority", integer=True)), name)


def parse_slo_class_spec(text: str, field: str = "--slo-class",
                         extra: tuple[str, ...] = ()) -> tuple[str, dict[str, Any]]:
    """`NAME:key=value,key=value` (keys ttft_ms, tpot_ms, priority, and `extra`, e.g.
    `share`) → (NAME, {key: value as text}); check the SLO keys with `parse_slo_class`.

    Raises:
        AstroUserError: no name, a key without `=`, an unknown or repeated key (names `field`).
    """
    name, sep, rest = text.partition(":")
    name = name.strip()
    fix = f"write NAME:ttft_ms=1000,tpot_ms=100,priority=0{''.join(f',{k}=...' for k in extra)}"
    if not name or not sep:
        raise AstroUserError(f"{text!r}: no class name", field=field, fix=fix)
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in ("ttft_ms", "tpot_ms", "priority", *extra) or key in out:
            raise AstroUserError(f"{text!r}: bad or repeated key {key!r}", field=field, fix=fix)
        out[key] = value.strip()
    return name, out


def parse_request_slo(headers: Mapping[str, str], priority: Any = None,
                      classes: Mapping[str, RequestSlo] | None = None,
                      model: str | None = None) -> RequestSlo | None:
    """A request's SLO from its headers (keys lower-case), its body's `priority` and the
    recipe's classes; None when it carries none (today's behaviour).

    Order: the class (`x-slo-class`, else a class named like `model`) gives defaults;
    `x-slo-ttft-ms`, `x-slo-tpot-ms` and the body's `priority` override them. An
    `x-slo-class` the recipe does not define is an error unless a target header comes
    with it (then it only labels the request, as `astro bench --slo-class` sends it).

    Raises:
        AstroUserError: a bad value or an unknown `x-slo-class` (names the header or
            field; the front door answers 400).
    """
    classes = classes or {}
    base: RequestSlo | None = None
    name = headers.get(CLASS_HEADER)
    ttft = headers.get(TTFT_HEADER)
    tpot = headers.get(TPOT_HEADER)
    if name is not None and name not in classes and (ttft is not None or tpot is not None):
        base = RequestSlo(slo_class=name)  # a label for targets the headers give (astro bench sends both)
    elif name is not None:
        if name not in classes:
            raise AstroUserError(f"unknown {CLASS_HEADER} {name!r}", field=CLASS_HEADER,
                                 fix=f"use one of {', '.join(sorted(classes)) or '(none configured)'}")
        base = classes[name]
    elif model is not None and model in classes:
        base = classes[model]
    if base is None and ttft is None and tpot is None and priority is None:
        return None
    base = base or RequestSlo()
    return RequestSlo(
        base.ttft_ms if ttft is None else _number(ttft, TTFT_HEADER),
        base.tpot_ms if tpot is None else _number(tpot, TPOT_HEADER),
        base.priority if priority is None else int(_number(priority, "priority", integer=True)),
        base.slo_class,
    )


__all__ = ["ADMISSION_MODES", "DEFAULT_ADMISSION", "NO_ROOM", "QUEUE_FULL", "REFUSED_TTFT", "Admission",
           "AdmissionVerdict", "RequestSlo", "RouterQueue", "judge", "least_headroom", "parse_request_slo",
           "parse_slo_class", "parse_slo_class_spec", "remaining_slo"]
