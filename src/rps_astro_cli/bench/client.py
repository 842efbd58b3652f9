"""Streaming OpenAI-compatible client with honest timing: the lean asyncio-streams HTTP/1.1
client (`services.rpc.HostPool`) for http:// targets, httpx for https:// ones. httpx cost
~3× `vllm bench serve`'s client CPU per streamed event; the lean one is measured against
it in benchmarks/client_cpu_per_event.py (BENCHMARKS.md).

Per request: POST `/v1/chat/completions` (or `/v1/completions`) with `stream: true` and
`stream_options.include_usage`, then read the SSE stream as raw bytes:

- `SSEDecoder` splits the byte stream into events on line boundaries, decoding UTF-8
  only for complete lines, so a multi-byte character split across network chunks is
  never mangled.
- `StreamTimer` stamps each event with the arrival time of the network chunk that
  completed it, and keeps two timelines (`ClientOptions.ttft_definition` picks one,
  docs/metrics.md "TTFT and ITL definitions"):
  - "astro" (the default): only an event that carries content (non-empty
    `delta.content` / `delta.reasoning_content` for chat, non-empty `text` for
    completions) moves timing: a role-only first delta or a usage-only last chunk moves
    neither TTFT nor the end, and ITL is the gaps between content events;
  - "vllm" (`vllm bench serve` 0.32's `endpoint_request_func`): every event with a
    non-empty `choices` list counts, whatever its text (a role-only delta, an empty
    text, a finish-only chunk): the first starts TTFT, every later one adds an ITL gap,
    the last ends E2E; a usage-only chunk (empty `choices`) and `[DONE]` do not count.
- Output tokens: `usage.completion_tokens` when the server reports it, else the shared
  token counter over the received text (`output_tokens_source` says which).
- A non-200 status, an `{"error": ...}` event, a transport error or a stream that ends
  without `[DONE]` or a `finish_reason` marks the request failed (kept apart).
- `ClientOptions.timeout_s` (`--request-timeout`) is the deadline of the whole request,
  from sending it to its last byte: a server that keeps a stream open with SSE comments
  (`: ping`) or a trickle of tokens cannot hold the bench past it (a per-read timeout
  would be pushed on by every comment, and the run would never end).

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.bench.workload_base import MODALITY_CLASS, BenchRequest
from rps_astro_cli.services.rpc import HostPool, RpcError
from rps_astro_cli.tokens import TokenCounter, count_tokens_fallback

_JSON = json.JSONDecoder()


class SSEDecoder:
    """Incremental Server-Sent-Events decoder over bytes.

    `feed(data)` returns the `data:` payloads (UTF-8 bytes, undecoded: `json.loads` takes
    them as they are) of the events completed by `data`; an event ends at a blank line.
    `flush()` returns a last event without its blank line. Bytes are never decoded before
    a line is complete, so a multi-byte character split across network chunks is whole.
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []

    def feed(self, data: bytes) -> list[bytes]:
        if self._buf:
            data, self._buf = self._buf + data, b""
        if not self._data and b"\r" not in data:
            # fast path (what OpenAI servers send): "data: {...}\n\n" events, LF only;
            # the bytes after the last blank line wait for the next network chunk
            parts = data.split(b"\n\n")
            self._buf = parts.pop()
            out: list[bytes] = []
            for ev in parts:
                if ev.startswith(b"data:") and b"\n" not in ev:
                    out.append(ev[6:] if ev.startswith(b"data: ") else ev[5:])
                elif ev:
                    out += self._lines([*ev.split(b"\n"), b""])
            return out
        lines = data.split(b"\n")
        self._buf = lines.pop()  # an unfinished line
        return self._lines(lines)

    def _lines(self, lines: list[bytes]) -> list[bytes]:
        """Complete lines (CR stripped); an empty line ends an event."""
        out: list[bytes] = []
        for line in lines:
            if line.endswith(b"\r"):
                line = line[:-1]
            if not line:
                if self._data:
                    out.append(b"\n".join(self._data))
                    self._data = []
                continue
            if line.startswith(b"data:"):
                payload = line[5:]
                if payload.startswith(b" "):
                    payload = payload[1:]
                self._data.append(payload)
            # comments (":") and other fields (event:, id:, retry:) are ignored
        return out

    def flush(self) -> list[bytes]:
        out = self._lines([*self._buf.split(b"\n"), b""]) if self._buf else []
        self._buf = b""
        if self._data:
            out.append(b"\n".join(self._data))
            self._data = []
        return out


@dataclass
class StreamTimer:
    """Accumulates one response stream; times are whatever clock the caller passes.

    first_content_s / last_content_s: arrival of the first / last content event.
    chunk_times_s: arrival of every content event. text: the content received.
    choice_times_s: arrival of every event with a non-empty `choices` list (vLLM's
        timeline: its first is vLLM's TTFT, its last vLLM's E2E end).
    usage: the last `usage` object seen. response_id: the first event's `id` (astro's
    engines use it as the request id in `/status`). done: `[DONE]` seen. finished: a
    `finish_reason` seen (finish_reason: the last one, e.g. "stop" or "length"). error:
    an error event's message.
    """

    chat: bool = True
    first_content_s: float | None = None
    last_content_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    choice_times_s: list[float] = field(default_factory=list)
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

    def on_event(self, payload: bytes | str, t: float) -> None:
        if payload.strip() in (b"[DONE]", "[DONE]"):
            self.done = True
            return
        try:
            # raw_decode of the decoded text: json.loads(bytes) first sniffs the encoding
            # and then checks for trailing text, ~30 % of a small event's parse time
            obj = _JSON.raw_decode((payload.decode() if isinstance(payload, bytes) else payload).strip())[0]
        except (json.JSONDecodeError, UnicodeDecodeError):
            text = payload.decode("utf-8", "replace") if isinstance(payload, bytes) else payload
            self.error = self.error or f"malformed SSE event: {text[:80]!r}"
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
        choices = obj.get("choices")
        if isinstance(choices, list) and choices:
            self.choice_times_s.append(t)
        for ch in choices or []:
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
    ignore_eos: send `ignore_eos: true`. timeout_s: the deadline of each whole request,
    from sending it to its last byte (s; `--request-timeout`).
    api_key: sent as a Bearer token when set. counter: token counter (no-usage fallback).
    ttft_definition: "astro" or "vllm": which timeline of `StreamTimer` times the request.
    slo_of: request_id → its `bench.slo.SloClass` (`--slo-class`): sent as the headers
        x-slo-class, x-slo-ttft-ms, x-slo-tpot-ms and the body's `priority`; an HTTP 429
        answer then counts as refused (admission), not as an error.
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
    ttft_definition: str = "astro"
    slo_of: Mapping[str, Any] = field(default_factory=dict)


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


def _prepare(req: BenchRequest, opts: ClientOptions,
             scheduled_s: float) -> tuple[str, bytes, dict[str, str], RequestRecord, StreamTimer]:
    """(path, body bytes, headers, the request's record, its stream timer)."""
    path, body = build_body(req, opts)
    rec = RequestRecord(request_id=req.request_id, modality=req.modality,
                        req_class=MODALITY_CLASS.get(req.modality, "sand"),
                        prompt_tokens=req.prompt_tokens, expected_output_tokens=req.output_tokens,
                        scheduled_s=scheduled_s)
    mt = body.get("max_tokens")
    rec.max_tokens = mt if isinstance(mt, int) else None
    headers = {"content-type": "application/json"}
    if opts.api_key:
        headers["authorization"] = f"Bearer {opts.api_key}"
    c = opts.slo_of.get(req.request_id)
    if c is not None:  # its SLO class (issue 33): headers, the body's priority, the record's targets
        headers["x-slo-class"] = c.name
        if c.slo.ttft_ms is not None:
            headers["x-slo-ttft-ms"] = f"{c.slo.ttft_ms:g}"
        if c.slo.tpot_ms is not None:
            headers["x-slo-tpot-ms"] = f"{c.slo.tpot_ms:g}"
        body["priority"] = c.slo.priority
        rec.slo_class, rec.slo_ttft_s = c.name, c.slo.ttft_s
        rec.slo_tpot_s = None if c.slo.tpot_ms is None else c.slo.tpot_ms / 1000
    return path, json.dumps(body).encode(), headers, rec, StreamTimer(chat=path.endswith("chat/completions"))


def _read_head(rec: RequestRecord, headers: Any) -> None:
    """The astro response headers: serving instance, class, predicted length."""
    rec.instance = headers.get("x-astro-instance")
    cls = headers.get("x-astro-class")
    if cls in ("sand", "pebbles", "rocks"):
        rec.req_class, rec.class_source = cls, "engine"
    pred = headers.get("x-astro-predicted-output-tokens", "")
    if pred.isdigit():
        rec.predicted_output_tokens = int(pred)


def server_root(url: str) -> str:
    """The server root of an OpenAI-compatible URL: a trailing `/v1` (the form of the
    `openai` client's base_url and of cluster.json's `openai_base_url`) is dropped, since
    the request paths (`/v1/chat/completions`, `/v1/models`) carry it."""
    u = url.rstrip("/")
    return u[:-3] if u.endswith("/v1") else u


def _timed_out(rec: RequestRecord, timeout_s: float, now_s: float) -> RequestRecord:
    """`rec` failed: not finished `timeout_s` after it was sent."""
    rec.finish_s = now_s
    rec.error = f"transport: Timeout: not finished within --request-timeout {timeout_s:g} s of being sent"
    return rec


def _http_error(rec: RequestRecord, status: int, body: bytes, now_s: float) -> RequestRecord:
    """`rec` failed with a non-200 answer (`body`), finished at `now_s`; a 401 says how to fix it."""
    rec.finish_s = now_s
    rec.error = f"HTTP {status}: {_error_text(body)}"
    rec.refused = status == 429 and rec.slo_class is not None  # admission refused it (issue 33)
    if status == 401:
        rec.error += " (pass --api-key KEY or set ASTRO_API_KEY)"
    return rec


async def send_request(client: httpx.AsyncClient, req: BenchRequest, opts: ClientOptions,
                       clock: Callable[[], float], scheduled_s: float) -> RequestRecord:
    """Send one request with httpx and time its stream (https targets); never raises for
    server/transport faults (they become a failed record). `clock()` returns seconds on
    the run's clock. `opts.timeout_s` bounds the whole request (httpx's own read timeout
    bounds one read: SSE comments would push it on forever)."""
    path, payload, headers, rec, timer = _prepare(req, opts, scheduled_s)
    rec.sent_s = clock()
    deadline = asyncio.timeout(opts.timeout_s)
    try:
        async with deadline, client.stream("POST", opts.base_url.rstrip("/") + path, content=payload,
                                           headers=headers) as resp:
            _read_head(rec, resp.headers)
            if resp.status_code != 200:
                return _http_error(rec, resp.status_code, await resp.aread(), clock())
            async for chunk in resp.aiter_bytes():  # bytes after content-encoding, before text decoding
                timer.feed(chunk, clock())
            timer.close(clock())
    except (httpx.HTTPError, OSError) as exc:  # TimeoutError (the deadline) is an OSError
        if deadline.expired():
            return _timed_out(rec, opts.timeout_s, clock())
        rec.finish_s = clock()
        rec.error = f"transport: {type(exc).__name__}: {str(exc) or 'no detail'}"[:300]
        return rec
    end = clock()
    _finish(rec, timer, end, opts.counter, opts.ttft_definition)
    return rec


async def send_request_lean(pool: HostPool, req: BenchRequest, opts: ClientOptions,
                            clock: Callable[[], float], scheduled_s: float) -> RequestRecord:
    """`send_request` on the lean asyncio-streams client (`services.rpc.HostPool`), for
    plain http:// targets: the same record, at a fraction of httpx's CPU per streamed
    event (benchmarks/client_cpu_per_event.py). `opts.timeout_s` is the deadline of the
    whole request, from sending it to its last byte (module docstring)."""
    path, payload, headers, rec, timer = _prepare(req, opts, scheduled_s)
    rec.sent_s = clock()
    deadline = asyncio.timeout(opts.timeout_s)
    try:
        async with deadline:
            resp = await pool.request("POST", path, payload, headers)
            try:
                _read_head(rec, resp.headers)
                if resp.status != 200:
                    return _http_error(rec, resp.status, await resp.read(), clock())
                async for chunk in resp.body_reads():
                    timer.feed(chunk, clock())
                timer.close(clock())
            finally:
                resp.aclose_sync()
    except (RpcError, OSError) as exc:  # TimeoutError (the deadline) is an OSError
        if deadline.expired():
            return _timed_out(rec, opts.timeout_s, clock())
        rec.finish_s = clock()
        rec.error = f"transport: {type(exc).__name__}: {str(exc) or 'no detail'}"[:300]
        return rec
    end = clock()
    _finish(rec, timer, end, opts.counter, opts.ttft_definition)
    return rec


def _finish(rec: RequestRecord, timer: StreamTimer, end_s: float, counter: TokenCounter,
            ttft_definition: str = "astro") -> None:
    """Fill `rec` from a closed stream (shared with tests); `ttft_definition` picks the
    timeline (module docstring)."""
    if timer.error:
        rec.error = timer.error
    elif not (timer.done or timer.finished):
        rec.error = "stream ended early: no [DONE] and no finish_reason"
    rec.finish_reason = timer.finish_reason
    rec.server_request_id = timer.response_id
    times = timer.choice_times_s if ttft_definition == "vllm" else timer.chunk_times_s
    rec.first_token_s = times[0] if times else None
    rec.finish_s = times[-1] if times else end_s
    rec.itl_s = [b - a for a, b in zip(times, times[1:])]
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
    the start.

    Multi-turn sessions (`session_id`, `turn`): as the virtual cluster replays them,
    first turns take the send times in order (the rate is session starts per second) and
    turn t ≥ 1 is sent `think_s` after turn t − 1's reply ended (closed loop); when that
    turn failed, this one fails unsent ("its previous turn failed"). Without sessions
    every request keeps its own send time."""
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    turn_at = {f"{r.session_id}#{r.turn}": i for i, r in enumerate(requests) if r.session_id}
    prev = [turn_at.get(f"{r.session_id}#{r.turn - 1}") if r.session_id and r.turn > 0 else None
            for r in requests]
    if any(p is not None for p in prev):
        starts = iter(send_at_s)
        first_at = [None if p is not None else next(starts) for p in prev]
    else:
        first_at = list(send_at_s)
    records: list[RequestRecord | None] = [None] * len(requests)
    ended = [asyncio.Event() for _ in requests] if any(p is not None for p in prev) else None

    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    send: Callable[..., Any]
    if urlsplit(opts.base_url).scheme == "http":  # the lean client; httpx for https
        client: Any = HostPool(opts.base_url, max_idle=max_concurrency or 10_000, connect_timeout_s=30.0)
        send, close = send_request_lean, client.close
    else:
        limits = httpx.Limits(max_connections=max_concurrency or 10_000, max_keepalive_connections=256)
        timeout = httpx.Timeout(connect=30.0, read=opts.timeout_s, write=60.0, pool=None)
        client = httpx.AsyncClient(limits=limits, timeout=timeout)
        send, close = send_request, None

    async def one(i: int) -> RequestRecord:
        p = prev[i]
        req = requests[i]
        if p is not None:
            assert ended is not None
            await ended[p].wait()
            before = records[p]
            assert before is not None
            at = (before.finish_s if before.finish_s is not None else clock()) + req.think_s
            if not before.success:
                rec = RequestRecord(request_id=req.request_id, modality=req.modality,
                                    req_class=MODALITY_CLASS.get(req.modality, "sand"),
                                    prompt_tokens=req.prompt_tokens, expected_output_tokens=req.output_tokens,
                                    scheduled_s=at, sent_s=at, finish_s=at, success=False,
                                    error="its previous turn failed")
                return _done(i, rec)
        else:
            at = first_at[i]
            assert at is not None
        delay = at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is None:
            rec = await send(client, req, opts, clock, at)
        else:
            async with sem:
                rec = await send(client, req, opts, clock, at)
        return _done(i, rec)

    def _done(i: int, rec: RequestRecord) -> RequestRecord:
        records[i] = rec
        if ended is not None:
            ended[i].set()
        if on_done is not None:
            on_done(rec)
        return rec

    try:
        return list(await asyncio.gather(*(one(i) for i in range(len(requests)))))
    finally:
        if close is not None:
            close()
        else:
            await client.aclose()
