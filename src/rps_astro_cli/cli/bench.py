"""`astro bench`: run a workload against a live cluster / OpenAI-compatible server or the
virtual cluster, print a Rich summary and write the report folder (library:
`rps_astro_cli.bench.runner.run_bench`)."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from rps_astro_cli.cli.common import (
    InstanceParamOpt,
    ParamOpt,
    console,
    err_console,
    table_fits,
    user_errors,
    warn_key_on_command_line,
)

_DEFAULT_OUT = "bench-results"


def _split(text: str | None) -> list[str] | None:
    if text is None:
        return None
    vals = [t.strip() for t in text.split(",") if t.strip()]
    return vals or None


@user_errors
def bench(
    workload: Annotated[str, typer.Option("--workload", "-w", help="sharegpt | custom (JSONL prompts) | random (fixed ISL/OSL) | llava-instruct | llava-video | burstgpt | azure | length-trace | mooncake (block-hash JSONL, shared prefixes) | shared-prefix | synthetic | mix-to | mix-ml | mix-mh")] = "sharegpt",
    sampling: Annotated[str, typer.Option("--sampling", help="astro | vllm: vllm draws sharegpt/custom/random and the arrivals exactly as `vllm bench serve` does for the same file and --seed (give the same --tokenizer).")] = "astro",
    input_len: Annotated[int, typer.Option("--input-len", help="random: prompt tokens per request.")] = 1024,
    output_len: Annotated[int, typer.Option("--output-len", help="random: reply tokens per request; custom: for rows without output_tokens.")] = 128,
    multi_turn: Annotated[bool, typer.Option("--multi-turn", help="sharegpt: replay whole conversations turn by turn (prompt = history; the rate is session starts/s).")] = False,
    think_time: Annotated[float | None, typer.Option("--think-time", help="--multi-turn: mean think time before the next turn (s, exponential; default 2).")] = None,
    path: Annotated[str | None, typer.Option("--path", help="Dataset file (else $ASTRO_DATA_DIR / ../shared/data, else hub, else synthetic).")] = None,
    num_requests: Annotated[int, typer.Option("--num-requests", "-n", help="Requests per run.")] = 200,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the workload and arrival generators.")] = 0,
    tokenizer: Annotated[str | None, typer.Option("--tokenizer", help="Local HF tokenizer folder (default: the shared fallback counter).")] = None,
    image_dir: Annotated[str | None, typer.Option("--image-dir", help="LLaVA-Instruct image folder (COCO train2017).")] = None,
    video_dir: Annotated[str | None, typer.Option("--video-dir", help="LLaVA-Video video folder.")] = None,
    max_frames: Annotated[int, typer.Option("--max-frames", help="Frames sampled per video.")] = 32,
    min_tokens: Annotated[int, typer.Option("--min-tokens", help="ShareGPT filter: min prompt/reply tokens (vLLM: 4).")] = 4,
    max_prompt_tokens: Annotated[int, typer.Option("--max-prompt-tokens", help="ShareGPT filter: max prompt tokens (vLLM: 1024); mooncake: longer prompts are cut at a 512-token block.")] = 1024,
    max_total_tokens: Annotated[int, typer.Option("--max-total-tokens", help="Max prompt + reply tokens (vLLM: 2048).")] = 2048,
    arrival: Annotated[str, typer.Option("--arrival", help="poisson | gamma | constant | trace")] = "poisson",
    request_rate: Annotated[str, typer.Option("--request-rate", help="Requests/s (> 0) or inf.")] = "inf",
    burstiness: Annotated[str | None, typer.Option("--burstiness", help="Gamma shape (> 0; 1 = Poisson, inf = constant); implies --arrival gamma.")] = None,
    time_scale: Annotated[str, typer.Option("--time-scale", help="Trace replay: multiply timestamps by this (> 0).")] = "1",
    max_concurrency: Annotated[int | None, typer.Option("--max-concurrency", help="Most requests in flight.")] = None,
    warmup: Annotated[int, typer.Option("--warmup", help="Live: send this many requests (the workload's first, all at once) before each run and leave them out of every metric.")] = 0,
    max_seconds: Annotated[float | None, typer.Option("--max-seconds", help="Send no request planned later than this many seconds after the start (the run ends when the sent ones finish).")] = None,
    rates: Annotated[str | None, typer.Option("--rates", help="Sweep: comma-separated request rates, e.g. 10,15,20.")] = None,
    cluster: Annotated[str | None, typer.Option("--cluster", help="cluster.json written by `astro serve`.")] = None,
    base_url: Annotated[str | None, typer.Option("--base-url", help="Any OpenAI-compatible server, e.g. http://127.0.0.1:8000 (a trailing /v1, the openai client's form, is dropped).")] = None,
    model: Annotated[str | None, typer.Option("--model", help="Model name (default: the server's first /v1/models).")] = None,
    endpoint: Annotated[str, typer.Option("--endpoint", help="chat | completions (media always use chat).")] = "chat",
    send_true_lengths: Annotated[bool, typer.Option("--send-true-lengths/--no-send-true-lengths", help="Send vllm_xargs.astro_output_tokens (the reply length) so sim engines reproduce it.")] = True,
    max_tokens: Annotated[str, typer.Option("--max-tokens", help="auto | reference (the dataset reply length, as vllm bench) | none | N. auto = none with --cluster (astro's dispatcher would clip its prediction by it), reference with --base-url.")] = "auto",
    ignore_eos: Annotated[bool, typer.Option("--ignore-eos", help="Send ignore_eos: true (vLLM).")] = False,
    ttft_definition: Annotated[str, typer.Option("--ttft-definition", help="astro (default): TTFT at the first non-empty text, ITL over text chunks | vllm: TTFT at the first chunk, every chunk an ITL gap (as vllm bench serve). docs/metrics.md.")] = "astro",
    request_timeout: Annotated[float, typer.Option("--request-timeout", help="Deadline of each whole request, from sending it to its last byte (s): a stream still open then (even one kept alive by SSE comments) fails as a timeout.")] = 600.0,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="ASTRO_API_KEY", callback=warn_key_on_command_line, help="Bearer key for the server (prefer $ASTRO_API_KEY: a flag shows in ps).")] = None,
    virtual: Annotated[bool, typer.Option("--virtual", help="Run on the virtual-time cluster simulation instead of HTTP.")] = False,
    recipe: Annotated[str | None, typer.Option("--recipe", help="Virtual: an astro serve recipe (name under recipes/ or YAML path): profile, engine limits, instance policy, instances, dispatch policy; flags given win.")] = None,
    instances: Annotated[int | None, typer.Option("--instances", help="Virtual: number of instances (default: the recipe's, else 4).")] = None,
    profile: Annotated[str | None, typer.Option("--profile", help="Execution profile id or JSON (virtual; live --slo-scale with --base-url). Virtual: P1,P2,... gives one per instance (a heterogeneous fleet; sets --instances when neither it nor --recipe does).")] = None,
    calibration: Annotated[str | None, typer.Option("--calibration", help="Virtual: the Predictors' step-model calibration: online (refit from their engines' steps), off (keep the profile, lean on load while its error is high) or none (fixed, always trusted). Default: online with --predictor-profile, else none.")] = None,
    predictor_profile: Annotated[str | None, typer.Option("--predictor-profile", help="Virtual: the profile the Predictors' look-ahead is told, one for all or P1,P2,... one per instance (default: each its engine's own; another = a model-mismatch run).")] = None,
    instance_policy: Annotated[str | None, typer.Option("--instance-policy", help="Virtual: in-instance policy (fcfs, rps, ...; default: the recipe's, else fcfs).")] = None,
    instance_policies: Annotated[str | None, typer.Option("--instance-policies", help="Compare in-instance policies, one run each, e.g. fcfs,rps (live: a fresh cluster from cluster.json's recipe per policy).")] = None,
    instance_param: InstanceParamOpt = None,
    policies: Annotated[str | None, typer.Option("--policies", "--policy", help="Dispatch policy, or several to compare, e.g. round_robin,llumnix,power_of_k (--policy: the name astro simulate and astro serve use).  [default: power_of_k (virtual), or the recipe's; live: the cluster's]")] = None,
    k: Annotated[str | None, typer.Option("--k", help="power_of_k sample sizes, e.g. 2,4,all.")] = None,
    objective: Annotated[str | None, typer.Option("--objective", help="Virtual: power_of_k objective, ttft (default) or e2e (live: astro serve --objective).")] = None,
    param: ParamOpt = None,
    oracle_lengths: Annotated[bool, typer.Option("--oracle-lengths", help="Virtual: dispatch on true output lengths.")] = False,
    prediction_noise: Annotated[float, typer.Option("--prediction-noise", help="Virtual: Gaussian noise σ on each latency prediction (1 = ±100%).")] = 0.0,
    prediction_noise_fraction: Annotated[float, typer.Option("--prediction-noise-fraction", help="Virtual: share of predictions noised (0-1).")] = 1.0,
    length_model: Annotated[str | None, typer.Option("--length-model", help="Virtual: length model (default: the tagger's baseline).")] = None,
    remaining_length: Annotated[str, typer.Option("--remaining-length", help="Virtual: look-ahead's length of queued/running requests: none (predicted + 10-token auto-extension, the default), default (E[L | L > generated] from artifacts/dispatch/remaining_classic.json) or a table JSON.")] = "none",
    max_num_seqs: Annotated[int | None, typer.Option("--max-num-seqs", help="Virtual: batch-size limit override.")] = None,
    schedulers: Annotated[int, typer.Option("--schedulers", help="Virtual: stateless scheduler replicas dispatching independently (a round-robin Service in front); see --status-interval.")] = 1,
    status_interval: Annotated[float, typer.Option("--status-interval", help="Virtual: instance status copied every this many s; between copies a scheduler knows only its own sends (0: live state).")] = 0.0,
    slo: Annotated[list[str] | None, typer.Option("--slo", help="SLO metric:seconds (ttft, tpot, e2el, nlat), repeatable; e.g. ttft:10.")] = None,
    slo_scale: Annotated[float | None, typer.Option("--slo-scale", help="Relative SLO: E2E ≤ scale × isolated E2E (RPS-Serve).")] = None,
    capacity: Annotated[bool, typer.Option("--capacity", help="Search the SLO capacity (highest rate meeting the goal).")] = False,
    capacity_metric: Annotated[str, typer.Option("--capacity-metric", help="ttft | tpot | e2el | nlat")] = "ttft",
    capacity_percentile: Annotated[float, typer.Option("--capacity-percentile", help="Percentile of the capacity goal.")] = 99.0,
    capacity_threshold: Annotated[float | None, typer.Option("--capacity-threshold", help="Goal (s); default the --slo of that metric, else 10.")] = None,
    capacity_start_rate: Annotated[float, typer.Option("--capacity-start-rate", help="First rate the search probes (req/s).")] = 4.0,
    capacity_max_rate: Annotated[float, typer.Option("--capacity-max-rate", help="Upper bound of the search (req/s).")] = 256.0,
    capacity_width: Annotated[int, typer.Option("--capacity-width", help="Rates the capacity search probes per round (1: doubling then bisection; N: N rates at once, for a parallel --executor; within the tolerance of width 1 when the latency rises with the rate, BENCHMARKS.md, Scale-out).")] = 1,
    executor: Annotated[str, typer.Option("--executor", help="Virtual: where the runs execute: serial (here, one by one), processes (a local pool) or ray (Ray tasks; pip install 'rps_astro_cli[ray]'). Same report either way.")] = "serial",
    ray_address: Annotated[str | None, typer.Option("--ray-address", help="--executor ray: join this Ray cluster (e.g. auto, ray://head:10001) instead of starting a local one.")] = None,
    workers: Annotated[int | None, typer.Option("--workers", help="--executor processes/ray (local): parallel runs (default: all cores).")] = None,
    fail_under: Annotated[float | None, typer.Option("--fail-under", help="Exit 1 when SLO attainment (good/all) is below this fraction.")] = None,
    slo_class: Annotated[list[str] | None, typer.Option("--slo-class", help="A per-request SLO class NAME:ttft_ms=1000,tpot_ms=100,share=0.7,priority=0 (repeat; shares ≤ 1 in all, the rest carry none): each request joins one by share (seeded by --seed), is sent with x-slo-class / x-slo-ttft-ms / x-slo-tpot-ms and its body priority (vLLM without --scheduling-policy priority rejects a nonzero one: use priority=0 there), and report.json's metrics.overall and metrics.NAME carry goodput_rps, slo_attainment and refused.")] = None,
    admission: Annotated[str, typer.Option("--admission", help="Virtual: a request whose TTFT SLO no instance is predicted to meet (predicted TTFT x 1.1 over it, or no room now: 5 % of batch slots and KV blocks free after it): reject (default; recorded as refused) | queue (one in time but without room waits in the router queue, decided again every 50 ms) | off (dispatched anyway). Live: the scheduler's own --admission decides.")] = "reject",
    out: Annotated[str | None, typer.Option("--out", help="Report folder, new or existing (default bench-results/<workload>-<time>); checked before the run starts.")] = None,
    no_report: Annotated[bool, typer.Option("--no-report", help="Write no files.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print report.json's content on stdout instead of the table.")] = False,
    wide: Annotated[bool, typer.Option("--wide", help="Print every summary column (the default table fits 80 columns).")] = False,
) -> None:
    """Benchmark a cluster (live) or the virtual cluster: workloads, arrivals, honest metrics,
    SLO capacity and a report folder (metric formulas: docs/metrics.md).

    Examples:

    \b
      astro bench --cluster cluster.json -w sharegpt -n 200 \\
          --request-rate 5 --slo ttft:10
      astro bench --base-url http://127.0.0.1:8000 -w burstgpt \\
          --arrival trace --time-scale 0.1
      astro bench --virtual --instances 12 -w length-trace -n 5000 \\
          --max-total-tokens 4096 --policies round_robin,llumnix,power_of_k \\
          --k 2,all --oracle-lengths --capacity
      astro bench --virtual ... --capacity --executor ray --capacity-width 2

    Exit codes: 0 every request ok; 1 every request of a run failed, or --fail-under
    not met; 2 bad input (a flag or file); 3 some requests failed (errors, zero-token
    streams) or outputs were cut short (finish_reason length before max_tokens);
    130 interrupted (Ctrl-C or SIGTERM), after writing the partial report.
    Refused requests (admission: HTTP 429, or refused in the virtual cluster) are not
    failures: alone they leave the exit code 0; they count as SLO misses in
    slo_attainment (and in --fail-under's attainment).
    """
    from rps_astro_cli.bench.arrivals import parse_positive, parse_rates
    from rps_astro_cli.bench.config import BenchConfig
    from rps_astro_cli.bench.runner import run_bench
    from rps_astro_cli.errors import AstroUserError
    from rps_astro_cli.params import parse_assignments

    # Parse-time checks: bad numbers fail before anything starts.
    rate = parse_positive(request_rate, "--request-rate")
    b = parse_positive(burstiness, "--burstiness") if burstiness is not None else 1.0
    ts = parse_positive(time_scale, "--time-scale", allow_inf=False,
                        fix_inf="pass a finite factor, e.g. 0.01 to replay the trace 100x faster; to send "
                                "every request at once use --arrival constant --request-rate inf")
    if burstiness is not None and arrival == "poisson":
        arrival = "gamma"
    rate_list = parse_rates(rates) if rates is not None else None
    rdef: dict = {}
    if recipe is not None:
        if not virtual:
            raise AstroUserError("--recipe describes the virtual cluster; a live cluster has its own "
                                 "(astro serve --recipe)", field="--recipe", fix="add --virtual")
        from rps_astro_cli.bench.virtual import recipe_flag_defaults

        rdef = recipe_flag_defaults(recipe)
        if policies:  # the recipe's k / objective / params belong to its own dispatch policy
            rdef = {k: v for k, v in rdef.items() if k not in ("ks", "objective", "policy_params")}
    out_dir = None if no_report else (out or f"{_DEFAULT_OUT}/{workload}-{time.strftime('%Y%m%d-%H%M%S')}")
    cfg = BenchConfig.flat(
        workload=workload, path=path, num_requests=num_requests, seed=seed, tokenizer=tokenizer,
        image_dir=image_dir, video_dir=video_dir, max_frames=max_frames, min_tokens=min_tokens,
        max_prompt_tokens=max_prompt_tokens, max_total_tokens=max_total_tokens, arrival=arrival,
        request_rate=rate, burstiness=b, time_scale=ts, max_concurrency=max_concurrency, rates=rate_list,
        cluster=cluster, base_url=base_url, model=model, endpoint=endpoint, send_true_lengths=send_true_lengths,
        max_tokens=max_tokens, ignore_eos=ignore_eos, timeout_s=request_timeout, api_key=api_key, virtual=virtual,
        profile=profile, instance_policy=instance_policy or rdef.get("instance_policy", "fcfs"),
        instances=instances if instances is not None else rdef.get("instances", _profile_count(profile) or 4),
        predictor_profile=predictor_profile, calibration=calibration,
        instance_policies=_split(instance_policies), recipe=recipe,
        policies=_split(policies) or rdef.get("policies"), ks=_split(k) or rdef.get("ks"),
        objective=objective or rdef.get("objective"),
        policy_params={**(rdef.get("policy_params") or {}), **(parse_assignments(param) or {})} or None,
        instance_policy_params=parse_assignments(instance_param, "--instance-param") or None, oracle_lengths=oracle_lengths, prediction_noise=prediction_noise,
        prediction_noise_fraction=prediction_noise_fraction, length_model=length_model, remaining_length=remaining_length,
        max_num_seqs=max_num_seqs, slo=slo, slo_scale=slo_scale, capacity=capacity,
        capacity_metric=capacity_metric, capacity_percentile=capacity_percentile,
        capacity_threshold_s=capacity_threshold, capacity_start_rps=capacity_start_rate, capacity_max_rps=capacity_max_rate, fail_under=fail_under,
        schedulers=schedulers, status_interval_s=status_interval,
        capacity_width=capacity_width, executor=executor, ray_address=ray_address, workers=workers,
        out_dir=out_dir, multi_turn=True if multi_turn else None, think_time=think_time,
        ttft_definition=ttft_definition, sampling=sampling, input_len=input_len, output_len=output_len,
        warmup=warmup, max_seconds=max_seconds, slo_classes=slo_class or None, admission=admission)
    result = _run_with_progress(cfg, run_bench)
    if as_json:
        import json

        from rps_astro_cli.bench.report import report_dict

        typer.echo(json.dumps(report_dict(result)))
    else:
        print_summary(result, wide=wide)
    for w in result.warnings[len(result.workload.get("warnings") or []):]:
        err_console.print(f"[bold yellow]WARNING:[/] {w}", highlight=False, soft_wrap=True)
    if result.out_dir:
        err_console.print(f"report: {result.out_dir}/report.json, report.md, report.html, requests.jsonl, "
                          "summary.csv, requests.csv",
                          highlight=False, soft_wrap=True)
    for reason in result.exit_reasons:
        err_console.print(f"[bold red]fail:[/] {reason}", highlight=False, soft_wrap=True)
    if result.exit_code:
        raise typer.Exit(result.exit_code)


def _profile_count(profile: str | None) -> int | None:
    """Instances a `--profile P1,P2,…` list gives (None: not a list)."""
    from rps_astro_cli.services.config import split_profiles

    profs = split_profiles(profile)
    return len(profs) if profs and len(profs) > 1 else None


def _run_with_progress(cfg, run_bench):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn("{task.description}"), BarColumn(),
                    TextColumn("done {task.completed:.0f}/{task.total:.0f} · ok {task.fields[ok]} · failed {task.fields[failed]}"),
                    TimeElapsedColumn(),
                    console=err_console, transient=False)
    state: dict = {}

    def on(event: str, **data) -> None:
        if event == "workload":
            wl = data["workload"]
            err_console.print(f"workload [bold]{wl.name}[/]: {len(wl.requests)} requests; data: {wl.source}",
                              highlight=False)
            if wl.skipped:
                err_console.print(f"  skipped: {dict(wl.skipped)}", highlight=False)
            if wl.notes:
                err_console.print(f"  adjusted: {dict(wl.notes)}", highlight=False)
            for w in wl.warnings:  # soft_wrap: a path in a warning stays whole (copyable)
                err_console.print(f"[bold yellow]WARNING:[/] {w}", highlight=False, soft_wrap=True)
        elif event == "run_start":
            state["task"] = prog.add_task(data["label"], total=data["total"], ok=0, failed=0)
            state["ok"] = state["failed"] = 0
        elif event == "run_end":
            run = data["run"]
            state.setdefault("walls", []).append(run.wall_s)
            m = run.metrics["overall"]
            _say(prog.console, f"done {run.label}: {m.num_completed}/{m.num_requests} ok, "
                 f"P99 TTFT {_f(m.ttft_s.p99)} s, mean E2E {_f(m.e2e_s.mean)} s, {run.wall_s:.1f} s wall")
            if m.goodput_rps is not None:  # per-request SLO classes (--slo-class)
                _say(prog.console, f"SLO classes: goodput {m.goodput_rps:.2f} req/s, attainment "
                     f"{m.slo_attainment:.1%}, refused {m.refused} (admission; not errors)")
            if m.num_failed:
                from rps_astro_cli.bench.metrics import top_errors

                prog.console.print(f"  [bold red]failed {m.num_failed}:[/] {top_errors(m.errors)}",
                                   highlight=False, soft_wrap=True)
        elif event == "probe":
            _say(prog.console, probe_line(data["search"], data["rate"], data["ok"], state))
        elif event == "request":
            key = "ok" if data["record"].success else "failed"
            state[key] += 1
            prog.update(state["task"], advance=1, ok=state["ok"], failed=state["failed"])

    with prog:
        return run_bench(cfg, on)


def _say(con, text: str) -> None:
    """One progress line, indented 2, wrapped at words to the console's width with the
    continuation indented 6 (a label or number is never split)."""
    from rps_astro_cli.cli.common import wrap_help

    con.print(wrap_help(text.strip(), con.width, "  ", "      "), highlight=False, markup=False, soft_wrap=True)


def _f(v) -> str:
    return "n/a" if v is None else f"{v:.3g}"


def probe_line(search, rate: float, ok: bool, state: dict) -> str:
    """One capacity probe on the console: its value against the goal, the bracket, and
    how many probes are left (`CapacitySearch.probes_left`) with the time they should
    take at the mean wall time of the probes so far (`state["walls"]`)."""
    v = next((val for r, val, _ in reversed(search.probes) if r == rate), None)
    g = search.goal
    lo, hi = search.bracket()
    least, most = search.probes_left()
    walls = state.get("walls") or []
    per = sum(walls) / len(walls) if walls else None
    if most == 0:
        left = "search done"
    else:
        n = f"{least}" if least == most else f"{least}–{most}" if most is not None else f"≥ {least}"
        eta = f", ≈ {_dur(per * (most if most is not None else least))}" if per and (most or least) else ""
        left = f"{n} probe{'s' if most != 1 else ''} left{eta}"
    br = f"[{_f(lo) if lo is not None else '?'}, {_f(hi) if hi is not None else '?'}] req/s"
    label = f"{search.label} " if search.label else ""
    verdict = "met" if ok else "missed (not in steady state)" if rate in search.unsteady else "missed"
    return (f"  probe {len(search.probes)} {label}at {rate:.3g} req/s: {g.metric} p{g.percentile:g} "
            f"{_f(v)} s vs {g.threshold_s:g} s → {verdict}; bracket {br}; {left}")


def _dur(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


COMPACT_COLUMNS = ("run", "ok/all", "TTFT mean", "TTFT p99", "TPOT mean", "ITL p99", "E2E mean", "E2E p99")
"""The default console table: fits 80 columns (the full one: --wide, report.md)."""


def common_suffix(labels: list[str], sep: str = " @ ") -> str | None:
    """The " @ <arrivals>" part every run label shares (None: they differ or have none),
    e.g. ["round_robin @ poisson 5 req/s", "llumnix @ poisson 5 req/s"] → "poisson 5 req/s"."""
    tails = {lab.split(sep, 1)[1] if sep in lab else None for lab in labels}
    return tails.pop() if len(tails) == 1 else None


def _label_table(out, title: str, caption: str | None, headers: list[str], rows: list[list[str]],
                 left: int = 1):
    """A compact table whose first column holds labels: when the labels as they are would
    make it wider than `out`, they become numbers with a legend under the table (returned
    as lines), so no row ever wraps and no label is cut. Returns (table, legend lines)."""
    from rich import box
    from rich.table import Table

    def build(labels: list[str]) -> Table:
        t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, caption=caption)
        for i, h in enumerate(headers):
            t.add_column(h, no_wrap=True, justify="left" if i < left else "right")
        for lab, row in zip(labels, rows):
            t.add_row(lab, *row[1:])
        return t

    t = build([r[0] for r in rows])
    if table_fits(out, t):
        return t, []
    return build([f"#{i}" for i in range(1, len(rows) + 1)]), [f"#{i} {r[0]}" for i, r in enumerate(rows, 1)]


def print_summary(result, wide: bool = False) -> None:
    """Rich summary table (+ capacity table) of a `BenchResult`: the compact columns
    (`COMPACT_COLUMNS`, fitting 80 columns: numeric cells and run labels never wrap; the
    arrivals all runs share move to the title; labels too long for the width become #1,
    #2, … with a legend) by default, every column with `wide`."""
    from rich.console import Console
    from rich.table import Table

    from rps_astro_cli.bench.report import report_dict
    from rps_astro_cli.bench.report_md import SUMMARY_COLUMNS, fmt, summary_rows, time_unit

    out = console if console.is_terminal else Console(width=200) if wide else Console()
    rep = report_dict(result)
    tdef = "" if rep["target"].get("mode") == "virtual" else f"; TTFT/ITL: {rep['config'].get('ttft_definition')}"
    rows = summary_rows(rep)  # class rows only when the run has more than one class
    arrivals = common_suffix([r[0] for r in rows]) if not wide else None
    at = f" @ {arrivals}" if arrivals else ""
    title = f"astro bench — {rep['workload']['name']} ({rep['target'].get('mode')}){at}; {time_unit(rep)}{tdef}"
    legend: list[str] = []
    if wide:
        t = Table(title=title, show_lines=False)
        for c in SUMMARY_COLUMNS:
            t.add_column(c, overflow="fold")
        for row in rows:
            t.add_row(*row)
    else:
        idx = [SUMMARY_COLUMNS.index(c) for c in COMPACT_COLUMNS[1:]]
        short = []
        for row in rows:
            label = row[0].removesuffix(at) if at else row[0]
            short.append([label if row[1] == "overall" else f"{label} · {row[1]}", *[row[i] for i in idx]])
        headers = ["run", *(c.replace(" ", "\n") for c in COMPACT_COLUMNS[1:])]
        # a column no run measured (ITL in the virtual cluster, which times no chunks) is left out
        cols = [0, *(j for j in range(1, len(headers)) if any(r[j] != "n/a" for r in short))]
        headers, short = [headers[j] for j in cols], [[r[j] for j in cols] for r in short]
        t, legend = _label_table(out, title, "seconds; every column: --wide, report.md", headers, short)
    out.print(t)
    for line in legend:
        out.print(line, highlight=False, markup=False)
    if rep["capacity"]:
        _print_capacity(out, rep["capacity"], fmt, wide)


def _print_capacity(out, capacity: list[dict], fmt, wide: bool) -> None:
    """The SLO-capacity table: one line per policy (the goal, when all share it, in the
    title) and each policy's note below it as a paragraph, wrapped at words."""
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    goals = {c["goal"] for c in capacity}
    one_goal = len(goals) == 1 and not wide
    if wide:
        ct = Table(title="SLO capacity")
        for c in ("policy", "goal", "capacity req/s", "interpolated", "probes", "note"):
            ct.add_column(c)
        for c in capacity:
            ct.add_row(c["label"], c["goal"], fmt(c["capacity_rps"]), fmt(c["interpolated_rps"]),
                       str(len(c["probes"])), c["note"])
        out.print(ct)
        return
    headers = ["policy", *([] if one_goal else ["goal"]), "capacity\nreq/s", "interpolated\nreq/s", "probes"]
    rows = [[c["label"], *([] if one_goal else [c["goal"]]), fmt(c["capacity_rps"]), fmt(c["interpolated_rps"]),
             str(len(c["probes"]))] for c in capacity]
    title = f"SLO capacity — {goals.pop()}" if one_goal else "SLO capacity"
    ct, legend = _label_table(out, title, None, headers, rows, left=1 if one_goal else 2)
    out.print(ct)
    for line in legend:
        out.print(line, highlight=False, markup=False)
    for c in capacity:
        if c["note"]:
            out.print(Padding(Text(f"{c['label']}: {c['note']}"), (0, 0, 0, 2)), highlight=False)


def register(app: typer.Typer) -> None:
    """Add `astro bench` to the root app."""
    from rps_astro_cli.cli.common import HELP_CLASSES

    # click's plain help (as every astro command, `cli.main`): bench has ~60 options, and
    # Rich's option table cut their names at 80 columns (`--max-prompt-toke…`)
    app.command("bench", cls=HELP_CLASSES[0], context_settings={"max_content_width": 100})(bench)


__all__ = ["bench", "register", "print_summary"]
