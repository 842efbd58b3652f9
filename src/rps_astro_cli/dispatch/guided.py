"""Load-aware and prediction-guided dispatch: `least_requests`, `llumnix`, `power_of_k`.

All three follow the two-call interface of `dispatch/base.py`, so the live scheduler
(`services/scheduler.py`, Predictor RPCs over HTTP with a deadline) and the virtual
cluster simulation (look-ahead called directly) share them.

Known weaknesses (each policy's docstring says more):
- `least_requests` is blind to request size: ten 2-token replies count like ten
  2,000-token ones.
- `llumnix` sees memory, not time: it cannot tell a long prefill queue from a short one
  once both fit in KV blocks, and its status is as old as the last poll.
- `power_of_k` is only as good as the length tagger and the Predictor; with small k it
  may miss the best instance (Astrolabe reports the Rank-1 pick 40–80% of the time).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rps_astro_cli.dispatch.base import DISPATCH_POLICIES, FEWEST_OUTSTANDING, DispatchPolicy, Fallback
from rps_astro_cli.dispatch.stages import (
    STATUS,
    TIE_RESOLUTION_S,
    HealthFilter,
    KvHeadroomFilter,
    LeastLoadedSampler,
    LlumnixLoadScorer,
    LoadScorer,
    PowerOfKSampler,
    PredictedLatencyScorer,
)
from rps_astro_cli.params import Param
from rps_astro_cli.types import InstanceLoad, LatencyEstimate

OBJECTIVES = ("e2e", "ttft")


@DISPATCH_POLICIES.register("least_requests")
class LeastRequests(DispatchPolicy):
    """Least outstanding requests (the vLLM router / Envoy baseline). The count is the
    dispatcher's own: requests it sent to an instance that have not yet ended.
    Pipeline: health → all → outstanding requests → min (random ties).
    Weakness: blind to request size and to the engine's KV state."""

    name = "least_requests"
    scorers = ((FEWEST_OUTSTANDING, 1.0),)


VARIANT = Param("variant", str, "astrolabe", "Llumnix load formula: astrolabe (the Llumnix- baseline) or code "
                "(Llumnix's released code)", choices=("astrolabe", "code"), alias="llumnix_variant")
WATERMARK_FRAC = Param("watermark_frac", float, 0.01, "code variant: KV blocks kept free, as a fraction of the "
                       "total (vLLM's 0.01)", ge=0.0, lt=1.0)


@DISPATCH_POLICIES.register("llumnix")
class LlumnixDispatch(DispatchPolicy):
    """Llumnix's load-aware dispatch without migration; pick the lowest load.

    Two variants (`variant=`), both over the engine's latest status:

    - ``"astrolabe"`` (default) — the Astrolabe authors' "Llumnix-" baseline, which equals
      the Llumnix paper's freeness F = (M − ΣV) / B with B the running batch size:
      ``load = −(kv_blocks_free − waiting_blocks_needed) / max(num_running, 1)``.
      Free blocks minus the full prompt demand of queued requests is M − ΣV (running
      requests' virtual usage is the blocks they hold). No watermark.
    - ``"code"`` — Llumnix's released code: ``load = −(kv_blocks_free − watermark −
      waiting_blocks_needed) / (num_running + num_waiting)``, ``−inf`` when the instance
      holds no request; watermark = `watermark_frac` × total blocks (vLLM's 0.01).

    The default is Llumnix- because the Astrolabe paper's tables compare against it
    (ARCHITECTURE.md §2). An instance whose status is unknown is skipped; if no candidate has a
    status the decision falls back to least outstanding requests.
    Pipeline: health → all → Llumnix load → min (random ties); fallback fewest
    outstanding over the candidates.
    Weakness: memory-only signal; a queue of long prefills that fits in KV looks free.
    """

    name = "llumnix"
    params = (VARIANT, WATERMARK_FRAC)
    fallback = Fallback(FEWEST_OUTSTANDING, "candidates", "fallback: no status; fewest outstanding")

    def __init__(self, variant: str = "astrolabe", watermark_frac: float = 0.01) -> None:
        self.variant = VARIANT.check(variant)
        self.watermark_frac = WATERMARK_FRAC.check(watermark_frac)
        self._load = LlumnixLoadScorer(self.variant, self.watermark_frac)
        self.scorers = ((self._load, 1.0),)

    def load(self, ld: InstanceLoad) -> float | None:
        """The instance's load (lower = freer), or None when its status is unknown."""
        return self._load.load(ld)


AUTO_FANOUT = 8  # k="auto": look-aheads per request at most (full fanout up to this fleet size)
K = Param("k", int, "auto", "instances sampled per request (power-of-k choices); 'all' = full fanout; 'auto' = "
          f"all up to {AUTO_FANOUT} instances, else the {AUTO_FANOUT} least loaded (the cached one first)", ge=1,
          keywords=("all", "auto"), alias="k")
PIN_CACHED = Param("pin_cached", bool, True, "always sample the instance holding the longest cached prefix of the "
                   "request (plus k − 1 at random); no effect on traffic without prefix-cache hits")
OBJECTIVE = Param("objective", str, "ttft", "the predicted latency minimised: e2e or ttft", choices=OBJECTIVES,
                  alias="objective")
KV_RESERVE_FRAC = Param("kv_reserve_frac", float, 0.1,
                        "consider only instances that keep this fraction of their KV blocks free after the "
                        "waiting queue's and this request's prompts (all when none does; 0 = off)",
                        ge=0.0, lt=1.0)
TIE_TOLERANCE_S = Param("tie_tolerance_s", float, 0.02,
                        "predictions within this many seconds of the best are ties, broken by the lowest "
                        "Llumnix- load (engine status), then at random (0 = exact ties only)", ge=0.0, le=60.0)


def parse_k(k: int | str) -> int | str | None:
    """`k` as an int ≥ 1, None for full fanout (`"all"`), or `"auto"`.

    Raises:
        AstroUserError: anything else (names the field `k`).
    """
    v = K.check(k)
    return None if v == "all" else v


@DISPATCH_POLICIES.register("power_of_k")
class PowerOfK(DispatchPolicy):
    """Astrolabe's randomized one-shot dispatch (ARCHITECTURE.md §2).

    The sampler picks k distinct healthy instances uniformly (`k="all"` or k ≥ the
    healthy count = full fanout; the default `k="auto"` is full fanout up to
    AUTO_FANOUT = 8 instances and beyond that the 8 least loaded by Llumnix- load,
    `stages.LeastLoadedSampler`, so the look-aheads per request stay bounded) — among
    the instances with KV headroom when `kv_reserve_frac` > 0
    (`stages.KvHeadroomFilter`); with `pin_cached` (default) one of them is the
    instance holding the longest cached prefix of the request, when any holds one
    (`PowerOfKSampler`); the caller asks those instances' Predictors for a
    `LatencyEstimate` in parallel, with a deadline; the scorer takes the predicted
    `objective` (``"ttft"`` default, or ``"e2e"``, the paper's) and the lowest wins; ties (within
    TIE_RESOLUTION_S = 1 µs, or `tie_tolerance_s`, then compared by Llumnix- load) are
    broken uniformly at random.

    Predicted lengths (issue 13, BENCHMARKS.md "Dispatch with predicted lengths"): with
    `k="all", objective="ttft", kv_reserve_frac=0.1, tie_tolerance_s=0.02` the
    Predictors decide where a prefill starts soonest — a timing question they answer
    well whatever the lengths — and the KV gate keeps requests off instances about to run
    out of blocks, where a look-ahead's view depends on the running requests' lengths.
    Predictors that were late or failed, or whose model's recent error is too high
    (`sim.calibration`), are unscored: the best predicted candidate and the unscored ones
    are compared by load (`stages.LoadScorer`: Llumnix- load where the status is known),
    and if none has a usable prediction, every healthy instance is. (The paper's Po2,
    which reads no status, falls back to least outstanding requests.)
    Pipeline: health [→ KV headroom] → power-of-k [+ cache pin] → predicted latency → min
    [within the tie tolerance: Llumnix- load] (random ties). The paper's Po2:
    `k=2, objective="e2e", kv_reserve_frac=0, tie_tolerance_s=0`.

    Raises (constructor):
        AstroUserError: k < 1 or not an int/"all"; unknown objective; kv_reserve_frac
            outside [0, 1).
    """

    name = "power_of_k"
    params = (K, OBJECTIVE, PIN_CACHED, KV_RESERVE_FRAC, TIE_TOLERANCE_S)
    fallback = Fallback(FEWEST_OUTSTANDING, "filtered", "fallback: no predictor answered; fewest outstanding")

    def __init__(self, k: int | str = "auto", objective: str = "ttft", pin_cached: bool = True,
                 kv_reserve_frac: float = 0.1, tie_tolerance_s: float = 0.02) -> None:
        self.k = parse_k(k)
        self.objective = OBJECTIVE.check(objective)
        self.pin_cached = PIN_CACHED.check(pin_cached)
        self.kv_reserve_frac = KV_RESERVE_FRAC.check(kv_reserve_frac)
        self.tie_tolerance_s = TIE_TOLERANCE_S.check(tie_tolerance_s)
        self._tie_load = LlumnixLoadScorer("astrolabe", 0.0)
        if self.kv_reserve_frac > 0:
            self.filters = (HealthFilter(), KvHeadroomFilter(self.kv_reserve_frac))
        self.sampler = (LeastLoadedSampler(AUTO_FANOUT, self.pin_cached) if self.k == "auto"
                        else PowerOfKSampler(self.k, self.pin_cached))  # type: ignore[arg-type]
        self.scorers = ((PredictedLatencyScorer(self.objective), 1.0),)
        if self.kv_reserve_frac > 0 or self.tie_tolerance_s > 0:
            # it reads the engines' status anyway: where predictions are missing or
            # untrusted, compare by load (Llumnix-), not by outstanding requests
            self.unanswered = LoadScorer()
            self.unanswered_reason = "fallback: a predictor did not answer; lowest load"
            self.fallback = Fallback(self.unanswered, "filtered", "fallback: no predictor answered; lowest load")

    def stage_inputs(self) -> frozenset[str]:
        """The stages' inputs, and the engines' status when ties are broken by load."""
        return super().stage_inputs() | ({STATUS} if self.tie_tolerance_s > 0 else set())

    def score(self, loads: Sequence[InstanceLoad], candidates: Sequence[int],
              predictions: Mapping[int, LatencyEstimate]) -> tuple[dict[int, float] | None, str]:
        """The predicted objective; with `tie_tolerance_s`, the candidates predicted within
        it of the best are scored by their Llumnix- load instead (unless none of them has
        a status)."""
        values, reason = super().score(loads, candidates, predictions)
        if not values or self.tie_tolerance_s <= 0 or not reason.startswith("lowest"):
            return values, reason
        best = min(values.values())
        near = [i for i, v in values.items() if v <= best + self.tie_tolerance_s / TIE_RESOLUTION_S]
        if len(near) < 2:
            return values, reason
        by_index = {ld.index: ld for ld in loads}
        tied = self._tie_load.score(by_index, near, predictions)
        if not tied:
            return values, reason
        return tied, f"{reason} within {self.tie_tolerance_s:g} s, then lowest Llumnix- load"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "k": "all" if self.k is None else self.k, "objective": self.objective,
                "pin_cached": self.pin_cached, "kv_reserve_frac": self.kv_reserve_frac,
                "tie_tolerance_s": self.tie_tolerance_s}


__all__ = ["AUTO_FANOUT", "LeastRequests", "LlumnixDispatch", "PowerOfK", "parse_k"]
