"""Look-ahead speed, this checkout against another one, each arm in its own process.

For changes that span the look-ahead engine (`sim/lookahead_engine/`, compiled by mypyc)
and the instance policies, which one process cannot hold twice: each arm runs the whole
package of its checkout (`PYTHONPATH=<checkout>/src`, with its own build: `pip install
-e` there, or `python setup.py build_ext --inplace` in it with this venv's Python). Both
arms time `predict` on the same snapshots (`lookahead_speed.make_snapshot` of this
checkout, same seed and cell), best of `--passes` timings per snapshot (process CPU time
and wall clock; the machine is shared), and report the median. Arms alternate run by
run (base, new, new, base, base, new, ...): each repeat's ratio is new / base of one
adjacent pair; the summary is the median ratio over the repeats and its spread. The
estimates of the two arms are compared snapshot by snapshot (TTFT, E2E, steps): beyond
a relative 1e-9, and bit for bit.

    .venv/bin/python benchmarks/lookahead_ab_proc.py --base /tmp/base [--repeats 5]
        [--profile llava-onevision-7b-a100] [--policy rps] [--mix 0.4,0.2] [--labelled]
        [--running 48] [--waiting 200] [--snapshots 100] [--passes 3]

`--labelled`: the snapshot's requests carry the class the policy gives them
(`req_class`), as an engine's `/status` reports them to its Predictor; without it the
look-ahead classifies them itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def worker(args: argparse.Namespace) -> None:
    """One arm: time the look-ahead on the cell's snapshots; JSON to stdout."""
    import numpy as np
    from lookahead_speed import label_snapshot, load_lengths, make_snapshot  # a sibling: run as a script

    from rps_astro_cli.policies.build import build_instance_policy
    from rps_astro_cli.sim import lookahead
    from rps_astro_cli.sim.latency import LatencyModel
    from rps_astro_cli.sim.profile import load_profile
    from rps_astro_cli.types import InstanceConfig

    prof = load_profile(args.profile)
    cfg = InstanceConfig.from_profile(prof)
    policy = build_instance_policy(args.policy, None, prof)
    mix = tuple(float(x) for x in args.mix.split(","))
    rng = np.random.default_rng(args.seed)
    lengths = load_lengths()
    snaps = [make_snapshot(lengths, cfg, args.running, args.waiting, rng, mix) for _ in range(args.snapshots)]
    if args.labelled:
        snaps = [label_snapshot(s, policy) for s in snaps]
    lat = LatencyModel(prof)
    est = [lookahead.predict(st, c, lat, policy) for st, c in snaps]  # warm the memo
    wall = [float("inf")] * len(snaps)
    cpu = [float("inf")] * len(snaps)
    for _ in range(args.passes):
        for i, (st, c) in enumerate(snaps):
            c0 = time.process_time()
            t0 = time.perf_counter()
            lookahead.predict(st, c, lat, policy)
            wall[i] = min(wall[i], (time.perf_counter() - t0) * 1e6)
            cpu[i] = min(cpu[i], (time.process_time() - c0) * 1e6)
    json.dump({"native": bool(lookahead.NATIVE), "wall_us": wall, "cpu_us": cpu,
               "est": [(e.ttft_s, e.e2e_s, e.steps_simulated) for e in est]}, sys.stdout)


def run_arm(src: Path, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, __file__, "--worker", *(f"--{k}={v}" for k, v in (
        ("profile", args.profile), ("policy", args.policy), ("mix", args.mix), ("running", args.running),
        ("waiting", args.waiting), ("snapshots", args.snapshots), ("passes", args.passes), ("seed", args.seed)))]
    if args.labelled:
        cmd.append("--labelled")
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"arm {src} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, help="checkout of the commit to compare with (built)")
    ap.add_argument("--new", type=Path, default=HERE.parent, help="the other checkout (default: this one)")
    ap.add_argument("--repeats", type=int, default=5, help="runs of each arm")
    ap.add_argument("--passes", type=int, default=3, help="timings per snapshot per run (fastest kept)")
    ap.add_argument("--snapshots", type=int, default=100)
    ap.add_argument("--running", type=int, default=48)
    ap.add_argument("--waiting", type=int, default=200)
    ap.add_argument("--profile", default="llava-onevision-7b-a100")
    ap.add_argument("--policy", default="rps")
    ap.add_argument("--mix", default="0.4,0.2", help="IMAGE,VIDEO fractions (lookahead_speed.py --mix); "
                    "default 40 %% image, 20 %% video: RPS-Serve's MH mix")
    ap.add_argument("--labelled", action="store_true", help="requests carry their class, as /status reports it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write every repeat's medians and the ratios here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.base is None:
        raise SystemExit("--base: the checkout to compare with is required")
    import numpy as np

    arms = {"base": args.base.resolve() / "src", "new": args.new.resolve() / "src"}
    print(f"{args.running} running / {args.waiting} waiting, {args.policy} on {args.profile}, mix {args.mix}"
          f"{' (labelled)' if args.labelled else ''}, {args.snapshots} snapshots, best of {args.passes}; "
          f"base {args.base}, new {args.new}")
    print(f"{'repeat':>6} | {'base cpu µs':>11} {'new cpu µs':>10} {'new/base':>8} | "
          f"{'base wall µs':>12} {'new wall µs':>11} {'new/base':>8} | estimates differ")
    ratios: dict[str, list[float]] = {"cpu": [], "wall": []}
    meds: dict[tuple[str, str], list[float]] = {(a, c): [] for a in arms for c in ratios}
    differ: list[int] = []
    for rep in range(args.repeats):
        order = ("base", "new") if rep % 2 == 0 else ("new", "base")
        res = {a: run_arm(arms[a], args) for a in order}
        for a in arms:
            if not res[a]["native"]:
                print(f"warning: arm {a} ran its interpreted engine (no current build)")
        row = []
        for c in ("cpu", "wall"):
            mb, mn = float(np.median(res["base"][f"{c}_us"])), float(np.median(res["new"][f"{c}_us"]))
            ratios[c].append(mn / mb)
            meds["base", c].append(mb)
            meds["new", c].append(mn)
            row.append(f"{mb:>11.0f} {mn:>10.0f} {mn / mb:>8.3f}")
        pairs = list(zip(res["base"]["est"], res["new"]["est"]))
        ndiff = sum(1 for x, y in pairs
                    if x[2] != y[2] or abs(x[0] - y[0]) > 1e-9 * abs(x[0]) or abs(x[1] - y[1]) > 1e-9 * abs(x[1]))
        nbits = sum(1 for x, y in pairs if tuple(x) != tuple(y))  # not equal bit for bit
        print(f"{rep:>6} | {row[0]} | {row[1]:>1} | {ndiff} of {args.snapshots} ({nbits} not bit for bit)",
              flush=True)
        differ.append(ndiff)
    for c, rs in ratios.items():
        print(f"{c}: base median {np.median(meds['base', c]):.0f} µs, new {np.median(meds['new', c]):.0f} µs; "
              f"ratio new/base median {np.median(rs):.3f} (min {min(rs):.3f}, max {max(rs):.3f}, "
              f"{args.repeats} repeats)")
    if args.json:
        out = {"base": str(args.base), "new": str(args.new), "running": args.running, "waiting": args.waiting,
               "policy": args.policy, "profile": args.profile, "mix": args.mix, "labelled": args.labelled,
               "snapshots": args.snapshots, "estimates_differ_per_repeat": differ,
               "per_repeat": {f"{a}_{c}_median_us": v for (a, c), v in meds.items()},
               "ratio_new_over_base": {c: {"median": float(np.median(rs)), "min": min(rs), "max": max(rs)}
                                       for c, rs in ratios.items()}}
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
