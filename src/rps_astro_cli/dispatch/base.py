"""The dispatch-policy interface.

A dispatch is two calls, so the same policy runs in the async live scheduler (which
queries Predictor sidecars over HTTP with a deadline) and in the synchronous virtual
cluster simulation (which calls the look-ahead directly):

1. `candidates(loads, rng)` → indices of instances to consider (power-of-k samples k
   distinct healthy ones; load-based policies return every healthy one). If
   `needs_predictions`, the caller obtains a `LatencyEstimate` for each candidate.
2. `choose(loads, candidates, predictions, rng)` → a `DispatchDecision`.
   `predictions` maps instance index → estimate for those that answered in time
   (late/failed ones are simply absent).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rps_astro_cli.registry import Registry
from rps_astro_cli.sim.lookahead import LatencyEstimate

DISPATCH_POLICIES: Registry[type[DispatchPolicy]] = Registry("dispatch policy")


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """What the dispatcher knows of one instance without predicting.

    index: position in the cluster's instance list.
    healthy: passes health checks (circuit breaker closed).
    outstanding_requests: requests the dispatcher sent there that have not ended.
    kv_blocks_free / kv_blocks_total: from the latest status (None if unknown).
    num_running / num_waiting: from the latest status (None if unknown).
    waiting_blocks_needed: KV blocks the waiting queue needs for its prompts (None if
        unknown).
    """

    index: int
    healthy: bool = True
    outstanding_requests: int = 0
    kv_blocks_free: int | None = None
    kv_blocks_total: int | None = None
    num_running: int | None = None
    num_waiting: int | None = None
    waiting_blocks_needed: int | None = None


@dataclass(frozen=True)
class DispatchDecision:
    """One dispatch decision.

    policy: the policy's name. candidates: instance indices considered.
    predictions: index → (ttft_s, e2e_s) for candidates that answered.
    choice: the chosen instance index. reason: short text ("lowest e2e",
    "fallback: no predictor answered", ...). decide_us: microseconds spent deciding
    (filled by the caller, which also times the RPCs).
    """

    policy: str
    candidates: tuple[int, ...]
    choice: int
    reason: str
    predictions: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    decide_us: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "candidates": list(self.candidates),
            "predictions": {str(k): {"ttft_s": v[0], "e2e_s": v[1]} for k, v in self.predictions.items()},
            "choice": self.choice,
            "reason": self.reason,
            "decide_us": self.decide_us,
        }


class DispatchPolicy:
    """Base class; register subclasses with `@DISPATCH_POLICIES.register(name)`."""

    name = "base"
    needs_predictions = False
    needs_status = False

    def candidates(self, loads: Sequence[InstanceLoad], rng: np.random.Generator) -> list[int]:
        """Instances to consider: every healthy one by default (all if none is healthy)."""
        healthy = [ld.index for ld in loads if ld.healthy]
        return healthy or [ld.index for ld in loads]

    def choose(
        self,
        loads: Sequence[InstanceLoad],
        candidates: Sequence[int],
        predictions: Mapping[int, LatencyEstimate],
        rng: np.random.Generator,
    ) -> DispatchDecision:
        raise NotImplementedError

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


def make_dispatch(name: str, **params: Any) -> DispatchPolicy:
    """Instantiate a registered dispatch policy.

    Raises:
        AstroUserError: unknown name (lists the valid ones).
    """
    return DISPATCH_POLICIES.get(name)(**params)


def pick_min(values: Mapping[int, float], rng: np.random.Generator) -> int:
    """Key with the lowest value; ties broken uniformly at random."""
    best = min(values.values())
    tied = [k for k, v in values.items() if v == best]
    return tied[0] if len(tied) == 1 else tied[int(rng.integers(len(tied)))]
