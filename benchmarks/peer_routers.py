"""Peer harness: the same traffic through astro's scheduler and through the real peer routers.

One sim fleet (`services.cluster.ClusterSupervisor`, what `astro serve --instances N`
runs: N sim engines + N Predictors + the tagger, all on 127.0.0.1) serves every arm.
Per run, the harness starts ONE fresh front door on loopback, sends the request list,
and stops it; engines, Predictors and tagger stay up (they hold no state between runs
once drained: the sim engines' prefix cache is off, or with `--prefix-cache` reset before
each run), so every arm starts from the same drained fleet with a freshly started router. Arms (`--arms`, default all):

| arm | front door | lengths it dispatches on |
| --- | --- | --- |
| `astro/power_of_k` | `astro serve scheduler --policy power_of_k` (its defaults: k all, objective ttft, KV headroom gate 0.1, tie tolerance 0.02 s) + default tagger | predicted |
| `astro/power_of_k-oracle` | same with `--oracle-lengths` (true length from `vllm_xargs`) | oracle |
| `astro/po2` | the Astrolabe paper's Po2: `… --k 2 --objective e2e --param kv_reserve_frac=0 --param tie_tolerance_s=0` | predicted |
| `astro/power_of_k-inproc` | as `astro/power_of_k`, the scheduler tagging in-process (no tagger RPC) | predicted |
| `astro/power_of_k-late` | as `astro/power_of_k` with `--no-early-dispatch` (Predictors asked after the tag) | predicted |
| `astro/power_of_k-local` | as `astro/power_of_k`, the look-aheads in the scheduler's process (`--predict-in-process`: no Predictor RPCs; the tagger service as usual) | predicted |
| `astro/power_of_k-local-queue`, `astro/power_of_k-local-off` | as `astro/power_of_k-local` with `--admission queue` / `off` (the admission ablation; only requests with an SLO differ; not in the default `--arms`) | predicted |
| `astro/llumnix`, `astro/least_requests`, `astro/round_robin`, `astro/cache_aware` | `astro serve scheduler --policy …` | none (length-blind) |
| `vllm-router/{power_of_two,cache_aware,round_robin}` | `vllm-router --policy …` (PyPI, `.[peers]`) | none |
| `sglang-router/{power_of_two,cache_aware,round_robin}` | `sglang-router launch --policy …` (PyPI) | none |

Traffic: astro's own bench code (`bench.workloads.load_workload`, `bench.arrivals`,
`bench.client.run_requests`, `bench.metrics`). Repeat r uses seed `--seed + r` for the
workload sample and the Poisson arrivals; inside a repeat every arm gets the identical
list (its digest over ids, prompts, true lengths and send times is in the JSON per run).
The true output length reaches the sim engine as `vllm_xargs.astro_output_tokens`
(astro's scheduler and vllm-router forward it; astro's arms get no `max_tokens`, which
its scheduler would use to clip the prediction — an oracle bound). sglang-router drops
unknown fields, so its arms send `max_tokens` = true length + `ignore_eos: true` instead
(it sees no lengths either way). Every run checks that each completed request streamed
exactly its true length (`length_mismatches`).

Multi-turn sessions (`--multi-turn`, issue 14; use with `--prefix-cache`): the workload
is `-w sharegpt --multi-turn` (conversations replayed turn by turn, each turn's prompt the
whole history; `--think-time` mean exponential think time, engine s; `--max-total-tokens`
ends a session at its first longer turn; `--sessions N` takes N whole sessions instead of
`-n` turns). The closed-loop sender is astro bench's own (`bench.client.run_requests`):
first turns take the Poisson times (the rate is session starts per engine s), turn t is
sent its think time after turn t − 1's reply ended. With `--client-procs` > 1 every
session stays in one process (session j in process j mod P). Per run it adds: TTFT of
turns ≥ 2 (turn index ≥ 1; mean and P99) and the prefix-cache hit rate from the engines'
`vllm:prefix_cache_queries_total` / `hits_total` deltas (tokens; the caches are reset before
each run).

Heterogeneous fleets: `--profile P1,P2,…` gives one execution profile per engine in order
(its count must equal `--instances`, which it sets when not given), or `--recipe NAME` takes
the fleet of an `astro serve` recipe (`instances:` groups, e.g.
hetero-2xa100-2xa30-llama2-7b); both through `services.config.with_fleet`, as `astro serve`
does. Each engine runs its own profile and its Predictor simulates that one; the
`-local` arm's in-process look-aheads get it per engine (`--predictor-profile`).

Per-request SLO classes (`--slo-class NAME:ttft_ms=..,tpot_ms=..,share=..,priority=..`,
repeatable, `astro bench`'s syntax and parser `bench.slo.parse_slo_classes`; issue 33):
each request of repeat r draws a class by share (`bench.slo.assign_slo_classes`, seeded by
(seed + r, 33)), once per repeat, so every arm and load point of the repeat sends each
request with the same class; `bench.client` sends it as x-slo-class, x-slo-ttft-ms,
x-slo-tpot-ms and the body's `priority` to every arm (astro's scheduler admits on them —
`--admission reject`, its default, answers HTTP 429 when no instance is predicted to meet
the TTFT target; the peers ignore them). Per run (`slo_metrics`, from `bench.metrics`):
goodput = requests that completed within their class's TTFT and TPOT targets ÷ T (last
finish − first send), the same over the arrival window (identical across the arms of a
repeat), attainment overall and per class, refused (HTTP 429: missed, not an error) and
cut. Past capacity a peer queues every request it gets: each request has a deadline
(`--request-timeout-s`, engine s, default 300: an interactive request that meets 1 s /
100 ms ends within 1 + 0.1 × 2047 ≈ 206 s at the 2048-token cap) after which the client
cuts it; a cut request misses its SLO and is counted (`cut`), not a failure that rejects
the run, so a run ends by its last send + the deadline (its wall limit is raised to at
least that + 60 s). Engines still busy when the next run starts (a router that did not
abort what the client cut) get the fleet restarted (`drain_restart`). The goodput table
(below the latency table) gives per load and arm the median [min–max] over accepted runs
and the per-repeat goodput ratio to each peer arm.

Load points: `--loads` fractions of the virtual SLO capacity of the same fleet (same
recipe, instances, profile(s), workload — multi-turn included — and seed; `bench.runner.run_bench --virtual --capacity`,
P99 TTFT ≤ 10 s with steady state, policy `--capacity-policy`), or `--rates` directly.

Trust on a shared machine: repeats interleave (repeat, load, arm) with the arm order
rotated by A/R positions per repeat; engines run at `--time-scale` wall s per engine s
(times are reported in engine seconds, as `astro bench` does). Each engine's
`astro:engine_lag_seconds_max` (a max since start) is read before and after each run: a
run whose lag rose to ≥ `--max-lag-s` (0.25 s = the sim engine's resync bound, beyond it
engine time is lost, i.e. the hardware model ran slow) is REJECTED, the fleet is
restarted so the gauge is meaningful again, and the run is retried once at the end of the
schedule. Late-step fraction and the load generator's send delay are reported per run;
`--max-send-delay-s` rejects runs whose P99 send delay (engine s) passed it (the offered
arrivals were not the list's). The load generator runs in `--client-procs` processes
(request i from process i mod P, one common start): one Python client saturates on a
busy machine. The engines' own mean TTFT / E2E (their `vllm:*_seconds` histograms:
arrival at the engine → first / last token) are reported beside the client's, to tell
queueing at the engines (what dispatch changes) from delay in the streaming path.

CPU pinning (`--engine-cpus 0 --front-cpus 1`, taskset lists, disjoint): the sim engines
model GPUs, and a real fleet's GPUs do not slow down when the router uses CPU; on a shared
host the simulated engines would (round 5: astro's Predictors, tagger and relay took CPU
from them). With the flags the harness pins itself first (its load-generator processes,
the tagger, the Predictors and every front door inherit that set), then moves every thread
of each engine's process tree to the engine set; the kernel's `Cpus_allowed_list` is read
back for every thread after each fleet start and for each run's router (a mismatch stops
the harness). The sets are in the JSON (`cpu_pinning`, per run `cpus`) and the table's
header. Same pinning for every arm.

Output: `<out>/peer_routers.json` (config, capacity, every run, summary) and
`<out>/peer_routers.md` (median and min–max over accepted runs of P99 TTFT, mean TTFT,
mean E2E, throughput; paired ratio of P99 TTFT to the reference arm in the same repeat).

    .venv/bin/pip install -e '.[peers]'
    .venv/bin/python benchmarks/peer_routers.py --instances 4 --loads 0.85,0.95 \
        --repeats 3 -n 300 --out bench-results/peers
    .venv/bin/python benchmarks/peer_routers.py --instances 4 \
        --profile llama-2-7b-a100,llama-2-7b-a100,llama-2-7b-a30,llama-2-7b-a30 \
        --loads 0.85,0.95 --repeats 3 -n 300 --out bench-results/peers-hetero
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from rps_astro_cli.bench import scrape
from rps_astro_cli.bench.arrivals import ArrivalSpec, arrival_times
from rps_astro_cli.bench.client import ClientOptions, run_requests, send_request
from rps_astro_cli.bench.live import to_engine_seconds
from rps_astro_cli.bench.metrics import all_metrics, percentile
from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.bench.slo import SloClass, assign_slo_classes, parse_slo_classes
from rps_astro_cli.bench.workload_base import BenchRequest, WorkloadOptions
from rps_astro_cli.bench.workloads import load_workload
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.services.cluster import ClusterSupervisor, die_with_parent
from rps_astro_cli.services.config import (
    ClusterConfig,
    instance_specs,
    load_recipe,
    parse_config,
    with_fleet,
    with_overrides,
)


@dataclass(frozen=True)
class Arm:
    """One front door under test.

    name: "<router>/<policy>[-oracle]". router: "astro", "vllm-router" or "sglang-router".
    policy: the router's own policy name. oracle: astro's `--oracle-lengths`.
    lengths: what the dispatcher knows of output lengths ("predicted", "oracle", "none").
    """

    name: str
    router: str
    policy: str
    oracle: bool = False
    lengths: str = "none"
    args: tuple[str, ...] = ()  # extra `astro serve scheduler` flags (astro arms)
    tag_in_process: bool = False  # astro arms: the scheduler tags itself (no tagger service RPC)
    predict_in_process: bool = False  # astro arms: the scheduler runs the look-aheads (no Predictor RPCs)
    src: str | None = None  # astro arms: the scheduler runs from this source tree (`arm_of`'s NAME@SRC)


# the Astrolabe paper's Po2 (astro's defaults since issue 13 are k all, objective ttft,
# kv_reserve_frac 0.1, tie_tolerance_s 0.02)
PO2_ARGS = ("--k", "2", "--objective", "e2e", "--param", "kv_reserve_frac=0", "--param", "tie_tolerance_s=0")
ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("astro/power_of_k", "astro", "power_of_k", lengths="predicted"),
    Arm("astro/power_of_k-oracle", "astro", "power_of_k", oracle=True, lengths="oracle"),
    Arm("astro/po2", "astro", "power_of_k", lengths="predicted", args=PO2_ARGS),
    Arm("astro/power_of_k-inproc", "astro", "power_of_k", lengths="predicted", tag_in_process=True),
    Arm("astro/power_of_k-late", "astro", "power_of_k", lengths="predicted", args=("--no-early-dispatch",)),
    Arm("astro/power_of_k-local", "astro", "power_of_k", lengths="predicted", predict_in_process=True,
        args=("--predict-in-process",)),
    # `-local` whose forward waits for the tag (the default before `late_tag`)
    Arm("astro/power_of_k-local-waittag", "astro", "power_of_k", lengths="predicted", predict_in_process=True,
        args=("--predict-in-process", "--no-late-tag")),
    # the admission ablation of `-local` (its scheduler's default is --admission reject); only
    # requests with an SLO (`--slo-class`) are affected, so they are not in the default --arms
    Arm("astro/power_of_k-local-queue", "astro", "power_of_k", lengths="predicted", predict_in_process=True,
        args=("--predict-in-process", "--admission", "queue")),
    Arm("astro/power_of_k-local-off", "astro", "power_of_k", lengths="predicted", predict_in_process=True,
        args=("--predict-in-process", "--admission", "off")),
    Arm("astro/llumnix", "astro", "llumnix"),
    Arm("astro/least_requests", "astro", "least_requests"),
    Arm("astro/round_robin", "astro", "round_robin"),
    Arm("astro/cache_aware", "astro", "cache_aware"),
    Arm("vllm-router/power_of_two", "vllm-router", "power_of_two"),
    Arm("vllm-router/cache_aware", "vllm-router", "cache_aware"),
    Arm("vllm-router/round_robin", "vllm-router", "round_robin"),
    Arm("sglang-router/power_of_two", "sglang-router", "power_of_two"),
    Arm("sglang-router/cache_aware", "sglang-router", "cache_aware"),
    Arm("sglang-router/round_robin", "sglang-router", "round_robin"),
)}
ABLATION_ARMS = ("astro/power_of_k-local-queue", "astro/power_of_k-local-off")


def arm_of(name: str) -> Arm:
    """The arm called `name`; `NAME@SRC` is astro arm NAME with its scheduler run from the
    source tree SRC (a directory holding `rps_astro_cli`, e.g. `git worktree add /tmp/base
    REV` then `/tmp/base/src`, with the look-ahead engine's build copied in): an A/B of two
    builds in one interleaved run, on the same fleet. SRC's code imports this environment's
    packages.

    Raises:
        KeyError: no arm NAME. HarnessError: SRC on a peer router's arm, or no package there.
    """
    base, at, src = name.partition("@")
    arm = ARMS[base]
    if not at:
        return arm
    if arm.router != "astro":
        raise HarnessError(f"{name}: only an astro arm runs from another source tree")
    path = Path(src).resolve()
    if not (path / "rps_astro_cli" / "__init__.py").is_file():
        raise HarnessError(f"{name}: {path} holds no rps_astro_cli package (give a checkout's src directory)")
    return replace(arm, name=name, src=str(path))
DEFAULT_ARMS = [n for n in ARMS if n not in ABLATION_ARMS]
PEER_BINARIES = ("vllm-router", "sglang-router")
LAG_NAME = "astro:engine_lag_seconds_max"


class HarnessError(Exception):
    """A setup fault the user can fix (message names it)."""


# -- processes ---------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_binary(router: str) -> str | None:
    """Path of a peer router's executable: beside this Python first (the venv), else PATH."""
    local = Path(sys.executable).parent / router
    return str(local) if local.is_file() else shutil.which(router)


# -- CPU pinning (the engines off the router's cores) ------------------------------------------

def parse_cpus(spec: str) -> frozenset[int]:
    """`taskset -c` style list ("0", "0-2", "0,3-4") → the CPU numbers; ValueError if empty
    or malformed."""
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad CPU range {part!r}") from None
        if a < 0 or b < a:
            raise ValueError(f"bad CPU range {part!r}")
        out.update(range(a, b + 1))
    if not out:
        raise ValueError(f"no CPU in {spec!r}")
    return frozenset(out)


def format_cpus(cpus) -> str:
    """The CPU set as the kernel writes Cpus_allowed_list ({0, 1, 2, 5} → "0-2,5")."""
    s = sorted(cpus)
    parts: list[str] = []
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        parts.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(parts)


def cpus_allowed(pid: int, tid: int | None = None) -> frozenset[int]:
    """The kernel's Cpus_allowed_list of a process (or one of its threads)."""
    p = Path(f"/proc/{pid}") / ("task/" + str(tid) if tid is not None else "") / "status"
    for line in p.read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return parse_cpus(line.split(":", 1)[1])
    raise HarnessError(f"no Cpus_allowed_list in {p}")


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (from /proc/<pid>/task/<tid>/children), parents first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop(0)
        out.append(p)
        try:
            for t in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (t / "children").read_text().split()]
        except OSError:  # exited meanwhile
            continue
    return out


def tree_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes `pids` and their descendants have used so
    far (/proc/<pid>/stat utime + stime, all threads; ones that exited are left out)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for root in pids:
        for p in process_tree(root):
            try:
                fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / tick


def pin_tree(pid: int, cpus: frozenset[int]) -> str:
    """Pin every thread of `pid` and of its descendants to `cpus` (sched_setaffinity acts
    on one thread; threads started later inherit their creator's set), then check that the
    kernel shows exactly `cpus` for each; returns that Cpus_allowed_list."""
    for p in process_tree(pid):
        try:
            tids = [int(t.name) for t in Path(f"/proc/{p}/task").iterdir()]
        except OSError:
            continue
        for t in tids:
            try:
                os.sched_setaffinity(t, cpus)
            except ProcessLookupError:
                continue
        for t in tids:
            try:
                got = cpus_allowed(p, t)
            except OSError:
                continue
            if got != cpus:
                raise HarnessError(f"pid {p} thread {t}: Cpus_allowed_list {format_cpus(got)}, "
                                   f"wanted {format_cpus(cpus)}")
    return format_cpus(cpus_allowed(pid))


@dataclass(frozen=True)
class Pinning:
    """`--engine-cpus` / `--front-cpus`: the sim engines on one CPU set, everything else
    (this harness, its load-generator processes, Predictors, tagger, every front door) on
    the other. A real fleet's GPUs do not slow down when the router uses CPU; on a shared
    host the sim engines would."""

    engine: frozenset[int]
    front: frozenset[int]

    def describe(self) -> dict[str, str]:
        return {"engine_cpus": format_cpus(self.engine), "front_cpus": format_cpus(self.front)}


class Router:
    """One front-door process (astro scheduler or peer router) on 127.0.0.1."""

    def __init__(self, arm: Arm, fleet: dict[str, Any], log_path: Path, seed: int):
        self.arm = arm
        self.log_path = log_path
        engines = [i["engine_url"] for i in fleet["instances"]]
        self.engines = engines
        self.url: str | None = None
        self._ready: Path | None = None
        if arm.router == "astro":
            self._ready = log_path.with_suffix(".url")
            self._ready.unlink(missing_ok=True)
            cmd = [sys.executable, "-m", "rps_astro_cli.cli.main", "serve", "scheduler"]
            for u in engines:
                cmd += ["--engine", u]
            # look-aheads in the scheduler (the -local arm, or a fleet without Predictor sidecars):
            # each engine's own profile (or its Predictor's assumed one), as `astro serve` passes them
            local = arm.predict_in_process or not all(i.get("predictor_url") for i in fleet["instances"])
            for i in fleet["instances"]:
                cmd += ["--predictor-profile", i.get("assumed_profile") or i["profile"]] if local \
                    else ["--predictor", i["predictor_url"]]
            if local and "--predict-in-process" not in arm.args:
                cmd.append("--predict-in-process")
            if fleet.get("tagger") and not arm.tag_in_process:
                cmd += ["--tagger", fleet["tagger"]["url"]]
            cmd += ["--policy", arm.policy, "--profile", fleet["profile"], "--seed", str(seed),
                    "--host", "127.0.0.1", "--port", "0", "--ready-file", str(self._ready)]
            ts = float(fleet.get("time_scale", 1.0) or 1.0)
            if ts != 1.0:  # as `astro serve` passes it: observed wall s → engine s (calibration, metrics)
                cmd += ["--time-scale", repr(ts)]
            cmd += list(arm.args)
            if arm.oracle:
                cmd.append("--oracle-lengths")
        else:
            binary = peer_binary(arm.router)
            if binary is None:
                raise HarnessError(f"{arm.router} not installed: pip install -e '.[peers]' (arm {arm.name})")
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            cmd = [binary] + (["launch"] if arm.router == "sglang-router" else [])
            cmd += ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *engines, "--policy", arm.policy,
                    "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                    "--worker-startup-check-interval", "1",
                    "--log-level", "warn" if arm.router == "sglang-router" else "warning"]
        self.cmd = cmd
        env = None
        if arm.src is not None:  # another build's scheduler (`arm_of`)
            env = {**os.environ, "PYTHONPATH": arm.src}
        log = open(log_path, "ab")
        log.write(f"\n--- {time.strftime('%H:%M:%S')} {'PYTHONPATH=' + arm.src + ' ' if arm.src else ''}"
                  f"{' '.join(cmd)}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=die_with_parent, env=env)
        log.close()

    def wait_ready(self, opts_for, timeout_s: float = 90.0) -> None:
        """Until the router answers and has every engine: the URL known, `GET /health` < 500,
        (sglang) all workers registered, then one 1-token request per engine succeeds."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=3.0) as c:
            while True:
                if self.proc.poll() is not None:
                    raise HarnessError(f"{self.arm.name} exited with code {self.proc.returncode} "
                                       f"(log {self.log_path}):\n{_tail(self.log_path)}")
                if time.monotonic() > deadline:
                    raise HarnessError(f"{self.arm.name} not ready after {timeout_s:.0f} s (log {self.log_path})")
                if self.url is None and self._ready is not None and self._ready.is_file():
                    self.url = self._ready.read_text().strip() or None
                if self.url is not None and self._ready_now(c):
                    break
                time.sleep(0.2)
        warm = [BenchRequest(f"warmup-{i}", "warm up", 2, 1) for i in range(len(self.engines))]
        while True:
            recs = asyncio.run(_warm(warm, opts_for(self.url)))
            if all(r.success and r.output_tokens == 1 for r in recs):
                return
            if time.monotonic() > deadline:
                raise HarnessError(f"{self.arm.name}: warm-up requests failed: {recs[0].error} (log {self.log_path})")
            time.sleep(0.5)

    def _ready_now(self, c: httpx.Client) -> bool:
        try:
            if c.get(self.url + "/health").status_code >= 500:
                return False
            if self.arm.router == "sglang-router":
                ws = c.get(self.url + "/workers").json().get("workers") or []
                return sum(1 for w in ws if w.get("is_healthy")) >= len(self.engines)
            return True
        except (httpx.HTTPError, ValueError, AttributeError):
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


async def _warm(reqs: list[BenchRequest], opts: ClientOptions) -> list[RequestRecord]:
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=30.0) as c:
        return [await send_request(c, r, opts, lambda: time.perf_counter() - t0, 0.0) for r in reqs]


def _tail(p: Path, n: int = 6) -> str:
    try:
        return "\n".join(p.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


DEFAULT_PROFILE = "llama-2-7b-a30"


def fleet_config(instances: int | None, profile: str | None, recipe: str | None, time_scale: float,
                 prefix_cache: bool) -> ClusterConfig:
    """The sim fleet as `astro serve` would run it: the recipe's (`--recipe`), else
    `instances` × DEFAULT_PROFILE, with `--instances` / `--profile` (`P` or `P1,P2,…`, one
    per instance: a heterogeneous fleet) applied by `services.config.with_fleet`.

    Prefix caching off by default: every arm of a repeat sends the same prompts, and a
    cache left by the previous arm would favour whoever routes to it next (astro reads the
    engines' cached blocks; the peers keep their own per-run view). With `prefix_cache` on,
    every run starts with the engines' caches reset (`POST /reset_prefix_cache`, vLLM's
    route) once they are drained. internal_token off: the peer routers forward to the
    engines and cannot send astro's token. Predictor sidecars on (`predictor.in_process`
    false, whatever the recipe or astro's default says): the astro arms ask them, the
    `-local` arm runs the look-aheads in its scheduler instead. The supervisor's own
    scheduler is stopped at once.

    Raises:
        AstroUserError: one line naming the flag (`--profile` count ≠ instances, an unknown
            profile, `--instances` against the recipe's groups, a missing recipe).
    """
    engine = {"time_scale": time_scale, "enable_prefix_caching": prefix_cache}
    if recipe:
        base = load_recipe(recipe)
        base = with_overrides(base, {"engine." + k: v for k, v in engine.items()}
                              | {"internal_token": False, "predictor.in_process": False},
                              {"engine.time_scale": "--time-scale"}, f"recipe {recipe}")
    else:
        base = parse_config({"engine": {"profile": DEFAULT_PROFILE, **engine}, "scheduler": {"policy": "round_robin"},
                             "predictor": {"in_process": False}, "internal_token": False}, "peer harness")
    return with_fleet(base, instances=instances, profile=profile,
                      source=f"recipe {recipe}" if recipe else "peer harness")


def fleet_text(meta: dict[str, Any]) -> str:
    """"4 × sim `p`", or per profile in instance order "2 × sim `a` + 2 × sim `b`" for a
    heterogeneous fleet (meta "profiles": one per instance; older JSONs: "profile" only)."""
    profs = meta.get("profiles") or [meta["profile"]] * int(meta["instances"])
    runs: list[list[Any]] = []
    for p in profs:
        if runs and runs[-1][1] == p:
            runs[-1][0] += 1
        else:
            runs.append([1, p])
    text = " + ".join(f"{n} × sim `{p}`" for n, p in runs)
    return text + (f" (recipe `{meta['recipe']}`)" if meta.get("recipe") else "")


class Fleet:
    """The sim fleet: engines + Predictors + tagger via `ClusterSupervisor` (its own
    scheduler is stopped at once: every run brings its own front door)."""

    def __init__(self, cfg: ClusterConfig, run_dir: Path, pinning: Pinning | None = None):
        # `cfg`: `fleet_config` (the recipe or defaults, the fleet flags via `with_fleet`,
        # heterogeneous fleets included; prefix caching and internal_token from the flags)
        self.prefix_cache = cfg.engine.enable_prefix_caching
        self.cfg = cfg
        self.run_dir = run_dir
        self.sup: ClusterSupervisor | None = None
        self.info: dict[str, Any] = {}
        self.starts = 0
        self.pinning = pinning
        self.pins: dict[str, str] = {}  # child name → its Cpus_allowed_list, checked after each start

    def start(self) -> dict[str, Any]:
        self.starts += 1
        d = self.run_dir / f"fleet-{self.starts}"
        self.sup = ClusterSupervisor(self.cfg, d, None, report=lambda s: print(s, file=sys.stderr, flush=True))
        self.info = self.sup.start()
        sched = self.sup.scheduler
        if sched is not None and sched.proc is not None:
            sched.proc.terminate()
            sched.proc.wait(10)
            self.sup.scheduler = None
        self.pins = {}
        if self.pinning is not None:  # engines to their set; tagger and Predictors (inherited) checked on the other
            for c in self.sup.engines:
                self.pins[c.name] = pin_tree(c.pid, self.pinning.engine)
            for c in self._services():
                self.pins[c.name] = pin_tree(c.pid, self.pinning.front)
            self.info["cpu_pinning"] = dict(self.pins)
        return self.info

    def _services(self) -> list[Any]:
        """The fleet's tagger and Predictors (astro's services beside its front door)."""
        if self.sup is None:
            return []
        return [*([self.sup.tagger] if self.sup.tagger else []), *self.sup.predictors]

    def service_pids(self) -> list[int]:
        return [c.pid for c in self._services() if c.pid]

    def engine_cpus_now(self) -> list[str]:
        """Each engine's Cpus_allowed_list as the kernel shows it now."""
        return [format_cpus(cpus_allowed(c.pid)) for c in (self.sup.engines if self.sup else []) if c.pid]

    def stop(self) -> None:
        if self.sup is not None:
            self.sup.stop()
            self.sup = None

    def restart(self) -> dict[str, Any]:
        self.stop()
        return self.start()

    def engine_urls(self) -> list[str]:
        return [i["engine_url"] for i in self.info["instances"]]


# -- one run -----------------------------------------------------------------------------

def client_opts(arm: Arm, url: str, model: str | None, timeout_s: float,
                slo_of: dict[str, SloClass] | None = None) -> ClientOptions:
    """How the arm's requests are encoded (see module docstring: sglang-router drops
    `vllm_xargs`, so it gets max_tokens + ignore_eos). `slo_of` (request id → its
    `--slo-class`): `bench.client` sends the class as the headers x-slo-class,
    x-slo-ttft-ms, x-slo-tpot-ms and the body's `priority` — to every arm alike (the
    peers ignore them) — and counts an HTTP 429 as refused."""
    if arm.router == "sglang-router":
        return ClientOptions(base_url=url, model=model, send_true_lengths=True, ignore_eos=True,
                             max_tokens_mode="reference", timeout_s=timeout_s, slo_of=slo_of or {})
    return ClientOptions(base_url=url, model=model, send_true_lengths=True, max_tokens_mode="none",
                         timeout_s=timeout_s, slo_of=slo_of or {})


async def _scrape(urls: list[str]) -> list[dict[str, float] | None]:
    async with httpx.AsyncClient(timeout=10.0) as c:
        return list(await asyncio.gather(*(scrape.scrape(c, u) for u in urls)))


def wait_drained(urls: list[str], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        ms = asyncio.run(_scrape(urls))
        if all(m is not None and m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) == 0
               for m in ms):
            return
        if time.monotonic() > deadline:
            raise HarnessError(f"engines still busy after {timeout_s:.0f} s: {urls}")
        time.sleep(0.5)


def reset_prefix_caches(urls: list[str], timeout_s: float = 30.0) -> None:
    """`POST /reset_prefix_cache` on every (drained) engine until each says it reset."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as c:
        for u in urls:
            while True:
                r = c.post(u.rstrip("/") + "/reset_prefix_cache")
                if r.status_code == 200 and r.json().get("reset"):
                    break
                if time.monotonic() > deadline:
                    raise HarnessError(f"{u} did not reset its prefix cache: HTTP {r.status_code} {r.text[:120]}")
                time.sleep(0.2)


def digest(requests: list[BenchRequest], times_s: list[float]) -> str:
    """sha256 over (id, prompt, true length, send time in µs) of the request list (and,
    for a multi-turn turn, its session, turn and think time in µs)."""
    h = hashlib.sha256()
    for r, t in zip(requests, times_s):
        h.update(f"{r.request_id}\0{r.prompt_text()}\0{r.output_tokens}\0{round(t * 1e6)}\n".encode())
        if r.session_id:
            h.update(f"{r.session_id}\0{r.turn}\0{round(r.think_s * 1e6)}\n".encode())
    return h.hexdigest()[:16]


def split_parts(requests: list[BenchRequest], send_at_s: list[float], procs: int) -> list[tuple[list[int], list[float]]]:
    """How the load generator's `procs` processes share the list: (request indices, send
    times) per process, as `run_requests` takes them. Without sessions request i goes to
    process i mod P with its own time. With sessions (multi-turn) a whole session stays in
    one process — the j-th session to start (in list order of first turns) in process
    j mod P — and a process gets the send times of its sessions' first turns, in order
    (`run_requests` gives the k-th first turn of its list the k-th time; later turns wait
    for the previous reply)."""
    if not any(r.session_id and r.turn > 0 for r in requests):
        return [(list(range(p, len(requests), procs)), send_at_s[p::procs]) for p in range(procs)]
    sessions: dict[str, int] = {}  # session id → its rank among first turns
    for r in requests:
        if r.turn == 0 or not r.session_id:
            sessions.setdefault(r.session_id or f"\0{r.request_id}", len(sessions))
    parts: list[tuple[list[int], list[float]]] = [([], []) for _ in range(procs)]
    for i, r in enumerate(requests):
        key = r.session_id or f"\0{r.request_id}"
        if key not in sessions:
            raise ValueError(f"{r.request_id}: turn {r.turn} of session {r.session_id!r} has no turn 0 in the list")
        j = sessions[key]
        parts[j % procs][0].append(i)
        if r.turn == 0 or not r.session_id:
            parts[j % procs][1].append(send_at_s[j])
    return parts


def _client_part(job: tuple[list[BenchRequest], list[float], ClientOptions, float]) -> list[RequestRecord]:
    """One load-generator process: wait for the common start (wall clock), then
    `run_requests` on its share; times shifted onto the common clock."""
    reqs, times, opts, start_unix_s = job
    delay = start_unix_s - time.time()
    if delay > 0:
        time.sleep(delay)
    shift = max(0.0, time.time() - start_unix_s)  # this part's clock starts `shift` s after the common start
    recs = asyncio.run(run_requests(reqs, [t - shift for t in times], opts))
    for r in recs:
        r.scheduled_s += shift
        r.sent_s += shift
        if r.first_token_s is not None:
            r.first_token_s += shift
        if r.finish_s is not None:
            r.finish_s += shift
    return recs


def _client_worker_init() -> None:
    """A load-generator worker dies at once on SIGTERM (what `Pool.terminate` sends) and
    leaves Ctrl-C to the parent. With the parent's SIGTERM → KeyboardInterrupt handler
    inherited, a worker killed inside the task queue's lock could leave another blocked on
    that lock forever, and `Pool.terminate` then waited on it without end (a CI hang)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def stop_pool(pool, timeout_s: float = 10.0) -> None:
    """Idle workers exit on `close()`; any still alive after `timeout_s` are killed."""
    pool.close()
    procs = list(pool._pool)  # noqa: SLF001 (the worker processes)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)
    pool.terminate()


def send_all(requests: list[BenchRequest], send_at_s: list[float], opts: ClientOptions, pool,
             timeout_s: float) -> list[RequestRecord]:
    """Send `requests[i]` at `send_at_s[i]` (wall s from a common start) from the pool's
    processes (`split_parts`: request i from process i mod P, a multi-turn session whole in
    one; one Python client saturates on a busy machine and then sends late), or in this
    process when `pool` is None. Records come back in request order."""
    if pool is None:
        return asyncio.run(asyncio.wait_for(run_requests(requests, send_at_s, opts), timeout_s))
    procs = pool._processes  # noqa: SLF001 (multiprocessing keeps the size there)
    start = time.time() + 1.0
    split = split_parts(requests, send_at_s, procs)
    jobs = [([requests[i] for i in idx], times, opts, start) for idx, times in split]
    parts = pool.map_async(_client_part, jobs).get(timeout_s)
    out: list[RequestRecord] = [None] * len(requests)  # type: ignore[list-item]
    for (idx, _), recs in zip(split, parts):
        for i, rec in zip(idx, recs):
            out[i] = rec
    return out


def run_one(arm: Arm, fleet: Fleet, requests: list[BenchRequest], times_s: list[float], *, seed: int,
            max_lag_s: float, run_timeout_s: float, log_dir: Path, pool=None,
            max_send_delay_s: float | None = None, slo_of: dict[str, SloClass] | None = None,
            class_names: list[str] | tuple[str, ...] = (), deadline_s: float | None = None) -> dict[str, Any]:
    """Start the arm's router, send the list (engine-second times × time_scale), stop it.
    With the fleet pinned, the router's process tree is pinned (checked) to the front set
    and the engines' sets are re-read before the traffic starts.

    SLO classes (`slo_of`, request id → class; the same mapping for every arm of a
    repeat): each request carries its class's headers; `deadline_s` (engine s,
    `--request-timeout-s`) cuts a request not finished that long after it was sent — it
    misses its SLO, counts as `cut`, not as a failure that rejects the run — so a run
    past capacity ends by its last send + the deadline (its wall limit is raised to at
    least that + 60 s). Engines still busy when a run starts (a router that did not abort
    what the client cut) get the fleet restarted (`drain_restart` in the run)."""
    ts = float(fleet.info["time_scale"])
    model = fleet.info.get("model")
    urls = fleet.engine_urls()
    drain_restart = False
    try:
        wait_drained(urls)
    except HarnessError as e:
        print(f"{e}: restarting the fleet", file=sys.stderr, flush=True)
        fleet.restart()
        urls = fleet.engine_urls()
        wait_drained(urls)
        drain_restart = True
    if fleet.prefix_cache:
        reset_prefix_caches(urls)
    router = Router(arm, fleet.info, log_dir / f"{arm.name.replace('/', '_')}.log", seed)
    out: dict[str, Any] = {"arm": arm.name, "router": arm.router, "policy": arm.policy, "lengths": arm.lengths,
                           "digest": digest(requests, times_s), "num_requests": len(requests),
                           "admission": admission_of(arm), "drain_restart": drain_restart}
    req_timeout_s, limit_s = run_timeout_s, run_timeout_s  # wall
    if deadline_s is not None:
        req_timeout_s = deadline_s * ts
        limit_s = max(run_timeout_s, max(times_s, default=0.0) * ts + req_timeout_s + 60.0)
        out.update(request_deadline_s=deadline_s, run_limit_s=limit_s)
    t_start = time.perf_counter()
    try:
        router.wait_ready(lambda u: client_opts(arm, u, model, 30.0))
        out["router_ready_s"] = time.perf_counter() - t_start
        if fleet.pinning is not None:
            out["cpus"] = {"router": pin_tree(router.proc.pid, fleet.pinning.front),
                           "engines": fleet.engine_cpus_now()}
            if any(c != format_cpus(fleet.pinning.engine) for c in out["cpus"]["engines"]):
                raise HarnessError(f"engines not on CPUs {format_cpus(fleet.pinning.engine)}: {out['cpus']['engines']}")
        opts = client_opts(arm, router.url or "", model, req_timeout_s, slo_of)
        before = asyncio.run(_scrape(urls))
        services = fleet.service_pids()
        cpu_router0, cpu_services0 = tree_cpu_s([router.proc.pid]), tree_cpu_s(services)
        cpu0 = read_cpu_times()
        t0 = time.perf_counter()
        # think times are engine seconds too (as `astro bench` live scales them)
        wall_reqs = [replace(r, think_s=r.think_s * ts) if r.think_s else r for r in requests]
        try:
            records = send_all(wall_reqs, [t * ts for t in times_s], opts, pool, limit_s)
        except (TimeoutError, mp.TimeoutError):
            out.update(status="error", reason=f"run exceeded {limit_s:.0f} s wall")
            return out
        wall = time.perf_counter() - t0
        cpu1 = read_cpu_times()
        cpu_router, cpu_services = tree_cpu_s([router.proc.pid]) - cpu_router0, tree_cpu_s(services) - cpu_services0
        after = asyncio.run(_scrape(urls))
        if arm.router == "astro" and router.url:
            out["decision_cost"] = decision_costs(router.url)
    finally:
        router.stop()
    for r in records:
        to_engine_seconds(r, ts)
    m = all_metrics(records)["overall"]
    ok = [r for r in records if r.success]
    lag = [{"before_s": (b or {}).get(LAG_NAME), "after_s": (a or {}).get(LAG_NAME),
            "steps": scrape.delta(b, a, "astro:engine_steps_total"),
            "steps_late": scrape.delta(b, a, "astro:engine_steps_late_total"),
            "served": scrape.delta(b, a, "vllm:request_success_total")} for b, a in zip(before, after)]
    rose = [x["after_s"] for x in lag if x["after_s"] is not None and x["after_s"] > (x["before_s"] or 0.0)]
    run_lag = max(rose, default=0.0)
    steps = sum(x["steps"] or 0 for x in lag)
    late = sum(x["steps_late"] or 0 for x in lag)
    send_delay = [r.sent_s - r.scheduled_s for r in records]
    eng = {}  # the engines' own view (arrival at the engine → first / last token), engine seconds
    for k, name in (("engine_ttft_mean_s", "vllm:time_to_first_token_seconds"),
                    ("engine_e2e_mean_s", "vllm:e2e_request_latency_seconds")):
        num = sum(scrape.delta(b, a, name + "_sum") or 0.0 for b, a in zip(before, after))
        cnt = sum(scrape.delta(b, a, name + "_count") or 0.0 for b, a in zip(before, after))
        eng[k] = num / cnt if cnt else None
    mism = sum(1 for r in ok if r.output_tokens != r.expected_output_tokens)
    tokens = sum(r.output_tokens or 0 for r in records)
    out.update(session_metrics(requests, records, before, after))
    slo = slo_metrics(records, class_names) if slo_of else {}
    out.update(slo)
    # requests cut at their deadline are an outcome of the load (they miss their SLO), not a fault
    failed = m.num_failed - (slo.get("cut", 0) if deadline_s is not None else 0)
    out.update(
        status="ok", wall_s=wall, time_scale=ts,
        request_ids=[r.request_id for r in records],
        completed=m.num_completed, failed=m.num_failed, errors=m.errors, length_mismatches=mism,
        ttft_p99_s=m.ttft_s.p99, ttft_mean_s=m.ttft_s.mean, e2e_mean_s=m.e2e_s.mean, e2e_p99_s=m.e2e_s.p99,
        throughput_rps=m.throughput_rps, output_tokens_per_s=m.output_tokens_per_s,
        served_per_engine=[x["served"] for x in lag],
        # the front door's own CPU (its process tree) and the fleet's tagger + Predictors'
        # (astro's services; they poll engines in every arm) per output token relayed
        router_cpu_s=cpu_router, services_cpu_s=cpu_services, tokens_relayed=tokens,
        router_cpu_ms_per_token=(1e3 * cpu_router / tokens) if tokens else None,
        services_cpu_ms_per_token=(1e3 * cpu_services / tokens) if tokens else None,
        engine_lag_max_s=run_lag, engine_lag=lag, steps_late_fraction=(late / steps) if steps else None,
        **eng, send_delay_max_s=max(send_delay, default=0.0),
        send_delay_p99_s=float(np.percentile(send_delay, 99)) if send_delay else None,
        **steal_fractions(cpu0, cpu1),
    )
    why = verdict(run_lag, failed, mism, max_lag_s, out["send_delay_p99_s"], max_send_delay_s)
    if why:
        out.update(status="rejected", reason=why)
    return out


def decision_costs(url: str) -> dict[str, Any]:
    """astro's own cost per request from its scheduler's `/decisions` (the last
    `decisions_kept`, 1000 by default, of the run): wall ms, p50 / p99 / max, of
    `decide_us` (the decision, reading loads, look-aheads and admission included),
    `overhead_us` (everything the front door added to the request) and `tag_wait_us`
    (how long it waited for the length tag once it needed it), over all decisions
    and over the refused ones (admission's 429 path), with their counts; {} when the
    scheduler does not answer."""
    try:
        decs = httpx.get(url + "/decisions", params={"n": 100_000}, timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}
    out: dict[str, Any] = {}
    for name, rows in (("all", decs), ("refused", [d for d in decs if d.get("outcome") == "refused"])):
        out[f"{name}_n"] = len(rows)
        for key in ("decide_us", "overhead_us", "tag_wait_us"):
            v = [d[key] / 1000.0 for d in rows if d.get(key) is not None]
            stem = f"{name}_{key.removesuffix('_us')}_ms"
            out.update({f"{stem}_p50": percentile(v, 50), f"{stem}_p99": percentile(v, 99),
                        f"{stem}_max": max(v, default=None)})
    return out


def session_metrics(requests: list[BenchRequest], records: list[RequestRecord],
                    before: list[dict[str, float] | None], after: list[dict[str, float] | None]) -> dict[str, Any]:
    """Multi-turn and prefix-cache figures of one run: TTFT (engine s) of the completed
    turns with index ≥ 1 (the second and later turns of a session: mean, P99, count), the
    least time a later turn went out after its previous reply's end + its think time
    (engine s; ≥ 0 in a closed loop; `requests` carry engine-second think times) and
    the run's prefix-cache hit rate = Σ hits / Σ queries over the engines' counter deltas
    (tokens; None where no engine exports them or nothing was queried)."""
    later = [rec.first_token_s - rec.sent_s for q, rec in zip(requests, records)
             if q.session_id and q.turn >= 1 and rec.success and rec.first_token_s is not None]
    # closed loop: how long after (previous reply's end + think time) each later turn went out
    at = {(q.session_id, q.turn): rec for q, rec in zip(requests, records) if q.session_id}
    slack = [rec.sent_s - (at[(q.session_id, q.turn - 1)].finish_s + q.think_s)
             for q, rec in zip(requests, records)
             if q.session_id and q.turn >= 1 and rec.success and (q.session_id, q.turn - 1) in at
             and at[(q.session_id, q.turn - 1)].finish_s is not None]
    qs = [scrape.delta(b, a, "vllm:prefix_cache_queries_total") for b, a in zip(before, after)]
    hs = [scrape.delta(b, a, "vllm:prefix_cache_hits_total") for b, a in zip(before, after)]
    queried = sum(x for x in qs if x is not None) if any(x is not None for x in qs) else None
    hit = sum(x for x in hs if x is not None) if any(x is not None for x in hs) else None
    return {"later_turns": len(later), "closed_loop_slack_min_s": min(slack, default=None),
            "ttft_later_mean_s": float(np.mean(later)) if later else None,
            "ttft_later_p99_s": float(np.percentile(later, 99)) if later else None,
            "prefix_cache_queries_tokens": queried, "prefix_cache_hits_tokens": hit,
            "prefix_hit_rate": (hit / queried) if queried and hit is not None else None}


# -- per-request SLO classes (issue 33) ---------------------------------------------------------

# `bench.client`'s error of a request cut at its deadline (`ClientOptions.timeout_s` after it was sent)
TIMED_OUT = "transport: Timeout: not finished within"
DEFAULT_SLO_DEADLINE_S = 300.0  # engine s; `--request-timeout-s` with --slo-class


def slo_assignment(requests: list[BenchRequest], classes: list[SloClass], seed: int) -> dict[str, SloClass]:
    """Request id → its class, drawn by share (`bench.slo.assign_slo_classes`: a generator
    seeded by (seed, 33) alone, as `astro bench --slo-class` draws them). `main` calls it
    once per repeat with that repeat's seed; every arm and load point of the repeat sends
    that one mapping. Past the shares' sum a request carries no class (and no SLO)."""
    return assign_slo_classes([q.request_id for q in requests], classes, seed)


def admission_of(arm: Arm) -> str:
    """The arm's admission mode: astro's `--admission` (its default reject) for a policy
    that reads predictions; "never" for a length-blind astro policy (admission judges
    predicted TTFTs); "none" for a peer router (it ignores the SLO headers)."""
    if arm.router != "astro":
        return "none"
    if arm.lengths == "none":
        return "never"
    a = list(arm.args)
    return a[a.index("--admission") + 1] if "--admission" in a else "reject"


def slo_metrics(records: list[RequestRecord], class_names: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The SLO figures of one run (records in engine seconds; {} when no request has a
    class), from `bench.metrics` (`group_metrics`: a request meets its SLO when it
    succeeded, TTFT ≤ its class's target and TPOT ≤ its target where both are defined;
    refused = HTTP 429, neither met nor an error):

    - goodput_rps = met ÷ T, T = last finish − first send of the run (bench.metrics'
      run duration: an arm that drains a backlog longer has a longer T);
    - goodput_window_rps = met ÷ the arrival window (last − first scheduled send time:
      the same for every arm of a repeat, so the paired ratio is that of met counts);
    - slo_attainment = met ÷ requests with a class; refused, refused_share;
    - cut: requests not finished their deadline (`--request-timeout-s`) after being sent
      (`bench.client` ends them; they miss their SLO and are no error); slo_errors: the
      other failed requests;
    - slo_classes: the same per class (`class_names` first, in order)."""
    if not any(r.slo_class is not None for r in records):
        return {}
    ms = all_metrics(records)
    sched = [r.scheduled_s for r in records]
    window = max(sched) - min(sched)

    def cut(rs: list[RequestRecord]) -> int:
        return sum(1 for r in rs if not r.success and not r.refused and (r.error or "").startswith(TIMED_OUT))

    def figures(rs: list[RequestRecord], g) -> dict[str, Any]:
        met = sum(1 for r in rs if r.meets_request_slo)
        n_cut = cut(rs)
        return {"requests": len(rs), "met": met, "goodput_rps": g.goodput_rps,
                "goodput_window_rps": met / window if window > 0 else None, "slo_attainment": g.slo_attainment,
                "refused": g.refused, "refused_share": g.refused / len(rs) if rs else None, "cut": n_cut,
                "cut_share": n_cut / len(rs) if rs else None, "slo_errors": g.num_failed - n_cut,
                "ttft_p99_s": g.ttft_s.p99}

    classed = [r for r in records if r.slo_class is not None]
    out = figures(classed, ms["overall"])
    del out["ttft_p99_s"]  # the run's own ttft_p99_s stays the overall one
    out["slo_requests"] = out.pop("requests")
    out["requests_without_class"] = len(records) - len(classed)
    out["arrival_window_s"] = window
    out["slo_duration_s"] = ms["overall"].duration_s
    names = list(class_names) + sorted({r.slo_class for r in classed} - set(class_names))
    out["slo_classes"] = {n: figures([r for r in classed if r.slo_class == n], ms[n]) for n in names if n in ms}
    return out


def read_cpu_times(text: str | None = None) -> dict[str, list[int]]:
    """The kernel's cumulative CPU time counters (USER_HZ ticks) per line of /proc/stat:
    {"cpu": [user, nice, system, idle, iowait, irq, softirq, steal, ...], "cpu0": [...], ...};
    {} where /proc/stat is not readable (not Linux)."""
    if text is None:
        try:
            text = Path("/proc/stat").read_text()
        except OSError:
            return {}
    out = {}
    for line in text.splitlines():
        f = line.split()
        if f and f[0].startswith("cpu"):
            out[f[0]] = [int(x) for x in f[1:]]
    return out


def steal_fractions(before: dict[str, list[int]], after: dict[str, list[int]]) -> dict[str, Any]:
    """Host steal time over a run: Δsteal ÷ Δ(all ticks) for the whole machine
    (`host_steal_fraction`) and per CPU (`cpu_steal_fraction`, by name). Steal is time a
    virtual CPU was runnable but the hypervisor ran something else — the host stalls that
    reject runs for engine lag on a shared VM. None where the counters are missing or
    did not move. Guest time (fields 9–10) is already inside user / nice, so the total is
    fields 1–8."""
    def frac(name: str) -> float | None:
        b, a = before.get(name), after.get(name)
        if not b or not a or len(b) < 8 or len(a) < 8:
            return None
        d = [x - y for x, y in zip(a[:8], b[:8])]
        total = sum(d)
        return d[7] / total if total > 0 else None
    per = {n: frac(n) for n in sorted(after) if n != "cpu"}
    return {"host_steal_fraction": frac("cpu"), "cpu_steal_fraction": per}


def verdict(lag_s: float, failed: int, mismatches: int, max_lag_s: float, send_p99_s: float | None = None,
            max_send_delay_s: float | None = None) -> str:
    """Why a run is rejected ("" = accepted): engine lag (wall s, rose during the run) at or
    past `max_lag_s`; the load generator's P99 send delay (engine s) past `max_send_delay_s`
    (the offered arrivals were not the list's); failed requests; requests not streamed at
    their true length."""
    reasons = []
    if lag_s >= max_lag_s:
        reasons.append(f"engine lag {lag_s:.3f} s ≥ {max_lag_s:g} s")
    if max_send_delay_s is not None and send_p99_s is not None and send_p99_s > max_send_delay_s:
        reasons.append(f"client sent late: P99 {send_p99_s:.2f} s > {max_send_delay_s:g} s")
    if failed:
        reasons.append(f"{failed} failed requests")
    if mismatches:
        reasons.append(f"{mismatches} requests not at their true length")
    return "; ".join(reasons)


# -- schedule, summary, table ----------------------------------------------------------------

def schedule(arms: list[Arm], loads: list[float], repeats: int) -> list[tuple[int, int, Arm]]:
    """(repeat, load index, arm) in run order: loads and arms interleaved inside each
    repeat; repeat r rotates the arm order by ⌊r·A/R⌋ positions (each arm runs early,
    middle and late)."""
    A = len(arms)
    out = []
    for r in range(repeats):
        off = (r * A) // repeats
        for li in range(len(loads)):
            for j in range(A):
                out.append((r, li, arms[(j + off + li) % A]))
    return out


def _stat(vals: list[float]) -> dict[str, float | None]:
    v = [x for x in vals if x is not None and math.isfinite(x)]
    if not v:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": float(np.median(v)), "min": min(v), "max": max(v), "n": len(v)}


METRICS = ("ttft_p99_s", "ttft_mean_s", "e2e_mean_s", "throughput_rps", "engine_ttft_mean_s", "engine_e2e_mean_s",
           "send_delay_p99_s", "ttft_later_mean_s", "ttft_later_p99_s", "prefix_hit_rate", "engine_lag_max_s",
           "steps_late_fraction", "host_steal_fraction")


SLO_STATS = ("goodput_rps", "goodput_window_rps", "slo_attainment", "refused_share", "cut_share")


def summarize(runs: list[dict[str, Any]], arms: list[Arm], rates: list[float], ref: str) -> list[dict[str, Any]]:
    """Per (load, arm): median / min / max over accepted runs of each metric, and the median
    over repeats of P99 TTFT ÷ the reference arm's in the same repeat. With SLO classes
    (runs that have `goodput_rps`) also: goodput (both denominators), attainment overall
    and per class, refused and cut shares, and per peer arm (router not astro) the
    goodput ÷ that peer's in the same repeat (`goodput_vs`, `goodput_window_vs`: median
    [min–max] over the repeats where both runs were accepted)."""
    out = []
    peers = [a.name for a in arms if a.router != "astro"]
    for li, rate in enumerate(rates):
        here = [x for x in runs if x["load_index"] == li]
        refs = {x["repeat"]: x for x in here if x["arm"] == ref and x["status"] == "ok"}
        for a in arms:
            mine = [x for x in here if x["arm"] == a.name]
            ok = [x for x in mine if x["status"] == "ok"]
            row: dict[str, Any] = {"load_index": li, "rate_rps": rate, "arm": a.name, "lengths": a.lengths,
                                   "admission": admission_of(a),
                                   "runs_ok": len(ok), "runs_total": len(mine),
                                   "rejected": [x.get("reason") for x in mine if x["status"] != "ok"]}
            for k in METRICS:
                row[k] = _stat([x.get(k) for x in ok])
            ratios = [x["ttft_p99_s"] / refs[x["repeat"]]["ttft_p99_s"] for x in ok
                      if x["repeat"] in refs and refs[x["repeat"]]["ttft_p99_s"]]
            row["ttft_p99_vs_ref"] = _stat(ratios)
            if any("goodput_rps" in x for x in here):
                for k in SLO_STATS:
                    row[k] = _stat([x.get(k) for x in ok])
                names = list(dict.fromkeys(n for x in here for n in x.get("slo_classes") or {}))
                row["class_attainment"] = {n: _stat([(x.get("slo_classes") or {}).get(n, {}).get("slo_attainment")
                                                     for x in ok]) for n in names}
                for key, k in (("goodput_vs", "goodput_rps"), ("goodput_window_vs", "goodput_window_rps")):
                    row[key] = {}
                    for p in peers:
                        prefs = {x["repeat"]: x for x in here if x["arm"] == p and x["status"] == "ok"}
                        row[key][p] = _stat([x[k] / prefs[x["repeat"]][k] for x in ok if x["repeat"] in prefs
                                             and x.get(k) is not None and prefs[x["repeat"]].get(k)])
            out.append(row)
    return out


def _fmt(s: dict[str, Any], unit: str = "") -> str:
    if s["median"] is None:
        return "n/a"
    return f"{s['median']:.3g}{unit} [{s['min']:.3g}–{s['max']:.3g}]"


def _load_cell(row: dict[str, Any], loads: list[float] | None, unit: str) -> str:
    rate = f"{row['rate_rps']:.3g} {unit}"
    return f"{loads[row['load_index']]:.0%} ({rate})" if loads else rate


def _ratio_cell(row: dict[str, Any]) -> str:
    r = row["ttft_p99_vs_ref"]
    return "n/a" if r["median"] is None else f"{r['median']:.2f} [{r['min']:.2f}–{r['max']:.2f}]"


def _rejected_lines(summary: list[dict[str, Any]], unit: str) -> list[str]:
    rej = [f"- `{row['arm']}` @ {row['rate_rps']:.3g} {unit}: {why}" for row in summary for why in row["rejected"]]
    return ["", "Rejected runs:", *rej] if rej else []


def markdown(summary: list[dict[str, Any]], loads: list[float] | None, ref: str, meta: dict[str, Any]) -> str:
    if meta.get("multi_turn"):
        return markdown_sessions(summary, loads, ref, meta)
    lines = [f"Fleet: {fleet_text(meta)} at time scale {meta['time_scale']:g}; "
             f"{meta['workload']} ({meta.get('source', '?')}) {meta['num_requests']} requests/run, Poisson; {meta['repeats']} repeats "
             f"(seeds {meta['seed']}…{meta['seed'] + meta['repeats'] - 1}); times in engine seconds. "
             f"Median [min–max] over accepted runs; × ref = median of per-repeat P99 TTFT ratios to `{ref}`. "
             "TTFT / E2E: at the client (send → first / last streamed token); engine TTFT / E2E: the engines' own "
             "histograms (arrival at the engine → first / last token), exact means over the run; client send "
             "P99: how late the load generator sent (a busy machine delays it); engine lag: the highest reading "
             "of an engine's lag gauge (max since the fleet started) that rose during the run (wall s; 0: none "
             "rose); late steps: fraction of engine steps that ran late; steal: the host's steal time over the run "
             "(/proc/stat, Δsteal ÷ Δall ticks: a virtual CPU runnable while the hypervisor ran something else)."
             + _pinning_text(meta),
             "",
             "| load | arm | lengths | runs ok | P99 TTFT (s) | × ref | mean TTFT (s) | mean E2E (s) "
             "| throughput (req/s) | engine mean TTFT (s) | engine mean E2E (s) | client send P99 (s) "
             "| engine lag (s) | late steps | steal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in summary:
        lines.append(f"| {_load_cell(row, loads, 'req/s')} | `{row['arm']}` | {row['lengths']} | "
                     f"{row['runs_ok']}/{row['runs_total']} | {_fmt(row['ttft_p99_s'])} | {_ratio_cell(row)} | "
                     f"{_fmt(row['ttft_mean_s'])} | {_fmt(row['e2e_mean_s'])} | "
                     f"{_fmt(row['throughput_rps'])} | {_fmt(row['engine_ttft_mean_s'])} | "
                     f"{_fmt(row['engine_e2e_mean_s'])} | {_fmt(row['send_delay_p99_s'])} | "
                     f"{_fmt(row['engine_lag_max_s'])} | {_fmt(row['steps_late_fraction'])} | "
                     f"{_fmt(row['host_steal_fraction'])} |")
    return "\n".join(lines + slo_lines(summary, loads, meta) + _rejected_lines(summary, "req/s")) + "\n"


def slo_classes_meta(specs: list[str] | None) -> list[dict[str, Any]]:
    """The `--slo-class` entries as the table's header describes them."""
    return [{"name": c.name, "share": c.share, "ttft_ms": c.slo.ttft_ms, "tpot_ms": c.slo.tpot_ms,
             "priority": c.slo.priority} for c in parse_slo_classes(specs)]


def _pct(s: dict[str, Any]) -> str:
    if s["median"] is None:
        return "n/a"
    return f"{s['median']:.0%} [{s['min']:.0%}–{s['max']:.0%}]"


def _ratio(s: dict[str, Any]) -> str:
    return "n/a" if s["median"] is None else f"{s['median']:.2f} [{s['min']:.2f}–{s['max']:.2f}]"


def slo_lines(summary: list[dict[str, Any]], loads: list[float] | None, meta: dict[str, Any]) -> list[str]:
    """The goodput table (runs with `--slo-class`): per load and arm, median [min–max] over
    accepted runs of goodput, attainment (overall, per class), refused and cut shares, and
    the paired goodput ratio to each peer arm; [] without SLO classes."""
    classes = meta.get("slo_classes")
    rows = [r for r in summary if "goodput_rps" in r]
    if not classes or not rows:
        return []
    names = [c["name"] for c in classes]
    peers = list(dict.fromkeys(p for r in rows for p in r["goodput_vs"]))

    def targets(c: dict[str, Any]) -> str:
        t = [f"TTFT ≤ {c['ttft_ms']:g} ms"] if c.get("ttft_ms") is not None else []
        t += [f"TPOT ≤ {c['tpot_ms']:g} ms"] if c.get("tpot_ms") is not None else []
        return ", ".join(t + [f"priority {c['priority']}"])

    desc = "; ".join(f"`{c['name']}` {c['share']:.0%} ({targets(c)})" for c in classes)
    deadline = meta.get("request_deadline_s")
    lines = ["", f"SLO classes: {desc}, drawn per request by share (seeded by the repeat's seed: the same classes "
             "for every arm) and sent to every arm as x-slo-class / x-slo-ttft-ms / x-slo-tpot-ms and the body's "
             "priority (the peers ignore them). A request meets its SLO when it completed with TTFT and TPOT within "
             "its class's targets (`bench.metrics`); refused ones (HTTP 429) and cut ones (not finished "
             f"{'?' if deadline is None else f'{deadline:g}'} engine s after being sent) miss it, apart from errors "
             "(an error rejects the run). Goodput: met ÷ T (`bench.metrics`: last finish − first send of the "
             "run, so a longer drain lowers it); window: met ÷ the arrival window (the same for every arm of a "
             "repeat). Attainment: met ÷ requests with a class. × peer: median [min–max] of the per-repeat "
             "goodput ratios to that peer (T; window). Admission: astro's `--admission` (reject: HTTP 429 when "
             "no instance is predicted to meet the TTFT target; never: the policy reads no predictions).",
             "",
             "| load | arm | admission | runs ok | goodput (req/s) | goodput, window (req/s) | attainment | "
             + "".join(f"`{n}` attainment | " for n in names) + "refused | cut | "
             + "".join(f"× `{p}` (T; window) | " for p in peers),
             "|" + " --- |" * (9 + len(names) + len(peers))]
    lines[-2] = lines[-2].rstrip()
    for row in rows:
        att = row.get("class_attainment") or {}
        none = {"median": None}
        lines.append(f"| {_load_cell(row, loads, 'req/s')} | `{row['arm']}` | {row.get('admission', '?')} | "
                     f"{row['runs_ok']}/{row['runs_total']} | {_fmt(row['goodput_rps'])} | "
                     f"{_fmt(row['goodput_window_rps'])} | {_pct(row['slo_attainment'])} | "
                     + "".join(f"{_pct(att.get(n, none))} | " for n in names)
                     + f"{_pct(row['refused_share'])} | {_pct(row['cut_share'])} | "
                     + "".join(f"{_ratio(row['goodput_vs'].get(p, none))}; "
                               f"{_ratio(row['goodput_window_vs'].get(p, none))} | " for p in peers).rstrip())
    return lines


def _pinning_text(meta: dict[str, Any]) -> str:
    p = meta.get("cpu_pinning")
    if not p:
        return " CPUs: not pinned (engines share the front door's cores)."
    return (f" CPUs: sim engines on {p['engine_cpus']}; harness, load generators, Predictors, tagger and every "
            f"front door on {p['front_cpus']} (checked in /proc per start and per run).")


def _turns(meta: dict[str, Any]) -> str:
    t = meta.get("turns_per_run") or [meta["num_requests"]]
    span = f"{min(t)}" if min(t) == max(t) else f"{min(t)}–{max(t)}"
    return f"{meta['sessions']} sessions/run ({span} turns)" if meta.get("sessions") else f"{span} turns/run"


def markdown_sessions(summary: list[dict[str, Any]], loads: list[float] | None, ref: str,
                      meta: dict[str, Any]) -> str:
    """The multi-turn table: load in session starts per engine s; TTFT overall and of
    turns ≥ 2, mean E2E, the engines' prefix-cache hit rate, the run's engine lag."""
    lines = [f"Fleet: {fleet_text(meta)} at time scale {meta['time_scale']:g}, prefix "
             f"caching {'on' if meta.get('prefix_cache') else 'OFF'} (reset before every run); {meta['workload']} "
             f"--multi-turn ({meta.get('source', '?')}), {_turns(meta)}, Poisson session starts, "
             f"think time mean {meta.get('think_time_s', 2.0):g} s; {meta['repeats']} repeats "
             f"(seeds {meta['seed']}…{meta['seed'] + meta['repeats'] - 1}); times in engine seconds. "
             f"Median [min–max] over accepted runs; × ref = median of per-repeat P99 TTFT ratios to `{ref}`. "
             "TTFT / E2E at the client; turns ≥ 2: a session's second and later turns; hit rate: the engines' "
             "prefix-cache hit tokens ÷ queried tokens (their counter deltas over the run); engine lag: the "
             "highest reading of an engine's lag gauge (a max since the fleet started) that rose during the run "
             "(wall s; 0: none rose above the fleet's earlier maximum; ≥ --max-lag-s rejects the run).",
             "",
             "| load | arm | lengths | runs ok | P99 TTFT (s) | × ref | mean TTFT (s) | TTFT turns ≥ 2 mean (s) "
             "| TTFT turns ≥ 2 P99 (s) | mean E2E (s) | prefix hit rate | engine lag (s) | client send P99 (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in summary:
        lines.append(f"| {_load_cell(row, loads, 'sessions/s')} | `{row['arm']}` | {row['lengths']} | "
                     f"{row['runs_ok']}/{row['runs_total']} | {_fmt(row['ttft_p99_s'])} | {_ratio_cell(row)} | "
                     f"{_fmt(row['ttft_mean_s'])} | "
                     f"{_fmt(row['ttft_later_mean_s'])} | {_fmt(row['ttft_later_p99_s'])} | {_fmt(row['e2e_mean_s'])} | "
                     f"{_fmt(row['prefix_hit_rate'])} | {_fmt(row['engine_lag_max_s'])} | "
                     f"{_fmt(row['send_delay_p99_s'])} |")
    return "\n".join(lines + _rejected_lines(summary, "sessions/s")) + "\n"


# -- main --------------------------------------------------------------------------------------

def virtual_capacity(args) -> dict[str, Any]:
    """SLO capacity (P99 TTFT ≤ 10 s, steady) of the same fleet on the virtual cluster
    (`astro bench --virtual`: the same recipe, instance count and profile(s), so a
    heterogeneous `--profile P1,P2,…` runs each virtual instance on its own profile)."""
    from rps_astro_cli.bench.config import BenchConfig
    from rps_astro_cli.bench.runner import run_bench

    make = getattr(BenchConfig, "flat", BenchConfig)  # flat flag names (BenchConfig has sections since issue 12)
    extra = {}
    if args.multi_turn:  # the same sessions: capacity in session starts per s
        extra = {"multi_turn": True, "think_time": args.think_time, "max_total_tokens": args.max_total_tokens}
    cfg = make(workload=args.workload, path=args.path, num_requests=args.capacity_requests, seed=args.seed,
               virtual=True, instances=args.instances, profile=args.profile, recipe=args.recipe,
               policies=[args.capacity_policy], capacity=True, **extra)
    res = run_bench(cfg)
    c = res.capacity[0]
    return {"policy": args.capacity_policy, "capacity_rps": c.capacity_rps, "goal": c.goal.describe(),
            "num_requests": args.capacity_requests, "note": c.note}


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--instances", type=int, default=None,
                    help="sim engines in the fleet (default: the recipe's, else the --profile list's, else 4)")
    ap.add_argument("--profile", default=None,
                    help=f"execution profile of the engines: one for all, or P1,P2,... one per instance in order "
                         f"(a heterogeneous fleet; default: the recipe's, else {DEFAULT_PROFILE})")
    ap.add_argument("--recipe", default=None,
                    help="an astro serve recipe (name under recipes/ or YAML path) for the fleet: its instances "
                         "(groups), profiles and engine limits; --instances / --profile given win")
    ap.add_argument("--time-scale", type=float, default=1.0, help="sim wall s per engine s (≥ 1 keeps lag low)")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="engines cache prefixes; each run starts with every engine's cache reset")
    ap.add_argument("-w", "--workload", default="sharegpt")
    ap.add_argument("--path", default=None, help="dataset file (default: astro's data resolution)")
    ap.add_argument("-n", "--num-requests", type=int, default=300, help="requests (multi-turn: turns) per run")
    ap.add_argument("--multi-turn", action="store_true",
                    help="sharegpt conversations replayed turn by turn, closed loop (rates: session starts/s)")
    ap.add_argument("--sessions", type=int, default=None,
                    help="--multi-turn: whole sessions per run (instead of -n turns)")
    ap.add_argument("--max-prompt-tokens", type=int, default=None,
                    help="cut longer prompts (at a block, -w mooncake) to this many tokens")
    ap.add_argument("--think-time", type=float, default=2.0,
                    help="--multi-turn: mean think time before a next turn (engine s)")
    ap.add_argument("--max-total-tokens", type=int, default=None,
                    help="drop (multi-turn: end a session at) a turn whose prompt + reply is longer "
                         "(default: the workload's, 2048)")
    ap.add_argument("--seed", type=int, default=0, help="repeat r uses seed + r")
    ap.add_argument("--loads", default="0.85,0.95", help="fractions of the virtual capacity")
    ap.add_argument("--rates", default=None, help="request rates (engine req/s) instead of --loads")
    ap.add_argument("--capacity-policy", default="least_requests", help="policy of the virtual capacity search")
    ap.add_argument("--capacity-requests", type=int, default=400, help="requests per capacity probe")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS),
                    help=f"comma list of: {', '.join(ARMS)} (default: all but {', '.join(ABLATION_ARMS)})")
    ap.add_argument("--slo-class", action="append", default=None, metavar="SPEC",
                    help="per-request SLO class NAME:ttft_ms=..,tpot_ms=..,share=..,priority=.. (repeat; astro "
                         "bench's syntax): each request draws a class by share (seeded by the repeat's seed, the "
                         "same for every arm) and sends its headers to every arm; adds goodput, attainment and "
                         "refused (HTTP 429) per run and a goodput table")
    ap.add_argument("--request-timeout-s", type=float, default=None,
                    help="with --slo-class: a request not finished this long (engine s) after it was sent is "
                         f"cut and misses its SLO (default {DEFAULT_SLO_DEADLINE_S:g}); a run then ends by its last "
                         "send + this (its wall limit is raised to at least that + 60 s)")
    ap.add_argument("--skip-missing", action="store_true", help="drop peer arms whose router is not installed")
    ap.add_argument("--reference", default="astro/power_of_k", help="arm the × ref column divides by")
    ap.add_argument("--max-lag-s", type=float, default=0.25, help="reject a run whose engine lag reached this (wall s)")
    ap.add_argument("--max-send-delay-s", type=float, default=None,
                    help="reject a run whose load generator's P99 send delay passed this (engine s; default: "
                         "report it only)")
    ap.add_argument("--retries", type=int, default=1, help="re-runs of a rejected run, at the end of the schedule")
    ap.add_argument("--engine-cpus", default=None,
                    help="CPUs of the sim engines (taskset list, e.g. 0); needs --front-cpus")
    ap.add_argument("--front-cpus", default=None,
                    help="CPUs of everything else: this harness, its load generators, Predictors, tagger, every "
                         "front door (e.g. 1); disjoint from --engine-cpus")
    ap.add_argument("--client-procs", type=int, default=4, help="load-generator processes (1 = in this one)")
    ap.add_argument("--run-timeout-s", type=float, default=900.0,
                    help="wall limit of one run (without --slo-class also each request's)")
    ap.add_argument("--out", default="bench-results/peer-routers", help="folder for the JSON and Markdown")
    ap.add_argument("--from-json", default=None, help="only re-render the Markdown of an existing peer_routers.json")
    args = ap.parse_args(argv)
    if args.from_json:
        return args
    args.pinning = None
    if (args.engine_cpus is None) != (args.front_cpus is None):
        ap.error("--engine-cpus and --front-cpus go together")
    if args.engine_cpus is not None:
        try:
            eng, front = parse_cpus(args.engine_cpus), parse_cpus(args.front_cpus)
        except ValueError as e:
            ap.error(f"--engine-cpus/--front-cpus: {e}")
        have = os.sched_getaffinity(0)
        if eng & front or not (eng | front) <= have:
            ap.error(f"--engine-cpus/--front-cpus: two disjoint sets within this process's CPUs "
                     f"{format_cpus(have)} (got {format_cpus(eng)} / {format_cpus(front)})")
        args.pinning = Pinning(eng, front)
    names = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in names if a.partition("@")[0] not in ARMS]
    if bad:
        ap.error(f"--arms: unknown arm(s) {', '.join(bad)}; choose from {', '.join(ARMS)}")
    try:
        arms = [arm_of(a) for a in names]
    except HarnessError as e:
        ap.error(f"--arms: {e}")
    missing = sorted({a.router for a in arms if a.router != "astro" and peer_binary(a.router) is None})
    if missing and not args.skip_missing:
        ap.error(f"--arms: {', '.join(missing)} not installed; pip install -e '.[peers]' or pass --skip-missing")
    args.arm_list = [a for a in arms if a.router not in missing]
    if not args.arm_list:
        ap.error("--arms: no arm left to run")
    if args.reference not in [a.name for a in args.arm_list]:
        args.reference = args.arm_list[0].name
    try:
        args.load_list = None if args.rates else [float(x) for x in args.loads.split(",")]
        args.rate_list = [float(x) for x in args.rates.split(",")] if args.rates else None
    except ValueError:
        ap.error("--loads/--rates: comma-separated numbers, e.g. 0.85,0.95")
    if any(v <= 0 for v in (args.load_list or args.rate_list or [0])):
        ap.error("--loads/--rates: every value must be > 0")
    if min(args.instances or 1, args.repeats, args.num_requests, args.client_procs) < 1 or args.time_scale <= 0:
        ap.error("--instances, --repeats, -n, --client-procs must be ≥ 1 and --time-scale > 0")
    if (args.sessions is not None or args.think_time != 2.0) and not args.multi_turn:
        ap.error("--sessions / --think-time: only with --multi-turn")
    if args.multi_turn and args.workload != "sharegpt":
        ap.error(f"--multi-turn: replays ShareGPT conversations; use -w sharegpt (got {args.workload})")
    if args.sessions is not None and args.sessions < 1:
        ap.error("--sessions: must be ≥ 1")
    if args.think_time < 0:
        ap.error("--think-time: must be ≥ 0 (engine s)")
    if args.max_total_tokens is not None and args.max_total_tokens < 8:
        ap.error("--max-total-tokens: must be ≥ 8")
    try:
        args.slo_classes = parse_slo_classes(args.slo_class)
    except AstroUserError as e:
        ap.error(str(e))  # names --slo-class
    if args.slo_classes and args.multi_turn:
        ap.error("--slo-class: not with --multi-turn (a later turn's send time is not in the list)")
    if args.request_timeout_s is not None and not args.slo_classes:
        ap.error("--request-timeout-s: only with --slo-class")
    if args.request_timeout_s is not None and not args.request_timeout_s > 0:
        ap.error("--request-timeout-s: must be > 0 (engine s)")
    if args.slo_classes and args.request_timeout_s is None:
        args.request_timeout_s = DEFAULT_SLO_DEADLINE_S
    try:  # the fleet as `astro serve` builds it; a bad --profile count etc. is one line, no usage
        args.fleet_cfg = fleet_config(args.instances, args.profile, args.recipe, args.time_scale, args.prefix_cache)
    except AstroUserError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    specs = instance_specs(args.fleet_cfg)
    args.instances = len(specs)
    args.profiles = [s.profile for s in specs]  # one per engine, in order
    if args.profile is None:
        args.profile = ",".join(args.profiles) if len(set(args.profiles)) > 1 else args.profiles[0]
    return args


def workload_options(args) -> WorkloadOptions:
    """The workload's options from the flags (multi-turn: `--sessions` loads every
    conversation and `first_sessions` keeps the first N)."""
    kw: dict[str, Any] = {"path": Path(args.path) if args.path else None, "num_requests": args.num_requests}
    if args.max_total_tokens is not None:
        kw["max_total_tokens"] = args.max_total_tokens
    if args.max_prompt_tokens is not None:  # e.g. -w mooncake: its prompts cut to the profile's context
        kw["max_prompt_tokens"] = args.max_prompt_tokens
    if args.multi_turn:
        kw.update(multi_turn=True, think_time_s=args.think_time)
        if args.sessions is not None:
            kw["num_requests"] = 10**9
    return WorkloadOptions(**kw)


def first_sessions(requests: list[BenchRequest], n: int) -> list[BenchRequest]:
    """The turns of the first `n` sessions (in list order of their first turns)."""
    keep: set[str] = set()
    for q in requests:
        if q.turn == 0 and len(keep) < n:
            keep.add(q.session_id)
    return [q for q in requests if q.session_id in keep]


def rerender(path: Path, max_send_delay_s: float | None = None) -> str:
    """The Markdown table of an existing `peer_routers.json` (complete or cut short); with
    `max_send_delay_s`, accepted runs whose client send P99 passed it are rejected too."""
    doc = json.loads(path.read_text())
    for r in doc["runs"]:
        if max_send_delay_s is not None and r["status"] == "ok":
            why = verdict(0.0, 0, 0, math.inf, r.get("send_delay_p99_s"), max_send_delay_s)
            if why:
                r.update(status="rejected", reason=why)
    arms = [Arm(**a) for a in doc["arms"]]
    cfg = doc["config"]
    meta = {k: cfg[k] for k in ("instances", "profile", "time_scale", "workload", "num_requests", "repeats", "seed")}
    meta.update(profiles=cfg.get("profiles"), recipe=cfg.get("recipe"))
    meta["source"] = (doc.get("workload_sources") or ["?"])[0]
    meta.update(multi_turn=cfg.get("multi_turn", False), think_time_s=cfg.get("think_time", 2.0),
                prefix_cache=cfg.get("prefix_cache", False), cpu_pinning=doc.get("cpu_pinning"))
    meta.update(sessions=cfg.get("sessions"), turns_per_run=[r["num_requests"] for r in doc["runs"]])
    meta.update(slo_classes=slo_classes_meta(cfg.get("slo_class")), request_deadline_s=cfg.get("request_timeout_s"))
    summary = summarize(doc["runs"], arms, doc["rates_rps"], cfg["reference"])
    return markdown(summary, cfg["load_list"], cfg["reference"], meta)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        print(rerender(Path(args.from_json), args.max_send_delay_s), end="")
        return 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    capacity = None
    if args.rate_list:
        rates = args.rate_list
    else:
        print("virtual capacity of the fleet ...", file=sys.stderr, flush=True)
        capacity = virtual_capacity(args)
        if not capacity["capacity_rps"]:
            print(f"error: no virtual capacity found ({capacity['note']}); pass --rates", file=sys.stderr)
            return 1
        rates = [f * capacity["capacity_rps"] for f in args.load_list]
        print(f"capacity {capacity['capacity_rps']:.4g} req/s ({capacity['policy']}) → rates "
              f"{', '.join(f'{r:.4g}' for r in rates)}", file=sys.stderr, flush=True)
    lists: dict[tuple[int, int], tuple[list[BenchRequest], list[float]]] = {}
    slo_by_repeat: dict[int, dict[str, SloClass]] = {}  # one class per request, every arm and load of a repeat
    sources: list[str] = []
    for r in range(args.repeats):
        wl = load_workload(args.workload, workload_options(args), np.random.default_rng(args.seed + r))
        if args.sessions is not None:
            wl.requests = first_sessions(wl.requests, args.sessions)
        sources.append(wl.source)
        if args.slo_classes:
            slo_by_repeat[r] = slo_assignment(wl.requests, args.slo_classes, args.seed + r)
        for w in wl.warnings:
            print(f"warning: {w}", file=sys.stderr, flush=True)
        for li, rate in enumerate(rates):
            t = arrival_times(ArrivalSpec("poisson", rate), len(wl.requests),
                              np.random.default_rng([args.seed + r, int(round(rate * 1000)), 7]))
            lists[(r, li)] = (wl.requests, [float(x) for x in t])
    plan = schedule(args.arm_list, rates, args.repeats)
    log_dir = out_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    pins: dict[str, Any] = {}
    if args.pinning is not None:  # this process first: the pool, Predictors, tagger and routers inherit the set
        pins = {**args.pinning.describe(), "harness": pin_tree(os.getpid(), args.pinning.front)}
    fleet = Fleet(args.fleet_cfg, log_dir, pinning=args.pinning)
    runs: list[dict[str, Any]] = []
    retries: dict[tuple[int, int, str], int] = {}

    # the load-generator pool first, so its workers are forked with default signal handling
    # (see _client_worker_init)
    pool = mp.get_context("fork").Pool(args.client_procs, initializer=_client_worker_init) \
        if args.client_procs > 1 else None
    if pool is not None and args.pinning is not None:
        pins["load_generators"] = [pin_tree(p.pid, args.pinning.front) for p in pool._pool]  # noqa: SLF001

    def _term(signum, _frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, _term)
    meta = {"instances": args.instances, "profile": args.profile, "profiles": args.profiles, "recipe": args.recipe,
            "time_scale": args.time_scale,
            "workload": args.workload, "num_requests": args.num_requests, "repeats": args.repeats,
            "seed": args.seed, "source": sources[0], "multi_turn": args.multi_turn, "think_time_s": args.think_time,
            "prefix_cache": args.prefix_cache, "sessions": args.sessions,
            "turns_per_run": [len(reqs) for reqs, _ in lists.values()], "cpu_pinning": pins or None,
            "slo_classes": slo_classes_meta(args.slo_class), "request_deadline_s": args.request_timeout_s}
    versions = {}
    for b in PEER_BINARIES:
        try:
            from importlib.metadata import version

            versions[b] = version(b)
        except Exception:  # not installed
            versions[b] = None
    md = ""

    def write(done: bool) -> None:  # after every run: a cut-short session still leaves its figures
        nonlocal md
        summary = summarize(runs, args.arm_list, rates, args.reference)
        md = markdown(summary, args.load_list, args.reference, meta)
        doc = {"schema": "astro.peer_routers/1", "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
               "complete": done, "started_unix_s": t_start, "wall_s": time.time() - t_start,
               "config": {k: v for k, v in vars(args).items()
                          if k not in ("arm_list", "pinning", "fleet_cfg", "slo_classes")},
               "fleet": args.fleet_cfg.model_dump(mode="json", exclude={"api_key"}),
               "cpu_pinning": {**pins, "fleet": fleet.pins} if pins else None,
               "arms": [a.__dict__ for a in args.arm_list], "peer_versions": versions, "capacity": capacity,
               "rates_rps": rates, "workload_sources": sources, "fleet_starts": fleet.starts, "log_dir": str(log_dir),
               "runs": runs, "summary": summary}
        (out_dir / "peer_routers.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")
        (out_dir / "peer_routers.md").write_text(md)

    complete = False
    unit = "sessions/s" if args.multi_turn else "req/s"
    try:
        fleet.start()
        queue = list(plan)
        i = 0
        while i < len(queue):
            r, li, arm = queue[i]
            i += 1
            reqs, times = lists[(r, li)]
            res = run_one(arm, fleet, reqs, times, seed=args.seed + r, max_lag_s=args.max_lag_s,
                          run_timeout_s=args.run_timeout_s, log_dir=log_dir, pool=pool,
                          max_send_delay_s=args.max_send_delay_s, slo_of=slo_by_repeat.get(r),
                          class_names=[c.name for c in args.slo_classes], deadline_s=args.request_timeout_s)
            res["client_procs"] = args.client_procs
            res.update(repeat=r, load_index=li, rate_rps=rates[li], order=len(runs))
            runs.append(res)
            p99 = res.get("ttft_p99_s")
            print(f"[{len(runs)}/{len(queue)}] r{r} {rates[li]:.3g} {unit} {arm.name}: {res['status']} "
                  f"P99 TTFT {p99 if p99 is None else round(p99, 3)} s, engine lag rose to "
                  f"{res.get('engine_lag_max_s', 0):.3f} s, late steps {res.get('steps_late_fraction') or 0:.0%}, "
                  f"steal {res.get('host_steal_fraction') or 0:.1%}, wall {res.get('wall_s', 0):.0f} s"
                  + (f", goodput {res['goodput_rps']:.3g} req/s (window {res['goodput_window_rps']:.3g}), "
                     f"attainment {res['slo_attainment']:.0%}, refused {res['refused']}, cut {res['cut']}"
                     if res.get("goodput_rps") is not None and res.get("goodput_window_rps") is not None else "")
                  + (f", astro decision P99 {dc['all_decide_ms_p99']:.2f} ms, front door P99 "
                     f"{dc['all_overhead_ms_p99']:.2f} ms over {dc['all_n']}"
                     if (dc := res.get("decision_cost") or {}).get("all_overhead_ms_p99") is not None
                     and dc.get("all_decide_ms_p99") is not None else "")
                  + (f", front door CPU {res['router_cpu_ms_per_token']:.3f} ms/token"
                     if res.get("router_cpu_ms_per_token") is not None else "")
                  + (f" ({res['reason']})" if res.get("reason") else ""),
                  file=sys.stderr, flush=True)
            if res["status"] != "ok":
                key = (r, li, arm.name)
                if retries.get(key, 0) < args.retries:
                    retries[key] = retries.get(key, 0) + 1
                    queue.append((r, li, arm))
                if max((x.get("after_s") or 0.0 for x in res.get("engine_lag", [])), default=0.0) >= args.max_lag_s \
                        or res["status"] == "error":
                    fleet.restart()  # the lag gauge is a max since start: a fresh fleet makes it meaningful again
            write(False)
        complete = True
    except KeyboardInterrupt:
        print("interrupted: writing the runs done so far", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, old)
        if pool is not None:
            stop_pool(pool)
        fleet.stop()
        write(complete)
    print(md)
    return 0 if complete else 130


if __name__ == "__main__":
    sys.exit(main())
