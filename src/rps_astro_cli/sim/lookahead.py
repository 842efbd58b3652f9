"""The Predictor's look-ahead: from an instance snapshot and a candidate request, predict
the candidate's TTFT and E2E (seconds from the snapshot time) by simulating the
instance's own scheduler forward (Astrolabe §4; ARCHITECTURE.md §2).

Auto-extension (Astrolabe §4): a request whose generated tokens have reached its
predicted length is assumed to end within the next `extension_tokens` tokens (10).
A request with no predicted length uses `default_output_tokens`.

`predict_stepwise` is the plain reference: it replays `InstanceSim.step` one step at a
time. The fast `predict` must return the same numbers (property-tested); its engine is
`sim/lookahead_engine/`, compiled with mypyc at install when possible (see
`sim/engine_build.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.sim.engine_build import is_native, load_engine
from rps_astro_cli.sim.instance import InstanceSim
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.policy import InstancePolicy
from rps_astro_cli.sim.prefix_cache import PrefixCache
from rps_astro_cli.sim.remaining import OnlineRemaining, RemainingLength
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.types import CandidateRequest, InstanceStatus, LatencyEstimate, RequestStatus

#: the look-ahead engine package (`sim/lookahead_engine/`): its mypyc build, or its
#: source when there is none, it is older than the source, or ASTRO_PURE_PYTHON=1
engine = load_engine()
CANDIDATE_ID: str = engine.CANDIDATE_ID
MAX_LOOKAHEAD_STEPS: int = engine.MAX_LOOKAHEAD_STEPS
#: True when the mypyc build of the look-ahead engine is in use.
NATIVE: bool = is_native(engine)


def expected_output_tokens(r: RequestStatus, extension_tokens: int, default_output_tokens: int,
                           remaining: RemainingLength | OnlineRemaining | None = None,
                           max_model_len: int | None = None) -> int:
    """Output length the look-ahead assumes for a queued/running request (tokens):
    its predicted length, or `generated + extension_tokens` once it has reached that;
    with `remaining`, its conditional estimate given the tokens already generated
    (`RemainingLength.expected_total`, capped at max_model_len − prompt)."""
    if remaining is not None:
        cap = None if max_model_len is None else max_model_len - r.prompt_tokens
        return remaining.expected_total(r.predicted_output_tokens, r.generated_tokens, cap)
    return int(engine.expected_tokens(r.predicted_output_tokens, r.generated_tokens, extension_tokens,
                                    default_output_tokens))


def _status_computed(r: RequestStatus) -> int:
    """Computed tokens the look-ahead starts `r` with: a request not yet admitted starts
    past its prefix-cache hit (`cached_tokens`; at least one token left to compute)."""
    if r.cached_tokens > 0 and r.kv_blocks == 0 and r.num_computed_tokens == 0:
        return min(r.cached_tokens, r.prompt_tokens + r.generated_tokens - 1)
    return r.num_computed_tokens


def _to_sim(r: RequestStatus, target: int) -> SimRequest:
    return SimRequest(
        request_id=r.request_id,
        arrival_s=r.arrival_s,
        prompt_tokens=r.prompt_tokens,
        target_output_tokens=target,
        modality=r.modality,
        vision_tokens=r.vision_tokens,
        encoder_s=r.encoder_s,
        req_class=r.req_class,
        predicted_output_tokens=r.predicted_output_tokens,
        deadline_s=r.deadline_s,
        num_computed_tokens=_status_computed(r),
        num_generated_tokens=r.generated_tokens,
        kv_blocks=r.kv_blocks,
    )


def candidate_to_sim(c: CandidateRequest, now_s: float, first_token_only: bool = False) -> SimRequest:
    """The candidate as a fresh `SimRequest` arriving at `now_s + preprocess_s`;
    `first_token_only`: it ends with its first token (its predicted length still orders
    it for a policy that reads lengths)."""
    if c.prompt_tokens <= 0 or c.predicted_output_tokens <= 0:
        raise AstroUserError(
            "prompt_tokens and predicted_output_tokens must be ≥ 1", field="candidate"
        )
    return SimRequest(
        request_id=CANDIDATE_ID,
        arrival_s=now_s + c.preprocess_s,
        prompt_tokens=c.prompt_tokens,
        target_output_tokens=1 if first_token_only else c.predicted_output_tokens,
        modality=c.modality,
        vision_tokens=c.vision_tokens,
        encoder_s=c.encoder_s,
        req_class=c.req_class,
        predicted_output_tokens=c.predicted_output_tokens,
        deadline_s=c.deadline_s,
        # a prefix-cache hit: its prefill starts past the cached tokens; it still allocates
        # every block (a hit on a free cached block takes it from the free pool; a block
        # shared with a running request is counted again, which errs towards later)
        num_computed_tokens=min(max(0, c.cached_tokens), c.prompt_tokens - 1),
    )


def _check_fits(candidate: CandidateRequest, max_model_len: int) -> None:
    """Raise AstroUserError (field "candidate") when prompt + predicted output exceeds
    `max_model_len` (tokens): no instance could ever hold the request."""
    total = candidate.prompt_tokens + candidate.predicted_output_tokens
    if total > max_model_len:
        raise AstroUserError(
            f"prompt + output = {total} tokens exceeds max_model_len {max_model_len}",
            field="candidate",
        )


def build_sim(
    status: InstanceStatus,
    latency: LatencyModel,
    policy: InstancePolicy,
    extension_tokens: int = 10,
    default_output_tokens: int = 256,
    remaining: RemainingLength | OnlineRemaining | None = None,
) -> InstanceSim:
    """An `InstanceSim` holding the snapshot's running and waiting requests (prefix
    caching off, as in the jump look-ahead: the candidate's hit comes as computed tokens)."""
    sim = InstanceSim(replace(status.limits, enable_prefix_caching=False), latency, policy)
    mx = status.limits.max_model_len
    ext, dflt = extension_tokens, default_output_tokens
    sim.running = [_to_sim(r, expected_output_tokens(r, ext, dflt, remaining, mx)) for r in status.running]
    sim.waiting = [_to_sim(r, expected_output_tokens(r, ext, dflt, remaining, mx)) for r in status.waiting]
    sim.free_blocks = status.kv_blocks_free
    return sim


def _ready_s(r: RequestStatus, now_s: float) -> float:
    """When an arriving request joins the queue: its `ready_s` (now when unset or past)."""
    return r.ready_s if r.ready_s is not None and r.ready_s > now_s else now_s


def arrivals_order(ready_s: Sequence[float], requests: Sequence[Any], candidate: Any) -> list[tuple[float, Any]]:
    """The future queue arrivals of a look-ahead in the order they join the queue:
    (time s, request) for `requests` (still in preprocessing, ready at `ready_s`) and
    the candidate (at its `arrival_s`). By time; on a tie the requests already in
    preprocessing (submitted earlier) go first, in their order."""
    n = len(requests)
    events = sorted([(t, i) for i, t in enumerate(ready_s)] + [(candidate.arrival_s, n)])
    return [(t, candidate if i == n else requests[i]) for t, i in events]


def predict_stepwise(
    status: InstanceStatus,
    candidate: CandidateRequest,
    latency: LatencyModel,
    policy: InstancePolicy,
    *,
    extension_tokens: int = 10,
    default_output_tokens: int = 256,
    remaining: RemainingLength | OnlineRemaining | None = None,
    first_token_only: bool = False,
) -> LatencyEstimate:
    """Reference look-ahead: step `InstanceSim` until the candidate finishes. Requests
    still in preprocessing (`status.arriving`) and the candidate join the queue at their
    ready times (`arrivals_order`). `first_token_only`: as `predict`'s.

    Raises:
        AstroUserError: the candidate cannot fit the instance at all.
        RuntimeError: no progress within MAX_LOOKAHEAD_STEPS (a model bug).
    """
    sim = build_sim(status, latency, policy, extension_tokens, default_output_tokens, remaining)
    cfg = status.limits
    _check_fits(candidate, cfg.max_model_len)
    cand = candidate_to_sim(candidate, status.time_s, first_token_only)
    ext, dflt = extension_tokens, default_output_tokens
    mx = cfg.max_model_len
    arriving = [_to_sim(r, expected_output_tokens(r, ext, dflt, remaining, mx)) for r in status.arriving]
    pending = arrivals_order([_ready_s(r, status.time_s) for r in status.arriving], arriving, cand)
    t = status.time_s
    added = False
    steps = 0
    while cand.finish_s is None:
        while pending and t >= pending[0][0]:
            sim.add(pending.pop(0)[1])
        added = not pending
        res = sim.step(t)
        if res.scheduled:
            t += res.duration_s
            steps += 1
        elif res.preempted:
            # the running pass preempted the request it was serving (vLLM V1 then stops
            # the pass) and nothing else ran: no time passes, the next step goes on
            pass
        elif not added:
            t = pending[0][0]
        else:
            raise RuntimeError("look-ahead made no progress (instance cannot admit any request)")
        if steps > MAX_LOOKAHEAD_STEPS:
            raise RuntimeError("look-ahead exceeded MAX_LOOKAHEAD_STEPS")
    assert cand.first_token_s is not None
    return LatencyEstimate(
        ttft_s=cand.first_token_s - status.time_s,
        e2e_s=cand.finish_s - status.time_s,
        steps_simulated=steps,
        events=steps,
    )


def predict(
    status: InstanceStatus,
    candidate: CandidateRequest,
    latency: LatencyModel,
    policy: InstancePolicy,
    *,
    extension_tokens: int = 10,
    default_output_tokens: int = 256,
    remaining: RemainingLength | OnlineRemaining | None = None,
    first_token_only: bool = False,
) -> LatencyEstimate:
    """Jump look-ahead: the candidate's predicted TTFT and E2E on this instance, equal to
    `predict_stepwise` (up to float rounding of summed step times), in O(events) rather
    than O(steps) (Astrolabe §4 predictor; ARCHITECTURE.md §2; see sim/lookahead_engine/).

    status: the instance snapshot (its `limits` give the batching rules; `time_s` is
        "now"). candidate: the request being placed; it joins the waiting queue at
        `time_s + candidate.preprocess_s`. latency: the memoized step-latency model.
    policy: the instance's local policy (waiting order, preemption victim). For a
        `time_dependent` policy a decode run is jumped only while admission is blocked
        by `max_num_seqs`/the token budget or the queue is empty.
    extension_tokens / default_output_tokens: the auto-extension rule (tokens), see
        `expected_output_tokens`. remaining: the conditional remaining-length rule
        (`sim.remaining`) instead of auto-extension, for queued/running/arriving requests.
    first_token_only: stop at the candidate's first token (it is simulated as a request
        of one output token): the same TTFT — nothing before a request's first token
        depends on how long it then decodes — for a fraction of the work when the
        instance is busy; the estimate's `e2e_s` then equals its `ttft_s` (for a caller
        that ranks by TTFT and has no length for the candidate yet: an early decision).

    Returns a `LatencyEstimate` in seconds from `status.time_s`; `events` counts loop
    iterations (jumps + individually simulated steps).

    Raises:
        AstroUserError: the candidate is empty or longer than max_model_len.
        RuntimeError: the instance can never admit the candidate (no progress), or more
            than MAX_LOOKAHEAD_STEPS steps.
    """
    cfg = status.limits
    _check_fits(candidate, cfg.max_model_len)
    cand = engine.lreq_candidate(candidate_to_sim(candidate, status.time_s, first_token_only))
    ext, dflt = extension_tokens, default_output_tokens
    running = _lreqs_from_status(status.running, ext, dflt, remaining, cfg.max_model_len)
    waiting = _lreqs_from_status(status.waiting, ext, dflt, remaining, cfg.max_model_len)
    pending = None
    if status.arriving:
        arriving = _lreqs_from_status(status.arriving, ext, dflt, remaining, cfg.max_model_len)
        pending = arrivals_order([_ready_s(r, status.time_s) for r in status.arriving], arriving, cand)
    lp = engine.FastLookahead(cfg, latency, policy, running, waiting, status.kv_blocks_free).run(
        cand, status.time_s, pending)
    return LatencyEstimate(lp.ttft_s, lp.e2e_s, lp.steps, lp.events)


def _lreqs_from_status(reqs: Sequence[RequestStatus], ext: int, dflt: int,
                       remaining: RemainingLength | OnlineRemaining | None, max_model_len: int) -> list[Any]:
    """`engine.lreqs_from_status`, or with `remaining` each target its conditional estimate;
    a request not yet admitted starts past its `cached_tokens` (`_status_computed`)."""
    if remaining is None:
        return cast(list[Any], engine.lreqs_from_status(reqs, ext, dflt))
    return [engine.LReq(r.request_id, r.arrival_s, r.prompt_tokens,
                      expected_output_tokens(r, ext, dflt, remaining, max_model_len),
                      r.modality, r.vision_tokens, r.encoder_s, r.req_class, r.predicted_output_tokens,
                      r.deadline_s, _status_computed(r), r.generated_tokens, r.kv_blocks) for r in reqs]


def _lreqs_from_sim(reqs: Sequence[SimRequest], ext: int, dflt: int,
                    remaining: RemainingLength | OnlineRemaining | None, max_model_len: int) -> list[Any]:
    """`engine.lreqs_from_sim`, or with `remaining` each target its conditional estimate
    (`RemainingLength.expected_total`, capped at max_model_len − prompt)."""
    if remaining is None:
        return cast(list[Any], engine.lreqs_from_sim(reqs, ext, dflt))
    return [engine.LReq(r.request_id, r.arrival_s, r.prompt_tokens,
                      remaining.expected_total(r.predicted_output_tokens, r.num_generated_tokens,
                                               max_model_len - r.prompt_tokens),
                      r.modality, r.vision_tokens, r.encoder_s, r.req_class, r.predicted_output_tokens,
                      r.deadline_s, r.num_computed_tokens, r.num_generated_tokens, r.kv_blocks) for r in reqs]


def _credit_hits(lreqs: Sequence[Any], reqs: Sequence[SimRequest], cache: PrefixCache, block_size: int) -> None:
    """Each of `reqs` not yet admitted (no blocks, nothing computed) with block hashes
    starts its look-ahead prefill past its prefix-cache hit now: its look-ahead twin in
    `lreqs` gets the hit as computed tokens (at least one token left to compute, as at
    admission). Like the candidate's hit, its blocks are still all allocated (errs
    towards later), and a block evicted before its admission is still counted a hit."""
    for lr, r in zip(lreqs, reqs):
        h = r.block_hashes
        if h and r.kv_blocks == 0 and r.num_computed_tokens == 0:
            n = cache.lookup(h, (r.prompt_tokens + r.num_generated_tokens - 1) // block_size)[0]
            if n:
                lr.num_computed_tokens = n * block_size


def predict_instance(
    inst: InstanceSim,
    now_s: float,
    candidate: CandidateRequest,
    *,
    policy: InstancePolicy | None = None,
    arriving: list[SimRequest] | tuple[SimRequest, ...] = (),
    extension_tokens: int = 10,
    default_output_tokens: int = 256,
    remaining: RemainingLength | OnlineRemaining | None = None,
    waiting_hits: bool = True,
    latency: LatencyModel | None = None,
) -> LatencyEstimate:
    """`predict(snapshot("", now_s, inst), candidate, latency or inst.latency, policy or inst.policy)`
    without building the snapshot: for the virtual cluster, which holds `InstanceSim`s.

    arriving: requests dispatched to the instance but still in preprocessing; each
    joins the queue at its `arrival_s` (the virtual cluster's enqueue time).
    The look-ahead sees each request's `predicted_output_tokens` (never its true
    `target_output_tokens`), as a Predictor reading `/status` does. Same errors as
    `predict`.
    remaining: when given, queued/running requests' output length is its conditional
    estimate given the tokens already generated (`sim.remaining`) instead of the
    auto-extension rule; the candidate keeps its predicted length.
    waiting_hits: a waiting or arriving request not yet admitted starts its prefill past
    its prefix-cache hit on the instance now (as the candidate does with
    `cached_tokens`); False = it prefills its whole prompt.
    latency: the step model the Predictor assumes (None: the instance's own, i.e. a
    Predictor whose model is exactly its engine).
    """
    cfg = inst.config
    _check_fits(candidate, cfg.max_model_len)
    cand = engine.lreq_candidate(candidate_to_sim(candidate, now_s))
    ext, dflt = extension_tokens, default_output_tokens
    running = _lreqs_from_sim(inst.running, ext, dflt, remaining, cfg.max_model_len)
    waiting = _lreqs_from_sim(inst.waiting, ext, dflt, remaining, cfg.max_model_len)
    cache = inst.cache if waiting_hits else None
    if cache is not None:
        _credit_hits(waiting, inst.waiting, cache, cfg.block_size)
    pending = None
    if arriving:
        arr = _lreqs_from_sim(arriving, ext, dflt, remaining, cfg.max_model_len)
        if cache is not None:
            _credit_hits(arr, arriving, cache, cfg.block_size)
        pending = arrivals_order([max(r.arrival_s, now_s) for r in arriving], arr, cand)
    lp = engine.FastLookahead(cfg, latency or inst.latency, policy or inst.policy, running, waiting,
                              inst.free_blocks).run(
        cand, now_s, pending)
    return LatencyEstimate(lp.ttft_s, lp.e2e_s, lp.steps, lp.events)
