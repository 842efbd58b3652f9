"""Scheduler overhead and throughput through ONE scheduler process (issue 3 acceptance).

Starts a cluster with `ClusterSupervisor` (N fast sim engines + N Predictors + tagger +
scheduler, all separate processes on loopback), then:

1. Overhead at a fixed rate: Poisson arrivals at `--rate` req/s (default 200) for
   `--seconds`, non-streaming completions with 2 output tokens. Overhead per request is
   what the scheduler itself adds, excluding engine time (see `services/scheduler/`):
   arrival → body handed to the engine connection (body read, tag RPC, parse, dispatch
   incl. the k predict RPCs, serialization) + engine response → response handed to the
   server. Read from the scheduler's `/decisions` (`overhead_us`). Also printed: the
   decision time alone (`decide_us`) and the client-observed latency.
2. Maximum sustained rate: closed loop, `--concurrency` requests in flight from
   `--client-procs` load-generator processes for `--seconds`; completed req/s.

Goals on the 2-core dev machine (issue 3): p99 overhead ≤ 5 ms at 200 req/s with k=2;
≥ 1,000 req/s sustained. Load generator, engines and predictors share those 2 cores with
the scheduler, so the figures are a lower bound for a scheduler on its own core.

    .venv/bin/python benchmarks/dispatch_overhead.py [--policy power_of_k --k 2] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import tempfile
import time

import httpx
import numpy as np

from rps_astro_cli.services.cluster import ClusterSupervisor
from rps_astro_cli.services.config import parse_config
from rps_astro_cli.services.rpc import HostPool, RpcError

BODY = {"prompt": "Summarize the plot of a short story about a lighthouse keeper.", "max_tokens": 2}
BODY_BYTES = json.dumps(BODY).encode()


async def _open_loop(url: str, rate: float, seconds: float, seed: int) -> list[float]:
    """Poisson arrivals at `rate` req/s for `seconds`; client latency of each 200 (s)."""
    rng = np.random.default_rng(seed)
    lat: list[float] = []
    pool = HostPool(url)

    async def one() -> None:
        t0 = time.perf_counter()
        status, _ = await pool.post_json("/v1/completions", BODY_BYTES)
        if status == 200:
            lat.append(time.perf_counter() - t0)

    tasks = []
    t_end = time.perf_counter() + seconds
    t_next = time.perf_counter()
    while t_next < t_end:
        delay = t_next - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
        t_next += rng.exponential(1.0 / rate)
    await asyncio.gather(*tasks, return_exceptions=True)
    pool.close()
    return lat


async def _closed_loop(url: str, concurrency: int, seconds: float) -> tuple[int, int]:
    """`concurrency` workers each sending back-to-back requests; (ok, failed)."""
    ok = err = 0
    pool = HostPool(url)
    t_end = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal ok, err
        while time.perf_counter() < t_end:
            try:
                status, _ = await pool.post_json("/v1/completions", BODY_BYTES)
                ok += status == 200
                err += status != 200
            except RpcError:
                err += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    pool.close()
    return ok, err


def _closed_proc(url: str, concurrency: int, seconds: float, q) -> None:
    import uvloop

    q.put(uvloop.run(_closed_loop(url, concurrency, seconds)))


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` (Linux /proc)."""
    import os

    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--policy", default="power_of_k")
    ap.add_argument("--k", default="2")
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--time-scale", type=float, default=0.01, help="sim engines' wall s per engine s")
    ap.add_argument("--length-model", default="baseline",
                    help="tagger model (default: the baseline, so the figure is the scheduler's, not the tagger's)")
    ap.add_argument("--tagger-in-process", action="store_true",
                    help="tag inside the scheduler (recipe tagger.enabled: false) instead of the tagger service")
    ap.add_argument("--json", nargs="?", const="-", default=None,
                    help="print the figures as one JSON object; with PATH: write them there and print the table")
    a = ap.parse_args()

    cfg = parse_config({"name": "dispatch-overhead", "instances": a.instances, "restart_crashed": 0,
                        "engine": {"time_scale": a.time_scale}, "tagger": {"length_model": a.length_model, "enabled": not a.tagger_in_process},
                        "scheduler": {"policy": a.policy, "k": a.k, "decisions_kept": 100_000}})
    with tempfile.TemporaryDirectory() as d, ClusterSupervisor(cfg, d, report=lambda s: print(s, file=sys.stderr)) as sup:
        url = sup.scheduler.url
        import uvloop

        uvloop.run(_open_loop(url, 50, 1.0, 1))  # warm connections and memos
        n0 = len(httpx.get(url + "/decisions?n=100000").json())
        c0 = _cpu_s(sup.scheduler.pid)
        lat = uvloop.run(_open_loop(url, a.rate, a.seconds, 0))
        sched_cpu_ms = (_cpu_s(sup.scheduler.pid) - c0) * 1000
        decs = httpx.get(url + "/decisions?n=100000").json()[n0:]
        over_ms = [d["overhead_us"] / 1000 for d in decs if d.get("outcome") == "ok"]
        decide_ms = [d["decide_us"] / 1000 for d in decs if d.get("outcome") == "ok"]
        tag_ms = [d["tag_wait_us"] / 1000 for d in decs if d.get("outcome") == "ok"]
        m = httpx.get(url + "/metrics").text
        rpcs = sum(float(line.rsplit(" ", 1)[1]) for line in m.splitlines() if line.startswith("astro:predict_rpcs_total"))
        q = mp.get_context("spawn").Queue()
        per = max(1, a.concurrency // a.client_procs)
        procs = [mp.get_context("spawn").Process(target=_closed_proc, args=(url, per, a.seconds, q))
                 for _ in range(a.client_procs)]
        for p in procs:
            p.start()
        got = [q.get() for _ in procs]
        for p in procs:
            p.join()
        ok = sum(g[0] for g in got)
        err = sum(g[1] for g in got)
    res = {
        "policy": a.policy, "k": a.k, "instances": a.instances, "rate_req_s": a.rate,
        "requests_measured": len(over_ms),
        "overhead_p50_ms": pct(over_ms, 50), "overhead_p99_ms": pct(over_ms, 99),
        "decide_p50_ms": pct(decide_ms, 50), "decide_p99_ms": pct(decide_ms, 99),
        "tag_wait_p50_ms": pct(tag_ms, 50), "tag_wait_p99_ms": pct(tag_ms, 99),
        "client_latency_p50_ms": pct([x * 1000 for x in lat], 50),
        "client_latency_p99_ms": pct([x * 1000 for x in lat], 99),
        "predict_rpcs_total": rpcs,
        "scheduler_cpu_ms_per_request": sched_cpu_ms / max(1, len(over_ms)),
        "max_sustained_req_s": ok / a.seconds, "closed_loop_errors": err, "concurrency": a.concurrency,
    }
    if a.json and a.json != "-":
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.json == "-":
        print(json.dumps(res))
    else:
        print(f"dispatch overhead — policy {a.policy} k={a.k}, {a.instances} sim engines (time scale {a.time_scale})")
        print(f"  at {a.rate:.0f} req/s for {a.seconds:.0f} s ({len(over_ms)} requests):")
        print(f"    scheduler overhead p50 {res['overhead_p50_ms']:.2f} ms   p99 {res['overhead_p99_ms']:.2f} ms"
              f"   (goal p99 <= 5 ms)")
        print(f"    of which decision   p50 {res['decide_p50_ms']:.2f} ms   p99 {res['decide_p99_ms']:.2f} ms")
        print(f"    of which tag wait   p50 {res['tag_wait_p50_ms']:.2f} ms   p99 {res['tag_wait_p99_ms']:.2f} ms")
        print(f"    scheduler CPU       {res['scheduler_cpu_ms_per_request']:.2f} ms per request "
              f"(=> ~{1000 / max(res['scheduler_cpu_ms_per_request'], 1e-9):.0f} req/s on one free core)")
        print(f"    client latency      p50 {res['client_latency_p50_ms']:.2f} ms   p99 {res['client_latency_p99_ms']:.2f} ms")
        print(f"  max sustained: {res['max_sustained_req_s']:.0f} req/s (closed loop, {a.concurrency} in flight, "
              f"{err} errors; goal >= 1000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
