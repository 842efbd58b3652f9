"""The predict client: one `POST /predict` per candidate instance to its Predictor, in
parallel, with a deadline, and a breaker per Predictor; or, with `predict_in_process`,
for an instance without a Predictor URL, the same look-ahead here (one
`services.predictor.Predictor` per engine, fed the scheduler's own `/status` polls),
after the RPCs went out.

Bodies are `rps_astro_cli.protocol.service_wire`'s codec (`PredictRequest` out,
`PredictReply` back), the same the Predictor decodes and encodes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import replace
from typing import Any

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.protocol.service_wire import PredictReply, PredictRequest
from rps_astro_cli.services.predictor import Predictor, PredictorSettings, with_pending
from rps_astro_cli.services.rpc import RpcError
from rps_astro_cli.services.scheduler.clients import Clients, swallow
from rps_astro_cli.services.scheduler.instances import Instances, InstanceState, pending_wire
from rps_astro_cli.services.scheduler.metrics import SchedulerMetrics
from rps_astro_cli.services.scheduler.settings import SchedulerSettings
from rps_astro_cli.types import InstanceStatus, LatencyEstimate

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
        self._local: dict[str, Predictor] = {}  # engine URL → in-process Predictor

    def local_predictor(self, st: InstanceState) -> Predictor:
        """The in-process Predictor of `st`'s engine (made on first use). Its status cache
        outlives one status poll period, so the poll keeps it fresh without fetches of its own."""
        pred = self._local.get(st.ep.engine_url)
        if pred is None:
            cache_s = self.s.status_interval_s + 0.05
            pred = self._local[st.ep.engine_url] = Predictor(PredictorSettings(
                st.ep.engine_url, status_cache_s=cache_s, status_max_age_s=max(0.25, 2 * cache_s),
                profile=st.ep.profile or self.s.profile, default_output_tokens=self.s.default_output_tokens,
                internal_token=self.s.internal_token, calibration=self.s.calibration))
        if st.status is not None:
            pred.adopt(st.status, st.status_s)
        return pred

    def local_calibration(self, st: InstanceState) -> dict[str, Any] | None:
        """`st`'s in-process Predictor's step calibration (`CalibrationState.to_dict`), or
        None (no in-process Predictor, or no status seen yet)."""
        pred = self._local.get(st.ep.engine_url)
        return None if pred is None or pred.calibration is None else pred.calibration.to_dict()

    @staticmethod
    def _estimate(pred: Predictor, held: tuple[InstanceStatus, float], q: PredictRequest) -> LatencyEstimate | None:
        """`pred`'s look-ahead of `q` on its `held` (status, age s); None when its step
        model is not trusted now."""
        if not pred.trusted:
            return None
        status, age_s = held
        return pred.predict(status, q.candidate, with_pending(status, q.pending, age_s), q.first_token_only)

    async def _predict_local(self, st: InstanceState, q: PredictRequest) -> LatencyEstimate | None:
        pred = self.local_predictor(st)
        return self._estimate(pred, await pred.status(), q)

    async def _predict_one(self, url: str, payload: bytes) -> LatencyEstimate | None:
        """The Predictor's estimate; None when it says its model is not trusted now."""
        status, body = await self.clients.post_json(url, "/predict", payload)
        if status != 200:
            raise ValueError(f"predictor answered {status}")
        reply = PredictReply.from_dict(json.loads(body))
        return reply.estimate() if reply.trusted else None

    async def predict_many(self, candidates: list[int], query: PredictRequest,
                           cached: dict[int, int] | None = None,
                           untrusted: list[int] | None = None) -> dict[int, LatencyEstimate]:
        """Predictions of `query`'s candidate on each instance whose Predictor answers
        within `predict_deadline_s` (`cached`: instance index → the candidate's prefix-cache
        hit there, tokens, sent as its `cached_tokens` to that Predictor); late ones are
        left to finish in the background, failed ones skipped. A Predictor that missed
        `predictor_breaker_failures` RPCs in a row is not asked for `predictor_breaker_s`
        (outcome "skipped"), so a hung sidecar does not cost every request the full
        deadline; then it is probed again. A Predictor whose step model is not trusted
        (`sim.calibration`) answers, but its estimate is left out (outcome "untrusted",
        its index appended to `untrusted`): the policy compares that instance by load."""
        payload = b""  # the query's body, encoded once a sidecar is asked it unchanged
        tasks: dict[asyncio.Task[LatencyEstimate | None], int] = {}
        states: dict[int, InstanceState] = {}  # held here: discovery may drop one while we wait
        now = time.monotonic()
        local: list[tuple[int, PredictRequest]] = []
        for i in candidates:
            st = states[i] = self.instances[i]
            if not st.ep.predictor_url and not self.s.predict_in_process:
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
            if not st.ep.predictor_url:
                local.append((i, q))
                continue
            if q is not query:
                body = json.dumps(q.to_dict()).encode()
            elif not payload:
                body = payload = json.dumps(query.to_dict()).encode()
            tasks[asyncio.ensure_future(self._predict_one(st.ep.predictor_url, body))] = i
        out: dict[int, LatencyEstimate] = {}
        if local:  # after the RPCs went out: the look-aheads run while the sidecars work
            # in one go, not as tasks, while each in-process Predictor holds a usable status
            # (the status poll keeps it so): a decision that yields to the event loop between
            # its look-aheads has every other request's ready work timed inside it
            got: list[LatencyEstimate | None | BaseException] = []
            waiting = []  # those whose Predictor must wait for a status fetch first
            for k, (i, q) in enumerate(local):
                pred = self.local_predictor(states[i])
                held = pred.status_now()
                if held is None:
                    waiting.append(k)
                    got.append(None)
                    continue
                try:
                    got.append(self._estimate(pred, held, q))
                except Exception as failed:  # noqa: BLE001 - judged below, as the awaited path's are
                    got.append(failed)
            if waiting:
                fetched = await asyncio.gather(*(asyncio.wait_for(self._predict_local(states[local[k][0]], local[k][1]),
                                                                  self.s.predict_deadline_s) for k in waiting),
                                               return_exceptions=True)
                for k, est in zip(waiting, fetched):
                    got[k] = est
            for (i, _), est in zip(local, got):
                if est is None:
                    self._untrusted(i, states[i], untrusted)
                elif isinstance(est, LatencyEstimate):
                    out[i] = est
                    self.m.child(self.m.predict_rpcs, self.policy_name, "in_process").inc()
                    states[i].predictor_failures = 0
                    states[i].predictor_error = None
                elif isinstance(est, (TimeoutError, RpcError, AstroUserError, ValueError, OSError)):
                    outcome = "timeout" if isinstance(est, TimeoutError) else "error"
                    self.m.predict_rpcs.labels(self.policy_name, outcome).inc()
                    self._failed(states[i], f"in-process {outcome}: {type(est).__name__}: {est}"[:200])
                elif isinstance(est, BaseException):
                    raise est
        if not tasks:
            return out
        done, pending = await asyncio.wait(tasks, timeout=self.s.predict_deadline_s)
        for t in pending:  # late: skipped; left to finish in the background
            t.add_done_callback(swallow)
            self.m.predict_rpcs.labels(self.policy_name, "timeout").inc()
            self._failed(states[tasks[t]], f"no answer within the {self.s.predict_deadline_s * 1e3:.0f} ms deadline")
        for t in done:
            exc = t.exception()
            if exc is None:
                est = t.result()
                if est is None:
                    self._untrusted(tasks[t], states[tasks[t]], untrusted)
                    continue
                out[tasks[t]] = est
                self.m.child(self.m.predict_rpcs, self.policy_name, "ok").inc()
                states[tasks[t]].predictor_failures = 0
                states[tasks[t]].predictor_error = None
            else:
                outcome = "timeout" if isinstance(exc, asyncio.TimeoutError) else "error"
                self.m.predict_rpcs.labels(self.policy_name, outcome).inc()
                self._failed(states[tasks[t]], f"{outcome}: {type(exc).__name__}: {exc}"[:200])
        return out

    def _untrusted(self, i: int, st: InstanceState, untrusted: list[int] | None) -> None:
        self.m.predict_rpcs.labels(self.policy_name, "untrusted").inc()
        st.predictor_failures = 0
        st.predictor_error = None
        if untrusted is not None:
            untrusted.append(i)

    def _failed(self, st: InstanceState, why: str) -> None:
        st.predictor_error = why
        st.predictor_error_at = time.monotonic()
        st.predictor_failures += 1
        if st.predictor_failures >= self.s.predictor_breaker_failures:
            st.predictor_failures = 0
            st.predictor_skip_until = time.monotonic() + self.s.predictor_breaker_s
            log.warning("predictor of %s missed %d RPCs in a row; not asked for %.1f s", st.ep.name,
                        self.s.predictor_breaker_failures, self.s.predictor_breaker_s)
