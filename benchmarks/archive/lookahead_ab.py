"""Look-ahead speed, this build against another one, in one process on the same snapshots.

The other build is a checkout of an earlier commit with its own compiled engine (e.g.
`git archive fe1a52e | tar -x -C /tmp/base` and `pip install -e /tmp/base` in a second
venv, which compiles it). Its `sim/lookahead.py` and engine build are loaded under other
module names beside this install's (the rest of the package is this install's: the
comparison is of the look-ahead alone). Both time `predict` on the snapshots of
benchmarks/lookahead_speed.py (same seed, same cell), interleaved snapshot by snapshot
(alternating which goes first), each on its own warm `LatencyModel`, and every estimate
is checked equal between the two.

Prints, per repeat: median µs of each, wall clock and process CPU time (per snapshot the
fastest of `--passes` timings; the machine is shared, so this trims waits for a core),
and their ratios; then the median ratio and its spread over the repeats.

    .venv/bin/python benchmarks/archive/lookahead_ab.py --base /tmp/base [--repeats 5] [--snapshots 200]
        [--running 48] [--waiting 200] [--policy fcfs]
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np

from rps_astro_cli.policies.build import build_instance_policy
from rps_astro_cli.sim import lookahead
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.profile import load_profile
from rps_astro_cli.types import InstanceConfig


def _sibling(name: str) -> ModuleType:
    """The benchmark script `benchmarks/<name>.py` as module `name` (benchmarks/ is no package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_ls = _sibling("lookahead_speed")
load_lengths, make_snapshot = _ls.load_lengths, _ls.make_snapshot


class _BaseEngineFinder(importlib.abc.MetaPathFinder):
    """`rps_astro_cli.sim.jump` (and its `jump__mypyc` library): the base checkout's files."""

    def __init__(self, sim_dir: Path) -> None:
        self.sim_dir = sim_dir

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        head, _, name = fullname.rpartition(".")
        if head != "rps_astro_cli.sim" or name not in ("jump", "jump__mypyc"):
            return None
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            f = self.sim_dir / f"{name}{suffix}"
            if f.exists():
                return importlib.util.spec_from_file_location(fullname, f)
        f = self.sim_dir / f"{name}.py"
        return importlib.util.spec_from_file_location(fullname, f) if f.exists() else None


_MOVED = {
    "rps_astro_cli.policies.base": "rps_astro_cli.sim.policy",
    "rps_astro_cli.policies.fcfs": "rps_astro_cli.sim.fcfs",
    "rps_astro_cli.status": "rps_astro_cli.sim.status",
}


def load_base(base: Path) -> ModuleType:
    """The base checkout's `sim/lookahead.py` (as `rps_astro_cli.sim._lookahead_base`),
    with its engine (`sim/jump.py`, its build when current)."""
    sim_dir = base / "src" / "rps_astro_cli" / "sim"
    if not (sim_dir / "jump.py").exists():
        raise SystemExit(f"--base {base}: no src/rps_astro_cli/sim/jump.py (a checkout before the engine package)")
    sys.meta_path.insert(0, _BaseEngineFinder(sim_dir))
    # modules the base imported that have moved since (issue 12 layers): the same classes
    for old, new in _MOVED.items():
        if importlib.util.find_spec(old.rpartition(".")[0]) is not None and old not in sys.modules:
            try:
                importlib.import_module(old)
            except ModuleNotFoundError:
                sys.modules[old] = importlib.import_module(new)
    spec = importlib.util.spec_from_file_location("rps_astro_cli.sim._lookahead_base", sim_dir / "lookahead.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=Path, required=True, help="checkout of the commit to compare with (built)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--passes", type=int, default=3, help="timings per snapshot per repeat (fastest kept)")
    ap.add_argument("--snapshots", type=int, default=200)
    ap.add_argument("--running", type=int, default=48)
    ap.add_argument("--waiting", type=int, default=200)
    ap.add_argument("--profile", default="llama-2-7b-a30")
    ap.add_argument("--policy", default="fcfs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write every repeat's medians and the ratios here")
    args = ap.parse_args()
    base = load_base(args.base)
    prof = load_profile(args.profile)
    cfg = InstanceConfig.from_profile(prof)
    policy = build_instance_policy(args.policy, None, prof)
    rng = np.random.default_rng(args.seed)
    lengths = load_lengths()
    # lookahead_speed.py draws the (8, *) cells first; skip to this cell's snapshots
    for n_run in (8, 48):
        for n_wait in (0, 50, 200):
            snaps = [make_snapshot(lengths, cfg, n_run, n_wait, rng) for _ in range(args.snapshots)]
            if (n_run, n_wait) == (args.running, args.waiting):
                break
        else:
            continue
        break
    arms = {"base": base.predict, "new": lookahead.predict}
    lats = {k: LatencyModel(prof) for k in arms}
    for st, cand in snaps:  # warm both memos; the two must agree exactly
        a, b = (arms[k](st, cand, lats[k], policy) for k in ("base", "new"))
        assert (a.ttft_s, a.e2e_s, a.steps_simulated, a.events) == (b.ttft_s, b.e2e_s, b.steps_simulated, b.events)
    print(f"{args.running} running / {args.waiting} waiting, {args.policy}, {args.snapshots} snapshots; "
          f"base {args.base} (engine {'build' if base.NATIVE else 'source'}), "
          f"new (engine {'build' if lookahead.NATIVE else 'source'}); estimates equal on every snapshot")
    print(f"{'repeat':>6} | {'base med µs':>11} {'new med µs':>10} {'new/base':>8} | "
          f"{'base cpu µs':>11} {'new cpu µs':>10} {'new/base':>8}")
    ratios: dict[str, list[float]] = {"wall": [], "cpu": []}
    meds: dict[str, list[float]] = {f"{k}_{c}_median_us": [] for k in arms for c in ratios}
    for rep in range(args.repeats):
        best = {(k, c): [float("inf")] * len(snaps) for k in arms for c in ratios}
        for p in range(args.passes):
            for i, (st, cand) in enumerate(snaps):
                order = ("base", "new") if (i + p + rep) % 2 == 0 else ("new", "base")
                for k in order:
                    c0 = time.process_time()
                    t0 = time.perf_counter()
                    arms[k](st, cand, lats[k], policy)
                    wall, cpu = (time.perf_counter() - t0) * 1e6, (time.process_time() - c0) * 1e6
                    best[k, "wall"][i] = min(best[k, "wall"][i], wall)
                    best[k, "cpu"][i] = min(best[k, "cpu"][i], cpu)
        row = []
        for c in ("wall", "cpu"):
            mb, mn = float(np.median(best["base", c])), float(np.median(best["new", c]))
            ratios[c].append(mn / mb)
            meds[f"base_{c}_median_us"].append(mb)
            meds[f"new_{c}_median_us"].append(mn)
            row.append(f"{mb:>11.0f} {mn:>10.0f} {mn / mb:>8.3f}")
        print(f"{rep:>6} | {row[0]} | {row[1]}", flush=True)
    for c, rs in ratios.items():
        print(f"median ratio new/base ({c}) {np.median(rs):.3f} (min {min(rs):.3f}, max {max(rs):.3f}, "
              f"{args.repeats} repeats)")
    if args.json:
        out = {"base": str(args.base), "running": args.running, "waiting": args.waiting, "policy": args.policy,
               "profile": args.profile, "snapshots": args.snapshots, "per_repeat": meds,
               "ratio_new_over_base": {c: {"median": float(np.median(rs)), "min": min(rs), "max": max(rs)}
                                       for c, rs in ratios.items()}}
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
