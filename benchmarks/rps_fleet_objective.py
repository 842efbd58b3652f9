"""The dispatch objective for a multimodal fleet (issue 15): 4 × the RPS-Serve testbed
(`recipes/rps-serve-testbed-x4.yaml`: rps inside every instance), MH mix at 8 req/s
(2 req/s per instance, the paper's per-GPU rate) for 100 s, **predicted** lengths (the
tagger's default length model), power_of_k k=all on predicted TTFT vs on predicted E2E, and
round_robin as the floor. One process per (objective, seed); figures are virtual time.

    .venv/bin/python benchmarks/rps_fleet_objective.py --seeds 1,2,3 [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ASTRO = str(Path(sys.executable).with_name("astro"))
ARMS = {"ttft": ["--policies", "power_of_k", "--k", "all", "--objective", "ttft"],
        "e2e": ["--policies", "power_of_k", "--k", "all", "--objective", "e2e"],
        "round_robin": ["--policies", "round_robin"]}


def run(arm: str, seed: int) -> dict:
    cmd = [ASTRO, "bench", "--virtual", "--recipe", "rps-serve-testbed-x4", "-w", "mix-mh", "-n", "800",
           "--request-rate", "8", *ARMS[arm], "--seed", str(seed), "--json", "--no-report"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["runs"][0]["metrics"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--json", type=Path, default=None, help="write every run's metrics and the geo-means here")
    a = ap.parse_args()
    geo: dict[str, dict[str, float]] = {}
    seeds = [int(x) for x in a.seeds.split(",")]
    res = {(arm, s): run(arm, s) for s in seeds for arm in ARMS}
    print("| objective | seed | TTFT mean overall / sand / pebbles / rocks (s) | P99 TTFT overall (s) | mean E2E (s) |")
    print("|---|---|---|---|---|")
    for arm in ARMS:
        for s in seeds:
            m = res[(arm, s)]
            print(f"| {arm} | {s} | " + " / ".join(f"{m[g]['ttft_s']['mean']:.3f}" for g in
                                                   ("overall", "sand", "pebbles", "rocks"))
                  + f" | {m['overall']['ttft_s']['p99']:.2f} | {m['overall']['e2e_s']['mean']:.2f} |")
        gm = {g: statistics.geometric_mean([res[(arm, s)][g]["ttft_s"]["mean"] / res[("e2e", s)][g]["ttft_s"]["mean"]
                                            for s in seeds]) for g in ("overall", "sand", "pebbles", "rocks")}
        print(f"| {arm} | geo-mean ÷ e2e | " + " / ".join(f"{gm[g]:.3f}" for g in gm) + " | | |")
        geo[arm] = gm
    if a.json:
        out = {"seeds": seeds, "runs": {arm: {str(s): res[(arm, s)] for s in seeds} for arm in ARMS},
               "ttft_mean_geo_mean_over_e2e": geo}
        a.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
