"""RPS-Serve at the paper's operating point (issue 15): the acceptance command

    astro bench --virtual --recipe rps-serve-testbed -w mix-mh --request-rate 2 \\
        --instance-policies fcfs,rps --seed S --json

for several seeds, memory variants (100 / 50 / 25 %: rps-serve-testbed, -50, -25), rates
and mixes, and the mean change of rps vs fcfs in sand and overall mean TTFT (paper:
−78.5 % sand, −54 % overall), sand preemptions under rps and sand TTFT under rps at 25 %
(paper: < 1 s). Run from the repository root:

    .venv/bin/python benchmarks/rps_testbed.py --seeds 1,2,3,4,5,6,7,8
    .venv/bin/python benchmarks/rps_testbed.py --seeds 1,2,3 --rates 1,2,3 --recipes rps-serve-testbed \\
        --workloads mix-mh,mix-50-30-20,mix-60-30-10,mix-70-20-10 --summary-only

Each (recipe, workload, rate, seed) is one `astro bench` process running fcfs and rps on
identical traffic (same workload and arrival seed), so every change is a ratio inside
one run. A run lasts the authors' 100 s of arrivals: n = 100 × rate requests.

Two TTFTs (docs/metrics.md): "client" from the request's send (Poisson arrival), and
"harness" as the authors' llmperf counts it (from the engine's arrival stamp: own input
processing + queue + first scheduling to first token). The testbed recipes model the
harness's single AsyncLLM event loop (`engine.preprocess_slots: 1`), so the client TTFT
also holds the wait behind other requests' preprocessing.

Stationarity: a run is flagged "growing" when FCFS's mean client TTFT over the last third
of the sends is more than twice that over the first third (a queue that grows through the
run: its percentages depend on the run length).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ASTRO = str(Path(sys.executable).with_name("astro"))


def run(recipe: str, workload: str, rate: float, seed: int, extra: list[str]) -> dict:
    n = int(round(100 * rate))
    with tempfile.TemporaryDirectory() as out:
        cmd = [ASTRO, "bench", "--virtual", "--recipe", recipe, "-w", workload, "--request-rate", f"{rate:g}",
               "-n", str(n), "--instance-policies", "fcfs,rps", "--seed", str(seed), "--json", "--out", out, *extra]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=True).stdout
        rep = json.loads(res.strip().splitlines()[-1])
        rows = [json.loads(x) for x in (Path(out) / "requests.jsonl").read_text().splitlines() if x.strip()]
    by = {r["instance_policy"]: r["metrics"] for r in rep["runs"]}
    fcfs_rows = sorted((r for r in rows if r["run"].startswith("fcfs")), key=lambda r: r["sent_s"])
    third = max(1, len(fcfs_rows) // 3)
    first = [r["ttft_s"] for r in fcfs_rows[:third] if r["ttft_s"] is not None]
    last = [r["ttft_s"] for r in fcfs_rows[-third:] if r["ttft_s"] is not None]
    growth = (statistics.mean(last) / statistics.mean(first)) if first and last and statistics.mean(first) > 0 \
        else None
    cmd_txt = " ".join(c for c in cmd[1:] if not c.startswith("/tmp"))
    # mean client TTFT by modality (the same requests under both policies, whatever class a
    # smart classifier gave them): text / image / video
    by_mod = {}
    for pol in ("fcfs", "rps"):
        for mod in ("text", "image", "video"):
            v = [r["ttft_s"] for r in rows if r["run"].startswith(pol) and r["modality"] == mod
                 and r["ttft_s"] is not None]
            by_mod[f"{pol}_{mod}"] = statistics.mean(v) if v else None
    return {"cmd": cmd_txt.replace("--out ", ""), "fcfs": by["fcfs"], "rps": by["rps"], "fcfs_growth": growth,
            "ttft_by_modality": by_mod}


def _t(m: dict, g: str, key: str = "ttft_s") -> float | None:
    return ((m.get(g) or {}).get(key) or {}).get("mean")


def _d(f: dict, p: dict, g: str, key: str = "ttft_s") -> float | None:
    x, y = _t(f, g, key), _t(p, g, key)
    return None if not x or y is None else 100 * (y / x - 1)


def fmt(v: float | None, unit: str = " %") -> str:
    return "n/a" if v is None else f"{v:+.1f}{unit}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--rates", default="2")
    ap.add_argument("--recipes", default="rps-serve-testbed,rps-serve-testbed-50,rps-serve-testbed-25")
    ap.add_argument("--workloads", default="mix-mh")
    ap.add_argument("--workers", type=int, default=2, help="astro processes at once")
    ap.add_argument("--summary-only", action="store_true", help="print only the per-configuration mean rows")
    ap.add_argument("--json", "--json-out", dest="json_out", help="write every run's figures here")
    ap.add_argument("extra", nargs="*", help="more astro bench flags (after --), e.g. --instance-param K=V")
    a = ap.parse_args()
    seeds = [int(x) for x in a.seeds.split(",")]
    confs = [(rc, w, float(r)) for rc in a.recipes.split(",") for w in a.workloads.split(",")
             for r in a.rates.split(",")]
    jobs = [(c, s) for c in confs for s in seeds]
    with ThreadPoolExecutor(a.workers) as pool:
        results = list(pool.map(lambda j: run(*j[0], j[1], a.extra), jobs))
    print("| recipe | mix | req/s | seed | sand TTFT fcfs → rps (s) | Δ sand | Δ sand (harness) | overall TTFT "
          "fcfs → rps (s) | Δ overall | Δ overall (harness) | pebbles Δ | rocks Δ | sand preempt rps | "
          "FCFS TTFT last/first third | Δ text (by modality) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    dump = []
    for ci, (recipe, wl, rate) in enumerate(confs):
        rs = results[ci * len(seeds):(ci + 1) * len(seeds)]
        cols: dict[str, list[float]] = {k: [] for k in ("s", "sh", "o", "oh", "ps", "growth", "txt")}
        for seed, r in zip(seeds, rs):
            f, p = r["fcfs"], r["rps"]
            row = {"s": _d(f, p, "sand"), "sh": _d(f, p, "sand", "ttft_harness_s"), "o": _d(f, p, "overall"),
                   "oh": _d(f, p, "overall", "ttft_harness_s"), "ps": _t(p, "sand"), "growth": r["fcfs_growth"]}
            bm = r["ttft_by_modality"]
            ft, rt = bm["fcfs_text"], bm["rps_text"]
            row["txt"] = (100 * (rt / ft - 1)) if ft and rt is not None else None
            for k, v in row.items():
                if v is not None:
                    cols[k].append(v)
            dump.append({"recipe": recipe, "workload": wl, "rate": rate, "seed": seed, **r})
            if not a.summary_only:
                g = r["fcfs_growth"]
                print(f"| {recipe} | {wl} | {rate:g} | {seed} | {_t(f, 'sand'):.3f} → {_t(p, 'sand'):.3f} | "
                      f"{fmt(row['s'])} | {fmt(row['sh'])} | {_t(f, 'overall'):.3f} → {_t(p, 'overall'):.3f} | "
                      f"{fmt(row['o'])} | {fmt(row['oh'])} | {fmt(_d(f, p, 'pebbles'))} | {fmt(_d(f, p, 'rocks'))} | "
                      f"{(p.get('sand') or {}).get('preemptions')} | "
                      f"{'n/a' if g is None else f'{g:.1f}×' + (' growing' if g > 2 else '')} | {fmt(row['txt'])} |",
                      flush=True)

        def mm(k: str, cols=cols) -> str:
            v = cols[k]
            return "n/a" if not v else f"**{statistics.mean(v):+.1f} %** ({min(v):+.1f} … {max(v):+.1f})"

        gr = cols["growth"]
        print(f"| {recipe} | {wl} | {rate:g} | **mean {len(rs)}** | rps sand {statistics.mean(cols['ps']):.3f} s "
              f"({min(cols['ps']):.3f} … {max(cols['ps']):.3f}) | {mm('s')} | {mm('sh')} | | {mm('o')} | {mm('oh')} "
              f"| | | | {'n/a' if not gr else f'{min(gr):.1f}–{max(gr):.1f}×'} | {mm('txt')} |", flush=True)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(dump, indent=1))


if __name__ == "__main__":
    main()
