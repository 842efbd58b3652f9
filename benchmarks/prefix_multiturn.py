"""Prefix caching on multi-turn ShareGPT sessions (issue 14), virtual cluster.

4 × llama-2-7b-a30 (1056 KV blocks of 16 tokens each), `-w sharegpt --multi-turn`
(the shared 500-conversation sample; each turn's prompt is the whole history, sent a
2 s mean think time after the previous reply), Poisson session starts at RATE sessions/s,
several seeds; per policy: P99 / mean TTFT overall, P99 TTFT of turns ≥ 2 (the second
and later turns: index ≥ 1), the prefix-cache hit rate (hit tokens / queried tokens) and
preemptions. Policies run on the same workload and arrivals per seed (interleaved in one
process, as `astro bench` runs them). Lengths: the default length model's predictions
for power_of_k (say so beside the figure), or oracle with --oracle.

    .venv/bin/python benchmarks/prefix_multiturn.py --rate 6 --seeds 0,1,2 -n 600
    .venv/bin/python benchmarks/prefix_multiturn.py --rates 1,2,3,4 --seeds 0,1,2,3,4,5 --json sweep.json

The table gives, per rate, each policy's P99 TTFT per seed (median [min–max]), the
geo-mean over seeds of P99 / round_robin's P99 (3 decimals), and the P99 of all seeds'
TTFTs pooled (the SLO-capacity statistic of `benchmarks/dispatch_predicted.py`).

Arms of power_of_k, to measure each change alone: `power_of_k` (both on, the default),
`power_of_k/nopin` (`pin_cached=false`: k drawn uniformly), `power_of_k/nowait` (the
look-ahead credits only the candidate's own hit, not queued requests'), `power_of_k/base`
(both off: the build before them), or `power_of_k/NAME=VALUE+...` (policy parameters;
`nowait`; `rl=default`: the look-ahead's conditional remaining length), e.g.
`--policies round_robin,cache_aware,power_of_k,power_of_k/nopin,power_of_k/nowait,power_of_k/base`.

Virtual time is deterministic for a seed, so the figures do not depend on machine load.
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import numpy as np

from rps_astro_cli.bench.config import BenchConfig
from rps_astro_cli.bench.runner import run_bench
from rps_astro_cli.cluster import virtual as cluster_virtual

ARMS = {"nopin": ({"pin_cached": "false"}, True), "nowait": ({}, False), "base": ({"pin_cached": "false"}, False)}


def run_arm(arm: str, base_cfg: dict) -> list:
    """The bench runs of one policy arm (`name` or `name/variant`, see ARMS)."""
    name, _, variant = arm.partition("/")
    if variant in ARMS or not variant:
        params, waiting_hits = ARMS[variant] if variant else ({}, True)
    else:  # "NAME=VALUE+NAME=VALUE" policy parameters ("nowait"; "rl=X": --remaining-length X)
        parts = variant.split("+")
        waiting_hits = "nowait" not in parts
        params = dict(p.split("=", 1) for p in parts if p != "nowait")
    extra = {"remaining_length": params.pop("rl")} if "rl" in params else {}
    cfg = BenchConfig.flat(**base_cfg, **extra, policies=[name], **({"policy_params": params} if params else {}))
    orig = cluster_virtual.simulate_cluster
    if not waiting_hits:
        cluster_virtual.simulate_cluster = functools.partial(orig, waiting_hits=False)  # type: ignore[assignment]
    try:
        return run_bench(cfg).runs
    finally:
        cluster_virtual.simulate_cluster = orig  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=6.0, help="session starts per second")
    ap.add_argument("--rates", default=None, help="comma-separated session rates: a sweep (overrides --rate)")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("-n", type=int, default=600, help="turns (requests) per run")
    ap.add_argument("--policies", default="round_robin,cache_aware,session_affinity,power_of_k")
    ap.add_argument("--oracle", action="store_true", help="oracle output lengths for the look-ahead")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--json", default=None, help="write every per-seed figure to this file")
    a = ap.parse_args()
    pols = a.policies.split(",")
    rates = [float(r) for r in a.rates.split(",")] if a.rates else [a.rate]
    seeds = [int(s) for s in a.seeds.split(",")]
    out: dict[str, dict] = {}
    for rate in rates:
        rows: dict[str, list[dict[str, float]]] = {p: [] for p in pols}
        ttfts: dict[str, list[float]] = {p: [] for p in pols}
        for seed in seeds:
            base = dict(workload="sharegpt", multi_turn=True, num_requests=a.n, seed=seed,
                        max_total_tokens=4096, request_rate=rate,
                        virtual=True, instances=a.instances, oracle_lengths=a.oracle)
            for arm in pols:  # interleaved: every arm of a seed before the next seed
                for run in run_arm(arm, base):
                    o = run.metrics["overall"]
                    ok = [r for r in run.records if r.success and r.first_token_s is not None]
                    later = [r.first_token_s - r.sent_s for r in ok if not r.request_id.endswith("-t0")]
                    ttfts[arm] += [r.first_token_s - r.sent_s for r in ok]
                    rows[arm].append({
                        "seed": seed, "p99": o.ttft_s.p99, "mean": o.ttft_s.mean,
                        "p99_later": float(np.percentile(later, 99)),
                        "hit": o.prefix_cache_hit_rate or 0.0, "pre": float(run.extras.get("preemptions_total") or 0),
                        "makespan_s": float(run.extras.get("makespan_s") or 0.0)})
                    print(f"rate {rate:g} seed {seed} {arm}: P99 TTFT {o.ttft_s.p99:.3f} s, "
                          f"mean {o.ttft_s.mean:.3f} s, hit rate {o.prefix_cache_hit_rate:.3f}, "
                          f"preemptions {run.extras.get('preemptions_total')}",
                          flush=True)
        ref = rows.get("round_robin")
        print(f"\n{rate:g} sessions/s, seeds {a.seeds}:")
        print("| policy | P99 TTFT (s), median [min–max] over seeds | × round_robin (geo-mean) | P99 TTFT pooled (s) | "
              "mean TTFT (s) | P99 TTFT turns ≥ 2 (s) | hit rate | preemptions |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        out[f"{rate:g}"] = {}
        for p, rs in rows.items():
            p99 = [r["p99"] for r in rs]
            ratio = (math.exp(np.mean([math.log(r["p99"] / b["p99"]) for r, b in zip(rs, ref)]))
                     if ref else float("nan"))
            pooled = float(np.percentile(ttfts[p], 99))
            out[f"{rate:g}"][p] = {"runs": rs, "ratio_rr": ratio, "p99_pooled": pooled}
            print(f"| {p} | {np.median(p99):.3f} [{min(p99):.3f}–{max(p99):.3f}] | {ratio:.3f} | {pooled:.3f} | "
                  f"{np.median([r['mean'] for r in rs]):.3f} | {np.median([r['p99_later'] for r in rs]):.3f} | "
                  f"{np.median([r['hit'] for r in rs]):.3f} | {np.median([r['pre'] for r in rs]):.0f} |", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
