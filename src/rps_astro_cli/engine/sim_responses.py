"""The sim engine's completion responses (`engine.sim_server` builds them): OpenAI /
vLLM JSON bodies and SSE streams of a request's choices.

- `_Format`: one request's pre-built JSON fragments (a token chunk is one string
  concat); `_stream` streams a plain single-choice request, `_stream_choices` one with
  n choices, planned text (seed, stop), logprobs or echo; `_complete` waits for every
  choice and answers the whole body, aborting the requests if the client disconnects.
- `_SSEResponse`: a StreamingResponse that always watches for the client's disconnect.
- `_echo`: what `echo` puts before the output, as vLLM does.
- `output_tokens`, `_usage`, `_astro_timing` (engine-side split sent in the usage
  chunk for `astro profile`), `_error_event`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rps_astro_cli.engine.sim_engine import FINISHED, EngineRequest, EngineShutdown, SimEngine
from rps_astro_cli.engine.synthetic import WORDS, chat_logprobs, completion_logprobs, synthetic_text
from rps_astro_cli.engine.synthetic import WORDS_JSON as _WORDS_JSON
from rps_astro_cli.protocol.openai_types import ApiError


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
