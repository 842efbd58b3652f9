"""Discrete-event, virtual-time cluster simulation.

N `InstanceSim`s (each with its own instance policy) step independently; a
`DispatchPolicy` places each request when it arrives (ARCHITECTURE.md §1, use 3: sweep request
rates in seconds on a CPU). Events, in a heap ordered by (time, kind, sequence):

- arrival: the dispatcher builds an `InstanceLoad` per instance and runs the policy's
  pipeline (`dispatch.decide`: filter → sample → predict → score → pick); when the
  policy reads `PREDICTIONS`, "predict" runs the jump look-ahead
  (`sim.lookahead.predict_instance`) on each candidate instance, with the request's
  prefix-cache hit there (`CandidateRequest.cached_tokens`). The decision takes no
  virtual time; its wall-clock µs are recorded.
- enqueue: the request reaches the chosen engine's waiting queue after its
  preprocessing time (`preprocess_s`, 0 for text); an idle instance is woken: it forms
  a step at that instant, after all arrivals and enqueues of the same instant. With
  `preprocess_slots` = k, each instance's front end preprocesses at most k requests at
  once, first come first served (k = 1: one event loop, as vLLM's AsyncLLM in the
  RPS-Serve authors' harness runs input processing): a request starts its
  preprocessing when a slot frees (`RequestRecord.preprocess_start_s`, the engine's
  arrival stamp) and a text request, with no preprocessing of its own, still waits for
  a slot. None (the default): every request preprocesses on its own at once.
- step end: an instance's step (formed at its start by `InstanceSim.step`) completes;
  its finished requests are recorded and the next step starts at once if work remains.

An instance's state is applied when its step is formed (tokens are stamped at the step's
end), so a status read mid-step shows the state as of the step's end. A look-ahead for a
busy instance therefore starts at that end time (the candidate still arrives at
now + preprocess) and its estimates are shifted back to "seconds from now".

Multi-turn sessions: a request that `follows` another arrives `think_s` after that one's
last token (closed loop: the next turn is sent after the previous reply); its own
`arrival_s` is ignored. Requests with `token_ids` carry chained block hashes
(`sim.prefix_cache.block_hashes`, computed once at arrival) so the instances' prefix
caches can hit; the dispatcher sees each instance's cached prefix of the request
(`InstanceLoad.prefix_hit_tokens`) and whether it served the session's previous turn
(`InstanceLoad.served_session`) when the policy reads status.

Several stateless schedulers (`dispatch` a list of S policies, one per scheduler replica,
as behind a Kubernetes Service): the n-th arrival goes to scheduler n mod S (a
round-robin Service). With `status_interval_s` = Δ > 0 no scheduler reads an instance's
live state: every Δ virtual seconds (at t = kΔ, before the first event at or after it)
each instance's status is copied — running and waiting requests, free KV blocks, the
requests still preprocessing, outstanding count — as a Predictor's cached `/status` is
shared by every scheduler; a decision between two refreshes reads that copy, taken as
current, plus (with `count_pending`) the scheduler's own pending list: the requests it
sent to that instance after the copy, queued as new (the live /predict `pending` field).
No scheduler knows the others' sends until the next refresh — the herding a stale
status causes. Prefix-cache hits are read live. Δ = 0 with one scheduler is the
single-dispatcher simulation above, event for event; `ClusterResult.herding` then stays
None.

Ties at equal times: arrivals, then enqueues, then step ends; within a kind, by sequence.
All randomness (the dispatch policy's sampling and tie-breaks) comes from the one
`numpy.random.Generator` passed in, so a run is deterministic for a seed.
"""

from __future__ import annotations

import copy
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.dispatch.admission import (
    DEFAULT_ADMISSION,
    NO_ROOM,
    QUEUE_FULL,
    REFUSED_TTFT,
    Admission,
    RequestSlo,
    RouterQueue,
    remaining_slo,
)
from rps_astro_cli.dispatch.base import DispatchPolicy, decide
from rps_astro_cli.dispatch.loads import DispatchRequest, StatusRow, loads_for, status_fields_of
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.sim.calibration import StepCalibrator, StepSample
from rps_astro_cli.sim.fcfs import FCFSPolicy
from rps_astro_cli.sim.instance import InstanceSim, StatusNames
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.lookahead import predict_instance
from rps_astro_cli.sim.policy import InstancePolicy
from rps_astro_cli.sim.prefix_cache import block_hashes
from rps_astro_cli.sim.profile import ExecutionProfile
from rps_astro_cli.sim.remaining import OnlineRemaining, RemainingLength
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.types import CandidateRequest, InstanceConfig, LatencyEstimate

_ARRIVAL, _ENQUEUE, _STEP_END, _RETRY = 0, 1, 2, 3


@dataclass(frozen=True, slots=True)
class TimedRequest:
    """One request of a virtual workload.

    request_id: unique id. arrival_s: arrival at the dispatcher (virtual seconds).
    prompt_tokens: prompt length incl. vision tokens (tokens, ≥ 1).
    output_tokens: true output length; the engine generates exactly this many (≥ 1).
    predicted_output_tokens: what the dispatcher and Predictors see (tokens); None =
        the true length (oracle). Clipped to [1, max_model_len - prompt_tokens].
    modality: text / image / video. vision_tokens: tokens from media (included in
        prompt_tokens). encoder_s: vision-encoder seconds charged to the step holding
        its first prefill chunk. preprocess_s: CPU preprocessing seconds between
        dispatch and the engine queue. req_class: sand / pebbles / rocks or None.
    deadline_s: absolute deadline (virtual seconds) for deadline-aware policies, or None.
    token_ids: the prompt's token ids, then the reply's when known (a multi-turn replay
        knows them); None = unknown, no prefix caching for this request.
    session_id: the conversation it belongs to (None = none). follows: request_id of
        the previous turn; this one arrives `think_s` seconds after that one finishes.
    slo: its TTFT/TPOT targets and priority; with a TTFT target it is judged by
        `simulate_cluster`'s `admission` (None = today's behaviour).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    predicted_output_tokens: int | None = None
    modality: str = "text"
    vision_tokens: int = 0
    encoder_s: float = 0.0
    preprocess_s: float = 0.0
    req_class: str | None = None
    deadline_s: float | None = None
    token_ids: tuple[int, ...] | None = None
    session_id: str | None = None
    follows: str | None = None
    think_s: float = 0.0
    slo: RequestSlo | None = None  # its SLO and priority (`dispatch.admission`); None = none


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (times in virtual seconds).

    instance: index of the instance it was sent to. dispatch_s: decision time (= arrival).
    enqueue_s: reached the engine queue (dispatch + preprocess). first_scheduled_s: its
    first step started. first_token_s / finish_s: first / last output token.
    num_preemptions: times it was preempted by recompute. predicted_ttft_s /
    predicted_e2e_s: the chosen instance's look-ahead (seconds from arrival), when the
    policy predicted. decide_us: wall-clock microseconds the decision took.
    cached_tokens: prompt tokens served from the prefix cache at its first admission.
    session_id: its conversation, or None.
    preprocess_start_s: its own preprocessing started (the engine's arrival stamp, as
        vLLM's `arrival_time`): = dispatch_s unless it waited for a front-end slot.
    untrusted_predictors: candidates whose Predictor was not asked because its model's
        recent error was too high (`calibration`; the decision leaned on load for them).
    refused: admission refused it (the reason, e.g. "slo_ttft_unmeetable"): never
        dispatched, `instance` = -1, no token times; None = dispatched.
    slo_class: its SLO class name, when it carried one.
    """

    request_id: str
    instance: int
    arrival_s: float
    dispatch_s: float
    enqueue_s: float
    first_scheduled_s: float | None
    first_token_s: float | None
    finish_s: float | None
    prompt_tokens: int
    output_tokens: int
    predicted_output_tokens: int
    num_preemptions: int
    modality: str = "text"
    req_class: str | None = None
    predicted_ttft_s: float | None = None
    predicted_e2e_s: float | None = None
    decide_us: float = 0.0
    cached_tokens: int = 0
    session_id: str | None = None
    preprocess_start_s: float | None = None
    untrusted_predictors: int = 0
    refused: str | None = None
    slo_class: str | None = None

    @property
    def ttft_s(self) -> float:
        """Time to first token from arrival (seconds)."""
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        """End-to-end latency from arrival (seconds)."""
        assert self.finish_s is not None
        return self.finish_s - self.arrival_s

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ClusterResult:
    """A virtual-cluster run.

    records: one per request, in input order. preemptions_per_instance /
    steps_per_instance / requests_per_instance: per-instance totals. makespan_s: virtual
    time of the last finish. wall_s: wall-clock seconds the simulation took.
    dispatch: the dispatch policy's `describe()`.
    prefix_cache_queries_tokens / prefix_cache_hits_tokens: summed over the instances
    (tokens looked up in / served from the prefix cache, vLLM's counters).
    """

    records: list[RequestRecord]
    preemptions_per_instance: list[int]
    steps_per_instance: list[int]
    requests_per_instance: list[int]
    makespan_s: float
    wall_s: float
    dispatch: dict[str, Any] = field(default_factory=dict)
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    herding: dict[str, Any] | None = None  # several schedulers / a stale status only (`_Herding.summary`)
    # with `calibration`: each Predictor's calibrator at the end (`CalibrationState.to_dict`)
    calibration: list[dict[str, Any]] | None = None

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions_per_instance)


def _validate(requests: Sequence[TimedRequest], cfg: InstanceConfig) -> None:
    seen: set[str] = set()
    for r in requests:
        where = f"request {r.request_id!r}"
        if r.request_id in seen:
            raise AstroUserError(f"{where}: duplicate request_id", field="request_id")
        seen.add(r.request_id)
        if r.prompt_tokens < 1:
            raise AstroUserError(f"{where}: prompt_tokens must be ≥ 1, got {r.prompt_tokens}", field="prompt_tokens")
        if r.output_tokens < 1:
            raise AstroUserError(f"{where}: output_tokens must be ≥ 1, got {r.output_tokens}", field="output_tokens")
        if r.prompt_tokens + r.output_tokens > cfg.max_model_len:
            raise AstroUserError(
                f"{where}: prompt + output = {r.prompt_tokens + r.output_tokens} tokens exceeds "
                f"max_model_len {cfg.max_model_len}", field="output_tokens",
                fix="drop or truncate such requests when building the workload",
            )
        if r.arrival_s < 0 or r.preprocess_s < 0 or r.encoder_s < 0 or r.think_s < 0:
            raise AstroUserError(f"{where}: times must be ≥ 0", field="arrival_s")
        if r.follows is not None and r.follows not in seen:
            raise AstroUserError(f"{where}: follows {r.follows!r}, which is not an earlier request",
                                 field="follows", fix="list a session's turns in order")


def simulate_cluster(
    requests: Sequence[TimedRequest],
    num_instances: int,
    dispatch: DispatchPolicy | Sequence[DispatchPolicy],
    latency: LatencyModel | ExecutionProfile | Sequence[LatencyModel | ExecutionProfile],
    config: InstanceConfig | Sequence[InstanceConfig] | None = None,
    instance_policy_factory: Callable[[], InstancePolicy] | None = None,
    rng: np.random.Generator | None = None,
    *,
    extension_tokens: int = 10,
    default_output_tokens: int = 256,
    remaining: RemainingLength | OnlineRemaining | None = None,
    status_interval_s: float = 0.0,
    count_pending: bool = True,
    waiting_hits: bool = True,
    preprocess_slots: int | None = None,
    predictor_latency: LatencyModel | ExecutionProfile | Sequence[LatencyModel | ExecutionProfile] | None = None,
    calibration: str | None = None,
    admission: Admission | None = DEFAULT_ADMISSION,
) -> ClusterResult:
    """Run `requests` through `num_instances` simulated instances in virtual time.

    requests: the workload (any order; processed by arrival time, ties by input order).
    dispatch: a `DispatchPolicy` (`dispatch.make_dispatch(name)`); it keeps its own
        state (round-robin's turn), so pass a fresh one per run. A list: one fresh
        policy per scheduler replica (module docstring).
    latency: step-latency model, or a profile to build one from; a sequence: one per
        instance (a heterogeneous fleet).
    config: batching limits (one, or one per instance); default each instance's
        `InstanceConfig.from_profile(its profile)`. The instances must share one KV
        block size (prefix hashes are per block).
    instance_policy_factory: makes each instance's local policy (default FCFS).
    rng: the run's only source of randomness (required).
    extension_tokens / default_output_tokens: the look-ahead's auto-extension rule.
    remaining: the look-ahead's conditional remaining-length rule for queued/running
        requests (`sim.remaining`; None = the auto-extension rule). An
        `OnlineRemaining` also observes every finished request's true length.
    status_interval_s: 0 = decisions read the instances' live state; Δ > 0 = a status
        copy refreshed every Δ virtual seconds (module docstring).
    count_pending: with Δ > 0, each scheduler adds its own sends since the copy.
    waiting_hits: the look-ahead credits queued requests' own prefix-cache hits
        (`sim.lookahead.predict_instance`); False = only the candidate's.
    preprocess_slots: requests each instance's front end preprocesses at once, FIFO
        (module docstring); None = unlimited (each on its own). The look-ahead sees the
        candidate's wait for a slot as part of its preprocessing time.
    predictor_latency: the step model(s) each instance's Predictor assumes (same forms
        as `latency`); None = each Predictor's model is its engine's (no mismatch).
    calibration: None = the Predictors' models are fixed and always trusted (as
        before calibration existed); "off" = fixed, but each Predictor's recent step
        error is tracked and an untrusted one (`sim.calibration`) is not asked, so the
        dispatch leans on load for that instance; "online" = as "off", and each
        Predictor also refits its model from its engine's steps (`StepCalibrator`).
    admission: how requests with a TTFT SLO (`TimedRequest.slo`) are judged
        (`dispatch.admission`; default reject, margin 10 %, 5 % room); a refused request is
        recorded with `refused` set and never reaches an instance. In mode "queue" a
        request in time but without room anywhere is held in the router queue and
        decided again every `queue_retry_s` virtual seconds (its record's `arrival_s`
        stays its arrival, `dispatch_s` is when it left the queue). Requests without an
        SLO are unaffected. None = never judged.

    Returns a `ClusterResult` (records in input order).

    Raises:
        AstroUserError: num_instances < 1, no rng, or a malformed request (names it).
    """
    if num_instances < 1:
        raise AstroUserError(f"must be ≥ 1, got {num_instances}", field="num_instances")
    if preprocess_slots is not None and preprocess_slots < 1:
        raise AstroUserError(f"must be ≥ 1 or None, got {preprocess_slots}", field="preprocess_slots")
    schedulers = [dispatch] if isinstance(dispatch, DispatchPolicy) else list(dispatch)
    if not schedulers:
        raise AstroUserError("needs at least one dispatch policy", field="schedulers")
    if not (status_interval_s >= 0 and np.isfinite(status_interval_s)):
        raise AstroUserError(f"must be a finite number ≥ 0, got {status_interval_s}", field="status_interval_s")
    dispatch = schedulers[0]
    if rng is None:
        raise AstroUserError("simulate_cluster needs a numpy Generator", field="rng",
                             fix="pass rng=numpy.random.default_rng(seed)")
    if calibration not in (None, "off", "online"):
        raise AstroUserError(f"unknown calibration {calibration!r}", field="calibration", fix="use online or off")
    lats = _per_instance(latency, num_instances, "latency")
    plats = None if predictor_latency is None else _per_instance(predictor_latency, num_instances,
                                                                  "predictor_latency")
    if config is None:
        cfgs = [InstanceConfig.from_profile(lt.profile) for lt in lats]
    elif isinstance(config, InstanceConfig):
        cfgs = [config] * num_instances
    else:
        cfgs = list(config)
        if len(cfgs) != num_instances:
            raise AstroUserError(f"{len(cfgs)} instance configs for {num_instances} instances", field="config")
    if len({c.block_size for c in cfgs}) > 1:
        raise AstroUserError("the instances' KV block sizes differ", field="config",
                             fix="give every instance the same block_size (prefix hashes are per block)")
    cfg = min(cfgs, key=lambda c: c.max_model_len)  # every request must fit every instance
    _validate(requests, cfg)
    factory = instance_policy_factory or FCFSPolicy
    sims = [InstanceSim(cfgs[i], lats[i], factory()) for i in range(num_instances)]
    bs = cfg.block_size
    max_len = cfg.max_model_len
    # each instance's Predictor: its step model (None: the engine's own) and, with
    # `calibration`, its calibrator (which holds the model in force)
    cals = None if calibration is None else [
        StepCalibrator((plats[i] if plats is not None else lats[i]).profile, learn=calibration == "online")
        for i in range(num_instances)]
    busy_until = [0.0] * num_instances
    stepping = [False] * num_instances
    pending_finished: list[list[SimRequest]] = [[] for _ in range(num_instances)]
    arriving: list[list[SimRequest]] = [[] for _ in range(num_instances)]  # dispatched, still preprocessing
    outstanding = [0] * num_instances
    dispatched = [0] * num_instances
    # per instance: when each front-end preprocessing slot is next free (virtual s)
    frontend = [[0.0] * preprocess_slots for _ in range(num_instances)] if preprocess_slots else None
    learn = getattr(remaining, "observe", None)  # an online table learns from finished requests
    inputs = frozenset().union(*(d.inputs for d in schedulers))
    herd = _Herding(sims, arriving, outstanding, busy_until, stepping, len(schedulers), status_interval_s,
                    count_pending) if len(schedulers) > 1 or status_interval_s > 0 else None
    n_arrived = 0
    # admission mode "queue": the held requests (indices), when each first arrived
    router_q = RouterQueue(admission.queue_max) if admission is not None and admission.mode == "queue" else None
    first_arrival: dict[int, float] = {}
    retry_due = False

    n = len(requests)
    records: list[RequestRecord | None] = [None] * n
    sim_reqs: list[SimRequest | None] = [None] * n
    heap: list[tuple[float, int, int, int]] = []
    seq = 0
    followers: dict[str, list[int]] = {}
    for idx, r in enumerate(requests):
        if r.follows is None:
            heap.append((r.arrival_s, _ARRIVAL, idx, idx))
        else:
            followers.setdefault(r.follows, []).append(idx)
    seq = n
    last_instance: dict[str, int] = {}  # session → instance of its latest turn
    # each instance as this process's scheduler sees it (dispatch.loads.InstanceView)
    own_views = [_Seen(i, sim, outstanding, cfgs[i], last_instance) for i, sim in enumerate(sims)]
    heapq.heapify(heap)
    index_of: dict[int, int] = {}
    makespan = 0.0
    t_wall = time.perf_counter()

    def start_step(i: int, now: float) -> None:
        nonlocal seq
        res = sims[i].step(now)
        if cals is not None and res.scheduled:  # the Predictor learns from its engine's step
            cals[i].observe(StepSample.of(res.shape, res.duration_s))
        if res.scheduled:
            end = now + res.duration_s
            busy_until[i] = end
            stepping[i] = True
            pending_finished[i] = res.finished
            seq += 1
            heapq.heappush(heap, (end, _STEP_END, seq, i))
        elif res.preempted:
            # the pass preempted the request it served and nothing ran (vLLM V1 stops
            # the pass); the next step forms at once
            wake(i, now)
        else:
            stepping[i] = False

    def wake(i: int, now: float) -> None:
        # an idle instance forms its next step at `now`, after every arrival and
        # enqueue of that same instant (event kind order)
        nonlocal seq
        stepping[i] = True
        busy_until[i] = now
        seq += 1
        heapq.heappush(heap, (now, _STEP_END, seq, i))

    while heap:
        now, kind, _s, x = heapq.heappop(heap)
        if herd is not None:
            herd.refresh(now)
        if kind == _STEP_END:
            i = x
            fin = pending_finished[i]
            if fin:
                outstanding[i] -= len(fin)
                for sr in fin:
                    if learn is not None:  # the scheduler sees the true length when a request ends
                        learn(sr.predicted_output_tokens, sr.num_generated_tokens)
                    rec = records[index_of[id(sr)]]
                    assert rec is not None
                    rec.first_scheduled_s = sr.first_scheduled_s
                    rec.first_token_s = sr.first_token_s
                    rec.finish_s = sr.finish_s
                    rec.num_preemptions = sr.num_preemptions
                    rec.req_class = sr.req_class  # the class the instance policy used
                    rec.cached_tokens = sr.num_cached_tokens
                    for nxt in followers.get(sr.request_id, ()):
                        seq += 1  # the next turn: after the reply plus the think time
                        heapq.heappush(heap, (now + requests[nxt].think_s, _ARRIVAL, seq, nxt))
                makespan = now
            pending_finished[i] = []
            start_step(i, now)
            continue
        if kind == _ENQUEUE:
            i = records[x].instance  # type: ignore[union-attr]
            sr = sim_reqs[x]
            assert sr is not None
            arriving[i].remove(sr)
            sr.arrival_s = now
            sims[i].add(sr)
            if not stepping[i]:
                wake(i, now)
            continue
        if kind == _RETRY:  # the router queue's turn: its requests arrive again, in its order
            retry_due = False
            assert router_q is not None
            for q in router_q.take_all():
                seq += 1
                heapq.heappush(heap, (now, _ARRIVAL, seq, q))
            continue
        # arrival: dispatch
        req = requests[x]
        arrived = first_arrival.setdefault(x, now) if router_q is not None else now
        slo = req.slo
        if arrived < now:  # back from the router queue: what is left of its TTFT target
            assert slo is not None
            slo = remaining_slo(slo, arrived, now)
        sched = n_arrived % len(schedulers)  # a round-robin Service in front of the scheduler replicas
        n_arrived += 1
        dispatch = schedulers[sched]
        pred_len = req.predicted_output_tokens if req.predicted_output_tokens is not None else req.output_tokens
        pred_len = max(1, min(int(pred_len), max_len - req.prompt_tokens))
        t0 = time.perf_counter()
        hashes = block_hashes(req.token_ids, bs) if req.token_ids else ()
        max_hit = (req.prompt_tokens - 1) // bs
        # what this scheduler sees: the live instances, or (stale status) the copies + its pending list
        views: Sequence[Any] = sims
        seen_out, seen_busy, seen_stepping, seen_arriving = outstanding, busy_until, stepping, arriving
        if herd is not None:
            views, seen_out, seen_busy, seen_stepping, seen_arriving = herd.views(sched, now)
        seen = own_views if herd is None else [_Seen(i, sim, seen_out, cfgs[i], last_instance)
                                               for i, sim in enumerate(views)]
        loads = loads_for(seen, DispatchRequest(req.prompt_tokens, hashes, bs, req.session_id), inputs)
        preds: dict[int, LatencyEstimate] = {}
        untrusted: list[int] = []

        # called by `decide` at once, inside this iteration: binding the loop's values
        # as defaults only says so to the linter (B023)
        def predict(cands: list[int], req=req, pred_len=pred_len, now=now, preds=preds, hashes=hashes,
                    max_hit=max_hit, views=views, busy_until=seen_busy, stepping=seen_stepping,
                    arriving=seen_arriving, untrusted=untrusted) -> dict[int, LatencyEstimate]:
            cand = CandidateRequest(req.prompt_tokens, pred_len, req.modality, req.vision_tokens,
                                    req.encoder_s, req.preprocess_s, req.req_class, req.deadline_s)
            for i in cands:
                plat = None if plats is None else plats[i]
                if cals is not None:
                    if not cals[i].trusted:  # its model is off: not asked, load decides for it
                        untrusted.append(i)
                        continue
                    plat = cals[i].latency
                t_snap = busy_until[i] if stepping[i] and busy_until[i] > now else now
                c = cand
                pre_i = req.preprocess_s
                if frontend is not None:  # the wait for a front-end slot, then its own preprocessing
                    pre_i += max(0.0, min(frontend[i]) - now)
                    cand = c = replace(cand, preprocess_s=pre_i)
                cache = sims[i].cache
                if hashes and cache is not None:  # the candidate's prefix-cache hit there
                    hit = cache.lookup(hashes, max_hit)[0] * bs
                    if hit:
                        c = replace(c, cached_tokens=hit)
                if t_snap > now:  # from the step's end: keeps the hit set above
                    c = replace(c, preprocess_s=max(0.0, now + pre_i - t_snap))
                est = predict_instance(views[i], t_snap, c, arriving=arriving[i], extension_tokens=extension_tokens,
                                       default_output_tokens=default_output_tokens, remaining=remaining,
                                       waiting_hits=waiting_hits, latency=plat)
                shift = t_snap - now
                preds[i] = LatencyEstimate(est.ttft_s + shift, est.e2e_s + shift,
                                           est.steps_simulated, est.events)
            return preds

        if slo is None and req.slo is not None:  # its deadline passed in the router queue
            decision = None
            refused: str | None = REFUSED_TTFT
        else:
            decision = decide(dispatch, loads, rng, predict, slo, admission)
            refused = decision.refused
        decide_us = (time.perf_counter() - t0) * 1e6
        slo_class = req.slo.slo_class if req.slo is not None else None
        if refused == NO_ROOM:  # queue mode: in time, no room now: hold it
            assert router_q is not None and req.slo is not None and req.slo.ttft_s is not None
            shed = router_q.offer(x, req.slo.priority, arrived + req.slo.ttft_s)
            if not retry_due:
                retry_due = True
                seq += 1
                heapq.heappush(heap, (now + admission.queue_retry_s, _RETRY, seq, -1))  # type: ignore[union-attr]
            if shed is None:
                continue
            x, req, refused = shed, requests[shed], QUEUE_FULL
            slo_class = req.slo.slo_class if req.slo is not None else None
            arrived = first_arrival.get(x, now)
            pred_len = req.predicted_output_tokens if req.predicted_output_tokens is not None else req.output_tokens
            pred_len = max(1, min(int(pred_len), max_len - req.prompt_tokens))
        if refused is not None:
            records[x] = RequestRecord(
                req.request_id, -1, arrived, now, now, None, None, None, req.prompt_tokens, req.output_tokens,
                pred_len, 0, req.modality, req.req_class, decide_us=decide_us, session_id=req.session_id,
                refused=refused, slo_class=slo_class)
            for nxt in followers.get(req.request_id, ()):
                seq += 1  # a refused turn ends now; the next one follows after its think time
                heapq.heappush(heap, (now + requests[nxt].think_s, _ARRIVAL, seq, nxt))
            continue
        assert decision is not None
        i = decision.choice
        chosen = preds.get(i)
        outstanding[i] += 1
        dispatched[i] += 1
        pre_start = now
        if frontend is not None:  # FIFO: the earliest-free slot of the chosen instance's front end
            slots = frontend[i]
            j = slots.index(min(slots))
            pre_start = max(now, slots[j])
            slots[j] = pre_start + req.preprocess_s
        enqueue_s = pre_start + req.preprocess_s
        if req.session_id is not None:
            last_instance[req.session_id] = i
        waited = now - arrived  # in the router queue (queue mode), else 0
        records[x] = RequestRecord(
            req.request_id, i, arrived, now, enqueue_s, None, None, None,
            req.prompt_tokens, req.output_tokens, pred_len, 0, req.modality, req.req_class,
            chosen.ttft_s + waited if chosen else None, chosen.e2e_s + waited if chosen else None, decide_us,
            session_id=req.session_id, preprocess_start_s=pre_start, untrusted_predictors=len(untrusted),
            slo_class=slo_class,
        )
        sr = SimRequest(
            request_id=req.request_id, arrival_s=enqueue_s, prompt_tokens=req.prompt_tokens,
            target_output_tokens=req.output_tokens, modality=req.modality,
            vision_tokens=req.vision_tokens, encoder_s=req.encoder_s, req_class=req.req_class,
            predicted_output_tokens=pred_len, deadline_s=req.deadline_s, block_hashes=hashes,
        )
        sim_reqs[x] = sr
        index_of[id(sr)] = x
        if enqueue_s > now:
            seq += 1
            heapq.heappush(heap, (enqueue_s, _ENQUEUE, seq, x))
            arriving[i].append(sr)  # what a Predictor sees as `arriving` until then
        else:
            sims[i].add(sr)
            if not stepping[i]:
                wake(i, now)
        if herd is not None:
            herd.sent(sched, i, sr)

    out = [r for r in records if r is not None]
    assert len(out) == n
    return ClusterResult(
        records=out,
        preemptions_per_instance=[s.num_preemptions_total for s in sims],
        steps_per_instance=[s.num_steps_total for s in sims],
        requests_per_instance=dispatched,
        makespan_s=makespan,
        wall_s=time.perf_counter() - t_wall,
        dispatch=dispatch.describe(),
        prefix_cache_queries_tokens=sum(s.prefix_cache_queries_tokens for s in sims),
        prefix_cache_hits_tokens=sum(s.prefix_cache_hits_tokens for s in sims),
        herding=herd.summary() if herd is not None else None,
        calibration=None if cals is None else [c.state().to_dict() for c in cals],
    )


def _per_instance(models: Any, n: int, field_name: str) -> list[LatencyModel]:
    """One `LatencyModel` per instance from a model or profile (every instance) or a
    sequence of them (one each; a profile given twice shares one memo)."""
    if isinstance(models, (LatencyModel, ExecutionProfile)):
        one = models if isinstance(models, LatencyModel) else LatencyModel(models)
        return [one] * n
    items = list(models)
    if len(items) != n:
        raise AstroUserError(f"{len(items)} step models for {n} instances", field=field_name,
                             fix="give one per instance, or one for all")
    memo: dict[int, LatencyModel] = {}
    out = []
    for m in items:
        if isinstance(m, LatencyModel):
            out.append(m)
        else:
            out.append(memo.setdefault(id(m), LatencyModel(m)))
    return out


class _StatusView(StatusNames):
    """An instance as a status copy shows it: what `predict_instance` and the loads read."""

    def __init__(self, sim: InstanceSim, running: list[SimRequest], waiting: list[SimRequest], free_blocks: int):
        self.config, self.latency, self.policy, self.cache = sim.config, sim.latency, sim.policy, sim.cache
        self.running, self.waiting, self.free_blocks = running, waiting, free_blocks
        self.num_preemptions_total = sim.num_preemptions_total


class _Seen:
    """One instance as a scheduler of the virtual cluster sees it when it dispatches (a
    `dispatch.loads.InstanceView`): the instance (or its stale copy), its outstanding
    requests, and the sessions' last instances."""

    __slots__ = ("index", "sim", "counts", "cfg", "sessions")
    healthy = True

    def __init__(self, index: int, sim: Any, counts: list[int], cfg: InstanceConfig, sessions: dict[str, int]):
        self.index, self.sim, self.counts, self.cfg, self.sessions = index, sim, counts, cfg, sessions

    @property
    def outstanding(self) -> int:
        return self.counts[self.index]

    @property
    def caches_prefixes(self) -> bool:
        return self.sim.cache is not None

    def status_row(self) -> StatusRow:
        return status_fields_of(self.sim)

    def prefix_hit_tokens(self, req: DispatchRequest) -> int | None:
        cache = self.sim.cache
        if cache is None:
            return None
        return cache.lookup(req.block_hashes, (req.prompt_tokens - 1) // req.block_size)[0] * req.block_size

    def served_session(self, session_id: str | None) -> bool:
        return session_id is not None and self.sessions.get(session_id) == self.index


class _Herding:
    """Status copies refreshed every Δ, each scheduler's pending list, and the herding
    figures (module docstring). Δ = 0: the schedulers read the live instances.

    summary(): schedulers, status_interval_s, count_pending; requests_per_scheduler;
    refreshes (status copies taken); queue_spread_mean — over the decisions, the mean of
    (longest − shortest) true queue (waiting + preprocessing requests) across the
    instances just after the request joined; unseen_sends_mean — over the decisions, the
    mean number of requests the other schedulers had sent to the chosen instance since
    its status copy (sends this scheduler could not know of; 0 when Δ = 0).
    """

    def __init__(self, sims: list[InstanceSim], arriving: list[list[SimRequest]], outstanding: list[int],
                 busy_until: list[float], stepping: list[bool], s: int, interval_s: float, count_pending: bool):
        n = len(sims)
        self.sims, self.live_arriving, self.live_out = sims, arriving, outstanding
        self.live_busy, self.live_stepping = busy_until, stepping
        self.n, self.s, self.interval, self.count_pending = n, s, interval_s, count_pending
        self.snaps: list[_StatusView] = []
        self.snap_t: float | None = None
        self.snap_out = list(outstanding)
        self.snap_busy = list(busy_until)
        self.snap_stepping = list(stepping)
        self.snap_arriving: list[list[SimRequest]] = [[] for _ in range(n)]
        self.pending: list[list[list[SimRequest]]] = [[[] for _ in range(n)] for _ in range(s)]  # [sched][inst]
        self.per_sched = [0] * s
        self.refreshes = 0
        self._spread_sum = 0.0
        self._unseen_sum = 0
        self._decisions = 0

    @property
    def live(self) -> bool:
        return self.interval <= 0

    def refresh(self, now: float) -> None:
        """Before the event at `now`: a new copy when a refresh time kΔ ≤ now has passed
        since the last one (the state then is the state after every earlier event)."""
        if self.live:
            return
        tick = float(np.floor(now / self.interval) * self.interval)
        if self.snap_t is not None and tick <= self.snap_t:
            return
        self.snap_t = tick
        self.refreshes += 1
        self.snaps = [_StatusView(sim, [copy.copy(r) for r in sim.running], [copy.copy(r) for r in sim.waiting],
                                  sim.free_blocks) for sim in self.sims]
        self.snap_out = list(self.live_out)
        self.snap_busy = list(self.live_busy)
        self.snap_stepping = list(self.live_stepping)
        self.snap_arriving = [[copy.copy(r) for r in a] for a in self.live_arriving]
        for per in self.pending:  # sent before the copy: the status shows them now
            for q in per:
                q.clear()

    def views(self, sched: int, now: float) -> tuple[list[Any], list[int], list[float], list[bool],
                                                     list[list[SimRequest]]]:
        """(instances, outstanding, busy_until, stepping, arriving) as scheduler `sched`
        sees them at `now`: the status copies plus its own pending list — sent requests
        already at the engine queue join the copy's waiting queue, those still
        preprocessing its arriving list."""
        if self.live:
            return self.sims, self.live_out, self.live_busy, self.live_stepping, self.live_arriving
        views: list[Any] = []
        out, arr = [], []
        for i, v in enumerate(self.snaps):
            own = self.pending[sched][i] if self.count_pending else []
            if own:
                queued = [r for r in own if r.arrival_s <= now]
                views.append(_StatusView(v, v.running, v.waiting + queued, v.free_blocks))
                arr.append(self.snap_arriving[i] + [r for r in own if r.arrival_s > now])
            else:
                views.append(v)
                arr.append(self.snap_arriving[i])
            out.append(self.snap_out[i] + len(own))
        return views, out, self.snap_busy, self.snap_stepping, arr

    def sent(self, sched: int, i: int, sr: SimRequest) -> None:
        """Scheduler `sched` sent `sr` to instance `i` (after the instance got it)."""
        unseen = 0 if self.live else sum(len(self.pending[o][i]) for o in range(self.s) if o != sched)
        if not self.live:
            self.pending[sched][i].append(copy.copy(sr))
        self.per_sched[sched] += 1
        queues = [len(sim.waiting) + len(a) for sim, a in zip(self.sims, self.live_arriving)]
        self._spread_sum += max(queues) - min(queues)
        self._unseen_sum += unseen
        self._decisions += 1

    def summary(self) -> dict[str, Any]:
        d = max(1, self._decisions)
        return {"schedulers": self.s, "status_interval_s": self.interval, "count_pending": self.count_pending,
                "requests_per_scheduler": list(self.per_sched), "refreshes": self.refreshes,
                "queue_spread_mean": self._spread_sum / d, "unseen_sends_mean": self._unseen_sum / d}


# -- a minimal length-trace workload (the bench issue builds richer ones) ---------------
_PROMPT_COLS = ("num_prefill_tokens", "prompt_tokens", "ContextTokens", "Request tokens")
_OUTPUT_COLS = ("num_decode_tokens", "output_tokens", "GeneratedTokens", "Response tokens")


def read_length_trace(path: str | Path) -> np.ndarray:
    """(prompt_tokens, output_tokens) rows of a CSV length trace, shape (n, 2), int64.

    Accepts the Astrolabe/Vidur trace (`num_prefill_tokens,num_decode_tokens,...`), the
    Azure LLM inference trace (`ContextTokens,GeneratedTokens`), BurstGPT
    (`Request tokens,Response tokens`) or plain `prompt_tokens,output_tokens` headers.
    Rows with a non-positive prompt or output (e.g. BurstGPT failures) are dropped.

    Raises:
        AstroUserError: unreadable file, or no recognised prompt/output columns.
    """
    import csv

    p = Path(path)
    if not p.is_file():
        raise AstroUserError(f"no such trace file: {p}", field="--trace")
    with p.open(newline="") as f:
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise AstroUserError(f"{p} is empty", field="--trace") from None
        pc = next((header.index(c) for c in _PROMPT_COLS if c in header), None)
        oc = next((header.index(c) for c in _OUTPUT_COLS if c in header), None)
        if pc is None or oc is None:
            raise AstroUserError(
                f"{p}: no prompt/output token columns in header {header}", field="--trace",
                fix=f"name them one of {_PROMPT_COLS} and {_OUTPUT_COLS}",
            )
        rows = []
        for n, row in enumerate(reader, start=2):
            try:
                a, b = int(float(row[pc])), int(float(row[oc]))
            except (ValueError, IndexError):
                raise AstroUserError(f"{p}:{n}: not a number in the token columns", field="--trace") from None
            if a > 0 and b > 0:
                rows.append((a, b))
    if not rows:
        raise AstroUserError(f"{p}: no usable rows", field="--trace")
    return np.asarray(rows, dtype=np.int64)


def poisson_workload(lengths: np.ndarray, num_requests: int, rate_per_s: float, max_model_len: int,
                     rng: np.random.Generator) -> list[TimedRequest]:
    """`num_requests` text requests cycling through `lengths` rows (those with prompt +
    output ≤ max_model_len, in file order) with Poisson arrivals at `rate_per_s`
    (exponential gaps from `rng`), oracle predicted lengths.

    Raises:
        AstroUserError: rate ≤ 0, num_requests < 1, or no row fits max_model_len.
    """
    if not rate_per_s > 0:
        raise AstroUserError(f"must be > 0, got {rate_per_s}", field="--rate")
    if num_requests < 1:
        raise AstroUserError(f"must be ≥ 1, got {num_requests}", field="--num-requests")
    fit = lengths[lengths.sum(axis=1) <= max_model_len]
    if len(fit) == 0:
        raise AstroUserError(f"no trace row fits max_model_len {max_model_len}", field="--trace")
    rows = fit[np.arange(num_requests) % len(fit)]
    t = np.cumsum(rng.exponential(1.0 / rate_per_s, size=num_requests))
    return [TimedRequest(f"req-{i}", float(t[i]), int(p), int(o)) for i, (p, o) in enumerate(rows)]
