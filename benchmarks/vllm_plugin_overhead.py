"""Per-step CPU cost of astro's vLLM scheduler plugin, without vllm.

The plugin's per-step work (`engine/vllm_plugin.py`) is: reorder the waiting queue by the
policy (`PolicyDriver.order_waiting`), rank preemption victims when KV could run out
(`preemption_possible` + `PolicyDriver.rank_victims`), and capture the status board
(`StatusBoard.publish`). This times exactly those calls on stand-in requests with the
attributes vLLM's `Request` has (a running batch of R requests, W waiting), for several
policies, and prints µs per step. The live figure from a real engine is `/status`
`plugin.us_per_step` (the integration tests print it).

    .venv/bin/python benchmarks/vllm_plugin_overhead.py [--running 48] [--waiting 100] [--steps 2000]
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from rps_astro_cli.engine.vllm_bridge import PolicyDriver, StatusBoard, preemption_possible
from rps_astro_cli.policies import make_policy
from rps_astro_cli.types import InstanceConfig

CLASSES = ("sand", "pebbles", "rocks")


class Req:
    """Stand-in with the vLLM `Request` attributes the plugin reads."""

    def __init__(self, i: int, rng: np.random.Generator, now: float):
        self.request_id = f"req-{i}"
        self.arrival_time = now - float(rng.uniform(0, 30))
        self.num_prompt_tokens = int(rng.integers(16, 2048))
        self.num_computed_tokens = 0
        self.num_output_tokens = 0
        self.max_tokens = 256
        self.priority = 0
        self.num_preemptions = 0
        self.mm_features = []
        self.sampling_params = SimpleNamespace(extra_args={
            "astro_class": CLASSES[int(rng.integers(0, 3))],
            "astro_predicted_output_tokens": int(rng.integers(16, 512))})

    @property
    def num_tokens(self):
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_tokens_with_spec(self):
        return self.num_tokens


def bench(policy: str, n_run: int, n_wait: int, steps: int, pressure: bool) -> float:
    rng = np.random.default_rng(0)
    now = 1000.0
    running = [Req(i, rng, now) for i in range(n_run)]
    for r in running:
        r.num_computed_tokens = r.num_prompt_tokens
        r.num_output_tokens = 1
        r.num_computed_tokens = r.num_tokens - 1
    waiting = deque(Req(n_run + i, rng, now) for i in range(n_wait))
    drv = PolicyDriver(make_policy(policy))
    board = StatusBoard("bench", InstanceConfig(num_gpu_blocks=4096, max_num_seqs=max(1, n_run)),
                        drv.policy.describe())
    free = 0 if pressure else 1 << 20
    t0 = time.perf_counter()
    for s in range(steps):
        t = now + s * 0.02
        if drv.reorders_waiting:
            drv.order_waiting(waiting, t)
        if drv.picks_victims and running and preemption_possible(running, free, 16):
            drv.rank_victims(running, t)
        board.publish(running, waiting, free, 0, t)
        for r in running:  # one decode step's worth of state change
            r.num_output_tokens += 1
            r.num_computed_tokens += 1
    return (time.perf_counter() - t0) / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", type=int, default=48)
    ap.add_argument("--waiting", type=int, default=100)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--json", type=Path, default=None, help="write the printed figures (µs per step) here")
    a = ap.parse_args()
    rows: dict[str, dict[str, float]] = {}
    print(f"plugin work per engine step, {a.running} running + {a.waiting} waiting requests "
          f"({a.steps} steps):")
    for pol in ("fcfs", "static_class", "edf", "rps"):
        for pressure in (False, True):
            us = bench(pol, a.running, a.waiting, a.steps, pressure)
            tag = "KV pressure (victims ranked)" if pressure else "no KV pressure"
            print(f"  {pol:13s} {tag:29s} {us:9.1f} µs/step")
            rows.setdefault(pol, {})["kv_pressure_us" if pressure else "no_kv_pressure_us"] = us
    if a.json:
        out = {"running": a.running, "waiting": a.waiting, "steps": a.steps, "us_per_step": rows}
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
