"""CPU µs per dispatch decision (`candidates` + `choose`, predictions given, no RPC) on
12 instances, for each dispatch policy: the cost of the dispatch pipeline itself.

CPU time (`time.process_time`, min of 7 repeats of 2,000 decisions), so other jobs on
the machine do not inflate it. It imports nothing newer than the pre-pipeline API, so
the same script measures an older tree for a before/after ratio:

    .venv/bin/python benchmarks/dispatch_decision_cost.py [--json PATH]
    mkdir /tmp/base && git archive fe1a52e src artifacts | tar -x -C /tmp/base
    (cd /tmp/base && PYTHONPATH=src "$OLDPWD/.venv/bin/python" "$OLDPWD/benchmarks/dispatch_decision_cost.py")
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from rps_astro_cli.dispatch import make_dispatch
from rps_astro_cli.types import InstanceLoad

try:
    from rps_astro_cli.types import LatencyEstimate
except ImportError:  # before the value types moved (issue 12)
    from rps_astro_cli.sim.lookahead import LatencyEstimate  # type: ignore[no-redef]

POLICIES = (("round_robin", {}), ("least_requests", {}), ("llumnix", {}), ("power_of_k", {"k": 2, "objective": "e2e", "kv_reserve_frac": 0.0,
                                                                         "tie_tolerance_s": 0.0}))


def decision_cost_us(name: str, params: dict, n: int = 2000, repeats: int = 7) -> float:
    """Min over `repeats` of the mean CPU µs of one decision (see module docstring)."""
    rng = np.random.default_rng(0)
    loads = [InstanceLoad(i, True, int(rng.integers(0, 20)), int(rng.integers(0, 1000)), 1056,
                          int(rng.integers(0, 48)), int(rng.integers(0, 10)), int(rng.integers(0, 200)))
             for i in range(12)]
    preds = {i: LatencyEstimate(0.1 * i, 1.0 + (i * 7 % 12), 0, 0) for i in range(12)}
    p = make_dispatch(name, **params)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(n):
            cands = p.candidates(loads, rng)
            p.choose(loads, cands, {i: preds[i] for i in cands} if "predictions" in p.inputs else {}, rng)
        best = min(best, (time.process_time() - t0) / n * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the printed figures (µs per policy) here")
    args = ap.parse_args()
    cost = {name: decision_cost_us(name, params) for name, params in POLICIES}
    print("  ".join(f"{name} {us:.1f} µs" for name, us in cost.items()))
    if args.json:
        args.json.write_text(json.dumps({"decision_cpu_us": cost}, indent=1) + "\n")


if __name__ == "__main__":
    main()
