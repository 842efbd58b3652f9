"""A fake OpenAI chat streaming server with exactly known latencies, for measuring what a
load generator adds to TTFT / ITL / E2E (benchmarks/ttft_known_server.py, tests).

Raw asyncio HTTP/1.1 (keep-alive, chunked). Every POST to `.../chat/completions` is
answered with vLLM's stream shapes: the response head at once, then a role-only delta
(`{"role": "assistant", "content": ""}`) `ttft_s` after the request's last byte was
read, then `n` text deltas `itl_s` apart on a fixed grid (no drift; the last with
`finish_reason: "length"`), a usage chunk and `[DONE]`; `n` is the request's
`max_completion_tokens` / `max_tokens` (16 when absent) unless `chunks` fixes it.

So for every request the server-side truth is: TTFT = ttft_s, each ITL = itl_s,
E2E = ttft_s + n · itl_s (vLLM's definition: the role-only delta is the first chunk).
Each request's own times are logged (`log_path`, one JSON line per request, written when
its stream ends): `arrival_s` (perf_counter() when its body was read: CLOCK_MONOTONIC,
the same clock in every process on this host, and vLLM's `start_times`), `first_s`
(when the role-only delta was written), `last_s` (the last text delta), `n`, and the
`x-request-id` header when sent. A server event loop that falls behind shows up as
first_s − arrival_s > ttft_s there, so a reader can tell server lag from client lag.

    python benchmarks/fake_sse_server.py --port 8123 --ttft-ms 80 --itl-ms 20 --log /tmp/fake.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import IO


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _event(obj: dict) -> bytes:
    return _chunk(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


class FakeSSE:
    """The server's behaviour (see module docstring).

    ttft_s: delay from a request's last byte to its role-only delta (s). itl_s: gap
    between deltas (s). chunks: text deltas per reply (None: the request's max_tokens).
    log: a text file for the per-request JSON lines (None: not logged).
    """

    def __init__(self, ttft_s: float, itl_s: float, chunks: int | None = None, log: IO[str] | None = None):
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.chunks = chunks
        self.log = log
        self.records: list[dict] = []  # the logged lines, also kept in memory (in-process use)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                method, path = lines[0].split(b" ")[:2]
                length, rid = 0, None
                for line in lines[1:]:
                    k, _, v = line.partition(b":")
                    k = k.strip().lower()
                    if k == b"content-length":
                        length = int(v)
                    elif k == b"x-request-id":
                        rid = v.strip().decode()
                raw = await reader.readexactly(length) if length else b""
                arrival = time.perf_counter()
                if method != b"POST" or not path.endswith(b"/chat/completions"):
                    ok = path.endswith(b"/models") or path == b"/health"  # /health: a router's check
                    msg = (b'{"object":"list","data":[{"id":"fake","object":"model"}]}' if path.endswith(b"/models")
                           else b"{}" if ok else b'{"error":"no"}')
                    writer.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (b"200 OK" if ok else b"404 Not Found", len(msg), msg))
                    await writer.drain()
                    continue
                body = json.loads(raw) if raw else {}
                n = self.chunks or int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
                await self._stream(writer, n, arrival, rid)
        except (asyncio.IncompleteReadError, ConnectionError, ValueError, RuntimeError):
            pass  # the client went away (RuntimeError: uvloop's write on a closed transport)
        finally:
            writer.close()

    async def _stream(self, writer: asyncio.StreamWriter, n: int, arrival: float, rid: str | None) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": "fake"}
        await asyncio.sleep(max(0.0, arrival + self.ttft_s - time.perf_counter()))
        writer.write(_event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}))
        first = time.perf_counter()
        for i in range(n):
            await asyncio.sleep(max(0.0, arrival + self.ttft_s + (i + 1) * self.itl_s - time.perf_counter()))
            writer.write(_event({**base, "choices": [{"index": 0, "delta": {"content": " tok"}, "logprobs": None,
                                                      "finish_reason": "length" if i == n - 1 else None}]}))
        last = time.perf_counter()
        writer.write(_event({**base, "choices": [],
                             "usage": {"prompt_tokens": 16, "completion_tokens": n, "total_tokens": 16 + n}}))
        writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()
        rec = {"arrival_s": arrival, "first_s": first, "last_s": last, "n": n, "request_id": rid}
        self.records.append(rec)
        if self.log is not None:
            self.log.write(json.dumps(rec) + "\n")
            self.log.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ttft-ms", type=float, default=80.0)
    ap.add_argument("--itl-ms", type=float, default=20.0)
    ap.add_argument("--chunks", type=int, default=None,
                    help="text deltas per reply (default: the request's max_tokens)")
    ap.add_argument("--log", default=None, help="append one JSON line per request here")
    a = ap.parse_args()

    async def run() -> None:
        log = open(a.log, "a") if a.log else None  # noqa: SIM115 - open for the server's lifetime
        fake = FakeSSE(a.ttft_ms / 1e3, a.itl_ms / 1e3, a.chunks, log)
        srv = await asyncio.start_server(fake.handle, "127.0.0.1", a.port, backlog=1024)
        async with srv:
            await srv.serve_forever()

    try:
        import uvloop

        uvloop.run(run())
    except ImportError:  # pragma: no cover
        asyncio.run(run())


if __name__ == "__main__":
    main()
