"""A fixed-seed virtual-cluster run (power_of_k, k=2: every dispatch decision runs the
jump look-ahead on two instances) whose per-request results must equal, bit for bit,
those recorded from the build before the engine was split into a package (issue 12,
base commit fe1a52e). The fixture holds numbers only: the workload (generated once from
a seed and stored, so a numpy release cannot change it) and what happened to each
request. Any change to the look-ahead's float operations or decisions shows up here.

Re-record (only on purpose, from a build whose estimates are known good):
    .venv/bin/python tests/test_lookahead_recorded.py --record
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from rps_astro_cli.cluster import TimedRequest, simulate_cluster
from rps_astro_cli.dispatch import make_dispatch
from rps_astro_cli.policies import make_policy
from rps_astro_cli.sim.profile import load_profile
from rps_astro_cli.types import InstanceConfig

FIXTURE = Path(__file__).with_name("data") / "lookahead_virtual_cluster.json"
PROFILE = "llama-2-7b-a30"
# a small KV pool and a short batch so queues, partial prefills and preemptions happen
CFG = InstanceConfig(block_size=16, num_gpu_blocks=400, max_num_seqs=12, max_num_batched_tokens=256,
                     max_model_len=4096)
INSTANCES = 3
RUNS = (("fcfs", 11), ("rps", 12))  # (instance policy, dispatch seed)
RECORD_FIELDS = ("instance", "enqueue_s", "first_scheduled_s", "first_token_s", "finish_s",
                 "num_preemptions", "predicted_ttft_s", "predicted_e2e_s")
MODALITIES = ("text", "image", "video")


def make_workload(n: int, seed: int) -> list[list[float | int]]:
    """Rows [arrival_s, prompt_tokens, output_tokens, predicted_output_tokens, modality
    index, vision_tokens, encoder_s, preprocess_s]: Poisson arrivals at ~9 req/s
    (above what 3 such instances serve, so queues build), predicted lengths off by up to
    ±60 % (auto-extension happens), 15 % images and 5 % videos."""
    g = np.random.default_rng(seed)
    t = 0.0
    rows: list[list[float | int]] = []
    for _ in range(n):
        t += float(g.exponential(1 / 9.0))
        u = float(g.random())
        m = 0 if u < 0.8 else (1 if u < 0.95 else 2)
        vis = (0, 729, 1568)[m]
        prompt = int(g.integers(8, 1200)) + vis
        out = int(g.integers(1, 300))
        pred = max(1, int(round(out * float(g.uniform(0.4, 1.6)))))
        enc = (0.0, 0.05, 0.3)[m] * float(g.uniform(0.8, 1.2))
        pre = (0.0, 0.01, 0.04)[m] * float(g.uniform(0.8, 1.2))
        rows.append([t, prompt, out, pred, m, vis, enc, pre])
    return rows


def to_requests(rows: list[list[float | int]]) -> list[TimedRequest]:
    return [TimedRequest(f"q{i}", float(a), int(p), int(o), predicted_output_tokens=int(pr),
                         modality=MODALITIES[int(m)], vision_tokens=int(v), encoder_s=float(e),
                         preprocess_s=float(pp))
            for i, (a, p, o, pr, m, v, e, pp) in enumerate(rows)]


def run_cluster(rows: list[list[float | int]], policy: str, seed: int) -> dict[str, list]:
    prof = load_profile(PROFILE)
    po2 = make_dispatch("power_of_k", k=2, objective="e2e", kv_reserve_frac=0.0, tie_tolerance_s=0.0)  # the paper's
    res = simulate_cluster(to_requests(rows), INSTANCES, po2, prof, CFG,
                           lambda: make_policy(policy), np.random.default_rng(seed))
    return {
        "records": [[getattr(r, f) for f in RECORD_FIELDS] for r in res.records],
        "steps_per_instance": list(res.steps_per_instance),
        "preemptions_per_instance": list(res.preemptions_per_instance),
    }


def test_virtual_cluster_matches_the_recorded_run() -> None:
    fx = json.loads(FIXTURE.read_text())
    assert fx["fields"] == list(RECORD_FIELDS)
    for policy, seed in RUNS:
        want = fx["runs"][policy]
        got = run_cluster(fx["workload"], policy, seed)
        assert got["steps_per_instance"] == want["steps_per_instance"], policy
        assert got["preemptions_per_instance"] == want["preemptions_per_instance"], policy
        for i, (g, w) in enumerate(zip(got["records"], want["records"], strict=True)):
            assert g == w, f"{policy} request q{i}: {dict(zip(RECORD_FIELDS, g))} != {dict(zip(RECORD_FIELDS, w))}"
    # the run exercises what it is meant to: preemptions and auto-extension under both
    assert all(sum(fx["runs"][p]["preemptions_per_instance"]) > 0 for p, _s in RUNS)


def _record() -> None:
    rows = make_workload(200, 2026)
    fx = {"profile": PROFILE, "fields": list(RECORD_FIELDS), "workload": rows,
          "runs": {p: run_cluster(rows, p, s) for p, s in RUNS}}
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_text(json.dumps(fx, separators=(",", ":")) + "\n")
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")


if __name__ == "__main__":
    if sys.argv[1:] == ["--record"]:
        _record()
    else:
        raise SystemExit("usage: python tests/test_lookahead_recorded.py --record")
