"""The Predictor's look-ahead: from an instance snapshot and a candidate request, predict
the candidate's TTFT and E2E (seconds from the snapshot time) by simulating the
instance's own scheduler forward (Astrolabe §4; DESIGN.md §2).

Auto-extension (Astrolabe §4): a request whose generated tokens have reached its
predicted length is assumed to end within the next `extension_tokens` tokens (10).
A request with no predicted length uses `default_output_tokens`.

`predict_stepwise` is the plain reference: it replays `InstanceSim.step` one step at a
time. The fast `predict` must return the same numbers (property-tested).
"""

from __future__ import annotations

from dataclasses import dataclass

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.policies.base import InstancePolicy
from rps_astro_cli.sim.instance import InstanceSim
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.status import InstanceStatus, RequestStatus

CANDIDATE_ID = "__candidate__"
MAX_LOOKAHEAD_STEPS = 2_000_000


@dataclass(frozen=True)
class CandidateRequest:
    """The request being placed.

    prompt_tokens: prompt length incl. vision tokens (tokens).
    predicted_output_tokens: the tagger's predicted output length (tokens, ≥ 1).
    modality: text / image / video. vision_tokens: tokens from media (informational).
    encoder_s: vision-encoder seconds charged to its first prefill step.
    preprocess_s: CPU preprocessing seconds before it reaches the engine queue.
    req_class: sand / pebbles / rocks when classified, else None.
    """

    prompt_tokens: int
    predicted_output_tokens: int
    modality: str = "text"
    vision_tokens: int = 0
    encoder_s: float = 0.0
    preprocess_s: float = 0.0
    req_class: str | None = None
    deadline_s: float | None = None


@dataclass(frozen=True)
class LatencyEstimate:
    """Predicted latencies of the candidate, in seconds from the snapshot time.

    ttft_s: until its first output token. e2e_s: until its last token.
    steps_simulated: engine steps the look-ahead advanced (jumps count their steps).
    events: loop iterations the look-ahead ran (equals steps for the stepwise one).
    """

    ttft_s: float
    e2e_s: float
    steps_simulated: int
    events: int


def expected_output_tokens(r: RequestStatus, extension_tokens: int, default_output_tokens: int) -> int:
    """Output length the look-ahead assumes for a queued/running request (tokens):
    its predicted length, or `generated + extension_tokens` once it has reached that."""
    pred = r.predicted_output_tokens if r.predicted_output_tokens else default_output_tokens
    if r.generated_tokens >= pred:
        return r.generated_tokens + extension_tokens
    return pred


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
        num_computed_tokens=r.computed_tokens,
        num_generated_tokens=r.generated_tokens,
        kv_blocks=r.kv_blocks,
    )


def candidate_to_sim(c: CandidateRequest, now_s: float) -> SimRequest:
    """The candidate as a fresh `SimRequest` arriving at `now_s + preprocess_s`."""
    if c.prompt_tokens <= 0 or c.predicted_output_tokens <= 0:
        raise AstroUserError(
            "prompt_tokens and predicted_output_tokens must be ≥ 1", field="candidate"
        )
    return SimRequest(
        request_id=CANDIDATE_ID,
        arrival_s=now_s + c.preprocess_s,
        prompt_tokens=c.prompt_tokens,
        target_output_tokens=c.predicted_output_tokens,
        modality=c.modality,
        vision_tokens=c.vision_tokens,
        encoder_s=c.encoder_s,
        req_class=c.req_class,
        predicted_output_tokens=c.predicted_output_tokens,
        deadline_s=c.deadline_s,
    )


def build_sim(
    status: InstanceStatus,
    latency: LatencyModel,
    policy: InstancePolicy,
    extension_tokens: int = 10,
    default_output_tokens: int = 256,
) -> InstanceSim:
    """An `InstanceSim` holding the snapshot's running and waiting requests."""
    sim = InstanceSim(status.limits, latency, policy)
    sim.running = [
        _to_sim(r, expected_output_tokens(r, extension_tokens, default_output_tokens)) for r in status.running
    ]
    sim.waiting = [
        _to_sim(r, expected_output_tokens(r, extension_tokens, default_output_tokens)) for r in status.waiting
    ]
    sim.free_blocks = status.kv_blocks_free
    return sim


def predict_stepwise(
    status: InstanceStatus,
    candidate: CandidateRequest,
    latency: LatencyModel,
    policy: InstancePolicy,
    *,
    extension_tokens: int = 10,
    default_output_tokens: int = 256,
) -> LatencyEstimate:
    """Reference look-ahead: step `InstanceSim` until the candidate finishes.

    Raises:
        AstroUserError: the candidate cannot fit the instance at all.
        RuntimeError: no progress within MAX_LOOKAHEAD_STEPS (a model bug).
    """
    sim = build_sim(status, latency, policy, extension_tokens, default_output_tokens)
    cfg = status.limits
    if candidate.prompt_tokens + candidate.predicted_output_tokens > cfg.max_model_len:
        raise AstroUserError(
            f"prompt + output = {candidate.prompt_tokens + candidate.predicted_output_tokens} "
            f"tokens exceeds max_model_len {cfg.max_model_len}", field="candidate",
        )
    cand = candidate_to_sim(candidate, status.time_s)
    t = status.time_s
    added = False
    steps = 0
    while cand.finish_s is None:
        if not added and t >= cand.arrival_s:
            sim.add(cand)
            added = True
        res = sim.step(t)
        if res.scheduled:
            t += res.duration_s
            steps += 1
        elif not added:
            t = cand.arrival_s
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
