"""Scheduler CPU per relayed SSE event, this checkout against another one, same engine.

One sim engine (`astro serve engine --time-scale 0.05`: steps of ~1–2 ms, so streams are
fast) serves two schedulers started side by side, `--policy round_robin` (no Predictor
or status traffic: what is left is the front door's own work), each from its checkout's
`src` (`PYTHONPATH`). Each run sends `--streams` concurrent streaming completions of
`--tokens` tokens (`ignore_eos`) through one scheduler and reads that process's CPU time
(utime + stime from /proc) before and after; µs per relayed `data:` event includes the
per-request work (parse, in-process tag, dispatch) spread over its events. Arms alternate
and swap order every repeat; the summary is each arm's median and the ratio of medians.

    .venv/bin/python benchmarks/archive/relay_cpu_ab.py --base /work/main/src [--repeats 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def cpu_s(pid: int) -> float:
    """Process CPU seconds (user + system) from /proc."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def start(args: list[str], env: dict, ready: Path, wait_s: float = 180.0) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "rps_astro_cli.cli.main", "serve", *args, "--port", "0",
                          "--ready-file", str(ready)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t_end = time.monotonic() + wait_s
    while time.monotonic() < t_end:
        if p.poll() is not None:
            raise SystemExit(f"`astro serve {args[0]}` exited with {p.returncode}")
        if ready.exists() and ready.read_text().strip():
            return p, ready.read_text().strip()
        time.sleep(0.1)
    p.kill()
    raise SystemExit(f"`astro serve {args[0]}` not ready after {wait_s:.0f} s")


async def load(url: str, streams: int, tokens: int) -> int:
    """`streams` concurrent streaming completions through `url`; the `data:` events read."""
    async with httpx.AsyncClient(timeout=120) as c:
        async def one(i: int) -> int:
            body = {"model": "meta-llama/Llama-2-7b-hf", "prompt": f"hello {i} world", "max_tokens": tokens,
                    "ignore_eos": True, "stream": True}
            n = 0
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    n += line.startswith("data:")
            return n
        return sum(await asyncio.gather(*(one(i) for i in range(streams))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", required=True, help="the other checkout's src folder")
    ap.add_argument("--new", default=str(Path(__file__).resolve().parents[2] / "src"), help="this checkout's src")
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--json", type=Path, default=None, help="write every repeat's µs per event and the ratio here")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="relay-ab-"))
    env = dict(os.environ, ASTRO_INTERNAL_TOKEN=os.environ.get("ASTRO_INTERNAL_TOKEN", "relay-ab"))
    procs = []
    try:
        eng, eurl = start(["engine", "--time-scale", "0.05"], dict(env, PYTHONPATH=a.new), tmp / "engine")
        procs.append(eng)
        arms = {}
        for name, src in (("base", a.base), ("new", a.new)):
            p, url = start(["scheduler", "--engine", eurl, "--policy", "round_robin"], dict(env, PYTHONPATH=src),
                           tmp / name)
            procs.append(p)
            arms[name] = (p, url)
        res: dict[str, list[float]] = {"base": [], "new": []}
        for rep in range(a.repeats):
            for name in ("base", "new") if rep % 2 == 0 else ("new", "base"):
                p, url = arms[name]
                c0 = cpu_s(p.pid)
                events = asyncio.run(load(url, a.streams, a.tokens))
                res[name].append((cpu_s(p.pid) - c0) / max(1, events) * 1e6)
                print(f"repeat {rep} {name}: {events} events, scheduler CPU {res[name][-1]:.1f} µs/event", flush=True)
        for name, v in res.items():
            print(f"{name}: median {statistics.median(v):.1f} µs/event {[round(x, 1) for x in v]}")
        print(f"ratio new/base {statistics.median(res['new']) / statistics.median(res['base']):.3f}")
        if a.json:
            out = {"base": a.base, "new": a.new, "streams": a.streams, "tokens": a.tokens,
                   "scheduler_cpu_us_per_event": res,
                   "ratio_new_over_base": statistics.median(res["new"]) / statistics.median(res["base"])}
            a.json.write_text(json.dumps(out, indent=1) + "\n")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
