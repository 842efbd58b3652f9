"""FCFS: vLLM's default policy."""

from __future__ import annotations

from collections.abc import Sequence

from rps_astro_cli.sim.policy import INSTANCE_POLICIES, InstancePolicy
from rps_astro_cli.sim.request import SimRequest


@INSTANCE_POLICIES.register("fcfs")
class FCFSPolicy(InstancePolicy):
    """First come, first served (vLLM V1 default): the waiting queue in its own order
    (arrival order, preempted requests put back at the front); preempt the request
    scheduled last."""

    name = "fcfs"
    time_dependent = False

    def order_waiting(self, waiting: Sequence[SimRequest], now_s: float) -> list[SimRequest]:
        return list(waiting)

    def preemption_victim(self, running: Sequence[SimRequest], now_s: float) -> SimRequest:
        return running[-1]
