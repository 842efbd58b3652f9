"""Fleet scale (issue 32): the dispatch decision's cost and the held-back dispatch win at
4 / 16 / 64 / 256 instances, one command:

    nice -n 10 .venv/bin/python benchmarks/fleet_scale.py                       # the table
    nice -n 10 .venv/bin/python benchmarks/fleet_scale.py --sizes 16,64 --seeds 3 --json out.json

Virtual cluster (`cluster.virtual.simulate_cluster`, every look-ahead in this process),
N × one execution profile (default llama-2-7b-a30), FCFS in-instance, Poisson arrivals,
PREDICTED lengths on the length model's held-back ShareGPT split (the workload of
`dispatch_predicted.py`). Per size the fleet's SLO capacity (P99 TTFT ≤ 10 s) is searched
with `llumnix` on its own seeds (bisection to `--capacity-tol` of the rate), and every arm
runs at `--loads` of it on the same request lists (arms rotated per seed).

Arms: `least_requests` and `llumnix` (the load-aware baselines); `auto` — astro's default
`power_of_k` (k="auto": full fanout up to 8 instances, else the 8 least loaded);
`all` — the same with k="all" (every Predictor asked; skipped above `--all-max`
instances, where it takes minutes per run); `k8` — a uniform draw of 8 (what "auto"
narrows instead of, to show the load scan's worth).

Per arm and size: P99 TTFT (median over seeds), its ratio to the better baseline of the
same seed (geometric mean over seeds), the decision's wall time per request (p50 / p99,
µs, the look-aheads included) and the look-aheads (Predictor calls) per request.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import dispatch_predicted as _dp  # benchmarks/ is on sys.path when a script runs
import numpy as np

from rps_astro_cli.cluster.virtual import simulate_cluster
from rps_astro_cli.dispatch import make_dispatch
from rps_astro_cli.policies import make_policy
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.profile import load_profile
from rps_astro_cli.types import InstanceConfig

SLO_TTFT_S, _default_data, held_out_pool, workload = _dp.SLO_TTFT_S, _dp._default_data, _dp.held_out_pool, _dp.workload


ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "least_requests": ("least_requests", {}),
    "llumnix": ("llumnix", {}),
    "auto": ("power_of_k", {}),
    "all": ("power_of_k", {"k": "all"}),
    "k8": ("power_of_k", {"k": 8}),
}
BASELINES = ("least_requests", "llumnix")


class Counting:
    """Wraps a policy's sampler to count the candidates handed to the look-ahead (one
    Predictor call each)."""

    def __init__(self, inner: Any, asks: bool) -> None:
        self.inner, self.asks = inner, asks
        self.reads = inner.reads
        self.lookaheads = 0

    def __call__(self, pool, rng, by_index=None):
        cands = self.inner(pool, rng, by_index)
        self.lookaheads += len(cands) if self.asks else 0
        return cands


def run(arm: str, reqs, n: int, lat, icfg, seed: int) -> dict[str, float]:
    name, params = ARMS[arm]
    pol = make_dispatch(name, **params)
    counter = pol.sampler = Counting(pol.sampler, "predictions" in pol.inputs)
    res = simulate_cluster(reqs, n, pol, lat, icfg, lambda: make_policy("fcfs"), np.random.default_rng([seed, 11]))
    ttft = np.array([r.ttft_s if r.first_token_s is not None else math.inf for r in res.records])
    dec = np.array([r.decide_us for r in res.records])
    return {"p99_ttft_s": float(np.percentile(ttft, 99)), "decide_us_p50": float(np.percentile(dec, 50)),
            "decide_us_p99": float(np.percentile(dec, 99)), "lookaheads_per_request": counter.lookaheads / len(reqs),
            "wall_s": float(res.wall_s)}


def capacity(pool, n: int, per_inst_guess: float, requests: int, tol: float, seeds: int, lat, icfg, log) -> float:
    """Highest rate whose pooled P99 TTFT (llumnix, seeds 1000…) is ≤ SLO_TTFT_S."""
    def ok(rate: float) -> bool:
        ttfts: list[float] = []
        for s in range(seeds):
            reqs = workload(pool, requests, rate, 1000 + s, "predicted")
            res = simulate_cluster(reqs, n, make_dispatch("llumnix"), lat, icfg, lambda: make_policy("fcfs"),
                                   np.random.default_rng([1000 + s, 11]))
            ttfts += [r.ttft_s if r.first_token_s is not None else math.inf for r in res.records]
        v = float(np.percentile(ttfts, 99))
        log(f"  {n} instances: {rate:.2f} req/s → P99 TTFT {v:.2f} s")
        return v <= SLO_TTFT_S

    lo, hi = 0.6 * per_inst_guess * n, 1.4 * per_inst_guess * n
    while not ok(lo):
        lo, hi = lo * 0.7, lo
    while ok(hi):
        lo, hi = hi, hi * 1.3
    while hi - lo > tol * lo:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4,16,64,256")
    ap.add_argument("--loads", default="0.9,0.95")
    ap.add_argument("--arms", default="least_requests,llumnix,auto,all,k8")
    ap.add_argument("--all-max", type=int, default=64, help="skip the k=all arm above this many instances")
    ap.add_argument("--requests-per-instance", type=int, default=250)
    ap.add_argument("--max-requests", type=int, default=32000, help="cap on requests per run (large fleets)")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--capacity-seeds", type=int, default=1)
    ap.add_argument("--capacity-tol", type=float, default=0.03, help="relative")
    ap.add_argument("--per-instance-guess", type=float, default=2.0, help="req/s per instance to start the search")
    ap.add_argument("--capacity-per-instance", type=float, default=None,
                    help="skip the search: the fleet's capacity is this many req/s per instance")
    ap.add_argument("--profile", default="llama-2-7b-a30")
    ap.add_argument("--data", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",")]
    for a in arms:
        if a not in ARMS:
            ap.error(f"--arms: unknown arm {a!r}; known: {', '.join(ARMS)}")
    for b in BASELINES:
        if b not in arms:
            arms.insert(0, b)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    data = args.data or _default_data()
    if not data.is_file():
        ap.error(f"--data: no such file {data}; pass the ShareGPT sample (or set ASTRO_DATA_DIR)")
    pool = held_out_pool(data)
    prof = load_profile(args.profile)
    lat, icfg = LatencyModel(prof), InstanceConfig.from_profile(prof)
    out: dict[str, Any] = {"profile": args.profile, "lengths": "predicted", "engines": "virtual (sim)", "sizes": {}}
    rows = []
    t0 = time.time()
    for n in [int(x) for x in args.sizes.split(",")]:
        nreq = min(args.requests_per_instance * n, args.max_requests)
        cap = (args.capacity_per_instance * n if args.capacity_per_instance is not None else
               capacity(pool, n, args.per_instance_guess, nreq, args.capacity_tol, args.capacity_seeds, lat, icfg, log))
        out["sizes"][str(n)] = {"capacity_rps": cap, "requests": nreq, "loads": {}}
        for load in [float(x) for x in args.loads.split(",")]:
            here = [a for a in arms if not (a == "all" and n > args.all_max)]
            per: dict[str, list[dict[str, float]]] = {a: [] for a in here}
            for s in range(args.seeds):
                reqs = workload(pool, nreq, load * cap, s, "predicted")
                for a in here[s % len(here):] + here[:s % len(here)]:
                    per[a].append(run(a, reqs, n, lat, icfg, s))
                log(f"  {n} inst load {load} seed {s} ({time.time() - t0:.0f} s): "
                    + ", ".join(f"{a} {per[a][-1]['p99_ttft_s']:.2f}" for a in here))
            out["sizes"][str(n)]["loads"][str(load)] = per
            if args.json:
                args.json.write_text(json.dumps(out, indent=1))
            best = [min(per[b][s]["p99_ttft_s"] for b in BASELINES) for s in range(args.seeds)]
            for a in here:
                ratio = math.exp(np.mean([math.log(per[a][s]["p99_ttft_s"] / best[s]) for s in range(args.seeds)]))
                rows.append((n, load, a, float(np.median([r["p99_ttft_s"] for r in per[a]])), ratio,
                             float(np.median([r["decide_us_p50"] for r in per[a]])),
                             float(np.median([r["decide_us_p99"] for r in per[a]])),
                             float(np.mean([r["lookaheads_per_request"] for r in per[a]]))))
    print(f"{'inst':>5} {'load':>5} {'arm':<15} {'P99 TTFT s':>10} {'× best base':>11} "
          f"{'decide p50 µs':>13} {'p99 µs':>8} {'look-aheads':>11}")
    for n, load, a, p99, ratio, d50, d99, la in rows:
        print(f"{n:>5} {load:>5.2f} {a:<15} {p99:>10.2f} {ratio:>11.2f} {d50:>13.0f} {d99:>8.0f} {la:>11.1f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
