"""Look-ahead speed: microseconds per `predict` (jump) vs `predict_stepwise` (reference).

Snapshots are built from the Astrolabe ShareGPT/Llama-2 length trace
($ASTRO_DATA_DIR/traces/astrolabe_sharegpt_val_10k_llama2.csv: prompt and output tokens
per request): R running requests caught at a uniformly random point of their decode
(prompt computed, KV blocks = ceil(computed / 16), skipped if the 1056-block pool would
overflow), W waiting requests, and a candidate, all with oracle predicted lengths, on the
`llama-2-7b-a30` profile (block 16, 1056 blocks, max 48 seqs, chunk 512).

Prints one row per (running, waiting): median and p99 µs of the jump look-ahead (wall
clock, and the process CPU time beside it: the machine is shared, so wall time includes
waiting for a core), the step-by-step median on a subset, their ratio (same subset),
mean steps simulated and mean events, and the largest relative difference between the two
look-aheads' TTFT/E2E on the subset. When the engine (sim/lookahead_engine/) runs as its
mypyc build, the same snapshots are also timed on the interpreted source in this process
("src med µs") and the ratio printed ("×src"). "1st med µs": the same snapshots'
look-ahead stopped at the candidate's first token (`first_token_only`, an early
decision's), "×1st" the full one's median over it; its TTFT must equal the full one's
("max rel diff" covers it too).

    .venv/bin/python benchmarks/lookahead_speed.py [--snapshots 200] [--stepwise 15] [--policy fcfs]

Multimodal fleets (issue 15): `--profile llava-onevision-7b-a100 --policy rps --mix 0.4,0.2
--labelled` (RPS-Serve's MH mix: 40 % one image, 20 % an 8-frame video; `--labelled`: the
requests carry the class the policy gives them, as an engine's `/status` reports them to
its Predictor). benchmarks/lookahead_ab_proc.py times these snapshots against another
checkout.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from rps_astro_cli.data_paths import data_dir
from rps_astro_cli.policies.build import build_instance_policy
from rps_astro_cli.sim import engine_build, lookahead
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.lookahead import predict, predict_stepwise
from rps_astro_cli.sim.profile import load_profile
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.types import CandidateRequest, InstanceConfig, InstanceStatus, RequestStatus


def load_lengths() -> np.ndarray:
    path = data_dir() / "traces" / "astrolabe_sharegpt_val_10k_llama2.csv"
    d = np.loadtxt(path, delimiter=",", skiprows=1, usecols=(0, 1), dtype=np.int64)
    return d[(d[:, 0] > 0) & (d[:, 1] > 0)]


IMAGE_TOKENS, FRAME_TOKENS, VIDEO_FRAMES = 729, 196, 8  # LLaVA-OneVision (artifacts/profiles)


def dress(p: int, mix: tuple[float, float], rng: np.random.Generator) -> dict:
    """A request's media under `--mix IMAGE,VIDEO` (fractions): one image (729 vision
    tokens) or an 8-frame video (196 tokens a frame) added to the text prompt `p`. All
    text, with no random draw, by default: the default snapshots are those of the
    figures in BENCHMARKS.md."""
    if mix == (0.0, 0.0):
        return {"prompt_tokens": p, "modality": "text", "vision_tokens": 0}
    u = rng.random()
    if u < mix[0]:
        return {"prompt_tokens": p + IMAGE_TOKENS, "modality": "image", "vision_tokens": IMAGE_TOKENS}
    if u < mix[0] + mix[1]:
        v = FRAME_TOKENS * VIDEO_FRAMES
        return {"prompt_tokens": p + v, "modality": "video", "vision_tokens": v}
    return {"prompt_tokens": p, "modality": "text", "vision_tokens": 0}


def make_snapshot(lengths: np.ndarray, cfg: InstanceConfig, n_running: int, n_waiting: int,
                  rng: np.random.Generator, mix: tuple[float, float] = (0.0, 0.0)) -> tuple[InstanceStatus, CandidateRequest]:
    bs = cfg.block_size
    running: list[RequestStatus] = []
    used = 0
    tries = 0
    while len(running) < n_running and tries < 100 * n_running:
        tries += 1
        p, o = (int(x) for x in lengths[rng.integers(len(lengths))])
        m = dress(p, mix, rng)
        p = m["prompt_tokens"]
        if o < 2 or p + o > cfg.max_model_len:
            continue
        g = int(rng.integers(1, o))
        c = p + g - 1
        kv = -(-c // bs)
        if used + kv > cfg.num_gpu_blocks - 8:
            continue
        used += kv
        running.append(RequestStatus(f"r{len(running)}", 0.0, p, c, g, o, kv_blocks=kv,
                                     modality=m["modality"], vision_tokens=m["vision_tokens"]))
    waiting = []
    while len(waiting) < n_waiting:
        p, o = (int(x) for x in lengths[rng.integers(len(lengths))])
        m = dress(p, mix, rng)
        if m["prompt_tokens"] + o <= cfg.max_model_len:
            # with --mix, arrivals spread over the last second (mixed classes then age
            # differently); else all at 0.5 s
            arr = float(rng.uniform(0.0, 1.0)) if mix != (0.0, 0.0) else 0.5
            waiting.append(RequestStatus(f"w{len(waiting)}", arr, m["prompt_tokens"],
                                         0, 0, o, modality=m["modality"], vision_tokens=m["vision_tokens"]))
    waiting.sort(key=lambda r: r.arrival_s)
    while True:
        p, o = (int(x) for x in lengths[rng.integers(len(lengths))])
        m = dress(p, mix, rng)
        if m["prompt_tokens"] + o <= cfg.max_model_len:
            break
    status = InstanceStatus("bench", 1.0, cfg, cfg.num_gpu_blocks - used, tuple(running), tuple(waiting))
    return status, CandidateRequest(m["prompt_tokens"], o, modality=m["modality"], vision_tokens=m["vision_tokens"])


def label_snapshot(snap: tuple[InstanceStatus, CandidateRequest], policy) -> tuple[InstanceStatus, CandidateRequest]:
    """The snapshot with each request's `req_class` the one a class-aware `policy` gives it
    (as its engine labels them); other policies: unchanged."""
    classify = getattr(policy, "classify", None)
    if classify is None:
        return snap
    st, cand = snap

    def lab(r: RequestStatus) -> RequestStatus:
        probe = SimRequest(r.request_id, 0.0, r.prompt_tokens, 1, modality=r.modality, vision_tokens=r.vision_tokens)
        return replace(r, req_class=classify(probe))

    return replace(st, running=tuple(map(lab, st.running)), waiting=tuple(map(lab, st.waiting))), cand


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--snapshots", type=int, default=200, help="snapshots per cell (fast look-ahead)")
    ap.add_argument("--stepwise", type=int, default=15, help="snapshots per cell also timed step by step")
    ap.add_argument("--profile", default="llama-2-7b-a30")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="fcfs", help="instance policy (fcfs, rps, edf, ...)")
    ap.add_argument("--mix", default="0,0", help="IMAGE,VIDEO: fractions of requests with one image / an "
                    "8-frame video (LLaVA-OneVision token counts); default all text")
    ap.add_argument("--labelled", action="store_true", help="requests carry the class the policy gives them "
                    "(req_class), as /status reports them")
    ap.add_argument("--json", type=Path, default=None, help="write the printed figures (one row per cell) here")
    args = ap.parse_args()
    rows: list[dict[str, float]] = []
    prof = load_profile(args.profile)
    cfg = InstanceConfig.from_profile(prof)
    lengths = load_lengths()
    rng = np.random.default_rng(args.seed)
    policy = build_instance_policy(args.policy, None, prof)
    mix = tuple(float(x) for x in args.mix.split(","))
    if len(mix) != 2 or min(mix) < 0 or sum(mix) > 1:
        raise SystemExit("--mix: two fractions IMAGE,VIDEO, each ≥ 0, summing to ≤ 1 (e.g. 0.2,0.1)")
    native = lookahead.engine
    source = engine_build.load_source("rps_astro_cli.sim._engine_source") if lookahead.NATIVE else None
    print(f"profile {prof.profile_id}; blocks {cfg.num_gpu_blocks}×{cfg.block_size}, "
          f"max_num_seqs {cfg.max_num_seqs}, chunk {cfg.max_num_batched_tokens}; policy {args.policy}; "
          f"engine {'mypyc build' if lookahead.NATIVE else 'interpreted source'}")
    print(f"{'running':>7} {'waiting':>7} | {'jump med µs':>11} {'jump p99 µs':>11} "
          f"{'cpu med µs':>10} {'cpu p99 µs':>10} | {'src med µs':>10} {'×src':>5} | {'1st med µs':>10} {'×1st':>5} | "
          f"{'step med µs':>11} {'ratio':>7} | "
          f"{'steps':>7} {'events':>7} {'max rel diff':>12}")
    for n_run in (8, 48):
        for n_wait in (0, 50, 200):
            snaps = [make_snapshot(lengths, cfg, n_run, n_wait, rng, mix) for _ in range(args.snapshots)]
            if args.labelled:
                snaps = [label_snapshot(st, policy) for st in snaps]
            lat = LatencyModel(prof)  # warm memo, as a long-lived Predictor has
            fast_us, cpu_us, steps, events = [], [], [], []
            for st, cand in snaps:
                c0 = time.process_time()
                t0 = time.perf_counter()
                est = predict(st, cand, lat, policy)
                fast_us.append((time.perf_counter() - t0) * 1e6)
                cpu_us.append((time.process_time() - c0) * 1e6)
                steps.append(est.steps_simulated)
                events.append(est.events)
            first_us, maxdiff = [], 0.0
            for (st, cand), est in zip(snaps, (predict(st, cand, lat, policy) for st, cand in snaps)):
                t0 = time.perf_counter()
                short = predict(st, cand, lat, policy, first_token_only=True)
                first_us.append((time.perf_counter() - t0) * 1e6)
                maxdiff = max(maxdiff, abs(short.ttft_s - est.ttft_s) / est.ttft_s)
            first_med = float(np.median(first_us))
            src_med, src_ratio = float("nan"), float("nan")
            if source is not None:  # the interpreted engine on the same snapshots
                lookahead.engine = source
                src_us = []
                for st, cand in snaps:
                    t0 = time.perf_counter()
                    predict(st, cand, lat, policy)
                    src_us.append((time.perf_counter() - t0) * 1e6)
                lookahead.engine = native
                src_med = float(np.median(src_us))
                src_ratio = src_med / float(np.median(fast_us))
            slow_us, fast_sub = [], []
            for (st, cand), f_us in zip(snaps[: args.stepwise], fast_us[: args.stepwise]):
                t0 = time.perf_counter()
                ref = predict_stepwise(st, cand, lat, policy)
                slow_us.append((time.perf_counter() - t0) * 1e6)
                fast_sub.append(f_us)
                est = predict(st, cand, lat, policy)
                maxdiff = max(maxdiff, abs(est.e2e_s - ref.e2e_s) / ref.e2e_s,
                              abs(est.ttft_s - ref.ttft_s) / ref.ttft_s)
            med = float(np.median(fast_us))
            p99 = float(np.percentile(fast_us, 99))
            smed = float(np.median(slow_us)) if slow_us else float("nan")
            ratio = smed / float(np.median(fast_sub)) if slow_us else float("nan")
            cmed, cp99 = float(np.median(cpu_us)), float(np.percentile(cpu_us, 99))
            print(f"{n_run:>7} {n_wait:>7} | {med:>11.0f} {p99:>11.0f} {cmed:>10.0f} {cp99:>10.0f} | "
                  f"{src_med:>10.0f} {src_ratio:>4.1f}× | {first_med:>10.0f} {med / first_med:>4.1f}× | "
                  f"{smed:>11.0f} {ratio:>6.0f}× | "
                  f"{np.mean(steps):>7.0f} {np.mean(events):>7.0f} {maxdiff:>12.1e}", flush=True)
            rows.append({"running": n_run, "waiting": n_wait, "jump_median_us": med, "jump_p99_us": p99,
                         "cpu_median_us": cmed, "cpu_p99_us": cp99, "source_median_us": src_med,
                         "source_ratio": src_ratio, "first_token_median_us": first_med,
                         "stepwise_median_us": smed, "stepwise_ratio": ratio,
                         "steps_mean": float(np.mean(steps)), "events_mean": float(np.mean(events)),
                         "max_rel_diff": maxdiff})
    if args.json:
        out = {"profile": prof.profile_id, "policy": args.policy, "mix": args.mix, "labelled": args.labelled,
               "native": bool(lookahead.NATIVE), "cells": rows}
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
