"""A front door's own CPU per relayed token, the relay alone (issue 32's CPU-per-token goal):
one fake engine (`fake_sse_server.py`: a stream of `--tokens` deltas `--itl-ms` apart, no
scheduling work of its own), each front door in turn in front of it with round_robin (astro:
no `/status` polls, no look-ahead; its in-process baseline tagger), and a client process
holding `--streams` streams open at once. The front door's process CPU seconds (utime +
stime from /proc) over the streamed tokens, per run, the arms interleaved and rotated.

Engine on CPU 0; the front door and the client on CPU 1 (as the peer harness pins them).
Against `peer_routers.py`'s CPU per token at 85 % load, the difference is what the
scheduler does besides relaying (status polls, decisions, calibration).

    .venv/bin/python benchmarks/relay_cpu.py [--streams 32] [--tokens 300] [--itl-ms 20] \\
        [--repeats 3] [--arms astro,vllm-router] [--json out.json]

An arm `astro@SRC` runs astro's scheduler from the source tree SRC (another checkout's
`src`, on PYTHONPATH): two builds of the relay compared in one run. Arms `lean-streams` and
`lean-protocol` are the two relay shapes of `relay_shapes.py` as minimal HTTP front doors
(one request per client connection read, forwarded on a new engine connection, the body
relayed): what a Python relay with none of astro's layers costs under the same engine,
client and pinning.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    """utime + stime of `pid` (seconds)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_ok(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {timeout_s:.0f} s")


LEAN = ("lean-streams", "lean-protocol")


def lean_server(shape: str, port: int, engine_port: int) -> None:
    """A minimal front door: each client request (head and content-length body) is sent
    on a new engine connection and the engine's chunked response relayed with `shape`."""
    from relay_shapes import RelayProtocol, streams_relay

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                n = next((int(x.split(b":", 1)[1]) for x in lines[1:] if x.lower().startswith(b"content-length:")), 0)
                body = await r.readexactly(n)
                req = (lines[0] + b"\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                       % len(body) + body)
                if shape == "lean-streams":
                    await streams_relay(w, engine_port, req, close=False)
                else:
                    loop = asyncio.get_running_loop()
                    done: asyncio.Future[None] = loop.create_future()
                    w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-type: text/event-stream\r\n\r\n")
                    t, _ = await loop.create_connection(lambda d=done: RelayProtocol(w.transport, d, close_out=False),
                                                        "127.0.0.1", engine_port)
                    t.write(req)
                    await done
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    async def main() -> None:
        srv = await asyncio.start_server(handle, "127.0.0.1", port)
        await srv.serve_forever()

    import uvloop
    uvloop.run(main())


def start_router(arm: str, engine_url: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = None
    if arm in LEAN:
        cmd = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE)!r}); import relay_cpu; "
               f"relay_cpu.lean_server({arm!r}, {port}, {int(engine_url.rsplit(':', 1)[1])})"]
    elif arm.partition("@")[0] == "astro":
        cmd = [sys.executable, "-m", "rps_astro_cli.cli.main", "serve", "scheduler", "--engine", engine_url,
               "--policy", "round_robin", "--host", "127.0.0.1", "--port", str(port)]
        src = arm.partition("@")[2]
        if src:
            if not (Path(src) / "rps_astro_cli" / "__init__.py").is_file():
                raise SystemExit(f"{arm}: {src} holds no rps_astro_cli package (give a checkout's src directory)")
            env = {**os.environ, "PYTHONPATH": str(Path(src).resolve())}
    else:
        binary = Path(sys.executable).parent / arm
        if not binary.is_file():
            raise SystemExit(f"{arm} is not installed: pip install -e '.[peers]'")
        cmd = [str(binary), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", engine_url,
               "--policy", "round_robin", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env=env)
    os.sched_setaffinity(proc.pid, {1})
    url = f"http://127.0.0.1:{port}"
    if arm in LEAN:  # it relays chat streams only: wait for its port
        import socket

        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{arm} did not listen within 30 s") from None
                time.sleep(0.1)
    else:
        wait_ok(url + "/v1/models")
    return proc, url


async def streams(url: str, n: int, tokens: int) -> int:
    """`n` streams of `tokens` at once; the content deltas read."""
    async with httpx.AsyncClient(timeout=120.0, limits=httpx.Limits(max_connections=n)) as c:
        async def one() -> int:
            body = {"model": "fake", "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens,
                    "stream": True}
            got = 0
            async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    got += line.startswith("data: {") and '"content":" tok"' in line
            return got

        return sum(await asyncio.gather(*(one() for _ in range(n))))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--itl-ms", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default="astro,vllm-router")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        ap.error("needs two CPUs (engine on CPU 0; front door and client on CPU 1)")
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    os.sched_setaffinity(0, {1})
    out: dict[str, list[float]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="astro-relay-cpu-") as d:
        eport = free_port()
        eng = subprocess.Popen([sys.executable, str(HERE / "fake_sse_server.py"), "--port", str(eport),
                                "--ttft-ms", "5", "--itl-ms", str(a.itl_ms)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        os.sched_setaffinity(eng.pid, {0})
        engine_url = f"http://127.0.0.1:{eport}"
        try:
            wait_ok(engine_url + "/v1/models")
            for r in range(a.repeats):
                order = arms[r % len(arms):] + arms[:r % len(arms)]
                for arm in order:
                    proc, url = start_router(arm, engine_url, Path(d) / f"{arm.replace('/', '_')}.log")
                    try:
                        asyncio.run(streams(url, 2, 5))  # warm: connections, first-call imports
                        c0 = cpu_s(proc.pid)
                        got = asyncio.run(streams(url, a.streams, a.tokens))
                        used = cpu_s(proc.pid) - c0
                    finally:
                        os.killpg(proc.pid, signal.SIGTERM)
                        proc.wait(10)
                    if got != a.streams * a.tokens:
                        raise SystemExit(f"{arm}: {got} content deltas relayed, expected {a.streams * a.tokens}")
                    us = used / got * 1e6
                    out[arm].append(us)
                    print(f"repeat {r} {arm:12s} {us:6.1f} µs CPU per token ({used:.2f} s over {got} tokens)",
                          flush=True)
        finally:
            os.killpg(eng.pid, signal.SIGTERM)
            eng.wait(10)
    for arm, v in out.items():
        print(f"{arm:12s} median {sorted(v)[len(v) // 2]:.1f} µs ({', '.join(f'{x:.1f}' for x in v)})")
    if a.json:
        a.json.write_text(json.dumps({"streams": a.streams, "tokens": a.tokens, "itl_ms": a.itl_ms,
                                      "us_cpu_per_token": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
