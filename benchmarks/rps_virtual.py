"""RPS-Serve reproduction in virtual time: one LLaVA-OneVision-7B/A100 sim instance,
the MH mix, Poisson arrivals, SLO = `slo_scale` × each request's isolated E2E, compared
across the in-instance policies fcfs (vLLM), edf, naive_class, static_class,
naive_aging and rps (ARCHITECTURE.md §3; paper §4).

    .venv/bin/python benchmarks/rps_virtual.py                      # main tables (2 req/s)
    .venv/bin/python benchmarks/rps_virtual.py --sweep rate         # 1 … 3 req/s (paper), then 4, 5, 6
    .venv/bin/python benchmarks/rps_virtual.py --sweep kv           # KV memory 100 / 50 / 25 / 10 %
    .venv/bin/python benchmarks/rps_virtual.py --sweep slo          # SLO scale 1.25 … 10

Per request: prompt = text tokens (ShareGPT / LLaVA-Instruct prompts from the data folder,
fallback counter) + vision tokens of the profile (729 per image, 196 per frame, 32 frames
per video); true output length = the dataset's reference reply; preprocessing and encoder
seconds from the profile. Class of a request (for the tables, the same for every policy):
the shipped smart classifier `artifacts/rps/llava-onevision-7b-a100` on (prompt tokens,
vision tokens, modality). EDF gets each request's deadline = arrival + SLO (the paper's
EDF "assumes knowledge of each request's deadline").

Metrics (per class and overall): TTFT mean and P90 (s); normalized latency = mean of
E2E / output tokens (s/token); SLO violation rate (E2E > SLO) and severity (mean seconds
past the SLO among violators); preemptions (sum of per-request preemption counts).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from rps_astro_cli.bench.workload_base import WorkloadOptions
from rps_astro_cli.bench.workloads import load_workload
from rps_astro_cli.cluster.virtual import simulate_cluster
from rps_astro_cli.cluster.workload import TimedRequest
from rps_astro_cli.dispatch import make_dispatch
from rps_astro_cli.policies.build import build_instance_policy
from rps_astro_cli.rps.classes import CLASSES
from rps_astro_cli.rps.classifier import load_classifier
from rps_astro_cli.rps.estimator import isolated_latency
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.profile import load_profile
from rps_astro_cli.types import InstanceConfig

POLICIES = ("fcfs", "edf", "naive_class", "static_class", "naive_aging", "rps")
PROFILE = "llava-onevision-7b-a100"


def build_requests(n: int, rate: float, seed: int, slo_scale: float, lm: LatencyModel):
    """(timed requests, per-request info dict) for the MH mix at `rate` req/s."""
    prof = lm.profile
    v = prof.vision
    rng = np.random.default_rng(seed)
    wl = load_workload("mix-mh", WorkloadOptions(num_requests=n), rng)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(wl.requests)))
    clf = load_classifier(PROFILE)
    reqs, info = [], {}
    for r, t in zip(wl.requests, arrivals):
        vis = r.num_images * v.tokens_per_image + r.num_frames * v.tokens_per_frame
        pre = r.num_images * v.preprocess_s_per_image + r.num_frames * v.preprocess_s_per_frame
        enc = r.num_images * v.encoder_s_per_image + r.num_frames * v.encoder_s_per_frame
        prompt = r.prompt_tokens + vis
        out = max(1, min(r.output_tokens, prof.max_model_len - prompt))
        iso = isolated_latency(lm, prompt, out, enc, pre)
        slo = slo_scale * iso.e2e_s
        reqs.append(TimedRequest(r.request_id, float(t), prompt, out, modality=r.modality, vision_tokens=vis,
                                 encoder_s=enc, preprocess_s=pre, deadline_s=float(t) + slo))
        info[r.request_id] = {"cls": clf.classify(prompt, vis, r.modality), "modality": r.modality,
                              "iso_e2e_s": iso.e2e_s, "out": out}
    return reqs, info, wl


def run_policy(name: str, reqs, lm: LatencyModel, cfg: InstanceConfig, seed: int):
    t0 = time.perf_counter()
    res = simulate_cluster(reqs, 1, make_dispatch("round_robin"), lm, cfg,
                           lambda: build_instance_policy(name, None, lm.profile), np.random.default_rng(seed))
    return res, time.perf_counter() - t0


def metrics(records, info, slo_scale: float, key: str = "cls") -> dict[str, dict[str, float]]:
    groups: dict[str, list] = {}
    for rec in records:
        groups.setdefault(info[rec.request_id][key], []).append(rec)
        groups.setdefault("overall", []).append(rec)
    out = {}
    for g, recs in groups.items():
        ttft = np.array([r.ttft_s for r in recs])
        norm = np.array([r.e2e_s / info[r.request_id]["out"] for r in recs])
        over = np.array([r.e2e_s - slo_scale * info[r.request_id]["iso_e2e_s"] for r in recs])
        viol = over[over > 0]
        out[g] = {"n": len(recs), "ttft_mean_s": float(ttft.mean()), "ttft_p90_s": float(np.percentile(ttft, 90)),
                  "norm_lat_s_per_tok": float(norm.mean()), "slo_viol_pct": 100.0 * len(viol) / len(recs),
                  "slo_sev_s": float(viol.mean()) if len(viol) else 0.0,
                  "preemptions": int(sum(r.num_preemptions for r in recs))}
    return out


def table(title: str, rows: dict[str, dict[str, float]]) -> str:
    head = ("| policy | n | TTFT mean (s) | TTFT P90 (s) | norm. latency (s/token) | SLO viol. (%) | "
            "severity (s) | preemptions |\n|---|---|---|---|---|---|---|---|")
    lines = [f"**{title}**", "", head]
    for pol, m in rows.items():
        lines.append(f"| {pol} | {m['n']} | {m['ttft_mean_s']:.3f} | {m['ttft_p90_s']:.3f} | "
                     f"{m['norm_lat_s_per_tok']:.4f} | {m['slo_viol_pct']:.1f} | {m['slo_sev_s']:.2f} | "
                     f"{m['preemptions']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=600)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--slo-scale", type=float, default=5.0)
    ap.add_argument("--kv-fraction", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--sweep", choices=("none", "rate", "kv", "slo"), default="none")
    ap.add_argument("--json", dest="json_out", default=None, help="also write all numbers here")
    a = ap.parse_args(argv)
    prof = load_profile(PROFILE)
    lm = LatencyModel(prof)
    pols = [p for p in a.policies.split(",") if p]
    results: dict = {"args": vars(a)}

    def one(rate: float, kv: float, slo_scale: float) -> dict:
        cfg = InstanceConfig.from_profile(prof, num_gpu_blocks=max(1, int(prof.num_gpu_blocks * kv)))
        reqs, info, wl = build_requests(a.num_requests, rate, a.seed, slo_scale, lm)
        per = {}
        for p in pols:
            res, wall = run_policy(p, reqs, lm, cfg, a.seed)
            per[p] = {"by_class": metrics(res.records, info, slo_scale),
                      "by_modality": metrics(res.records, info, slo_scale, "modality"),
                      "wall_s": wall, "preemptions_total": res.num_preemptions}
        cls_counts = {c: sum(1 for i in info.values() if i["cls"] == c) for c in CLASSES}
        mods = {m: sum(1 for i in info.values() if i["modality"] == m) for m in ("text", "image", "video")}
        return {"per_policy": per, "class_counts": cls_counts, "modality_counts": mods, "source": wl.source,
                "warnings": wl.warnings}

    if a.sweep == "none":
        r = one(a.rate, a.kv_fraction, a.slo_scale)
        results["main"] = r
        print(f"MH mix, {a.num_requests} requests, Poisson {a.rate} req/s, KV {a.kv_fraction:.0%}, "
              f"SLO {a.slo_scale}x isolated E2E; classes {r['class_counts']}, modalities {r['modality_counts']}\n")
        for g in (*CLASSES, "overall"):
            print(table(g, {p: r["per_policy"][p]["by_class"][g] for p in pols if g in r["per_policy"][p]["by_class"]}))
        print(table("text requests (by modality)", {p: r["per_policy"][p]["by_modality"]["text"] for p in pols}))
        print("wall s per run: " + ", ".join(f"{p} {r['per_policy'][p]['wall_s']:.1f}" for p in pols))
    else:
        grid = {"rate": [("rate", x) for x in (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0)],
                "kv": [("kv", x) for x in (1.0, 0.5, 0.25, 0.1)],
                "slo": [("slo", x) for x in (1.25, 2.5, 5.0, 7.5, 10.0)]}[a.sweep]
        results["sweep"] = {}
        hdr = "| " + a.sweep + " | policy | sand TTFT mean (s) | overall TTFT mean (s) | overall TTFT P90 (s) | " \
              "norm. latency (s/token) | SLO viol. (%) | severity (s) | preemptions (sand) |"
        print(hdr + "\n|" + "---|" * 9)
        for kind, x in grid:
            rate = x if kind == "rate" else a.rate
            kv = x if kind == "kv" else a.kv_fraction
            slo = x if kind == "slo" else a.slo_scale
            r = one(rate, kv, slo)
            results["sweep"][str(x)] = r
            for p in pols:
                o = r["per_policy"][p]["by_class"]["overall"]
                s = r["per_policy"][p]["by_class"].get("sand", {"ttft_mean_s": float("nan"), "preemptions": 0})
                print(f"| {x:g} | {p} | {s['ttft_mean_s']:.3f} | {o['ttft_mean_s']:.3f} | {o['ttft_p90_s']:.3f} | "
                      f"{o['norm_lat_s_per_tok']:.4f} | {o['slo_viol_pct']:.1f} | {o['slo_sev_s']:.2f} | "
                      f"{o['preemptions']} ({s['preemptions']}) |", flush=True)
    if a.json_out:
        with open(a.json_out, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
