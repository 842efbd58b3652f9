"""The sim engine's HTTP face: an OpenAI-compatible FastAPI app over a `SimEngine`.

Routes:
- `POST /v1/completions`, `POST /v1/chat/completions` (see `protocol.openai` for fields);
  streaming answers are SSE `data: {...}` chunks, one per output token (token text is
  synthetic: one short word per token; counts are exact), ending `data: [DONE]`; with
  `stream_options.include_usage` a usage-only chunk (`choices: []`) precedes `[DONE]`.
  Chat streams send the `{"role": "assistant"}` delta together with the first token (as
  vLLM does), so a client's first chunk marks the first token. Honoured as vLLM does:
  `stop` strings and `seed` (`engine.synthetic`: the cut text, finish_reason "stop",
  `stop_reason`), and `n` (n sequences, one engine request each, choices indexed
  0..n−1; usage counts the prompt once; child i's seed is seed + i), log-probabilities
  (chat `logprobs` + `top_logprobs`, completions `logprobs`: vLLM's objects, streamed one
  token per chunk, synthetic values from `engine.synthetic.top_logprobs`), `echo`
  (completions: the prompt text before the output, streamed with the first token, its
  tokens first in logprobs; chat: the last message's text when it is the assistant's,
  streamed as its own chunk after the role). `tools` with tool_choice "auto" are refused
  as a vLLM without `--enable-auto-tool-choice` refuses them; structured output and
  generated tool calls are refused explicitly (`protocol.openai.refuse_unsimulated`).
- `POST /tokenize`, `POST /detokenize`: vLLM's shapes (`{prompt | messages}` →
  `{count, max_model_len, tokens, token_strs}`; `{tokens}` → `{prompt}`), with the
  engine's tokenizer (`tokens.FallbackCodec` or `HFCodec` for `--tokenizer`).
- `GET /v1/models`, `GET /health` (liveness), `GET /ready` (readiness: 503 before the
  engine loop runs and while draining), `GET /status` (the `InstanceStatus` snapshot; requests
  still in multimodal preprocessing are not in it yet: they are not schedulable; waiting
  requests carry their prefix-cache hit `cached_tokens`; `?prefix_since=N` adds
  `prefix_cache`, the change of the set of cached block hashes since cache event N, or
  the whole set for N = 0: `sim.prefix_cache.PrefixCache.delta`),
  `POST /reset_prefix_cache` (vLLM's dev-mode route: forget every cached block; 409 while
  requests hold blocks, where vLLM logs and answers 200),
  `GET /metrics` (Prometheus text, vLLM 0.32's metric names, labels `model_name` and
  `engine` ("0"), one CollectorRegistry per app): gauges `vllm:num_requests_running`,
  `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (used blocks / total, 0–1);
  counters `vllm:num_preemptions_total`, `vllm:prompt_tokens_total`,
  `vllm:generation_tokens_total`, `vllm:request_success_total{finished_reason}` (stop |
  length | abort | error), `vllm:prefix_cache_queries_total` /
  `vllm:prefix_cache_hits_total` (tokens); histograms (vLLM's buckets and definitions:
  `_RequestHistograms`) `vllm:time_to_first_token_seconds`,
  `vllm:inter_token_latency_seconds`, `vllm:request_time_per_output_token_seconds`,
  `vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds`,
  `vllm:request_prefill_time_seconds`, `vllm:request_decode_time_seconds`,
  `vllm:request_inference_time_seconds`, `vllm:request_prompt_tokens`,
  `vllm:request_generation_tokens`, `vllm:request_params_max_tokens`, in engine
  (simulated) seconds, which equal wall seconds at time_scale 1.0; and astro's own `astro:engine_steps_total`,
  `astro:engine_steps_late_total` (delivered > 5 ms wall after the scheduled end),
  `astro:engine_lag_seconds_max` (wall seconds): whether the loop keeps up.

Errors are `{"error": {"message", "type", "param", "code"}}`: 400 bad field, 401 bad API
key (checked on /v1 routes when set), 404 unknown model, 413 body too large, 500 server
fault (with a request id, logged; never a traceback). A client that disconnects aborts
its request, which frees its KV blocks; one that disconnects while sending its body is one
log line. No `/docs`, `/redoc` or `/openapi.json` (they would answer without the key).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from rps_astro_cli.engine.sim_engine import FINISHED, EngineRequest, EngineShutdown, SimEngine
from rps_astro_cli.engine.synthetic import WORDS, chat_logprobs, completion_logprobs, synthetic_text
from rps_astro_cli.engine.synthetic import WORDS_JSON as _WORDS_JSON
from rps_astro_cli.protocol.http_server import OFF_LOOP_BYTES, off_loop, serve_blocking
from rps_astro_cli.protocol.limits import CostLimits, check_request_cost
from rps_astro_cli.protocol.openai import (
    CHAT_TOKENS_PER_MESSAGE,
    CHAT_TOKENS_REPLY_PRIMER,
    ApiError,
    ApiLimits,
    ParsedRequest,
    chat_prompt_tokens,
    decode_json_body,
    http_error_body,
    parse_chat_request,
    parse_completion_request,
    prompt_token_ids,
    refuse_unsimulated,
    resolve_max_tokens,
    vision_charge,
)
from rps_astro_cli.tokens import FALLBACK_VOCAB_SIZE, FallbackCodec, count_tokens_fallback, token_ids_fallback

log = logging.getLogger(__name__)

# vLLM 0.32's default buckets (vllm/v1/metrics/buckets.py), so a vLLM dashboard's quantiles match
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
ENGINE_INDEX = "0"  # vLLM's `engine` label: the engine-core index (one per sim engine process)


def tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's request-token buckets: the 1-2-5 series up to max_model_len."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _RequestHistograms:
    """vLLM's per-request histograms, observed as tokens are delivered and requests end
    (engine seconds; vLLM's definitions, vllm/v1/metrics/stats.py): TTFT (first token −
    arrival), ITL (gap between a request's consecutive tokens), E2E (last token −
    arrival), queue time (first scheduled − joining the waiting queue: arrival, or the
    end of multimodal preprocessing), prefill time (first token − first scheduled),
    decode time (last − first token), inference time (last token − first scheduled),
    time per output token (decode time / (tokens − 1)), prompt and generation tokens,
    max_tokens; labels `model_name`, `engine`."""

    def __init__(self, registry: CollectorRegistry, model: str, max_model_len: int):
        lab = (model, ENGINE_INDEX)
        tok = tokens_buckets(max_model_len)

        def h(name: str, doc: str, buckets) -> Any:
            return Histogram(name, doc, ["model_name", "engine"], buckets=buckets, registry=registry).labels(*lab)

        self.ttft = h("vllm:time_to_first_token_seconds", "Time to first token (engine seconds).", TTFT_BUCKETS_S)
        self.itl = h("vllm:inter_token_latency_seconds", "Inter-token latency (engine seconds).", ITL_BUCKETS_S)
        self.tpot = h("vllm:request_time_per_output_token_seconds",
                      "Time per output token per request: decode time / (tokens - 1).", ITL_BUCKETS_S)
        self.e2e = h("vllm:e2e_request_latency_seconds", "End-to-end request latency (engine seconds).",
                     E2E_BUCKETS_S)
        self.queue = h("vllm:request_queue_time_seconds", "Time in the waiting queue before first scheduled.",
                       E2E_BUCKETS_S)
        self.prefill = h("vllm:request_prefill_time_seconds", "First scheduled to first token.", E2E_BUCKETS_S)
        self.decode = h("vllm:request_decode_time_seconds", "First token to last token.", E2E_BUCKETS_S)
        self.inference = h("vllm:request_inference_time_seconds", "First scheduled to last token.", E2E_BUCKETS_S)
        self.prompt = h("vllm:request_prompt_tokens", "Prompt tokens per request.", tok)
        self.generation = h("vllm:request_generation_tokens", "Generation tokens per request.", tok)
        self.max_tokens = h("vllm:request_params_max_tokens", "The max_tokens bound per request.", tok)

    def finished(self, er: EngineRequest, end_s: float) -> None:
        s = er.sim
        sched = s.first_scheduled_s if s.first_scheduled_s is not None else s.arrival_s
        first = s.first_token_s if s.first_token_s is not None else end_s
        queued = er.ready_s if er.ready_s is not None else s.arrival_s
        self.e2e.observe(end_s - s.arrival_s)
        self.queue.observe(max(0.0, sched - queued))
        self.prefill.observe(first - sched)
        self.decode.observe(end_s - first)
        self.inference.observe(end_s - sched)
        n = s.num_generated_tokens
        if n > 1:
            self.tpot.observe((end_s - first) / (n - 1))
        self.prompt.observe(s.prompt_tokens)
        self.generation.observe(n)
        self.max_tokens.observe(er.max_tokens)


# -- metrics ---------------------------------------------------------------------------
class _EngineCollector:
    """Reads gauges and counters from the engine at scrape time, so /metrics always
    agrees with the engine's state."""

    def __init__(self, engine: SimEngine, model: str):
        self.engine = engine
        self.model = model

    def collect(self):
        e, lab, labels = self.engine, [self.model, ENGINE_INDEX], ["model_name", "engine"]
        for name, doc, val in (
            ("vllm:num_requests_running", "Requests in the running batch.", e.num_running),
            ("vllm:num_requests_waiting", "Requests in the waiting queue.", e.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage: used blocks / total (0-1).", e.kv_cache_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(lab, val)
            yield g
        from rps_astro_cli.rps.queue_metrics import PROMETHEUS_GAUGES

        classes = e.class_metrics()
        for key, (name, doc) in PROMETHEUS_GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=[*labels, "class"])
            for cls, vals in classes.items():
                g.add_metric([*lab, cls], vals[key])
            yield g
        c = e.counters
        for name, doc, val in (
            ("vllm:num_preemptions", "Preemptions by recompute.", e.inst.num_preemptions_total),
            ("vllm:prompt_tokens", "Prompt tokens of admitted requests.", c.prompt_tokens_total),
            ("vllm:generation_tokens", "Output tokens sampled.", c.generation_tokens_total),
            ("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up.",
             e.inst.prefix_cache_queries_tokens),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens served from the cache.",
             e.inst.prefix_cache_hits_tokens),
        ):
            m = CounterMetricFamily(name, doc, labels=labels)
            m.add_metric(lab, val)
            yield m
        m = CounterMetricFamily("vllm:request_success", "Requests ended, by vLLM's finished_reason.",
                                labels=[*labels, "finished_reason"])
        for reason, val in c.finished_by_reason.items():
            m.add_metric([*lab, reason], val)
        yield m
        # astro's own: is the wall-clock loop keeping up with the model's step times?
        for name, doc, val in (
            ("astro:engine_steps", "Engine steps run.", c.steps_total),
            ("astro:engine_steps_late", "Steps delivered > 5 ms (wall) after their scheduled end.",
             c.steps_late_total),
        ):
            m = CounterMetricFamily(name, doc, labels=labels)
            m.add_metric(lab, val)
            yield m
        g = GaugeMetricFamily("astro:engine_lag_seconds_max", "Largest wall-clock delivery delay "
                              "behind a step's scheduled end.", labels=labels)
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
    """The raw body (413 over `limit`). A client that disconnects before sending all of it
    is logged as one line (no traceback) and answered 499, which nobody reads."""
    cl = request.headers.get("content-length")
    if cl and cl.isdigit() and int(cl) > limit:
        raise ApiError(413, f"request body is {cl} bytes, over the limit of {limit}", param="body")
    buf = bytearray()
    try:
        async for chunk in request.stream():
            buf += chunk
            if len(buf) > limit:
                raise ApiError(413, f"request body is over the limit of {limit} bytes", param="body")
    except ClientDisconnect:
        log.warning("client disconnected during the body of %s %s (%d bytes received)", request.method,
                    request.url.path, len(buf))
        raise ApiError(499, "client disconnected before sending the whole body", param="body") from None
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
    cost: CostLimits = CostLimits()  # what one request may ask for (n, tokens, logprobs)


def create_app(engine: SimEngine, *, api_key: str | None = None, limits: ApiLimits = ApiLimits(),
               served_model_name: str | None = None, counter=count_tokens_fallback, codec=None) -> FastAPI:
    """An OpenAI-compatible app over `engine` (started/stopped by the app's lifespan).

    api_key: when set, /v1 routes need `Authorization: Bearer <api_key>` (else 401).
    limits: body size / media bounds. served_model_name: the model name clients use
    (default: the profile's `model`). counter: prompt token counter (text → tokens).
    codec: `tokens.FallbackCodec` / `HFCodec` for /tokenize and /detokenize (default: the
    fallback's when `counter` is the fallback counter; else those routes answer 501).
    The app's Prometheus registry is `app.state.registry`; the engine is `app.state.engine`.
    """
    ctx = _Ctx(engine, served_model_name or engine.profile.model, api_key, limits, counter,
               token_ids_fallback if counter is count_tokens_fallback else None, cost=CostLimits.from_env())
    if codec is None and counter is count_tokens_fallback:
        codec = FallbackCodec()
    # a token-id prompt's ids must be below this (the codec's vocabulary; unknown: the fallback's)
    vocab_size = int(getattr(codec, "vocab_size", FALLBACK_VOCAB_SIZE))
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_EngineCollector(engine, ctx.model))
    hists = _RequestHistograms(registry, ctx.model, engine.config.max_model_len)
    engine.on_first_token = hists.ttft.observe
    engine.on_token = hists.itl.observe
    engine.on_finish = hists.finished

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.close()

    # no /docs, /redoc or /openapi.json: they would answer without the key
    app = FastAPI(title="astro sim engine", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
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

    def _codec_model(body: dict[str, Any]):
        if codec is None:
            raise ApiError(501, "this engine counts tokens with a counter that has no token ids; start it with "
                           "--tokenizer PATH (or the fallback counter) to use /tokenize and /detokenize",
                           param=None, err_type="NotImplementedError")
        m = body.get("model")
        if m is not None and m != ctx.model:
            raise ApiError(404, f"model: the model {m!r} does not exist; this engine serves {ctx.model!r}",
                           param="model")
        return codec

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        """vLLM's /tokenize: {prompt, add_special_tokens (default true)} or {messages}
        (chat: the count is the prompt's `usage.prompt_tokens`, astro's chat accounting;
        the formatting tokens are id 0) → {count, max_model_len, tokens, token_strs}."""
        _check_key(request)
        body = decode_json_body(await _read_body(request, ctx.limits.max_body_bytes))
        c = _codec_model(body)
        strs = _bool_field_of(body, "return_token_strs")
        if body.get("messages") is not None:
            text, images, frames = chat_prompt_tokens(body["messages"], ctx.counter, ctx.limits)
            if images or frames:
                raise ApiError(400, "messages: /tokenize counts text only; remove image_url / video_url parts",
                               param="messages")
            ids: list[int] = []
            for m in body["messages"]:
                ids += [0] * CHAT_TOKENS_PER_MESSAGE + c.encode(m["role"])
                content = m.get("content")
                for t in ([content] if isinstance(content, str) else
                          [p["text"] for p in content or () if p.get("type") == "text"]):
                    ids += c.encode(t)
            ids += [0] * CHAT_TOKENS_REPLY_PRIMER
            if len(ids) != text:  # pragma: no cover - the counter and the codec disagree
                log.warning("tokenize: %d ids for a %d-token chat prompt", len(ids), text)
        elif isinstance(body.get("prompt"), str):
            add = body.get("add_special_tokens", True)
            ids = c.encode(body["prompt"], add_special_tokens=bool(add))
        else:
            raise ApiError(400, "prompt: required: a string (or send messages for a chat prompt)", param="prompt")
        out: dict[str, Any] = {"count": len(ids), "max_model_len": engine.config.max_model_len, "tokens": ids,
                               "token_strs": None}
        if strs:
            chat = body.get("messages") is not None
            out["token_strs"] = ["" if chat and i == 0 else c.token_strs([i])[0] for i in ids]
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        """vLLM's /detokenize: {tokens: [int ≥ 0]} → {prompt}."""
        _check_key(request)
        body = decode_json_body(await _read_body(request, ctx.limits.max_body_bytes))
        c = _codec_model(body)
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                 for t in toks):
            raise ApiError(400, "tokens: must be a list of token ids (integers ≥ 0)", param="tokens")
        try:
            text = c.decode(toks)
        except KeyError as exc:
            raise ApiError(400, f"tokens: {exc.args[0]} is not a token id of this engine's tokenizer",
                           param="tokens") from None
        return JSONResponse({"prompt": text})

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

    def _parse(raw: bytes, endpoint: str) -> tuple[Any, ParsedRequest]:
        body = decode_json_body(raw)
        if isinstance(body, dict):
            refuse_unsimulated(body, endpoint)
        if endpoint == "completions":
            return body, parse_completion_request(body, ctx.counter, vocab_size)
        return body, parse_chat_request(body, ctx.counter, ctx.limits)

    async def _handle(request: Request, endpoint: str) -> Response:
        _check_key(request)
        if engine.draining:
            raise ApiError(503, "engine is shutting down (draining); send the request to another instance",
                           param=None)
        raw = await _read_body(request, ctx.limits.max_body_bytes)
        # a big body is decoded and counted off the event loop (the simulated steps run on it)
        body, req = await off_loop(_parse, raw, endpoint) if len(raw) > OFF_LOOP_BYTES else _parse(raw, endpoint)
        if req.model is not None and req.model != ctx.model:
            raise ApiError(404, f"model: the model {req.model!r} does not exist; this engine serves "
                           f"{ctx.model!r}", param="model")
        charge = vision_charge(req, engine.profile.vision)
        prompt = req.text_tokens + charge.vision_tokens
        check_request_cost(req, prompt, resolve_max_tokens(req, prompt, engine.config.max_model_len), ctx.cost)
        rid = ("cmpl-" if endpoint == "completions" else "chatcmpl-") + uuid.uuid4().hex
        ids = prompt_token_ids(body, endpoint, ctx.token_ids) if ctx.token_ids is not None else ()
        ers = [engine.submit(req, charge, request_id=rid, token_ids=ids)]
        for i in range(1, req.n):  # n > 1: one sequence per choice (child i's seed: seed + i)
            child = replace(req, seed=req.seed + i) if req.seed is not None else req
            ers.append(engine.submit(child, charge, request_id=f"{rid}-{i}", token_ids=ids))
        fmt = _Format(rid, ctx.model, endpoint)
        fmt.logprobs = req.logprobs
        if req.echo:
            fmt.echo_text, fmt.echo_tokens = _echo(body, endpoint, codec, req.logprobs is not None)
        if req.stream:
            plain = len(ers) == 1 and ers[0].text is None and req.logprobs is None and not fmt.echo_text
            body_iter = (_stream(engine, ers[0], fmt, req.include_usage) if plain
                         else _stream_choices(engine, ers, fmt, req.include_usage))
            return _SSEResponse(body_iter, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _complete(request, engine, ers, fmt)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _handle(request, "completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _handle(request, "chat")

    return app


def _echo(body: dict[str, Any], endpoint: str, codec: Any, with_logprobs: bool) -> tuple[str, tuple[str, ...]]:
    """What `echo` puts before the output, as vLLM does: completions: the prompt text (a
    token-id prompt decoded) and, when logprobs are asked, its token strings; chat: the
    last message's text when that message is the assistant's (else nothing), no tokens."""
    if endpoint == "chat":
        last = (body.get("messages") or [None])[-1]
        if not isinstance(last, dict) or last.get("role") != "assistant":
            return "", ()
        c = last.get("content") or ""
        text = c if isinstance(c, str) else "\n".join(p.get("text", "") for p in c if p.get("type") == "text")
        return text, ()
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if codec is None and (with_logprobs or not isinstance(p, str)):
        raise ApiError(400, "echo: this engine's token counter has no token ids, so it cannot echo a token-id "
                       "prompt or its logprobs; start it with --tokenizer PATH (or the fallback counter)", "echo")
    try:
        ids = codec.encode(p) if isinstance(p, str) and codec is not None else list(p) if codec is not None else []
        text = p if isinstance(p, str) else codec.decode(ids)
        toks = tuple(codec.token_strs(ids)) if with_logprobs else ()
    except KeyError as exc:
        raise ApiError(400, f"prompt: {exc.args[0]} is not a token id of this engine's tokenizer, so it cannot "
                       "be echoed", "prompt") from None
    return text, toks


def _bool_field_of(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if v is not None and not isinstance(v, bool):
        raise ApiError(400, f"{key}: must be true or false, got {v!r}", param=key)
    return bool(v)


# -- response formatting ---------------------------------------------------------------
class _Format:
    """Pre-built JSON fragments of one request's responses (one string concat per token)."""

    __slots__ = ("rid", "model", "chat", "created", "head", "tok_pre", "tok_post", "logprobs", "echo_text",
                 "echo_tokens")

    def __init__(self, rid: str, model: str, endpoint: str):
        self.rid, self.model, self.chat = rid, model, endpoint == "chat"
        self.logprobs: int | None = None  # top logprobs per token asked for (None: no logprobs)
        self.echo_text = ""  # `echo`: the text before the output (`_echo`)
        self.echo_tokens: tuple[str, ...] = ()  # its token strings (completions echo with logprobs)
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

    def chunk(self, index: int, text: str | None, finish: str | None = None, stop_reason: str | None = None,
              logprobs: dict[str, Any] | None = None) -> str:
        """One stream chunk of choice `index` built field by field (the path for seeded or
        stopped text, n > 1, logprobs and echo): a token's `text` with its `logprobs`
        object, or the chat role delta when None."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if text is None else {"content": text}
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        if stop_reason is not None:
            choice["stop_reason"] = stop_reason
        return 'data: ' + self.head + '"choices":[' + json.dumps(choice) + ']}\n\n'

    def full(self, ers: list[EngineRequest], usage: dict[str, int]) -> dict[str, Any]:
        choices = []
        for i, er in enumerate(ers):
            text = self.echo_text + (er.text.text if er.text is not None else synthetic_text(er.output_tokens))
            lp = None
            if self.logprobs is not None:
                toks = output_tokens(er)
                lp = (chat_logprobs(toks, self.logprobs) if self.chat
                      else completion_logprobs(toks, self.logprobs, prompt_tokens=self.echo_tokens))
            if self.chat:
                choice: dict[str, Any] = {"index": i, "message": {"role": "assistant", "content": text},
                                          "logprobs": lp, "finish_reason": er.finish_reason}
            else:
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": er.finish_reason}
            if er.text is not None and er.text.stop_reason is not None:
                choice["stop_reason"] = er.text.stop_reason
            choices.append(choice)
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": usage}


def output_tokens(er: EngineRequest) -> list[str]:
    """The token strings of a request's output (its words; a stop cut keeps whole tokens)."""
    if er.text is not None:
        return [WORDS[w] for w in er.text.word_ids]
    return [WORDS[i % len(WORDS)] for i in range(er.output_tokens)]


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


def _usage(er: EngineRequest, others: list[EngineRequest] | None = None) -> dict[str, int]:
    """The usage object: the prompt once, the output tokens of every choice (`others`: the
    n > 1 request's choices, `er` among them)."""
    out = sum(e.output_tokens for e in others) if others else er.output_tokens
    return {"prompt_tokens": er.prompt_tokens, "completion_tokens": out, "total_tokens": er.prompt_tokens + out}


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


async def _stream_choices(engine: SimEngine, ers: list[EngineRequest], fmt: _Format,
                          include_usage: bool) -> AsyncIterator[str]:
    """The stream of a request with n ≥ 1 choices and/or planned text (seed, stop): each
    choice's tokens as they are generated, tagged with its index; the usage chunk (prompt
    once, every choice's tokens) after the last choice finishes."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, er: EngineRequest) -> None:
        while True:
            item = await er.queue.get()
            merged.put_nowait((i, item))
            if isinstance(item, Exception) or item == FINISHED:
                return

    pumps = [asyncio.ensure_future(pump(i, er)) for i, er in enumerate(ers)]
    sent = [0] * len(ers)
    text_len = [0] * len(ers)  # text streamed so far per choice (completions: the next text_offset)
    deltas = [er.text.deltas() if er.text is not None else None for er in ers]
    toks = [output_tokens(er) for er in ers] if fmt.logprobs is not None else None
    live = len(ers)
    try:
        while live:
            i, item = await merged.get()
            if isinstance(item, Exception):
                yield _error_event(item) + "data: [DONE]\n\n"
                return
            if item == FINISHED:
                live -= 1
                continue
            er, d = ers[i], deltas[i]
            parts = [fmt.chunk(i, None)] if fmt.chat and sent[i] == 0 else []
            if fmt.chat and sent[i] == 0 and fmt.echo_text:  # vLLM: the echoed content, its own chunk
                parts.append(fmt.chunk(i, fmt.echo_text))
            while sent[i] < item:
                k = sent[i]
                last = k + 1 == er.output_tokens
                stop = er.text.stop_reason if last and er.text is not None else None
                text = d[k] if d is not None else WORDS[k % len(WORDS)]
                echo = not fmt.chat and k == 0 and bool(fmt.echo_text)  # completions: the prompt with token 0
                lp = None
                if toks is not None:
                    lp = (chat_logprobs(toks[i][k:k + 1], fmt.logprobs, k) if fmt.chat else
                          completion_logprobs(toks[i][k:k + 1], fmt.logprobs, k, text_len[i],
                                              fmt.echo_tokens if echo else ()))
                if echo:
                    text = fmt.echo_text + text
                text_len[i] += len(text)
                parts.append(fmt.chunk(i, text, er.finish_reason if last else None, stop, lp))
                sent[i] += 1
            yield "".join(parts)
        tail = fmt.usage_chunk(_usage(ers[0], ers), _astro_timing(ers[0])) if include_usage else ""
        yield tail + "data: [DONE]\n\n"
    finally:
        for t in pumps:
            t.cancel()
        for er in ers:
            if not er.done:
                engine.abort(er)


async def _complete(request: Request, engine: SimEngine, ers: list[EngineRequest], fmt: _Format) -> Response:
    """Wait for the whole output of every choice, aborting them if the client disconnects."""
    result: list[Any] = []

    async with anyio.create_task_group() as tg:

        async def wait_done() -> None:
            for er in ers:
                while True:
                    item = await er.queue.get()
                    if isinstance(item, Exception):
                        result.append(item)
                        tg.cancel_scope.cancel()
                        return
                    if item == FINISHED:
                        break
            result.append(FINISHED)
            tg.cancel_scope.cancel()

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            for er in ers:
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
        for er in ers:
            engine.abort(er)
        raise result[0]
    return JSONResponse(fmt.full(ers, _usage(ers[0], ers)))


# -- running ---------------------------------------------------------------------------
def run_engine(engine: SimEngine, *, host: str = "127.0.0.1", port: int = 8000,
               api_key: str | None = None, limits: ApiLimits = ApiLimits(),
               served_model_name: str | None = None, log_level: str = "warning",
               ready_file: str | None = None, counter=count_tokens_fallback, codec=None) -> None:
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
                     counter=counter, codec=codec)
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
