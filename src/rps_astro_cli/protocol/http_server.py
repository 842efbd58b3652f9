"""HTTP serving helpers shared by the sim engine and the services: a TCP_NODELAY
listening socket, uvicorn on it until interrupted (printing `ready: URL` for
supervisors), and a background server thread for tests and whole-cluster mode."""

from __future__ import annotations

import asyncio
import functools
import gc
import json
import os
import socket
import threading
import time
from collections.abc import Callable, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from fastapi import FastAPI

from rps_astro_cli.protocol.limits import HttpLimits

T = TypeVar("T")


def bind_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 asks the OS for a free port.

    Raises:
        AstroUserError: the address cannot be bound (in use, bad host).
    """
    from rps_astro_cli.errors import AstroUserError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP (not 0) so asyncio sets TCP_NODELAY on accepted connections; and
    # NODELAY on the listener (Linux inherits it): without it, small SSE writes wait for
    # the client's delayed ACK (~40 ms per response).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise AstroUserError(f"cannot listen on {host}:{port}: {exc.strerror}", field="--port",
                             fix="pick a free port or 0 for any") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


DRAIN_S_ENV = "ASTRO_DRAIN_S"  # seconds in-flight requests get to finish after SIGTERM
DEFAULT_DRAIN_S = 4.0  # under the `astro serve` supervisor's 5 s SIGTERM → SIGKILL grace


def drain_seconds() -> float:
    """The drain bound: `$ASTRO_DRAIN_S` (seconds ≥ 0) or DEFAULT_DRAIN_S.

    Raises:
        AstroUserError: not a finite number ≥ 0 (names the variable).
    """
    import math

    from rps_astro_cli.errors import AstroUserError

    raw = os.environ.get(DRAIN_S_ENV)
    if raw is None or raw == "":
        return DEFAULT_DRAIN_S
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not math.isfinite(v) or v < 0:
        raise AstroUserError(f"{DRAIN_S_ENV}={raw!r} is not a number of seconds >= 0", field=DRAIN_S_ENV,
                             fix="set e.g. ASTRO_DRAIN_S=30 (0 = cut in-flight requests at once)")
    return v


# bodies larger than this are parsed, tokenized and hashed off the event loop (`off_loop`):
# ~40 ms of fallback tokenizing per MB would otherwise stall every other request
OFF_LOOP_BYTES = 64 * 1024
_worker: ThreadPoolExecutor | None = None


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` on this process's one worker thread, awaited. One thread, so the CPU-heavy
    work of big bodies queues there and the event loop keeps at least its share of the
    interpreter (the GIL switches every 5 ms) for everyone else's requests."""
    global _worker
    if _worker is None:
        _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="astro-heavy")
    return await asyncio.get_running_loop().run_in_executor(_worker, functools.partial(fn, *args))


_REASONS = {408: "Request Timeout", 431: "Request Header Fields Too Large", 503: "Service Unavailable"}


def raw_error(status: int, message: str, type_: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI-shaped JSON error body and
    `connection: close`, written straight to a transport (no route ran)."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": status}}).encode()
    return (f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


CLIENT_BODY = "astro.client_body"  # the scope extension naming a request's `ClientBody`


class ClientBody:
    """A request's response body written straight to the client's connection, from any
    callback on the event loop (the front door's relay writes each engine read from the
    engine connection's own data callback: no task woken, no ASGI message per piece).

    Only once the response has started (through ASGI `send`) with chunked framing; its
    end goes through ASGI `send` too (uvicorn then finishes the cycle: keep-alive, the
    next request). `paused` while the client's connection holds more unsent bytes than its
    high-water mark; `drain()` waits for it to go under."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle

    def ready(self) -> bool:
        """The response has started, chunked, and not ended: `write` may be used."""
        c = self._cycle
        return bool(c.response_started and c.chunked_encoding and not c.response_complete)

    def write(self, data: bytes) -> bool:
        """Write `data` as one chunk; False when the client has gone (nothing written)."""
        c = self._cycle
        if c.disconnected or c.transport.is_closing():
            return False
        c.transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return True

    @property
    def paused(self) -> bool:
        return bool(self._cycle.flow.write_paused)

    async def drain(self) -> None:
        await self._cycle.flow.drain()


def client_body(scope: MutableMapping[str, Any]) -> ClientBody | None:
    """The request's `ClientBody` once its response has started chunked; None under a
    server other than `bounded_http_protocol`'s (then write through ASGI `send`)."""
    body = scope.get("extensions", {}).get(CLIENT_BODY)
    return body if isinstance(body, ClientBody) and body.ready() else None


def bounded_http_protocol(limits: HttpLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools HTTP/1.1 protocol with `limits` enforced on every connection
    before any route runs (so before an API key is checked):

    - request line + headers over `max_header_bytes` → 431 and closed (the parser holds
      an unfinished header whole, so it is counted as the bytes arrive: the most a
      connection can make the server hold is that bound plus one socket read);
    - more than `max_headers` header fields → 431;
    - headers not complete `header_timeout_s` after the request's first byte (or the
      connection's start) → 408 and closed; the body not complete `body_timeout_s` after
      the headers → 408 (or, once a response has started, closed);
    - more than `max_connections` open at once → 503 and closed at once.

    Each request's scope carries its `ClientBody` (extension `CLIENT_BODY`).
    """
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class BoundedHttpProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = True  # between a request's first byte and its last header
            self._head_bytes = 0
            self._n_headers = 0
            self._refused = False  # answered by the limits: the parser's callbacks are ignored
            self._timer: asyncio.TimerHandle | None = None

        def _arm(self, seconds: float, what: str) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._expired, what)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _refuse(self, status: int, message: str, type_: str) -> None:
            self._refused = True
            self._disarm()
            if not self.transport.is_closing():
                self.transport.write(raw_error(status, message, type_))
                self.transport.close()

        def _expired(self, what: str) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            cycle = self.cycle
            if what == "body" and cycle is not None and cycle.response_started:
                self._refused = True
                self.transport.close()
                return
            secs = limits.header_timeout_s if what == "headers" else limits.body_timeout_s
            var = "ASTRO_HTTP_HEADER_TIMEOUT_S" if what == "headers" else "ASTRO_HTTP_BODY_TIMEOUT_S"
            self._refuse(408, f"the request's {what} did not arrive within {secs:g} s ({var})", "request_timeout")

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                self._refuse(503, f"this server holds {limits.max_connections} connections already "
                             "(ASTRO_HTTP_MAX_CONNECTIONS); retry later", "server_busy")
                return
            self._arm(limits.header_timeout_s, "headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            super().data_received(data)
            if self._refused or self.transport.is_closing() or not self._in_head:
                return
            if self._timer is None:
                self._arm(limits.header_timeout_s, "headers")
            self._head_bytes += len(data)
            if self._head_bytes > limits.max_header_bytes:
                self._refuse(431, f"the request line and headers are over {limits.max_header_bytes} bytes "
                             "(ASTRO_HTTP_MAX_HEADER_BYTES)", "request_header_fields_too_large")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes, self._n_headers = True, 0, 0

        def on_header(self, name: bytes, value: bytes) -> None:
            self._n_headers += 1
            if self._n_headers <= limits.max_headers:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            if self._refused:
                return
            if self._n_headers > limits.max_headers:
                self._refuse(431, f"the request has {self._n_headers} header fields, over the limit of "
                             f"{limits.max_headers} (ASTRO_HTTP_MAX_HEADERS)", "request_header_fields_too_large")
                return
            self._arm(limits.body_timeout_s, "body")
            before = self.cycle
            super().on_headers_complete()
            if self.cycle is not before:  # a request cycle was made (not an upgrade)
                self.scope.setdefault("extensions", {})[CLIENT_BODY] = ClientBody(self.cycle)

        def on_body(self, body: bytes) -> None:
            if not self._refused:
                super().on_body(body)

        def on_message_complete(self) -> None:
            if self._refused:
                return
            self._disarm()
            super().on_message_complete()

    return BoundedHttpProtocol


def _uvicorn_server(app: FastAPI, log_level: str, drain_s: float = 2.0, on_exit: Callable[[], None] | None = None):
    import signal

    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn's server; the first SIGINT/SIGTERM also calls `on_exit` (on the event
        loop) so the app can stop admitting, and a SIGTERM that ended a clean drain is
        not re-raised after it (the process exits 0)."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if sig == signal.SIGTERM:
                captured = getattr(self, "_captured_signals", None)
                if isinstance(captured, list) and sig in captured:
                    captured.remove(sig)
            if first and on_exit is not None:
                try:
                    asyncio.get_running_loop().call_soon_threadsafe(on_exit)
                except RuntimeError:  # no loop in this thread (not started yet)
                    on_exit()

    config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_keep_alive=30,
                            lifespan="on", timeout_graceful_shutdown=drain_s,
                            http=bounded_http_protocol(HttpLimits.from_env()))
    return _Server(config)


def one_blas_thread() -> None:
    """Limit this process's BLAS (OpenBLAS, MKL) to one thread. A service's numpy work is
    small solves (a Predictor's step-model refit: a 2048 × ~20 window; the outcome fit:
    2 × 2), which a second BLAS thread does not speed up; but OpenBLAS's idle threads
    busy-wait after each call, and with refits a few times a second that spinning was two
    thirds of the scheduler's CPU, on the cores its event loop and the engines share
    (docs/experiments/peer-routers.md, round 4)."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


def serve_blocking(app: FastAPI, host: str, port: int, log_level: str = "warning",
                   ready_file: str | None = None, *, use_uvloop: bool = False,
                   on_exit: Callable[[], None] | None = None, drain_s: float | None = None) -> None:
    """Serve `app` with uvicorn on host:port (port 0 = any free port) until interrupted
    (blocking). Once listening, prints `ready: http://HOST:PORT` on stdout and writes that
    URL to `ready_file` (when given), so a supervisor can learn the port. `use_uvloop`
    runs the event loop on uvicorn's uvloop when it is installed (else asyncio). Shared by the
    engine (`engine.sim_server.run_engine`) and the services (`services.http_common.run_app`).

    SIGTERM / SIGINT drain: the listener closes at once (no new connections; idle
    keep-alive ones are closed), `on_exit()` is called on the event loop (the app stops
    admitting: `/ready` 503), in-flight requests get `drain_s` seconds (default
    `drain_seconds()`: $ASTRO_DRAIN_S or 4 s) to finish, then the rest are cancelled; after
    SIGTERM the process returns normally (exit code 0).

    Raises:
        AstroUserError: the address cannot be bound; a bad $ASTRO_DRAIN_S.
    """
    if drain_s is None:
        drain_s = drain_seconds()
    one_blas_thread()
    sock = bind_socket(host, port)
    url = f"http://{host if ':' not in host else f'[{host}]'}:{sock.getsockname()[1]}"
    server = _uvicorn_server(app, log_level, drain_s, on_exit)

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.01)
        if server.started:
            # what starting made (modules, models, profiles, the app) lives as long as the
            # process: out of every later garbage collection. A full collection scanned it
            # all, ~30 ms on the 2-core machine, a stall of every request in flight
            gc.freeze()
            print(f"ready: {url}", flush=True)
            if ready_file:
                with open(ready_file, "w") as fh:
                    fh.write(url + "\n")
        await task

    run = asyncio.run
    if use_uvloop:
        try:
            import uvloop  # optional speed-up (uvicorn's "standard" extra)

            run = uvloop.run
        except ImportError:  # pragma: no cover
            pass
    try:
        run(main())
    except KeyboardInterrupt:
        pass


class ServerThread:
    """Serve an app on 127.0.0.1:<free port> in a background thread (tests, `astro serve`
    whole-cluster mode). Use as a context manager; `url` is the base URL.

    Raises:
        RuntimeError: the server did not come up within `timeout_s`.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", timeout_s: float = 20.0):
        self.sock = bind_socket(host, port)
        self.url = f"http://{host}:{self.sock.getsockname()[1]}"
        self.server = _uvicorn_server(app, log_level)
        self.thread = threading.Thread(target=self._run, daemon=True, name="astro-server")
        self.timeout_s = timeout_s

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + self.timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
