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

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rps_astro_cli.dispatch.base import DISPATCH_POLICIES, DispatchDecision, DispatchPolicy, InstanceLoad, pick_min
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.sim.lookahead import LatencyEstimate

OBJECTIVES = ("e2e", "ttft")
TIE_RESOLUTION_S = 1e-6  # power_of_k: predictions closer than this are ties


def least_requests_choice(
    loads: Sequence[InstanceLoad], candidates: Sequence[int], rng: np.random.Generator
) -> int:
    """Candidate with the fewest outstanding requests (counted by the dispatcher
    itself); ties broken uniformly at random."""
    by_index = {ld.index: ld for ld in loads}
    return pick_min({i: float(by_index[i].outstanding_requests) for i in candidates}, rng)


@DISPATCH_POLICIES.register("least_requests")
class LeastRequests(DispatchPolicy):
    """Least outstanding requests (the vLLM router / Envoy baseline). The count is the
    dispatcher's own: requests it sent to an instance that have not yet ended.
    Weakness: blind to request size and to the engine's KV state."""

    name = "least_requests"

    def choose(self, loads: Sequence[InstanceLoad], candidates: Sequence[int],
               predictions: Mapping[int, LatencyEstimate], rng: np.random.Generator) -> DispatchDecision:
        i = least_requests_choice(loads, candidates, rng)
        return DispatchDecision(self.name, tuple(candidates), i, "fewest outstanding requests")


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
    (DESIGN.md §2). An instance whose status is unknown is skipped; if no candidate has a
    status the decision falls back to least outstanding requests.
    Weakness: memory-only signal; a queue of long prefills that fits in KV looks free.
    """

    name = "llumnix"
    needs_status = True

    def __init__(self, variant: str = "astrolabe", watermark_frac: float = 0.01) -> None:
        if variant not in ("astrolabe", "code"):
            raise AstroUserError(f"unknown llumnix variant {variant!r}", field="variant",
                                 fix="use 'astrolabe' (Llumnix-) or 'code'")
        if not 0.0 <= watermark_frac < 1.0:
            raise AstroUserError(f"must be in [0, 1), got {watermark_frac}", field="watermark_frac")
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

    def choose(self, loads: Sequence[InstanceLoad], candidates: Sequence[int],
               predictions: Mapping[int, LatencyEstimate], rng: np.random.Generator) -> DispatchDecision:
        by_index = {ld.index: ld for ld in loads}
        values = {}
        for i in candidates:
            v = self.load(by_index[i])
            if v is not None:
                values[i] = v
        if not values:
            i = least_requests_choice(loads, candidates, rng)
            return DispatchDecision(self.name, tuple(candidates), i, "fallback: no status; fewest outstanding")
        return DispatchDecision(self.name, tuple(candidates), pick_min(values, rng), "lowest load")

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "variant": self.variant, "watermark_frac": self.watermark_frac}


@DISPATCH_POLICIES.register("power_of_k")
class PowerOfK(DispatchPolicy):
    """Astrolabe's randomized one-shot dispatch (DESIGN.md §2).

    `candidates` samples k distinct healthy instances uniformly (`k="all"` or k ≥ the
    healthy count = full fanout); the caller asks those instances' Predictors for a
    `LatencyEstimate` in parallel, with a deadline; `choose` picks the lowest predicted
    `objective` (``"e2e"`` default, or ``"ttft"``); ties (within TIE_RESOLUTION_S = 1 µs)
    are broken uniformly at random.
    Predictors that were late or failed are absent from `predictions`; if none answered,
    the decision falls back to least outstanding requests over every healthy instance.

    Raises (constructor):
        AstroUserError: k < 1 or not an int/"all"; unknown objective.
    """

    name = "power_of_k"
    needs_predictions = True

    def __init__(self, k: int | str = 2, objective: str = "e2e") -> None:
        self.k = parse_k(k)
        if objective not in OBJECTIVES:
            raise AstroUserError(f"unknown objective {objective!r}", field="objective",
                                 fix=f"use one of: {', '.join(OBJECTIVES)}")
        self.objective = objective

    def candidates(self, loads: Sequence[InstanceLoad], rng: np.random.Generator) -> list[int]:
        pool = super().candidates(loads, rng)
        if self.k is None or self.k >= len(pool):
            return list(pool)
        picked = rng.choice(len(pool), size=self.k, replace=False)
        return [pool[int(j)] for j in picked]

    def choose(self, loads: Sequence[InstanceLoad], candidates: Sequence[int],
               predictions: Mapping[int, LatencyEstimate], rng: np.random.Generator) -> DispatchDecision:
        preds = {i: (p.ttft_s, p.e2e_s) for i, p in predictions.items()}
        if not predictions:
            pool = DispatchPolicy.candidates(self, loads, rng)
            i = least_requests_choice(loads, pool, rng)
            return DispatchDecision(self.name, tuple(candidates), i,
                                    "fallback: no predictor answered; fewest outstanding")
        key = 0 if self.objective == "ttft" else 1
        # Predictions within TIE_RESOLUTION_S are ties: float noise from different engine
        # clocks (1e-14 s) must not beat the random tie-break.
        i = pick_min({j: round(v[key] / TIE_RESOLUTION_S) for j, v in preds.items()}, rng)
        return DispatchDecision(self.name, tuple(candidates), i, f"lowest {self.objective}", preds)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "k": "all" if self.k is None else self.k, "objective": self.objective}


def parse_k(k: int | str) -> int | None:
    """`k` as an int ≥ 1, or None for full fanout (`"all"`).

    Raises:
        AstroUserError: anything else (names the field `k`).
    """
    if isinstance(k, str):
        if k.strip().lower() == "all":
            return None
        try:
            k = int(k)
        except ValueError:
            raise AstroUserError(f"must be an integer ≥ 1 or 'all', got {k!r}", field="k") from None
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise AstroUserError(f"must be an integer ≥ 1 or 'all', got {k!r}", field="k")
    return k
