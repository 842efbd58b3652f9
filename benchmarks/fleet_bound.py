#!/usr/bin/env python3
"""The most a fleet can serve, whatever the dispatcher: each instance's saturated service
rate, summed over the fleet (issue 31, the heterogeneous fleet's SLO-capacity goal).

For each distinct instance of a recipe (its group's profile and engine settings), one
such instance alone runs in the virtual cluster with a backlog: `-n` requests of the
workload arriving far faster than it serves (`--rate`, default 500 req/s). Its service
rate is the completions per second over the middle of its makespan (from 20 % to 80 %
of the last finish: the backlog is full there, neither filling nor draining). The
fleet's bound is Σ count × rate: at any higher arrival rate some instance's queue grows
without end, so no dispatcher's SLO capacity can exceed it for long (a short run can: its
queues have not built yet — `astro bench --capacity` warns about such probes).

    ASTRO_DATA_DIR=… .venv/bin/python benchmarks/fleet_bound.py \\
        --recipe hetero-2xa100-2xa30-llama2-7b -w sharegpt -n 3000 --seed 0

Prints one line per instance kind and the fleet's bound; `--json F` writes them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.services.config import GROUP_OVERRIDES, instance_specs, load_recipe


def window_rate(finish_s: list[float], lo: float = 0.2, hi: float = 0.8) -> float:
    """Completions per second between `lo` and `hi` of the last finish time (a saturated
    instance's service rate, its fill and drain left out)."""
    if not finish_s:
        raise ValueError("no request finished")
    end = max(finish_s)
    a, b = lo * end, hi * end
    return sum(1 for t in finish_s if a <= t < b) / (b - a)


def single_instance_recipes(recipe: str) -> list[tuple[int, dict[str, Any]]]:
    """(count, a one-instance recipe) per distinct instance of `recipe`: its group's
    profile and engine overrides, everything else as the recipe has it."""
    cfg = load_recipe(recipe)
    base = cfg.model_dump(mode="json", exclude_none=True)
    kinds: dict[str, tuple[int, dict[str, Any]]] = {}
    for spec in instance_specs(cfg):
        group = {k: v for k, v in spec.engine.model_dump(mode="json").items() if k in GROUP_OVERRIDES and v is not None}
        key = json.dumps(group, sort_keys=True)
        if key not in kinds:
            kinds[key] = (0, {**base, "name": f"{cfg.name}-one-{len(kinds)}", "instances": [{"count": 1, **group}]})
        count, one = kinds[key]
        kinds[key] = (count + 1, one)
    return list(kinds.values())


def saturated_rate(one: dict[str, Any], workload: str, n: int, rate: float, seed: int, tmp: Path) -> float:
    """The service rate of `one` (a one-instance recipe) under a backlog (module docstring)."""
    rp = tmp / f"{one['name']}.yaml"
    rp.write_text(yaml.safe_dump(one))
    out = tmp / one["name"]
    cmd = [sys.executable, "-m", "rps_astro_cli.cli.main", "bench", "--virtual", "--recipe", str(rp), "-w", workload,
           "-n", str(n), "--request-rate", str(rate), "--policies", "round_robin", "--seed", str(seed),
           "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise AstroUserError(f"astro bench failed for {one['instances'][0]}: {done.stderr.strip()[-500:]}")
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines() if line.strip()]
    return window_rate([r["finish_s"] for r in rows if r.get("success")])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", required=True, help="recipe name or path (its instances: groups)")
    ap.add_argument("-w", "--workload", default="sharegpt")
    ap.add_argument("-n", type=int, default=3000, help="requests of the backlog")
    ap.add_argument("--rate", type=float, default=500.0, help="arrival rate, far above one instance's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the rates here")
    a = ap.parse_args(argv)
    try:
        kinds = single_instance_recipes(a.recipe)
        with tempfile.TemporaryDirectory() as d:
            rows = []
            for count, one in kinds:
                r = saturated_rate(one, a.workload, a.n, a.rate, a.seed, Path(d))
                rows.append({"count": count, "instance": one["instances"][0], "service_rate_rps": r})
                g = one["instances"][0]
                limits = ", ".join(f"{k} {v}" for k, v in g.items() if k not in ("count", "profile"))
                print(f"{count} × {g.get('profile')} ({limits}): {r:.3f} req/s each", flush=True)
    except AstroUserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    bound = sum(x["count"] * x["service_rate_rps"] for x in rows)
    print(f"fleet bound: {bound:.2f} req/s")
    if a.json is not None:
        a.json.write_text(json.dumps({"recipe": a.recipe, "workload": a.workload, "n": a.n, "seed": a.seed,
                                      "kinds": rows, "fleet_bound_rps": bound}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
