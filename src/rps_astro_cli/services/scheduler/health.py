"""Health checks: readmit instances whose circuit breaker opened, poll `/status` for
status-based policies, check each instance's Predictor (`/health`), and learn the served
model names.

A connection error or timeout on the hot path marks an instance unhealthy at once
(`Instances.mark_failed`); this loop re-checks the broken ones every
`recheck_interval_s` and every instance every `health_interval_s` (`GET /health`), or
every `status_interval_s` with `GET /status` when the policy reads engine status
(llumnix) or prefix-cache hits (cache_aware, power_of_k's cache pin), storing the
status's `InstanceLoad` fields. The Predictors' and the tagger's `/health` are asked every
`health_interval_s` only, also under a status-based policy (at the status period they
were a third of the scheduler's CPU on a 4-instance fleet: 50 httpx calls/s); for the
hits it asks `?prefix_since=N` and applies the engine's change of cached block hashes
to the instance's `PrefixMirror` (an engine that does not answer `prefix_cache` leaves
it empty: no hits). Under `prefix_tokenizer` auto it also asks each engine's `GET
/version` until one answer tells its kind (astro sim engine or not: `prompt_ids.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from rps_astro_cli.dispatch.loads import status_fields_of
from rps_astro_cli.services.predictor import Predictor
from rps_astro_cli.services.rpc import RpcError
from rps_astro_cli.services.scheduler.clients import Clients
from rps_astro_cli.services.scheduler.instances import Instances, InstanceState, late_lengths_onto
from rps_astro_cli.services.scheduler.prompt_ids import engine_kind_of_version
from rps_astro_cli.services.scheduler.settings import SchedulerSettings
from rps_astro_cli.services.scheduler.tagging import TagClient
from rps_astro_cli.types import InstanceStatus

log = logging.getLogger("astro.scheduler")


# a failed predict RPC's error stays on /health until a predict RPC succeeds, or until the
# Predictor's /health passes with no predict RPC failing for this long (no traffic to
# clear it: a transient deadline miss must not leave /health degraded for ever)
PREDICT_ERROR_STALE_S = 5.0


class HealthMonitor:
    """The background checks (see module docstring). `models` is filled from the first
    engine's `/v1/models` when the settings name none."""

    def __init__(self, settings: SchedulerSettings, instances: Instances, clients: Clients,
                 needs_status: bool, models: set[str], tags: TagClient | None = None, needs_prefix: bool = False,
                 probe_version: bool = False, local: Callable[[InstanceState], Predictor] | None = None,
                 learn_policy: bool = False):
        self.s = settings
        # without status polls, ask each engine's /status once (again after a failure) for
        # the in-instance policy it names (`InstanceState.engine_policy`: the late tag's)
        self.learn_policy = learn_policy
        # `predict_in_process`: an instance's in-process Predictor, fed each status poll with
        # the engine's steps since its last one (its online calibration)
        self.local = local
        self.tags = tags  # the TagClient whose tagger service is health-checked with the instances
        self.instances = instances
        self.clients = clients
        self.needs_status = needs_status or needs_prefix
        self.needs_prefix = needs_prefix
        self.models = models
        # learn each engine's kind from its GET /version, once (prefix_tokenizer auto)
        self.probe_version = probe_version
        self._task: asyncio.Task[None] | None = None

    async def check(self, st: InstanceState, with_predictor: bool = True) -> None:
        """One health check of `st` (status poll for status-based policies), and of its
        Predictor when `with_predictor`."""
        try:
            if self.needs_status:  # polled every status_interval_s: the lean client
                asked_s = time.monotonic()
                local = self.local(st) if self.local is not None and not st.ep.predictor_url else None
                query = [f"prefix_since={st.prefix.seq}"] if self.needs_prefix else []
                if local is not None:
                    query.append(f"steps_since={local.steps_seq}")
                path = "/status?" + "&".join(query) if query else "/status"
                async with asyncio.timeout(self.s.health_timeout_s):
                    resp = await self.clients.pool(st.ep.engine_url).request("GET", path)
                    body = await resp.read()
                if resp.status != 200:
                    raise ValueError(f"/status answered {resp.status}")
                d = json.loads(body)
                if st.late_lengths and isinstance(d, dict):  # forwarded before their tag: the tag's lengths
                    late_lengths_onto(d, st.late_lengths)
                status = InstanceStatus.from_dict(d)
                st.load_row = status_fields_of(status)
                st.status_s = asked_s
                st.status = status
                st.engine_policy = str(status.policy.get("name") or "")
                st.block_size = status.limits.block_size
                if local is not None:
                    await local.take(status, d.get("steps"), asked_s)
                if self.needs_prefix:
                    st.prefix_caching = isinstance(d.get("prefix_cache"), dict)
                    if st.prefix_caching:
                        st.prefix.apply(d["prefix_cache"])
            else:
                code, _ = await self.clients.get(st.ep.engine_url, "/health", self.s.health_timeout_s)
                if code != 200:
                    raise ValueError(f"/health answered {code}")
                if self.learn_policy and st.engine_policy is None:
                    await self.probe_policy(st)
            if self.probe_version and st.engine_kind is None:
                await self.probe_kind(st)
            if not self.models:
                code, body = await self.clients.get(st.ep.engine_url, "/v1/models")
                if code == 200:
                    self.models.update(m["id"] for m in json.loads(body).get("data", ()) if "id" in m)
        except (TimeoutError, RpcError, ValueError, KeyError, TypeError, AttributeError) as exc:
            self.instances.mark_failed(st, f"health check: {exc!r}")
        else:
            self.instances.mark_ok(st)
        if st.ep.predictor_url and with_predictor:
            await self.check_predictor(st)

    async def probe_kind(self, st: InstanceState) -> None:
        """`GET /version` of `st`'s engine → `st.engine_kind` (`prompt_ids.engine_kind_of_version`);
        a failed call leaves it unknown, asked again at the next check, and is not a
        health failure (the engine answered its health check)."""
        try:
            code, body = await self.clients.get(st.ep.engine_url, "/version")
        except (TimeoutError, RpcError):
            return
        st.engine_kind = engine_kind_of_version(code, body)

    async def probe_policy(self, st: InstanceState) -> None:
        """`GET /status` of `st`'s engine → `st.engine_policy` (the name its `policy`
        object gives; "" when it answers no such object, e.g. a 404 from an engine with no
        /status); a failed call leaves it unknown, asked again at the next check."""
        try:
            code, body = await self.clients.get(st.ep.engine_url, "/status", self.s.health_timeout_s)
        except (TimeoutError, RpcError):
            return
        name = ""
        if code == 200:
            try:
                policy = json.loads(body).get("policy")
            except (ValueError, AttributeError):
                policy = None
            if isinstance(policy, dict) and isinstance(policy.get("name"), str):
                name = policy["name"]
        elif code >= 500:
            return
        st.engine_policy = name

    async def check_predictor(self, st: InstanceState) -> None:
        """`GET /health` of `st`'s Predictor: a failure, or a body whose status is not
        "ok" (its engine's /status fails), is recorded as its `predictor_error` (shown by
        `/health` and `/instances`); a pass clears only an error a health check set (a
        failed predict RPC is cleared by the next one that succeeds)."""
        url = st.ep.predictor_url
        assert url is not None  # the callers ask only instances with a Predictor
        why = None
        try:
            code, raw = await self.clients.get(url, "/health")
            if code != 200:
                why = f"/health answered {code}"
            else:
                body = json.loads(raw)
                if body.get("status") != "ok":
                    why = f"reports {body.get('status')!r}: {body.get('problem') or 'no reason given'}"
        except (TimeoutError, RpcError, ValueError, AttributeError) as exc:
            why = repr(exc)
        if why is not None:
            if st.predictor_error is None:
                log.warning("predictor of %s: %s", st.ep.name, why)
            st.predictor_error = f"health check: {why}"[:200]
        elif st.predictor_error is not None and (
                st.predictor_error.startswith("health check")
                or time.monotonic() - st.predictor_error_at > PREDICT_ERROR_STALE_S):
            st.predictor_error = None

    async def check_all(self, with_services: bool = True) -> None:
        """Check every instance; with `with_services` also every Predictor and the tagger."""
        await asyncio.gather(*(self.check(st, with_services) for st in self.instances),
                             *([self.tags.check()] if self.tags is not None and with_services else []))

    async def start(self) -> None:
        """Check every instance once, then run the loop in the background."""
        await self.check_all()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _recheck_predictors(self) -> None:
        """Re-check the Predictors a health check found failing (fast readmission). One
        whose error came from a predict RPC is not asked: the next predict RPC clears
        it, or the full check after `PREDICT_ERROR_STALE_S` (asking every tick cost the
        scheduler more CPU than its requests while a busy host made RPCs late). The
        tagger is asked at the full period only: every request tries it anyway."""
        broken = [st for st in self.instances if st.ep.predictor_url and st.predictor_error is not None
                  and st.predictor_error.startswith("health check")]
        if broken:
            await asyncio.gather(*(self.check_predictor(st) for st in broken))

    async def _loop(self) -> None:
        """Every `recheck_interval_s`: re-check the broken instances (fast readmission);
        every `health_interval_s`: all, Predictors and tagger included; in between, for
        status-based policies, every engine's `/status` each `status_interval_s`."""
        full_period = self.s.health_interval_s
        engine_period = self.s.status_interval_s if self.needs_status else full_period
        tick = min(self.s.recheck_interval_s, engine_period)
        last_full = last_engines = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            try:
                now = time.monotonic()
                if now - last_full >= full_period:
                    last_full = last_engines = now
                    await self.check_all()
                elif now - last_engines >= engine_period:
                    last_engines = now
                    await self.check_all(with_services=False)
                    await self._recheck_predictors()
                else:
                    broken = [st for st in self.instances if not st.healthy]
                    if broken:
                        await asyncio.gather(*(self.check(st, with_predictor=False) for st in broken))
                    await self._recheck_predictors()
            except Exception:  # pragma: no cover - keep the loop alive whatever happens
                log.exception("health loop")
