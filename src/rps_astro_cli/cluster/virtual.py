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
  preprocessing when a slot frees (`ClusterRecord.preprocess_start_s`, the engine's
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

import functools
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from rps_astro_cli.cluster.instance import VirtualInstance
from rps_astro_cli.cluster.views import _Herding, _LiveSeen, _Seen
from rps_astro_cli.cluster.workload import TimedRequest
from rps_astro_cli.dispatch.admission import (
    DEFAULT_ADMISSION,
    NO_ROOM,
    QUEUE_FULL,
    REFUSED_TTFT,
    Admission,
    RouterQueue,
    remaining_slo,
)
from rps_astro_cli.dispatch.base import DispatchPolicy, decide
from rps_astro_cli.dispatch.loads import DispatchRequest, loads_for
from rps_astro_cli.dispatch.outcome import OutcomeCorrection
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.sim.calibration import StepCalibrator, StepSample
from rps_astro_cli.sim.fcfs import FCFSPolicy
from rps_astro_cli.sim.instance import InstanceSim
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.lookahead import predict_instance
from rps_astro_cli.sim.policy import InstancePolicy
from rps_astro_cli.sim.prefix_cache import block_hashes
from rps_astro_cli.sim.profile import ExecutionProfile
from rps_astro_cli.sim.remaining import OnlineRemaining, RemainingLength
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.types import CandidateRequest, InstanceConfig, LatencyEstimate

_ARRIVAL, _ENQUEUE, _STEP_END, _RETRY = 0, 1, 2, 3


@dataclass(slots=True)
class ClusterRecord:
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

    records: list[ClusterRecord]
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
    # with calibration online: each instance's outcome correction at the end (`dispatch.outcome`)
    outcome_correction: dict[str, Any] | None = None

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
    # each instance's Predictor: its step model (None: the engine's own) and, with
    # `calibration`, its calibrator (which holds the model in force)
    cals = None if calibration is None else [
        StepCalibrator((plats[i] if plats is not None else lats[i]).profile, learn=calibration == "online")
        for i in range(num_instances)]
    instances = [
        VirtualInstance(i, sims[i], cfgs[i], None if cals is None else cals[i], None if plats is None else plats[i],
                        [0.0] * preprocess_slots if preprocess_slots else None)
        for i in range(num_instances)]
    # online: the Predictors' estimates are also corrected by what each instance's requests took
    outcomes = OutcomeCorrection() if calibration == "online" else None
    run = _Run(requests, instances, schedulers, rng, cfg, admission, status_interval_s, count_pending,
               extension_tokens=extension_tokens, default_output_tokens=default_output_tokens, remaining=remaining,
               waiting_hits=waiting_hits, outcomes=outcomes)
    return run.run()


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


class _Run:
    """One `simulate_cluster` run: the instances (`VirtualInstance`), the event heap and
    one method per event kind (`_arrival`, `_enqueue`, `_step_end`, `_retry`; module
    docstring). Heap entries are (time, kind, sequence, x): x is the request's index for
    an arrival or an enqueue, the instance's for a step end."""

    def __init__(self, requests: Sequence[TimedRequest], instances: list[VirtualInstance],
                 schedulers: list[DispatchPolicy], rng: np.random.Generator, cfg: InstanceConfig,
                 admission: Admission | None, status_interval_s: float, count_pending: bool, *,
                 extension_tokens: int, default_output_tokens: int,
                 remaining: RemainingLength | OnlineRemaining | None, waiting_hits: bool,
                 outcomes: OutcomeCorrection | None = None):
        self.requests, self.instances, self.schedulers, self.rng = requests, instances, schedulers, rng
        # `dispatch.outcome` (calibration online): corrections by served latencies, fed as requests
        # end; the chosen instance's raw estimate of each request until then
        self.outcomes = outcomes
        self.raw_pred: dict[int, tuple[float, float]] = {}
        self.dispatch = schedulers[0]  # the latest arrival's scheduler (`ClusterResult.dispatch` describes it)
        self.bs, self.max_len = cfg.block_size, cfg.max_model_len
        self.admission = admission
        self.extension_tokens, self.default_output_tokens = extension_tokens, default_output_tokens
        self.remaining, self.waiting_hits = remaining, waiting_hits
        self.learn = getattr(remaining, "observe", None)  # an online table learns from finished requests
        self.inputs = frozenset().union(*(d.inputs for d in schedulers))
        self.last_instance: dict[str, int] = {}  # session → instance of its latest turn
        # each instance as this process's scheduler sees it (dispatch.loads.InstanceView)
        self.own_views = [_LiveSeen(inst, self.last_instance) for inst in instances]
        self.herd = _Herding(self.own_views, len(schedulers), status_interval_s, count_pending) \
            if len(schedulers) > 1 or status_interval_s > 0 else None
        self.n_arrived = 0
        # admission mode "queue": the held requests (indices), when each first arrived
        self.router_q = RouterQueue(admission.queue_max) if admission is not None and admission.mode == "queue" \
            else None
        self.first_arrival: dict[int, float] = {}
        self.retry_due = False
        n = len(requests)
        self.records: list[ClusterRecord | None] = [None] * n
        self.sim_reqs: list[SimRequest | None] = [None] * n
        self.heap: list[tuple[float, int, int, int]] = []
        self.followers: dict[str, list[int]] = {}
        for idx, r in enumerate(requests):
            if r.follows is None:
                self.heap.append((r.arrival_s, _ARRIVAL, idx, idx))
            else:
                self.followers.setdefault(r.follows, []).append(idx)
        self.seq = n
        heapq.heapify(self.heap)
        self.index_of: dict[int, int] = {}
        self.makespan = 0.0

    def run(self) -> ClusterResult:
        t_wall = time.perf_counter()
        heap, herd = self.heap, self.herd
        arrival, enqueue, step_end, retry = self._arrival, self._enqueue, self._step_end, self._retry
        while heap:
            now, kind, _s, x = heapq.heappop(heap)
            if herd is not None:
                herd.refresh(now)
            if kind == _STEP_END:
                step_end(now, x)
            elif kind == _ENQUEUE:
                enqueue(now, x)
            elif kind == _RETRY:
                retry(now)
            else:
                arrival(now, x)
        out = [r for r in self.records if r is not None]
        assert len(out) == len(self.requests)
        insts = self.instances
        return ClusterResult(
            records=out,
            preemptions_per_instance=[inst.sim.num_preemptions_total for inst in insts],
            steps_per_instance=[inst.sim.num_steps_total for inst in insts],
            requests_per_instance=[inst.dispatched for inst in insts],
            makespan_s=self.makespan,
            wall_s=time.perf_counter() - t_wall,
            dispatch=self.dispatch.describe(),
            prefix_cache_queries_tokens=sum(inst.sim.prefix_cache_queries_tokens for inst in insts),
            prefix_cache_hits_tokens=sum(inst.sim.prefix_cache_hits_tokens for inst in insts),
            herding=herd.summary() if herd is not None else None,
            calibration=None if insts[0].calibrator is None
            else [inst.calibrator.state().to_dict() for inst in insts if inst.calibrator is not None],
            outcome_correction=None if self.outcomes is None else self.outcomes.state(),
        )

    def _push(self, t: float, kind: int, x: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, kind, self.seq, x))

    # -- an instance's steps ----------------------------------------------------------
    def _wake(self, inst: VirtualInstance, now: float) -> None:
        # an idle instance forms its next step at `now`, after every arrival and
        # enqueue of that same instant (event kind order)
        inst.stepping = True
        inst.busy_until = now
        self._push(now, _STEP_END, inst.index)

    def _step_end(self, now: float, i: int) -> None:
        """Instance `i`'s step completes (or an idle instance is woken): its finished
        requests are recorded (their next turns scheduled) and its next step starts at
        once if work remains."""
        inst = self.instances[i]
        fin = inst.pending_finished
        if fin:
            inst.outstanding -= len(fin)
            learn, records, index_of, requests = self.learn, self.records, self.index_of, self.requests
            outcomes = self.outcomes
            for sr in fin:
                if learn is not None:  # the scheduler sees the true length when a request ends
                    learn(sr.predicted_output_tokens, sr.num_generated_tokens)
                x = index_of[id(sr)]
                rec = records[x]
                assert rec is not None
                rec.first_scheduled_s = sr.first_scheduled_s
                rec.first_token_s = sr.first_token_s
                rec.finish_s = sr.finish_s
                raw = self.raw_pred.pop(x, None) if outcomes is not None else None
                if raw is not None and sr.first_token_s is not None and sr.finish_s is not None:
                    assert outcomes is not None
                    served = (sr.first_token_s - rec.dispatch_s, sr.finish_s - rec.dispatch_s)
                    outcomes.observe(rec.instance, raw, served)
                rec.num_preemptions = sr.num_preemptions
                rec.req_class = sr.req_class  # the class the instance policy used
                rec.cached_tokens = sr.num_cached_tokens
                for nxt in self.followers.get(sr.request_id, ()):
                    # the next turn: after the reply plus the think time
                    self._push(now + requests[nxt].think_s, _ARRIVAL, nxt)
            self.makespan = now
        inst.pending_finished = []
        # the next step, formed at once (`InstanceSim.step`)
        res = inst.sim.step(now)
        cal = inst.calibrator
        if cal is not None and res.scheduled:  # the Predictor learns from its engine's step
            cal.observe(StepSample.of(res.shape, res.duration_s))
        if res.scheduled:
            end = now + res.duration_s
            inst.busy_until = end
            inst.stepping = True
            inst.pending_finished = res.finished
            self.seq += 1
            heapq.heappush(self.heap, (end, _STEP_END, self.seq, i))
        elif res.preempted:
            # the pass preempted the request it served and nothing ran (vLLM V1 stops
            # the pass); the next step forms at once
            self._wake(inst, now)
        else:
            inst.stepping = False

    def _enqueue(self, now: float, x: int) -> None:
        """Request `x` reaches its instance's waiting queue (its preprocessing is done)."""
        inst = self.instances[self.records[x].instance]  # type: ignore[union-attr]
        sr = self.sim_reqs[x]
        assert sr is not None
        inst.arriving.remove(sr)
        sr.arrival_s = now
        inst.sim.add(sr)
        if not inst.stepping:
            self._wake(inst, now)

    def _retry(self, now: float) -> None:
        """The router queue's turn: its requests arrive again, in its order."""
        self.retry_due = False
        assert self.router_q is not None
        for q in self.router_q.take_all():
            self._push(now, _ARRIVAL, q)

    # -- dispatch -----------------------------------------------------------------------
    def _pred_len(self, req: TimedRequest) -> int:
        pred_len = req.predicted_output_tokens if req.predicted_output_tokens is not None else req.output_tokens
        return max(1, min(int(pred_len), self.max_len - req.prompt_tokens))

    def _arrival(self, now: float, x: int) -> None:
        """Request `x` reaches the dispatcher: the scheduler whose turn it is decides
        (admission first, for a request with an SLO); it is refused, held in the router
        queue, or sent to its instance's front end."""
        requests, bs = self.requests, self.bs
        req = requests[x]
        arrived = self.first_arrival.setdefault(x, now) if self.router_q is not None else now
        slo = req.slo
        if arrived < now:  # back from the router queue: what is left of its TTFT target
            assert slo is not None
            slo = remaining_slo(slo, arrived, now)
        sched = self.n_arrived % len(self.schedulers)  # a round-robin Service in front of the scheduler replicas
        self.n_arrived += 1
        dispatch = self.dispatch = self.schedulers[sched]
        pred_len = self._pred_len(req)
        t0 = time.perf_counter()
        hashes = block_hashes(req.token_ids, bs) if req.token_ids else ()
        # what this scheduler sees: the live instances, or (stale status) the copies + its pending list
        herd = self.herd
        seen = self.own_views if herd is None else herd.views(sched, now)
        loads = loads_for(seen, DispatchRequest(req.prompt_tokens, hashes, bs, req.session_id), self.inputs)
        preds: dict[int, LatencyEstimate] = {}  # the Predictors' own estimates
        used: dict[int, LatencyEstimate] = {}  # what the dispatch compared (outcome-corrected)
        untrusted: list[int] = []
        predict = functools.partial(self._predict, req, pred_len, now, hashes, seen, preds, untrusted, used)
        if slo is None and req.slo is not None:  # its deadline passed in the router queue
            decision = None
            refused: str | None = REFUSED_TTFT
        else:
            decision = decide(dispatch, loads, self.rng, predict, slo, self.admission)
            refused = decision.refused
        decide_us = (time.perf_counter() - t0) * 1e6
        slo_class = req.slo.slo_class if req.slo is not None else None
        if refused == NO_ROOM:  # queue mode: in time, no room now: hold it
            router_q = self.router_q
            assert router_q is not None and req.slo is not None and req.slo.ttft_s is not None
            shed = router_q.offer(x, req.slo.priority, arrived + req.slo.ttft_s)
            if not self.retry_due:
                self.retry_due = True
                self._push(now + self.admission.queue_retry_s, _RETRY, -1)  # type: ignore[union-attr]
            if shed is None:
                return
            x, req, refused = shed, requests[shed], QUEUE_FULL
            slo_class = req.slo.slo_class if req.slo is not None else None
            arrived = self.first_arrival.get(x, now)
            pred_len = self._pred_len(req)
        if refused is not None:
            self.records[x] = ClusterRecord(
                req.request_id, -1, arrived, now, now, None, None, None, req.prompt_tokens, req.output_tokens,
                pred_len, 0, req.modality, req.req_class, decide_us=decide_us, session_id=req.session_id,
                refused=refused, slo_class=slo_class)
            for nxt in self.followers.get(req.request_id, ()):
                # a refused turn ends now; the next one follows after its think time
                self._push(now + requests[nxt].think_s, _ARRIVAL, nxt)
            return
        assert decision is not None
        i = decision.choice
        inst = self.instances[i]
        chosen = used.get(i)
        raw = preds.get(i)
        if self.outcomes is not None and raw is not None:
            self.raw_pred[x] = (raw.ttft_s, raw.e2e_s)
        inst.outstanding += 1
        inst.dispatched += 1
        pre_start = now
        slots = inst.frontend
        if slots is not None:  # FIFO: the earliest-free slot of the chosen instance's front end
            j = slots.index(min(slots))
            pre_start = max(now, slots[j])
            slots[j] = pre_start + req.preprocess_s
        enqueue_s = pre_start + req.preprocess_s
        if req.session_id is not None:
            self.last_instance[req.session_id] = i
        waited = now - arrived  # in the router queue (queue mode), else 0
        self.records[x] = ClusterRecord(
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
        self.sim_reqs[x] = sr
        self.index_of[id(sr)] = x
        if enqueue_s > now:
            self._push(enqueue_s, _ENQUEUE, x)
            inst.arriving.append(sr)  # what a Predictor sees as `arriving` until then
        else:
            inst.sim.add(sr)
            if not inst.stepping:
                self._wake(inst, now)
        if herd is not None:
            herd.sent(sched, i, sr)

    def _predict(self, req: TimedRequest, pred_len: int, now: float, hashes: tuple[int, ...],
                 seen: Sequence[_Seen | _LiveSeen], preds: dict[int, LatencyEstimate], untrusted: list[int],
                 used: dict[int, LatencyEstimate], cands: list[int]) -> dict[int, LatencyEstimate]:
        """`decide`'s predict stage for `req` at `now`: the jump look-ahead of each
        candidate as the scheduler sees it (`seen`), in seconds from now, into `preds`;
        an untrusted Predictor (`calibration`) is not asked, its index goes to `untrusted`."""
        bs = self.bs
        max_hit = (req.prompt_tokens - 1) // bs
        cand = CandidateRequest(req.prompt_tokens, pred_len, req.modality, req.vision_tokens,
                                req.encoder_s, req.preprocess_s, req.req_class, req.deadline_s)
        for i in cands:
            inst = self.instances[i]
            plat = inst.predictor_latency
            cal = inst.calibrator
            if cal is not None:
                if not cal.trusted:  # its model is off: not asked, load decides for it
                    untrusted.append(i)
                    continue
                plat = cal.latency
            s = seen[i]
            busy_until = s.busy_until
            t_snap = busy_until if s.stepping and busy_until > now else now
            c = cand
            pre_i = req.preprocess_s
            if inst.frontend is not None:  # the wait for a front-end slot, then its own preprocessing
                pre_i += max(0.0, min(inst.frontend) - now)
                cand = c = replace(cand, preprocess_s=pre_i)
            cache = inst.sim.cache
            if hashes and cache is not None:  # the candidate's prefix-cache hit there
                hit = cache.lookup(hashes, max_hit)[0] * bs
                if hit:
                    c = replace(c, cached_tokens=hit)
            if t_snap > now:  # from the step's end: keeps the hit set above
                c = replace(c, preprocess_s=max(0.0, now + pre_i - t_snap))
            est = predict_instance(s.sim, t_snap, c, arriving=s.arriving, extension_tokens=self.extension_tokens,
                                   default_output_tokens=self.default_output_tokens, remaining=self.remaining,
                                   waiting_hits=self.waiting_hits, latency=plat)
            shift = t_snap - now
            preds[i] = LatencyEstimate(est.ttft_s + shift, est.e2e_s + shift,
                                       est.steps_simulated, est.events)
        outcomes = self.outcomes
        used.update(preds if outcomes is None else {i: outcomes.correct(i, p) for i, p in preds.items()})
        return used
