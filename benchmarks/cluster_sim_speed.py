"""Virtual-cluster speed: wall seconds to simulate 12 instances × 10,000 requests from
the Astrolabe ShareGPT/Llama-2 length trace
($ASTRO_DATA_DIR/traces/astrolabe_sharegpt_val_10k_llama2.csv) at 30 req/s Poisson
arrivals, `llama-2-7b-a30` profile, FCFS instances, oracle lengths.

Goal (issue 2): ≤ 20 s wall on one core for round_robin. Also runs power_of_k (k=2,
jump look-ahead per candidate) when that policy is registered. Prints wall and process
CPU seconds (the machine may be shared).

    .venv/bin/python benchmarks/cluster_sim_speed.py [--requests 10000] [--rate 30]
        [--instances 12] [--policies round_robin,power_of_k] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from rps_astro_cli.cluster import TimedRequest, simulate_cluster
from rps_astro_cli.data_paths import data_dir
from rps_astro_cli.dispatch import DISPATCH_POLICIES, make_dispatch
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.profile import load_profile
from rps_astro_cli.types import InstanceConfig


def trace_requests(n: int, rate: float, max_len: int, rng: np.random.Generator) -> list[TimedRequest]:
    path = data_dir() / "traces" / "astrolabe_sharegpt_val_10k_llama2.csv"
    d = np.loadtxt(path, delimiter=",", skiprows=1, usecols=(0, 1), dtype=np.int64)
    d = d[(d[:, 0] > 0) & (d[:, 1] > 0) & (d[:, 0] + d[:, 1] <= max_len)]
    rows = d[np.arange(n) % len(d)]
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n))
    return [TimedRequest(f"r{i}", float(arrivals[i]), int(p), int(o)) for i, (p, o) in enumerate(rows)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=30.0)
    ap.add_argument("--instances", type=int, default=12)
    ap.add_argument("--policies", default="round_robin,power_of_k")
    ap.add_argument("--profile", default="llama-2-7b-a30")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the printed figures here")
    args = ap.parse_args()
    prof = load_profile(args.profile)
    cfg = InstanceConfig.from_profile(prof)
    rows: dict[str, dict[str, float]] = {}
    reqs = trace_requests(args.requests, args.rate, cfg.max_model_len, np.random.default_rng(args.seed))
    print(f"{args.instances} instances × {len(reqs)} requests at {args.rate} req/s "
          f"({reqs[-1].arrival_s:.0f} s of arrivals), profile {prof.profile_id}")
    for name in args.policies.split(","):
        if name not in DISPATCH_POLICIES._items:
            print(f"{name}: not registered, skipped")
            continue
        c0 = time.process_time()
        res = simulate_cluster(reqs, args.instances, make_dispatch(name), LatencyModel(prof), cfg,
                               None, np.random.default_rng(args.seed))
        cpu_s = time.process_time() - c0
        ttft = np.array([r.ttft_s for r in res.records])
        e2e = np.array([r.e2e_s for r in res.records])
        dec = np.array([r.decide_us for r in res.records])
        print(f"{name:>12}: wall {res.wall_s:6.2f} s, CPU {cpu_s:6.2f} s (goal ≤ 20 s for round_robin) | "
              f"steps {sum(res.steps_per_instance)} | preemptions {res.num_preemptions} | "
              f"mean TTFT {ttft.mean():.3f} s, P99 TTFT {np.percentile(ttft, 99):.3f} s, "
              f"mean E2E {e2e.mean():.2f} s | decision median {np.median(dec):.0f} µs", flush=True)
        rows[name] = {"wall_s": res.wall_s, "cpu_s": cpu_s, "steps": sum(res.steps_per_instance),
                      "preemptions": res.num_preemptions, "ttft_mean_s": float(ttft.mean()),
                      "ttft_p99_s": float(np.percentile(ttft, 99)), "e2e_mean_s": float(e2e.mean()),
                      "decide_median_us": float(np.median(dec))}
    if args.json:
        out = {"instances": args.instances, "requests": len(reqs), "rate": args.rate, "profile": prof.profile_id,
               "seed": args.seed, "policies": rows}
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
