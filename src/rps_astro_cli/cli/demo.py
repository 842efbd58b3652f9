"""`astro demo`: the README's main job in one command — bring up a whole cluster on the
embedded sim engines (`astro serve`), benchmark it with ShareGPT prompts (`astro bench
--workload sharegpt`: real ones from the sample-data folder, `$ASTRO_DATA_DIR` or
../shared/data; without it the bench falls back to synthetic ShareGPT-like prompts, and
the demo says so on its first line), write the report, stop the cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from rps_astro_cli.cli.common import console, fail, user_errors


def _astro(*args: str) -> list[str]:
    return [sys.executable, "-m", "rps_astro_cli.cli.main", *args]


@user_errors
def demo(
    instances: Annotated[int, typer.Option("--instances", "-n", min=1, max=32, help="Sim engines.")] = 4,
    num_requests: Annotated[int, typer.Option("--num-requests", min=1, help="Requests to send.")] = 200,
    request_rate: Annotated[float, typer.Option("--request-rate", min=0.01, help="Poisson rate (req/s).")] = 8.0,
    policy: Annotated[str, typer.Option("--policy", help="Dispatch policy.")] = "power_of_k",
    profile: Annotated[str, typer.Option("--profile", help="Engine execution profile.")] = "llama-2-7b-a30",
    out: Annotated[Path | None, typer.Option("--out", help="Report folder (default runs/demo-<time>).")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    compare: Annotated[bool, typer.Option("--compare/--no-compare", help="End with astro's dispatch beside the load-aware baselines on the same requests near the fleet's knee (virtual cluster, seconds).")] = True,
) -> None:
    """Serve a sim cluster and benchmark it on ShareGPT prompts (the README's main job).

    Prompts come from the sample-data folder ($ASTRO_DATA_DIR, default ../shared/data);
    without one, synthetic ShareGPT-like prompts are used (said on the first line)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = Path("runs") / f"demo-{stamp}"
    out_dir = out or run_dir / "bench"
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster_json = run_dir / "cluster.json"
    serve_log = run_dir / "serve.log"
    source, warning = data_source()
    # soft_wrap: each stays one line (the data source must be on the first line at any width)
    console.print(f"[bold]astro demo[/]: prompts: {source}; {num_requests} requests at {request_rate} req/s "
                  f"to {instances} sim engines ({profile}), dispatch {policy}", highlight=False, soft_wrap=True)
    if warning:
        console.print(f"[bold yellow]WARNING[/]: {warning}", highlight=False, soft_wrap=True)
    with serve_log.open("w") as log:
        serve = subprocess.Popen(
            _astro("serve", "--instances", str(instances), "--policy", policy, "--profile", profile,
                   "--cluster-json", str(cluster_json), "--run-dir", str(run_dir / "serve")),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while not cluster_json.is_file():
            if serve.poll() is not None:
                fail(f"astro serve exited with code {serve.returncode}; see {serve_log}")
            if time.monotonic() > deadline:
                fail(f"the cluster did not come up within 120 s; see {serve_log}")
            time.sleep(0.2)
        console.print(f"cluster up: endpoints in {cluster_json} (log {serve_log})")
        bench = subprocess.run(
            _astro("bench", "--cluster", str(cluster_json), "--workload", "sharegpt",
                   "--num-requests", str(num_requests), "--request-rate", str(request_rate),
                   "--seed", str(seed), "--out", str(out_dir),
                   # the Astrolabe paper's SLO (TTFT ≤ 10 s), so SLO violations and goodput show
                   "--slo", "ttft:10"),
            env=os.environ.copy(),
        )
        code = bench.returncode
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGINT)
            try:
                serve.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
    if code != 0:
        fail(f"astro bench exited with code {code}", code=code)
    console.print(f"[bold green]done[/]: report in {out_dir}")
    if compare:
        side_by_side(instances, profile, policy, seed, out_dir.parent / "side-by-side")


# requests per second per instance near a 4 × A30 ShareGPT fleet's knee: its SLO capacity is
# about 2.2–2.4 req/s per instance with predicted lengths (BENCHMARKS, "Dispatch with predicted
# lengths"); a bit below it queues form and dispatch matters
KNEE_RPS_PER_INSTANCE = 2.15
BASELINES = ("llumnix", "least_requests")


def side_by_side(instances: int, profile: str, policy: str, seed: int, out: Path,
                 num_requests: int = 1500) -> None:
    """astro's dispatch beside the load-aware baselines on the same requests, in the
    virtual cluster (the sim engines' own step model, predicted lengths) near the knee:
    P99 and mean TTFT per policy and the ratio to the better baseline, in the last lines.
    Never fails the demo (a failure is one line)."""
    import json

    rate = round(KNEE_RPS_PER_INSTANCE * instances, 2)
    policies = [*BASELINES, policy] if policy not in BASELINES else [*BASELINES, "power_of_k"]
    log = out.parent / "side-by-side.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        r = subprocess.run(_astro("bench", "--virtual", "--workload", "sharegpt", "--num-requests", str(num_requests),
                                  "--request-rate", str(rate), "--policies", ",".join(policies),
                                  "--instances", str(instances), "--profile", profile, "--seed", str(seed),
                                  "--slo", "ttft:10", "--out", str(out)),
                           stdout=fh, stderr=subprocess.STDOUT, env=os.environ.copy())
    try:
        runs = json.loads((out / "report.json").read_text())["runs"]
        p99 = {run["label"].split()[0]: run["metrics"]["overall"]["ttft_s"]["p99"] for run in runs}
        mean = {run["label"].split()[0]: run["metrics"]["overall"]["ttft_s"]["mean"] for run in runs}
    except (OSError, ValueError, KeyError, TypeError):
        console.print(f"side by side: not available (astro bench --virtual exited {r.returncode}; see {log})")
        return
    ours = policies[-1]
    best = min(BASELINES, key=lambda b: p99[b])
    console.print(f"[bold]side by side[/] (virtual cluster, {instances} × {profile} sim step model, predicted "
                  f"lengths, the same {num_requests} ShareGPT requests at {rate} req/s, near the fleet's knee):",
                  highlight=False, soft_wrap=True)
    for name in policies:
        console.print(f"  {name:15s} P99 TTFT {p99[name]:7.2f} s   mean TTFT {mean[name]:6.3f} s", highlight=False)
    console.print(f"  {ours} ÷ best baseline ({best}): P99 TTFT ×{p99[ours] / p99[best]:.2f}, mean TTFT "
                  f"×{mean[ours] / mean[best]:.2f}; report {out}", highlight=False, soft_wrap=True)


def data_source() -> tuple[str, str | None]:
    """(where the demo's prompts come from, in words; a loud warning or None), from
    `data_paths.data_dir()` — the folder `astro bench --workload sharegpt` reads."""
    from rps_astro_cli.data_paths import data_dir

    d = data_dir()
    if d is not None:
        return f"real ShareGPT from the sample-data folder {d}", None
    env = os.environ.get("ASTRO_DATA_DIR")
    why = f"ASTRO_DATA_DIR={env} is not a folder" if env else "ASTRO_DATA_DIR is unset and there is no ../shared/data"
    import importlib.util

    hub = importlib.util.find_spec("datasets") is not None  # the optional "hub" extra
    first = "the Hugging Face hub if reachable, else " if hub else ""
    return (f"{first}SYNTHETIC ShareGPT-like (no sample-data folder)",
            f"no sample-data folder ({why}): the benchmark falls back to {first}synthetic ShareGPT-like prompts, not "
            "real ShareGPT; for real prompts run `export ASTRO_DATA_DIR=/path/to/data` (the folder holding "
            "the ShareGPT sample) and rerun")


def register(app: typer.Typer) -> None:
    """Add `astro demo` to the root app."""
    app.command("demo")(demo)
