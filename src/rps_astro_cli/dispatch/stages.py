"""The stages a dispatch policy is built from (llm-d's scheduling pipeline):

    filters  → sampler → [Predictor RPCs] → scorers → picker
    (health,   (power-     (only if a scorer  (latency,  (min score,
     capacity)  of-k)       needs them)        load, …)   random, turn)

- A **filter** narrows the instances considered; it never returns an empty pool (if
  nothing passes, it passes everything on — a lagging health check must not stop
  dispatch).
- A **sampler** picks the candidates from the pool (all, or k at random).
- A **scorer** gives candidates a cost, lower = better; candidates it cannot score
  (no status yet, no prediction) are left out.
- A **picker** turns costs into one choice; ties are broken by the run's Generator.

Each stage declares what it reads beyond the request and the outstanding counts, as one
set `reads` of the inputs below; a policy's `inputs` is the union over its stages, and
the callers (the live scheduler, the endpoint picker, the virtual cluster) fetch or fill
exactly that (`base.prefix_hits_wanted` is their one rule for prefix hits):

- `STATUS`: the engines' `/status` fields of `InstanceLoad` (KV blocks, queue, batch).
- `PREFIX_HITS`: each instance's cached prefix of the request (`prefix_hit_tokens`,
  `request_prompt_tokens`), which the stage decides by: filled for every request.
- `PREDICTIONS`: the candidates' Predictor estimates (whose look-ahead also starts a
  candidate's prefill past its hit, so hits are filled once some instance caches).

Every stage is deterministic given the `numpy.random.Generator` passed in, and draws from
it exactly when the pre-pipeline policies did, so fixed-seed runs are bit-identical.
The prefix-cache stages: `PowerOfKSampler(pin_cached=True)` here and
`prefix.CacheAwareScorer`; both read `PREFIX_HITS`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:  # value types only; no import at run time
    from rps_astro_cli.types import InstanceLoad, LatencyEstimate

TIE_RESOLUTION_S = 1e-6  # predicted latencies closer than this are ties

# the inputs a stage may read (module docstring)
STATUS = "status"
PREFIX_HITS = "prefix_hits"
PREDICTIONS = "predictions"
NOTHING: frozenset[str] = frozenset()


# -- filters -------------------------------------------------------------------------------
class Filter:
    """Narrows the pool (instance indices, in index order)."""

    name: ClassVar[str] = "filter"
    reads: ClassVar[frozenset[str]] = NOTHING

    def __call__(self, by_index: Mapping[int, InstanceLoad], pool: list[int]) -> list[int]:
        raise NotImplementedError


class HealthFilter(Filter):
    """Healthy instances (circuit breaker closed); all of them if none is healthy.
    Weakness: as fresh as the last health check."""

    name = "health"

    def __call__(self, by_index: Mapping[int, InstanceLoad], pool: list[int]) -> list[int]:
        kept = [i for i in pool if by_index[i].healthy]
        return kept or pool


class KvRoomFilter(Filter):
    """Capacity: instances whose KV blocks are not already spoken for — free blocks minus
    what the waiting queue needs for its prompts is more than `min_free_blocks`.
    Instances with unknown status pass; if none has room, all pass.
    Weakness: a memory-only signal (a long prefill queue that fits looks free)."""

    name = "kv_room"
    reads = frozenset({STATUS})

    def __init__(self, min_free_blocks: int = 0) -> None:
        self.min_free_blocks = min_free_blocks

    def __call__(self, by_index: Mapping[int, InstanceLoad], pool: list[int]) -> list[int]:
        def room(ld: InstanceLoad) -> bool:
            if ld.kv_blocks_free is None:
                return True
            return ld.kv_blocks_free - (ld.waiting_blocks_needed or 0) > self.min_free_blocks

        kept = [i for i in pool if room(by_index[i])]
        return kept or pool


class KvHeadroomFilter(Filter):
    """KV headroom: instances that would keep at least `reserve_frac` of their KV pool free
    after this request's prompt is placed — free blocks − the waiting queue's prompt
    blocks − the prompt blocks of requests sent there since that status
    (`pending_blocks_needed`) − ceil(request prompt / block size) ≥ reserve_frac × total
    blocks (the
    request's prompt counts when `InstanceLoad.request_prompt_tokens` and the block size
    are known), and the same fraction of its batch slots (`max_num_seqs` − running −
    waiting − in flight − this one). Instances with unknown status pass; if none has
    headroom, all pass.

    Why: at high load the TTFT tail comes from instances running out of KV blocks (the
    queue then waits for running requests to finish); a predicted-latency scorer sees
    that only as well as the running requests' predicted lengths, a memory check sees it
    exactly. Weakness: a fixed reserve; memory only, so it cannot tell a long prefill
    queue that fits from a short one.
    """

    name = "kv_headroom"
    reads = frozenset({STATUS})

    def __init__(self, reserve_frac: float) -> None:
        self.reserve_frac = reserve_frac

    def headroom_blocks(self, ld: InstanceLoad) -> int | None:
        """Blocks left free after the waiting queue's and this request's prompts (None
        when the status is unknown)."""
        if ld.kv_blocks_free is None:
            return None
        own = 0
        if ld.request_prompt_tokens and ld.kv_block_size:
            cached = ld.prefix_hit_tokens or 0
            own = -(-max(0, ld.request_prompt_tokens - cached) // ld.kv_block_size)
        return ld.kv_blocks_free - (ld.waiting_blocks_needed or 0) - (ld.pending_blocks_needed or 0) - own

    def free_slots(self, ld: InstanceLoad) -> int | None:
        """Batch slots left after the running, waiting and in-flight requests and this one
        (max_num_seqs − running − waiting − pending − 1; None when unknown)."""
        if ld.max_num_seqs is None or ld.num_running is None:
            return None
        return ld.max_num_seqs - ld.num_running - (ld.num_waiting or 0) - (ld.pending_requests or 0) - 1

    def __call__(self, by_index: Mapping[int, InstanceLoad], pool: list[int]) -> list[int]:
        def ok(ld: InstanceLoad) -> bool:
            slots = self.free_slots(ld)
            if slots is not None and ld.max_num_seqs is not None and slots < self.reserve_frac * ld.max_num_seqs:
                return False  # a full batch queues the request as surely as a full KV pool
            room = self.headroom_blocks(ld)
            if room is None or ld.kv_blocks_total is None:
                return True
            return room >= self.reserve_frac * ld.kv_blocks_total

        kept = [i for i in pool if ok(by_index[i])]
        return kept or pool


# -- samplers ------------------------------------------------------------------------------
class Sampler:
    """Picks the candidates from the filtered pool: every one by default.

    reads: `PREFIX_HITS` for a sampler that reads `InstanceLoad.prefix_hit_tokens`
    (`by_index`: the request's cached prefix on each instance)."""

    name: ClassVar[str] = "all"
    reads: frozenset[str] = NOTHING

    def __call__(self, pool: list[int], rng: np.random.Generator,
                 by_index: Mapping[int, InstanceLoad] | None = None) -> list[int]:
        return list(pool)


class PowerOfKSampler(Sampler):
    """k distinct instances uniformly at random (Astrolabe; power-of-k choices);
    `k=None` or k ≥ the pool = the whole pool (full fanout, no draw).

    pin_cached: when some instance of the pool holds a cached prefix of the request
    (`prefix_hit_tokens` > 0), the candidates are that instance (the longest hit; ties:
    fewest outstanding, then pool order) plus k − 1 drawn uniformly from the rest, so
    the scorer (the Predictor, which simulates the hit) weighs the cache hit against
    load in one number. With no hit anywhere (or hits unknown) the draw is exactly the
    plain one, so traffic with no prefix sharing gets the same candidates.
    Weakness: with small k it may miss the best instance."""

    name = "power_of_k"

    def __init__(self, k: int | None, pin_cached: bool = False) -> None:
        self.k = k
        self.pin_cached = pin_cached
        self.reads = frozenset({PREFIX_HITS}) if pin_cached and k is not None else NOTHING

    def __call__(self, pool: list[int], rng: np.random.Generator,
                 by_index: Mapping[int, InstanceLoad] | None = None) -> list[int]:
        if self.k is None or self.k >= len(pool):
            return list(pool)
        if self.pin_cached and by_index is not None:
            pinned = cached_best(pool, by_index)
            if pinned is not None:
                rest = [i for i in pool if i != pinned]
                if self.k == 1:
                    return [pinned]
                picked = rng.choice(len(rest), size=self.k - 1, replace=False)
                return [pinned, *(rest[int(j)] for j in picked)]
        picked = rng.choice(len(pool), size=self.k, replace=False)
        return [pool[int(j)] for j in picked]


class LeastLoadedSampler(Sampler):
    """At most `limit` candidates, chosen by cheap signals before any look-ahead (issue
    32: the decision's cost must not grow with the fleet): the whole pool when it holds
    ≤ `limit` instances; else, with `pin_cached`, the instance holding the longest cached
    prefix of the request, then the lowest Llumnix- load (astrolabe variant: free KV
    blocks after the waiting queue, per running request; fewest outstanding requests
    where a status is missing), ties broken at random. Why not a uniform draw of k: at
    64 instances a draw of 8 misses the idle ones a load scan finds for free, and the
    look-ahead then compares busy instances only (BENCHMARKS.md, "Fleet scale").
    The pin uses `prefix_hit_tokens` where the caller filled them (see `reads`)."""

    name = "least_loaded"

    def __init__(self, limit: int, pin_cached: bool = False) -> None:
        self.limit = limit
        self.pin_cached = pin_cached
        # hits are not declared: this sampler serves the look-ahead policy, whose caller
        # fills them whenever some instance caches prefixes (`prefix_hits_wanted`); with
        # caching off everywhere no hit can exist, and the request is not hashed for none
        self.reads = frozenset({STATUS})
        self._load = LlumnixLoadScorer("astrolabe", 0.0)

    def __call__(self, pool: list[int], rng: np.random.Generator,
                 by_index: Mapping[int, InstanceLoad] | None = None) -> list[int]:
        if len(pool) <= self.limit or by_index is None:
            return list(pool) if len(pool) <= self.limit else PowerOfKSampler(self.limit)(pool, rng)
        pinned = cached_best(pool, by_index) if self.pin_cached else None
        rest = [i for i in pool if i != pinned]
        ranks = rng.random(len(rest))  # random tie-break among equal loads

        def key(j: int) -> tuple[float, float, float]:
            ld = by_index[rest[j]]
            v = self._load.load(ld)
            # instances without a status after every one with one, by outstanding requests
            return (0.0, v, ranks[j]) if v is not None else (1.0, float(ld.outstanding_requests), ranks[j])
        order = sorted(range(len(rest)), key=key)
        picked = [rest[j] for j in order[:self.limit - (pinned is not None)]]
        return [pinned, *picked] if pinned is not None else picked


def cached_best(pool: Sequence[int], by_index: Mapping[int, InstanceLoad]) -> int | None:
    """The instance of `pool` with the longest cached prefix of the request (ties: fewest
    outstanding requests, then pool order), or None when no instance has a hit."""
    best: int | None = None
    best_key = (0, 0)
    for i in pool:
        ld = by_index[i]
        hit = ld.prefix_hit_tokens or 0
        if hit <= 0:
            continue
        key = (hit, -ld.outstanding_requests)
        if best is None or key > best_key:
            best, best_key = i, key
    return best


# -- scorers -------------------------------------------------------------------------------
class Scorer:
    """Costs of candidates (lower = better); candidates it cannot score are left out.

    reason: the decision's reason when this scorer alone decides ("lowest e2e").
    """

    name: ClassVar[str] = "scorer"
    reads: ClassVar[frozenset[str]] = NOTHING
    reason: str = "lowest score"

    def score(self, by_index: Mapping[int, InstanceLoad], candidates: Sequence[int],
              predictions: Mapping[int, LatencyEstimate]) -> dict[int, float]:
        raise NotImplementedError


class OutstandingScorer(Scorer):
    """Requests the dispatcher sent there that have not ended (the vLLM router / Envoy
    least-request signal). Weakness: blind to request size and KV state."""

    name = "outstanding"
    reason = "fewest outstanding requests"

    def score(self, by_index: Mapping[int, InstanceLoad], candidates: Sequence[int],
              predictions: Mapping[int, LatencyEstimate]) -> dict[int, float]:
        return {i: float(by_index[i].outstanding_requests) for i in candidates}


class LlumnixLoadScorer(Scorer):
    """Llumnix's load (the negative of its freeness), from the latest status; see
    `guided.LlumnixDispatch` for the two variants. Instances without status: unscored."""

    name = "llumnix_load"
    reads = frozenset({STATUS})
    reason = "lowest load"

    def __init__(self, variant: str, watermark_frac: float) -> None:
        self.variant = variant
        self.watermark_frac = watermark_frac

    def load(self, ld: InstanceLoad) -> float | None:
        """The instance's load (lower = freer), or None when its status is unknown."""
        if ld.kv_blocks_free is None or ld.num_running is None:
            return None
        need = ld.waiting_blocks_needed or 0
        if self.variant == "astrolabe":
            return -(ld.kv_blocks_free - need) / max(ld.num_running, 1)
        n = ld.num_running + (ld.num_waiting or 0)
        if n == 0:
            return -math.inf
        watermark = self.watermark_frac * (ld.kv_blocks_total or 0)
        return -(ld.kv_blocks_free - watermark - need) / n

    def score(self, by_index: Mapping[int, InstanceLoad], candidates: Sequence[int],
              predictions: Mapping[int, LatencyEstimate]) -> dict[int, float]:
        values = {}
        for i in candidates:
            v = self.load(by_index[i])
            if v is not None:
                values[i] = v
        return values


class LoadScorer(Scorer):
    """The load signal a prediction-guided policy falls back to where it has no usable
    prediction (a Predictor late, down, or its model's recent error too high): Llumnix-
    load (`LlumnixLoadScorer`, astrolabe variant) when every candidate has a status, else
    fewest outstanding requests. Why not outstanding alone: on a fleet whose instances
    differ in speed or queue shape it is the worst of the load signals measured
    (BENCHMARKS.md, "Model mismatch")."""

    name = "load"
    reads = frozenset({STATUS})
    reason = "lowest load"

    def __init__(self) -> None:
        self._llx = LlumnixLoadScorer("astrolabe", 0.0)

    def score(self, by_index: Mapping[int, InstanceLoad], candidates: Sequence[int],
              predictions: Mapping[int, LatencyEstimate]) -> dict[int, float]:
        values = self._llx.score(by_index, candidates, predictions)
        if len(values) == len(candidates):
            return values
        return {i: float(by_index[i].outstanding_requests) for i in candidates}


class PredictedLatencyScorer(Scorer):
    """The Predictor's look-ahead estimate of `objective` (e2e or ttft) on that instance,
    in units of TIE_RESOLUTION_S (1 µs) so float noise from different engine clocks
    (1e-14 s) is a tie, not a win. Candidates whose Predictor was late are unscored.
    Weakness: only as good as the length tagger and the Predictor."""

    name = "predicted_latency"
    reads = frozenset({PREDICTIONS})

    def __init__(self, objective: str) -> None:
        self.objective = objective
        self.reason = f"lowest {objective}"

    def score(self, by_index: Mapping[int, InstanceLoad], candidates: Sequence[int],
              predictions: Mapping[int, LatencyEstimate]) -> dict[int, float]:
        # in the order the predictions came (the tie-break draws index into it)
        ttft = self.objective == "ttft"
        return {j: round((p.ttft_s if ttft else p.e2e_s) / TIE_RESOLUTION_S) for j, p in predictions.items()}


# -- pickers -------------------------------------------------------------------------------
class Picker:
    """One instance from the scored candidates."""

    name: ClassVar[str] = "picker"
    reason: str = ""  # the decision's reason when no scorer decides

    def pick(self, candidates: Sequence[int], values: Mapping[int, float] | None, n_instances: int,
             rng: np.random.Generator) -> int:
        raise NotImplementedError


def pick_min(values: Mapping[int, float], rng: np.random.Generator, tolerance: float = 0.0) -> int:
    """Key with the lowest value; values within `tolerance` of it are ties, broken
    uniformly at random (one draw, only when there is a tie; in the mapping's order)."""
    best = min(values.values())
    tied = [k for k, v in values.items() if v <= best + tolerance]
    return tied[0] if len(tied) == 1 else tied[int(rng.integers(len(tied)))]


class MinScorePicker(Picker):
    """The lowest cost; costs within `tolerance` of it are ties, broken uniformly at
    random. Weakness (llm-d's): equal scores hot-spot without the random tie-break, so
    it is never skipped."""

    name = "min_score"

    def __init__(self, tolerance: float = 0.0) -> None:
        self.tolerance = tolerance

    def pick(self, candidates: Sequence[int], values: Mapping[int, float] | None, n_instances: int,
             rng: np.random.Generator) -> int:
        assert values, "MinScorePicker needs scores"
        return pick_min(values, rng, self.tolerance)


class UniformPicker(Picker):
    """A uniformly random candidate (always one draw)."""

    name = "uniform"
    reason = "uniform random"

    def pick(self, candidates: Sequence[int], values: Mapping[int, float] | None, n_instances: int,
             rng: np.random.Generator) -> int:
        return candidates[int(rng.integers(len(candidates)))]


class RoundRobinPicker(Picker):
    """The next candidate in index order after the last one picked (stateful: one per
    policy instance)."""

    name = "round_robin"
    reason = "next in turn"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[int], values: Mapping[int, float] | None, n_instances: int,
             rng: np.random.Generator) -> int:
        cand = set(candidates)
        for off in range(n_instances):
            i = (self._next + off) % n_instances
            if i in cand:
                self._next = (i + 1) % n_instances
                return i
        raise ValueError("no candidates")
