"""RPS-Serve at the paper's operating point (issue 15): the acceptance command

    astro bench --virtual --recipe rps-serve-testbed -w mix-mh --request-rate 2 \\
        --instance-policies fcfs,rps --seed S --json

for several seeds and the three memory variants (100 / 50 / 25 %: rps-serve-testbed,
-50, -25), and the mean change of rps vs fcfs in sand and overall mean TTFT (paper:
−78.5 % sand, −54 % overall), sand preemptions under rps and sand TTFT under rps at 25 %
(paper: < 1 s). Run from the repository root:

    .venv/bin/python benchmarks/rps_testbed.py --seeds 1,2,3
    .venv/bin/python benchmarks/rps_testbed.py --seeds 1,2,3 --rates 1,2,3 --recipes rps-serve-testbed

Each (recipe, rate, seed) is one `astro bench` process running fcfs and rps on identical
traffic (same workload and arrival seed), so every change is a ratio inside one run. TTFT
is from arrival at the engine (virtual time; the request's own preprocessing counts, no
shared API-server queue is modelled, so this is also the harness's TTFT).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ASTRO = str(Path(sys.executable).with_name("astro"))


def run(recipe: str, rate: float, seed: int, n: int, workload: str) -> dict:
    cmd = [ASTRO, "bench", "--virtual", "--recipe", recipe, "-w", workload, "--request-rate", f"{rate:g}",
           "-n", str(n), "--instance-policies", "fcfs,rps", "--seed", str(seed), "--json", "--no-report"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    rep = json.loads(out.strip().splitlines()[-1])
    by = {r["instance_policy"]: r["metrics"] for r in rep["runs"]}
    return {"cmd": " ".join(cmd[1:]), "fcfs": by["fcfs"], "rps": by["rps"]}


def fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.1f} %"


def _ttft(m: dict, g: str) -> float | None:
    return (m.get(g) or {}).get("ttft_s", {}).get("mean")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--rates", default="2")
    ap.add_argument("--recipes", default="rps-serve-testbed,rps-serve-testbed-50,rps-serve-testbed-25")
    ap.add_argument("-n", type=int, default=200, help="requests (200 at 2 req/s = the authors' 100 s)")
    ap.add_argument("-w", "--workload", default="mix-mh")
    a = ap.parse_args()
    print("| recipe | req/s | seed | sand TTFT fcfs → rps (s) | Δ sand | overall TTFT fcfs → rps (s) | Δ overall "
          "| pebbles Δ | rocks Δ | sand preempt rps | failed (fcfs/rps) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for recipe in a.recipes.split(","):
        for rate in (float(x) for x in a.rates.split(",")):
            ds, do = [], []
            for seed in (int(x) for x in a.seeds.split(",")):
                r = run(recipe, rate, seed, a.n, a.workload)
                f, p = r["fcfs"], r["rps"]

                def d(g: str, f=f, p=p) -> float | None:
                    x, y = _ttft(f, g), _ttft(p, g)
                    return None if not x or y is None else 100 * (y / x - 1)

                ds.append(d("sand"))
                do.append(d("overall"))
                print(f"| {recipe} | {rate:g} | {seed} | {_ttft(f, 'sand'):.3f} → {_ttft(p, 'sand'):.3f} | "
                      f"{fmt(ds[-1])} | {_ttft(f, 'overall'):.3f} → {_ttft(p, 'overall'):.3f} | {fmt(do[-1])} | "
                      f"{fmt(d('pebbles'))} | {fmt(d('rocks'))} | {p.get('sand', {}).get('preemptions')} | "
                      f"{f['overall']['num_failed']}/{p['overall']['num_failed']} |", flush=True)
            ok_s = [x for x in ds if x is not None]
            ok_o = [x for x in do if x is not None]
            print(f"| {recipe} | {rate:g} | **mean** | | **{statistics.mean(ok_s):+.1f} %** "
                  f"(min {min(ok_s):+.1f}, max {max(ok_s):+.1f}) | | **{statistics.mean(ok_o):+.1f} %** "
                  f"(min {min(ok_o):+.1f}, max {max(ok_o):+.1f}) | | | | |", flush=True)


if __name__ == "__main__":
    main()
