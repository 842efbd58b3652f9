"""Herding with several stateless schedulers (issue 16): S scheduler replicas behind a
round-robin Service dispatch independently on a status that is Δ seconds stale
(`cluster.virtual.simulate_cluster(dispatch=[S policies], status_interval_s=Δ)`: every Δ
each instance's status is copied, as the Predictor's cached `/status` is shared by all
schedulers; between copies a scheduler knows only its own sends — its pending list).

    nice -n 10 .venv/bin/python benchmarks/herding.py --seeds 0,1,2 --out /tmp/herding.json

Fleet: `--instances` × Llama-2-7B/A30 sim profile, FCFS, the Astrolabe ShareGPT length
trace (Llama-2 token counts, prompt + output ≤ 4,096), Poisson arrivals at `--rate`,
**oracle** output lengths (the dispatcher sees true lengths: herding, not length error).
Arms: power_of_k k=2 and k=all (full fanout); S = 1, 2, 4 at Δ = `--intervals`; S = 1
at Δ = 0 (live state, today's simulation) as the reference; S = 4 without the pending
list (`count_pending` off). Per run: P99 / mean TTFT, mean E2E, the herding figures of
`ClusterResult.herding` (mean queue spread across instances at each decision, the mean
number of other schedulers' sends to the chosen instance it could not see) and the
per-instance request counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from rps_astro_cli.cluster.virtual import simulate_cluster
from rps_astro_cli.cluster.workload import poisson_workload, read_length_trace
from rps_astro_cli.data_paths import data_dir
from rps_astro_cli.dispatch import make_dispatch
from rps_astro_cli.sim.profile import load_profile
from rps_astro_cli.types import InstanceConfig


def one(args, lengths, k: str, s: int, interval: float, pending: bool, seed: int) -> dict:
    prof = load_profile("llama-2-7b-a30")
    reqs = poisson_workload(lengths, args.n, args.rate, 4096, np.random.default_rng([seed, 1]))
    pols = [make_dispatch("power_of_k", k=k) for _ in range(s)]
    res = simulate_cluster(reqs, args.instances, pols, prof, InstanceConfig.from_profile(prof), None,
                           np.random.default_rng([seed, 2]), status_interval_s=interval, count_pending=pending)
    ttft = np.array([r.first_token_s - r.arrival_s for r in res.records])
    e2e = np.array([r.finish_s - r.arrival_s for r in res.records])
    h = res.herding or {}
    return {"k": k, "schedulers": s, "status_interval_s": interval, "count_pending": pending, "seed": seed,
            "ttft_p99_s": float(np.percentile(ttft, 99)), "ttft_mean_s": float(ttft.mean()),
            "e2e_mean_s": float(e2e.mean()), "queue_spread_mean": h.get("queue_spread_mean"),
            "unseen_sends_mean": h.get("unseen_sends_mean"), "requests_per_instance": res.requests_per_instance,
            "wall_s": res.wall_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("-n", type=int, default=3000)
    ap.add_argument("--rate", type=float, default=7.5, help="req/s (4 × A30: ~8.5 req/s SLO capacity for k=2)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--intervals", default="0.25", help="status refresh Δ (s), comma-separated")
    ap.add_argument("--ks", default="2,all", help="power_of_k k values, comma-separated")
    ap.add_argument("--out", "--json", dest="out", type=Path, default=None,
                    help="write the arguments and every row here (JSON)")
    args = ap.parse_args()
    root = data_dir()
    if root is None:
        raise SystemExit("no data folder: set ASTRO_DATA_DIR (the Astrolabe length trace)")
    lengths = read_length_trace(root / "traces" / "astrolabe_sharegpt_val_10k_llama2.csv")
    arms = []
    for k in args.ks.split(","):
        arms.append((k, 1, 0.0, True))
        for iv in (float(x) for x in args.intervals.split(",")):
            arms += [(k, s, iv, True) for s in (1, 2, 4)] + [(k, 4, iv, False)]
    rows = []
    for seed in (int(x) for x in args.seeds.split(",")):
        for arm in arms:
            row = one(args, lengths, *arm, seed)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "requests_per_instance"}), flush=True)
    print("\n| k | S | Δ (s) | pending list | P99 TTFT s, median (min–max) | P99 TTFT / S=1 same Δ | mean TTFT s "
          "| mean E2E s | queue spread | unseen sends |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for arm in arms:
        rs = [r for r in rows if (r["k"], r["schedulers"], r["status_interval_s"], r["count_pending"]) == arm]
        base = [r for r in rows if (r["k"], r["schedulers"], r["status_interval_s"], r["count_pending"])
                == (arm[0], 1, arm[2], True)]
        ratio = statistics.median(a["ttft_p99_s"] / b["ttft_p99_s"] for a, b in zip(rs, base))
        p99 = [r["ttft_p99_s"] for r in rs]

        def med(key, rs=rs):
            return statistics.median(r[key] for r in rs)

        print(f"| {arm[0]} | {arm[1]} | {arm[2]:g} | {'on' if arm[3] else 'off'} | {statistics.median(p99):.2f} "
              f"({min(p99):.2f}–{max(p99):.2f}) | {ratio:.2f} | {med('ttft_mean_s'):.3f} | {med('e2e_mean_s'):.2f} "
              f"| {med('queue_spread_mean') if rs[0]['queue_spread_mean'] is not None else float('nan'):.2f} "
              f"| {med('unseen_sends_mean') if rs[0]['unseen_sends_mean'] is not None else float('nan'):.2f} |")
    if args.out:
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
