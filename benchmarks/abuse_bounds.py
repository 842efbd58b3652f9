"""Abuse bounds (issue 29): memory of every process and the latency of normal requests
while clients misbehave, against `astro serve --instances 2` (sim engines), loopback.

    .venv/bin/python benchmarks/abuse_bounds.py [--slowloris-s 60] [--cases big_prompts] [--json out.json]

Cases, one after another, each with every process's peak RSS (VmRSS, sampled every
50 ms) beside the idle RSS:

1. `headers`: 40 connections each sending an unfinished 20 MB header to the scheduler
   (no API key needed) — the server must cut each at `ASTRO_HTTP_MAX_HEADER_BYTES`.
2. `slowloris`: 100 connections trickling header bytes (one line a second, reconnecting
   when closed) for `--slowloris-s`, while a normal 1-token request is timed every 0.5 s:
   the P100 of those must stay under 0.2 s.
3. `largest`: the largest request the default limits admit (n 128 × max_tokens 2048 =
   262,144 output tokens, logprobs 3: 4 × 262,144 = 1,048,576 log-probability entries),
   non-streamed: its response bytes and the scheduler's and engine's peak RSS.
4. `big_prompts`: 30 concurrent ~1 MB prompts (each refused as too long) while a 1-token
   request is timed.

`--cases` runs only the named ones (comma-separated; default all four). Prints one
table and, with `--json`, writes the figures. Exit code 1 when a normal request failed
or took over the bound (in the slowloris case, when run), else 0. Not a CI test (minutes
of traffic).
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
import threading
import time
from pathlib import Path

import httpx


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Peaks:
    """Peak RSS per process, sampled every 50 ms in a thread while in a `with` block."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.peak: dict[str, float] = {}
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            for name, pid in self.pids.items():
                v = rss_mib(pid)
                if v is not None:
                    self.peak[name] = max(self.peak.get(name, 0.0), v)
            time.sleep(0.05)

    def __enter__(self) -> Peaks:
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rstrip("/").split(":")
    return host, int(port)


async def unfinished_header(url: str, total_bytes: int) -> int:
    """Send an unfinished header of up to `total_bytes`; bytes the server took before it
    closed the connection."""
    host, port = host_port(url)
    r, w = await asyncio.open_connection(host, port)
    sent = 0
    chunk = b"a" * 65536
    try:
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-big: ")
        while sent < total_bytes:
            w.write(chunk)
            await asyncio.wait_for(w.drain(), 15)
            sent += len(chunk)
    except (TimeoutError, OSError):
        pass
    w.close()
    return sent


async def slowloris(url: str, until: float) -> int:
    """Hold a connection by trickling header lines, reconnecting when closed; the
    number of times the server closed it."""
    host, port = host_port(url)
    closed = 0
    while time.monotonic() < until:
        try:
            r, w = await asyncio.open_connection(host, port)
            w.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n")
            while time.monotonic() < until:
                await asyncio.sleep(1.0)
                if r.at_eof():
                    break
                w.write(b"x-a: b\r\n")
                await w.drain()
            w.close()
        except OSError:
            pass
        closed += 1
    return closed


async def timed_requests(sched: str, model: str, until: float, every_s: float) -> list[float]:
    out = []
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with httpx.AsyncClient(base_url=sched, timeout=30) as c:
        while time.monotonic() < until:
            t0 = time.perf_counter()
            r = await c.post("/v1/chat/completions", json=body)
            out.append(time.perf_counter() - t0 if r.status_code == 200 else float("inf"))
            await asyncio.sleep(every_s)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--slowloris-s", type=float, default=60.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--cases", default="headers,slowloris,largest,big_prompts",
                    help="comma-separated cases to run (default: all four)")
    args = ap.parse_args()
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = set(wanted) - {"headers", "slowloris", "largest", "big_prompts"}
    if unknown:
        ap.error(f"--cases: unknown case(s) {', '.join(sorted(unknown))}")
    tmp = Path(tempfile.mkdtemp(prefix="astro-abuse-"))
    cj = tmp / "cluster.json"
    log = open(tmp / "serve.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "rps_astro_cli.cli.main", "serve", "--instances", "2",
                             "--time-scale", "0.1", "--run-dir", str(tmp / "run"), "--cluster-json", str(cj)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    results: dict[str, dict] = {}
    ok = True
    try:
        deadline = time.monotonic() + 180
        while not cj.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                print((tmp / "serve.out").read_text(), file=sys.stderr)
                return 1
            time.sleep(0.2)
        time.sleep(1.0)
        info = json.loads(cj.read_text())
        sched, model = info["scheduler"]["url"], info["model"]
        pids = {"scheduler": info["scheduler"]["pid"]}
        for inst in info["instances"]:
            pids[inst["name"]] = inst["engine_pid"]
        idle = {n: rss_mib(p) or 0.0 for n, p in pids.items()}
        print(f"cluster up: scheduler {sched}; idle RSS " + ", ".join(f"{n} {v:.0f} MiB" for n, v in idle.items()),
              flush=True)

        async def headers_case() -> dict:
            with Peaks(pids) as pk:
                taken = await asyncio.gather(*(unfinished_header(sched, 20 << 20) for _ in range(40)))
            return {"max_bytes_taken": max(taken), "peak_rss_mib": pk.peak}

        async def slowloris_case() -> dict:
            until = time.monotonic() + args.slowloris_s
            with Peaks(pids) as pk:
                held = [asyncio.create_task(slowloris(sched, until)) for _ in range(100)]
                lat = await timed_requests(sched, model, until, 0.5)
                closes = await asyncio.gather(*held)
            lat.sort()
            return {"requests": len(lat), "latency_p50_s": lat[len(lat) // 2], "latency_max_s": lat[-1],
                    "server_closes": sum(closes), "peak_rss_mib": pk.peak}

        async def largest_case() -> dict:
            body = {"model": model, "prompt": "hello world", "n": 128, "temperature": 1.0, "max_tokens": 2048,
                    "logprobs": 3, "vllm_xargs": {"astro_output_tokens": 2048}}
            with Peaks(pids) as pk:
                async with httpx.AsyncClient(base_url=sched, timeout=600) as c:
                    t0 = time.perf_counter()
                    r = await c.post("/v1/completions", json=body)
                    took = time.perf_counter() - t0
            return {"status": r.status_code, "response_mib": len(r.content) / 2**20, "seconds": took,
                    "peak_rss_mib": pk.peak}

        async def big_prompts_case() -> dict:
            prompt = "word " * 200_000  # ~1 MB, far past any profile's context
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
            async with httpx.AsyncClient(base_url=sched, timeout=120) as c:
                base = await timed_requests(sched, model, time.monotonic() + 2.0, 0.2)
                raw = json.dumps(body).encode()  # encoded once: the client's own json.dumps is not timed
                t_burst = time.perf_counter()

                async def one() -> tuple[int, float]:
                    r = await c.post("/v1/chat/completions", content=raw,
                                     headers={"content-type": "application/json"})
                    return r.status_code, time.perf_counter() - t_burst

                big = [asyncio.create_task(one()) for _ in range(30)]
                await asyncio.sleep(0.05)
                with Peaks(pids) as pk:
                    lat = await timed_requests(sched, model, time.monotonic() + 3.0, 0.1)
                done = [await t for t in big]
            lat.sort()
            return {"baseline_p50_s": sorted(base)[len(base) // 2], "baseline_max_s": max(base),
                    "latency_p50_s": lat[len(lat) // 2], "latency_max_s": lat[-1], "requests": len(lat),
                    "big_statuses": sorted({code for code, _ in done}),
                    "big_all_answered_s": max(t for _, t in done), "peak_rss_mib": pk.peak}

        for name, case in (("headers", headers_case), ("slowloris", slowloris_case), ("largest", largest_case),
                           ("big_prompts", big_prompts_case)):
            if name not in wanted:
                continue
            results[name] = asyncio.run(case())
            print(f"{name}: " + json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                            for k, v in results[name].items() if k != "peak_rss_mib"}), flush=True)
            print("   peak RSS " + ", ".join(f"{n} {v:.0f} MiB" for n, v in results[name]["peak_rss_mib"].items()),
                  flush=True)
        ok = "slowloris" not in results or results["slowloris"]["latency_max_s"] < 0.2
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    results["idle_rss_mib"] = idle  # type: ignore[assignment]
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print("ok" if ok else "FAILED: a normal request took over 0.2 s or failed during the slowloris case")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
