"""Load-blind baselines: round-robin and uniform random."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from rps_astro_cli.dispatch.base import DISPATCH_POLICIES, DispatchDecision, DispatchPolicy, InstanceLoad
from rps_astro_cli.sim.lookahead import LatencyEstimate


@DISPATCH_POLICIES.register("round_robin")
class RoundRobin(DispatchPolicy):
    """Cycle through healthy instances in index order. Weakness: blind to load and to
    request size, so long requests pile up by chance."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, loads: Sequence[InstanceLoad], candidates: Sequence[int],
               predictions: Mapping[int, LatencyEstimate], rng: np.random.Generator) -> DispatchDecision:
        n = len(loads)
        cand = set(candidates)
        for off in range(n):
            i = (self._next + off) % n
            if i in cand:
                self._next = (i + 1) % n
                return DispatchDecision(self.name, tuple(candidates), i, "next in turn")
        raise ValueError("no candidates")


@DISPATCH_POLICIES.register("random")
class RandomDispatch(DispatchPolicy):
    """Uniform random healthy instance."""

    name = "random"

    def choose(self, loads: Sequence[InstanceLoad], candidates: Sequence[int],
               predictions: Mapping[int, LatencyEstimate], rng: np.random.Generator) -> DispatchDecision:
        i = candidates[int(rng.integers(len(candidates)))]
        return DispatchDecision(self.name, tuple(candidates), i, "uniform random")
