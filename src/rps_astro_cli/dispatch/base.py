"""The dispatch-policy interface: a policy is a pipeline of stages (`dispatch/stages.py`)

    filters (health, capacity) → sampler (power-of-k) → scorers (predicted latency,
    load, …; a prefix-cache scorer slots in here) → picker

declared by the policy class together with its parameters (`params`, see
`rps_astro_cli.params`). One dispatch is two calls, so the same policy runs in the async
live scheduler (Predictor RPCs over HTTP with a deadline) and in the synchronous virtual
cluster (look-ahead called directly):

1. `candidates(loads, rng)` = `sample(filter(loads), rng)` → indices to consider. If
   `PREDICTIONS` is among the policy's `inputs` (a scorer reads predictions), the caller
   obtains a `LatencyEstimate` for each candidate.
2. `choose(loads, candidates, predictions, rng)` = scorers + picker → a
   `DispatchDecision`. `predictions` maps instance index → estimate for those that
   answered in time (late/failed ones are simply absent).

`decide` / `decide_async` run both calls and the predictions in between, and time each
stage into the decision (`stage_us`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from rps_astro_cli.dispatch.admission import Admission, RequestSlo, judge, least_headroom, room_of
from rps_astro_cli.dispatch.stages import (
    PREDICTIONS,
    PREFIX_HITS,
    Filter,
    HealthFilter,
    KvHeadroomFilter,
    MinScorePicker,
    OutstandingScorer,
    Picker,
    Sampler,
    Scorer,
)
from rps_astro_cli.params import Param, check_params
from rps_astro_cli.registry import Registry
from rps_astro_cli.types import DispatchDecision, InstanceLoad, LatencyEstimate

__all__ = [
    "DISPATCH_POLICIES",
    "DispatchPolicy",
    "Fallback",
    "alias_param",
    "decide",
    "decide_async",
    "dispatch_params",
    "make_dispatch",
    "prefix_hits_wanted",
]

DISPATCH_POLICIES: Registry[type[DispatchPolicy]] = Registry("dispatch policy")


@dataclass(frozen=True)
class Fallback:
    """What a policy does when its scorers score no candidate (no status yet, no
    Predictor answered): score `pool` ("candidates", or "filtered" = every instance the
    filters pass) with `scorer`, and say `reason`."""

    scorer: Scorer  # the fallback signal, e.g. fewest outstanding requests
    pool: str  # "candidates" | "filtered"
    reason: str  # the decision's reason, e.g. "fallback: no status; fewest outstanding"


FEWEST_OUTSTANDING = OutstandingScorer()


class DispatchPolicy:
    """Base class; register subclasses with `@DISPATCH_POLICIES.register(name)`.

    A subclass declares its pipeline (class attributes, or set in `__init__` from its
    parameters) and its parameters:

    name: the registered name. params: the declared `Param`s; `__init__` takes exactly
        these as keywords, with the same defaults (a test checks).
    filters: applied in order (default: health). sampler: default all candidates.
    scorers: (scorer, weight) pairs. One scorer decides by its raw costs; several are
        each min-max normalised to [0, 1] (0 = best) and summed with their weights.
    picker: default the lowest cost, random tie-break. fallback: when no candidate is
        scored (None: the picker gets no scores).
    unanswered: for a policy that reads predictions, when some candidates' Predictors
        answered and others did not (dead, late, breaker open): the best predicted
        candidate and the unanswered ones are compared by this load signal instead
        (random ties), so an instance whose Predictor is down keeps getting its share
        rather than losing every comparison (None: unanswered candidates just lose).
    """

    name: ClassVar[str] = "base"
    params: ClassVar[tuple[Param, ...]] = ()
    filters: tuple[Filter, ...] = (HealthFilter(),)
    sampler: Sampler = Sampler()
    scorers: tuple[tuple[Scorer, float], ...] = ()
    picker: Picker = MinScorePicker()
    fallback: Fallback | None = None
    unanswered: Scorer | None = FEWEST_OUTSTANDING
    unanswered_reason: str = "fallback: a predictor did not answer; fewest outstanding"

    @property
    def inputs(self) -> frozenset[str]:
        """What the policy's stages read (`stages.STATUS`, `PREFIX_HITS`, `PREDICTIONS`):
        `stage_inputs()`, taken once (the pipeline is set by `__init__` and not changed
        after; asked on every decision). The caller fetches or fills exactly these."""
        got: frozenset[str] | None = self.__dict__.get("_inputs")
        if got is None:
            got = self.__dict__["_inputs"] = self.stage_inputs()
        return got

    def stage_inputs(self) -> frozenset[str]:
        """The union of the stages' declared `reads` (a subclass adds what it reads itself)."""
        stages: list[Any] = [*self.filters, self.sampler, *(s for s, _ in self.scorers)]
        if self.fallback is not None:
            stages.append(self.fallback.scorer)
        return frozenset().union(*(st.reads for st in stages))

    # -- stage 1, 2: which instances to consider ------------------------------------------
    def filter(self, loads: Sequence[InstanceLoad]) -> list[int]:
        """The filters' pool (instance indices)."""
        by_index = {ld.index: ld for ld in loads}
        pool = [ld.index for ld in loads]
        for f in self.filters:
            pool = f(by_index, pool)
        return pool

    def sample(self, pool: list[int], rng: np.random.Generator,
               loads: Sequence[InstanceLoad] | None = None) -> list[int]:
        """The sampler's candidates from the pool (`loads`: for a sampler that reads
        `PREFIX_HITS` or `STATUS`; ignored for one that reads nothing)."""
        if loads is None or not self.sampler.reads:
            return self.sampler(pool, rng)
        return self.sampler(pool, rng, {ld.index: ld for ld in loads})

    def candidates(self, loads: Sequence[InstanceLoad], rng: np.random.Generator) -> list[int]:
        """Instances to consider: every healthy one by default (all if none is healthy)."""
        return self.sample(self.filter(loads), rng, loads)

    # -- stage 3, 4: score and pick ---------------------------------------------------------
    def score(self, loads: Sequence[InstanceLoad], candidates: Sequence[int],
              predictions: Mapping[int, LatencyEstimate]) -> tuple[dict[int, float] | None, str]:
        """(costs of the candidates the scorers could score, or None without scorers;
        the reason), the fallback applied when nothing was scored."""
        if not self.scorers:
            return None, self.picker.reason
        by_index = {ld.index: ld for ld in loads}
        if len(self.scorers) == 1:
            scorer = self.scorers[0][0]
            values = scorer.score(by_index, candidates, predictions)
            reason = scorer.reason
        else:
            values = _weighted(self.scorers, by_index, candidates, predictions)
            reason = "lowest weighted score (" + " + ".join(s.name for s, _ in self.scorers) + ")"
        if not values and self.fallback is not None:
            pool = list(candidates) if self.fallback.pool == "candidates" else self.filter(loads)
            values = self.fallback.scorer.score(by_index, pool, predictions)
            reason = self.fallback.reason
        elif values and self.unanswered is not None and PREDICTIONS in self.inputs:
            missing = [i for i in candidates if i not in predictions]
            if missing:  # ranks in seconds cannot be compared with no rank: load decides
                best = min(values, key=values.__getitem__)
                values = self.unanswered.score(by_index, [best, *missing], predictions)
                reason = self.unanswered_reason
        return values, reason

    def choose(
        self,
        loads: Sequence[InstanceLoad],
        candidates: Sequence[int],
        predictions: Mapping[int, LatencyEstimate],
        rng: np.random.Generator,
    ) -> DispatchDecision:
        """Score the candidates and pick one (timings in `stage_us`)."""
        t0 = time.perf_counter()
        values, reason = self.score(loads, candidates, predictions)
        t1 = time.perf_counter()
        choice = self.picker.pick(candidates, values, len(loads), rng)
        t2 = time.perf_counter()
        return DispatchDecision(self.name, tuple(candidates), choice, reason, _pairs(predictions),
                                stage_us={"score": (t1 - t0) * 1e6, "pick": (t2 - t1) * 1e6})

    def describe(self) -> dict[str, Any]:
        """Name and parameter values, for reports, `/decisions` and cluster.json."""
        return {"name": self.name, **{p.name: getattr(self, p.name) for p in self.params}}


def _weighted(scorers: Sequence[tuple[Scorer, float]], by_index: Mapping[int, InstanceLoad],
              candidates: Sequence[int], predictions: Mapping[int, LatencyEstimate]) -> dict[int, float]:
    """Σ weight × (cost normalised to [0, 1] over the candidates every scorer scored)."""
    per = [(s.score(by_index, candidates, predictions), w) for s, w in scorers]
    common = [i for i in per[0][0] if all(i in v for v, _ in per)]
    out = dict.fromkeys(common, 0.0)
    for v, w in per:
        lo, hi = min((v[i] for i in common), default=0.0), max((v[i] for i in common), default=0.0)
        span = hi - lo
        for i in common:
            out[i] += w * ((v[i] - lo) / span if span > 0 else 0.0)
    return out


def dispatch_params(name: str) -> tuple[Param, ...]:
    """The declared parameters of dispatch policy `name`.

    Raises:
        AstroUserError: unknown name (lists the valid ones).
    """
    return DISPATCH_POLICIES.get(name).params


def alias_param(key: str) -> Param:
    """The declared parameter whose flat recipe key (`Param.alias`) is `key` (e.g.
    `scheduler.k` → power_of_k's k), searched over every registered policy.

    Raises:
        KeyError: no registered policy declares that alias (a programming error).
    """
    for name in DISPATCH_POLICIES.names():
        for p in DISPATCH_POLICIES.get(name).params:
            if p.alias == key:
                return p
    raise KeyError(f"no dispatch policy declares the flat key {key!r}")


def make_dispatch(name: str, fields: Mapping[str, str] | None = None, **params: Any) -> DispatchPolicy:
    """Instantiate a registered dispatch policy; `params` (strings from flags or typed
    values) are converted and checked against its declared `params` first.

    Args:
        fields: parameter name → the recipe field / flag it came from (for errors).

    Raises:
        AstroUserError: unknown name (lists the valid ones); an undeclared parameter
            (lists the declared ones); a bad value (names the field and what it takes).
    """
    cls = DISPATCH_POLICIES.get(name)
    return cls(**check_params(cls.params, params, owner=f"dispatch policy {name}", fields=fields))


def prefix_hits_wanted(inputs: frozenset[str], some_instance_caches: bool) -> bool:
    """Whether a dispatch reading `inputs` needs each instance's cached prefix of the
    request (`InstanceLoad.prefix_hit_tokens`): always for a stage that decides by it
    (`PREFIX_HITS`); for the Predictors' look-ahead (`PREDICTIONS`: it starts a
    candidate's prefill past its hit; the KV headroom gate of that policy counts the
    request's prompt net of it) once some instance caches prefixes — with caching off
    everywhere no hit can exist. The one rule of the live scheduler, the endpoint picker
    and the virtual cluster."""
    return PREFIX_HITS in inputs or (PREDICTIONS in inputs and some_instance_caches)


def decide(policy: DispatchPolicy, loads: Sequence[InstanceLoad], rng: np.random.Generator,
           predict: Callable[[list[int]], Mapping[int, LatencyEstimate]],
           slo: RequestSlo | None = None, admission: Admission | None = None) -> DispatchDecision:
    """One dispatch through the pipeline: filter → sample → `predict(candidates)` (only
    if the policy needs predictions) → [admission, for a request with a TTFT `slo`] →
    score → pick, each stage timed in `stage_us`. A refused request's decision has
    `refused` set (`dispatch.admission`)."""
    t0 = time.perf_counter()
    inputs = policy.inputs
    pool = policy.filter(loads)
    t1 = time.perf_counter()
    cands = policy.sample(pool, rng, loads)
    t2 = time.perf_counter()
    preds = predict(cands) if PREDICTIONS in inputs else {}
    t3 = time.perf_counter()
    return _finish(policy, loads, cands, preds, rng, slo, admission, t0, t1, t2, t3)


async def decide_async(policy: DispatchPolicy, loads: Sequence[InstanceLoad], rng: np.random.Generator,
                       predict: Callable[[list[int]], Awaitable[Mapping[int, LatencyEstimate]]],
                       slo: RequestSlo | None = None, admission: Admission | None = None) -> DispatchDecision:
    """`decide` with an awaitable `predict` (the live scheduler's parallel RPCs)."""
    t0 = time.perf_counter()
    inputs = policy.inputs
    pool = policy.filter(loads)
    t1 = time.perf_counter()
    cands = policy.sample(pool, rng, loads)
    t2 = time.perf_counter()
    preds = await predict(cands) if PREDICTIONS in inputs else {}
    t3 = time.perf_counter()
    return _finish(policy, loads, cands, preds, rng, slo, admission, t0, t1, t2, t3)


def _finish(policy: DispatchPolicy, loads: Sequence[InstanceLoad], cands: list[int],
            preds: Mapping[int, LatencyEstimate], rng: np.random.Generator, slo: RequestSlo | None,
            admission: Admission | None, t0: float, t1: float, t2: float, t3: float) -> DispatchDecision:
    """`policy.choose` (behind admission for a judged request), with the stage times."""
    if slo is not None and slo.ttft_ms is not None and admission is not None and PREDICTIONS in policy.inputs:
        return _timed(_admit_and_choose(policy, loads, cands, preds, rng, slo, admission), t0, t1, t2, t3)
    return _timed(policy.choose(loads, cands, preds, rng), t0, t1, t2, t3)


def _pairs(preds: Mapping[int, LatencyEstimate]) -> dict[int, tuple[float, float]]:
    """A decision's `predictions`: index → (TTFT s, E2E s)."""
    return {i: (p.ttft_s, p.e2e_s) for i, p in preds.items()}


def _admit_and_choose(policy: DispatchPolicy, loads: Sequence[InstanceLoad], cands: list[int],
                      preds: Mapping[int, LatencyEstimate], rng: np.random.Generator,
                      slo: RequestSlo | None, admission: Admission | None) -> DispatchDecision:
    """`policy.choose` behind admission (`dispatch.admission`), for a request with a TTFT
    target (`slo.ttft_ms`) under a policy that read predictions (`_finish` checks)."""
    assert slo is not None and admission is not None
    ta = time.perf_counter()
    ttft = {i: p.ttft_s for i, p in preds.items()}
    room = None
    if admission.require_room:
        by_index = {ld.index: ld for ld in loads}
        gate = KvHeadroomFilter(0.0)
        f = min(0.99, admission.room_reserve_frac + admission.priority_reserve_frac * max(0, slo.priority))
        room = {i: room_of(gate.free_slots(by_index[i]), gate.headroom_blocks(by_index[i]),
                           f * (by_index[i].max_num_seqs or 0), f * (by_index[i].kv_blocks_total or 0))
                for i in cands}
    verdict = judge(slo, cands, ttft, admission, room)
    tb = time.perf_counter()
    adm_us = {"admit": (tb - ta) * 1e6}
    if not verdict.admit:
        dec = DispatchDecision(policy.name, tuple(cands), -1, f"refused: {verdict.reason}",
                               {i: (p.ttft_s, p.e2e_s) for i, p in preds.items()},
                               refused=verdict.reason, admission=verdict.reason,
                               retry_after_s=verdict.retry_after_s)
    elif verdict.feasible and admission.prefer == "least":
        choice = least_headroom(verdict.feasible, ttft)
        dec = DispatchDecision(policy.name, tuple(cands), choice, "least TTFT headroom within the SLO",
                               {i: (p.ttft_s, p.e2e_s) for i, p in preds.items()}, admission=verdict.reason)
    elif verdict.feasible and len(verdict.feasible) < len(cands):
        sub = {i: preds[i] for i in verdict.feasible}
        dec = policy.choose(loads, list(verdict.feasible), sub, rng)
        dec = replace(dec, candidates=tuple(cands),
                      predictions={i: (p.ttft_s, p.e2e_s) for i, p in preds.items()},
                      reason=f"{dec.reason} among {len(verdict.feasible)}/{len(cands)} meeting the TTFT SLO",
                      admission=verdict.reason)
    else:
        dec = replace(policy.choose(loads, cands, preds, rng), admission=verdict.reason)
    return replace(dec, stage_us={**adm_us, **dec.stage_us})


def _timed(dec: DispatchDecision, t0: float, t1: float, t2: float, t3: float) -> DispatchDecision:
    """`dec` with its whole time and the stages before `choose` (a decision is made per
    request: built field by field, ~3× cheaper than `dataclasses.replace`; a test checks
    every field is carried)."""
    t4 = time.perf_counter()
    stages = {"filter": (t1 - t0) * 1e6, "sample": (t2 - t1) * 1e6, "predict": (t3 - t2) * 1e6, **dec.stage_us}
    return DispatchDecision(dec.policy, dec.candidates, dec.choice, dec.reason, dec.predictions, (t4 - t0) * 1e6,
                            stages, dec.untrusted, dec.refused, dec.admission, dec.retry_after_s, dec.uncorrected)
