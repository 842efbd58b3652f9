"""The sim engine's HTTP face: an OpenAI-compatible FastAPI app over a `SimEngine`.

Routes:
- `POST /v1/completions`, `POST /v1/chat/completions` (see `protocol.openai` for fields);
  streaming answers are SSE `data: {...}` chunks, one per output token (token text is
  synthetic: one short word per token; counts are exact), ending `data: [DONE]`; with
  `stream_options.include_usage` a usage-only chunk (`choices: []`) precedes `[DONE]`.
  Chat streams send the `{"role": "assistant"}` delta together with the first token (as
  vLLM does), so a client's first chunk marks the first token.
- `GET /v1/models`, `GET /health` (liveness), `GET /ready` (readiness: 503 before the
  engine loop runs and while draining), `GET /status` (the `InstanceStatus` snapshot; requests
  still in multimodal preprocessing are not in it yet: they are not schedulable; waiting
  requests carry their prefix-cache hit `cached_tokens`; `?prefix_since=N` adds
  `prefix_cache`, the change of the set of cached block hashes since cache event N, or
  the whole set for N = 0: `sim.prefix_cache.PrefixCache.delta`),
  `POST /reset_prefix_cache` (vLLM's dev-mode route: forget every cached block; 409 while
  requests hold blocks, where vLLM logs and answers 200),
  `GET /metrics` (Prometheus text, vLLM's metric names, one CollectorRegistry per app):
  gauges `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` (used blocks / total, 0–1); counters
  `vllm:num_preemptions_total`, `vllm:prompt_tokens_total`,
  `vllm:generation_tokens_total`, `vllm:request_success_total`,
  `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total` (tokens); histograms
  `vllm:time_to_first_token_seconds` (first token − arrival) and
  `vllm:e2e_request_latency_seconds` (last token − arrival), in engine (simulated) seconds,
  which equal wall seconds at time_scale 1.0; and astro's own `astro:engine_steps_total`,
  `astro:engine_steps_late_total` (delivered > 5 ms wall after the scheduled end),
  `astro:engine_lag_seconds_max` (wall seconds): whether the loop keeps up.

Errors are `{"error": {"message", "type", "param", "code"}}`: 400 bad field, 401 bad API
key (checked on /v1 routes when set), 404 unknown model, 413 body too large, 500 server
fault (with a request id, logged; never a traceback). A client that disconnects aborts
its request, which frees its KV blocks.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from rps_astro_cli.engine.sim_engine import FINISHED, EngineRequest, EngineShutdown, SimEngine
from rps_astro_cli.protocol.http_server import serve_blocking
from rps_astro_cli.protocol.openai import (
    ApiError,
    ApiLimits,
    decode_json_body,
    http_error_body,
    parse_chat_request,
    parse_completion_request,
    prompt_token_ids,
    refuse_unsimulated,
    vision_charge,
)
from rps_astro_cli.tokens import count_tokens_fallback, token_ids_fallback

log = logging.getLogger(__name__)

WORDS = (" the", " of", " and", " to", " in", " a", " is", " that",
         " for", " it", " as", " was", " with", " be", " by", " on")
_WORDS_JSON = tuple(json.dumps(w) for w in WORDS)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def synthetic_text(num_tokens: int) -> str:
    """The engine's output text for `num_tokens` tokens (token i is WORDS[i % 16])."""
    return "".join(WORDS[i % len(WORDS)] for i in range(num_tokens))


# -- metrics ---------------------------------------------------------------------------
class _EngineCollector:
    """Reads gauges and counters from the engine at scrape time, so /metrics always
    agrees with the engine's state."""

    def __init__(self, engine: SimEngine, model: str):
        self.engine = engine
        self.model = model

    def collect(self):
        e, lab = self.engine, [self.model]
        for name, doc, val in (
            ("vllm:num_requests_running", "Requests in the running batch.", e.num_running),
            ("vllm:num_requests_waiting", "Requests in the waiting queue.", e.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage: used blocks / total (0-1).", e.kv_cache_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(lab, val)
            yield g
        from rps_astro_cli.rps.queue_metrics import PROMETHEUS_GAUGES

        classes = e.class_metrics()
        for key, (name, doc) in PROMETHEUS_GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name", "class"])
            for cls, vals in classes.items():
                g.add_metric([self.model, cls], vals[key])
            yield g
        c = e.counters
        for name, doc, val in (
            ("vllm:num_preemptions", "Preemptions by recompute.", e.inst.num_preemptions_total),
            ("vllm:prompt_tokens", "Prompt tokens of admitted requests.", c.prompt_tokens_total),
            ("vllm:generation_tokens", "Output tokens sampled.", c.generation_tokens_total),
            ("vllm:request_success", "Requests finished.", c.requests_finished_total),
            ("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up.",
             e.inst.prefix_cache_queries_tokens),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens served from the cache.",
             e.inst.prefix_cache_hits_tokens),
        ):
            m = CounterMetricFamily(name, doc, labels=["model_name"])
            m.add_metric(lab, val)
            yield m
        # astro's own: is the wall-clock loop keeping up with the model's step times?
        for name, doc, val in (
            ("astro:engine_steps", "Engine steps run.", c.steps_total),
            ("astro:engine_steps_late", "Steps delivered > 5 ms (wall) after their scheduled end.",
             c.steps_late_total),
        ):
            m = CounterMetricFamily(name, doc, labels=["model_name"])
            m.add_metric(lab, val)
            yield m
        g = GaugeMetricFamily("astro:engine_lag_seconds_max", "Largest wall-clock delivery delay "
                              "behind a step's scheduled end.", labels=["model_name"])
        g.add_metric(lab, c.lag_wall_s_max)
        yield g


# -- SSE response that always watches for disconnects -----------------------------------
class _SSEResponse(StreamingResponse):
    """A StreamingResponse that listens for client disconnect whatever the ASGI spec
    version, cancelling the body iterator (whose `finally` aborts the request)."""

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:

            async def stream() -> None:
                await self.stream_response(send)
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()


async def _read_body(request: Request, limit: int) -> bytes:
    cl = request.headers.get("content-length")
    if cl and cl.isdigit() and int(cl) > limit:
        raise ApiError(413, f"request body is {cl} bytes, over the limit of {limit}", param="body")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise ApiError(413, f"request body is over the limit of {limit} bytes", param="body")
    return bytes(buf)


@dataclass
class _Ctx:
    engine: SimEngine
    model: str
    api_key: str | None
    limits: ApiLimits
    counter: Any
    # prompt text → token ids for prefix caching (the fallback's when `counter` is the
    # fallback counter; None: another tokenizer counts, so no ids, no prefix hits)
    token_ids: Any = None


def create_app(engine: SimEngine, *, api_key: str | None = None, limits: ApiLimits = ApiLimits(),
               served_model_name: str | None = None, counter=count_tokens_fallback) -> FastAPI:
    """An OpenAI-compatible app over `engine` (started/stopped by the app's lifespan).

    api_key: when set, /v1 routes need `Authorization: Bearer <api_key>` (else 401).
    limits: body size / media bounds. served_model_name: the model name clients use
    (default: the profile's `model`). counter: prompt token counter (text → tokens).
    The app's Prometheus registry is `app.state.registry`; the engine is `app.state.engine`.
    """
    ctx = _Ctx(engine, served_model_name or engine.profile.model, api_key, limits, counter,
               token_ids_fallback if counter is count_tokens_fallback else None)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_EngineCollector(engine, ctx.model))
    ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (engine seconds).",
                     ["model_name"], buckets=TTFT_BUCKETS_S, registry=registry).labels(ctx.model)
    e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency (engine seconds).",
                    ["model_name"], buckets=E2E_BUCKETS_S, registry=registry).labels(ctx.model)
    engine.on_first_token = ttft.observe
    engine.on_finish = e2e.observe

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.close()

    app = FastAPI(title="astro sim engine", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.registry = registry

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.to_dict(), status_code=exc.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})  # unknown route / wrong method: OpenAI shape, not {"detail"}
        allow = {k.lower(): v for k, v in headers.items()}.get("allow")
        return JSONResponse(http_error_body(exc.status_code, request.method, request.url.path, exc.detail, allow),
                            status_code=exc.status_code, headers=headers or None)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        rid = uuid.uuid4().hex[:12]
        log.error("server fault (request id %s) on %s", rid, request.url.path, exc_info=exc)
        return JSONResponse({"error": {"message": f"internal server error (request id {rid})",
                                       "type": "server_error", "param": None, "code": 500}},
                            status_code=500)

    def _check_key(request: Request) -> None:
        if ctx.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        token = auth[7:] if auth[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode(), ctx.api_key.encode()):
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                           param="authorization")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "instance_id": engine.instance_id}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        why = engine.not_ready_reason()
        if why is None:
            return JSONResponse({"ready": True, "instance_id": engine.instance_id})
        return JSONResponse({"ready": False, "instance_id": engine.instance_id, "reason": why}, status_code=503)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _check_key(request)
        return {"object": "list", "data": [{
            "id": ctx.model, "object": "model", "created": 0, "owned_by": "astro",
            "root": ctx.model, "max_model_len": engine.config.max_model_len}]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict[str, Any]:
        _check_key(request)
        if model_id != ctx.model:
            raise ApiError(404, f"model: the model {model_id!r} does not exist; this engine serves {ctx.model!r}",
                           param="model")
        return {"id": ctx.model, "object": "model", "created": 0, "owned_by": "astro", "root": ctx.model,
                "max_model_len": engine.config.max_model_len}

    @app.get("/version")
    async def version() -> dict[str, str]:
        from rps_astro_cli import __version__

        return {"version": __version__, "engine": "astro-sim"}

    @app.get("/status")
    async def status(prefix_since: int | None = None) -> JSONResponse:
        # the codec's dict rendered directly (the same bytes as returning the dict, without
        # FastAPI's response-model validation and jsonable_encoder pass over every request)
        body = engine.status().to_dict()
        cache = engine.inst.cache
        if prefix_since is not None and cache is not None:
            body["prefix_cache"] = cache.delta(prefix_since)
        return JSONResponse(body)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        # vLLM's route (its dev mode): forget every cached block; vLLM answers 200 and
        # only logs when blocks are still in use — here that is a 409 the caller can see
        cache = engine.inst.cache
        if cache is None:
            return JSONResponse({"reset": False, "reason": "prefix caching is off"})
        if not cache.reset():
            raise ApiError(409, "prefix cache not reset: requests still hold KV blocks; reset when the engine is "
                           "idle", None, "conflict")
        return JSONResponse({"reset": True})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def _handle(request: Request, endpoint: str) -> Response:
        _check_key(request)
        if engine.draining:
            raise ApiError(503, "engine is shutting down (draining); send the request to another instance",
                           param=None)
        body = decode_json_body(await _read_body(request, ctx.limits.max_body_bytes))
        if isinstance(body, dict):
            refuse_unsimulated(body, endpoint)
        if endpoint == "completions":
            req = parse_completion_request(body, ctx.counter)
        else:
            req = parse_chat_request(body, ctx.counter, ctx.limits)
        if req.model is not None and req.model != ctx.model:
            raise ApiError(404, f"model: the model {req.model!r} does not exist; this engine serves "
                           f"{ctx.model!r}", param="model")
        charge = vision_charge(req, engine.profile.vision)
        rid = ("cmpl-" if endpoint == "completions" else "chatcmpl-") + uuid.uuid4().hex
        ids = prompt_token_ids(body, endpoint, ctx.token_ids) if ctx.token_ids is not None else ()
        er = engine.submit(req, charge, request_id=rid, token_ids=ids)
        fmt = _Format(rid, ctx.model, endpoint)
        if req.stream:
            return _SSEResponse(_stream(engine, er, fmt, req.include_usage), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
        return await _complete(request, engine, er, fmt)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _handle(request, "chat")

    return app


# -- response formatting ---------------------------------------------------------------
class _Format:
    """Pre-built JSON fragments of one request's responses (one string concat per token)."""

    __slots__ = ("rid", "model", "chat", "created", "head", "tok_pre", "tok_post")

    def __init__(self, rid: str, model: str, endpoint: str):
        self.rid, self.model, self.chat = rid, model, endpoint == "chat"
        self.created = int(time.time())
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        self.head = (f'{{"id":{json.dumps(rid)},"object":"{obj}","created":{self.created},'
                     f'"model":{json.dumps(model)},')
        if self.chat:
            self.tok_pre = 'data: ' + self.head + '"choices":[{"index":0,"delta":{"content":'
            self.tok_post = '},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self.tok_pre = 'data: ' + self.head + '"choices":[{"index":0,"text":'
            self.tok_post = ',"logprobs":null,"finish_reason":null}]}\n\n'

    def last_token(self, i: int, reason: str) -> str:
        return (self.tok_pre + _WORDS_JSON[i % len(WORDS)]
                + self.tok_post.replace('"finish_reason":null', f'"finish_reason":"{reason}"'))

    def role_chunk(self) -> str:
        return ('data: ' + self.head + '"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
                '"logprobs":null,"finish_reason":null}]}\n\n')

    def usage_chunk(self, usage: dict[str, int], timing: dict[str, Any] | None = None) -> str:
        extra = ',"astro_timing":' + json.dumps(timing) if timing else ''
        return 'data: ' + self.head + '"choices":[],"usage":' + json.dumps(usage) + extra + '}\n\n'

    def full(self, er: EngineRequest, usage: dict[str, int]) -> dict[str, Any]:
        text = synthetic_text(er.output_tokens)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": er.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": er.finish_reason}
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": usage}


def _astro_timing(er: EngineRequest) -> dict[str, Any]:
    """Engine-side split of a finished request for `astro profile` (engine seconds):
    vision/KV tokens, encoder_s, wait_s = first schedule − arrival (preprocessing + queue),
    prefill_s = first token − first schedule − encoder_s. Sent in the usage chunk."""
    s = er.sim
    sched = s.first_scheduled_s if s.first_scheduled_s is not None else s.arrival_s
    first = s.first_token_s if s.first_token_s is not None else sched
    return {"modality": s.modality, "req_class": s.req_class, "vision_tokens": s.vision_tokens,
            "kv_tokens": s.prompt_tokens, "encoder_s": s.encoder_s, "wait_s": sched - s.arrival_s,
            "prefill_s": first - sched - s.encoder_s}


def _usage(er: EngineRequest) -> dict[str, int]:
    return {"prompt_tokens": er.prompt_tokens, "completion_tokens": er.output_tokens,
            "total_tokens": er.prompt_tokens + er.output_tokens}


def _error_event(exc: Exception) -> str:
    return "data: " + json.dumps({"error": {"message": str(exc), "type": "server_error",
                                            "param": None, "code": 500}}) + "\n\n"


async def _stream(engine: SimEngine, er: EngineRequest, fmt: _Format, include_usage: bool) -> AsyncIterator[str]:
    sent = 0
    last = er.output_tokens
    nw = len(WORDS)
    pre, post, words = fmt.tok_pre, fmt.tok_post, _WORDS_JSON
    try:
        while True:
            item = await er.queue.get()
            if isinstance(item, Exception):
                yield _error_event(item) + "data: [DONE]\n\n"
                return
            if item == FINISHED:
                tail = fmt.usage_chunk(_usage(er), _astro_timing(er)) if include_usage else ""
                yield tail + "data: [DONE]\n\n"
                return
            parts = [fmt.role_chunk()] if fmt.chat and sent == 0 else []
            while sent < item:
                parts.append(fmt.last_token(sent, er.finish_reason) if sent + 1 == last
                             else pre + words[sent % nw] + post)
                sent += 1
            yield parts[0] if len(parts) == 1 else "".join(parts)
    finally:
        if not er.done:
            engine.abort(er)


async def _complete(request: Request, engine: SimEngine, er: EngineRequest, fmt: _Format) -> Response:
    """Wait for the whole output, aborting the request if the client disconnects."""
    result: list[Any] = []

    async with anyio.create_task_group() as tg:

        async def wait_done() -> None:
            while True:
                item = await er.queue.get()
                if isinstance(item, Exception) or item == FINISHED:
                    result.append(item)
                    tg.cancel_scope.cancel()
                    return

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            engine.abort(er)
            tg.cancel_scope.cancel()

        tg.start_soon(wait_done)
        tg.start_soon(watch)
    if not result:  # client gone: nobody reads this response
        return Response(status_code=499)
    if isinstance(result[0], EngineShutdown):  # shut down / drain over: 503, try elsewhere (no traceback)
        return JSONResponse({"error": {"message": str(result[0]), "type": "engine_unavailable", "param": None,
                                       "code": 503}}, status_code=503)
    if isinstance(result[0], Exception):
        raise result[0]
    return JSONResponse(fmt.full(er, _usage(er)))


# -- running ---------------------------------------------------------------------------
def run_engine(engine: SimEngine, *, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, limits: ApiLimits = ApiLimits(),
               served_model_name: str | None = None, log_level: str = "warning",
               ready_file: str | None = None, counter=count_tokens_fallback) -> None:
    """Serve `engine` over HTTP until interrupted (blocking). `counter` counts prompt
    tokens (default `tokens.count_tokens_fallback`).

    With an internal token in the environment ($ASTRO_INTERNAL_TOKEN / _FILE,
    `protocol.internal_auth`) every route but /health and /ready needs it; binding a
    non-loopback `host` with neither it nor `api_key` prints a warning.

    Prints `ready: http://HOST:PORT` on stdout once listening (with port 0 the OS picks a
    port); `ready_file`, when given, receives the same URL.

    Raises:
        AstroUserError: the address cannot be bound.
    """
    import sys

    from rps_astro_cli.protocol.http_server import drain_seconds
    from rps_astro_cli.protocol.internal_auth import TOKEN_ENV, exposure_warning, guard, internal_token

    token = internal_token()  # the cluster's internal token: every route but /health and /ready needs it
    if (msg := exposure_warning(host, "engine", bool(token or api_key), f"${TOKEN_ENV} (or --api-key)")):
        print(msg, file=sys.stderr, flush=True)
    app = create_app(engine, api_key=api_key, limits=limits, served_model_name=served_model_name,
                     counter=counter)
    drain_s = drain_seconds()
    serve_blocking(guard(app, token), host, port, log_level, ready_file, on_exit=lambda: start_drain(engine, drain_s),
                   drain_s=drain_s + 1.0)


def start_drain(engine: SimEngine, drain_s: float) -> None:
    """SIGTERM: stop admitting (new requests 503, `/ready` 503) and give in-flight
    requests `drain_s` seconds; then end the rest with a clean error (a 503 body or an SSE
    error event), before the server's own deadline (`drain_s` + 1) would cancel them.
    Call on the engine's event loop."""
    import asyncio

    engine.draining = True
    log.warning("draining: %d request(s) in flight, %.1f s to finish", engine.num_live, drain_s)

    def cut() -> None:
        n = engine.fail_all(f"engine shut down: the {drain_s:g} s drain period ended first")
        if n:
            log.warning("drain period over: %d request(s) ended unfinished", n)

    asyncio.get_running_loop().call_later(drain_s, cut)
