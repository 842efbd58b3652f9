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
from typing import Any

import numpy as np

from rps_astro_cli.registry import Registry
# defined with the wire vocabulary (rps_astro_cli.types); re-exported here
from rps_astro_cli.types import DispatchDecision, InstanceLoad, LatencyEstimate

DISPATCH_POLICIES: Registry[type[DispatchPolicy]] = Registry("dispatch policy")


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
