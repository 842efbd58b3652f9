"""Load-blind baselines: round-robin and uniform random."""

from __future__ import annotations

from rps_astro_cli.dispatch.base import DISPATCH_POLICIES, DispatchPolicy
from rps_astro_cli.dispatch.stages import RoundRobinPicker, UniformPicker


@DISPATCH_POLICIES.register("round_robin")
class RoundRobin(DispatchPolicy):
    """Cycle through healthy instances in index order. Pipeline: health → all → (no
    scorer) → next in turn. Weakness: blind to load and to request size, so long
    requests pile up by chance."""

    name = "round_robin"

    def __init__(self) -> None:
        self.picker = RoundRobinPicker()  # its turn is per policy instance


@DISPATCH_POLICIES.register("random")
class RandomDispatch(DispatchPolicy):
    """Uniform random healthy instance. Pipeline: health → all → (no scorer) → uniform.
    Weakness: blind to load; imbalance grows as √n by chance."""

    name = "random"
    picker = UniformPicker()
