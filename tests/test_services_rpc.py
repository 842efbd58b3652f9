"""The scheduler's lean HTTP/1.1 client against hand-written raw servers."""

from __future__ import annotations

import asyncio

import pytest

from rps_astro_cli.services.http_common import free_port
from rps_astro_cli.services.rpc import HostPool, RpcError


class RawServer:
    """Answers each request on a connection with the next canned response from
    `responses`; `close_after` closes a connection after that many responses."""

    def __init__(self, responses: list[bytes], close_after: int | None = None):
        self.responses = list(responses)
        self.close_after = close_after
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                cl = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        cl = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(cl))
                writer.write(self.responses.pop(0))
                await writer.drain()
                served += 1
                if self.close_after is not None and served >= self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, IndexError):
            pass
        writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def test_keep_alive_reuses_one_connection():
    async def main():
        srv = RawServer([ok(b'{"a": %d}' % i) for i in range(3)])
        async with srv as url:
            pool = HostPool(url)
            got = [await pool.post_json("/x", b'{"q": 1}') for _ in range(3)]
            pool.close()
        assert got == [(200, b'{"a": 0}'), (200, b'{"a": 1}'), (200, b'{"a": 2}')]
        assert srv.connections == 1
        assert srv.requests[0].startswith(b"POST /x HTTP/1.1\r\n") and srv.requests[0].endswith(b'{"q": 1}')

    asyncio.run(main())


def test_chunked_body_is_decoded_and_the_connection_stays_in_step():
    async def main():
        resp = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                b"4\r\nabcd\r\n3\r\nefg\r\n0\r\n\r\n")
        async with RawServer([resp, ok(b"next")]) as url:
            pool = HostPool(url)
            r = await pool.request("GET", "/s")
            body = b"".join([c async for c in r.body_reads()])
            await r.aclose()
            assert (r.status, body) == (200, b"abcdefg")
            assert await pool.post_json("/y", b"") == (200, b"next")  # same connection, still in sync
            pool.close()

    asyncio.run(main())


def test_idle_connection_closed_by_server_is_retried_once():
    async def main():
        srv = RawServer([ok(b"one"), ok(b"two")], close_after=1)
        async with srv as url:
            pool = HostPool(url)
            assert await pool.post_json("/a", b"{}") == (200, b"one")
            await asyncio.sleep(0.05)  # the server has closed the idle connection by now
            assert await pool.post_json("/a", b"{}") == (200, b"two")
            pool.close()
        assert srv.connections == 2

    asyncio.run(main())


def test_refused_and_broken_connections_raise_rpc_error():
    async def main():
        with pytest.raises(RpcError, match="cannot connect"):
            await HostPool(f"http://127.0.0.1:{free_port()}").post_json("/p", b"{}")
        cut = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly-part"
        async with RawServer([cut], close_after=1) as url:
            r = await HostPool(url).request("POST", "/p", b"{}")
            with pytest.raises(RpcError, match="body broken"):
                async for _ in r.body_reads():
                    pass

    asyncio.run(main())


def test_only_plain_http_urls():
    with pytest.raises(ValueError, match="http://"):
        HostPool("https://example.com")


def test_body_reads_decodes_chunked_bodies_split_anywhere_and_keeps_the_connection():
    """`Response.body_reads` (the bench's streaming path): a chunked body whose bytes arrive
    cut mid size-line, mid chunk and mid CRLF, with trailers, gives exactly the chunks'
    data, and the connection is reused for the next request."""
    import asyncio

    from rps_astro_cli.services.rpc import HostPool

    body = b"5\r\nhello\r\n1;ext=1\r\n \r\nb\r\nworld again\r\n0\r\nx-trailer: 1\r\n\r\n"
    pieces = [body[:2], body[2:9], body[9:10], body[10:23], body[23:]]
    conns = []

    async def handle(reader, writer):
        conns.append(writer)
        for _ in range(2):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            for p in pieces:
                writer.write(p)
                await writer.drain()
                await asyncio.sleep(0.01)
        writer.close()

    async def main():
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        pool = HostPool(f"http://127.0.0.1:{port}")
        got = []
        for _ in range(2):
            resp = await asyncio.wait_for(pool.request("GET", "/x"), 5)
            got.append(b"".join([c async for c in resp.body_reads()]))
            resp.aclose_sync()
        pool.close()
        srv.close()
        return got

    got = asyncio.run(asyncio.wait_for(main(), 20))
    assert got == [b"hello world again"] * 2
    assert len(conns) == 1  # one keep-alive connection served both


async def tap_all(resp) -> tuple[bytes, list]:
    """The body of `resp`: its first read awaited, the rest through `Response.tap`; and
    every `on_end` argument seen (a second one would show after the short wait)."""
    got, ends = [await resp.read_some()], []
    done = asyncio.get_running_loop().create_future()

    def end(err):
        ends.append(err)
        if not done.done():
            done.set_result(None)

    resp.tap(got.append, end)
    await asyncio.wait_for(done, 5)
    await asyncio.sleep(0.05)
    resp.aclose_sync()
    return b"".join(got), ends


def test_tap_hands_the_body_to_callbacks_split_anywhere_then_reuses_the_connection():
    """`Response.tap` (the front door's relay): the same split chunked body as above,
    tapped after its first read, gives exactly the chunks' data through `on_data`, then
    one `on_end(None)`; the connection serves the next request. A body cut mid-chunk ends
    with one `on_end(RpcError)`."""
    body = b"5\r\nhello\r\n1;ext=1\r\n \r\nb\r\nworld again\r\n0\r\nx-trailer: 1\r\n\r\n"
    pieces = [body[:2], body[2:9], body[9:10], body[10:23], body[23:]]
    head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    conns = []

    async def handle(reader, writer):
        conns.append(writer)
        for _ in range(2):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(head)
            for p in pieces:
                writer.write(p)
                await writer.drain()
                await asyncio.sleep(0.01)
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head + body[:30])  # cut inside "world again"
        await writer.drain()
        writer.close()

    async def main():
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        pool = HostPool(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
        out = [await tap_all(await pool.request("GET", "/x")) for _ in range(3)]
        pool.close()
        srv.close()
        return out

    (b1, e1), (b2, e2), (b3, e3) = asyncio.run(asyncio.wait_for(main(), 20))
    assert b1 == b2 == b"hello world again" and e1 == e2 == [None]
    assert b3 == b"hello world" and len(e3) == 1 and isinstance(e3[0], RpcError)
    assert len(conns) == 1  # one keep-alive connection served all three


def test_tap_reads_a_body_that_ends_with_the_connection():
    """A response with neither Content-Length nor chunked framing ends when the server
    closes: the tap hands on every byte, then one `on_end(None)` (the body is whole),
    and the connection is not pooled."""
    data = b"x" * 200_000

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n")
        for i in range(0, len(data), 50_000):
            writer.write(data[i:i + 50_000])
            await writer.drain()
            await asyncio.sleep(0.01)
        writer.close()

    async def main():
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        pool = HostPool(f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}")
        body, ends = await tap_all(await pool.request("GET", "/x"))
        idle = len(pool._idle)
        pool.close()
        srv.close()
        return body, ends, idle

    body, ends, idle = asyncio.run(asyncio.wait_for(main(), 20))
    assert body == data and ends == [None] and idle == 0
