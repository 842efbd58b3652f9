"""A lean HTTP/1.1 keep-alive client for the scheduler's hot path (tag and predict RPCs,
forwarding to engines) between astro's own services on loopback.

Why not httpx here: measured on the 2-core dev machine against a uvicorn JSON endpoint,
one httpx.AsyncClient POST costs ~585 µs of client CPU, a plain asyncio-streams request
~30 µs. With k=2 the scheduler makes 3 RPCs plus the forward per request, so httpx alone
would cap one scheduler process near 400 req/s. httpx stays in use for everything else
(health checks, status polls, the services' own clients).

Scope (deliberately small): plain `http://host:port` (no TLS, no proxies, no redirects),
request bodies with Content-Length, responses with Content-Length, chunked transfer
encoding or read-to-close. One pool of idle connections per destination. A request on
a reused idle connection that the server had already closed (EOF before any response
byte) is retried once on a fresh connection, which is safe because the server never saw
it. Every transport failure raises `RpcError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

_MAX_HEAD_BYTES = 64 * 1024


class RpcError(ConnectionError):
    """The destination could not be reached or broke the HTTP exchange."""


class _Conn:
    __slots__ = ("reader", "writer", "reused")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.reused = False

    def close(self) -> None:
        try:
            self.writer.close()
        except Exception:  # pragma: no cover - already gone
            pass


class Response:
    """A response whose body is read as an async stream of decoded chunks.

    status: HTTP status code. headers: lower-cased names → values.
    Call `read()` for the whole body, or iterate `chunks()`, then `aclose()` (idempotent;
    returns the connection to the pool when the body was fully read).
    """

    def __init__(self, pool: HostPool, conn: _Conn, status: int, headers: dict[str, str]):
        self.pool = pool
        self.status = status
        self.headers = headers
        self._conn: _Conn | None = conn
        self._done = False
        te = headers.get("transfer-encoding", "").lower()
        self._chunked = "chunked" in te
        cl = headers.get("content-length")
        self._remaining = int(cl) if cl is not None and not self._chunked else None
        self._keep = headers.get("connection", "").lower() != "close" and (self._chunked or cl is not None)
        if status in (204, 304) or (self._remaining == 0):
            self._done = True

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, chunk by chunk (decoded from chunked encoding when used).

        Raises:
            RpcError: the connection broke before the body ended.
        """
        conn = self._conn
        if conn is None or self._done:
            return
        r = conn.reader
        try:
            if self._chunked:
                while True:
                    line = await r.readuntil(b"\r\n")
                    size = int(line.split(b";", 1)[0].strip() or b"0", 16)
                    if size == 0:
                        while (await r.readuntil(b"\r\n")) != b"\r\n":  # trailers
                            pass
                        break
                    data = await r.readexactly(size + 2)
                    yield data[:-2]
            elif self._remaining is not None:
                while self._remaining > 0:
                    data = await r.read(min(self._remaining, 1 << 16))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", self._remaining)
                    self._remaining -= len(data)
                    yield data
            else:  # read to close
                while data := await r.read(1 << 16):
                    yield data
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, ValueError) as exc:
            self._drop()
            raise RpcError(f"{self.pool.base_url}: response body broken: {exc!r}") from None
        self._done = True

    async def body_reads(self) -> AsyncIterator[bytes]:
        """The body as it arrives: one piece per socket read, chunked framing removed, so
        a read that carries several chunks (a burst of SSE events) is one piece — what a
        streaming client timing network arrivals wants, with one await per read instead
        of two per chunk (`chunks`). Content-Length and read-to-close bodies are read as
        `chunks` reads them.

        Raises:
            RpcError: the connection broke before the body ended.
        """
        conn = self._conn
        if conn is None or self._done:
            return
        if not self._chunked:
            async for data in self.chunks():
                yield data
            return
        r = conn.reader
        buf, pos = b"", 0  # unparsed bytes start at buf[pos] (an index: no re-slicing per chunk)
        need = -1  # bytes of chunk data still to come (then its CRLF); -1: a size line is next
        try:
            while True:
                out = []
                while True:
                    if need < 0:
                        nl = buf.find(b"\r\n", pos)
                        if nl < 0:
                            break
                        size = int(buf[pos:nl].split(b";", 1)[0].strip() or b"0", 16)
                        pos = nl + 2
                        if size == 0:  # last chunk: optional trailers, then an empty line
                            tail = buf[pos:]
                            while not (tail.startswith(b"\r\n") or b"\r\n\r\n" in tail):
                                more = await r.read(1 << 16)
                                if not more:
                                    raise asyncio.IncompleteReadError(b"", None)
                                tail += more
                            if out:
                                yield b"".join(out)
                            self._done = True
                            return
                        need = size
                    avail = len(buf) - pos
                    if avail < need + 2:
                        if need and avail > 0:  # hand on what arrived of a long chunk now
                            take = min(avail, need)
                            out.append(buf[pos:pos + take])
                            pos += take
                            need -= take
                        break
                    out.append(buf[pos:pos + need])
                    pos += need + 2
                    need = -1
                if out:
                    yield b"".join(out)
                more = await r.read(1 << 16)
                if not more:
                    raise asyncio.IncompleteReadError(b"", None)
                buf, pos = buf[pos:] + more, 0
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError, ValueError) as exc:
            self._drop()
            raise RpcError(f"{self.pool.base_url}: response body broken: {exc!r}") from None

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body (then the connection goes back to the pool); with `max_bytes`,
        at most its first `max_bytes` bytes (the rest unread: the connection is dropped)."""
        parts = []
        size = 0
        async for c in self.chunks():
            parts.append(c)
            size += len(c)
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
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, limit=_MAX_HEAD_BYTES), self.connect_timeout_s)
        except (TimeoutError, OSError) as exc:
            raise RpcError(f"{self.base_url}: cannot connect: {exc!r}") from None
        return _Conn(reader, writer)

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
