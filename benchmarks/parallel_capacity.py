"""Wall time of the Astrolabe SLO-capacity command (BENCHMARKS.md "SLO capacity"), serial
vs `--executor ray`, arms interleaved, each run a fresh `astro bench` process.

Arms: `serial` (the command as it was), `ray` (every probe a Ray task; the same
search, width 1: the four policy variants' searches advance together, one rate each per
round), `ray-wN` (N rates per variant per round, `--capacity-width N`). Per run: wall
time (s, the whole process: Ray's start included), probes, rounds (a round = one batch
handed to the executor; serial: one per probe), and each variant's capacity. Checks that
the serial and width-1 ray capacities and probe lists are identical, and that a width-N
capacity is within the search tolerance of the serial one.

Usage:
  nice -n 10 .venv/bin/python benchmarks/parallel_capacity.py --repeats 3 \\
      --arms serial,ray,ray-w2 --out /tmp/parallel_capacity.json
  (-n 1000 etc. for a quick check; default the BENCHMARKS.md command's 5,000 requests)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ASTRO = str(Path(sys.executable).with_name("astro"))


def command(n: int, arm: str, workers: int | None) -> list[str]:
    cmd = [ASTRO, "bench", "--virtual", "--instances", "12", "--profile", "llama-2-7b-a30", "-w", "length-trace",
           "-n", str(n), "--max-total-tokens", "4096", "--policies", "round_robin,llumnix,power_of_k",
           "--k", "2,all", "--oracle-lengths", "--capacity", "--capacity-threshold", "10",
           "--capacity-start-rate", "16", "--no-report", "--json"]
    if arm.startswith("ray"):
        cmd += ["--executor", "ray"] + (["--workers", str(workers)] if workers else [])
        if "-w" in arm:
            cmd += ["--capacity-width", arm.split("-w")[1]]
    return cmd


def rounds_of(cap: dict) -> int:
    return cap.get("rounds") or len(cap["probes"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=5000, help="requests per run (the command's 5,000)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default="serial,ray,ray-w2")
    ap.add_argument("--workers", type=int, default=None, help="local Ray CPUs (default: all cores)")
    ap.add_argument("--out", "--json", dest="out", type=Path, default=None, help="write the figures here (JSON)")
    args = ap.parse_args()
    arms = args.arms.split(",")
    rows = []
    for rep in range(args.repeats):
        for arm in arms:
            t0 = time.perf_counter()
            cp = subprocess.run(command(args.n, arm, args.workers), capture_output=True, text=True, timeout=3600)
            wall = time.perf_counter() - t0
            if cp.returncode not in (0, 3):
                sys.exit(f"{arm}: exit {cp.returncode}: {cp.stderr[-2000:]}")
            rep_json = json.loads(next(x for x in cp.stdout.splitlines() if x.startswith("{")))
            caps = rep_json["capacity"]
            row = {"repeat": rep, "arm": arm, "wall_s": wall, "probes": sum(len(c["probes"]) for c in caps),
                   # rounds of the executor: the variants advance together, so the slowest variant's count
                   "rounds": (sum(rounds_of(c) for c in caps) if arm == "serial" else max(rounds_of(c) for c in caps)),
                   "capacity": {c["label"]: c["capacity_rps"] for c in caps},
                   "probe_rates": {c["label"]: [p["rate_rps"] for p in c["probes"]] for c in caps}}
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "probe_rates"}), flush=True)
    summary = {}
    for arm in arms:
        walls = [r["wall_s"] for r in rows if r["arm"] == arm]
        summary[arm] = {"wall_s_median": statistics.median(walls), "wall_s_min": min(walls), "wall_s_max": max(walls),
                        "runs": len(walls)}
    base = [r for r in rows if r["arm"] == "serial"]
    for arm in arms:
        if arm == "serial" or not base:
            continue
        ratios = [b["wall_s"] / r["wall_s"] for b, r in zip(base, [r for r in rows if r["arm"] == arm])]
        summary[arm]["speedup_vs_serial_per_repeat"] = ratios
        summary[arm]["speedup_median"] = statistics.median(ratios)
        one = next(r for r in rows if r["arm"] == arm)
        if "-w" not in arm:
            summary[arm]["identical_to_serial"] = (one["capacity"] == base[0]["capacity"]
                                                   and one["probe_rates"] == base[0]["probe_rates"])
        else:
            summary[arm]["max_relative_gap_vs_serial"] = max(
                abs(one["capacity"][k] - v) / v for k, v in base[0]["capacity"].items() if v)
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"n": args.n, "rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
