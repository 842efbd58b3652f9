"""Predictor sidecar (one per engine; Astrolabe §4, ARCHITECTURE.md §2).

`POST /predict` takes a candidate request and answers how long it would take on this
predictor's engine. Both bodies are `rps_astro_cli.protocol.service_wire`'s codec, which
the scheduler uses at the other end:

    request  `PredictRequest`: {"prompt_tokens": int ≥ 1, "predicted_output_tokens": int ≥ 1,
              "modality": "text"|"image"|"video" = "text", "vision_tokens": int = 0,
              "encoder_s": float = 0, "preprocess_s": float = 0,
              "req_class": str|null, "deadline_s": float|null, "objective": "e2e"|"ttft" = "e2e",
              "pending": [{"prompt_tokens", "predicted_output_tokens", "sent_age_s",
              "accepted_age_s"}] = []}
    response `PredictReply`: {"ttft_s", "e2e_s": seconds from the snapshot time,
              "objective_s": the requested objective's value,
              "snapshot_age_s": how old the engine status used was (s),
              "lookahead_us": look-ahead time (µs), "instance_id": str}

It reads the engine's `GET /status` on demand and caches it for `status_cache_s`
(default 20 ms; concurrent queries share one fetch; a status up to `status_max_age_s`
old is still used while a background fetch refreshes it), rebuilds the engine's own
instance policy from the snapshot's `policy` field, and runs the fast look-ahead
(`sim.lookahead.predict` when present, else the reference `predict_stepwise`) with
auto-extension (`extension_tokens`, default 10). The latency model is kept per profile
id so its (batch size, token count) memo lives across queries.

Pending requests (issue 13 §2): the scheduler lists the requests it has sent to this
engine and not yet seen end (`protocol.service_wire.PendingRequest`); the ones the snapshot cannot hold —
not yet accepted by the engine, or accepted less than the snapshot's age ago — join the
simulated waiting queue (`with_pending`), so two close dispatches do not both see the
same empty instance before its `/status` shows the first.

Metrics (`GET /metrics`, Prometheus):
- `astro:predictor_predict_seconds` histogram: wall time per /predict, incl. any status fetch.
- `astro:predictor_lookahead_seconds` histogram: look-ahead time alone.
- `astro:predictor_cpu_seconds_total`: CPU seconds (process time) spent in the look-ahead.
- `process_cpu_seconds_total`: the whole process (HTTP, status fetches, look-ahead);
  its increase ÷ the increase of `astro:predictor_requests_total` = CPU per query, the
  Astrolabe paper's Po2-vs-fanout predictor CPU figure.
- `astro:predictor_requests_total{outcome}`: ok | bad_request | engine_unavailable.
- `astro:predictor_status_fetches_total{outcome}`: ok | error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.policies import build_instance_policy, make_policy
from rps_astro_cli.protocol.http_server import off_loop
from rps_astro_cli.protocol.internal_auth import guard, token_headers
from rps_astro_cli.protocol.service_wire import PendingRequest, PredictReply, PredictRequest
from rps_astro_cli.services.http_common import (
    DEFAULT_MAX_BODY_BYTES,
    FastRoutes,
    HTTPUserError,
    add_health_and_metrics,
    check_api_key,
    error_response,
    install_error_handlers,
    new_registry,
    read_json_body,
)
from rps_astro_cli.services.rpc import HostPool, RpcError
from rps_astro_cli.sim import lookahead as _lookahead
from rps_astro_cli.sim.calibration import CalibrationState, StepCalibrator, StepSample
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.policy import InstancePolicy
from rps_astro_cli.sim.profile import ExecutionProfile, load_profile
from rps_astro_cli.types import CandidateRequest, InstanceStatus, LatencyEstimate, RequestStatus

log = logging.getLogger("astro.predictor")

__all__ = ["Predictor", "PredictorSettings", "create_app", "parse_predict",
           "PENDING_MARGIN_S", "run_predictor", "with_pending"]


def lookahead_fn():
    """The fast look-ahead if the simulator provides it, else the reference one."""
    return getattr(_lookahead, "predict", None) or _lookahead.predict_stepwise


@dataclass(frozen=True)
class PredictorSettings:
    """Configuration of one Predictor.

    engine_url: base URL of the engine it predicts for (its `/status`).
    status_cache_s: reuse a fetched status for this long (seconds; 0 = always fetch).
    status_max_age_s: up to this age a stale status is still used while a background
        fetch refreshes it (seconds; ≤ status_cache_s disables that).
    status_timeout_s: deadline of one `/status` fetch (seconds).
    profile: execution profile id/path; None = the profile id the engine reports.
    extension_tokens: auto-extension (tokens past the predicted length a request is
        assumed to run; Astrolabe §4: 10). default_output_tokens: length assumed for
        requests with no predicted length (tokens).
    api_key: required bearer token when set. max_body_bytes: body limit (bytes).
    internal_token: the cluster's internal token: sent to the engine, and required on
    every route but /health and /ready (`protocol.internal_auth`); None = neither.
    calibration: "online" (default): the step model is refitted from the steps the
        engine reports (`/status?steps_since=`, `sim.calibration`), starting from the
        profile; "off": the profile stays, but its recent error is still tracked and the
        replies say whether it is trusted (the dispatch leans on load while it is not).
        An engine that reports no steps leaves the profile in force, trusted.
    """

    engine_url: str
    status_cache_s: float = 0.02
    status_max_age_s: float = 0.25
    status_timeout_s: float = 1.0
    profile: str | None = None
    extension_tokens: int = 10
    default_output_tokens: int = 256
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    internal_token: str | None = None
    calibration: str = "online"

    def __post_init__(self) -> None:
        if self.calibration not in CALIBRATION_MODES:
            raise AstroUserError(f"unknown calibration {self.calibration!r}", field="calibration",
                                 fix="use online or off")


CALIBRATION_MODES = ("online", "off")


def parse_predict(body: dict[str, Any]) -> PredictRequest:
    """A /predict body (`PredictRequest.from_dict`).

    Raises:
        HTTPUserError: 400 naming the missing or malformed field.
    """
    try:
        return PredictRequest.from_dict(body)
    except AstroUserError as exc:
        raise HTTPUserError(400, exc.args[0], exc.field) from None


PENDING_MARGIN_S = 0.05
"""A forward the engine has not answered is assumed in its queue this long after it was
sent (s): a non-streamed request is answered only when it ends."""


def with_pending(status: InstanceStatus, pending: tuple[PendingRequest, ...], status_age_s: float,
                 margin_s: float = PENDING_MARGIN_S) -> InstanceStatus:
    """`status` with the pending requests it cannot show appended to its waiting queue.

    A snapshot taken `status_age_s` ago cannot hold a request the engine accepted after
    it (`accepted_age_s` < `status_age_s`), nor one not answered yet that was sent less
    than `status_age_s + margin_s` ago; it holds the others (accepted before it, or sent
    long enough before it). Each one it cannot hold is added at the back of the queue as
    a queued request with no KV blocks and nothing computed, arrived `sent_age_s −
    status_age_s` before the snapshot's time (clipped to it)."""
    add = []
    for k, p in enumerate(pending):
        if p.accepted_age_s is not None:
            if p.accepted_age_s >= status_age_s:
                continue  # accepted before the snapshot: in it
        elif p.sent_age_s >= status_age_s + margin_s:
            continue  # unanswered, but at the engine since before the snapshot
        arrival = status.time_s - max(0.0, p.sent_age_s - status_age_s)
        add.append(RequestStatus(f"pending-{k}", arrival, p.prompt_tokens,
                                 predicted_output_tokens=p.predicted_output_tokens))
    if not add:
        return status
    return replace(status, waiting=status.waiting + tuple(add))


class Predictor:
    """Status cache + look-ahead for one engine (see module docstring)."""

    def __init__(self, settings: PredictorSettings, on_fetch: Callable[[str], None] = lambda outcome: None):
        self.settings = settings
        self.on_fetch = on_fetch  # called with "ok" / "error" after each /status fetch
        # lean keep-alive client (see services/rpc.py), sending the cluster's internal token
        self.pool = HostPool(settings.engine_url, headers=token_headers(settings.internal_token))
        self._status: InstanceStatus | None = None
        self._status_at = 0.0  # time.monotonic() of the fetch
        self._inflight: asyncio.Future | None = None
        self._latency: dict[str, LatencyModel] = {}
        self._policies: dict[str, InstancePolicy] = {}
        self._fixed_profile: ExecutionProfile | None = load_profile(settings.profile) if settings.profile else None
        self._predict = lookahead_fn()
        # the model and policy of the last status predicted on: a cached status serves
        # many predicts, so they are resolved once per fetched status, not per predict
        self._resolved: tuple[InstanceStatus, LatencyModel, InstancePolicy] | None = None
        self.last_error: str | None = None  # why the last engine /status fetch failed (None: it did not)
        # the step model's calibrator (made with the first status: the engine may name the profile)
        self.calibrator: StepCalibrator | None = None
        # its state after the last steps learned: read by the event loop while the worker
        # thread may be learning (`learn` runs there)
        self.calibration: CalibrationState | None = None
        self._steps_seq = 0  # engine steps learned up to (its `steps.seq`)

    async def ready(self) -> str | None:
        """None when the engine's `/status` answers (a cached one counts), else why not."""
        try:
            await self.status()
        except (TimeoutError, RpcError, AstroUserError, ValueError, OSError) as exc:
            return f"engine {self.settings.engine_url} /status: {type(exc).__name__}: {exc}"[:200]
        return None

    def problem(self) -> str | None:
        """What /health reports (the last `/status` fetch's failure, or None). While there
        is one, each call also starts one background re-fetch (never awaited: liveness
        must answer at once), so a restarted engine clears it without /predict traffic."""
        if self.last_error is not None and self._inflight is None:
            try:
                self._inflight = asyncio.ensure_future(self._fetch())
                self._inflight.add_done_callback(_swallow)
            except RuntimeError:  # no running loop (called outside the server)
                pass
        return self.last_error

    # -- engine status -----------------------------------------------------------------
    async def status(self) -> tuple[InstanceStatus, float]:
        """The engine's status and its age in seconds.

        Fresh (age ≤ `status_cache_s`): used as is. Stale but ≤ `status_max_age_s`: used
        as is while one background fetch refreshes it (stale-while-revalidate: under load
        a predict never waits on the engine). Older or absent: wait for a fetch.
        Concurrent callers share one fetch.

        Raises:
            RpcError / TimeoutError / AstroUserError: the engine did not answer / answered junk.
        """
        held = self.status_now()
        if held is not None:
            return held
        if self._inflight is None:
            self._inflight = asyncio.ensure_future(self._fetch())
        st = await asyncio.shield(self._inflight)
        return st, time.monotonic() - self._status_at

    def status_now(self) -> tuple[InstanceStatus, float] | None:
        """`status()` without waiting: the held status and its age when it may be used
        now (fresh, or stale-while-revalidate with one background fetch started), else
        None (the caller must wait for a fetch: `status()`). Needs a running event loop."""
        if self._status is None:
            return None
        age = time.monotonic() - self._status_at
        if age <= self.settings.status_cache_s:
            return self._status, age
        if age <= self.settings.status_max_age_s:
            if self._inflight is None:
                self._inflight = asyncio.ensure_future(self._fetch())
                self._inflight.add_done_callback(_swallow)
            return self._status, age
        return None

    def adopt(self, status: InstanceStatus, fetched_at: float) -> None:
        """Use `status`, fetched by someone else at `fetched_at` (time.monotonic() when it
        was asked for), when it is newer than the one held (the scheduler's status poll
        feeding its in-process Predictors)."""
        if self._status is None or fetched_at > self._status_at:
            self._status, self._status_at = status, fetched_at
            self.last_error = None

    @property
    def steps_seq(self) -> int:
        """The engine step count this Predictor has learned up to (`/status?steps_since=`)."""
        return self._steps_seq

    async def take(self, status: InstanceStatus, steps: Any, fetched_at: float) -> None:
        """`adopt` a `/status` someone else fetched at `fetched_at`, asked with
        `steps_since=steps_seq`, and learn from its `steps` (the scheduler's status poll
        feeding its in-process Predictors: without it they would never calibrate)."""
        if self.calibrator is not None and isinstance(steps, dict) and steps.get("rows"):
            await off_loop(self.learn, status, steps)
        else:
            self.learn(status, steps)
        self.adopt(status, fetched_at)

    async def _fetch(self) -> InstanceStatus:
        try:
            path = f"/status?steps_since={self._steps_seq}"
            resp = await asyncio.wait_for(self.pool.request("GET", path), self.settings.status_timeout_s)
            body = await asyncio.wait_for(resp.read(), self.settings.status_timeout_s)
            if resp.status != 200:
                raise RpcError(f"engine /status answered {resp.status}")
            d = json.loads(body)
            st = InstanceStatus.from_dict(d)
            steps = d.get("steps")
            # a refit is milliseconds of numpy: on the worker thread, not the event loop
            # the /predict requests share (late predictions are dropped by the scheduler)
            if self.calibrator is not None and isinstance(steps, dict) and steps.get("rows"):
                await off_loop(self.learn, st, steps)
            else:
                self.learn(st, steps)  # the first status (the calibrator is made) or no steps: cheap
        except BaseException as exc:
            self.last_error = f"engine {self.settings.engine_url} /status failed: {type(exc).__name__}: {exc}"[:200]
            self.on_fetch("error")
            raise
        finally:
            self._inflight = None
        self._status, self._status_at = st, time.monotonic()
        self.last_error = None
        self.on_fetch("ok")
        return st

    # -- model -------------------------------------------------------------------------
    def learn(self, status: InstanceStatus, steps: Any) -> None:
        """Feed the engine's steps since the last fetch (`/status`'s `steps`: {"seq",
        "rows"}) to the calibrator; an engine that sends none leaves it as it is."""
        if self.calibrator is None:
            prior = self._fixed_profile or load_profile(status.profile_id or None)
            self.calibrator = StepCalibrator(prior, learn=self.settings.calibration == "online")
        if not isinstance(steps, dict):
            return
        try:
            seq, rows = int(steps["seq"]), steps["rows"]
            samples = [StepSample(int(r[0]), int(r[1]), int(r[2]), float(r[3]), float(r[4]), float(r[5]))
                       for r in rows]
        except (KeyError, TypeError, ValueError, IndexError):
            log.warning("engine %s sent malformed steps; calibration skips them", self.settings.engine_url)
            return
        if seq < self._steps_seq:  # the engine restarted: its count began again
            samples = samples[-seq:] if seq > 0 else []
        self._steps_seq = seq
        if not samples and self.calibration is not None:
            return  # nothing new (an idle engine, polled 10 times a second): its state stands
        if self.calibrator.observe_many(samples):
            self._resolved = None  # a new fit: the next predict uses it
        self.calibration = self.calibrator.state()  # what the event loop reads

    @property
    def trusted(self) -> bool:
        """The step model may be relied on (`sim.calibration.StepCalibrator.trusted`, as of
        the last steps learned)."""
        return self.calibration is None or self.calibration.trusted

    def latency_model(self, status: InstanceStatus) -> LatencyModel:
        if self.calibrator is not None:
            return self.calibrator.latency
        key = self._fixed_profile.profile_id if self._fixed_profile else status.profile_id
        lm = self._latency.get(key)
        if lm is None:
            prof = self._fixed_profile or load_profile(status.profile_id or None)
            lm = self._latency[key] = LatencyModel(prof)
        return lm

    def policy(self, status: InstanceStatus) -> InstancePolicy:
        key = json.dumps(status.policy, sort_keys=True, default=str)
        pol = self._policies.get(key)
        if pol is None:
            spec = dict(status.policy)
            name = str(spec.pop("name", "fcfs"))
            try:
                # as the engine built it: its profile's defaults, its own parameters winning
                pol = build_instance_policy(name, spec, self._fixed_profile or status.profile_id or None)
            except (TypeError, ValueError, OSError) as exc:  # AstroUserError is a ValueError
                log.warning("engine policy %s%r not rebuilt with its parameters (%s); using its defaults",
                            name, spec, exc)
                try:
                    pol = make_policy(name)
                except AstroUserError:
                    log.warning("engine policy %r unknown here; predicting with fcfs", name)
                    pol = make_policy("fcfs")
            self._policies[key] = pol
        return pol

    def predict(self, status: InstanceStatus, cand: CandidateRequest,
                view: InstanceStatus | None = None, first_token_only: bool = False) -> LatencyEstimate:
        """Run the look-ahead of `cand` on `status` (CPU-bound, ~1 ms with the fast one);
        `view`: the state to simulate when it differs from the fetched `status` (e.g.
        `with_pending`'s), same engine and policy; `first_token_only`: stop at the
        candidate's first token (`lookahead.predict`)."""
        res = self._resolved
        if res is None or res[0] is not status:
            res = self._resolved = (status, self.latency_model(status), self.policy(status))
        return self._predict(
            view if view is not None else status, cand, res[1], res[2],
            extension_tokens=self.settings.extension_tokens,
            default_output_tokens=self.settings.default_output_tokens,
            first_token_only=first_token_only,
        )


def _swallow(t: asyncio.Future) -> None:
    if not t.cancelled():
        t.exception()


def create_app(settings: PredictorSettings) -> FastRoutes:
    """The Predictor's ASGI app (routes: /predict, /health (degraded once
    its engine's /status fails), /ready (503 until the engine's /status answers), /metrics); `app.state.predictor`
    is its `Predictor`."""
    from contextlib import asynccontextmanager

    from prometheus_client import Counter, Gauge, Histogram

    reg = new_registry()
    buckets = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
    m_predict = Histogram("astro:predictor_predict_seconds", "Wall time per /predict (s)",
                          buckets=buckets, registry=reg)
    m_look = Histogram("astro:predictor_lookahead_seconds", "Look-ahead time per /predict (s)",
                       buckets=buckets, registry=reg)
    m_cpu = Counter("astro:predictor_cpu_seconds", "CPU seconds spent in the look-ahead", registry=reg)
    m_req = Counter("astro:predictor_requests", "/predict requests by outcome", ["outcome"], registry=reg)
    m_fetch = Counter("astro:predictor_status_fetches", "Engine /status fetches by outcome", ["outcome"], registry=reg)
    m_age = Histogram("astro:predictor_snapshot_age_seconds", "Age of the status used (s)",
                      buckets=buckets, registry=reg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        app.state.predictor.pool.close()

    app = FastAPI(title="astro predictor", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # no /openapi.json: it would answer without the key
    app.state.predictor = Predictor(settings, on_fetch=lambda outcome: m_fetch.labels(outcome).inc())
    install_error_handlers(app)
    add_health_and_metrics(app, reg, {"role": "predictor", "engine_url": settings.engine_url},
                           problem=lambda: app.state.predictor.problem(),
                           ready=lambda: app.state.predictor.ready())

    async def predict(request: Request):
        t0 = time.perf_counter()
        check_api_key(request, settings.api_key)
        try:
            _, body = await read_json_body(request, settings.max_body_bytes)
            query = parse_predict(body)
            cand, objective = query.candidate, query.objective
        except HTTPUserError:
            m_req.labels("bad_request").inc()
            raise
        pred: Predictor = app.state.predictor
        try:
            status, age_s = await pred.status()
        except (TimeoutError, RpcError, AstroUserError, ValueError) as exc:
            m_req.labels("engine_unavailable").inc()
            return error_response(503, f"engine status unavailable: {exc}", None, "engine_unavailable")
        c0 = time.process_time()
        t1 = time.perf_counter()
        try:
            est = pred.predict(status, cand, with_pending(status, query.pending, age_s), query.first_token_only)
        except AstroUserError as exc:
            m_req.labels("bad_request").inc()
            return error_response(400, str(exc), exc.field or "candidate")
        look_s = time.perf_counter() - t1
        m_cpu.inc(time.process_time() - c0)
        m_look.observe(look_s)
        m_age.observe(age_s)
        m_req.labels("ok").inc()
        cal = pred.calibration
        out = PredictReply(est.ttft_s, est.e2e_s, est.ttft_s if objective == "ttft" else est.e2e_s,
                           age_s, look_s * 1e6, status.instance_id, pred.trusted,
                           None if cal is None else cal.recent_ape)
        m_predict.observe(time.perf_counter() - t0)
        return JSONResponse(out.to_dict())

    def calibration_view() -> dict[str, Any]:
        pred: Predictor = app.state.predictor
        cal, state = pred.calibrator, pred.calibration
        if cal is None or state is None:
            return {"calibration": settings.calibration, "state": None, "profile": None}
        return {"calibration": settings.calibration, "state": state.to_dict(), "profile": cal.profile.to_dict()}

    @app.get("/status")
    async def predictor_status(request: Request) -> JSONResponse:
        """The step model in force: the calibration mode, its state (samples, refits,
        recent error, trusted) and the fitted profile (`astro profiles export` reads it;
        the profile JSON loads with `--profile`)."""
        check_api_key(request, settings.api_key)
        return JSONResponse(calibration_view())

    def _cal_value(name: str) -> float:
        cal = app.state.predictor.calibration
        if cal is None:
            return float("nan")
        v = {"samples": cal.samples, "refits": cal.refits, "trusted": float(cal.trusted),
             "recent_ape": cal.recent_ape}[name]
        return float("nan") if v is None else float(v)

    for name, doc in (("samples", "engine steps the step model learned from"),
                      ("refits", "fits of the step model"),
                      ("recent_ape", "median absolute percentage error of the step model on the latest steps"),
                      ("trusted", "1 while the dispatch may rely on this Predictor's model")):
        Gauge(f"astro:predictor_calibration_{name}", doc, registry=reg).set_function(
            lambda name=name: _cal_value(name))

    app.add_api_route("/predict", predict, methods=["POST"])
    return FastRoutes(app, {("POST", "/predict"): predict})


def run_predictor(settings: PredictorSettings, host: str, port: int, log_level: str = "warning",
                  ready_file: str | None = None) -> None:
    """Serve a Predictor until SIGINT/SIGTERM (blocking); with `settings.internal_token`
    only callers that send it get past /health and /ready."""
    from rps_astro_cli.services.http_common import run_app, warn_exposed

    warn_exposed(host, "predictor", settings.internal_token or settings.api_key)
    run_app(guard(create_app(settings), settings.internal_token), host, port, log_level, ready_file)
