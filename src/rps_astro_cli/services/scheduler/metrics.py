"""The scheduler's Prometheus metrics (one registry per scheduler; `GET /metrics`).

- `astro_scheduler_requests_total{endpoint,outcome}` ok | client_error | engine_error |
  midstream_error | no_instance | client_disconnected.
- `astro_dispatch_decisions_total{policy,reason}`; `astro_dispatch_decide_seconds{policy}`
  (decision time incl. predict RPCs); `astro_predict_rpcs_total{policy,outcome}` (ok |
  timeout | error | skipped; per request exactly k for power_of_k, N for k=all;
  "skipped" = not sent, the Predictor's breaker is open; "in_process" = predicted in the
  scheduler's own process, `predict_in_process`); `astro_tag_rpcs_total{outcome}`.
- `astro_scheduler_overhead_seconds`: what the scheduler adds per request, engine time
  excluded (see the package docstring); `astro_scheduler_retries_total`.
- per instance: `astro_instance_healthy`, `astro_instance_outstanding_requests`,
  `astro_instance_dispatched_total`, `astro_breaker_trips_total`.
"""

from __future__ import annotations

from rps_astro_cli.services.http_common import new_registry

_FAST_BUCKETS_S = (2.5e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class SchedulerMetrics:
    """The metric objects, registered on `registry` (see module docstring)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.registry = r = new_registry()
        fast = _FAST_BUCKETS_S
        self.requests = Counter("astro_scheduler_requests", "Front-door requests by outcome",
                                ["endpoint", "outcome"], registry=r)
        self.decisions = Counter("astro_dispatch_decisions", "Dispatch decisions", ["policy", "reason"], registry=r)
        self.decide = Histogram("astro_dispatch_decide_seconds", "Decision time incl. predict RPCs (s)",
                                ["policy"], buckets=fast, registry=r)
        self.predict_rpcs = Counter("astro_predict_rpcs", "Predict RPCs sent", ["policy", "outcome"], registry=r)
        self.tag_rpcs = Counter("astro_tag_rpcs", "Tag calls", ["outcome"], registry=r)
        self.overhead = Histogram("astro_scheduler_overhead_seconds", "Scheduler overhead per request (s)",
                                  buckets=fast, registry=r)
        self.retries = Counter("astro_scheduler_retries", "Requests retried on another instance", registry=r)
        self.healthy = Gauge("astro_instance_healthy", "1 if the instance is in rotation", ["instance"], registry=r)
        self.outstanding = Gauge("astro_instance_outstanding_requests", "Requests in flight", ["instance"], registry=r)
        self.dispatched = Counter("astro_instance_dispatched", "Requests sent", ["instance"], registry=r)
        self.trips = Counter("astro_breaker_trips", "Times the instance was taken out", ["instance"], registry=r)
