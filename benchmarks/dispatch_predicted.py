"""Dispatch with PREDICTED lengths on held-out prompts (issue 13 §2), one command:

    nice -n 10 .venv/bin/python benchmarks/dispatch_predicted.py            # capacity search + table
    nice -n 10 .venv/bin/python benchmarks/dispatch_predicted.py --capacity-rps 11.6 --arms base

Virtual cluster (`cluster.virtual.simulate_cluster`, the library under `astro bench
--virtual`): N × one execution profile (default 4 × llama-2-7b-a30), FCFS in-instance
policy, Poisson arrivals.

Workload — prompts the length model never saw: the tagger (`--length-model`, default the
shipped default, `artifacts/length/chat-gbm`) was trained on a seeded conversation-level
split of the ShareGPT sample (`length.pipeline.make_split`, seed / test / val fractions read from the
artifact's meta.json: 0 / 0.2 / 0.1). Only that split's TEST conversations are used here:
every human → reply pair of them; the engine's prompt carries PROMPT_CONTEXT_TURNS (1)
earlier turn whatever the model, so every model runs on the same request lists, and the
tagger reads each turn as it was trained (`LengthModel.predict_samples`: its
`context_turns`, or the whole history for a model that reads it); filtered like vLLM's
ShareGPT sampler (4 ≤ prompt ≤ 1024 tokens, output ≥ 4, total ≤ 2048; fallback token
counter). A seed's requests are drawn with replacement from that pool (the pool holds
~400 pairs, 2,000 requests reuse them) with its own Poisson arrivals; every arm of a seed
gets the identical request list, so arms are compared as ratios inside a seed.

Load: the fleet's SLO capacity (P99 TTFT ≤ 10 s, all seeds' requests pooled per rate,
bisection) is searched with `least_requests` and `llumnix`; the better of the two is the
fleet's capacity, and the table is run at `--loads` fractions of it (default 90 / 95 %).

Arms (`--arms`, comma-separated names of ARMS, or the groups `base` / `levers` / `all`):
each is a dispatch policy + its parameters + "predicted" (tagger) or "oracle" (true)
lengths + the look-ahead's remaining-length rule for queued/running requests.

Output: a table per load (P99 TTFT and mean E2E per arm: median over seeds and
min–max), and per arm the ratio to best(llumnix, least_requests) of each seed
(geometric mean over seeds, min–max); `--json FILE` writes every per-seed number.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.cluster.virtual import simulate_cluster
from rps_astro_cli.cluster.workload import TimedRequest
from rps_astro_cli.dispatch import make_dispatch
from rps_astro_cli.policies import make_policy
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.profile import load_profile
from rps_astro_cli.types import InstanceConfig


class LlumnixGuarded:
    """Benchmark-only hybrid (a lever under test, not a registered policy): fan out to
    every instance, and among those whose predicted TTFT is within `slack_s` of the
    lowest, pick the lowest Llumnix- load — Llumnix's memory balancing when the
    look-ahead sees no queue, the look-ahead's veto when it does."""

    name = "llumnix_guarded"
    inputs = frozenset({"predictions", "status"})  # dispatch.PREDICTIONS, dispatch.STATUS

    def __init__(self, slack_s: float = 0.5) -> None:
        from rps_astro_cli.dispatch.guided import LlumnixDispatch

        self.slack_s = slack_s
        self._llx = LlumnixDispatch()

    def filter(self, loads):
        return [ld.index for ld in loads if ld.healthy] or [ld.index for ld in loads]

    def sample(self, pool, rng):
        return list(pool)

    def candidates(self, loads, rng):
        return self.sample(self.filter(loads), rng)

    def choose(self, loads, candidates, predictions, rng):
        from rps_astro_cli.dispatch.stages import pick_min
        from rps_astro_cli.types import DispatchDecision

        if not predictions:
            return self._llx.choose(loads, candidates, predictions, rng)
        best = min(p.ttft_s for p in predictions.values())
        ok = [i for i, p in predictions.items() if p.ttft_s <= best + self.slack_s]
        by = {ld.index: ld for ld in loads}
        vals = {i: v for i in ok if (v := self._llx.load(by[i])) is not None}
        if not vals:
            vals = {i: predictions[i].ttft_s for i in ok}
        return DispatchDecision(self.name, tuple(candidates), pick_min(vals, rng), "llumnix among ttft-near-best")

    def describe(self):
        return {"name": self.name, "slack_s": self.slack_s}


def _make(policy: str, params: dict[str, Any]):
    if policy == "llumnix_guarded":
        return LlumnixGuarded(**params)
    return make_dispatch(policy, **params)


SHAREGPT_REL = "sharegpt/sharegpt_v3_sample500.json"
PROMPT_CONTEXT_TURNS = 1  # earlier turns in a request's prompt (the classic tagger's format, 2026-12-01 figures)
SLO_TTFT_S = 10.0  # the capacity goal: P99 TTFT ≤ 10 s (Astrolabe §5)
SLO_PERCENTILE = 99.0


@dataclass(frozen=True)
class Arm:
    """One configuration under test.

    policy / params: `dispatch.make_dispatch(policy, **params)`. lengths: "predicted"
    (the tagger's) or "oracle" (the true output length). remaining: the look-ahead's
    rule for queued/running requests' output length (None = the tagger's point estimate
    + 10-token auto-extension; else a `sim.remaining` spec).
    """

    policy: str
    params: dict[str, Any] = field(default_factory=dict)
    lengths: str = "predicted"
    remaining: str | None = None


ARMS: dict[str, Arm] = {
    "llumnix": Arm("llumnix", lengths="oracle"),  # lengths unused by these two
    "least_requests": Arm("least_requests", lengths="oracle"),
    "pok2": Arm("power_of_k", {"k": 2}),
    "pok2_oracle": Arm("power_of_k", {"k": 2}, lengths="oracle"),
    "pokall": Arm("power_of_k", {"k": "all"}),
    "pok2_ttft": Arm("power_of_k", {"k": 2, "objective": "ttft"}),
    # (a) conditional remaining length given "longer than g" (sim/remaining.py)
    "pok2_cond": Arm("power_of_k", {"k": 2}, remaining="default:ratio@mean"),
    "pok2_emp": Arm("power_of_k", {"k": 2}, remaining="default:empirical@mean"),
    # (d) a risk quantile of the conditional distribution instead of its mean
    "pok2_cond_q50": Arm("power_of_k", {"k": 2}, remaining="default:ratio@q50"),
    "pok2_cond_q90": Arm("power_of_k", {"k": 2}, remaining="default:ratio@q90"),
    # (e) the ratio table keeps learning from finished requests during the run
    "pok2_cond_online": Arm("power_of_k", {"k": 2}, remaining="online:default:ratio@mean"),
    # (f) the length model's own distribution (length/dist.py calibration): E[L | L > g]
    "pok2_dist": Arm("power_of_k", {"k": 2}, remaining="calibrated@mean"),
    "pok2_dist_q50": Arm("power_of_k", {"k": 2}, remaining="calibrated@q50"),
    "pokall_dist": Arm("power_of_k", {"k": "all"}, remaining="calibrated@mean"),
    # KV headroom gate (dispatch.stages.KvHeadroomFilter) + the predicted-TTFT objective
    "kvall": Arm("power_of_k", {"k": "all", "objective": "ttft", "kv_reserve_frac": 0.1}),
    "kvall_oracle": Arm("power_of_k", {"k": "all", "objective": "ttft", "kv_reserve_frac": 0.1}, lengths="oracle"),
    "kv2": Arm("power_of_k", {"k": 2, "objective": "ttft", "kv_reserve_frac": 0.1}),
    "kvall_e2e": Arm("power_of_k", {"k": "all", "objective": "e2e", "kv_reserve_frac": 0.1}),
    "kvall15": Arm("power_of_k", {"k": "all", "objective": "ttft", "kv_reserve_frac": 0.15}),
    "kvall05": Arm("power_of_k", {"k": "all", "objective": "ttft", "kv_reserve_frac": 0.05}),
    "kvtie": Arm("power_of_k", {"k": "all", "objective": "ttft", "kv_reserve_frac": 0.1, "tie_tolerance_s": 0.02}),
    "kvtie_oracle": Arm("power_of_k", {"k": "all", "objective": "ttft", "kv_reserve_frac": 0.1,
                                       "tie_tolerance_s": 0.02}, lengths="oracle"),
    "kvtie05": Arm("power_of_k", {"k": "all", "objective": "ttft", "kv_reserve_frac": 0.05, "tie_tolerance_s": 0.02}),
    # issue 13 round 5 (mean E2E, first-turn pool): the default with a wider tie tolerance
    # (more decisions by Llumnix- load), the model's own length distribution for queued /
    # running requests, and a lower KV reserve
    "kvtie_t50": Arm("power_of_k", {"k": "all", "objective": "ttft", "kv_reserve_frac": 0.1, "tie_tolerance_s": 0.05}),
    "kvtie_t100": Arm("power_of_k", {"k": "all", "objective": "ttft", "kv_reserve_frac": 0.1, "tie_tolerance_s": 0.1}),
    "kvtie_t200": Arm("power_of_k", {"k": "all", "objective": "ttft", "kv_reserve_frac": 0.1, "tie_tolerance_s": 0.2}),
    "kvtie_dist": Arm("power_of_k", {"k": "all", "objective": "ttft", "kv_reserve_frac": 0.1, "tie_tolerance_s": 0.02},
                      remaining="calibrated@mean"),
    "kvtie_dist_q75": Arm("power_of_k", {"k": "all", "objective": "ttft", "kv_reserve_frac": 0.1,
                                         "tie_tolerance_s": 0.02}, remaining="calibrated@q75"),
    "kvtie2": Arm("power_of_k", {"k": 2, "objective": "ttft", "kv_reserve_frac": 0.1, "tie_tolerance_s": 0.02}),
    "pokall_ttft": Arm("power_of_k", {"k": "all", "objective": "ttft"}),
    # hybrid: Llumnix- among the instances whose predicted TTFT is near the best
    "guarded": Arm("llumnix_guarded", {"slack_s": 0.5}),
    "guarded_cond": Arm("llumnix_guarded", {"slack_s": 0.5}, remaining="default:ratio@mean"),
    "guarded_dist": Arm("llumnix_guarded", {"slack_s": 0.5}, remaining="calibrated@mean"),
    "guarded_dist_s02": Arm("llumnix_guarded", {"slack_s": 0.2}, remaining="calibrated@mean"),
    "guarded_dist_s01": Arm("llumnix_guarded", {"slack_s": 0.1}, remaining="calibrated@mean"),
    "guarded_oracle": Arm("llumnix_guarded", {"slack_s": 0.5}, lengths="oracle"),
}
GROUPS = {
    "base": ["llumnix", "least_requests", "pok2", "pok2_oracle"],
    "levers": ["pok2_cond", "pok2_emp", "pokall", "pok2_ttft", "pok2_cond_q50", "pok2_cond_q90",
               "pok2_cond_online"],
}
GROUPS["all"] = GROUPS["base"] + GROUPS["levers"]
BASELINES = ("llumnix", "least_requests")


def _default_data() -> Path:
    from rps_astro_cli.data_paths import data_dir

    d = data_dir()
    return (d / SHAREGPT_REL) if d is not None else Path("/work/shared/data") / SHAREGPT_REL


@dataclass
class Pool:
    """The held-out request pool: prompt tokens, true and predicted output tokens (int64
    arrays of one length), and what it was built from."""

    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    predicted_tokens: np.ndarray
    info: dict[str, Any]
    calibration: Any = None  # the length model's LogSpreadCalibration (meta.json fit.dist), if any
    prompts: tuple[str, ...] = ()  # each pair's prompt text, same order (what the engine is sent)


def held_out_pool(data: Path, model_name: str | None = None, pairs: str = "all") -> Pool:
    """The test-split pairs of the length model's own training split (module docstring),
    with the tagger's prediction for each. pairs="all": every human → reply pair of a test
    conversation, prompt as the tagger was trained on it (with its context turns);
    "first": what `astro bench -w sharegpt` takes — the first human → gpt pair of each
    test-split record, the human turn alone as the prompt."""
    from rps_astro_cli.length import default_length_model, load_length_model
    from rps_astro_cli.length.data import load_length_data
    from rps_astro_cli.length.pipeline import make_split
    from rps_astro_cli.tokens import count_tokens_fallback

    model = load_length_model(model_name) if model_name else default_length_model()
    meta = model.meta
    split = meta.split if hasattr(meta, "split") else {}
    seed = int(split.get("seed", 0))
    test_frac = float(split.get("test_frac", 0.2))
    val_frac = float(split.get("val_frac", 0.1))
    ds = load_length_data(data, context_turns=model.context_turns)
    trained_sha = meta.data.get("sha256")
    if trained_sha and ds.sha256() != trained_sha:
        raise SystemExit(f"{data}: not the data the length model was trained on (sha256 differs): "
                         "the held-out split would be wrong; pass --data with its training file")
    test = make_split(ds, test_frac=test_frac, val_frac=val_frac, seed=seed).test
    if meta.data.get("n_test") is not None and len(test) != int(meta.data["n_test"]):
        raise SystemExit(f"test split has {len(test)} pairs, the model's meta says {meta.data['n_test']}")
    # the request's prompt (what the engine prefills) carries PROMPT_CONTEXT_TURNS earlier
    # turns whatever the model reads, so every length model is measured on one workload
    # (the split is by conversation id and does not depend on the prompt format)
    wds = load_length_data(data, context_turns=PROMPT_CONTEXT_TURNS)
    wtest = make_split(wds, test_frac=test_frac, val_frac=val_frac, seed=seed).test
    if wtest.conversation_ids != test.conversation_ids:
        raise SystemExit("the workload's split differs from the model's (same data, seed and fractions expected)")
    pt, ot, prompts = [], [], []
    if pairs == "first":
        from rps_astro_cli.bench.workload_base import _first_pair, _read_json_records
        from rps_astro_cli.length.data import conversation_key

        test_ids = set(test.conversation_ids)
        cand = []
        for row, e in enumerate(_read_json_records(data)):
            if conversation_key(e.get("id"), row) in test_ids:
                got = _first_pair(e.get("conversations") or [])
                if not isinstance(got, str):
                    cand.append((got[0], count_tokens_fallback(got[1]), None))
    else:  # the engine sees the workload prompt; the tagger reads the sample as it was trained
        cand = [(w.prompt, int(w.response_tokens), s) for w, s in zip(wtest.samples, test.samples)]
    kept = []
    for text, o, sample in cand:
        p = count_tokens_fallback(text)
        if 4 <= p <= 1024 and o >= 4 and p + o <= 2048:  # vLLM's ShareGPT sampler filter
            pt.append(p)
            ot.append(o)
            prompts.append(text)
            kept.append(sample)
    if pairs == "first":
        pred = model.predict(prompts)
    else:
        pred = model.predict_samples(kept)
    info = {"data": str(data), "length_model": meta.model, "split": {"seed": seed, "test_frac": test_frac,
            "val_frac": val_frac, "by": "conversation id"}, "test_pairs": len(test), "pairs": pairs, "pool": len(pt),
            "test_conversations": len(set(test.conversation_ids))}
    info["calibrated"] = model.calibration is not None
    return Pool(np.asarray(pt, np.int64), np.asarray(ot, np.int64), np.asarray(pred, np.int64), info,
                model.calibration, tuple(prompts))


def workload(pool: Pool, n: int, rate_rps: float, seed: int, lengths: str) -> list[TimedRequest]:
    """`n` requests drawn (with replacement, seeded) from the pool, Poisson arrivals at
    `rate_rps`. The draw and the gaps depend on the seed only, never on the arm or the
    rate (the gaps are unit exponentials scaled by 1 / rate)."""
    rng = np.random.default_rng([seed, 13])
    idx = rng.integers(len(pool.prompt_tokens), size=n)
    t = np.cumsum(rng.exponential(1.0, size=n)) / rate_rps
    out = []
    for j, i in enumerate(idx):
        o = int(pool.output_tokens[i])
        pred = o if lengths == "oracle" else int(pool.predicted_tokens[i])
        out.append(TimedRequest(f"r{j}", float(t[j]), int(pool.prompt_tokens[i]), o, pred))
    return out


def _rule(spec: str, calibration: Any) -> Any:
    """A remaining-length rule from its spec: "calibrated@<statistic>" (the length model's
    distribution), or a `sim.remaining` spec ("online:" prefix = learning during the run)."""
    if spec.startswith("calibrated"):
        from rps_astro_cli.length.dist import CalibratedRemaining

        if calibration is None:
            raise SystemExit(f"arm rule {spec}: the length model has no distribution calibration")
        return CalibratedRemaining(calibration, spec.split("@", 1)[1] if "@" in spec else "mean")
    from rps_astro_cli.sim.remaining import OnlineRemaining, load_remaining

    if spec.startswith("online:"):
        return OnlineRemaining(load_remaining(spec[len("online:"):]))
    return load_remaining(spec)


def run_arm(arm: Arm, reqs: list[TimedRequest], num_instances: int, lat: LatencyModel, icfg: InstanceConfig,
            seed: int, calibration: Any = None) -> dict[str, float]:
    """P99 TTFT and mean E2E (s) of one arm on one request list. `calibration`: the length
    model's distribution calibration, for the "calibrated@<statistic>" remaining rule."""
    kw: dict[str, Any] = {}
    if arm.remaining is not None:
        kw["remaining"] = _rule(arm.remaining, calibration)
    res = simulate_cluster(reqs, num_instances, _make(arm.policy, arm.params), lat, icfg,
                           lambda: make_policy("fcfs"), np.random.default_rng([seed, 11]), **kw)
    ttft = np.array([r.ttft_s if r.first_token_s is not None else math.inf for r in res.records])
    e2e = np.array([r.e2e_s for r in res.records if r.finish_s is not None])
    return {"p99_ttft_s": float(np.percentile(ttft, SLO_PERCENTILE)), "mean_e2e_s": float(np.mean(e2e)),
            "mean_ttft_s": float(np.mean(ttft[np.isfinite(ttft)])), "preemptions": int(res.num_preemptions),
            "wall_s": res.wall_s}


def geo(xs: list[float]) -> float:
    return float(math.exp(np.mean(np.log(xs))))


def search_capacity(pool: Pool, arm: Arm, args, lat, icfg, log) -> float:
    """Highest rate (req/s) whose pooled P99 TTFT over the capacity seeds is ≤ SLO_TTFT_S,
    by bisection to `--capacity-tol` req/s between `--capacity-lo` / `--capacity-hi`."""
    seeds = list(range(args.capacity_seeds))

    def ok(rate: float) -> bool:
        ttfts = []
        for s in seeds:
            reqs = workload(pool, args.requests, rate, 1000 + s, arm.lengths)
            res = simulate_cluster(reqs, args.instances, make_dispatch(arm.policy, **arm.params), lat, icfg,
                                   lambda: make_policy("fcfs"), np.random.default_rng([1000 + s, 11]))
            ttfts += [r.ttft_s for r in res.records]
        v = float(np.percentile(ttfts, SLO_PERCENTILE))
        log(f"  capacity {arm.policy}: {rate:.3f} req/s → pooled P99 TTFT {v:.2f} s")
        return v <= SLO_TTFT_S

    lo, hi = args.capacity_lo, args.capacity_hi
    if not ok(lo):
        raise SystemExit(f"even {lo} req/s misses the SLO; lower --capacity-lo")
    while hi - lo > args.capacity_tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=None, help="ShareGPT file the length model was trained on")
    ap.add_argument("--length-model", default=None, help="length model name/folder (default: the shipped one)")
    ap.add_argument("--pairs", choices=("all", "first"), default="all",
                    help="all human→reply pairs of the test conversations, or only each record's first (as -w sharegpt)")
    ap.add_argument("--profile", default="llama-2-7b-a30")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds are first-seed … first-seed + seeds − 1")
    ap.add_argument("--loads", default="0.9,0.95", help="fractions of the SLO capacity")
    ap.add_argument("--capacity-rps", type=float, default=None, help="skip the search; use this capacity")
    ap.add_argument("--capacity-seeds", type=int, default=3)
    ap.add_argument("--capacity-lo", type=float, default=6.0)
    ap.add_argument("--capacity-hi", type=float, default=16.0)
    ap.add_argument("--capacity-tol", type=float, default=0.25)
    ap.add_argument("--arms", default="base")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    names: list[str] = []
    for a in args.arms.split(","):
        a = a.strip()
        for nm in GROUPS.get(a, [a]):
            if nm not in ARMS:
                ap.error(f"--arms: unknown arm {nm!r}; known: {', '.join(ARMS)} or groups {', '.join(GROUPS)}")
            if nm not in names:
                names.append(nm)
    for b in BASELINES:  # ratios need both baselines
        if b not in names:
            names.insert(0, b)
    loads = [float(x) for x in args.loads.split(",")]

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    data = args.data or _default_data()
    if not data.is_file():
        ap.error(f"--data: no such file {data}; pass the ShareGPT sample (or set ASTRO_DATA_DIR)")
    pool = held_out_pool(data, args.length_model, args.pairs)
    log(f"held-out pool: {json.dumps(pool.info)}")
    prof = load_profile(args.profile)
    lat = LatencyModel(prof)
    icfg = InstanceConfig.from_profile(prof)

    cap: dict[str, float] = {}
    if args.capacity_rps is not None:
        capacity = args.capacity_rps
    else:
        for b in BASELINES:
            cap[b] = search_capacity(pool, ARMS[b], args, lat, icfg, log)
        capacity = max(cap.values())
    log(f"fleet SLO capacity (P99 TTFT ≤ {SLO_TTFT_S:g} s): {capacity:.3f} req/s {cap}")

    out: dict[str, Any] = {"pool": pool.info, "capacity_rps": capacity, "capacity_by_policy": cap,
                           "instances": args.instances, "profile": args.profile, "requests": args.requests,
                           "arms": {n: ARMS[n].__dict__ for n in names}, "loads": {}}
    t0 = time.time()
    for load in loads:
        rate = load * capacity
        per: dict[str, list[dict[str, float]]] = {n: [] for n in names}
        for s in range(args.first_seed, args.first_seed + args.seeds):
            order = names[s % len(names):] + names[:s % len(names)]  # rotate the arm order per seed
            for n in order:
                arm = ARMS[n]
                reqs = workload(pool, args.requests, rate, s, arm.lengths)
                per[n].append(run_arm(arm, reqs, args.instances, lat, icfg, s, pool.calibration))
            log(f"  load {load:.2f} seed {s} done ({time.time() - t0:.0f} s): "
                + ", ".join(f"{n} {per[n][-1]['p99_ttft_s']:.2f}/{per[n][-1]['mean_e2e_s']:.2f}/"
                            f"{per[n][-1]['preemptions']}" for n in names))  # P99 TTFT / mean E2E s / preemptions
            if args.json:  # every finished seed, so a long run that is cut short keeps what it measured
                out["loads"][str(load)] = {"rate_rps": rate, "per_seed": per, "partial": True}
                args.json.write_text(json.dumps(out, indent=1))
        out["loads"][str(load)] = {"rate_rps": rate, "per_seed": per}
        if args.seeds:
            print_table(load, rate, names, per)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


def print_table(load: float, rate: float, names: list[str], per: dict[str, list[dict[str, float]]]) -> None:
    seeds = len(per[names[0]])
    best_t = [min(per[b][s]["p99_ttft_s"] for b in BASELINES) for s in range(seeds)]
    best_e = [min(per[b][s]["mean_e2e_s"] for b in BASELINES) for s in range(seeds)]
    print(f"\n## load {load:.0%} of capacity = {rate:.2f} req/s, {seeds} seeds")
    print("| arm | lengths | P99 TTFT s (median, min–max) | mean E2E s (median, min–max) "
          "| P99 TTFT / best baseline (geo-mean, min–max) | mean E2E / best baseline | preemptions (all seeds) |")
    print("|---|---|---|---|---|---|---|")
    for n in names:
        t = [r["p99_ttft_s"] for r in per[n]]
        e = [r["mean_e2e_s"] for r in per[n]]
        rt = [a / b for a, b in zip(t, best_t)]
        re_ = [a / b for a, b in zip(e, best_e)]
        lengths = "—" if n in BASELINES else ARMS[n].lengths
        print(f"| {n} | {lengths} | {np.median(t):.2f} ({min(t):.2f}–{max(t):.2f}) | {np.median(e):.2f} "
              f"({min(e):.2f}–{max(e):.2f}) | {geo(rt):.3f} ({min(rt):.3f}–{max(rt):.3f}) | {geo(re_):.4f} "
              f"({min(re_):.4f}–{max(re_):.4f}) | {sum(r.get('preemptions', 0) for r in per[n])} |")
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    raise SystemExit(main())
