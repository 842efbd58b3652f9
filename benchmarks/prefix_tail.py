"""Where power_of_k's multi-turn P99 TTFT comes from (issue 14): one seed, one rate.

Runs `benchmarks/prefix_multiturn.py`'s workload (4 × llama-2-7b-a30, ShareGPT multi-turn,
virtual) for the given arms and logs every dispatch decision of the virtual cluster (the
loads, the KV gate's pool, the candidates, the look-ahead's TTFT per candidate, the
choice). For every later turn (turn ≥ 2) whose prompt is cached somewhere, it says what
happened to its *cache instance* (the one holding the longest cached prefix):

- ``chosen``: the turn went there;
- ``gated``: the KV headroom gate dropped it from the pool;
- ``predicted_slower``: a candidate, predicted more than the tie band slower than the best;
- ``tie_lost``: within the tie band, lost on the Llumnix- load tie-break (or at random);

and for the top 1 % of TTFTs (the P99's tail): their turn, category, predicted vs served
TTFT, cached tokens, instance, preemptions. Virtual time: machine load changes nothing.

    .venv/bin/python benchmarks/prefix_tail.py --rate 3.5 --seed 0 --arms power_of_k --json /tmp/prefix_tail.json
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np
from prefix_multiturn import run_arm  # benchmarks/ is on sys.path when a script runs

from rps_astro_cli.cluster import virtual as cv


def run_logged(arm: str, base: dict) -> tuple[list[dict], dict[str, object]]:
    """One arm's bench run with the virtual cluster's decisions logged in dispatch order
    (each paired with the request id of the record made right after it)."""
    log: list[dict] = []
    orig_decide, orig_record = cv.decide, cv.ClusterRecord
    results: dict[str, object] = {}

    def decide(policy, loads, rng, predict, *rest):
        pool = policy.filter(loads)
        dec = orig_decide(policy, loads, rng, predict, *rest)
        log.append({"hits": {ld.index: ld.prefix_hit_tokens or 0 for ld in loads},
                    "pool": list(pool), "cands": list(dec.candidates), "choice": dec.choice,
                    "reason": dec.reason, "preds": dict(dec.predictions),
                    "tol": getattr(policy, "tie_tolerance_s", 0.0)})
        return dec

    def record(*a, **kw):
        rec = orig_record(*a, **kw)
        log[-1]["id"] = rec.request_id
        results[rec.request_id] = rec
        return rec

    cv.decide, cv.ClusterRecord = decide, record  # type: ignore[assignment]
    try:
        run_arm(arm, base)
    finally:
        cv.decide, cv.ClusterRecord = orig_decide, orig_record  # type: ignore[assignment]
    return log, results


def categorize(d: dict) -> str | None:
    """What happened to the cache instance of one decision (module docstring); None when
    the request's prompt is cached nowhere."""
    hits = d["hits"]
    best = max(hits.values(), default=0)
    if best <= 0:
        return None
    home = [i for i, h in hits.items() if h == best]
    if d["choice"] in home:
        return "chosen"
    if not any(i in d["pool"] for i in home):
        return "gated"
    preds = d["preds"]
    if not preds:
        return "not_predicted"
    top = min(p[0] for p in preds.values())
    h = min((preds[i][0] for i in home if i in preds), default=None)
    if h is None:
        return "not_sampled"
    return "tie_lost" if h <= top + d["tol"] + 1e-9 else "predicted_slower"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=3.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-n", type=int, default=600)
    ap.add_argument("--arms", default="power_of_k,cache_aware")
    ap.add_argument("--oracle", action="store_true")
    ap.add_argument("--json", default=None, help="write the printed figures to this file")
    a = ap.parse_args()
    out: dict[str, object] = {"rate": a.rate, "seed": a.seed, "n": a.n, "oracle": a.oracle, "arms": {}}
    base = dict(workload="sharegpt", multi_turn=True, num_requests=a.n, seed=a.seed, max_total_tokens=4096,
                request_rate=a.rate, virtual=True, instances=4, oracle_lengths=a.oracle)
    for arm in a.arms.split(","):
        log, recs = run_logged(arm, base)
        later = [d for d in log if not d["id"].endswith("-t0")]
        cats = Counter(categorize(d) for d in later)
        ttft = {rid: r.ttft_s for rid, r in recs.items() if r.first_token_s is not None}
        cut = float(np.percentile(list(ttft.values()), 99))
        print(f"\n== {arm}, {a.rate} sessions/s, seed {a.seed}: P99 TTFT {cut:.2f} s; later turns {len(later)}: "
              + ", ".join(f"{k or 'no_hit_anywhere'} {v}" for k, v in cats.most_common()))
        by_cat: dict[str | None, list[float]] = {}
        for d in later:
            if d["id"] in ttft:
                by_cat.setdefault(categorize(d), []).append(ttft[d["id"]])
        cat_rows: dict[str, dict[str, float]] = {}
        for k, v in sorted(by_cat.items(), key=lambda kv: str(kv[0])):
            print(f"   {k or 'no_hit_anywhere'}: mean TTFT {np.mean(v):.2f} s, P99 {np.percentile(v, 99):.2f} s")
            cat_rows[k or "no_hit_anywhere"] = {"later_turns": cats[k], "finished": len(v),
                                                "ttft_mean_s": float(np.mean(v)),
                                                "ttft_p99_s": float(np.percentile(v, 99))}
        per_inst = Counter(r.instance for rid, r in recs.items() if ttft.get(rid, 0) >= cut)
        print(f"   tail (TTFT ≥ P99) per instance: {dict(per_inst)}")
        tail = []
        for d in sorted(log, key=lambda d: -ttft.get(d["id"], 0))[:max(1, len(log) // 100)]:
            r = recs[d["id"]]
            pred = d["preds"].get(d["choice"])
            tail.append({"request_id": d["id"], "ttft_s": ttft[d["id"]], "predicted_ttft_s": pred[0] if pred else None,
                         "instance": r.instance, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                         "best_hit_tokens": max(d["hits"].values()), "category": categorize(d),
                         "preemptions": r.num_preemptions, "pool": d["pool"]})
            print(f"   {d['id']}: TTFT {ttft[d['id']]:.2f} s, predicted {pred[0] if pred else float('nan'):.2f} s, "
                  f"inst {r.instance}, prompt {r.prompt_tokens}, cached {r.cached_tokens} "
                  f"(best hit {max(d['hits'].values())}), cat {categorize(d)}, preempted {r.num_preemptions}, "
                  f"pool {d['pool']}")
        out["arms"][arm] = {"p99_ttft_s": cut, "later_turns": len(later),  # type: ignore[index]
                            "categories": cat_rows, "tail_per_instance": {str(k): v for k, v in per_inst.items()},
                            "tail": tail}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
