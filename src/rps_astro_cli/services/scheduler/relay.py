"""Relaying an engine's response to the client: whole responses as they are, streams
as whole SSE events, with the engine's headers minus hop-by-hop ones plus
`x-astro-instance`.

A stream that breaks mid-way ends with an SSE event
`data: {"error": {"message", "type": "engine_failure", "code": 502, "instance"}}` then
`data: [DONE]`; the engine connection is dropped whenever the body was not read to its
end (the engine then aborts the request).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from starlette.types import Receive, Scope, Send

from rps_astro_cli.protocol.http_server import ClientBody, client_body
from rps_astro_cli.services.http_common import error_body
from rps_astro_cli.services.rpc import Response as RawResponse
from rps_astro_cli.services.rpc import RpcError
from rps_astro_cli.services.scheduler.instances import Instances, InstanceState, Pending
from rps_astro_cli.types import DecisionRecord

log = logging.getLogger("astro.scheduler")

_HOP_HEADERS = frozenset(("connection", "keep-alive", "transfer-encoding", "content-length", "date", "server",
                          "te", "trailer", "upgrade", "proxy-authenticate", "proxy-authorization"))


def relay_headers(resp: RawResponse, instance: str) -> dict[str, str]:
    """The engine's response headers minus hop-by-hop ones, plus `x-astro-instance`."""
    out = {k: v for k, v in resp.headers.items() if k not in _HOP_HEADERS}
    out.setdefault("content-type", "application/json")
    out["x-astro-instance"] = instance
    return out


class ClientWatch:
    """Cancels the task that made it (a request's handler) when its client disconnects,
    until `stop`: the request's own work — dispatch, forward, relay — runs in that task,
    with no second task to hand each result over (a hand-over took ~0.3 ms of loop turns
    before the first byte). Made once the request's body was read to its end, so the next
    ASGI message is the disconnect."""

    def __init__(self, receive: Receive):
        task = asyncio.current_task()
        assert task is not None, "ClientWatch needs a running task"
        self.task = task
        self.left = False  # the client disconnected while watched (and the task was cancelled)
        self._stopped = False
        self._ours = False
        self._watch = asyncio.ensure_future(_disconnected(receive))
        self._watch.add_done_callback(self._fired)

    def _fired(self, watch: asyncio.Future[None]) -> None:
        if self._stopped or watch.cancelled() or watch.exception() is not None:
            return
        self.left = True
        self.task.cancel()

    def stop(self) -> bool:
        """Stop watching (idempotent). True when the client left and the task's
        cancellation was this watch's alone: it is undone, and the caller, which caught
        the CancelledError, goes on to end the request. False otherwise (a cancellation
        from elsewhere stands: re-raise it)."""
        if not self._stopped:
            self._stopped = True
            self._watch.cancel()
            self._ours = self.left and self.task.uncancel() == 0
        return self._ours


class RelayResponse:
    """The client's response (an ASGI app) relaying an engine's response: the status and
    headers through ASGI, then the body as the engine sends it, whole SSE events (`sse`)
    or bytes as they come, never more than a read's worth held.

    Under astro's HTTP server the body is written from the engine connection's own data
    callback straight to the client's (`rpc.Response.tap` → `http_server.ClientBody`): no
    task woken and no ASGI message per piece (round 8 of docs/experiments/peer-routers.md:
    that layering was most of the relay's CPU per token). Elsewhere (another ASGI server)
    each read is awaited and sent through ASGI. Either way the client's disconnect
    (`ClientWatch`) stops the relay there, and `cleanup` runs at the end whatever
    happened, even when the client left before the first piece."""

    def __init__(self, relay: _Relay, status_code: int, headers: dict[str, str]):
        self.relay = relay
        self.status_code = status_code
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = ClientWatch(receive)
        relay = self.relay
        try:
            raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
            await send({"type": "http.response.start", "status": self.status_code, "headers": raw})
            body = client_body(scope)
            if body is not None:
                await relay.tapped(body)
            else:
                await relay.awaited(send)
            tail = relay.tail()
            await send({"type": "http.response.body", "body": tail, "more_body": False})
        except asyncio.CancelledError:
            if not watch.stop():
                raise
            # the client left: its request's end is recorded by cleanup
        except ResponseCut:
            # return with the body unfinished: the server closes the connection without
            # the body's end (one log line, no traceback), so the client sees a cut body
            log.warning("a relayed response was cut mid-body")
        finally:
            watch.stop()
            await relay.cleanup()


async def _disconnected(receive: Receive) -> None:
    """Return once the client has disconnected (its body was read to the end already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class ResponseCut(Exception):
    """A whole (non-SSE) response was cut mid-body (its engine failed, or it grew past the
    byte limit): the client's connection is dropped without the body's end, so no client
    can take a truncated body for a whole one."""


class _Relay:
    """One relayed body: what of it goes to the client now (`_take`), how it ended
    (`outcome`), and the end's bookkeeping (`cleanup`, once)."""

    def __init__(self, instances: Instances, st: InstanceState, resp: RawResponse, first: bytes,
                 rec: DecisionRecord, t_send: float, on_end: Callable[[DecisionRecord, str], None],
                 entry: Pending | None, sse: bool, max_bytes: int | None):
        self.instances, self.st, self.resp, self.rec, self.t_send = instances, st, resp, rec, t_send
        self.on_end, self.entry, self.sse, self.max_bytes = on_end, entry, sse, max_bytes
        self.first = first
        self.pending = b""  # bytes of an SSE event not yet complete
        self.sent = 0  # bytes handed to the client so far
        self.outcome = "client_disconnected"  # until the body ends otherwise
        self.failure: RpcError | None = None
        self.closed = False

    def _take(self, data: bytes) -> bytes | None:
        """What of `data` (and what was held back) goes out now: whole SSE events or all of
        it; None once the byte limit is passed (the outcome says so)."""
        p = self.pending + data if self.pending else data
        if self.sse:
            end = p.rfind(b"\n\n") + 2
            out, self.pending = (p[:end], p[end:]) if end > 1 else (b"", p)
        else:
            out = p
            self.pending = b""
        self.sent += len(out)
        if self.max_bytes is not None and self.sent > self.max_bytes:
            self.outcome = "response_too_large"
            return None
        return out

    async def tapped(self, body: ClientBody) -> None:
        """Relay from the engine connection's data callback to `body` until the engine's
        body ends, breaks or passes the byte limit; pauses the engine while the client's
        connection is full."""
        loop = asyncio.get_running_loop()
        wake: asyncio.Future[None] = loop.create_future()
        resp = self.resp
        ended = False

        def data(more: bytes) -> None:
            nonlocal wake
            out = self._take(more)
            if out is None:  # past the byte limit: the engine's request is dropped (it aborts)
                resp.aclose_sync()
                end(None)
                return
            if out and (not body.write(out) or body.paused):
                resp.pause_reading()  # the client is full (or gone: then the watch ends this)
                if not wake.done():
                    wake.set_result(None)

        def end(err: RpcError | None) -> None:
            nonlocal ended
            if not ended:
                ended = True
                self.failure = err
                if not wake.done():
                    wake.set_result(None)

        data(self.first)
        if self.outcome != "response_too_large":
            resp.tap(data, end)
        while not ended:
            await wake
            wake = loop.create_future()
            if not ended:
                await body.drain()
                resp.resume_reading()

    async def awaited(self, send: Send) -> None:
        """Relay by awaiting each read and sending it through ASGI (see `tapped`)."""
        out = self._take(self.first)
        try:
            while out is not None:
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
                more = await self.resp.read_some()
                if not more:
                    return
                out = self._take(more)
        except RpcError as exc:
            self.failure = exc

    def tail(self) -> bytes:
        """The body's last bytes once relaying stopped: what was held back of a body that
        ended, or an SSE error event and `[DONE]` for a stream that broke or grew too large.

        Raises:
            ResponseCut: a whole response broke or grew too large (it must not end cleanly).
        """
        st = self.st
        if self.failure is not None:
            self.outcome = "midstream_error"
            self.instances.mark_failed(st, f"mid-stream {type(self.failure).__name__}")
            if not self.sse:
                raise ResponseCut(f"engine {st.ep.name} failed mid-body ({type(self.failure).__name__})")
            return _end_event(st, f"engine {st.ep.name} failed mid-stream ({type(self.failure).__name__}); "
                              "the response is incomplete", "engine_failure")
        if self.outcome != "response_too_large":
            tail, self.pending = self.pending, b""
            if self.max_bytes is None or self.sent + len(tail) <= self.max_bytes:
                self.outcome = "ok"
                return tail
            self.outcome = "response_too_large"
        why = (f"the response grew past this server's limit of {self.max_bytes} bytes "
               "(ASTRO_MAX_RESPONSE_BYTES) and was cut; ask for fewer tokens, choices or logprobs")
        if not self.sse:
            raise ResponseCut(why)
        return _end_event(st, why, "response_too_large")

    async def cleanup(self) -> None:
        """Once, however the relay ended: the engine connection closed (or returned to its
        pool when the body was read to its end), the instance released with its pending
        entry, the end recorded."""
        if self.closed:
            return
        self.closed = True
        await self.resp.aclose()  # an unfinished body drops the connection: the engine aborts
        self.instances.release(self.st, self.entry)
        self.rec.observed_e2e_s = time.perf_counter() - self.t_send
        self.on_end(self.rec, self.outcome)


def _end_event(st: InstanceState, message: str, type_: str) -> bytes:
    err = error_body(message, None, type_, 502)
    err["error"]["instance"] = st.ep.name
    return b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"


def stream_response(instances: Instances, st: InstanceState, resp: RawResponse, first: bytes,
                    rec: DecisionRecord, t_send: float, on_end: Callable[[DecisionRecord, str], None],
                    entry: Pending | None = None, *, sse: bool = True, max_bytes: int | None = None) -> RelayResponse:
    """The client's response relaying `resp` as it arrives (its first bytes `first`
    already read). At the end, once: the engine connection is closed (or returned to its
    pool), `st` released with its pending `entry` (the request has ended: no later
    `/status` shows it, so a Predictor must not count it as on its way),
    `rec.observed_e2e_s` set and `on_end(rec, outcome)` called with ok | midstream_error |
    response_too_large | client_disconnected.

    Past `max_bytes` relayed (None: no bound) the engine's request is dropped (it aborts):
    a stream ends with an SSE error event `response_too_large` and `[DONE]`; a whole
    response is cut (`ResponseCut`). An engine failing mid-body: the same, with
    `engine_failure`."""
    relay = _Relay(instances, st, resp, first, rec, t_send, on_end, entry, sse, max_bytes)
    return RelayResponse(relay, resp.status, relay_headers(resp, st.ep.name))

