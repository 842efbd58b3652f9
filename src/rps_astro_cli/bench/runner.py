"""`run_bench(config) -> BenchResult`: load the workload once, then run it at each rate,
for each dispatch policy (and k), live or virtual, optionally searching SLO capacity,
and write the report folder.

Modes:
- **live**: `cluster` (astro serve's `cluster.json`, schema "astro.cluster/1") or
  `base_url` (any OpenAI-compatible server). Engines' and scheduler's `/metrics` are
  scraped before and after each run (preemptions, dispatch overhead, predictor CPU), and
  the scheduler's `/decisions` give predictor error. `policies` in live mode start a
  fresh cluster per policy from the recipe in `cluster.json`
  (`services.cluster.ClusterSupervisor`), run, and stop it; so does
  `instance_policies` (`--instance-policies fcfs,rps`), one fresh cluster per in-instance
  policy (with `policies`, one per pair), each run labelled with its policy.
- **virtual**: the virtual-time cluster simulation (`cluster.virtual.simulate_cluster`)
  with `instances` × `profile`; policies are instantiated directly. `oracle_lengths`
  gives the dispatcher true output lengths instead of the length model's;
  `prediction_noise` multiplies each latency prediction by (1 + σ·z), z ~ N(0, 1),
  clipped at 0 (the Astrolabe paper's ±100 % robustness test is σ = 1).

Every run of one `run_bench` uses the same workload; the arrival times of a given rate
come from a generator seeded by (seed, rate), so policies see identical traffic.

A finished run is never lost: the report folder (`--out`) is checked before anything
starts; Ctrl-C, and SIGTERM while the runs go (in the main thread), write the partial
report and exit 130; a folder that fails when the report is written (a full disk, a
folder removed meanwhile) gets the report in a fresh temporary folder instead, with a
warning naming both.
"""

from __future__ import annotations

import asyncio
import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.bench import capacity as cap
from rps_astro_cli.bench.arrivals import ArrivalSpec, arrival_times
from rps_astro_cli.bench.config import BenchConfig
from rps_astro_cli.bench.metrics import (
    GroupMetrics,
    all_metrics,
    predictor_ttft_ape,
    slo_percentile_value,
    top_errors,
)
from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.bench.slo import SloSpec, parse_slo
from rps_astro_cli.bench.workload_base import Workload, WorkloadOptions
from rps_astro_cli.bench.workloads import load_workload
from rps_astro_cli.errors import AstroUserError

Progress = Callable[..., None]


@dataclass
class RunResult:
    """One run: one (policy, k, rate) on the workload.

    label: e.g. "power_of_k k=2 @ 20 req/s". records: per request (may be dropped for
    capacity probes to save memory). metrics: "overall" and per class. extras: scraped
    figures (preemptions, dispatch, predictor CPU...). wall_s: real time the run took.
    """

    label: str
    policy: str | None
    k: str | None
    rate_rps: float
    arrival: str
    metrics: dict[str, GroupMetrics]
    records: list[RequestRecord] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    instance_policy: str | None = None  # the in-instance policy of the run (None: a live run without
    #                                     --instance-policies, whose engines keep their own)

    def summary(self) -> dict[str, Any]:
        return {"label": self.label, "policy": self.policy, "k": self.k, "instance_policy": self.instance_policy,
                "rate_rps": _num(self.rate_rps),
                "arrival": self.arrival, "wall_s": self.wall_s,
                "metrics": {g: m.to_dict() for g, m in self.metrics.items()}, "extras": self.extras}


@dataclass
class BenchResult:
    """What `run_bench` returns.

    config: the config used. workload: `Workload.describe()`. target: what was measured
    (URLs, model, policy, profile...). runs: every run (capacity probes included).
    capacity: one `capacity.CapacityResult` per policy variant when searched.
    exit_code (`EXIT_CODES`, documented in `astro bench --help`): 0 every request ok;
    1 every request of a run failed, or `fail_under` failed; 3 some requests failed
    (errors, zero-token streams) or outputs were cut short (finish_reason "length" below
    max_tokens); 130 interrupted (Ctrl-C or SIGTERM: the report holds what completed).
    exit_reasons: why exit_code is not 0. out_dir: report folder or None (not the
    `--out` asked for when writing there failed: `warnings` says so).
    interrupted: Ctrl-C or SIGTERM stopped the benchmark.
    """

    config: BenchConfig
    workload: dict[str, Any]
    target: dict[str, Any]
    runs: list[RunResult]
    capacity: list[cap.CapacityResult] = field(default_factory=list)
    exit_code: int = 0
    exit_reasons: list[str] = field(default_factory=list)
    out_dir: Path | None = None
    warnings: list[str] = field(default_factory=list)
    interrupted: bool = False

    def flag(self, code: int, reason: str) -> None:
        """Record an exit reason; the exit code becomes the most severe seen
        (130 > 1 > 3 > 0)."""
        self.exit_reasons.append(reason)
        if _SEVERITY[code] > _SEVERITY[self.exit_code]:
            self.exit_code = code


EXIT_OK, EXIT_FAILED, EXIT_PARTIAL, EXIT_INTERRUPTED = 0, 1, 3, 130
EXIT_CODES = {EXIT_OK: "every request ok", EXIT_FAILED: "every request of a run failed, or --fail-under not met",
              EXIT_PARTIAL: "some requests failed (errors, zero-token streams) or outputs were cut short",
              EXIT_INTERRUPTED: "interrupted (Ctrl-C or SIGTERM); the partial report holds what completed"}
_SEVERITY = {EXIT_OK: 0, EXIT_PARTIAL: 1, EXIT_FAILED: 2, EXIT_INTERRUPTED: 3}
LAG_WARN_S = 0.05  # wall seconds: send lag (p99) or engine step lag (max) past this is warned
LATE_STEPS_WARN_FRAC = 0.05  # engine steps delivered late: warned past this fraction


def _num(v: float) -> float | str:
    return "inf" if isinstance(v, float) and math.isinf(v) else v


# -- preparation ---------------------------------------------------------------------------

def _check(cfg: BenchConfig) -> None:
    """The checks that read files or registries (the field checks ran when `cfg` was
    built, see `bench.config`), and the report folder: writable before the first
    request, not after the run."""
    if cfg.cluster.policies:
        from rps_astro_cli.dispatch import DISPATCH_POLICIES

        for p in cfg.cluster.policies:
            DISPATCH_POLICIES.get(p)  # raises listing the valid names
    if cfg.cluster.policy_params:
        _check_policy_params(cfg)
    if cfg.target.cluster:
        from rps_astro_cli.bench.live import read_cluster_json

        read_cluster_json(cfg.target.cluster)  # missing / invalid file → error before any data loads
    if cfg.cluster.instance_policies and not cfg.cluster.virtual:
        from rps_astro_cli.policies import INSTANCE_POLICIES

        for ipol in cfg.cluster.instance_policies:
            INSTANCE_POLICIES.get(ipol)  # unknown name: lists the valid ones
    if cfg.cluster.virtual:
        from rps_astro_cli.bench.virtual import bench_fleet, load_bench_recipe
        from rps_astro_cli.policies import INSTANCE_POLICIES, make_policy
        from rps_astro_cli.services.config import split_profiles
        from rps_astro_cli.sim.profile import load_profile

        # the recipe, the fleet flags against it (profiles exist, one per instance): one line naming the field
        bench_fleet(cfg, recipe=load_bench_recipe(cfg.cluster.recipe) if cfg.cluster.recipe else None)
        ip = cfg.cluster.instance_policy_params or {}
        ipols = cfg.cluster.instance_policies or [cfg.cluster.instance_policy]
        for ipol in ipols:
            INSTANCE_POLICIES.get(ipol)  # unknown name: lists the valid ones
        for n in ip:  # as --param: each --instance-param goes to the instance policies declaring it
            if not any(n in {p.name for p in INSTANCE_POLICIES.get(q).params} for q in ipols):
                raise AstroUserError(f"no instance policy of this run ({', '.join(ipols)}) takes {n!r}",
                                     field=f"--instance-param {n}", fix="see `astro policies` for their parameters")
        for ipol in ipols:
            own = {n: v for n, v in ip.items() if n in {p.name for p in INSTANCE_POLICIES.get(ipol).params}}
            make_policy(ipol, fields={n: f"--instance-param {n}" for n in own}, **own)  # names a bad value
        for flag, refs in (("--profile", cfg.cluster.profile), ("--predictor-profile", cfg.cluster.predictor_profile)):
            for ref in dict.fromkeys(split_profiles(refs) or ()):
                try:
                    load_profile(ref)
                except AstroUserError as exc:
                    raise AstroUserError(str(exc), field=flag) from None
    if cfg.output.out_dir:
        from rps_astro_cli.bench.report import check_out_dir

        check_out_dir(Path(cfg.output.out_dir))


def _check_policy_params(cfg: BenchConfig) -> None:
    """Each `--param NAME=VALUE` is declared by some policy of the run and passes each
    declaring policy's check."""
    from rps_astro_cli.dispatch import dispatch_params, make_dispatch

    pols = [p for p in _policy_names(cfg) if p is not None]
    if not pols:
        raise AstroUserError("--param sets the parameters of the policies this run starts", field="--param",
                             fix="add --virtual or --policies, or set them in the cluster's recipe for astro serve")
    for name, value in (cfg.cluster.policy_params or {}).items():
        takers = [p for p in pols if any(q.name == name for q in dispatch_params(p))]
        if not takers:
            declared = sorted({f"{p}: {q.name}" for p in pols for q in dispatch_params(p)})
            raise AstroUserError(f"no dispatch policy of this run ({', '.join(pols)}) takes {name!r}",
                                 field=f"--param {name}",
                                 fix=f"their parameters: {'; '.join(declared)}" if declared else "they take none")
        for p in takers:
            make_dispatch(p, fields={name: f"--param {name}"}, **{name: value})


def _policy_names(cfg: BenchConfig) -> list[str | None]:
    """The dispatch policies of the run: live without --policies, the running cluster's
    own (None); virtual, astro serve's default."""
    c = cfg.cluster
    return list(c.policies) if c.policies else (["power_of_k"] if c.virtual else [None])


def _variants(cfg: BenchConfig) -> list[tuple[str | None, str | None]]:
    """(policy, k) pairs to run; `--k` varies k for the policies that declare it."""
    from rps_astro_cli.dispatch import dispatch_params

    out: list[tuple[str | None, str | None]] = []
    for p in _policy_names(cfg):
        if p is not None and cfg.cluster.ks and any(q.name == "k" for q in dispatch_params(p)):
            out += [(p, k) for k in cfg.cluster.ks]
        else:
            out.append((p, None))
    return out


def _label(policy: str | None, k: str | None, spec: ArrivalSpec, target: dict[str, Any] | None = None) -> str:
    """Run label: "<policy>[ k=K] @ <arrivals>"; a live target without --policies is named
    by its own policy (cluster.json; its k only when not the default, so a live and a
    virtual run of the same policy carry the same label) or "server" (a plain
    OpenAI-compatible URL)."""
    if policy is None:
        from rps_astro_cli.dispatch.guided import K

        pol = (target or {}).get("policy") or {}
        shown_k = "k" in pol and str(pol["k"]) != str(K.default)
        who = (pol.get("name", "cluster") + (f" k={pol['k']}" if shown_k else "")) if pol else "server"
    else:
        who = policy + (f" k={k}" if k else "")
    return f"{who} @ {spec.describe()}"


def _arrivals(cfg: BenchConfig, wl: Workload, spec: ArrivalSpec, n: int) -> np.ndarray:
    if cfg.workload.sampling == "vllm" and spec.kind != "trace":  # vllm bench serve's plan for the seed
        from rps_astro_cli.bench.workloads_vllm import vllm_arrival_times

        return vllm_arrival_times(n, spec.rate_rps, spec.effective_shape, cfg.workload.seed)
    seed_rate = 0 if math.isinf(spec.rate_rps) else int(round(spec.rate_rps * 1000))
    rng = np.random.default_rng([cfg.workload.seed, seed_rate, 7])
    return arrival_times(spec, n, rng, [r.arrival_s for r in wl.requests])


# -- entry point ---------------------------------------------------------------------------

def _interrupt() -> None:
    """Raise KeyboardInterrupt (an event-loop callback: the loop's run ends with it)."""
    raise KeyboardInterrupt


def _sigterm_as_ctrl_c(got: dict[str, str]) -> Callable[[], None]:
    """Until the returned function is called (it restores the previous handler; calling it
    again does nothing): SIGTERM does what Ctrl-C does (`kill`, a batch scheduler's time
    limit, `timeout`), so the run ends in the partial report, not in a lost one, and
    `got["signal"]` becomes "SIGTERM". The SIGINT handler in force is called: inside a
    live run that is asyncio's, which cancels the run's task cleanly and then raises
    KeyboardInterrupt; elsewhere (or when SIGINT is ignored, as in a job a script started
    with `&`) KeyboardInterrupt is raised: at the running event loop's next callback, or at
    once when none runs. Not inside whatever the signal interrupted: within a connection's
    data callback, uvloop reports an exception as that connection's fatal error (a
    traceback on stderr) and goes on. Main thread only (Python delivers signals there);
    elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_term(signum: int, frame: Any) -> None:
        got["signal"] = "SIGTERM"
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler) and handler is not signal.default_int_handler:
            handler(signal.SIGINT, frame)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise KeyboardInterrupt from None
        loop.call_soon_threadsafe(_interrupt)

    try:
        before = signal.signal(signal.SIGTERM, on_term)
    except ValueError:  # signals not available in this interpreter
        return lambda: None
    done: list[bool] = []

    def restore() -> None:
        if not done:
            done.append(True)
            signal.signal(signal.SIGTERM, before)

    return restore


def run_bench(config: BenchConfig, progress: Progress | None = None) -> BenchResult:
    """Run the benchmark described by `config` (see module docstring).

    progress(event, **data) is called with "workload" (workload=Workload),
    "run_start" (label, total), "request" (record), "run_end" (run=RunResult), and with
    --capacity "probe" (search=CapacitySearch after recording the probe, rate, ok).

    Raises:
        AstroUserError: any bad setting or input (names the flag).
    """
    _check(config)  # every flag and named file, before any data loads or run starts
    from rps_astro_cli.tokens import load_counter

    length_model = None
    if config.cluster.virtual and not config.cluster.oracle_lengths:
        from rps_astro_cli.bench.virtual import load_bench_length_model

        length_model = load_bench_length_model(config.cluster.length_model)

    prog = progress or (lambda *a, **k: None)
    slo = parse_slo(config.slo.specs, config.slo.e2e_scale)
    counter = load_counter(config.workload.tokenizer)
    wl_counter = counter
    if config.workload.sampling == "vllm":
        from rps_astro_cli.bench.workloads_vllm import VLLM_SAMPLED_WORKLOADS
        from rps_astro_cli.tokens import load_counter_with_special

        if config.workload.name not in VLLM_SAMPLED_WORKLOADS or config.workload.multi_turn:
            raise AstroUserError(f"vLLM's draw is reproduced for {', '.join(VLLM_SAMPLED_WORKLOADS)} "
                                 f"(single-turn), not {config.workload.name}", field="--sampling",
                                 fix="use --sampling astro, or -w sharegpt / custom / random")
        wl_counter = load_counter_with_special(config.workload.tokenizer)
    spec0 = ArrivalSpec(config.arrivals.process, config.arrivals.request_rate_rps, config.arrivals.burstiness,
                        config.arrivals.time_scale)
    opts = WorkloadOptions(
        path=Path(config.workload.path) if config.workload.path else None, num_requests=config.workload.num_requests,
        min_tokens=config.workload.min_tokens, max_prompt_tokens=config.workload.max_prompt_tokens,
        max_total_tokens=config.workload.max_total_tokens,
        image_dir=Path(config.workload.image_dir) if config.workload.image_dir else None,
        video_dir=Path(config.workload.video_dir) if config.workload.video_dir else None,
        max_frames=config.workload.max_frames, counter=wl_counter,
        multi_turn=bool(config.workload.multi_turn), sampling=config.workload.sampling, seed=config.workload.seed,
        input_len=config.workload.input_len, output_len=config.workload.output_len,
        think_time_s=2.0 if config.workload.think_time_s is None else config.workload.think_time_s)
    wl = load_workload(config.workload.name, opts, np.random.default_rng(config.workload.seed))
    if config.workload.sampling == "vllm" and not config.workload.tokenizer:
        wl.warnings.append("--sampling vllm without --tokenizer: lengths are counted with astro's fallback "
                           "counter, so the filter keeps other pairs than vllm bench serve (which counts with "
                           "its --tokenizer); pass the same tokenizer folder to both")
    prog("workload", workload=wl)
    if config.arrivals.process == "trace" and not wl.has_timestamps:
        raise AstroUserError(f"workload {wl.name} has no timestamps to replay", field="--arrival",
                             fix="use burstgpt/azure for replay, or --arrival poisson/gamma/constant")

    if config.cluster.virtual:
        from rps_astro_cli.bench.virtual import VirtualTarget

        target: Any = VirtualTarget(config, wl, counter, length_model)
    else:
        from rps_astro_cli.bench.live import LiveTarget

        target = LiveTarget(config, wl, counter)

    result = BenchResult(config=config, workload=wl.describe(), target={}, runs=[],
                         warnings=list(wl.warnings))
    current: dict[str, Any] = {}  # the run in progress: its label, start, records so far (for Ctrl-C)
    got: dict[str, str] = {}  # "signal": "SIGTERM" when SIGTERM stopped the runs
    restore = _sigterm_as_ctrl_c(got)
    try:
        target.open()
        result.target = target.describe()
        ipols: list[str | None] = list(config.cluster.instance_policies or [None])
        variants = [(ip, p, k) for ip in ipols for p, k in _variants(config)]
        sweep = _Sweep(config, wl, spec0, slo, target, result, prog)
        if config.execution.executor != "serial":
            _run_parallel(sweep, variants)
        serial = variants if config.execution.executor == "serial" else []
        for ipol, policy, k in serial:
            target.use_instance_policy(ipol)  # first: a live target restarts its cluster in use_policy
            target.use_policy(policy, k)

            def run_at(rate: float, _p=policy, _k=k, _ip=ipol) -> RunResult:
                spec, times, label = sweep.plan(rate, _p, _k, _ip)
                reqs = wl.requests[:len(times)]  # --max-seconds: the requests planned after it are not sent
                prog("run_start", label=label, total=len(reqs))
                t0 = time.perf_counter()
                done_so_far: list[RequestRecord] = []
                current.update(label=label, policy=_p, k=_k, spec=spec, t0=t0, records=done_so_far)

                def on_record(r: RequestRecord) -> None:
                    done_so_far.append(r)
                    prog("request", record=r)

                records, extras = target.run(reqs, list(times), on_record)
                if len(reqs) < len(wl.requests):
                    extras["not_sent_after_max_seconds"] = len(wl.requests) - len(reqs)
                current.clear()
                run = sweep.finish(label, _p, _k, spec, records, extras, 0.0)
                run.wall_s = time.perf_counter() - t0
                result.runs.append(run)
                _lag_warnings(result, run)
                prog("run_end", run=run)
                return run

            if config.capacity.enabled:
                goal = sweep.goal()
                short: list[tuple[float, cap.SteadyState]] = []

                def probe(rate: float, _goal=goal, _short=short) -> tuple[float | None, bool]:
                    return sweep.probe_value(run_at(rate), _goal, _short)

                def on_record(search: cap.CapacitySearch, rate: float, ok: bool) -> None:
                    prog("probe", search=search, rate=rate, ok=ok)

                res = cap.search_capacity(probe, goal, **sweep.search_args(ipol, policy, k), on_record=on_record)
                result.capacity.append(res)
                sweep.short_warning(res, short)
            else:
                for rate in sweep.rates():
                    run_at(rate)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep what completed, exit 130
        restore()  # a second SIGTERM now ends the process, as a second Ctrl-C does
        result.interrupted = True
        n_done = 0
        if current:
            recs = list(current["records"])
            n_done = len(recs)
            label = current["label"] + " (interrupted)"
            sp = current["spec"]
            run = RunResult(label, current["policy"], current["k"], sp.rate_rps, sp.describe(),
                            all_metrics(recs, slo, None), recs, {"interrupted": True},
                            time.perf_counter() - current["t0"])
            _lag_extras(recs, run.extras)
            result.runs.append(run)
        how = got.get("signal", "Ctrl-C")
        result.flag(EXIT_INTERRUPTED, f"interrupted ({how}): {n_done} of {len(wl.requests)} requests of the run "
                    f"in progress had completed; the report holds the completed runs and those requests")
    finally:
        restore()
        target.close()
    _exit_status(result, slo)
    if config.output.out_dir:
        _write_report(result, Path(config.output.out_dir))
    return result


def _write_report(result: BenchResult, out_dir: Path) -> None:
    """Write the report into `out_dir` (checked before the run, `_check`); when that fails
    now (a full disk, the folder removed or made read-only meanwhile), into a fresh
    temporary folder, with a warning naming both: the finished run is not lost."""
    import tempfile

    from rps_astro_cli.bench import report

    try:
        result.out_dir = report.write_report(result, out_dir)
        return
    except OSError as exc:
        fallback = Path(tempfile.mkdtemp(prefix="astro-bench-report-"))
        result.warnings.append(f"--out {out_dir}: could not write the report there ({exc.strerror or exc}); "
                               f"it is in {fallback} instead")
    result.out_dir = report.write_report(result, fallback)


class _Sweep:
    """What every run of one `run_bench` shares, and the steps around executing a run
    that the serial loop and `_run_parallel` both take: plan a run (arrival times,
    label), finish it (metrics, `RunResult`), score a capacity probe."""

    def __init__(self, config: BenchConfig, wl: Workload, spec0: ArrivalSpec, slo: SloSpec, target: Any,
                 result: BenchResult, prog: Progress):
        self.config, self.wl, self.spec0, self.slo = config, wl, spec0, slo
        self.target, self.result, self.prog = target, result, prog

    def plan(self, rate: float, policy: str | None, k: str | None,
             ipol: str | None) -> tuple[ArrivalSpec, np.ndarray, str]:
        """(arrival spec, arrival times, label) of the run at `rate`; with --max-seconds
        only the times up to it (the workload's first len(times) requests are sent)."""
        cfg = self.config
        spec = self.spec0.with_rate(rate) if cfg.arrivals.process != "trace" else self.spec0
        times = _arrivals(cfg, self.wl, spec, len(self.wl.requests))
        if cfg.arrivals.max_seconds is not None:  # the duration limit: later requests are not sent
            times = times[:int(np.searchsorted(times, cfg.arrivals.max_seconds, side="right"))]
        label = _label(policy, k, spec, self.result.target)
        if ipol is not None:
            label = f"{ipol} · {label}"
        return spec, times, label

    def finish(self, label: str, policy: str | None, k: str | None, spec: ArrivalSpec,
               records: list[RequestRecord], extras: dict[str, Any], wall_s: float) -> RunResult:
        """The `RunResult` of an executed run (metrics over its records)."""
        _lag_extras(records, extras)
        if self.slo.e2e_scale is not None:
            self.target.fill_isolated(records)
        mets = all_metrics(records, self.slo, extras.get("preemptions_total"))
        by_instance: dict[str, list[RequestRecord]] = {}
        for r in records:
            if r.instance is not None:
                by_instance.setdefault(r.instance, []).append(r)
        if any(r.predicted_ttft_s is not None for r in records):  # the Predictor's error per instance (issue 31)
            extras["predictor_ttft_ape_per_instance"] = {name: predictor_ttft_ape(rs)
                                                         for name, rs in sorted(by_instance.items())}
        q = extras.get("prefix_cache_queries_tokens")
        if q:  # vLLM's hit rate, hit tokens / queried tokens (virtual, or scraped from live engines)
            mets["overall"].prefix_cache_hit_rate = extras["prefix_cache_hits_tokens"] / q
        return RunResult(label, policy, k, spec.rate_rps, spec.describe(), mets, records, extras, wall_s,
                         extras.get("instance_policy"))

    def goal(self) -> cap.CapacityGoal:
        c = self.config.capacity
        thr = c.threshold_s
        if thr is None:
            thr = dict(self.slo.thresholds_s).get(c.metric, 10.0)
        return cap.CapacityGoal(c.metric, c.percentile, thr)

    def search_args(self, ipol: str | None, policy: str | None, k: str | None) -> dict[str, Any]:
        """`capacity.search_capacity` / `CapacitySearch` keyword arguments of a variant."""
        c = self.config.capacity
        label = (f"{ipol} · " if ipol else "") + _label(policy, k, self.spec0, self.result.target).split(" @ ")[0]
        return {"rates": self.config.arrivals.rates_rps, "start_rps": c.start_rps, "min_rps": c.min_rps,
                "max_rps": c.max_rps, "tolerance": c.tolerance, "label": label, "width": c.width}

    @staticmethod
    def probe_value(run: RunResult, goal: cap.CapacityGoal,
                    short: list[tuple[float, cap.SteadyState]]) -> tuple[float | None, bool]:
        """(percentile value, steady) of a capacity probe's run; its records are dropped."""
        v = slo_percentile_value(run.records, goal.metric, goal.percentile)
        st = cap.steady_state(run.records)
        run.extras["capacity_probe"] = {"value_s": v, "steady_state": st.to_dict(),
                                        "meets": v is not None and v <= goal.threshold_s and st.steady}
        if st.short and st.steady and v is not None and v <= goal.threshold_s:
            short.append((run.rate_rps, st))  # a passing probe too short to trust
        run.records = []  # probes keep metrics only
        return v, st.steady

    def short_warning(self, res: cap.CapacityResult, short: list[tuple[float, cap.SteadyState]]) -> None:
        """Warn of passing probes too short to show steady state, with the `-n` that would
        be long enough at the highest of them; when the capacity itself is such a probe's
        rate, say so in its note too (beside the figure, where it is read)."""
        if not short:
            return
        r0, st0 = min(short, key=lambda x: x[0])
        top, st_top = max(short, key=lambda x: x[0])
        need = cap.requests_for_steady_state(top, st_top.mean_e2e_s or 0.0)
        self.result.warnings.append(
            f"{res.label}: {len(short)} passing capacity probe(s) (e.g. {r0:.3g} req/s: arrivals over "
            f"{st0.window_s:.3g} s, mean E2E {st0.mean_e2e_s:.3g} s) lasted under "
            f"{cap.STEADY_MIN_WINDOW_E2E:g} × the mean E2E — too short to show steady state; "
            f"raise -n to at least {need} for a trustworthy capacity")
        if res.capacity_rps is not None and any(math.isclose(r, res.capacity_rps) for r, _ in short):
            sep = "" if not res.note else " " if res.note.rstrip().endswith(".") else ". "
            res.note = res.note + sep + (
                f"Provisional: the probe at {res.capacity_rps:.3g} req/s was too short to show steady state "
                f"(a longer run may miss); raise -n to at least {need}.")

    def rates(self) -> list[float]:
        return list(self.config.arrivals.rates_rps or [self.config.arrivals.request_rate_rps])


def _run_parallel(sweep: _Sweep, variants: list[tuple[str | None, str | None, str | None]],
                  executor: Any = None) -> None:
    """The sweep on a parallel executor (`bench.executors`): every probe of a round goes to
    the executor at once — all rates × variants of a `--rates` sweep in one round, or the
    next rates of every variant's `CapacitySearch` — and the results land in the serial
    loop's order (variant by variant, each in probe order), so the report is the serial
    one. Ctrl-C keeps the runs of the rounds that completed."""
    from rps_astro_cli.bench.executors import ProbeTask, make_executor

    cfg, result, prog = sweep.config, sweep.result, sweep.prog
    ex = executor if executor is not None else make_executor(cfg.execution, sweep.target)
    per_variant: list[list[RunResult]] = [[] for _ in variants]
    searches: list[cap.CapacitySearch] = []
    shorts: list[list[tuple[float, cap.SteadyState]]] = [[] for _ in variants]
    goal = sweep.goal() if cfg.capacity.enabled else None
    if goal is not None:
        searches = [cap.CapacitySearch(goal, **sweep.search_args(ip, p, k)) for ip, p, k in variants]
    done = False
    try:
        while not done:
            if goal is not None:
                batch = [(vi, r) for vi, s in enumerate(searches) for r in s.next_rates()]
                done = not batch
            else:
                batch = [(vi, r) for vi in range(len(variants)) for r in sweep.rates()]
                done = True
            if not batch:
                break
            plans = [sweep.plan(r, variants[vi][1], variants[vi][2], variants[vi][0]) for vi, r in batch]
            tasks = [ProbeTask(variants[vi][0], variants[vi][1], variants[vi][2], tuple(float(t) for t in times))
                     for (vi, _), (_, times, _) in zip(batch, plans)]
            outcomes = ex.run(tasks)
            for (vi, rate), (spec, _, label), out in zip(batch, plans, outcomes):
                _, p, k = variants[vi]
                prog("run_start", label=label, total=len(out.records))
                for r in out.records:
                    prog("request", record=r)
                run = sweep.finish(label, p, k, spec, out.records, out.extras, out.wall_s)
                prog("run_end", run=run)
                if goal is not None:
                    ok = searches[vi].record(rate, sweep.probe_value(run, goal, shorts[vi]))
                    prog("probe", search=searches[vi], rate=rate, ok=ok)
                per_variant[vi].append(run)
    finally:
        if executor is None:
            ex.close()
        for vi, runs in enumerate(per_variant):
            for run in runs:
                result.runs.append(run)
                _lag_warnings(result, run)
            if done and goal is not None:
                res = searches[vi].result()
                result.capacity.append(res)
                sweep.short_warning(res, shorts[vi])


def _lag_extras(records: list[RequestRecord], extras: dict[str, Any]) -> None:
    """The bench's own send lag (actual − planned send time, wall s) and the count of
    outputs cut short (`RequestRecord.truncated`), into the run's extras."""
    lags = sorted(max(0.0, r.sent_s - r.scheduled_s) for r in records)
    extras["send_lag_s_max"] = lags[-1] if lags else None
    extras["send_lag_s_p99"] = lags[min(len(lags) - 1, int(0.99 * len(lags)))] if lags else None
    extras["outputs_truncated"] = sum(r.truncated for r in records)
    done = [r for r in records if r.success]
    # the reply-length check the report states beside the length source
    extras["outputs_equal_expected"] = sum(r.output_tokens == r.expected_output_tokens for r in done)
    extras["outputs_completed"] = len(done)


def _lag_warnings(result: BenchResult, run: RunResult) -> None:
    """Warn when the figures of `run` depend on a loop that did not keep up: the bench's
    send lag (P99) past LAG_WARN_S, or more than LATE_STEPS_WARN_FRAC of the engines'
    steps in the run delivered late (astro:engine_steps_late_total)."""
    x = run.extras
    p99 = x.get("send_lag_s_p99")
    if p99 is not None and p99 > LAG_WARN_S:
        result.warnings.append(f"{run.label}: the bench sent requests late (send lag P99 {p99 * 1e3:.0f} ms, max "
                               f"{x['send_lag_s_max'] * 1e3:.0f} ms): the client host is overloaded; latencies "
                               "include it")
    lag, late, steps = x.get("engine_lag_s_max"), x.get("engine_steps_late"), x.get("engine_steps")
    if late and steps and late / steps > LATE_STEPS_WARN_FRAC:  # the lag gauge alone is a max since start
        frac = f"{late / steps:.1%} of {steps:.0f} steps late"
        lag_txt = f"max lag since start {lag * 1e3:.0f} ms" if lag is not None else "lag unknown"
        result.warnings.append(f"{run.label}: the sim engines fell behind their step model ({frac}, {lag_txt}): "
                               "host CPU load shows in these latencies; rerun on a quieter host")


def _exit_status(result: BenchResult, slo: SloSpec) -> None:
    for run in result.runs:
        o = run.metrics["overall"]
        if o.num_requests > o.refused and o.num_completed == 0:  # refused alone is no failure
            result.flag(EXIT_FAILED, f"every request failed in run {run.label}: {top_errors(o.errors)}")
        elif o.num_failed:
            result.flag(EXIT_PARTIAL, f"{o.num_failed} of {o.num_requests} requests failed in run {run.label}: "
                        f"{top_errors(o.errors)}")
        cut = run.extras.get("outputs_truncated")
        if cut:
            result.flag(EXIT_PARTIAL, f"{cut} of {o.num_requests} outputs were cut short in run {run.label} "
                        "(finish_reason length before max_tokens: the model's context limit?)")
        if result.config.slo.fail_under is not None and o.slo is not None and o.num_requests:
            att = o.slo.good / o.num_requests
            if att < result.config.slo.fail_under:
                result.flag(EXIT_FAILED, f"SLO attainment {att:.1%} < --fail-under "
                            f"{result.config.slo.fail_under:.1%} in run {run.label}")


__all__ = ["BenchResult", "RunResult", "run_bench"]
