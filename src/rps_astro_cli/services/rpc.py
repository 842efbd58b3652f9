"""A lean HTTP/1.1 keep-alive client for the scheduler's hot path (tag and predict RPCs,
forwarding to engines) between astro's own services on loopback.

Why not httpx here: measured on the 2-core dev machine against a uvicorn JSON endpoint,
one httpx.AsyncClient POST costs ~585 µs of client CPU, a plain asyncio-streams request
~30 µs. With k=2 the scheduler makes 3 RPCs plus the forward per request, so httpx alone
would cap one scheduler process near 400 req/s. httpx stays in use for everything else
(health checks, status polls, the services' own clients).

Scope (deliberately small): plain `http://host:port` (no TLS, no proxies, no redirects),
request bodies with Content-Length, responses with Content-Length, chunked transfer
encoding or read-to-close, each read with one incremental decoder (`_Chunked`, `_Length`,
`_ToClose`) whether the body is awaited (`Response.read_some`) or handed to callbacks
run by the connection as bytes arrive (`Response.tap`: the front door's relay). One
pool of idle connections per destination. A request on
a reused idle connection that the server had already closed (EOF before any response
byte) is retried once on a fresh connection, which is safe because the server never saw
it. Every transport failure raises `RpcError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from urllib.parse import urlsplit

_MAX_HEAD_BYTES = 64 * 1024


class RpcError(ConnectionError):
    """The destination could not be reached or broke the HTTP exchange."""


class _Reader(asyncio.StreamReader):
    """asyncio's StreamReader whose incoming bytes can go to a callback instead of its
    buffer (`Response.tap`): the engine connection's data callback then relays them with
    no task woken per read."""

    _on_data: Callable[[bytes], None] | None = None
    _on_lost: Callable[[BaseException | None], None] | None = None

    def feed_data(self, data: bytes) -> None:
        if self._on_data is not None:
            self._on_data(data)
        else:
            super().feed_data(data)

    def feed_eof(self) -> None:
        super().feed_eof()
        if self._on_lost is not None:
            self._on_lost(None)

    def set_exception(self, exc: BaseException) -> None:
        super().set_exception(exc)
        if self._on_lost is not None:
            self._on_lost(exc)

    def start_tap(self, on_data: Callable[[bytes], None], on_lost: Callable[[BaseException | None], None]) -> bytes:
        """Send later bytes to `on_data` and the connection's end to `on_lost`; the bytes
        buffered until now are returned (the caller hands them on first)."""
        buf: bytearray = self._buffer  # type: ignore[attr-defined]
        buffered = bytes(buf)
        buf.clear()
        if self._paused:  # type: ignore[attr-defined]  # paused for a full buffer: it is empty now
            self._paused = False
            self._transport.resume_reading()  # type: ignore[attr-defined]
        self._on_data, self._on_lost = on_data, on_lost
        return buffered

    def stop_tap(self, rest: bytes = b"") -> None:
        """Buffer incoming bytes again, starting with `rest`."""
        self._on_data = self._on_lost = None
        if rest:
            super().feed_data(rest)


class _Conn:
    __slots__ = ("reader", "writer", "reused")

    def __init__(self, reader: _Reader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.reused = False

    def close(self) -> None:
        self.reader.stop_tap()
        try:
            self.writer.close()
        except Exception:  # pragma: no cover - already gone
            pass


class _Chunked:
    """Incremental decoder of the chunked transfer coding: `feed` bytes as they arrive,
    get the body's data back; `done` once the last chunk and trailers have come, `rest`
    the bytes past the body's end.

    Raises (from feed): ValueError on a malformed size line or a chunk not closed by CRLF.
    """

    __slots__ = ("buf", "need", "trailers", "done", "rest")

    def __init__(self) -> None:
        self.buf = b""  # unparsed bytes
        self.need = -1  # data bytes of the current chunk still to come (then its CRLF); -1: a size line is next
        self.trailers = False  # past the last chunk: trailer lines until an empty one
        self.done = False
        self.rest = b""

    def feed(self, data: bytes) -> bytes:
        buf = self.buf + data if self.buf else data
        pos, need, out = 0, self.need, []
        while True:
            nl = -1
            if self.trailers or need < 0:
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    if len(buf) - pos > _MAX_HEAD_BYTES:
                        raise ValueError("a chunk size or trailer line is too long")
                    break
            if self.trailers:
                empty, pos = nl == pos, nl + 2
                if empty:
                    self.done, self.rest, self.buf = True, buf[pos:], b""
                    return b"".join(out)
                continue
            if need < 0:
                size = int(buf[pos:nl].split(b";", 1)[0].strip() or b"0", 16)
                if size < 0:
                    raise ValueError(f"negative chunk size {size}")
                pos = nl + 2
                if size == 0:
                    self.trailers = True
                    continue
                need = size
            avail = len(buf) - pos
            if avail < need + 2:
                if need and avail > 0:  # hand on what arrived of a long chunk now
                    take = min(avail, need)
                    out.append(buf[pos:pos + take])
                    pos += take
                    need -= take
                break
            if buf[pos + need:pos + need + 2] != b"\r\n":
                raise ValueError("a chunk's data is not followed by CRLF")
            out.append(buf[pos:pos + need])
            pos += need + 2
            need = -1
        self.buf, self.need = buf[pos:], need
        return b"".join(out)

    def eof(self) -> None:
        raise ValueError("the connection ended inside a chunked body")


class _Length:
    """A Content-Length body (see `_Chunked`)."""

    __slots__ = ("left", "done", "rest")

    def __init__(self, n: int) -> None:
        self.left = n
        self.done = n == 0
        self.rest = b""

    def feed(self, data: bytes) -> bytes:
        if len(data) < self.left:
            self.left -= len(data)
            return data
        out, self.rest = data[:self.left], data[self.left:]
        self.left, self.done = 0, True
        return out

    def eof(self) -> None:
        raise ValueError(f"the connection ended {self.left} bytes before the body's end")


class _ToClose:
    """A body that ends when the connection does (see `_Chunked`)."""

    __slots__ = ("done", "rest")

    def __init__(self) -> None:
        self.done = False
        self.rest = b""

    def feed(self, data: bytes) -> bytes:
        return data

    def eof(self) -> None:
        self.done = True


class Response:
    """A response whose body is read as it arrives.

    status: HTTP status code. headers: lower-cased names → values.
    Read the body with `read()`, `read_some()` / `body_reads()`, or hand its rest to
    callbacks with `tap`; then `aclose()` (idempotent; returns the connection to the pool
    when the body was read to its end).
    """

    def __init__(self, pool: HostPool, conn: _Conn, status: int, headers: dict[str, str]):
        self.pool = pool
        self.status = status
        self.headers = headers
        self._conn: _Conn | None = conn
        chunked = "chunked" in headers.get("transfer-encoding", "").lower()
        cl = headers.get("content-length")
        self._dec: _Chunked | _Length | _ToClose = (
            _Chunked() if chunked else _Length(int(cl)) if cl is not None else _ToClose())
        self._keep = headers.get("connection", "").lower() != "close" and (chunked or cl is not None)
        self._done = status in (204, 304) or self._dec.done

    def _broken(self, exc: BaseException) -> RpcError:
        self._drop()
        return RpcError(f"{self.pool.base_url}: response body broken: {exc!r}")

    def _ended(self) -> None:
        self._done = True
        if self._dec.rest:  # bytes past the body's end: the connection is out of step
            self._keep = False

    async def read_some(self) -> bytes:
        """The body's next bytes, framing removed, as one socket read brings them (a read
        that carries several chunks, a burst of SSE events, is one piece); b"" once the
        body has ended.

        Raises:
            RpcError: the connection broke before the body ended.
        """
        conn, dec = self._conn, self._dec
        while conn is not None and not self._done:
            try:
                more = await conn.reader.read(1 << 16)
                if more:
                    out = dec.feed(more)
                else:
                    dec.eof()
                    out = b""
            except (OSError, ValueError) as exc:
                raise self._broken(exc) from None
            if dec.done:
                self._ended()
            if out:
                return out
        return b""

    async def body_reads(self) -> AsyncIterator[bytes]:
        """The body as it arrives: `read_some` until its end (what a streaming client
        timing network arrivals wants).

        Raises:
            RpcError: the connection broke before the body ended.
        """
        while piece := await self.read_some():
            yield piece

    def tap(self, on_data: Callable[[bytes], None], on_end: Callable[[RpcError | None], None]) -> None:
        """Hand the rest of the body to callbacks run by the connection itself as bytes
        arrive (no task woken per read): `on_data(bytes)` with each read's body bytes,
        framing removed; then once `on_end(None)` when the body has ended (`aclose` then
        returns the connection to the pool) or `on_end(RpcError)` when the connection broke
        first. Bytes already read are handed on at once, inside this call. `pause_reading`
        / `resume_reading` for flow control; `aclose` stops the callbacks."""
        conn = self._conn
        if conn is None or self._done:
            on_end(None if self._done else RpcError(f"{self.pool.base_url}: response already closed"))
            return
        reader, dec = conn.reader, self._dec

        def data(more: bytes) -> None:
            try:
                out = dec.feed(more)
            except ValueError as exc:
                on_end(self._broken(exc))
                return
            if out:
                on_data(out)
            if dec.done and self._conn is conn:
                reader.stop_tap(dec.rest)
                self._ended()
                on_end(None)

        def lost(exc: BaseException | None) -> None:
            if self._done or self._conn is not conn:
                return
            try:
                dec.eof()
            except ValueError as why:
                on_end(self._broken(exc or why))
                return
            reader.stop_tap()
            self._ended()
            on_end(None)

        buffered = reader.start_tap(data, lost)
        if buffered:
            data(buffered)
        if not self._done and self._conn is conn and reader.at_eof():
            lost(reader.exception())

    def pause_reading(self) -> None:
        """Stop reading the body from the socket (the peer then stops sending)."""
        if self._conn is not None:
            self._conn.writer.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._conn is not None:
            self._conn.writer.transport.resume_reading()

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body (then the connection goes back to the pool); with `max_bytes`,
        at most its first `max_bytes` bytes (the rest unread: the connection is dropped).

        Raises:
            RpcError: the connection broke before the body ended.
        """
        parts = []
        size = 0
        while piece := await self.read_some():
            parts.append(piece)
            size += len(piece)
            if max_bytes is not None and size >= max_bytes:
                break
        self.aclose_sync()
        out = b"".join(parts)
        return out if max_bytes is None else out[:max_bytes]

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def aclose_sync(self) -> None:
        if self._conn is None:
            return
        if self._done and self._keep:
            self.pool._release(self._conn)
            self._conn = None
        else:  # unread body: the connection cannot be reused (and the server sees the close)
            self._drop()

    async def aclose(self) -> None:
        self.aclose_sync()


class HostPool:
    """Keep-alive connections to one `http://host:port` (see module docstring).

    max_idle: idle connections kept. connect_timeout_s: TCP connect deadline (s).
    headers: sent on every request (e.g. the cluster's internal token,
    `protocol.internal_auth.token_headers`).
    """

    def __init__(self, base_url: str, max_idle: int = 256, connect_timeout_s: float = 2.0,
                 headers: dict[str, str] | None = None):
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"only http://host:port URLs are supported, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self.max_idle = max_idle
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Conn] = []
        self._host_header = f"{self.host}:{self.port}".encode()
        self._fixed_head = [f"{k}: {v}".encode() for k, v in (headers or {}).items()]

    async def _connect(self) -> _Conn:
        try:
            loop = asyncio.get_running_loop()
            reader = _Reader(limit=_MAX_HEAD_BYTES, loop=loop)
            protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
            transport, _ = await asyncio.wait_for(
                loop.create_connection(lambda: protocol, self.host, self.port), self.connect_timeout_s)
        except (TimeoutError, OSError) as exc:
            raise RpcError(f"{self.base_url}: cannot connect: {exc!r}") from None
        return _Conn(reader, asyncio.StreamWriter(transport, protocol, reader, loop))

    def _release(self, conn: _Conn) -> None:
        if len(self._idle) < self.max_idle and not conn.writer.is_closing() and not conn.reader.at_eof():
            conn.reused = True
            self._idle.append(conn)
        else:
            conn.close()

    async def request(self, method: str, path: str, body: bytes | None = None,
                      headers: dict[str, str] | None = None) -> Response:
        """Send one request; return once the response head has arrived.

        Raises:
            RpcError: connect failure, reset, or a malformed response head.
        """
        head = [f"{method} {self.prefix}{path} HTTP/1.1".encode(), b"host: " + self._host_header, *self._fixed_head]
        for k, v in (headers or {}).items():
            head.append(f"{k}: {v}".encode())
        if body is not None or method in ("POST", "PUT", "PATCH"):
            head.append(b"content-length: %d" % len(body or b""))
        data = b"\r\n".join(head) + b"\r\n\r\n" + (body or b"")
        for attempt in range(2):
            # the retry must not take another idle connection: after a server's keep-alive
            # timeout (uvicorn/vLLM: 5 s) every idle one may be closed
            conn = self._idle.pop() if self._idle and attempt == 0 else await self._connect()
            try:
                conn.writer.write(data)
                status_line = await conn.reader.readuntil(b"\r\n")
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError) as exc:
                conn.close()
                if conn.reused and attempt == 0:
                    continue  # the server closed this idle connection; it never saw the request
                raise RpcError(f"{self.base_url}: connection lost: {exc!r}") from None
            except BaseException:
                conn.close()
                raise
            try:
                raw_head = await conn.reader.readuntil(b"\r\n\r\n") if status_line != b"\r\n" else b""
                parts = status_line.split(b" ", 2)
                status = int(parts[1])
                hdrs: dict[str, str] = {}
                for line in raw_head.split(b"\r\n"):
                    if line:
                        k, _, v = line.partition(b":")
                        hdrs[k.decode("latin-1").strip().lower()] = v.decode("latin-1").strip()
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, ValueError, IndexError) as exc:
                conn.close()
                raise RpcError(f"{self.base_url}: malformed response: {exc!r}") from None
            except BaseException:
                conn.close()
                raise
            return Response(self, conn, status, hdrs)
        raise AssertionError("unreachable")  # pragma: no cover

    async def post_json(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST a JSON body; (status, whole response body).

        Raises:
            RpcError: transport failure.
        """
        resp = await self.request("POST", path, body, {"content-type": "application/json"})
        try:
            return resp.status, await resp.read()
        finally:
            resp.aclose_sync()

    def close(self) -> None:
        for c in self._idle:
            c.close()
        self._idle.clear()
