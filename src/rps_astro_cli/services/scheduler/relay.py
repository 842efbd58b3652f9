"""Relaying an engine's response to the client: whole responses as they are, streams
as whole SSE events, with the engine's headers minus hop-by-hop ones plus
`x-astro-instance`.

A stream that breaks mid-way ends with an SSE event
`data: {"error": {"message", "type": "engine_failure", "code": 502, "instance"}}` then
`data: [DONE]`; the engine connection is dropped whenever the body was not read to its
end (the engine then aborts the request).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from rps_astro_cli.services.http_common import error_body
from rps_astro_cli.services.rpc import Response as RawResponse
from rps_astro_cli.services.rpc import RpcError
from rps_astro_cli.services.scheduler.instances import Instances, InstanceState, Pending
from rps_astro_cli.types import DecisionRecord

_HOP_HEADERS = frozenset(("connection", "keep-alive", "transfer-encoding", "content-length", "date", "server",
                          "te", "trailer", "upgrade", "proxy-authenticate", "proxy-authorization"))


def relay_headers(resp: RawResponse, instance: str) -> dict[str, str]:
    """The engine's response headers minus hop-by-hop ones, plus `x-astro-instance`."""
    out = {k: v for k, v in resp.headers.items() if k not in _HOP_HEADERS}
    out.setdefault("content-type", "application/json")
    out["x-astro-instance"] = instance
    return out


async def first_chunk(it: AsyncIterator[bytes]) -> bytes:
    """The first body chunk (b"" for an empty body)."""
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return b""


class _RelayResponse(StreamingResponse):
    """A StreamingResponse that runs `cleanup` even when the client left before the body
    iterator ever started (Starlette then never enters the generator, so its `finally`
    would not run and the instance's outstanding count and connection would leak)."""

    def __init__(self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]], **kw: Any):
        super().__init__(content, **kw)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


def stream_response(instances: Instances, st: InstanceState, resp: RawResponse, it: AsyncIterator[bytes],
                    first: bytes, rec: DecisionRecord, t_send: float,
                    on_end: Callable[[DecisionRecord, str], None], entry: Pending | None = None) -> StreamingResponse:
    """The client's streaming response relaying `resp` (whose first chunk `first` has been
    read from `it`). At the end, once: the engine connection is closed (or returned to
    its pool), `st` released with its pending `entry` (the request has ended: no later
    `/status` shows it, so a Predictor must not count it as on its way),
    `rec.observed_e2e_s` set and `on_end(rec, outcome)` called with ok | midstream_error
    | client_disconnected."""
    state = {"outcome": "client_disconnected", "closed": False}

    async def cleanup() -> None:  # idempotent: from the relay's end or the response's
        if state["closed"]:
            return
        state["closed"] = True
        await resp.aclose()  # an unfinished body drops the connection: the engine aborts
        instances.release(st, entry)
        rec.observed_e2e_s = time.perf_counter() - t_send
        on_end(rec, str(state["outcome"]))

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
                instances.mark_failed(st, f"mid-stream {type(exc).__name__}")
                err = error_body(f"engine {st.ep.name} failed mid-stream ({type(exc).__name__}); "
                                 "the response is incomplete", None, "engine_failure", 502)
                err["error"]["instance"] = st.ep.name
                yield b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
        finally:
            await cleanup()

    return _RelayResponse(relay(), cleanup, status_code=resp.status, headers=relay_headers(resp, st.ep.name))
