"""The predict client: one `POST /predict` per candidate instance to its Predictor, in
parallel, with a deadline, and a breaker per Predictor.

Bodies are `rps_astro_cli.types`' codec (`PredictRequest` out, `PredictReply` back),
the same the Predictor decodes and encodes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace

from rps_astro_cli.services.scheduler.clients import Clients, swallow
from rps_astro_cli.services.scheduler.instances import Instances, InstanceState, pending_wire
from rps_astro_cli.services.scheduler.metrics import SchedulerMetrics
from rps_astro_cli.services.scheduler.settings import SchedulerSettings
from rps_astro_cli.types import LatencyEstimate, PredictReply, PredictRequest

log = logging.getLogger("astro.scheduler")


class PredictClient:
    """Predictions of a candidate on a set of instances (see module docstring)."""

    def __init__(self, settings: SchedulerSettings, instances: Instances, clients: Clients,
                 metrics: SchedulerMetrics, policy_name: str):
        self.s = settings
        self.instances = instances
        self.clients = clients
        self.m = metrics
        self.policy_name = policy_name

    async def _predict_one(self, url: str, payload: bytes) -> LatencyEstimate:
        status, body = await self.clients.post_json(url, "/predict", payload)
        if status != 200:
            raise ValueError(f"predictor answered {status}")
        return PredictReply.from_dict(json.loads(body)).estimate()

    async def predict_many(self, candidates: list[int], query: PredictRequest,
                           cached: dict[int, int] | None = None) -> dict[int, LatencyEstimate]:
        """Predictions of `query`'s candidate on each instance whose Predictor answers
        within `predict_deadline_s` (`cached`: instance index → the candidate's prefix-cache
        hit there, tokens, sent as its `cached_tokens` to that Predictor); late ones are
        left to finish in the background, failed ones skipped. A Predictor that missed
        `predictor_breaker_failures` RPCs in a row is not asked for `predictor_breaker_s`
        (outcome "skipped"), so a hung sidecar does not cost every request the full
        deadline; then it is probed again."""
        payload = json.dumps(query.to_dict()).encode()
        tasks: dict[asyncio.Task, int] = {}
        states: dict[int, InstanceState] = {}  # held here: discovery may drop one while we wait
        now = time.monotonic()
        for i in candidates:
            st = states[i] = self.instances[i]
            if not st.ep.predictor_url:
                continue
            if st.predictor_skip_until > now:
                self.m.predict_rpcs.labels(self.policy_name, "skipped").inc()
                continue
            body = payload
            q = query
            hit = cached.get(i) if cached else None
            if hit:
                q = replace(q, candidate=replace(q.candidate, cached_tokens=hit))
            if self.s.count_pending and st.pending:  # this engine's not-yet-visible requests
                q = replace(q, pending=pending_wire(st.pending, now, self.s.pending_keep_s))
            if q is not query:
                body = json.dumps(q.to_dict()).encode()
            tasks[asyncio.ensure_future(self._predict_one(st.ep.predictor_url, body))] = i
        if not tasks:
            return {}
        done, pending = await asyncio.wait(tasks, timeout=self.s.predict_deadline_s)
        out: dict[int, LatencyEstimate] = {}
        for t in pending:  # late: skipped; left to finish in the background
            t.add_done_callback(swallow)
            self.m.predict_rpcs.labels(self.policy_name, "timeout").inc()
            self._failed(states[tasks[t]], f"no answer within the {self.s.predict_deadline_s * 1e3:.0f} ms deadline")
        for t in done:
            exc = t.exception()
            if exc is None:
                out[tasks[t]] = t.result()
                self.m.predict_rpcs.labels(self.policy_name, "ok").inc()
                states[tasks[t]].predictor_failures = 0
                states[tasks[t]].predictor_error = None
            else:
                outcome = "timeout" if isinstance(exc, asyncio.TimeoutError) else "error"
                self.m.predict_rpcs.labels(self.policy_name, outcome).inc()
                self._failed(states[tasks[t]], f"{outcome}: {type(exc).__name__}: {exc}"[:200])
        return out

    def _failed(self, st: InstanceState, why: str) -> None:
        st.predictor_error = why
        st.predictor_error_at = time.monotonic()
        st.predictor_failures += 1
        if st.predictor_failures >= self.s.predictor_breaker_failures:
            st.predictor_failures = 0
            st.predictor_skip_until = time.monotonic() + self.s.predictor_breaker_s
            log.warning("predictor of %s missed %d RPCs in a row; not asked for %.1f s", st.ep.name,
                        self.s.predictor_breaker_failures, self.s.predictor_breaker_s)
