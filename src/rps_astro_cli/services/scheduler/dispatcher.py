"""Choosing an instance for one request: the scheduler's only contact with `dispatch/`.

`dispatch.decide_async` runs the policy's pipeline: filters and sampler (power-of-k: k
distinct healthy instances), then for prediction-guided policies the candidates'
predictions (`PredictClient`, deadline `predict_deadline_s`; late or failed ones are
absent), then scorers and picker (falling back to least outstanding requests when no
prediction arrived), each stage timed in the decision's `stage_us`. The whole decision
is timed here, from reading the instances' loads, predict RPCs included (`decide_us`,
`astro:dispatch_decide_seconds`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import numpy as np

from rps_astro_cli.dispatch import PREDICTIONS, STATUS, decide_async, make_dispatch, prefix_hits_wanted
from rps_astro_cli.dispatch.admission import Admission, RequestSlo
from rps_astro_cli.dispatch.loads import DispatchRequest, loads_for
from rps_astro_cli.dispatch.outcome import OutcomeCorrection
from rps_astro_cli.protocol.service_wire import PredictRequest
from rps_astro_cli.services.scheduler.instances import Instances
from rps_astro_cli.services.scheduler.metrics import SchedulerMetrics
from rps_astro_cli.services.scheduler.predictions import PredictClient
from rps_astro_cli.services.scheduler.settings import SchedulerSettings
from rps_astro_cli.types import CandidateRequest, DispatchDecision, LatencyEstimate

log = logging.getLogger("astro.scheduler")


class Dispatcher:
    """The dispatch policy of the settings, with the scheduler's seeded Generator."""

    def __init__(self, settings: SchedulerSettings, instances: Instances, predict: PredictClient,
                 metrics: SchedulerMetrics):
        self.policy = make_dispatch(settings.policy, **settings.policy_params)
        self.policy_name = settings.policy
        self.rng = np.random.default_rng(settings.seed)
        self.instances = instances
        self.predict = predict
        self.m = metrics
        self.objective: str = self.policy.describe().get("objective") or "e2e"
        # whether a decision asks Predictors, and whether it reads the candidate's own
        # predicted length (only an E2E prediction does: a TTFT does not depend on it,
        # and a policy without predictions reads no length at all)
        self.asks_predictors = PREDICTIONS in self.policy.inputs
        self.reads_length = self.asks_predictors and self.objective == "e2e"
        self.admission = Admission(settings.admission)
        # each instance's estimates corrected by what its requests then took (`dispatch.outcome`),
        # keyed by instance name; fed by the front door as requests end
        self.outcomes = OutcomeCorrection() if settings.calibration == "online" else None

    @property
    def needs_status(self) -> bool:
        """Whether the health loop polls engine `/status` every `status_interval_s`: the
        policy reads it, or the prefix caches it carries (`needs_prefix`)."""
        return STATUS in self.policy.inputs or self.needs_prefix

    @property
    def needs_prefix(self) -> bool:
        """Whether a request may need each instance's cached prefix of it
        (`dispatch.prefix_hits_wanted` with some cache): the health loop then mirrors the
        engines' cached block hashes, the front door hashes prompts (`prefix_wanted`),
        and each candidate's Predictor is told the candidate's hit (`cached_tokens`)."""
        return prefix_hits_wanted(self.policy.inputs, True)

    def prefix_wanted(self) -> bool:
        """Whether to hash this request's prompt blocks (and ask an engine's `/tokenize`
        for them) now: `dispatch.prefix_hits_wanted` over the instances as their
        `/status` reports them (with caching off everywhere the hashing — and on a vLLM
        fleet the RPC — would be waste)."""
        return prefix_hits_wanted(self.policy.inputs, any(st.prefix_caching for st in self.instances))

    def describe(self) -> dict[str, Any]:
        return self.policy.describe()

    async def choose(self, candidate: CandidateRequest, excluded: frozenset[int],
                     block_hashes: tuple[int, ...] = (), block_size: int = 16,
                     prefix_tokens: int | None = None, slo: RequestSlo | None = None,
                     first_token_only: bool = False) -> DispatchDecision | None:
        """Choose a dispatchable instance for `candidate` outside `excluded` (instance
        indices); None when there is none. The policy sees only the dispatchable
        instances, at positions 0..n-1 (so its "no healthy instance → all" fallback
        never reaches a terminating or not-ready one); the decision is translated back
        to instance indices. `block_hashes` (of `block_size`-token blocks): the
        request's prompt blocks, for a policy that `needs_prefix`; each instance's load
        then carries the request's cached prefix there, and each candidate's Predictor
        gets it as `cached_tokens`. `prefix_tokens`: the prompt's length in the ids the
        hashes were taken of, when those are the engine's (`/tokenize`; None: the
        candidate's `prompt_tokens`): it caps a hit (at least the last prompt token is
        computed, as the engine caps it) and is the load's `request_prompt_tokens`, so
        the hit's share of the prompt (cache_aware) and the KV headroom gate count in
        the engine's tokens, the unit of its hits and of its `/status`. `slo`: the
        request's SLO, judged by the settings' `admission` (a refusal: `refused` set).
        `first_token_only`: the look-aheads stop at the candidate's first token (its TTFT
        is all the decision reads: an early decision, whose length is not known yet);
        each prediction's E2E then equals its TTFT."""
        t0 = time.perf_counter()
        pool = self.instances.dispatchable()
        req = DispatchRequest(prefix_tokens or candidate.prompt_tokens, block_hashes, block_size)
        loads = loads_for(pool, req, self.policy.inputs, excluded)
        if not any(ld.healthy for ld in loads):
            # every instance broken: still try the non-excluded ones (a health check may lag)
            loads = [replace(ld, healthy=pool[ld.index].index not in excluded) for ld in loads]
            if not any(ld.healthy for ld in loads):
                return None
        query = PredictRequest(candidate, self.objective, first_token_only=first_token_only)
        identity = all(st.index == j for j, st in enumerate(pool))
        cached = ({pool[ld.index].index: ld.prefix_hit_tokens for ld in loads if ld.prefix_hit_tokens}
                  if block_hashes else None)

        untrusted: list[int] = []  # instance indices whose Predictor's model is not trusted now
        uncorrected: dict[int, tuple[float, float]] = {}  # positions → raw estimates outcome correction changed
        outcomes = self.outcomes

        async def predict(cands: list[int]) -> dict[int, LatencyEstimate]:
            if identity:
                got = await self.predict.predict_many(cands, query, cached, untrusted)
            else:
                got = await self.predict.predict_many([pool[j].index for j in cands], query, cached, untrusted)
                position = {pool[j].index: j for j in cands}
                got = {position[i]: est for i, est in got.items()}
            if outcomes is None or not got:
                return got
            return outcomes.correct_all({j: pool[j].ep.name for j in got}, got, uncorrected)

        dec = await decide_async(self.policy, loads, self.rng, predict, slo, self.admission)
        changes: dict[str, Any] = {}  # one copy of the decision, not one per change
        if untrusted:
            changes["untrusted"] = tuple(untrusted)
        raw = uncorrected or dec.uncorrected
        if not identity:
            changes.update(choice=pool[dec.choice].index if dec.refused is None else -1,
                           candidates=tuple(pool[j].index for j in dec.candidates),
                           predictions={pool[j].index: p for j, p in dec.predictions.items()})
            raw = {pool[j].index: p for j, p in raw.items()}
        if raw:
            changes["uncorrected"] = raw
        dt = time.perf_counter() - t0
        dec = replace(dec, decide_us=dt * 1e6, **changes)
        self.m.child(self.m.decisions, self.policy_name, dec.reason).inc()
        self.m.child(self.m.decide, self.policy_name).observe(dt)
        self.m.record_decision(self.policy_name, dec.reason, dec.stage_us)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("decision %s", dec.to_dict())
        return dec
