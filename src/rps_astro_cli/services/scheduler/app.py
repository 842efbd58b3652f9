"""The scheduler service: its parts wired together (`Scheduler`) and its ASGI app."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rps_astro_cli.discovery import InstanceEvent, InstanceSet
from rps_astro_cli.discovery.kubernetes import EndpointSliceWatcher
from rps_astro_cli.services.http_common import (
    FastRoutes,
    HTTPUserError,
    check_api_key,
    install_error_handlers,
    metrics_response,
)
from rps_astro_cli.services.scheduler.clients import Clients
from rps_astro_cli.services.scheduler.dispatcher import Dispatcher
from rps_astro_cli.services.scheduler.front_door import FrontDoor
from rps_astro_cli.services.scheduler.health import HealthMonitor
from rps_astro_cli.services.scheduler.instances import Instances, InstanceState
from rps_astro_cli.services.scheduler.metrics import SchedulerMetrics
from rps_astro_cli.services.scheduler.predictions import PredictClient
from rps_astro_cli.services.scheduler.prompt_ids import PromptIds
from rps_astro_cli.services.scheduler.relay import RelayResponse
from rps_astro_cli.services.scheduler.settings import InstanceEndpoint, SchedulerSettings
from rps_astro_cli.services.scheduler.tagging import TagClient

log = logging.getLogger("astro.scheduler")


class Scheduler:
    """One scheduler's parts: instances and their breakers, connection pools, health
    checks, tag and predict clients, the dispatcher and the front door; with
    `settings.discovery`, the EndpointSlice watcher whose events add and remove
    instances (`on_instance_event`)."""

    def __init__(self, settings: SchedulerSettings):
        if not settings.instances and settings.discovery is None:
            raise ValueError("the scheduler needs at least one instance")
        self.s = settings
        self.m = SchedulerMetrics()
        self.models: set[str] = set(settings.served_models)
        self.instances = Instances(settings.instances, self.m)
        self.clients = Clients(settings.upstream_timeout_s, settings.internal_token)
        self.tags = TagClient(settings, self.clients, self.m)
        predict = PredictClient(settings, self.instances, self.clients, self.m, settings.policy)
        self.dispatcher = Dispatcher(settings, self.instances, predict, self.m)
        self.prompt_ids = PromptIds(settings, self.instances, self.clients, self.m, settings.policy)
        needs_prefix = self.dispatcher.needs_prefix
        self.health = HealthMonitor(settings, self.instances, self.clients, self.dispatcher.needs_status,
                                    self.models, self.tags, needs_prefix=needs_prefix,
                                    probe_version=needs_prefix and self.prompt_ids.probes_version,
                                    local=predict.local_predictor if settings.predict_in_process else None,
                                    learn_policy=settings.late_tag)
        self.front_door = FrontDoor(settings, self.instances, self.clients, self.tags, self.dispatcher, self.m,
                                    self.models, self.prompt_ids)
        self.discovered: InstanceSet | None = None
        self.watcher: EndpointSliceWatcher | None = None
        self._by_key: dict[str, InstanceState] = {}  # discovery key (pod UID) → its state
        self.draining = False  # SIGTERM seen: /ready is 503 while in-flight requests finish

    def on_instance_event(self, ev: InstanceEvent) -> None:
        """Apply one discovery event: added → a new state, not dispatchable; ready →
        dispatchable; not_ready / terminating → no new requests (in-flight ones carry
        on); removed → no new requests, dropped once its outstanding requests end. The
        circuit breaker is untouched (a terminating pod still passes health checks)."""
        inst = ev.instance
        if ev.kind == "added":
            ep = InstanceEndpoint(inst.name, inst.engine_url, inst.predictor_url)
            self._by_key[inst.key] = self.instances.add(ep, dispatchable=False, phase="not_ready")
            log.info("instance %s added (%s)", inst.name, inst.engine_url)
            return
        st = self._by_key.get(inst.key)
        if st is None:
            return
        if ev.kind == "removed":
            del self._by_key[inst.key]
            self.instances.remove(st)
        else:
            self.instances.set_phase(st, ev.kind, ev.kind == "ready")

    async def start(self) -> None:
        d = self.s.discovery
        if d is not None:
            self.discovered = InstanceSet(self.on_instance_event)
            self.watcher = EndpointSliceWatcher(d.api, d.watch, self.discovered)
            self.watcher.start()
            if not await self.watcher.wait_synced(d.sync_timeout_s):
                log.warning("no EndpointSlice list of service %s/%s within %.0f s (%s); serving meanwhile",
                            d.api.namespace, d.watch.service, d.sync_timeout_s, self.watcher.stats.last_error)
        await self.health.start()

    async def close(self) -> None:
        if self.watcher is not None:
            await self.watcher.stop()
        await self.health.stop()
        await self.clients.close()


def create_app(settings: SchedulerSettings) -> FastRoutes:
    """The scheduler's ASGI app: /v1/chat/completions, /v1/completions, /v1/models[/{id}],
    /health (liveness), /ready (readiness), /metrics, /decisions, /instances (a `FastRoutes` over a FastAPI app; the
    Scheduler is `app.state.scheduler`)."""
    from contextlib import asynccontextmanager

    sched = Scheduler(settings)
    door = sched.front_door

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await sched.start()
        try:
            yield
        finally:
            await sched.close()

    app = FastAPI(title="astro scheduler", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # no /openapi.json: it would answer without the key
    app.state.scheduler = sched
    install_error_handlers(app)

    async def chat(request: Request) -> Response | RelayResponse:
        return await door.handle(request, "chat")

    async def completions(request: Request) -> Response | RelayResponse:
        return await door.handle(request, "completions")

    # reached via FastRoutes only (FastAPI answers their other methods: 405 with Allow)
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"], response_model=None)
    app.add_api_route("/v1/completions", completions, methods=["POST"], response_model=None)

    @app.get("/v1/models", response_model=None)
    async def models(request: Request) -> dict[str, Any]:
        check_api_key(request, settings.api_key)
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "astro"}
                                           for m in sorted(sched.models)]}

    @app.get("/v1/models/{model_id:path}", response_model=None)
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        """One served model (OpenAI's retrieve); 404 naming the served ones otherwise."""
        check_api_key(request, settings.api_key)
        if model_id not in sched.models:
            raise HTTPUserError(404, f"the model {model_id!r} does not exist; served here: "
                                f"{', '.join(sorted(sched.models)) or 'none yet'}", "model", "NotFoundError")
        return {"id": model_id, "object": "model", "owned_by": "astro"}

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness (always 200 while the process serves): `status` ok | degraded (some
        engine breaker open, some Predictor or the tagger failing: `problems` says which
        and why) |
        unavailable (no instance can take a request)."""
        n = sum(st.healthy and st.dispatchable for st in sched.instances)
        problems = {st.ep.name: p for st in sched.instances if (p := st.problems())}
        if sched.tags.error is not None:
            problems["tagger"] = [f"tagger: {sched.tags.error} (requests get the default length meanwhile)"]
        status = "unavailable" if not n else "degraded" if problems else "ok"
        body = {"status": status, "role": "scheduler", "healthy_instances": n,
                "instances": len(sched.instances), "policy": sched.dispatcher.describe()}
        if problems:
            body["problems"] = problems
        if sched.watcher is not None:
            body["discovery"] = {"lists": sched.watcher.stats.lists, "errors": sched.watcher.stats.errors,
                                 "last_error": sched.watcher.stats.last_error}
        return JSONResponse(body)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: 200 once some dispatchable instance's engine answers its health
        check (a request would reach an engine), else 503 naming why."""
        n = sum(st.healthy and st.dispatchable for st in sched.instances)
        if sched.draining:
            return JSONResponse({"ready": False, "reason": "draining: shutting down"}, status_code=503)
        if n:
            return JSONResponse({"ready": True, "healthy_instances": n})
        why = ("no instance known yet" if not len(sched.instances)
               else "no dispatchable instance's engine answers its health check")
        return JSONResponse({"ready": False, "reason": why,
                             "problems": {st.ep.name: st.problems() for st in sched.instances}}, status_code=503)

    @app.get("/instances", response_model=None)
    async def instances(request: Request) -> list[dict[str, Any]]:
        check_api_key(request, settings.api_key)
        outcomes = door.dispatcher.outcomes
        return [{"name": st.ep.name, "engine_url": st.ep.engine_url, "predictor_url": st.ep.predictor_url,
                 "healthy": st.healthy, "dispatchable": st.dispatchable, "phase": st.phase,
                 "outstanding_requests": st.outstanding, "dispatched": st.dispatched,
                 "engine_error": st.engine_error, "predictor_error": st.predictor_error,
                 "prefix_cached_blocks": len(st.prefix.hashes),
                 # the in-instance policy its engine names (fcfs: requests forwarded before their tag)
                 "engine_policy": st.engine_policy,
                 # `dispatch.outcome`: its predictions' correction by what its requests took
                 "outcome_correction": None if outcomes is None else outcomes.state().get(st.ep.name),
                 # `predict_in_process`: its in-process Predictor's step calibration
                 "calibration": door.dispatcher.predict.local_calibration(st)}
                for st in sched.instances]

    @app.get("/decisions", response_model=None)
    async def decisions(request: Request, n: int = 100) -> list[dict[str, Any]]:
        check_api_key(request, settings.api_key)
        kept = door.decisions
        n = max(0, min(n, len(kept)))
        return [r.to_dict() for r in list(kept)[len(kept) - n:]] if n else []

    @app.get("/metrics")
    async def metrics() -> Response:
        return metrics_response(sched.m.registry)

    return FastRoutes(app, {("POST", "/v1/chat/completions"): chat, ("POST", "/v1/completions"): completions})


def run_scheduler(settings: SchedulerSettings, host: str, port: int, log_level: str = "warning",
                  ready_file: str | None = None) -> None:
    """Serve the scheduler until SIGINT/SIGTERM (blocking)."""
    from rps_astro_cli.services.http_common import run_app, warn_exposed

    warn_exposed(host, "scheduler", settings.api_key)
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    app = create_app(settings)
    sched: Scheduler = app.state.scheduler

    def drain() -> None:  # SIGTERM: /ready turns 503; in-flight relays get the drain period
        sched.draining = True
        log.warning("draining: %d request(s) in flight", sum(st.outstanding for st in sched.instances))

    run_app(app, host, port, log_level, ready_file, on_exit=drain)
