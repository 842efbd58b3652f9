"""Global scheduler: the OpenAI-compatible front door (Astrolabe §3, ARCHITECTURE.md §2).

Per request to `/v1/chat/completions` or `/v1/completions`:
1. read the body (bounded: 413 over `max_body_bytes`) and start the tag RPC on the raw
   body at once; validate the body with the engine's own parser
   (`protocol/openai.py`) while the tagger works. Bad input → 4xx naming the field,
   and nothing reaches an engine; an unknown `model` → 404.
2. dispatch: the policy's `candidates` (power-of-k: k distinct healthy instances), then
   for prediction-guided policies one `POST /predict` per candidate to its Predictor, in
   parallel, with a deadline (`predict_deadline_s`, 50 ms): late or failed ones are
   skipped; the policy's `choose` picks (falling back to least outstanding requests when
   none answered).
3. forward the body to the chosen engine with `vllm_xargs.astro_predicted_output_tokens`
   set to the tagger's prediction (so the engine's `/status` shows it), and stream the
   response back unchanged (SSE events relayed whole), with header `x-astro-instance`
   (the instance's name, e.g. `engine-2`).

Clients: the hot path (tag, predict, forward) runs on `services/rpc.py`'s lean
keep-alive HTTP/1.1 pools (one per destination; httpx costs ~20x more CPU per call, see
that module), and so do llumnix's status polls; health checks and model discovery use
pooled `httpx.AsyncClient`s. A tag or
predict RPC that misses its deadline is skipped but not cancelled (it finishes in the
background, bounded by RPC_BOUND_S), so no keep-alive connection is torn down.

Failures: a connection error or timeout marks the instance unhealthy at once (circuit
breaker open) and a background health check (`GET /health` every `health_interval_s`,
or `GET /status` for status-based policies) readmits it when it answers again. A request
whose instance fails before anything was sent to the client is retried once on another
instance; one that fails mid-stream ends with an SSE event
`data: {"error": {"message", "type": "engine_failure", "code": 502, ...}}` then
`data: [DONE]`. Every request ends in a response or an error the client sees.

Scheduler overhead (`astro_scheduler_overhead_seconds`) = time from the request's
arrival until the body is handed to the engine connection, plus time from the engine's
response headers (first chunk when streaming) until the response is handed to the
server: everything the scheduler adds except waiting on the engine.

Metrics (`GET /metrics`):
- `astro_scheduler_requests_total{endpoint,outcome}` ok | client_error | engine_error |
  midstream_error | no_instance | client_disconnected.
- `astro_dispatch_decisions_total{policy,reason}`, `astro_dispatch_decide_seconds{policy}`
  (decision time incl. predict RPCs), `astro_predict_rpcs_total{policy,outcome}`
  (ok | timeout | error | skipped; per request exactly k for power_of_k, N for k=all;
  "skipped" = not sent, the Predictor's breaker is open),
  `astro_tag_rpcs_total{outcome}`, `astro_scheduler_retries_total`,
  `astro_instance_healthy{instance}`, `astro_instance_outstanding_requests{instance}`,
  `astro_instance_dispatched_total{instance}`, `astro_breaker_trips_total{instance}`.
- `GET /decisions?n=100` (API key when set): the last decisions as JSON (`DispatchDecision.to_dict()` plus
  request facts: prompt/predicted tokens, instance, retries, overhead, `tag_wait_us` (time
  waiting for the tagger after parsing), and the latencies
  the scheduler saw: `observed_ttft_s` = forward → first response chunk,
  `observed_e2e_s` = forward → end), for predictor-error analysis.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rps_astro_cli.dispatch import DispatchDecision, InstanceLoad, make_dispatch
from rps_astro_cli.protocol import openai as oa
from rps_astro_cli.services.http_common import (
    DEFAULT_MAX_BODY_BYTES,
    FastRoutes,
    HTTPUserError,
    check_api_key,
    error_body,
    error_response,
    install_error_handlers,
    metrics_response,
    new_registry,
    read_body,
)
from rps_astro_cli.services.rpc import HostPool, RpcError
from rps_astro_cli.services.rpc import Response as RawResponse
from rps_astro_cli.sim.lookahead import LatencyEstimate

log = logging.getLogger("astro.scheduler")

RPC_BOUND_S = 1.0  # longest a tag/predict RPC may run in the background after its deadline


@dataclass(frozen=True)
class InstanceEndpoint:
    """One instance the scheduler dispatches to.

    name: label in headers/metrics ("engine-0"). engine_url: its OpenAI server.
    predictor_url: its Predictor sidecar, or None (no predictions for it).
    """

    name: str
    engine_url: str
    predictor_url: str | None = None


@dataclass(frozen=True)
class SchedulerSettings:
    """Scheduler configuration (all times in seconds).

    instances: the engines (≥ 1). policy / policy_params: a registered dispatch policy
    and its constructor arguments (power_of_k: k, objective; llumnix: variant).
    tagger_url: the tagger service, or None to tag in-process with `length_model`.
    predict_deadline_s: deadline of the parallel predict RPCs (50 ms).
    tag_deadline_s: deadline of the tag RPC; on miss `default_output_tokens` is used.
    health_interval_s: health-check period; status_interval_s: `/status` poll period
    for status-based policies (llumnix); recheck_interval_s: how often instances out of
    rotation are re-checked (readmission delay). max_body_bytes: front-door body limit.
    served_models: model names accepted (empty = learn them from the engines).
    api_key: bearer token required on /v1/* when set. seed: the dispatch Generator's seed.
    upstream_timeout_s: read timeout towards engines. decisions_kept: ring size.
    predictor_breaker_failures / predictor_breaker_s: after that many consecutive
    late/failed predict RPCs a Predictor is not asked for that long (then probed again).
    oracle_lengths: use the request's true length (`vllm_xargs.astro_output_tokens`, which
    the bench sends) as the predicted length when present — the Astrolabe "oracle"
    ablation; the tagger is still called for the modality facts.
    """

    instances: tuple[InstanceEndpoint, ...]
    policy: str = "power_of_k"
    policy_params: dict[str, Any] = field(default_factory=dict)
    tagger_url: str | None = None
    length_model: str | None = None
    profile: str | None = None
    predict_deadline_s: float = 0.05
    tag_deadline_s: float = 0.05
    default_output_tokens: int = 256
    health_interval_s: float = 0.5
    status_interval_s: float = 0.1
    recheck_interval_s: float = 0.1
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    served_models: tuple[str, ...] = ()
    api_key: str | None = None
    seed: int = 0
    upstream_timeout_s: float = 600.0
    decisions_kept: int = 1000
    predictor_breaker_failures: int = 3
    predictor_breaker_s: float = 1.0
    oracle_lengths: bool = False


class InstanceState:
    """What the scheduler tracks per instance (mutable, event-loop only)."""

    __slots__ = ("index", "ep", "healthy", "outstanding", "load_fields", "dispatched",
                 "predictor_failures", "predictor_skip_until")

    def __init__(self, index: int, ep: InstanceEndpoint):
        self.index = index
        self.ep = ep
        self.healthy = True
        self.outstanding = 0
        self.dispatched = 0
        self.load_fields: dict[str, int] = {}
        self.predictor_failures = 0  # consecutive late/failed predict RPCs
        self.predictor_skip_until = 0.0  # time.monotonic() until which it is not asked

    def load(self, excluded: frozenset[int] = frozenset()) -> InstanceLoad:
        return InstanceLoad(self.index, self.healthy and self.index not in excluded, self.outstanding,
                            **self.load_fields)


def load_fields_from_status(st: dict[str, Any]) -> dict[str, int]:
    """`InstanceLoad` fields from an engine `/status` body: free/total blocks, running and
    waiting counts, and the blocks the waiting queue still needs for its prompts
    (Σ ceil(prompt_tokens / block_size) − blocks held)."""
    bs = int(st["limits"]["block_size"])
    need = 0
    for r in st.get("waiting", ()):
        need += max(0, -(-int(r["prompt_tokens"]) // bs) - int(r.get("kv_blocks", 0)))
    return {
        "kv_blocks_free": int(st["kv_blocks_free"]),
        "kv_blocks_total": int(st.get("kv_blocks_total") or st["limits"]["num_gpu_blocks"]),
        "num_running": len(st.get("running", ())),
        "num_waiting": len(st.get("waiting", ())),
        "waiting_blocks_needed": need,
    }


class _Metrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.registry = r = new_registry()
        fast = (2.5e-4, 5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
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


class Scheduler:
    """State and logic of the front door (see module docstring)."""

    def __init__(self, settings: SchedulerSettings):
        if not settings.instances:
            raise ValueError("the scheduler needs at least one instance")
        self.s = settings
        self.policy = make_dispatch(settings.policy, **settings.policy_params)
        self.policy_name = settings.policy
        self.rng = np.random.default_rng(settings.seed)
        self.instances = [InstanceState(i, ep) for i, ep in enumerate(settings.instances)]
        self.models: set[str] = set(settings.served_models)
        self.m = _Metrics()
        for st in self.instances:
            self.m.healthy.labels(st.ep.name).set(1)
            self.m.outstanding.labels(st.ep.name).set(0)
        self.decisions: collections.deque[dict[str, Any]] = collections.deque(maxlen=settings.decisions_kept)
        self._clients: dict[str, httpx.AsyncClient] = {}  # health checks, status polls
        self._pools: dict[str, HostPool] = {}
        self._tagger = None
        if settings.tagger_url is None:
            from rps_astro_cli.services.tagger import Tagger, TaggerSettings

            self._tagger = Tagger(TaggerSettings(settings.length_model, settings.profile))
        self._tasks: list[asyncio.Task] = []
        self._n = 0

    # -- lifecycle ---------------------------------------------------------------------
    def client(self, base_url: str) -> httpx.AsyncClient:
        """The pooled client for one service (one pool per destination keeps httpx's
        per-request pool scan short and its connections warm)."""
        c = self._clients.get(base_url)
        if c is None:
            limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256, keepalive_expiry=60)
            c = self._clients[base_url] = httpx.AsyncClient(
                base_url=base_url, limits=limits, timeout=httpx.Timeout(self.s.upstream_timeout_s, connect=2.0))
        return c

    def pool(self, base_url: str) -> HostPool:
        """The lean keep-alive pool for one service (hot path: tag, predict, forward)."""
        p = self._pools.get(base_url)
        if p is None:
            p = self._pools[base_url] = HostPool(base_url)
        return p

    async def start(self) -> None:
        for st in self.instances:  # build every httpx client up front: one costs ~10 ms (TLS setup)
            self.client(st.ep.engine_url)
        await self.check_all()
        self._tasks.append(asyncio.create_task(self._health_loop()))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()
        for p in self._pools.values():
            p.close()
        self._pools.clear()

    # -- health ------------------------------------------------------------------------
    def mark_failed(self, st: InstanceState, why: str) -> None:
        """Open the circuit breaker of `st` (out of rotation until a health check passes)."""
        if st.healthy:
            st.healthy = False
            self.m.healthy.labels(st.ep.name).set(0)
            self.m.trips.labels(st.ep.name).inc()
            log.warning("instance %s taken out: %s", st.ep.name, why)

    def mark_ok(self, st: InstanceState) -> None:
        if not st.healthy:
            st.healthy = True
            self.m.healthy.labels(st.ep.name).set(1)
            log.warning("instance %s readmitted", st.ep.name)

    async def check(self, st: InstanceState) -> None:
        """One health check of `st` (status poll for status-based policies)."""
        c = self.client(st.ep.engine_url)
        try:
            if self.policy.needs_status:  # polled every status_interval_s: the lean client
                async with asyncio.timeout(1.0):
                    resp = await self.pool(st.ep.engine_url).request("GET", "/status")
                    body = await resp.read()
                if resp.status != 200:
                    raise ValueError(f"/status answered {resp.status}")
                st.load_fields = load_fields_from_status(json.loads(body))
            else:
                r = await c.get("/health", timeout=1.0)
                r.raise_for_status()
            if not self.models:
                r = await c.get("/v1/models", timeout=1.0)
                if r.status_code == 200:
                    self.models.update(m["id"] for m in r.json().get("data", ()) if "id" in m)
        except (TimeoutError, httpx.HTTPError, RpcError, ValueError, KeyError, TypeError) as exc:
            self.mark_failed(st, f"health check: {exc!r}")
            return
        self.mark_ok(st)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(st) for st in self.instances))

    async def _health_loop(self) -> None:
        """Every `recheck_interval_s`: re-check the broken instances (fast readmission);
        every `health_interval_s` (`status_interval_s` for status-based policies): all."""
        full_period = self.s.status_interval_s if self.policy.needs_status else self.s.health_interval_s
        tick = min(self.s.recheck_interval_s, full_period)
        last_full = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            try:
                if time.monotonic() - last_full >= full_period:
                    last_full = time.monotonic()
                    await self.check_all()
                else:
                    broken = [st for st in self.instances if not st.healthy]
                    if broken:
                        await asyncio.gather(*(self.check(st) for st in broken))
            except Exception:  # pragma: no cover - keep the loop alive whatever happens
                log.exception("health loop")

    # -- tagging -----------------------------------------------------------------------
    def start_tag(self, raw: bytes) -> asyncio.Future | None:
        """Send the tag RPC for `raw` now (None when tagging in-process)."""
        if self._tagger is not None:
            return None
        assert self.s.tagger_url is not None
        return asyncio.ensure_future(self._post(self.s.tagger_url, "/tag", raw))

    async def finish_tag(self, task: asyncio.Future | None, raw: bytes) -> dict[str, Any] | None:
        """The tagger's answer, or None if it failed or missed `tag_deadline_s` (a late
        RPC is left to finish in the background)."""
        if task is None:  # in-process tagger
            try:
                out = self._tagger.tag(json.loads(raw))  # type: ignore[union-attr]
            except Exception:
                self.m.tag_rpcs.labels("error").inc()
                return None
            self.m.tag_rpcs.labels("ok").inc()
            return out
        done, _ = await asyncio.wait({task}, timeout=self.s.tag_deadline_s)
        if not done:
            task.add_done_callback(_swallow)
            self.m.tag_rpcs.labels("timeout").inc()
            return None
        try:
            status, body = task.result()
            if status != 200:
                raise ValueError(f"status {status}")
            out = json.loads(body)
        except (TimeoutError, RpcError, ValueError):
            self.m.tag_rpcs.labels("error").inc()
            return None
        self.m.tag_rpcs.labels("ok").inc()
        return out

    # -- dispatch ----------------------------------------------------------------------
    async def _post(self, base_url: str, path: str, payload: bytes) -> tuple[int, bytes]:
        """A JSON POST on the lean client. The RPC may outlive its caller's deadline
        (bounded by RPC_BOUND_S): a late answer is ignored rather than cancelled, so its
        keep-alive connection is not torn down."""
        async with asyncio.timeout(RPC_BOUND_S):  # no extra task, unlike wait_for
            return await self.pool(base_url).post_json(path, payload)

    async def _predict_one(self, url: str, payload: bytes) -> LatencyEstimate:
        status, body = await self._post(url, "/predict", payload)
        if status != 200:
            raise ValueError(f"predictor answered {status}")
        d = json.loads(body)
        return LatencyEstimate(float(d["ttft_s"]), float(d["e2e_s"]), 0, 0)

    async def predict_many(self, candidates: list[int], candidate: dict[str, Any]) -> dict[int, LatencyEstimate]:
        """Predictions of the candidate on each instance whose Predictor answers within
        the deadline; late ones are left to finish in the background, failed ones
        skipped. A Predictor that missed `predictor_breaker_failures` RPCs in a row is not
        asked for `predictor_breaker_s` (outcome "skipped"), so a hung sidecar does not
        cost every request the full deadline; then it is probed again."""
        payload = json.dumps(candidate).encode()
        tasks: dict[asyncio.Task, int] = {}
        now = time.monotonic()
        for i in candidates:
            st = self.instances[i]
            if not st.ep.predictor_url:
                continue
            if st.predictor_skip_until > now:
                self.m.predict_rpcs.labels(self.policy_name, "skipped").inc()
                continue
            tasks[asyncio.ensure_future(self._predict_one(st.ep.predictor_url, payload))] = i
        if not tasks:
            return {}
        done, pending = await asyncio.wait(tasks, timeout=self.s.predict_deadline_s)
        out: dict[int, LatencyEstimate] = {}
        for t in pending:  # late: skipped; left to finish in the background
            t.add_done_callback(_swallow)
            self.m.predict_rpcs.labels(self.policy_name, "timeout").inc()
            self._predictor_failed(self.instances[tasks[t]])
        for t in done:
            exc = t.exception()
            if exc is None:
                out[tasks[t]] = t.result()
                self.m.predict_rpcs.labels(self.policy_name, "ok").inc()
                self.instances[tasks[t]].predictor_failures = 0
            else:
                outcome = "timeout" if isinstance(exc, asyncio.TimeoutError) else "error"
                self.m.predict_rpcs.labels(self.policy_name, outcome).inc()
                self._predictor_failed(self.instances[tasks[t]])
        return out

    def _predictor_failed(self, st: InstanceState) -> None:
        st.predictor_failures += 1
        if st.predictor_failures >= self.s.predictor_breaker_failures:
            st.predictor_failures = 0
            st.predictor_skip_until = time.monotonic() + self.s.predictor_breaker_s
            log.warning("predictor of %s missed %d RPCs in a row; not asked for %.1f s", st.ep.name,
                        self.s.predictor_breaker_failures, self.s.predictor_breaker_s)

    async def dispatch(self, candidate: dict[str, Any], excluded: frozenset[int]) -> DispatchDecision | None:
        """Choose an instance (None when every instance is excluded)."""
        t0 = time.perf_counter()
        loads = [st.load(excluded) for st in self.instances]
        if not any(ld.healthy for ld in loads):
            # every instance broken: still try the non-excluded ones (a health check may lag)
            loads = [InstanceLoad(ld.index, ld.index not in excluded, ld.outstanding_requests,
                                  ld.kv_blocks_free, ld.kv_blocks_total, ld.num_running, ld.num_waiting,
                                  ld.waiting_blocks_needed) for ld in loads]
            if not any(ld.healthy for ld in loads):
                return None
        cands = self.policy.candidates(loads, self.rng)
        cands = [i for i in cands if loads[i].healthy]
        preds = await self.predict_many(cands, candidate) if self.policy.needs_predictions else {}
        dec = self.policy.choose(loads, cands, preds, self.rng)
        dt = time.perf_counter() - t0
        dec = DispatchDecision(dec.policy, dec.candidates, dec.choice, dec.reason, dec.predictions, dt * 1e6)
        self.m.decisions.labels(self.policy_name, dec.reason).inc()
        self.m.decide.labels(self.policy_name).observe(dt)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("decision %s", dec.to_dict())
        return dec

    # -- front door --------------------------------------------------------------------
    def check_model(self, parsed: oa.ParsedRequest) -> None:
        if parsed.model is not None and self.models and parsed.model not in self.models:
            raise HTTPUserError(404, f"model {parsed.model!r} is not served here; use one of: "
                                f"{', '.join(sorted(self.models))}", "model", "NotFoundError")

    async def handle(self, request: Request, endpoint: str) -> Response:
        t0 = time.perf_counter()
        check_api_key(request, self.s.api_key)
        raw = await read_body(request, self.s.max_body_bytes)
        tag_task = self.start_tag(raw)  # in parallel with parsing:
        if tag_task is not None:
            await asyncio.sleep(0)  # let the tag RPC go out before we parse
        try:
            body = oa.decode_json_body(raw)
            if endpoint == "chat":
                parsed = oa.parse_chat_request(body, limits=oa.ApiLimits(max_body_bytes=self.s.max_body_bytes))
            else:
                parsed = oa.parse_completion_request(body)
            self.check_model(parsed)
        except (oa.ApiError, HTTPUserError) as exc:
            if tag_task is not None:
                tag_task.add_done_callback(_swallow)  # not cancelled: keeps its connection
            self.m.requests.labels(endpoint, "client_error").inc()
            if isinstance(exc, oa.ApiError):
                return JSONResponse(exc.to_dict(), status_code=exc.status_code)
            raise
        t_tag = time.perf_counter()
        tag = await self.finish_tag(tag_task, raw)
        tag_wait_us = (time.perf_counter() - t_tag) * 1e6
        if tag is not None:
            pred_tokens = int(tag["predicted_output_tokens"])
            cand = {"prompt_tokens": int(tag["prompt_tokens"]), "predicted_output_tokens": pred_tokens,
                    "modality": tag.get("modality", "text"), "vision_tokens": int(tag.get("vision_tokens", 0)),
                    "encoder_s": float(tag.get("encoder_s", 0.0)), "preprocess_s": float(tag.get("preprocess_s", 0.0))}
        else:
            pred_tokens = self.s.default_output_tokens
            cand = {"prompt_tokens": max(1, parsed.text_tokens), "predicted_output_tokens": pred_tokens,
                    "modality": parsed.modality}
        if self.s.oracle_lengths and parsed.output_tokens is not None:
            cand["predicted_output_tokens"] = pred_tokens = parsed.output_tokens
        if parsed.max_tokens is not None:
            cand["predicted_output_tokens"] = pred_tokens = max(1, min(pred_tokens, parsed.max_tokens))
        if parsed.req_class:
            cand["req_class"] = parsed.req_class
        objective = self.policy.describe().get("objective")
        if objective:
            cand["objective"] = objective
        xargs = dict(body.get("vllm_xargs") or {})
        xargs["astro_predicted_output_tokens"] = pred_tokens
        body["vllm_xargs"] = xargs
        payload = json.dumps(body).encode()
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        self._n += 1
        rec: dict[str, Any] = {"request": self._n, "endpoint": endpoint, "prompt_tokens": cand["prompt_tokens"],
                               "predicted_output_tokens": pred_tokens, "retries": 0, "tag_wait_us": tag_wait_us}
        return await self._forward(endpoint, path, payload, parsed.stream, cand, rec, t0)

    async def _forward(self, endpoint: str, path: str, payload: bytes, stream: bool,
                       cand: dict[str, Any], rec: dict[str, Any], t0: float) -> Response:
        excluded: frozenset[int] = frozenset()
        last_err = "no instance available"
        overhead = 0.0
        for attempt in range(2):
            dec = await self.dispatch(cand, excluded)
            if dec is None:
                break
            st = self.instances[dec.choice]
            st.outstanding += 1
            st.dispatched += 1
            self.m.outstanding.labels(st.ep.name).set(st.outstanding)
            self.m.dispatched.labels(st.ep.name).inc()
            rec.update(dec.to_dict())
            rec["instance"] = st.ep.name
            pool = self.pool(st.ep.engine_url)
            t_send = time.perf_counter()
            overhead += t_send - t0
            resp = None
            try:
                resp = await asyncio.wait_for(
                    pool.request("POST", path, payload, {"content-type": "application/json"}),
                    self.s.upstream_timeout_s)
                it = resp.chunks().__aiter__()
                if stream and resp.status == 200:
                    first = await _first_chunk(it)
                    t1 = time.perf_counter()
                    rec["observed_ttft_s"] = t1 - t_send
                    overhead += time.perf_counter() - t1
                    return self._stream_response(endpoint, st, resp, it, first, rec, t_send, overhead)
                data = await resp.read()
            except (TimeoutError, RpcError) as exc:
                if resp is not None:
                    await resp.aclose()
                self._release(st)
                self.mark_failed(st, f"{type(exc).__name__}: {exc}")
                last_err = f"instance {st.ep.name} failed: {type(exc).__name__}"
                excluded = excluded | {st.index}
                if attempt == 0:
                    self.m.retries.inc()
                    rec["retries"] = 1
                t0 = time.perf_counter()
                continue
            except BaseException:
                if resp is not None:
                    await resp.aclose()
                self._release(st)
                raise
            t1 = time.perf_counter()
            self._release(st)
            rec["observed_e2e_s"] = t1 - t_send
            outcome = "ok" if resp.status < 400 else "client_error" if resp.status < 500 else "engine_error"
            self.m.requests.labels(endpoint, outcome).inc()
            out = Response(data, status_code=resp.status, headers=_relay_headers(resp, st.ep.name))
            overhead += time.perf_counter() - t1
            self._finish(rec, overhead, outcome)
            return out
        self.m.requests.labels(endpoint, "no_instance").inc()
        rec["outcome"] = "no_instance"
        self.decisions.append(rec)
        return error_response(503, f"no engine could take the request ({last_err}); retry later",
                              None, "engine_unavailable")

    def _release(self, st: InstanceState) -> None:
        st.outstanding -= 1
        self.m.outstanding.labels(st.ep.name).set(st.outstanding)

    def _finish(self, rec: dict[str, Any], overhead_s: float, outcome: str) -> None:
        rec["overhead_us"] = overhead_s * 1e6
        rec["outcome"] = outcome
        self.m.overhead.observe(overhead_s)
        self.decisions.append(rec)

    def _stream_response(self, endpoint: str, st: InstanceState, resp: RawResponse, it: AsyncIterator[bytes],
                         first: bytes, rec: dict[str, Any], t_send: float, overhead_s: float) -> StreamingResponse:
        sched = self
        state = {"outcome": "client_disconnected", "closed": False}

        async def cleanup() -> None:  # idempotent: from the relay's end or the response's
            if state["closed"]:
                return
            state["closed"] = True
            await resp.aclose()  # an unfinished body drops the connection: the engine aborts
            sched._release(st)
            rec["observed_e2e_s"] = time.perf_counter() - t_send
            sched.m.requests.labels(endpoint, state["outcome"]).inc()
            sched._finish(rec, overhead_s, state["outcome"])

        async def relay() -> AsyncIterator[bytes]:
            pending = first
            try:
                try:
                    while True:
                        cut = pending.rfind(b"\n\n")
                        if cut >= 0:  # relay whole SSE events only
                            yield pending[: cut + 2]
                            pending = pending[cut + 2:]
                        chunk = await it.__anext__()
                        pending += chunk
                except StopAsyncIteration:
                    state["outcome"] = "ok"
                    if pending:
                        yield pending
                except RpcError as exc:
                    state["outcome"] = "midstream_error"
                    sched.mark_failed(st, f"mid-stream {type(exc).__name__}")
                    err = error_body(f"engine {st.ep.name} failed mid-stream ({type(exc).__name__}); "
                                     "the response is incomplete", None, "engine_failure", 502)
                    err["error"]["instance"] = st.ep.name
                    yield b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
            finally:
                await cleanup()

        return _RelayResponse(relay(), cleanup, status_code=resp.status, headers=_relay_headers(resp, st.ep.name))


class _RelayResponse(StreamingResponse):
    """A StreamingResponse that runs `cleanup` even when the client left before the body
    iterator ever started (Starlette then never enters the generator, so its `finally`
    would not run and the instance's outstanding count and connection would leak)."""

    def __init__(self, content: AsyncIterator[bytes], cleanup, **kw: Any):
        super().__init__(content, **kw)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


_HOP_HEADERS = frozenset(("connection", "keep-alive", "transfer-encoding", "content-length", "date", "server",
                          "te", "trailer", "upgrade", "proxy-authenticate", "proxy-authorization"))


def _relay_headers(resp: RawResponse, instance: str) -> dict[str, str]:
    """The engine's response headers minus hop-by-hop ones, plus `x-astro-instance`."""
    out = {k: v for k, v in resp.headers.items() if k not in _HOP_HEADERS}
    out.setdefault("content-type", "application/json")
    out["x-astro-instance"] = instance
    return out


def _swallow(t: asyncio.Future) -> None:
    if not t.cancelled():
        t.exception()


async def _first_chunk(it: AsyncIterator[bytes]) -> bytes:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return b""


def create_app(settings: SchedulerSettings) -> FastRoutes:
    """The scheduler's ASGI app: /v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics, /decisions, /instances (a `FastRoutes` over a FastAPI app; the
    Scheduler is `app.state.scheduler`)."""
    from contextlib import asynccontextmanager

    sched = Scheduler(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await sched.start()
        try:
            yield
        finally:
            await sched.close()

    app = FastAPI(title="astro scheduler", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.scheduler = sched
    install_error_handlers(app)

    async def chat(request: Request):
        return await sched.handle(request, "chat")

    async def completions(request: Request):
        return await sched.handle(request, "completions")

    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])  # reached via FastRoutes only
    app.add_api_route("/v1/completions", completions, methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        check_api_key(request, settings.api_key)
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "astro"}
                                           for m in sorted(sched.models)]}

    @app.get("/health")
    async def health():
        n = sum(st.healthy for st in sched.instances)
        body = {"status": "ok" if n else "degraded", "role": "scheduler", "healthy_instances": n,
                "instances": len(sched.instances), "policy": sched.policy.describe()}
        return JSONResponse(body, status_code=200 if n else 503)

    @app.get("/instances")
    async def instances(request: Request):
        check_api_key(request, settings.api_key)
        return [{"name": st.ep.name, "engine_url": st.ep.engine_url, "predictor_url": st.ep.predictor_url,
                 "healthy": st.healthy, "outstanding_requests": st.outstanding, "dispatched": st.dispatched}
                for st in sched.instances]

    @app.get("/decisions")
    async def decisions(request: Request, n: int = 100):
        check_api_key(request, settings.api_key)
        n = max(0, min(n, len(sched.decisions)))
        return list(sched.decisions)[len(sched.decisions) - n:] if n else []

    @app.get("/metrics")
    async def metrics():
        return metrics_response(sched.m.registry)

    return FastRoutes(app, {("POST", "/v1/chat/completions"): chat, ("POST", "/v1/completions"): completions})


def run_scheduler(settings: SchedulerSettings, host: str, port: int, log_level: str = "warning",
                  ready_file: str | None = None) -> None:
    """Serve the scheduler until SIGINT/SIGTERM (blocking)."""
    from rps_astro_cli.services.http_common import run_app

    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    run_app(create_app(settings), host, port, log_level, ready_file)


__all__ = ["InstanceEndpoint", "Scheduler", "SchedulerSettings", "create_app", "run_scheduler"]
