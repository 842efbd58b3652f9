"""Model mismatch (issue 31): engines that do not run the profile their Predictors are
given, with online calibration off and on, against the load-aware baselines.

    nice -n 10 .venv/bin/python benchmarks/calibration_mismatch.py [--seeds 5] [--json out.json]

Virtual cluster, held-out ShareGPT prompts with PREDICTED lengths (the workload of
`benchmarks/dispatch_predicted.py`: the tagger's test split, drawn per seed), 4
instances, FCFS. Each seed makes its own fleet of "hardware astro never profiled": every
instance's engine runs a copy of the nominal profile (`--profile`, default
llama-2-7b-a30) with prefill attention, decode attention, per-sequence cost and the
linear curve each scaled by its own factor drawn log-uniformly in [0.6, 1.7], and the
curve bent (× (1 + b·log2(knot)/log2(last knot)), b in [−0.3, 0.5]); the Predictors are
given the nominal profile. KV blocks and batch limits are the nominal ones.

Load: the mismatched fleet's SLO capacity (pooled P99 TTFT ≤ 10 s over 3 capacity
seeds, bisection) with llumnix and least_requests, the better of the two; the table runs
at `--loads` of it (default 0.9, 0.95).

Arms: llumnix, least_requests (no Predictor), and power_of_k (astro's default) with the
Predictors given each engine's TRUE profile (`matched`: the ceiling, what every earlier
figure measured), given the nominal one, fixed and always trusted (before issue 31:
`none`), fixed with
degradation (`off`: an instance whose model's recent error is over 20 % is compared by
load), and online calibration (`online`). Per arm: P99 TTFT and mean E2E (median over
seeds, min–max), the ratio to best(llumnix, least_requests) per seed (geometric mean),
and the Predictor's TTFT error: |predicted − served| / served of the chosen instance,
median over requests after the first 200 (`predictor_ttft_ape_p50_after_warmup`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from dispatch_predicted import _default_data, held_out_pool, workload

from rps_astro_cli.cluster.virtual import simulate_cluster
from rps_astro_cli.dispatch import make_dispatch
from rps_astro_cli.policies import make_policy
from rps_astro_cli.sim.profile import ExecutionProfile, load_profile
from rps_astro_cli.types import InstanceConfig

SLO_TTFT_S = 10.0
WARMUP = 200
ARMS = (("llumnix", None), ("least_requests", None), ("power_of_k", "matched"), ("power_of_k", "none"),
        ("power_of_k", "off"), ("power_of_k", "online"))


def mismatched(nominal: ExecutionProfile, rng: np.random.Generator) -> ExecutionProfile:
    """A copy of `nominal` with its terms scaled and its curve bent (module docstring)."""
    f = np.exp(rng.uniform(np.log(0.6), np.log(1.7), size=4))
    bend = rng.uniform(-0.3, 0.5)
    top = math.log2(nominal.token_knots[-1])
    tok = tuple(v * f[3] * (1 + bend * math.log2(k) / top) for k, v in zip(nominal.token_knots, nominal.token_s))
    return replace(nominal, profile_id=f"{nominal.profile_id}-mismatch", token_s=tok, base_s=nominal.base_s * f[3],
                   per_seq_s=nominal.per_seq_s * f[2], decode_attn_s_per_ctx_token=nominal.decode_attn_s_per_ctx_token
                   * f[1], prefill_attn_s_per_token_pair=nominal.prefill_attn_s_per_token_pair * f[0],
                   fit={"factors": {"prefill": f[0], "decode": f[1], "per_seq": f[2], "shape": f[3], "bend": bend}})


def run(reqs, fleet: list[ExecutionProfile], nominal: ExecutionProfile, policy: str, calibration: str | None,
        seed: int) -> dict[str, float]:
    icfg = InstanceConfig.from_profile(nominal)
    res = simulate_cluster(reqs, len(fleet), make_dispatch(policy), fleet, icfg, lambda: make_policy("fcfs"),
                           np.random.default_rng([seed, 11]),
                           predictor_latency=nominal if policy == "power_of_k" and calibration != "matched" else None,
                           calibration=None if calibration in ("none", "matched") else calibration)
    ttft = np.array([r.ttft_s for r in res.records])
    e2e = np.array([r.e2e_s for r in res.records])
    ape = [abs(r.predicted_ttft_s - r.ttft_s) / r.ttft_s for r in res.records[WARMUP:]
           if r.predicted_ttft_s is not None and r.ttft_s > 0]
    return {"p99_ttft_s": float(np.percentile(ttft, 99)), "mean_e2e_s": float(np.mean(e2e)),
            "ape_p50_after_warmup": float(np.median(ape)) if ape else float("nan"),
            "untrusted_share": float(np.mean([r.untrusted_predictors > 0 for r in res.records]))}


def capacity(pool, fleet, nominal, n: int, log) -> float:
    def ok(policy: str, rate: float) -> bool:
        ttfts: list[float] = []
        for s in range(3):
            res = simulate_cluster(workload(pool, n, rate, 1000 + s, "predicted"), len(fleet), make_dispatch(policy),
                                   fleet, InstanceConfig.from_profile(nominal), lambda: make_policy("fcfs"),
                                   np.random.default_rng([1000 + s, 11]))
            ttfts += [r.ttft_s for r in res.records]
        return float(np.percentile(ttfts, 99)) <= SLO_TTFT_S

    best = 0.0
    for policy in ("llumnix", "least_requests"):
        lo, hi = 1.0, 40.0
        while hi - lo > 0.1:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ok(policy, mid) else (lo, mid)
        log(f"    capacity {policy}: {lo:.2f} req/s")
        best = max(best, lo)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--loads", default="0.9,0.95")
    ap.add_argument("--profile", default="llama-2-7b-a30")
    ap.add_argument("--data", type=Path, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    nominal = load_profile(args.profile)
    pool = held_out_pool(args.data or _default_data())
    loads = [float(x) for x in args.loads.split(",")]
    out: dict[str, Any] = {"profile": args.profile, "requests": args.requests, "seeds": {}}
    for seed in range(args.seeds):
        rng = np.random.default_rng([seed, 31])
        fleet = [mismatched(nominal, rng) for _ in range(4)]
        print(f"seed {seed}: factors " + "; ".join(
            " ".join(f"{k[0]}{v:.2f}" for k, v in p.fit["factors"].items()) for p in fleet), flush=True)
        cap = capacity(pool, fleet, nominal, args.requests, print)
        out["seeds"][seed] = {"capacity_rps": cap, "fleet": [p.fit["factors"] for p in fleet], "loads": {}}
        for load in loads:
            reqs = workload(pool, args.requests, load * cap, seed, "predicted")
            row = {f"{p}/{c}" if c else p: run(reqs, fleet, nominal, p, c, seed) for p, c in ARMS}
            base = min(row["llumnix"]["p99_ttft_s"], row["least_requests"]["p99_ttft_s"])
            base_e2e = min(row["llumnix"]["mean_e2e_s"], row["least_requests"]["mean_e2e_s"])
            for v in row.values():
                v["p99_ratio"] = v["p99_ttft_s"] / base
                v["e2e_ratio"] = v["mean_e2e_s"] / base_e2e
            out["seeds"][seed]["loads"][load] = row
            print(f"  load {load:.2f} ({load * cap:.2f} req/s): " + " | ".join(
                f"{k} p99×{v['p99_ratio']:.2f} e2e×{v['e2e_ratio']:.3f}"
                + (f" ape {v['ape_p50_after_warmup']:.1%}" if not math.isnan(v["ape_p50_after_warmup"]) else "")
                for k, v in row.items()), flush=True)
    print("\nsummary (geometric mean over seeds of the ratio to best(llumnix, least_requests); ape: median)")
    for load in loads:
        for name in (f"{p}/{c}" if c else p for p, c in ARMS):
            rows = [out["seeds"][s]["loads"][load][name] for s in out["seeds"]]
            g = math.exp(np.mean([math.log(r["p99_ratio"]) for r in rows]))
            ge = math.exp(np.mean([math.log(r["e2e_ratio"]) for r in rows]))
            apes = [r["ape_p50_after_warmup"] for r in rows if not math.isnan(r["ape_p50_after_warmup"])]
            print(f"  load {load:.2f} {name:22s} P99 TTFT ×{g:.3f} ({min(r['p99_ratio'] for r in rows):.2f}–"
                  f"{max(r['p99_ratio'] for r in rows):.2f})  mean E2E ×{ge:.3f}"
                  + (f"  ape p50 {np.median(apes):.1%}" if apes else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
