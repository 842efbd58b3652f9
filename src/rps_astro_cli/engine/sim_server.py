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
  generated tool calls are refused explicitly (`protocol.vllm_rules.refuse_unsimulated`).
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
  `engine.sim_metrics._RequestHistograms`) `vllm:time_to_first_token_seconds`,
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

The response bodies and SSE streams live in `engine/sim_responses.py`, the Prometheus
collector and histograms in `engine/sim_metrics.py`.
"""

from __future__ import annotations

import hmac
import logging
import re
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from rps_astro_cli.engine.sim_engine import SimEngine
from rps_astro_cli.engine.sim_metrics import _EngineCollector, _RequestHistograms
from rps_astro_cli.engine.sim_responses import _complete, _echo, _Format, _SSEResponse, _stream, _stream_choices
from rps_astro_cli.protocol.http_server import OFF_LOOP_BYTES, off_loop, serve_blocking
from rps_astro_cli.protocol.limits import CostLimits, check_request_cost
from rps_astro_cli.protocol.media import vision_charge
from rps_astro_cli.protocol.openai import (
    CHAT_TOKENS_PER_MESSAGE,
    CHAT_TOKENS_REPLY_PRIMER,
    chat_prompt_tokens,
    decode_json_body,
    parse_chat_request,
    parse_completion_request,
    prompt_token_ids,
    prompt_tokens_at_least,
    resolve_max_tokens,
)
from rps_astro_cli.protocol.openai_types import ApiError, ApiLimits, ParsedRequest, bad, http_error_body
from rps_astro_cli.protocol.vllm_rules import refuse_unsimulated
from rps_astro_cli.tokens import (
    FALLBACK_VOCAB_SIZE,
    FallbackCodec,
    count_tokens_fallback,
    fallback_space_chars,
    fallback_tokens_at_least,
    token_ids_fallback,
)

log = logging.getLogger(__name__)

# an X-Request-Id the engine takes as its request id's base (else a random one)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")


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
    async def status(prefix_since: int | None = None, steps_since: int | None = None) -> JSONResponse:
        # the codec's dict rendered directly (the same bytes as returning the dict, without
        # FastAPI's response-model validation and jsonable_encoder pass over every request)
        body = engine.status().to_dict()
        cache = engine.inst.cache
        if prefix_since is not None and cache is not None:
            body["prefix_cache"] = cache.delta(prefix_since)
        if steps_since is not None:  # the steps run since, for the Predictor's calibration
            body["steps"] = engine.steps_since(steps_since)
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

    max_len = engine.config.max_model_len
    # a lower bound of a text's count without tokenizing it: the fallback counter's own
    # (`tokens.fallback_tokens_at_least`); none known for another tokenizer (only a
    # token-id prompt's length then)
    text_at_least = fallback_tokens_at_least if counter is count_tokens_fallback else _no_bound
    if counter is count_tokens_fallback:
        fallback_space_chars()  # derived once (~40 ms) here, not in the first request

    def _parse(raw: bytes, endpoint: str) -> tuple[Any, ParsedRequest]:
        body = decode_json_body(raw)
        if isinstance(body, dict):
            refuse_unsimulated(body, endpoint)
            # a prompt certainly past the context is refused as `resolve_max_tokens` would
            # refuse it, before it is counted (tokenized): ~1 ms per MB instead of ~40 ms
            if (n := prompt_tokens_at_least(body, endpoint, text_at_least)) >= max_len:
                raise bad(f"the prompt is at least {n} tokens; this model's maximum context length is {max_len} "
                          "tokens (prompt + output); shorten it", "prompt" if endpoint == "completions" else "messages")
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
        # the client's X-Request-Id when it is a plain token not in use, as vLLM's server
        # takes it (the scheduler names a request it forwards before its tag so, and finds
        # it again in `/status`); else a random one
        kind = "cmpl-" if endpoint == "completions" else "chatcmpl-"
        given = request.headers.get("x-request-id", "")
        rid = kind + given if _REQUEST_ID.fullmatch(given) else ""
        if not rid or engine.is_live(rid) or (req.n > 1 and engine.is_live(rid + "-1")):
            rid = kind + uuid.uuid4().hex
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


def _no_bound(text: str) -> int:
    """No lower bound of a text's tokens (a tokenizer whose longest token is not known)."""
    return 0


def _bool_field_of(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if v is not None and not isinstance(v, bool):
        raise ApiError(400, f"{key}: must be true or false, got {v!r}", param=key)
    return bool(v)


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
