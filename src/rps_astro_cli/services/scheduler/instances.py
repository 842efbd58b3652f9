"""What the scheduler tracks per instance, the circuit breaker that takes an instance
out of rotation, and whether an instance may take new requests at all.

Two separate gates decide whether new requests may go to an instance:
- `dispatchable`: the fleet says it may (always, for a static `--engine` list; with
  Kubernetes discovery only while its EndpointSlice says ready and not terminating);
- `healthy`: the circuit breaker is closed (opened by a failed request, closed by a
  health check).
The dispatch sees only dispatchable instances, and among them the unhealthy ones as
unhealthy. A health check never makes an instance dispatchable: a terminating pod still
answers `/health` during its grace period, and stays out.

Indices are stable ids (never reused): an instance removed by discovery keeps its state,
not dispatchable, until its outstanding requests end, then it is dropped.
"""

from __future__ import annotations

import collections
import logging
import re
import time
from collections.abc import Iterator, Mapping
from typing import Any

from rps_astro_cli.dispatch.loads import DispatchRequest, StatusRow
from rps_astro_cli.protocol.service_wire import PendingRequest
from rps_astro_cli.services.scheduler.metrics import SchedulerMetrics
from rps_astro_cli.services.scheduler.settings import InstanceEndpoint
from rps_astro_cli.sim.prefix_cache import PrefixMirror
from rps_astro_cli.types import CandidateRequest, InstanceStatus

log = logging.getLogger("astro.scheduler")


class Pending:
    """A request forwarded to an instance, as the scheduler remembers it for its Predictor
    (times on `time.monotonic()`, s)."""

    __slots__ = ("prompt_tokens", "predicted_output_tokens", "sent_s", "accepted_s", "request_id")

    def __init__(self, prompt_tokens: int, predicted_output_tokens: int, sent_s: float,
                 request_id: str | None = None):
        self.prompt_tokens = prompt_tokens  # tokens
        self.predicted_output_tokens = predicted_output_tokens  # tokens (a late tag updates it)
        self.sent_s = sent_s  # forwarded to the engine
        self.accepted_s: float | None = None  # the engine answered the forward (holds it)
        self.request_id = request_id  # its `x-request-id` when forwarded before its tag


# how many late tags' lengths an instance remembers (the oldest are forgotten first)
LATE_LENGTHS_KEPT = 4096
# the id the scheduler gives a request it forwards before its tag (`x-request-id`); an
# engine's own id for it contains it (vLLM's and the sim engine's: "chatcmpl-" + the header)
LATE_ID = re.compile(r"astro-[0-9a-f]{16}")


def late_lengths_onto(status: dict[str, Any], lengths: Mapping[str, int]) -> None:
    """Put the tag's predicted length onto each request row of an engine's `/status` body
    (parsed JSON, before `InstanceStatus.from_dict`) that was forwarded before its tag: no
    `predicted_output_tokens` on the engine's side, an id in `lengths` (the length model's
    answer, arrived after the forward). On the wire dict, not the parsed rows: a poll
    re-applies every such length (a frozen row copied per length cost ~4 µs each)."""
    for key in ("running", "waiting", "arriving"):
        rows = status.get(key)
        if not isinstance(rows, list):
            continue
        for r in rows:
            if (isinstance(r, dict) and r.get("predicted_output_tokens") is None
                    and (m := LATE_ID.search(str(r.get("request_id", "")))) is not None):
                n = lengths.get(m.group())
                if n is not None:
                    r["predicted_output_tokens"] = n


def pending_wire(pending: list[Pending], now_s: float, keep_s: float) -> tuple[PendingRequest, ...]:
    """The `/predict` "pending" list of an instance at `now_s`; drops (from `pending`, in
    place) the entries sent more than `keep_s` ago: every snapshot fresh enough to be
    used shows them."""
    pending[:] = [p for p in pending if now_s - p.sent_s <= keep_s]
    return tuple(PendingRequest(p.prompt_tokens, p.predicted_output_tokens, max(0.0, now_s - p.sent_s),
                                None if p.accepted_s is None else max(0.0, now_s - p.accepted_s))
                 for p in pending)


class InstanceState:
    """One instance's live state (mutable, event-loop only)."""

    __slots__ = ("index", "ep", "healthy", "dispatchable", "phase", "removed", "outstanding", "load_row",
                 "status_s",
                 "dispatched", "predictor_failures", "predictor_skip_until", "engine_error", "predictor_error",
                 "pending", "engine_5xx", "predictor_error_at", "prefix", "block_size", "status", "engine_kind",
                 "engine_policy",
                 "prefix_caching", "late_lengths")

    def __init__(self, index: int, ep: InstanceEndpoint, dispatchable: bool = True, phase: str = "static"):
        self.index = index  # stable id in the scheduler's instance table (never reused)
        self.ep = ep
        # the engine's latest /status (status-based policies), for in-process predictions
        self.status: InstanceStatus | None = None
        self.healthy = True  # circuit breaker closed
        self.dispatchable = dispatchable  # the fleet lets new requests come (discovery: ready, not terminating)
        self.phase = phase  # static | the discovery phase: not_ready | ready | terminating | removed
        self.removed = False  # gone from discovery; dropped once outstanding reaches 0
        self.outstanding = 0  # requests forwarded there that have not ended
        self.dispatched = 0  # requests forwarded there in all
        # `dispatch.loads.status_fields_of` its latest /status (None before the first)
        self.load_row: StatusRow | None = None
        self.status_s = 0.0  # time.monotonic() when that /status was asked for
        self.predictor_failures = 0  # consecutive late/failed predict RPCs
        self.predictor_skip_until = 0.0  # time.monotonic() until which its Predictor is not asked
        self.pending: list[Pending] = []  # forwarded requests its /status may not show yet (oldest first)
        self.engine_error: str | None = None  # why its breaker opened (None while healthy)
        self.predictor_error: str | None = None  # its Predictor's last failure (None once it answers)
        self.engine_5xx = 0  # consecutive 5xx answers to forwarded requests (its breaker opens at 3)
        self.predictor_error_at = 0.0  # time.monotonic() of the last failed predict RPC
        self.prefix = PrefixMirror()  # its engine's cached block hashes (`/status?prefix_since=`)
        # its latest /status?prefix_since= answered a `prefix_cache` (prefix caching on there)
        self.prefix_caching = False
        self.block_size: int | None = None  # its KV block size (tokens), from its latest /status
        # "astro-sim" | "other" (its /version, asked once under prefix_tokenizer auto; None: not known yet)
        self.engine_kind: str | None = None
        # the in-instance policy its engine's latest /status names ("" when it has no
        # /status; None: not known yet, or its engine failed since and may have restarted)
        self.engine_policy: str | None = None
        # request id → the tag's predicted length (tokens) of requests forwarded before
        # their tag: put on its `/status` rows (`late_lengths_onto`), oldest forgotten first
        self.late_lengths: collections.OrderedDict[str, int] = collections.OrderedDict()

    def remember_length(self, request_id: str, tokens: int) -> None:
        """A late tag's length for request `request_id` forwarded here."""
        self.late_lengths[request_id] = tokens
        if len(self.late_lengths) > LATE_LENGTHS_KEPT:
            self.late_lengths.popitem(last=False)

    def problems(self) -> list[str]:
        """What is wrong with it, for `/health` and `/instances` (empty: nothing)."""
        out = []
        if not self.healthy:
            out.append(f"engine: {self.engine_error or 'unhealthy'}")
        if self.predictor_error is not None:
            out.append(f"predictor: {self.predictor_error} (dispatch falls back to load for it)")
        return out

    # -- dispatch.loads.InstanceView: what a dispatch reads of it ----------------------------
    @property
    def caches_prefixes(self) -> bool:
        return self.prefix_caching

    def status_row(self) -> StatusRow | None:
        """Its latest `/status` row (`dispatch.loads.status_fields_of`; None before the
        first), then the prompt blocks and count of the requests forwarded since that
        status was asked for (not in it yet; None, None when there are none)."""
        row = self.load_row
        if row is None:
            return None
        if self.pending:
            unseen = [p for p in self.pending if p.sent_s >= self.status_s]
            bs = row[5]
            return (*row[:7], sum(-(-p.prompt_tokens // bs) for p in unseen), len(unseen), *row[9:])
        return row

    def prefix_hit_tokens(self, req: DispatchRequest) -> int:
        return self.hit_tokens(req.block_hashes, req.block_size, req.prompt_tokens)

    def served_session(self, session_id: str | None) -> bool:
        return False  # the live scheduler keeps no sessions (session_affinity is a virtual baseline)

    def hit_tokens(self, hashes: tuple[int, ...], block_size: int, prompt_tokens: int) -> int:
        """Tokens of a request's prompt (`hashes` of its full blocks of `block_size`)
        cached on this instance as of its latest `/status` (at least one prompt token is
        left to compute, as the engine caps a hit); 0 when its block size differs."""
        if not hashes or self.block_size != block_size:
            return 0
        return self.prefix.hit_blocks(hashes, (prompt_tokens - 1) // block_size) * block_size


class Instances:
    """The instances in index order, with their circuit breakers and gauges."""

    def __init__(self, endpoints: tuple[InstanceEndpoint, ...], metrics: SchedulerMetrics):
        self.m = metrics
        self._by_index: dict[int, InstanceState] = {}
        self._next = 0
        for ep in endpoints:
            self.add(ep)

    def __getitem__(self, index: int) -> InstanceState:
        return self._by_index[index]

    def get(self, index: int) -> InstanceState | None:
        """Instance `index`, or None once it was dropped."""
        return self._by_index.get(index)

    def __iter__(self) -> Iterator[InstanceState]:
        return iter(list(self._by_index.values()))

    def __len__(self) -> int:
        return len(self._by_index)

    def dispatchable(self) -> list[InstanceState]:
        """The instances new requests may go to (breaker open or not), in index order."""
        return [st for st in self._by_index.values() if st.dispatchable]

    def add(self, ep: InstanceEndpoint, dispatchable: bool = True, phase: str = "static") -> InstanceState:
        """A new instance (a fresh index)."""
        st = InstanceState(self._next, ep, dispatchable, phase)
        self._next += 1
        self._by_index[st.index] = st
        self.m.healthy.labels(ep.name).set(1)
        self.m.outstanding.labels(ep.name).set(0)
        return st

    def set_phase(self, st: InstanceState, phase: str, dispatchable: bool) -> None:
        """Discovery moved `st` to `phase` (its breaker is left as it is)."""
        st.phase = phase
        st.dispatchable = dispatchable and not st.removed
        log.info("instance %s %s", st.ep.name, phase)

    def remove(self, st: InstanceState) -> None:
        """Discovery lost `st`: no new requests; dropped once its outstanding requests end."""
        st.removed = True
        self.set_phase(st, "removed", False)
        if st.outstanding == 0:
            self._drop(st)

    def _drop(self, st: InstanceState) -> None:
        if self._by_index.pop(st.index, None) is not None:
            for g in (self.m.healthy, self.m.outstanding):
                try:
                    g.remove(st.ep.name)
                except KeyError:
                    pass
            log.info("instance %s dropped", st.ep.name)

    def mark_failed(self, st: InstanceState, why: str) -> None:
        """Open the circuit breaker of `st` (out of rotation until a health check passes)."""
        st.engine_error = why
        st.engine_policy = None  # a restarted engine may run another policy: learn it again
        if st.healthy:
            st.healthy = False
            if not st.removed:
                self.m.healthy.labels(st.ep.name).set(0)
            self.m.trips.labels(st.ep.name).inc()
            log.warning("instance %s taken out: %s", st.ep.name, why)

    def mark_ok(self, st: InstanceState) -> None:
        """Close the circuit breaker of `st` (back in rotation if dispatchable)."""
        st.engine_error = None
        if not st.healthy:
            st.healthy = True
            if not st.removed:
                self.m.healthy.labels(st.ep.name).set(1)
            log.warning("instance %s readmitted", st.ep.name)

    def acquire(self, st: InstanceState, cand: CandidateRequest | None = None,
                now_s: float | None = None, request_id: str | None = None) -> Pending | None:
        """Count a request forwarded to `st`; with `cand`, also remember it as pending there
        (sent at `now_s`, default now; `request_id`: its `x-request-id` when it goes before
        its tag) and return that entry (mark its `accepted_s` when the engine answers; pass
        it to `release` if the forward fails)."""
        st.outstanding += 1
        st.dispatched += 1
        self.m.outstanding.labels(st.ep.name).set(st.outstanding)
        self.m.dispatched.labels(st.ep.name).inc()
        if cand is None:
            return None
        entry = Pending(cand.prompt_tokens, cand.predicted_output_tokens,
                        time.monotonic() if now_s is None else now_s, request_id)
        st.pending.append(entry)
        return entry

    def release(self, st: InstanceState, entry: Pending | None = None) -> None:
        """Count the end of a request forwarded to `st` (the last one of a removed
        instance drops it); `entry`: its pending entry, forgotten now (a failed forward,
        or the request ended: no later `/status` can show it)."""
        if entry is not None:
            if entry in st.pending:
                st.pending.remove(entry)
            if entry.request_id is not None:
                st.late_lengths.pop(entry.request_id, None)
        st.outstanding -= 1
        if st.removed:
            if st.outstanding == 0:
                self._drop(st)
            return
        self.m.outstanding.labels(st.ep.name).set(st.outstanding)
