"""Prefix-cache baselines: `cache_aware` and `session_affinity`.

`cache_aware` follows the rule SGLang's router and vllm-router document for their
`cache_aware` policy: when the load is imbalanced — (max − min outstanding requests) >
`balance_abs_threshold` and max > `balance_rel_threshold` × min over the candidates —
send to the least loaded; otherwise, if the best candidate's cached prefix covers more
than `cache_threshold` of the prompt, send there (the longest match; ties: fewer
outstanding); otherwise the least loaded. Differences, said here: those routers match the
request text against their own approximate radix tree of what they routed where, and
send a low-match request to the instance with the smallest tree; here the match is the
instance's actual prefix cache (`InstanceLoad.prefix_hit_tokens`, what vllm-router's
`kv_aware` / llm-d's precise prefix scorer read) and a low match goes to the least
loaded. Weakness: the thresholds are hand-set, so hits and load trade off by a step, not a
cost (hot spots on a popular prefix until the imbalance guard trips).

`session_affinity` sends every turn of a session to the instance that served its
previous turn (`InstanceLoad.served_session`, kept by the caller); a first turn, or one
whose instance is unhealthy, goes to the least loaded. Weakness: blind to load once a
session is placed (a burst of long sessions piles up on one instance).

Live scheduler: it fills `prefix_hit_tokens` from its mirror of each engine's cached
block hashes (`services/scheduler/health.py`, `/status?prefix_since=N`), so
`cache_aware` works live; it keeps no sessions (`served_session` False), so
`session_affinity` degrades to fewest outstanding there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rps_astro_cli.dispatch.base import DISPATCH_POLICIES, DispatchPolicy
from rps_astro_cli.dispatch.stages import PREFIX_HITS, Scorer
from rps_astro_cli.params import Param

if TYPE_CHECKING:
    from rps_astro_cli.types import InstanceLoad, LatencyEstimate

CACHE_THRESHOLD = Param("cache_threshold", float, 0.5, "share of the prompt the best cached prefix must exceed "
                        "to route by cache (0..1)", ge=0.0, le=1.0)
BALANCE_ABS = Param("balance_abs_threshold", int, 32, "load imbalance guard: max − min outstanding requests above "
                    "this (and the relative guard) routes to the least loaded", ge=0)
BALANCE_REL = Param("balance_rel_threshold", float, 1.5, "load imbalance guard: max outstanding above this × min "
                    "(and the absolute guard) routes to the least loaded", ge=1.0)

_TIE = 1e-6  # ties on the primary cost are broken by fewer outstanding requests


class CacheAwareScorer(Scorer):
    """Cost per the `cache_aware` rule (module docstring): outstanding requests when the
    load is imbalanced or no candidate's hit passes the threshold, else −hit tokens."""

    name = "cache_aware"
    reads = frozenset({PREFIX_HITS})  # and the outstanding counts, which every load carries
    reason = "cache-aware (longest cached prefix, load-balance guard)"

    def __init__(self, cache_threshold: float, balance_abs: int, balance_rel: float) -> None:
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel

    def score(self, by_index: Mapping[int, InstanceLoad], candidates: Sequence[int],
              predictions: Mapping[int, LatencyEstimate]) -> dict[int, float]:
        loads = {i: by_index[i].outstanding_requests for i in candidates}
        if not loads:
            return {}
        hi, lo = max(loads.values()), min(loads.values())
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return {i: float(v) for i, v in loads.items()}
        hits = {i: by_index[i].prefix_hit_tokens or 0 for i in candidates}
        best = max(hits.values())
        prompt = max((by_index[i].request_prompt_tokens or 0) for i in candidates)
        if prompt > 0 and best / prompt > self.cache_threshold:
            return {i: -float(hits[i]) + _TIE * loads[i] for i in candidates}
        return {i: float(v) for i, v in loads.items()}


class SessionScorer(Scorer):
    """Cost: the session's instance first, then fewest outstanding requests."""

    name = "session"
    reason = "session affinity (else fewest outstanding)"

    def score(self, by_index: Mapping[int, InstanceLoad], candidates: Sequence[int],
              predictions: Mapping[int, LatencyEstimate]) -> dict[int, float]:
        return {i: float(by_index[i].outstanding_requests) - (1e9 if by_index[i].served_session else 0.0)
                for i in candidates}


@DISPATCH_POLICIES.register("cache_aware")
class CacheAware(DispatchPolicy):
    """SGLang / vllm-router `cache_aware` over the instances' prefix caches (module
    docstring). Weakness: hand-set thresholds trade hits against load by a step."""

    name = "cache_aware"
    params = (CACHE_THRESHOLD, BALANCE_ABS, BALANCE_REL)

    def __init__(self, cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.5) -> None:
        self.cache_threshold = CACHE_THRESHOLD.check(cache_threshold)
        self.balance_abs_threshold = BALANCE_ABS.check(balance_abs_threshold)
        self.balance_rel_threshold = BALANCE_REL.check(balance_rel_threshold)
        self.scorers = ((CacheAwareScorer(self.cache_threshold, self.balance_abs_threshold,
                                          self.balance_rel_threshold), 1.0),)


@DISPATCH_POLICIES.register("session_affinity")
class SessionAffinity(DispatchPolicy):
    """A session's turns stick to the instance of its previous turn; new sessions go to
    the least loaded. Weakness: blind to load once a session is placed."""

    name = "session_affinity"
    scorers = ((SessionScorer(), 1.0),)
