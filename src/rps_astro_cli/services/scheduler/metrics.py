"""The scheduler's Prometheus metrics (one registry per scheduler; `GET /metrics`).

- `astro:scheduler_requests_total{endpoint,outcome}` ok | client_error | engine_error |
  midstream_error | no_instance | client_disconnected.
- `astro:dispatch_decisions_total{policy,reason}`; `astro:dispatch_decide_seconds{policy}`
  (decision time incl. predict RPCs); `astro:predict_rpcs_total{policy,outcome}` (ok |
  timeout | error | skipped; per request exactly k for power_of_k, N for k=all;
  "skipped" = not sent, the Predictor's breaker is open; "in_process" = predicted in the
  scheduler's own process, `predict_in_process`); `astro:tag_rpcs_total{outcome}`;
  `astro:tokenize_rpcs_total{outcome}` (ok | timeout | error: an engine's `/tokenize`
  for a prompt's prefix hashes, `prompt_ids.py`).
- `astro:scheduler_overhead_seconds`: what the scheduler adds per request, engine time
  excluded (see the package docstring); `astro:scheduler_retries_total`.
- per instance: `astro:instance_healthy`, `astro:instance_outstanding_requests`,
  `astro:instance_dispatched_total`, `astro:breaker_trips_total`.
- router quality (what a dashboard of the dispatch reads; `record_outcome`):
  `astro:prediction_abs_error_seconds{instance,metric}` |predicted − observed| and
  `astro:prediction_rel_error{instance,metric}` |predicted − observed| / observed, for
  metric ttft and e2e (e2e not for early-dispatch decisions, whose look-aheads stop at
  the first token), per request that finished ok with a prediction for the chosen
  instance (observed: the scheduler's own forward → first chunk / end of stream, the same
  pairs `GET /decisions` holds, so Δsum/Δcount are the report's predictor MAE and MAPE);
  `astro:prediction_error_seconds{instance,metric}` (a summary of predicted − observed,
  signed: Δsum / Δcount is the bias); `astro:dispatch_stage_seconds{policy,stage}` per decision stage
  (tag: the front door's wait for the tagger; filter, sample, predict (the Predictor
  fan-out), score, pick: `DispatchDecision.stage_us`); `astro:dispatch_fallbacks_total
  {policy,reason}` — a decision the policy made without its signal (its "fallback: ..."
  reason) and `reason="no tag"` (the tag missed its deadline or failed: the default
  length was used), `reason="tokenize timeout"` | `"tokenize error"` | `"tokenize no
  engine"` (the engine's token ids of a prompt were wanted for its prefix hashes but did
  not come: the fallback tokenizer's were hashed, which a vLLM engine's cache never
  matches for a text prompt).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rps_astro_cli.services.http_common import new_registry

_FAST_BUCKETS_S = (2.5e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_ERROR_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_REL_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)


class SchedulerMetrics:
    """The metric objects, registered on `registry` (see module docstring)."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram, Summary

        self.registry = r = new_registry()
        fast = _FAST_BUCKETS_S
        self.requests = Counter("astro:scheduler_requests", "Front-door requests by outcome",
                                ["endpoint", "outcome"], registry=r)
        self.decisions = Counter("astro:dispatch_decisions", "Dispatch decisions", ["policy", "reason"], registry=r)
        self.decide = Histogram("astro:dispatch_decide_seconds", "Decision time incl. predict RPCs (s)",
                                ["policy"], buckets=fast, registry=r)
        self.predict_rpcs = Counter("astro:predict_rpcs", "Predict RPCs sent", ["policy", "outcome"], registry=r)
        self.tag_rpcs = Counter("astro:tag_rpcs", "Tag calls", ["outcome"], registry=r)
        self.tokenize_rpcs = Counter("astro:tokenize_rpcs", "Engine /tokenize calls for prefix hashes",
                                     ["outcome"], registry=r)
        self.overhead = Histogram("astro:scheduler_overhead_seconds", "Scheduler overhead per request (s)",
                                  buckets=fast, registry=r)
        self.retries = Counter("astro:scheduler_retries", "Requests retried on another instance", registry=r)
        self.healthy = Gauge("astro:instance_healthy", "1 if the instance is in rotation", ["instance"], registry=r)
        self.outstanding = Gauge("astro:instance_outstanding_requests", "Requests in flight", ["instance"], registry=r)
        self.dispatched = Counter("astro:instance_dispatched", "Requests sent", ["instance"], registry=r)
        self.trips = Counter("astro:breaker_trips", "Times the instance was taken out", ["instance"], registry=r)
        self.pred_abs = Histogram("astro:prediction_abs_error_seconds", "|predicted - observed| latency (s)",
                                  ["instance", "metric"], buckets=_ERROR_BUCKETS_S, registry=r)
        self.pred_rel = Histogram("astro:prediction_rel_error", "|predicted - observed| / observed",
                                  ["instance", "metric"], buckets=_REL_BUCKETS, registry=r)
        self.pred_signed = Summary("astro:prediction_error_seconds", "predicted - observed latency (s), signed",
                                   ["instance", "metric"], registry=r)
        # (metric, label values) → its child: `labels()` validates and locks on every call
        # (~3 µs; a decision touched ~11), a dict lookup does not
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self.stage = Histogram("astro:dispatch_stage_seconds", "Time per dispatch stage (s)", ["policy", "stage"],
                               buckets=_FAST_BUCKETS_S, registry=r)
        self.fallbacks = Counter("astro:dispatch_fallbacks", "Decisions made without the policy's signal",
                                 ["policy", "reason"], registry=r)
        self.refused = Counter("astro:admission_refused", "Requests refused at admission (HTTP 429) by reason",
                               ["policy", "reason", "slo_class"], registry=r)

    def child(self, metric: Any, *values: str) -> Any:
        """`metric.labels(*values)`, remembered: for the per-decision metrics, whose label
        values come from small fixed sets (policies, stages, outcomes, reasons)."""
        key = (metric, values)
        c = self._children.get(key)
        if c is None:
            c = metric.labels(*values)
            if len(self._children) < 4096:  # bounded, whatever the label values
                self._children[key] = c
        return c

    def record_decision(self, policy: str, reason: str, stage_us: Mapping[str, float]) -> None:
        """A decision's stage times and, when it fell back, its reason."""
        for stage, us in stage_us.items():
            self.child(self.stage, policy, stage).observe(us / 1e6)
        if reason.startswith("fallback:"):
            self.child(self.fallbacks, policy, reason[len("fallback:"):].split(";")[0].strip()).inc()

    def record_outcome(self, instance: str, predicted: dict[str, float | None],
                       observed: dict[str, float | None]) -> None:
        """Prediction error of a finished request on its instance: `predicted` /
        `observed` map "ttft" / "e2e" to seconds (None: not known)."""
        for metric, p in predicted.items():
            a = observed.get(metric)
            if p is None or a is None:
                continue
            err = p - a
            self.pred_abs.labels(instance, metric).observe(abs(err))
            self.pred_signed.labels(instance, metric).observe(err)
            if a > 0:
                self.pred_rel.labels(instance, metric).observe(abs(err) / a)
