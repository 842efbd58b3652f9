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
`src`, on PYTHONPATH): two builds of the relay compared in one run.
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


def start_router(arm: str, engine_url: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = None
    if arm.partition("@")[0] == "astro":
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
