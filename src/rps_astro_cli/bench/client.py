"""Streaming OpenAI-compatible client (httpx) with honest timing.

Per request: POST `/v1/chat/completions` (or `/v1/completions`) with `stream: true` and
`stream_options.include_usage`, then read the SSE stream as raw bytes:

- `SSEDecoder` splits the byte stream into events on line boundaries, decoding UTF-8
  only for complete lines, so a multi-byte character split across network chunks is
  never mangled.
- `StreamTimer` stamps each event with the arrival time of the network chunk that
  completed it. Only an event that carries content (non-empty `delta.content` /
  `delta.reasoning_content` for chat, non-empty `text` for completions) moves timing:
  a role-only first delta or a usage-only last chunk moves neither TTFT nor the end.
- Output tokens: `usage.completion_tokens` when the server reports it, else the shared
  token counter over the received text (`output_tokens_source` says which).
- A non-200 status, an `{"error": ...}` event, a transport error or a stream that ends
  without `[DONE]` or a `finish_reason` marks the request failed (kept apart).

Request body extras (documented for users of plain vLLM / other servers):
- `max_tokens` (`ClientOptions.max_tokens_mode`): "reference" = the workload's reference
  reply length (as `vllm bench serve` does; the default against a plain `--base-url`),
  "none" = not sent (the default against an astro `--cluster`: astro's scheduler clips its
  predicted length by `max_tokens`, so sending the true length there would hand the
  dispatcher an oracle upper bound and flatter prediction-guided policies), or a number;
- `vllm_xargs.astro_output_tokens` = the same true length, so astro's sim engines
  reproduce the dataset's reply length. vLLM passes `vllm_xargs` into
  `SamplingParams.extra_args` (docs.vllm.ai "Custom Arguments"), where an unknown key is
  ignored; other OpenAI-compatible servers may reject unknown fields, so
  `--no-send-true-lengths` turns it off;
- `ignore_eos: true` only with `--ignore-eos` (vLLM extension).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.bench.workloads import MODALITY_CLASS, BenchRequest
from rps_astro_cli.tokens import TokenCounter, count_tokens_fallback


class SSEDecoder:
    """Incremental Server-Sent-Events decoder over bytes.

    `feed(data)` returns the `data:` payloads (str) of the events completed by `data`;
    an event ends at a blank line. `flush()` returns a last event without its blank line.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, data: bytes) -> list[str]:
        self._buf += data
        out: list[str] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                return out
            line, self._buf = self._buf[:nl], self._buf[nl + 1:]
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(b"data:"):
                payload = line[5:]
                if payload.startswith(b" "):
                    payload = payload[1:]
                self._data.append(payload.decode("utf-8", errors="replace"))
            # comments (":") and other fields (event:, id:, retry:) are ignored

    def flush(self) -> list[str]:
        out = self.feed(b"\n\n") if self._buf else []
        if self._data:
            out.append("\n".join(self._data))
            self._data = []
        return out


@dataclass
class StreamTimer:
    """Accumulates one response stream; times are whatever clock the caller passes.

    first_content_s / last_content_s: arrival of the first / last content event.
    chunk_times_s: arrival of every content event. text: the content received.
    usage: the last `usage` object seen. response_id: the first event's `id` (astro's
    engines use it as the request id in `/status`). done: `[DONE]` seen. finished: a
    `finish_reason` seen (finish_reason: the last one, e.g. "stop" or "length"). error:
    an error event's message.
    """

    chat: bool = True
    first_content_s: float | None = None
    last_content_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    response_id: str | None = None
    done: bool = False
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    decoder: SSEDecoder = field(default_factory=SSEDecoder)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def feed(self, data: bytes, t: float) -> None:
        """Feed one network chunk that arrived at time `t`."""
        for ev in self.decoder.feed(data):
            self.on_event(ev, t)

    def close(self, t: float) -> None:
        for ev in self.decoder.flush():
            self.on_event(ev, t)

    def on_event(self, payload: str, t: float) -> None:
        if payload.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError:
            self.error = self.error or f"malformed SSE event: {payload[:80]!r}"
            return
        if not isinstance(obj, dict):
            return
        if self.response_id is None and isinstance(obj.get("id"), str):
            self.response_id = obj["id"]
        if obj.get("error"):
            err = obj["error"]
            self.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"
            return
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]
        content = ""
        for ch in obj.get("choices") or []:
            if not isinstance(ch, dict):
                continue
            if self.chat:
                delta = ch.get("delta") or {}
                content += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            else:
                content += ch.get("text") or ""
            if ch.get("finish_reason"):
                self.finished = True
                self.finish_reason = str(ch["finish_reason"])
        if content:
            if self.first_content_s is None:
                self.first_content_s = t
            self.last_content_s = t
            self.chunk_times_s.append(t)
            self.text_parts.append(content)


@dataclass(frozen=True)
class ClientOptions:
    """How requests are sent.

    base_url: server root (e.g. http://127.0.0.1:8000). model: `model` field.
    endpoint: "chat" or "completions" (media requests always use chat).
    send_true_lengths: send `vllm_xargs.astro_output_tokens`.
    max_tokens_mode: "reference", "none" or a number (see module docstring).
    ignore_eos: send `ignore_eos: true`. timeout_s: per-request read timeout.
    api_key: sent as a Bearer token when set. counter: token counter (no-usage fallback).
    """

    base_url: str
    model: str | None = None
    endpoint: str = "chat"
    send_true_lengths: bool = True
    ignore_eos: bool = False
    timeout_s: float = 600.0
    api_key: str | None = None
    counter: TokenCounter = count_tokens_fallback
    max_tokens_mode: str = "reference"


def build_body(req: BenchRequest, opts: ClientOptions) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of the request."""
    chat = opts.endpoint == "chat" or bool(req.media)
    body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
    if opts.max_tokens_mode == "reference":
        body["max_tokens"] = max(1, req.output_tokens)
    elif opts.max_tokens_mode != "none":
        body["max_tokens"] = int(opts.max_tokens_mode)
    if opts.model:
        body["model"] = opts.model
    text = req.prompt_text()
    if chat:
        content: Any = text
        if req.media:
            content = [{"type": "text", "text": text}] + [m.content_part() for m in req.media]
        body["messages"] = [{"role": "user", "content": content}]
    else:
        body["prompt"] = text
    if opts.send_true_lengths:
        body["vllm_xargs"] = {"astro_output_tokens": max(1, req.output_tokens)}
    if opts.ignore_eos:
        body["ignore_eos"] = True
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


async def send_request(client: httpx.AsyncClient, req: BenchRequest, opts: ClientOptions,
                       clock: Callable[[], float], scheduled_s: float) -> RequestRecord:
    """Send one request and time its stream; never raises for server/transport faults
    (they become a failed record). `clock()` returns seconds on the run's clock."""
    path, body = build_body(req, opts)
    rec = RequestRecord(request_id=req.request_id, modality=req.modality,
                        req_class=MODALITY_CLASS.get(req.modality, "sand"),
                        prompt_tokens=req.prompt_tokens, expected_output_tokens=req.output_tokens,
                        scheduled_s=scheduled_s)
    mt = body.get("max_tokens")
    rec.max_tokens = mt if isinstance(mt, int) else None
    timer = StreamTimer(chat=path.endswith("chat/completions"))
    headers = {"content-type": "application/json"}
    if opts.api_key:
        headers["authorization"] = f"Bearer {opts.api_key}"
    payload = json.dumps(body).encode()
    rec.sent_s = clock()
    try:
        async with client.stream("POST", opts.base_url.rstrip("/") + path, content=payload,
                                 headers=headers) as resp:
            rec.instance = resp.headers.get("x-astro-instance")
            cls = resp.headers.get("x-astro-class")
            if cls in ("sand", "pebbles", "rocks"):
                rec.req_class, rec.class_source = cls, "engine"
            pred = resp.headers.get("x-astro-predicted-output-tokens", "")
            if pred.isdigit():
                rec.predicted_output_tokens = int(pred)
            if resp.status_code != 200:
                data = await resp.aread()
                rec.finish_s = clock()
                rec.error = f"HTTP {resp.status_code}: {_error_text(data)}"
                if resp.status_code == 401:
                    rec.error += " (pass --api-key KEY or set ASTRO_API_KEY)"
                return rec
            async for chunk in resp.aiter_bytes():  # bytes after content-encoding, before text decoding
                timer.feed(chunk, clock())
            timer.close(clock())
    except (httpx.HTTPError, OSError) as exc:
        rec.finish_s = clock()
        rec.error = f"transport: {type(exc).__name__}: {exc}"[:300]
        return rec
    end = clock()
    _finish(rec, timer, end, opts.counter)
    return rec


def _finish(rec: RequestRecord, timer: StreamTimer, end_s: float, counter: TokenCounter) -> None:
    """Fill `rec` from a closed stream (shared with tests)."""
    if timer.error:
        rec.error = timer.error
    elif not (timer.done or timer.finished):
        rec.error = "stream ended early: no [DONE] and no finish_reason"
    rec.finish_reason = timer.finish_reason
    rec.server_request_id = timer.response_id
    rec.first_token_s = timer.first_content_s
    rec.finish_s = timer.last_content_s if timer.last_content_s is not None else end_s
    rec.itl_s = [b - a for a, b in zip(timer.chunk_times_s, timer.chunk_times_s[1:])]
    usage = timer.usage or {}
    if isinstance(usage.get("completion_tokens"), int):
        rec.output_tokens, rec.output_tokens_source = usage["completion_tokens"], "usage"
    else:
        rec.output_tokens, rec.output_tokens_source = counter(timer.text), "counted"
    if isinstance(usage.get("prompt_tokens"), int):
        rec.prompt_tokens = usage["prompt_tokens"]
    if rec.error is None and rec.output_tokens == 0:  # a "successful" empty answer is a failure
        rec.error = "stream ended with zero output tokens"
    rec.success = rec.error is None


def _error_text(data: bytes) -> str:
    try:
        obj = json.loads(data)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        msg = err.get("message", err) if isinstance(err, dict) else err
        return str(msg)[:200]
    except (json.JSONDecodeError, UnicodeDecodeError):
        return data[:200].decode("utf-8", errors="replace")


async def discover_model(base_url: str, api_key: str | None = None, timeout_s: float = 10.0) -> str | None:
    """The first model id of `GET /v1/models`, or None when unavailable."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as c:
            r = await c.get(base_url.rstrip("/") + "/v1/models", headers=headers)
            data = r.json().get("data") or []
            return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError):
        return None


async def run_requests(requests: list[BenchRequest], send_at_s: list[float], opts: ClientOptions,
                       max_concurrency: int | None = None,
                       on_done: Callable[[RequestRecord], None] | None = None) -> list[RequestRecord]:
    """Send `requests[i]` at `send_at_s[i]` seconds after the start (waiting for a slot
    when `max_concurrency` is set); return records in request order, times relative to
    the start."""
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    limits = httpx.Limits(max_connections=max_concurrency or 10_000, max_keepalive_connections=256)
    timeout = httpx.Timeout(connect=30.0, read=opts.timeout_s, write=60.0, pool=None)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def one(i: int) -> RequestRecord:
            delay = send_at_s[i] - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                rec = await send_request(client, requests[i], opts, clock, send_at_s[i])
            else:
                async with sem:
                    rec = await send_request(client, requests[i], opts, clock, send_at_s[i])
            if on_done is not None:
                on_done(rec)
            return rec

        return list(await asyncio.gather(*(one(i) for i in range(len(requests)))))
