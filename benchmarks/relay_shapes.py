"""CPU per relayed token of two relay shapes, outside astro (issue 32's CPU-per-token goal):

- `streams`: what astro's relay does per token — an asyncio StreamReader on the engine
  connection, a chunked-decoding async generator, an SSE-cutting async generator, and an
  ASGI-like `send` (a dict per piece, chunked framing, one write);
- `protocol`: the engine connection's `asyncio.Protocol.data_received` decodes the chunked
  framing, cuts whole SSE events and writes them straight onto the client's transport (no
  future, task, generator or message per token).

A fake engine (its own process, CPU 0) streams one SSE event per stream every `--step-ms`
on `--streams` connections; the relay (CPU 1, uvloop) forwards them to a client process
(CPU 1, as the peer harness pins its load generators beside the front doors) that reads
everything. Prints the relay process's CPU time ÷ tokens relayed, per repeat, the shapes
interleaved. No scheduling, parsing, decisions or status polls: the relay loop alone.

    .venv/bin/python benchmarks/relay_shapes.py [--streams 32] [--tokens 400] [--step-ms 20] \\
        [--repeats 3] [--spread] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

EVENT = (b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","choices":[{"index":0,'
         b'"delta":{"content":" tok"}}]}\n\n')
FRAME = b"%x\r\n" % len(EVENT) + EVENT + b"\r\n"
HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n"


def engine(conn: Any, streams: int, tokens: int, step_s: float, spread: bool = False) -> None:
    """Accept `streams` connections, then write one event on each every `step_s`: all at
    once (an engine step's tokens go out together, as vLLM's do), or with `spread` each
    stream's at its own offset in the step (the relay then wakes once per token, as
    behind `fake_sse_server.py`, whose streams keep their own clocks)."""
    async def main() -> None:
        writers: list[asyncio.StreamWriter] = []
        ready = asyncio.Event()

        async def accept(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            writers.append(w)
            if len(writers) == streams:
                ready.set()

        srv = await asyncio.start_server(accept, "127.0.0.1", 0)
        conn.send(srv.sockets[0].getsockname()[1])
        await ready.wait()
        for w in writers:
            w.write(HEAD)
        for _ in range(tokens):
            if spread:
                for w in writers:
                    await asyncio.sleep(step_s / streams)
                    w.write(FRAME)
                continue
            await asyncio.sleep(step_s)
            for w in writers:
                w.write(FRAME)
        for w in writers:
            w.write(b"0\r\n\r\n")
            await w.drain()
        await asyncio.sleep(0.5)

    asyncio.run(main())


def client(port: int, streams: int) -> None:
    """Open `streams` connections to the relay and read each to its end."""
    async def main() -> None:
        async def one() -> None:
            r, _w = await asyncio.open_connection("127.0.0.1", port)
            while await r.read(65536):
                pass

        await asyncio.gather(*(one() for _ in range(streams)))

    asyncio.run(main())


async def streams_relay(cw: asyncio.StreamWriter, eng_port: int, request: bytes = b"", close: bool = True) -> None:
    """Relay one engine response (sent `request` first, when given) onto `cw`; `close`:
    close `cw` at the end (else the connection stays for the client's next request)."""
    er, ew = await asyncio.open_connection("127.0.0.1", eng_port)
    if request:
        ew.write(request)
    await er.readuntil(b"\r\n\r\n")
    cw.write(HEAD)

    async def chunks() -> Any:
        while True:
            size = int(await er.readuntil(b"\r\n"), 16)
            if size == 0:
                await er.readuntil(b"\r\n")
                return
            yield (await er.readexactly(size + 2))[:-2]

    async def sse() -> Any:
        pending = b""
        async for c in chunks():
            pending += c
            end = pending.rfind(b"\n\n")
            if end >= 0:
                yield pending[:end + 2]
                pending = pending[end + 2:]

    async def send(msg: dict[str, Any]) -> None:
        body = msg["body"]
        if body:
            cw.write(b"".join([b"%x\r\n" % len(body), body, b"\r\n"]))
        if not msg["more_body"]:
            cw.write(b"0\r\n\r\n")

    async for piece in sse():
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})
    if close:
        cw.close()
    ew.close()


class RelayProtocol(asyncio.Protocol):
    """The engine connection: chunked decoding and SSE cuts in `data_received`."""

    def __init__(self, out: asyncio.WriteTransport, done: asyncio.Future[None], close_out: bool = True):
        self.out, self.done, self.close_out = out, done, close_out
        self.buf, self.need, self.head, self.pending = b"", -1, True, b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        pos, need = 0, self.need
        if self.head:
            i = buf.find(b"\r\n\r\n")
            if i < 0:
                self.buf = buf
                return
            pos, self.head = i + 4, False
        out = []
        while True:
            if need < 0:
                nl = buf.find(b"\r\n", pos)
                if nl < 0:
                    break
                size = int(buf[pos:nl], 16)
                pos = nl + 2
                if size == 0:
                    self.cut(out)
                    self.out.write(b"0\r\n\r\n")
                    if self.close_out:
                        self.out.close()
                    assert self.transport is not None
                    self.transport.close()
                    self.done.set_result(None)
                    return
                need = size
            if len(buf) - pos < need + 2:
                break
            out.append(buf[pos:pos + need])
            pos += need + 2
            need = -1
        self.buf, self.need = buf[pos:], need
        self.cut(out)

    def cut(self, out: list[bytes]) -> None:
        if not out:
            return
        p = self.pending + b"".join(out)
        end = p.rfind(b"\n\n")
        if end < 0:
            self.pending = p
            return
        piece, self.pending = p[:end + 2], p[end + 2:]
        self.out.write(b"%x\r\n" % len(piece) + piece + b"\r\n")


async def protocol_relay(cw: asyncio.StreamWriter, eng_port: int) -> None:
    loop = asyncio.get_running_loop()
    cw.write(HEAD)
    done: asyncio.Future[None] = loop.create_future()
    await loop.create_connection(lambda: RelayProtocol(cw.transport, done), "127.0.0.1", eng_port)  # type: ignore[arg-type]
    await done


def relay(conn: Any, shape: str, eng_port: int, streams: int) -> None:
    """Serve `streams` clients with `shape`; send back the process CPU seconds it took."""
    try:
        import uvloop
        run = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a core dependency off Windows
        run = asyncio.run

    async def main() -> float:
        left = [streams]
        fin = asyncio.Event()
        fn = streams_relay if shape == "streams" else protocol_relay

        async def serve(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            await fn(w, eng_port)
            left[0] -= 1
            if not left[0]:
                fin.set()

        srv = await asyncio.start_server(serve, "127.0.0.1", 0)
        c0 = time.process_time()
        conn.send(srv.sockets[0].getsockname()[1])
        await fin.wait()
        return time.process_time() - c0

    conn.send(run(main()))


def one_run(shape: str, streams: int, tokens: int, step_s: float, spread: bool = False) -> float:
    """µs of relay CPU per token for one run of `shape`."""
    a, b = mp.Pipe()
    pe = mp.Process(target=engine, args=(b, streams, tokens, step_s, spread))
    pe.start()
    os.sched_setaffinity(pe.pid, {0})
    eport = a.recv()
    c, d = mp.Pipe()
    pr = mp.Process(target=relay, args=(d, shape, eport, streams))
    pr.start()
    os.sched_setaffinity(pr.pid, {1})
    rport = c.recv()
    pc = mp.Process(target=client, args=(rport, streams))
    pc.start()
    os.sched_setaffinity(pc.pid, {1})
    cpu_s = c.recv()
    for p in (pc, pr, pe):
        p.join()
    return cpu_s / (streams * tokens) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=400, help="events per stream")
    ap.add_argument("--step-ms", type=float, default=20.0, help="engine step: one event per stream each")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--spread", action="store_true", help="each stream's event at its own offset in the step "
                    "(one relay wake-up per token) instead of all at once")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        ap.error("needs two CPUs (engine on CPU 0; relay and client on CPU 1)")
    out: dict[str, list[float]] = {"streams": [], "protocol": []}
    for r in range(a.repeats):
        for shape in (("streams", "protocol") if r % 2 == 0 else ("protocol", "streams")):
            us = one_run(shape, a.streams, a.tokens, a.step_ms / 1000, a.spread)
            out[shape].append(us)
            print(f"repeat {r} {shape:8s} {us:6.1f} µs CPU per token", flush=True)
    for shape, v in out.items():
        print(f"{shape:8s} median {sorted(v)[len(v) // 2]:.1f} µs ({', '.join(f'{x:.1f}' for x in v)})")
    if a.json:
        a.json.write_text(json.dumps({"streams": a.streams, "tokens": a.tokens, "step_ms": a.step_ms,
                                      "spread": a.spread, "us_cpu_per_token": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
