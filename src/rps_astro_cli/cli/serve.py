"""`astro serve` group: the roles (engine, predictor, tagger, scheduler) and, with no
role, the whole cluster on one machine."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from rps_astro_cli.cli.common import (
    InstanceParamOpt,
    ParamOpt,
    deprecated_alias,
    user_errors,
    warn_key_on_command_line,
)

if TYPE_CHECKING:
    from rps_astro_cli.services.scheduler import SchedulerSettings

serve_app = typer.Typer(help="Run astro services (engine, predictor, tagger, scheduler, epp), or with no role the "
                        "whole cluster: `astro serve --instances 4`.",
                        invoke_without_command=True)

HostOpt = Annotated[str, typer.Option("--host", help="Listen address (127.0.0.1 unless you mean to expose it).")]
PortOpt = Annotated[int, typer.Option("--port", help="Listen port (0 = any free port; printed as 'ready: URL').")]
ReadyOpt = Annotated[str | None, typer.Option("--ready-file", help="Write the base URL here once listening.")]
KeyOpt = Annotated[str | None, typer.Option("--api-key", envvar="ASTRO_API_KEY", callback=warn_key_on_command_line,
                                             help="Require 'Authorization: Bearer KEY' (env ASTRO_API_KEY, "
                                             "which `ps` does not show).")]
LogOpt = Annotated[str, typer.Option("--log-level", help="debug | info | warning | error.")]
BodyOpt = Annotated[int, typer.Option("--max-body-bytes", help="Largest request body (bytes; larger gets 413).")]


@serve_app.callback()
@user_errors
def cluster(
    ctx: typer.Context,
    instances: Annotated[int | None, typer.Option("--instances", help="Engines.  [default: 4, or the recipe's]")] = None,
    recipe: Annotated[str | None, typer.Option("--recipe", help="Recipe YAML (path or name under recipes/).")] = None,
    policy: Annotated[str | None, typer.Option("--policy", help="Dispatch policy (power_of_k, llumnix, least_kv, "
                                               "...; `astro policies` lists them with their parameters).  [default: power_of_k, or the recipe's]")] = None,
    k: Annotated[str | None, typer.Option("--k", help="power_of_k sample size, 'all' (full fanout) or 'auto' (full fanout up to 8 engines, else the 8 least loaded).  [default: auto, or the recipe's]")] = None,
    objective: Annotated[str | None, typer.Option("--objective", help="power_of_k objective: e2e | ttft.  [default: ttft, or the recipe's]")] = None,
    param: ParamOpt = None,
    profile: Annotated[str | None, typer.Option("--profile", help="Engine execution profile id or JSON path: one for every engine, or P1,P2,... one per engine (a heterogeneous fleet; as many as --instances).")] = None,
    predictor_profile: Annotated[str | None, typer.Option("--predictor-profile", help="The profile the Predictors simulate: one for all, or P1,P2,... one per engine (default: each its engine's; another one = a model-mismatch experiment).")] = None,
    calibration: Annotated[str | None, typer.Option("--calibration", help="online (default): each Predictor refits its step model from its engine's steps; off: keep the profile, only track its error.")] = None,
    predictors: Annotated[str | None, typer.Option("--predictors", help="Where the look-aheads run: in-process (in the scheduler, on its /status polls: no RPC hop, the default for a fleet on one host) | sidecars (one Predictor process per engine, as the Kubernetes overlays run them).  [default: in-process, or the recipe's]")] = None,
    time_scale: Annotated[float | None, typer.Option("--time-scale", help="Sim wall s per engine s (0.1 = 10x faster).  [default: 1.0, or the recipe's]")] = None,
    instance_policy: Annotated[str | None, typer.Option("--instance-policy", help="In-instance policy of every engine.  [default: fcfs, or the recipe's]")] = None,
    instance_param: InstanceParamOpt = None,
    backend: Annotated[str | None, typer.Option("--backend", help="Engine backend of every instance: sim | vllm.  [default: sim, or the recipe's]")] = None,
    model: Annotated[str | None, typer.Option("--model", help="vllm backend: model path or name (added to the engines' vLLM flags).")] = None,
    engine_arg: Annotated[list[str] | None, typer.Option("--engine-arg", help="vllm backend: one more vLLM flag or value for every engine (repeat).")] = None,
    host: Annotated[str | None, typer.Option("--host", help="Scheduler bind address.  [default: 127.0.0.1, or the recipe's]")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Scheduler port (0 = any free port).  [default: 0, or the recipe's]")] = None,
    api_key: KeyOpt = None,
    restart_crashed: Annotated[int | None, typer.Option("--restart-crashed", help="Restarts per crashed child within 60 s (older ones are forgiven).  [default: 3, or the recipe's]")] = None,
    oracle_lengths: Annotated[bool | None, typer.Option("--oracle-lengths/--no-oracle-lengths", help="Scheduler uses the true lengths the bench sends (ablation).")] = None,
    admission: Annotated[str | None, typer.Option("--admission", help="Requests with a TTFT SLO no instance is predicted to meet: reject (HTTP 429; default) | queue (one in time but without room waits in a bounded router queue) | off (recipe scheduler.admission).")] = None,
    cluster_json: Annotated[str, typer.Option("--cluster-json", help="Where to write the endpoints for astro bench.")] = "cluster.json",
    run_dir: Annotated[str | None, typer.Option("--run-dir", help="Logs folder.  [default: runs/serve-<time>]")] = None,
    old_n: Annotated[int | None, typer.Option("-n", hidden=True, callback=deprecated_alias("-n", "--instances"))] = None,
) -> None:
    """With no role: start N sim engines + tagger + scheduler (its look-aheads in-process,
    or N Predictor sidecars with --predictors sidecars) on loopback,
    print their endpoints, write cluster.json, and supervise them until Ctrl-C."""
    if ctx.invoked_subcommand is not None:
        return
    from rps_astro_cli.cli.common import console, pick_alias

    # -n is --num-requests everywhere else (bench, simulate, demo): here it is a deprecated alias
    instances = pick_alias(ctx, "--instances", instances, "-n", old_n)
    from rps_astro_cli.errors import AstroUserError
    from rps_astro_cli.params import parse_assignments
    from rps_astro_cli.protocol.limits import CostLimits, HttpLimits
    from rps_astro_cli.services.cluster import ClusterError, ClusterSupervisor, default_run_dir
    from rps_astro_cli.services.config import ClusterConfig, load_recipe, with_fleet, with_overrides

    # a bad $ASTRO_MAX_* / $ASTRO_HTTP_* is one line here, before any child starts
    CostLimits.from_env()
    HttpLimits.from_env()
    cfg = load_recipe(recipe) if recipe else ClusterConfig()
    source = f"recipe {recipe}" if recipe else "defaults"
    cfg = with_fleet(cfg, instances=instances, profile=profile, predictor_profile=predictor_profile, source=source)
    params = {f"scheduler.params.{n}": v for n, v in parse_assignments(param).items()}
    params.update({f"engine.instance_policy_params.{n}": v
                   for n, v in parse_assignments(instance_param, "--instance-param").items()})
    flags = {"instances": "--instances", "scheduler.policy": "--policy", "scheduler.k": "--k",
             "scheduler.objective": "--objective", "engine.time_scale": "--time-scale",
             "engine.instance_policy": "--instance-policy", "host": "--host", "scheduler.port": "--port",
             "api_key": "--api-key", "restart_crashed": "--restart-crashed",
             "scheduler.oracle_lengths": "--oracle-lengths", "engine.backend": "--backend",
             "scheduler.admission": "--admission",
             "predictor.calibration": "--calibration", "predictor.in_process": "--predictors",
             **{path: f"--{'instance-' if path.startswith('engine.') else ''}param {path.rsplit('.', 1)[1]}"
                for path in params}}
    if predictors not in (None, "in-process", "sidecars"):
        raise AstroUserError(f"got {predictors!r}", field="--predictors", fix="use in-process or sidecars")
    cfg = with_overrides(cfg, {
        "predictor.in_process": None if predictors is None else predictors == "in-process",
        "instances": instances if isinstance(cfg.instances, int) else None, "scheduler.policy": policy,
        "scheduler.k": k, "scheduler.objective": objective,
        "engine.time_scale": time_scale, "engine.instance_policy": instance_policy,
        "host": host, "scheduler.port": port, "api_key": api_key, "restart_crashed": restart_crashed,
        "scheduler.oracle_lengths": oracle_lengths, "predictor.calibration": calibration,
        "scheduler.admission": admission,
        "engine.backend": backend, **params,
    }, flags, source=source)
    if model or engine_arg:
        extra = list(cfg.engine.extra_args) + (["--model", model] if model else []) + list(engine_arg or [])
        cfg = with_overrides(cfg, {"engine.extra_args": extra})
    sup = ClusterSupervisor(cfg, run_dir or default_run_dir(), cluster_json,
                            report=lambda line: console.print(line, highlight=False, markup=False))
    p = cfg.predictor
    parts = ("predictors + " if p.enabled and not p.in_process else "") + "tagger + scheduler" + \
        (" (look-aheads in-process)" if p.enabled and p.in_process else "")
    console.print(f"starting {cfg.num_instances} engines + {parts} "
                  f"(policy {cfg.scheduler.policy}, {_fleet_text(sup)}) ...")
    try:
        info = sup.start()
    except ClusterError as exc:
        from rps_astro_cli.cli.common import fail

        fail(str(exc), 1)
        return
    _print_table(info, cluster_json)
    raise typer.Exit(sup.supervise())


def _fleet_text(sup) -> str:
    """"profile P", or each profile with its count (and what the Predictors assume when it differs)."""
    from collections import Counter

    runs = Counter((s.profile, s.assumed_profile) for s in sup.specs)
    if len(runs) == 1 and sup.specs[0].profile == sup.specs[0].assumed_profile:
        return f"profile {sup.specs[0].profile}"
    return "profiles " + ", ".join(f"{n} × {p}" + (f" (Predictors told {a})" if a != p else "")
                                   for (p, a), n in runs.items())


def _print_table(info: dict, cluster_json: str) -> None:
    """The cluster's endpoints, one row per process: URLs never cut or wrapped (users copy
    them). When the profile column would make the table wider than the console, the
    profiles go below it, one line per engine, instead."""
    from rich import box
    from rich.table import Table

    from rps_astro_cli.cli.common import console, table_fits

    rows = [("scheduler", "scheduler", info["scheduler"]["openai_base_url"], str(info["scheduler"]["pid"]), "")]
    if info["tagger"]:
        rows.append(("tagger", "tagger", info["tagger"]["url"], str(info["tagger"]["pid"]), ""))
    for inst in info["instances"]:
        rows.append(("engine", inst["name"], inst["engine_url"], str(inst["engine_pid"]), inst.get("profile") or ""))
        if inst["predictor_url"]:
            rows.append(("predictor", inst["name"].replace("engine", "predictor"), inst["predictor_url"],
                         str(inst["predictor_pid"]), inst.get("assumed_profile") or ""))

    def build(with_profile: bool) -> Table:
        t = Table(title=f"astro cluster '{info['name']}' — policy {info['policy']}", box=box.SIMPLE_HEAD,
                  show_edge=False, pad_edge=False, collapse_padding=True)
        for c in ("role", "name", "url", "pid", *(("profile",) if with_profile else ())):
            t.add_column(c, no_wrap=True, justify="right" if c == "pid" else "left")
        for r in rows:
            t.add_row(*(r if with_profile else r[:4]))
        return t

    t = build(True)
    below = not table_fits(console, t)
    console.print(build(False) if below else t)
    if below:
        console.print()
        for r in rows:
            if r[4]:
                console.print(f"{r[1]}: profile {r[4]}", highlight=False, markup=False)
    console.print(f"endpoints written to {cluster_json}; model {info['model']}; Ctrl-C stops every child",
                  highlight=False)


@serve_app.command("predictor")
@user_errors
def predictor(
    engine_url: Annotated[str, typer.Option("--engine-url", help="Base URL of the engine to predict for.")],
    profile: Annotated[str | None, typer.Option("--profile", help="Execution profile (default: the engine's).")] = None,
    status_cache_ms: Annotated[float, typer.Option("--status-cache-ms", help="Reuse an engine /status this long (ms).")] = 20.0,
    status_max_age_ms: Annotated[float, typer.Option("--status-max-age-ms", help="Use a stale status up to this age while refreshing it in the background (ms).")] = 250.0,
    extension_tokens: Annotated[int, typer.Option("--extension-tokens", help="Auto-extension (tokens).")] = 10,
    default_output_tokens: Annotated[int, typer.Option("--default-output-tokens", help="Length assumed when unknown.")] = 256,
    calibration: Annotated[str, typer.Option("--calibration", help="online: refit the step model from the engine's steps (starting from --profile); off: keep the profile, only track its error.")] = "online",
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 0,
    ready_file: ReadyOpt = None,
    api_key: KeyOpt = None,
    log_level: LogOpt = "warning",
) -> None:
    """Serve a Predictor sidecar: POST /predict → predicted TTFT/E2E on its engine."""
    from rps_astro_cli.errors import AstroUserError
    from rps_astro_cli.protocol.internal_auth import internal_token
    from rps_astro_cli.services.predictor import CALIBRATION_MODES, PredictorSettings, run_predictor

    if status_cache_ms < 0:
        raise AstroUserError(f"must be ≥ 0, got {status_cache_ms}", field="--status-cache-ms")
    if extension_tokens < 0 or default_output_tokens < 1:
        raise AstroUserError("--extension-tokens must be ≥ 0 and --default-output-tokens ≥ 1",
                             field="--extension-tokens")
    if calibration not in CALIBRATION_MODES:
        raise AstroUserError(f"got {calibration!r}", field="--calibration", fix="use online or off")
    settings = PredictorSettings(engine_url=engine_url, status_cache_s=status_cache_ms / 1000,
                                 status_max_age_s=status_max_age_ms / 1000, profile=profile,
                                 extension_tokens=extension_tokens, default_output_tokens=default_output_tokens,
                                 api_key=api_key or None, internal_token=internal_token(), calibration=calibration)
    run_predictor(settings, host, port, log_level, ready_file)


@serve_app.command("tagger")
@user_errors
def tagger(
    length_model: Annotated[str | None, typer.Option("--length-model", help="Length-model artifact (default: baseline).")] = None,
    profile: Annotated[str | None, typer.Option("--profile", help="Profile pricing media tokens.")] = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 0,
    ready_file: ReadyOpt = None,
    api_key: KeyOpt = None,
    max_body_bytes: BodyOpt = 1 << 20,
    log_level: LogOpt = "warning",
) -> None:
    """Serve the length tagger: POST /tag → predicted output tokens + modality facts."""
    from rps_astro_cli.services.tagger import TaggerSettings, run_tagger

    run_tagger(TaggerSettings(length_model, profile, api_key or None, max_body_bytes), host, port, log_level,
               ready_file)


# The dispatch flags `astro serve scheduler` and `astro serve epp` share, declared once.
EngineOpt = Annotated[list[str] | None, typer.Option(
    "--engine", help="Engine base URL (repeat per instance; the EPP picks its HOST:PORT); or --discover.")]
PredictorOpt = Annotated[list[str] | None, typer.Option("--predictor", help="Predictor URL, same order as --engine.")]
DiscoverOpt = Annotated[str | None, typer.Option(
    "--discover", help="Find the engines instead of --engine: 'kubernetes' (the EndpointSlices of "
    "--discover-service, watched).")]
DiscoverServiceOpt = Annotated[str | None, typer.Option(
    "--discover-service", help="--discover kubernetes: the engines' Service (ports named http and predictor).")]
DiscoverNamespaceOpt = Annotated[str | None, typer.Option(
    "--discover-namespace", help="--discover kubernetes: the Service's namespace (default: the pod's own).")]
TaggerOpt = Annotated[str | None, typer.Option("--tagger", help="Tagger URL (default: tag in-process).")]
PolicyOpt = Annotated[str, typer.Option("--policy", help="Dispatch policy (`astro policies` lists them).")]
KOpt = Annotated[str | None, typer.Option(
    "--k", help="power_of_k sample size (≤ engines), 'all' (every engine's Predictor is asked) or 'auto' (all up to 8 engines, else the 8 least loaded).  [default: auto]")]
ObjectiveOpt = Annotated[str, typer.Option("--objective", help="power_of_k objective: ttft (default) | e2e.")]
LlumnixVariantOpt = Annotated[str, typer.Option("--llumnix-variant", help="astrolabe (Llumnix-) | code.")]
PredictDeadlineOpt = Annotated[float, typer.Option("--predict-deadline-ms", help="Predict RPC deadline (ms).")]
TagDeadlineOpt = Annotated[float, typer.Option("--tag-deadline-ms", help="Tag RPC deadline (ms).")]
HealthIntervalOpt = Annotated[float, typer.Option("--health-interval-ms", help="Health-check period (ms).")]
HealthTimeoutOpt = Annotated[float, typer.Option(
    "--health-timeout-ms", help="Deadline of one engine health check or /status poll (ms); a miss takes the engine "
    "out of rotation until a check passes (raise it on a loaded host).")]
StatusIntervalOpt = Annotated[float, typer.Option(
    "--status-interval-ms", help="Status poll period of status-based policies (ms).")]
ServedModelOpt = Annotated[list[str] | None, typer.Option(
    "--served-model-name", help="Accepted model name(s) (others get 404); default: the engines'.")]
TagProfileOpt = Annotated[str | None, typer.Option("--profile", help="Profile for in-process tagging.")]
TagModelOpt = Annotated[str | None, typer.Option("--length-model", help="Length model for in-process tagging.")]
DispatchSeedOpt = Annotated[int | None, typer.Option(
    "--seed", help="Seed of the dispatch Generator (default 0; with --discover, derived from the pod name "
    "$HOSTNAME so replicas differ).")]
PrefixTokenizerOpt = Annotated[str, typer.Option(
    "--prefix-tokenizer", help="Prefix-aware policies: a text prompt's token ids for its block hashes from an engine's "
    "POST /tokenize (engine: the ids vLLM caches by), the fallback tokenizer (fallback: the sim engine's), or auto "
    "(default): engine once some engine's /version is not astro-sim's.")]
TokenizeDeadlineOpt = Annotated[float, typer.Option(
    "--tokenize-deadline-ms", help="Deadline of that /tokenize RPC (ms); then the fallback ids are hashed.")]
AdmissionOpt = Annotated[str, typer.Option(
    "--admission", help="A request with a TTFT SLO (x-slo-ttft-ms, x-slo-class) that no instance is predicted to meet "
    "(predicted TTFT x 1.1 over it, or no room now: 5 % of batch slots and KV blocks free after it): reject "
    "(default; HTTP 429 + Retry-After), queue (one in time but without room waits in a bounded router queue, "
    "more important first, until room appears or its deadline passes) or off (dispatch it anyway). Requests "
    "without an SLO are unaffected.")]
SloClassOpt = Annotated[list[str] | None, typer.Option(
    "--slo-class", help="An SLO class NAME:ttft_ms=1000,tpot_ms=100,priority=0 (repeat), chosen by the x-slo-class "
    "header or a class named like the request's model.")]
DispatchCalibrationOpt = Annotated[str, typer.Option(
    "--calibration", help="online (default): correct each instance's predicted TTFT and E2E by what its own requests "
    "were then served with (a robust affine fit per instance, used while it beats the raw estimate: the API server, "
    "HTTP and later arrivals no step model sees); off: the Predictors' estimates as they are.")]
OracleOpt = Annotated[bool, typer.Option(
    "--oracle-lengths", help="Use vllm_xargs.astro_output_tokens (true length) as the predicted length when sent.")]


@dataclasses.dataclass(frozen=True)
class DispatchFlags:
    """The option group `astro serve scheduler` and `astro serve epp` share: each field is
    one option (its flag, help and default here, in --help order; units in the names), given
    to a command that takes `flags: DispatchFlags` under `@_dispatch_flags`."""

    engine: EngineOpt = None                        # engine base URLs (static fleet)
    predictor: PredictorOpt = None                  # their Predictor URLs, same order (or none)
    discover: DiscoverOpt = None                    # engine discovery source instead of --engine
    discover_service: DiscoverServiceOpt = None     # --discover kubernetes: the engines' Service
    discover_namespace: DiscoverNamespaceOpt = None  # ... and its namespace
    tagger: TaggerOpt = None                        # tagger URL (None: tag in-process)
    policy: PolicyOpt = "power_of_k"                # dispatch policy name
    k: KOpt = None                                  # power_of_k sample size or 'all'
    objective: ObjectiveOpt = "ttft"                # power_of_k objective
    llumnix_variant: LlumnixVariantOpt = "astrolabe"  # llumnix load formula
    param: ParamOpt = None                          # dispatch-policy NAME=VALUE assignments
    predict_deadline_ms: PredictDeadlineOpt = 50.0  # Predict RPC deadline
    tag_deadline_ms: TagDeadlineOpt = 50.0          # Tag RPC deadline
    health_interval_ms: HealthIntervalOpt = 500.0   # health-check period
    status_interval_ms: StatusIntervalOpt = 100.0   # /status poll period
    served_model_name: ServedModelOpt = None        # accepted model names (None: the engines')
    profile: TagProfileOpt = None                   # profile for in-process tagging
    length_model: TagModelOpt = None                # length model for in-process tagging
    seed: DispatchSeedOpt = None                    # dispatch Generator seed (None: 0, or the pod's)
    oracle_lengths: OracleOpt = False               # use the true lengths the client sends
    prefix_tokenizer: PrefixTokenizerOpt = "auto"   # where prefix-aware policies get token ids
    tokenize_deadline_ms: TokenizeDeadlineOpt = 20.0  # /tokenize RPC deadline
    health_timeout_ms: HealthTimeoutOpt = 1000.0    # one health check's / status poll's deadline
    admission: AdmissionOpt = "reject"              # requests with an SLO no instance can meet
    slo_class: SloClassOpt = None                   # SLO classes NAME:ttft_ms=..,tpot_ms=..,priority=..
    calibration: DispatchCalibrationOpt = "online"  # outcome correction of the predictions


def _dispatch_flags(fn: Callable[..., None]) -> Callable[..., None]:
    """Decorator of a command function: its `flags: DispatchFlags` parameter becomes the
    group's options, in its place (typer reads the signature), and the function is called
    with them gathered back into one `DispatchFlags`."""
    hints = typing.get_type_hints(DispatchFlags, include_extras=True)
    shared = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
              for f in dataclasses.fields(DispatchFlags)]
    names = [p.name for p in shared]
    sig = inspect.signature(fn, eval_str=True)
    params: list[inspect.Parameter] = []
    for p in sig.parameters.values():
        params.extend(shared if p.name == "flags" else [p.replace(kind=inspect.Parameter.KEYWORD_ONLY)])
    assert len(params) == len(sig.parameters) - 1 + len(shared), f"{fn.__name__} takes no `flags`"

    @functools.wraps(fn)
    def wrapper(**kwargs: Any) -> None:
        fn(flags=DispatchFlags(**{n: kwargs.pop(n) for n in names if n in kwargs}), **kwargs)

    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}
    return wrapper


@serve_app.command("scheduler")
@user_errors
@_dispatch_flags
def scheduler(
    flags: DispatchFlags,
    decisions_kept: Annotated[int, typer.Option("--decisions-kept", help="Decisions kept for GET /decisions.")] = 1000,
    predict_in_process: Annotated[bool, typer.Option("--predict-in-process", help="Instances without --predictor: run their look-ahead here, on the engine's /status (no sidecar RPC).")] = False,
    predictor_profile: Annotated[list[str] | None, typer.Option("--predictor-profile", help="--predict-in-process: the profile each engine's look-ahead simulates, same order as --engine (default: --profile, else the engine's own).")] = None,
    early_dispatch: Annotated[bool, typer.Option("--early-dispatch/--no-early-dispatch", help="When the decision reads no reply length (objective ttft, or a policy without predictions), text requests: decide while the tagger works (default on).")] = True,
    late_tag: Annotated[bool, typer.Option("--late-tag/--no-late-tag", help="With early dispatch, in-process look-aheads (or none) and fcfs engines: forward without waiting for the tag; its length follows to the look-aheads (default on).")] = True,
    time_scale: Annotated[float, typer.Option("--time-scale", help="The sim engines' --time-scale (wall s per engine s; 1 for vLLM): observed latencies are divided by it before the prediction-error metrics compare them with the Predictors' engine-second predictions.")] = 1.0,
    max_body_bytes: BodyOpt = 1 << 20,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 0,
    ready_file: ReadyOpt = None,
    api_key: KeyOpt = None,
    log_level: LogOpt = "warning",
) -> None:
    """Serve the global scheduler: OpenAI front door that tags, dispatches and forwards."""
    from dataclasses import replace

    from rps_astro_cli.services.scheduler import run_scheduler

    settings = _scheduler_settings(flags, decisions_kept=decisions_kept, max_body_bytes=max_body_bytes,
                                   api_key=api_key, early_dispatch=early_dispatch,
                                   predict_in_process=predict_in_process)
    settings = replace(settings, time_scale=_positive(time_scale, "--time-scale"), late_tag=late_tag)
    if predictor_profile:
        from rps_astro_cli.errors import AstroUserError
        from rps_astro_cli.services.config import check_profile_ref

        if len(predictor_profile) != len(settings.instances):
            raise AstroUserError(f"{len(predictor_profile)} --predictor-profile for {len(settings.instances)} --engine",
                                 field="--predictor-profile", fix="give one per engine, in the same order, or none")
        for ref in predictor_profile:
            check_profile_ref(ref, "--predictor-profile")
        settings = replace(settings, instances=tuple(replace(ep, profile=ref) for ep, ref
                                                     in zip(settings.instances, predictor_profile)))
    run_scheduler(settings, host, port, log_level, ready_file)


@serve_app.command("epp")
@user_errors
@_dispatch_flags
def epp(
    flags: DispatchFlags,
    destination_header: Annotated[str, typer.Option("--destination-header", help="Header (and metadata key) carrying the picked IP:PORT to the gateway.")] = "x-gateway-destination-endpoint",
    metadata_namespace: Annotated[str, typer.Option("--metadata-namespace", help="Dynamic-metadata namespace of the picked endpoint ('' = none).")] = "envoy.lb",
    body_mode: Annotated[str, typer.Option("--body-mode", help="Envoy's body mode when it sends no protocol_config: full_duplex_streamed (GIE's) | buffered.")] = "full_duplex_streamed",
    metrics_port: Annotated[int | None, typer.Option("--metrics-port", help="Serve Prometheus /metrics on this port.")] = None,
    max_body_bytes: BodyOpt = 1 << 20,
    host: HostOpt = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="gRPC listen port (ext_proc + grpc.health.v1; GIE's convention: 9002).")] = 9002,
    ready_file: ReadyOpt = None,
    api_key: KeyOpt = None,
    log_level: LogOpt = "warning",
) -> None:
    """Serve a Gateway API Inference Extension endpoint picker (Envoy ext_proc over gRPC):
    each request of an InferencePool is dispatched by astro (tag → Predictors → pick) and
    the gateway is told the endpoint (header and envoy.lb metadata
    x-gateway-destination-endpoint). Needs the epp extra."""
    from rps_astro_cli.errors import AstroUserError

    try:
        from rps_astro_cli.services.epp import BODY_MODES, EppSettings, run_epp
    except ImportError as exc:
        raise AstroUserError(f"needs the epp extra ({exc}): pip install "
                             "'rps_astro_cli[epp]'", field="astro serve epp") from None
    if body_mode not in BODY_MODES:
        raise AstroUserError(f"unknown mode {body_mode!r}; use one of: {', '.join(sorted(BODY_MODES))}",
                             field="--body-mode")
    if not destination_header.strip():
        raise AstroUserError("must not be empty", field="--destination-header")
    settings = _scheduler_settings(flags, decisions_kept=1000, max_body_bytes=max_body_bytes, api_key=api_key)
    run_epp(EppSettings(settings, destination_header.strip().lower(), metadata_namespace, body_mode,
                        metrics_port=metrics_port), host, port, log_level, ready_file)


def _scheduler_settings(flags: DispatchFlags, *, decisions_kept: int, max_body_bytes: int, api_key: str | None,
                        early_dispatch: bool = True, predict_in_process: bool = False) -> SchedulerSettings:
    """The `SchedulerSettings` of `astro serve scheduler`'s flags (`astro serve epp` shares
    `flags`); raises AstroUserError naming the flag."""
    from rps_astro_cli.errors import AstroUserError
    from rps_astro_cli.protocol.internal_auth import internal_token
    from rps_astro_cli.services.config import parse_config
    from rps_astro_cli.services.scheduler import InstanceEndpoint, SchedulerSettings

    engine = flags.engine or []
    preds = flags.predictor or []
    discovery = _discovery_settings(flags.discover, flags.discover_service, flags.discover_namespace,
                                    bool(engine or preds))
    seed = flags.seed
    if discovery is not None and seed is None:
        import os

        from rps_astro_cli.services.scheduler.settings import seed_from_pod_name

        seed = seed_from_pod_name(os.environ.get("HOSTNAME"))
    if preds and len(preds) != len(engine):
        raise AstroUserError(f"{len(preds)} --predictor for {len(engine)} --engine; give one per engine or none",
                             field="--predictor")
    from rps_astro_cli.params import parse_assignments

    params = parse_assignments(flags.param)
    from rps_astro_cli.dispatch.admission import parse_slo_class_spec

    classes = dict(parse_slo_class_spec(c) for c in flags.slo_class or ())
    sched: dict = {"policy": flags.policy, "objective": flags.objective, "llumnix_variant": flags.llumnix_variant,
                   "params": params, "prefix_tokenizer": flags.prefix_tokenizer, "admission": flags.admission,
                   "slo_classes": classes,
                   "tokenize_deadline_ms": flags.tokenize_deadline_ms, "health_timeout_ms": flags.health_timeout_ms}
    if flags.k is not None:
        sched["k"] = flags.k
    # with discovery the fleet size is unknown: k is checked against the largest fleet
    # (power-of-k takes the whole pool when k ≥ the instances discovered)
    n_instances = 256 if discovery is not None else len(engine)
    predictors = bool(preds) or discovery is not None or predict_in_process  # discovered: the pods' `predictor` port
    sec = parse_config({"instances": n_instances, "scheduler": sched, "predictor": {"enabled": predictors}}, "flags",
                       {"instances": "the --engine count", "scheduler.k": "--k", "scheduler.policy": "--policy",
                        "scheduler.objective": "--objective", "scheduler.llumnix_variant": "--llumnix-variant",
                        "predictor.enabled": "--predictor", "scheduler.prefix_tokenizer": "--prefix-tokenizer",
                        "scheduler.tokenize_deadline_ms": "--tokenize-deadline-ms",
                        "scheduler.health_timeout_ms": "--health-timeout-ms", "scheduler.admission": "--admission",
                        "scheduler.slo_classes": "--slo-class",
                        **{f"scheduler.params.{n}": f"--param {n}" for n in params}}).scheduler
    eps = tuple(InstanceEndpoint(f"engine-{i}", u, preds[i] if preds else None) for i, u in enumerate(engine))
    return SchedulerSettings(
        instances=eps, policy=flags.policy, policy_params=sec.policy_params(), tagger_url=flags.tagger,
        length_model=flags.length_model, profile=flags.profile, predict_deadline_s=flags.predict_deadline_ms / 1000,
        tag_deadline_s=flags.tag_deadline_ms / 1000, health_interval_s=flags.health_interval_ms / 1000,
        status_interval_s=flags.status_interval_ms / 1000, max_body_bytes=max_body_bytes,
        served_models=tuple(flags.served_model_name or ()), api_key=api_key or None, internal_token=internal_token(),
        seed=seed or 0,
        decisions_kept=max(1, decisions_kept), oracle_lengths=flags.oracle_lengths, early_dispatch=early_dispatch,
        predict_in_process=predict_in_process, discovery=discovery, prefix_tokenizer=sec.prefix_tokenizer,
        tokenize_deadline_s=sec.tokenize_deadline_ms / 1000, health_timeout_s=sec.health_timeout_ms / 1000,
        admission=sec.admission, slo_classes=sec.slo_class_map(), calibration=_calibration(flags.calibration))


def _calibration(mode: str) -> str:
    from rps_astro_cli.errors import AstroUserError
    from rps_astro_cli.services.predictor import CALIBRATION_MODES

    if mode not in CALIBRATION_MODES:
        raise AstroUserError(f"got {mode!r}", field="--calibration", fix="use online or off")
    return mode


def _positive(v: float, field: str) -> float:
    import math

    from rps_astro_cli.errors import AstroUserError

    if not (v > 0 and math.isfinite(v)):
        raise AstroUserError(f"must be a finite number > 0, got {v}", field=field,
                             fix="pass the engines' --time-scale, e.g. 1")
    return v


def _discovery_settings(discover: str | None, service: str | None, namespace: str | None, static: bool):
    """The scheduler's `DiscoverySettings` from the --discover flags (None: static
    --engine list). Raises AstroUserError naming the flag on a bad combination, or when
    not inside a pod (no in-cluster credentials)."""
    from rps_astro_cli.errors import AstroUserError

    if discover is None:
        for flag, value in (("--discover-service", service), ("--discover-namespace", namespace)):
            if value is not None:
                raise AstroUserError(f"{flag} needs --discover kubernetes", field=flag)
        if not static:
            raise AstroUserError("no engines: give --engine URL (repeat per instance) or --discover kubernetes "
                                 "--discover-service NAME", field="--engine")
        return None
    if discover != "kubernetes":
        raise AstroUserError(f"unknown source {discover!r}; the one source is 'kubernetes'", field="--discover")
    if static:
        raise AstroUserError("--discover kubernetes and --engine/--predictor exclude each other; give one or the "
                             "other", field="--discover")
    if not service:
        raise AstroUserError("--discover kubernetes needs --discover-service NAME (the engines' Service)",
                             field="--discover-service")
    from rps_astro_cli.discovery.kubernetes import KubeApi, WatchSettings
    from rps_astro_cli.services.scheduler.settings import DiscoverySettings

    return DiscoverySettings(KubeApi.in_cluster(namespace), WatchSettings(service=service))


def register(app: typer.Typer) -> None:
    """Add `astro serve ...` to the root app."""
    from rps_astro_cli.cli import serve_engine

    serve_engine.register(serve_app)
    app.add_typer(serve_app, name="serve")
