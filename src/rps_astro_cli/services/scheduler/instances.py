"""What the scheduler tracks per instance, and the circuit breaker that takes an
instance out of rotation."""

from __future__ import annotations

import logging

from rps_astro_cli.services.scheduler.metrics import SchedulerMetrics
from rps_astro_cli.services.scheduler.settings import InstanceEndpoint
from rps_astro_cli.types import InstanceLoad

log = logging.getLogger("astro.scheduler")


class InstanceState:
    """One instance's live state (mutable, event-loop only)."""

    __slots__ = ("index", "ep", "healthy", "outstanding", "load_fields", "dispatched",
                 "predictor_failures", "predictor_skip_until")

    def __init__(self, index: int, ep: InstanceEndpoint):
        self.index = index  # position in the scheduler's instance list
        self.ep = ep
        self.healthy = True  # circuit breaker closed
        self.outstanding = 0  # requests forwarded there that have not ended
        self.dispatched = 0  # requests forwarded there in all
        self.load_fields: dict[str, int] = {}  # `InstanceLoad.status_fields` of its latest /status
        self.predictor_failures = 0  # consecutive late/failed predict RPCs
        self.predictor_skip_until = 0.0  # time.monotonic() until which its Predictor is not asked

    def load(self, excluded: frozenset[int] = frozenset()) -> InstanceLoad:
        """Its `InstanceLoad`; unhealthy when `excluded` holds it (a retry's failed one)."""
        return InstanceLoad(self.index, self.healthy and self.index not in excluded, self.outstanding,
                            **self.load_fields)


class Instances:
    """The instances in index order, with their circuit breakers and gauges."""

    def __init__(self, endpoints: tuple[InstanceEndpoint, ...], metrics: SchedulerMetrics):
        self.all = [InstanceState(i, ep) for i, ep in enumerate(endpoints)]
        self.m = metrics
        for st in self.all:
            metrics.healthy.labels(st.ep.name).set(1)
            metrics.outstanding.labels(st.ep.name).set(0)

    def __getitem__(self, index: int) -> InstanceState:
        return self.all[index]

    def __iter__(self):
        return iter(self.all)

    def __len__(self) -> int:
        return len(self.all)

    def mark_failed(self, st: InstanceState, why: str) -> None:
        """Open the circuit breaker of `st` (out of rotation until a health check passes)."""
        if st.healthy:
            st.healthy = False
            self.m.healthy.labels(st.ep.name).set(0)
            self.m.trips.labels(st.ep.name).inc()
            log.warning("instance %s taken out: %s", st.ep.name, why)

    def mark_ok(self, st: InstanceState) -> None:
        """Close the circuit breaker of `st` (back in rotation)."""
        if not st.healthy:
            st.healthy = True
            self.m.healthy.labels(st.ep.name).set(1)
            log.warning("instance %s readmitted", st.ep.name)

    def acquire(self, st: InstanceState) -> None:
        """Count a request forwarded to `st`."""
        st.outstanding += 1
        st.dispatched += 1
        self.m.outstanding.labels(st.ep.name).set(st.outstanding)
        self.m.dispatched.labels(st.ep.name).inc()

    def release(self, st: InstanceState) -> None:
        """Count the end of a request forwarded to `st`."""
        st.outstanding -= 1
        self.m.outstanding.labels(st.ep.name).set(st.outstanding)
