"""Sim engine keeping up: N concurrent streaming requests against `astro serve engine`
(a subprocess pinned to one CPU core with `taskset` when available) in real time.

Every request has the same prompt (P tokens) and output (O tokens, ignore_eos), all sent at
once. The reference is the instance model itself run offline on the same batch: its
makespan (sum of step durations) is what a perfect wall-clock engine would take. Prints,
per N: wall makespan, model makespan, their ratio (1.00 = the loop keeps up exactly; the
HTTP arrival spread adds a few ms), the engine's late steps (delivered > 5 ms after their
scheduled end) and worst lag from its `/metrics`, the server's CPU seconds and µs of
server CPU per streamed token (the loop keeps up while that × tokens/s stays under one
core; on a shared machine a ratio > 1 with server CPU < wall means contention), and
whether every stream got exactly O tokens with exact usage.

    .venv/bin/python benchmarks/sim_engine_streams.py [--streams 64 128] [--prompt 200] [--output 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from rps_astro_cli.sim.fcfs import FCFSPolicy
from rps_astro_cli.sim.instance import InstanceSim
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.profile import load_profile
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.types import InstanceConfig


def model_makespan_s(profile_id: str, n: int, prompt: int, output: int, **overrides) -> float:
    """Seconds the instance model takes for n identical requests all queued at t = 0."""
    prof = load_profile(profile_id)
    inst = InstanceSim(InstanceConfig.from_profile(prof, **overrides), LatencyModel(prof), FCFSPolicy())
    for i in range(n):
        inst.add(SimRequest(str(i), 0.0, prompt, output))
    t = 0.0
    while inst.has_work:
        t += inst.step(t).duration_s
    return t


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


async def one(client: httpx.AsyncClient, url: str, prompt: int, output: int) -> tuple[int, dict]:
    body = {"prompt": "abcd " * prompt, "max_tokens": output, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    n, usage = 0, {}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if d["choices"] and d["choices"][0]["text"]:
                n += 1
            if d.get("usage"):
                usage = d["usage"]
    return n, usage


async def run_batch(url: str, n: int, prompt: int, output: int):
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        t0 = time.monotonic()
        res = await asyncio.gather(*(one(c, url, prompt, output) for _ in range(n)))
        return time.monotonic() - t0, res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--prompt", type=int, default=200)
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--profile", default="llama-2-7b-a30")
    ap.add_argument("--json", type=Path, default=None, help="write the printed figures (one row per stream count) here")
    args = ap.parse_args()
    rows: list[dict] = []
    print(f"profile {args.profile}, prompt {args.prompt} tokens, output {args.output} tokens, "
          f"server {'pinned to core 0' if shutil.which('taskset') else 'unpinned'}")
    print(f"{'streams':>7} {'wall_s':>8} {'model_s':>8} {'ratio':>6} {'late/steps':>12} "
          f"{'max_lag_ms':>10} {'srv_cpu_s':>9} {'us/token':>8} {'exact':>5}")
    for n in args.streams:
        with tempfile.TemporaryDirectory() as td:
            ready = Path(td) / "ready"
            cmd = [sys.executable, "-m", "rps_astro_cli.cli.main", "serve", "engine", "--profile",
                   args.profile, "--port", "0", "--ready-file", str(ready),
                   "--max-num-seqs", str(max(n, 48)), "--num-gpu-blocks", "100000"]
            if shutil.which("taskset"):
                cmd = ["taskset", "-c", "0", *cmd]
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                    env=dict(os.environ))
            try:
                deadline = time.monotonic() + 60
                while not (ready.exists() and ready.read_text().strip()):
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit("engine did not start")
                    time.sleep(0.05)
                url = ready.read_text().strip()
                cpu0 = cpu_s(proc.pid)
                wall, res = asyncio.run(run_batch(url, n, args.prompt, args.output))
                cpu = cpu_s(proc.pid) - cpu0
                m = httpx.get(url + "/metrics").text
            finally:
                proc.terminate()
                proc.wait(timeout=15)
        t = model_makespan_s(args.profile, n, args.prompt, args.output,
                             max_num_seqs=max(n, 48), num_gpu_blocks=100000)
        exact = all(k == args.output and u.get("completion_tokens") == args.output
                    and u.get("prompt_tokens") == args.prompt for k, u in res)
        late, steps = metric(m, "astro:engine_steps_late_total"), metric(m, "astro:engine_steps_total")
        lag_ms = metric(m, "astro:engine_lag_seconds_max") * 1000
        print(f"{n:>7} {wall:>8.2f} {t:>8.2f} {wall / t:>6.2f} {int(late):>5}/{int(steps):<6} "
              f"{lag_ms:>10.1f} {cpu:>9.2f} {cpu / (n * args.output) * 1e6:>8.1f} {str(exact):>5}")
        rows.append({"streams": n, "wall_s": wall, "model_s": t, "ratio": wall / t, "late_steps": int(late),
                     "steps": int(steps), "max_lag_ms": lag_ms, "server_cpu_s": cpu,
                     "server_cpu_us_per_token": cpu / (n * args.output) * 1e6, "exact": exact})
    if args.json:
        out = {"profile": args.profile, "prompt": args.prompt, "output": args.output,
               "pinned": bool(shutil.which("taskset")), "rows": rows}
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
