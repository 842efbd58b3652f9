"""Cluster recipes: the pydantic model of `recipes/*.yaml` behind `astro serve`.

A recipe names everything one `astro serve` starts; command-line flags override single
fields (`with_overrides`). Unknown keys are errors (a typo must not be silently ignored),
and every error names the field by its dotted path, e.g. `scheduler.k`.

    name: str                      # recipe name (reports, cluster.json)
    instances: int ≥ 1             # engines (each with its Predictor), all as `engine:` says
             | [{count ≥ 1, profile, num_gpu_blocks, max_num_seqs, max_num_batched_tokens,
                 time_scale}, ...]  # or groups (a heterogeneous fleet): `count` engines each,
                                    # these fields overriding `engine:`'s (≤ 256 in all)
    host: str = 127.0.0.1          # bind address of every child
    api_key: str | null            # front-door bearer key (scheduler /v1/*)
    internal_token: bool = true    # internal services require the cluster's token
    restart_crashed: int ≥ 0 = 3   # restarts per child within 60 s after crashes (0 = none; older ones forgiven)
    engine:    {backend, profile, instance_policy, instance_policy_params, time_scale, seed, num_gpu_blocks,
                max_num_seqs, max_num_batched_tokens, max_model_len, chunked_prefill, enable_prefix_caching,
                preprocess_slots, served_model_name, extra_args}
    predictor: {enabled, in_process, status_cache_ms, status_max_age_ms, extension_tokens,
                default_output_tokens, assumed_profile}
                # assumed_profile: the profile the Predictors are told (one id/path for all,
                # or a list, one per instance); null = each its own engine's (model-mismatch
                # experiments run engines on one profile and tell the Predictors another)
    tagger:    {enabled, length_model}
    scheduler: {policy, params, k, objective, llumnix_variant, predict_deadline_ms,
                tag_deadline_ms, health_interval_ms, status_interval_ms, max_body_bytes,
                port, seed, decisions_kept, oracle_lengths, early_dispatch, late_tag,
                prefix_tokenizer, tokenize_deadline_ms, health_timeout_ms}
                # params: the policy's declared parameters, e.g. {tie_blocks: 8} for
                # least_kv; k / objective / llumnix_variant: flat keys of power_of_k's
                # k, objective and llumnix's variant
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rps_astro_cli.errors import AstroUserError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EngineSection(_Strict):
    """How each engine is started (`astro serve engine ...`)."""

    backend: str = Field("sim", description="engine backend (sim | vllm)")
    profile: str = Field("llama-2-7b-a30", description="execution profile id or JSON path")
    instance_policy: str = Field("fcfs", description="in-instance scheduling policy")
    instance_policy_params: dict[str, Any] = Field(default_factory=dict, description="its declared parameters by "
                                                   "name (`astro serve --instance-param NAME=VALUE`)")
    time_scale: float = Field(1.0, gt=0, description="wall s per engine s (sim; 0.1 = 10x faster)")
    seed: int = Field(0, ge=0, description="engine i gets seed + i")
    num_gpu_blocks: int | None = Field(None, gt=0)
    max_num_seqs: int | None = Field(None, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)
    max_model_len: int | None = Field(None, gt=0)
    chunked_prefill: bool = True
    enable_prefix_caching: bool = Field(True, description="automatic prefix caching (vLLM V1's default: on)")
    preprocess_slots: int | None = Field(None, gt=0, description="virtual runs (`astro bench --virtual --recipe`): "
                                         "requests preprocessed at once by each engine's front end, FIFO "
                                         "(1 = one event loop, as the RPS-Serve authors' AsyncLLM harness); "
                                         "null = every request preprocesses on its own")
    served_model_name: str | None = None
    extra_args: list[str] = Field(default_factory=list, description="passed through to the backend")


class PredictorSection(_Strict):
    """Predictor sidecars (one per engine)."""

    enabled: bool = True
    in_process: bool = Field(True, description="true (default): no sidecars, the scheduler runs each instance's "
                             "look-ahead itself on its /status polls (no RPC hop: ~6 ms of front-door TTFT at "
                             "light load against ~34 ms with sidecars, docs/experiments/peer-routers.md); false: "
                             "one Predictor process per engine (spreads the look-ahead CPU of a large fleet)")
    status_cache_ms: float = Field(20.0, ge=0, description="reuse an engine /status this long (ms)")
    status_max_age_ms: float = Field(250.0, ge=0, description="use a stale status up to this age while "
                                     "refreshing it in the background (ms)")
    extension_tokens: int = Field(10, ge=0, description="auto-extension (tokens)")
    default_output_tokens: int = Field(256, ge=1, description="length assumed when none is known")
    calibration: Literal["online", "off"] = Field(
        "online", description="online: each Predictor refits its step model from its engine's steps (starting from "
        "its profile); off: the profile stays, its error is only tracked (the dispatch leans on load while it is "
        "high)")
    assumed_profile: str | list[str] | None = Field(
        None, description="the profile the Predictors simulate: one id/path for every instance, or a list with one "
        "per instance; null = each Predictor its own engine's (`astro serve --predictor-profile`)")


class TaggerSection(_Strict):
    """The length tagger service (`enabled: false`: no service; the scheduler tags
    in-process with the same model, saving one RPC hop per request)."""

    enabled: bool = True
    length_model: str | None = Field(None, description="artifact path/name; null = the baseline")


class SchedulerSection(_Strict):
    """The global scheduler (front door).

    The dispatch policy's parameters are declared by the policy (`DispatchPolicy.params`;
    `astro serve --help` and CONTRIBUTING.md list them) and go in `params`; `k`,
    `objective` and `llumnix_variant` are the flat keys existing recipes use for
    power_of_k's k / objective and llumnix's variant (a parameter declares its flat key
    as `Param.alias`); a value in `params` wins over its flat key. Both are converted and
    checked by the policy's declaration."""

    policy: str = "power_of_k"
    params: dict[str, Any] = Field(default_factory=dict, description="dispatch-policy parameters by name "
                                   "(`astro serve --param NAME=VALUE`), checked against the policy's declaration")
    k: int | Literal["all", "auto"] = Field("auto", description="power_of_k sample size; 'all' = full fanout; "
                                            "'auto' = all up to 8 instances, else the 8 least loaded")
    objective: str = Field("ttft", description="power_of_k objective: ttft | e2e")
    llumnix_variant: str = Field("astrolabe", description="llumnix load formula: astrolabe (Llumnix-) | code")
    predict_deadline_ms: float = Field(50.0, gt=0)
    tag_deadline_ms: float = Field(50.0, gt=0)
    health_interval_ms: float = Field(500.0, gt=0)
    status_interval_ms: float = Field(100.0, gt=0)
    max_body_bytes: int = Field(1 << 20, gt=0)
    port: int = Field(0, ge=0, le=65535, description="front-door port (0 = any free port)")
    seed: int = Field(0, ge=0)
    decisions_kept: int = Field(1000, ge=1, description="decisions kept for GET /decisions")
    oracle_lengths: bool = Field(False, description="use the true length the bench sends as the prediction")
    early_dispatch: bool = Field(True, description="objective ttft, text requests: ask the Predictors while the "
                                 "tagger works (a text request's TTFT does not depend on its reply length)")
    late_tag: bool = Field(True, description="with early dispatch, in-process look-aheads and fcfs engines: forward "
                           "without waiting for the tag; its length follows to the look-aheads")
    prefix_tokenizer: Literal["auto", "engine", "fallback"] = Field(
        "auto", description="prefix-aware policies: a text prompt's token ids for its block hashes from an engine's "
        "POST /tokenize (engine: the ids vLLM caches by), astro's fallback tokenizer (fallback: the sim engine's), or "
        "auto: engine unless every engine's /version says astro-sim")
    tokenize_deadline_ms: float = Field(20.0, gt=0, description="deadline of that /tokenize RPC; then the fallback "
                                        "ids are hashed")
    health_timeout_ms: float = Field(1000.0, gt=0, description="deadline of one health check or /status poll of an "
                                     "engine; a miss takes it out of rotation until a check passes")
    admission: Literal["off", "reject", "queue"] = Field(
        "reject", description="a request with a TTFT SLO (x-slo-ttft-ms / x-slo-class) that no instance is predicted "
        "to meet: reject (HTTP 429, Retry-After), queue (one in time but without room anywhere waits in a bounded "
        "router queue, more important first, until room appears or its deadline passes), or off (dispatch it "
        "anyway); requests without an SLO are unaffected")
    slo_classes: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="SLO classes by name: {ttft_ms, tpot_ms, priority}, chosen by the "
        "x-slo-class header or a class named like the request's model")

    @field_validator("slo_classes")
    @classmethod
    def _classes(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        from rps_astro_cli.dispatch.admission import parse_slo_class

        for name, spec in v.items():
            parse_slo_class(spec, name)
        return v

    def slo_class_map(self) -> dict[str, Any]:
        """The classes as `dispatch.admission.RequestSlo`s."""
        from rps_astro_cli.dispatch.admission import parse_slo_class

        return {name: parse_slo_class(spec, name) for name, spec in self.slo_classes.items()}

    @field_validator("k", "objective", "llumnix_variant", mode="before")
    @classmethod
    def _flat_key(cls, v: Any, info: Any) -> Any:
        """A flat key is checked by the parameter that declares it as its alias."""
        from rps_astro_cli.dispatch import alias_param

        return alias_param(info.field_name).convert(v)

    def policy_params(self) -> dict[str, Any]:
        """Constructor arguments of the chosen dispatch policy: its parameters that have a
        flat key (set or default), then `params`."""
        from rps_astro_cli.dispatch import dispatch_params

        out = {p.name: getattr(self, p.alias) for p in dispatch_params(self.policy) if p.alias}
        out.update(self.params)
        return out


MAX_INSTANCES = 256
GROUP_OVERRIDES = ("profile", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "time_scale")
"""The `engine:` fields an instance group may set for its own instances."""


class InstanceGroup(_Strict):
    """`count` instances of a heterogeneous fleet (one entry of `instances:` as a list):
    the fields given here override `engine:`'s for them, the rest is `engine:`'s."""

    count: int = Field(..., ge=1, le=MAX_INSTANCES, description="instances in this group")
    profile: str | None = Field(None, description="their execution profile id or JSON path (null: engine.profile)")
    num_gpu_blocks: int | None = Field(None, gt=0, description="null: engine.num_gpu_blocks, else the profile's")
    max_num_seqs: int | None = Field(None, gt=0)
    max_num_batched_tokens: int | None = Field(None, gt=0)
    time_scale: float | None = Field(None, gt=0, description="sim wall s per engine s (null: engine.time_scale); the "
                                     "scheduler's prediction-error metrics assume engine.time_scale")


class ClusterConfig(_Strict):
    """A whole cluster (see module docstring)."""

    name: str = "default"
    description: str = ""
    instances: Annotated[int, Field(ge=1, le=MAX_INSTANCES)] | Annotated[list[InstanceGroup], Field(min_length=1)] = 4
    host: str = "127.0.0.1"
    api_key: str | None = None
    internal_token: bool = Field(True, description="engines, Predictors and the tagger require the cluster's "
                                 "internal token (protocol.internal_auth); false: they answer anyone on their ports, "
                                 "e.g. for a peer router that cannot send one")
    restart_crashed: int = Field(3, ge=0)
    engine: EngineSection = Field(default_factory=EngineSection)
    predictor: PredictorSection = Field(default_factory=PredictorSection)
    tagger: TaggerSection = Field(default_factory=TaggerSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)

    @model_validator(mode="after")
    def _fleet_size(self) -> ClusterConfig:
        if self.num_instances > MAX_INSTANCES:
            raise ValueError(f"the groups' counts add up to {self.num_instances}, more than {MAX_INSTANCES}")
        return self

    @property
    def num_instances(self) -> int:
        """How many instances (engines) the cluster has: `instances`, or its groups' counts summed."""
        return self.instances if isinstance(self.instances, int) else sum(g.count for g in self.instances)

    @property
    def heterogeneous(self) -> bool:
        """Whether some instance runs another profile, or its Predictor is told another, than the first's."""
        specs = instance_specs(self)
        return len({(s.profile, s.assumed_profile) for s in specs}) > 1 or specs[0].profile != specs[0].assumed_profile


@dataclass(frozen=True)
class InstanceSpec:
    """One instance of a cluster as `instance_specs` expands it."""

    index: int                  # 0-based instance index (the engine is engine-{index})
    group: int | None           # its group's index in `instances:` (None: `instances` is a count)
    profile: str                # execution profile id or JSON path its engine runs
    engine: EngineSection       # its engine settings: `engine:` with its group's overrides applied
    assumed_profile: str        # the profile its Predictor simulates (predictor.assumed_profile, else `profile`)


def instance_specs(cfg: ClusterConfig) -> list[InstanceSpec]:
    """The per-instance list of (profile, engine settings, the profile its Predictor is
    told) of a validated config: `instances` engines of `engine:` as it is, or each group's
    `count` engines with the group's fields (`GROUP_OVERRIDES`) overriding `engine:`'s.
    Everything that starts or simulates instances (`astro serve`, `astro bench --virtual`,
    `astro simulate`) reads the fleet from here."""
    groups: list[tuple[int | None, dict[str, Any], int]]
    if isinstance(cfg.instances, int):
        groups = [(None, {}, cfg.instances)]
    else:
        groups = [(gi, g.model_dump(include=set(GROUP_OVERRIDES), exclude_none=True), g.count)
                  for gi, g in enumerate(cfg.instances)]
    assumed = cfg.predictor.assumed_profile
    out: list[InstanceSpec] = []
    for gi, over, count in groups:
        eng = cfg.engine.model_copy(update=over) if over else cfg.engine
        for _ in range(count):
            i = len(out)
            own = assumed[i] if isinstance(assumed, list) else assumed
            out.append(InstanceSpec(i, gi, eng.profile, eng, own or eng.profile))
    return out


_BOUND_OPS = (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"))


def _loc_text(loc: tuple) -> str:
    """A pydantic error location as the recipe path users write: `instances[1].count`
    (a union member's type name and list indices as pydantic spells them dropped or bracketed)."""
    out = ""
    for p in loc:
        if isinstance(p, int):
            out += f"[{p}]"
        elif not str(p).startswith(("function-", "literal[", "list[", "constrained-")) \
                and p not in ("int", "str", "float", "bool"):
            out += f".{p}" if out else str(p)
    return out


def _first_error(exc: ValidationError, data: Any) -> Any:
    """The pydantic error to report: for a union field (`instances`, `assumed_profile`),
    one from the member the input's shape meant (a list → the list member's), not
    the first member's type complaint."""
    errs = exc.errors()

    def meant(e: Any) -> bool:
        loc = e["loc"]
        if len(loc) < 2 or loc[0] not in ("instances", "predictor"):
            return True
        node = data
        for part in loc:
            if isinstance(node, dict) and part in node:
                node = node[part]
                continue
            branch = str(part)
            return branch.startswith("list[") == isinstance(node, list)
        return True

    return next((e for e in errs if meant(e)), errs[0])


def _user_error(exc: ValidationError, source: str, names: dict[str, str] | None = None,
                data: Any = None) -> AstroUserError:
    """One line for the first pydantic error. A field found in `names` (dotted path → the
    command-line flag that set it) is named by its flag, with no `source:` prefix, and the fix
    says which values the flag takes. A bound reads `must be ≥ 1`."""
    e = _first_error(exc, data)
    loc = _loc_text(e["loc"])
    if not loc:  # the one model-level check: the groups' total
        return AstroUserError(f"{source}: instances: {e['msg'].removeprefix('Value error, ')}", field="instances",
                              fix=f"give at most {MAX_INSTANCES} instances in all")
    msg = e["msg"].removeprefix("Value error, ")
    ctx = e.get("ctx") or {}
    bounds = [f"{op} {ctx[key]}" for key, op in _BOUND_OPS if key in ctx]
    if e["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal") and bounds:
        msg = f"must be {' and '.join(bounds)}"
    if e["type"] == "extra_forbidden":
        msg = "unknown field (check the spelling; see services/config.py for the schema)"
    flag = (names or {}).get(loc)
    if flag:
        fix = f"pass {flag} {' and '.join(bounds)}" if bounds else f"see `astro serve --help` for {flag}"
        return AstroUserError(f"{flag} {e.get('input')}: {msg[0].lower()}{msg[1:]}", field=flag, fix=fix)
    return AstroUserError(f"{source}: {loc}: {msg} (got {e.get('input')!r})", field=loc or "recipe")


def parse_config(data: dict[str, Any], source: str = "recipe", names: dict[str, str] | None = None) -> ClusterConfig:
    """Validate a recipe mapping.

    Args:
        data: the recipe mapping (YAML/JSON shape of the module docstring).
        source: what the mapping came from (a file path), prefixed to error messages.
        names: dotted path → command-line flag for fields set by flags; errors in those
            fields name the flag instead of the path.

    `scheduler.k` must be ≤ `instances` (or 'all', or 'auto', the default).

    Raises:
        AstroUserError: the first invalid field, named by its dotted path (or flag).
    """
    if not isinstance(data, dict):
        raise AstroUserError(f"{source}: must be a mapping of fields", field="recipe")
    try:
        cfg = ClusterConfig.model_validate(data)
    except ValidationError as exc:
        raise _user_error(exc, source, names, data) from None
    _check_profiles(cfg, source, names or {})
    _check_k(cfg, source, names or {})
    _check_policy(cfg, source, names or {})
    _check_instance_policy(cfg, source, names or {})
    return cfg


def check_profile_ref(ref: str, field: str, prefix: str = "") -> None:
    """`ref` names an execution profile that exists: a shipped id or a JSON file.

    Raises:
        AstroUserError: names `field` and lists the shipped profiles.
    """
    from rps_astro_cli.sim.profile import list_profiles, profile_path

    if not isinstance(ref, str) or not ref.strip() or not profile_path(ref).is_file():
        shipped = ", ".join(list_profiles()) or "(none shipped)"
        raise AstroUserError(f"{prefix}{field}: no profile {ref!r}", field=field,
                             fix=f"give a profile JSON path or one of: {shipped}")


def _check_profiles(cfg: ClusterConfig, source: str, names: dict[str, str]) -> None:
    """Every profile an instance runs or its Predictor is told exists (engine.profile when
    given and some instance uses it), and a list of assumed profiles has one per instance.
    Errors name the recipe path (`instances[0].profile`) or the flag that set it."""
    prefix = f"{source}: "

    def check(ref: str, path: str) -> None:
        flag = names.get(path)
        check_profile_ref(ref, flag or path, "" if flag else prefix)

    groups = cfg.instances if isinstance(cfg.instances, list) else []
    for gi, g in enumerate(groups):
        if g.profile is not None:
            check(g.profile, f"instances[{gi}].profile")
    if (not groups or any(g.profile is None for g in groups)) and "profile" in cfg.engine.model_fields_set:
        check(cfg.engine.profile, "engine.profile")  # the default is shipped (and a scheduler never loads it)
    assumed = cfg.predictor.assumed_profile
    if isinstance(assumed, list):
        n = cfg.num_instances
        if len(assumed) != n:
            field = names.get("predictor.assumed_profile", "predictor.assumed_profile")
            raise AstroUserError(f"{'' if field.startswith('--') else prefix}{field}: {_profiles(len(assumed))} for "
                                 f"{n} instances", field=field,
                                 fix=f"give one profile for all, or one per instance: {n}")
        for i, ref in enumerate(assumed):
            check(ref, f"predictor.assumed_profile[{i}]")
    elif assumed is not None:
        check(assumed, "predictor.assumed_profile")


def _check_k(cfg: ClusterConfig, source: str, names: dict[str, str]) -> None:
    """power-of-k samples k of the instances: k > instances is a mistake when given, and the
    default k (2) shrinks to a 1-instance cluster."""
    k = cfg.scheduler.k
    n = cfg.num_instances
    if k in ("all", "auto") or k <= n:
        return
    if "k" not in cfg.scheduler.model_fields_set:
        cfg.scheduler.k = n
        cfg.scheduler.model_fields_set.discard("k")  # still a default: recomputed after overrides
        return
    k_name, n_name = names.get("scheduler.k", "scheduler.k"), names.get("instances", "instances")
    prefix = "" if ("scheduler.k" in names or "instances" in names) else f"{source}: "
    raise AstroUserError(f"{prefix}{k_name} {k} is more than {n_name} {n}: power-of-k samples k of the "
                         "instances", field=k_name,
                         fix=f"give {k_name} ≤ {n} or 'all', or raise {n_name}")


def _check_policy(cfg: ClusterConfig, source: str, names: dict[str, str]) -> None:
    """The dispatch policy exists, its parameters pass its declaration (stored converted),
    and it has predictors if it needs them. Errors name the recipe path or the flag."""
    from rps_astro_cli.dispatch import DISPATCH_POLICIES, PREDICTIONS, make_dispatch

    sec = cfg.scheduler
    if sec.policy not in DISPATCH_POLICIES:
        raise AstroUserError(f"unknown dispatch policy {sec.policy!r}", field=names.get("scheduler.policy",
                             "scheduler.policy"), fix=f"choose one of: {', '.join(DISPATCH_POLICIES.names())}")
    specs = DISPATCH_POLICIES.get(sec.policy).params
    fields = {p.name: names.get(f"scheduler.{p.alias}", f"scheduler.{p.alias}") for p in specs if p.alias}
    for name in sec.params:  # a value in params wins over its flat key (so --param overrides a recipe's k)
        fields[name] = names.get(f"scheduler.params.{name}", f"scheduler.params.{name}")
    try:
        policy = make_dispatch(sec.policy, fields=fields, **sec.policy_params())
    except AstroUserError as exc:
        prefix = "" if (exc.field or "").startswith("--") else f"{source}: "
        raise AstroUserError(f"{prefix}{exc}", field=exc.field) from None
    if sec.params:
        from rps_astro_cli.params import check_params

        sec.params = check_params(specs, sec.params, owner=f"dispatch policy {sec.policy}", fields=fields)
    if PREDICTIONS in policy.inputs and not cfg.predictor.enabled:
        field = names.get("predictor.enabled", "predictor.enabled")
        pol_field = names.get("scheduler.policy", "scheduler.policy")
        fix = (f"give {field} URL per engine, or pick another {pol_field}" if field.startswith("--")
               else f"enable predictors or pick another {pol_field}")
        raise AstroUserError(f"dispatch policy {sec.policy} needs predictors", field=field, fix=fix)


def _check_instance_policy(cfg: ClusterConfig, source: str, names: dict[str, str]) -> None:
    """The engines' instance policy exists and its parameters pass its declaration
    (stored converted)."""
    from rps_astro_cli.params import check_params
    from rps_astro_cli.policies import INSTANCE_POLICIES

    e = cfg.engine
    if e.instance_policy not in INSTANCE_POLICIES and e.backend != "sim":
        return  # a vLLM engine may import more policy modules (ASTRO_VLLM_POLICY_MODULES) and checks there
    if e.instance_policy not in INSTANCE_POLICIES:
        field = names.get("engine.instance_policy", "engine.instance_policy")
        raise AstroUserError(f"unknown instance policy {e.instance_policy!r}", field=field,
                             fix=f"choose one of: {', '.join(INSTANCE_POLICIES.names())}")
    if not e.instance_policy_params:
        return
    fields = {n: names.get(f"engine.instance_policy_params.{n}", f"engine.instance_policy_params.{n}")
              for n in e.instance_policy_params}
    try:
        e.instance_policy_params = check_params(INSTANCE_POLICIES.get(e.instance_policy).params,
                                                e.instance_policy_params,
                                                owner=f"instance policy {e.instance_policy}", fields=fields)
    except AstroUserError as exc:
        prefix = "" if (exc.field or "").startswith("--") else f"{source}: "
        raise AstroUserError(f"{prefix}{exc}", field=exc.field) from None


def split_profiles(text: str | None) -> list[str] | None:
    """`--profile P` or `--profile P1,P2,…` as a list (None: not given)."""
    if text is None:
        return None
    vals = [t.strip() for t in str(text).split(",")]
    return vals if any(vals) else None


def with_fleet(cfg: ClusterConfig, *, instances: int | None = None, profile: str | None = None,
               predictor_profile: str | None = None, source: str = "flags",
               flags: tuple[str, str, str] = ("--instances", "--profile", "--predictor-profile")) -> ClusterConfig:
    """`cfg` with the fleet flags applied (None = not given), re-validated:

    - `instances` (`--instances N`): N instances of `engine:`; with instance groups in
      `cfg` it must equal their total (the groups stay).
    - `profile` (`--profile P` or `P1,P2,…`): one profile for every instance (each group's
      profile replaced), or one per instance in order — then the count must equal the
      instances (taken from the list when neither `instances` nor the recipe set them);
      instances of one group that get different profiles are split into groups, their
      other group fields kept.
    - `predictor_profile` (`--predictor-profile P[,…]`): `predictor.assumed_profile`, one
      for all or one per instance.

    Raises:
        AstroUserError: one line naming the flag (an unknown profile, a count that does not
            match the instances, `instances` against the recipe's groups).
    """
    f_inst, f_prof, f_pred = flags
    groups = cfg.instances if isinstance(cfg.instances, list) else None
    per: list[dict[str, Any]] = [] if groups is None else [
        g.model_dump(include=set(GROUP_OVERRIDES), exclude_none=True) for g in groups for _ in range(g.count)]
    over: dict[str, Any] = {}
    if instances is not None:
        if groups is not None and instances != len(per):
            raise AstroUserError(f"{f_inst} {instances}: the instance groups of {source} add up to {len(per)}",
                                 field=f_inst, fix=f"drop {f_inst}, or change the groups' counts")
        if groups is None:
            over["instances"] = instances
    n = instances if instances is not None else cfg.num_instances
    profs = split_profiles(profile)
    if profs is not None:
        for ref in profs:
            check_profile_ref(ref, f_prof)
        if len(profs) == 1 and groups is None:
            over["engine.profile"] = profs[0]
        else:
            if len(profs) > 1 and len(profs) != n:
                if instances is not None or groups is not None or "instances" in cfg.model_fields_set:
                    raise AstroUserError(f"{f_prof} lists {_profiles(len(profs))} for {n} instances", field=f_prof,
                                         fix=f"give one profile for every instance, or {n} separated by commas, "
                                             "one per instance in order")
                n = len(profs)
            per = per or [{} for _ in range(n)]
            for i, d in enumerate(per):
                d["profile"] = profs[0] if len(profs) == 1 else profs[i]
            over["instances"] = _compress(per)
    assumed = split_profiles(predictor_profile)
    if assumed is not None:
        for ref in assumed:
            check_profile_ref(ref, f_pred)
        if len(assumed) > 1 and len(assumed) != n:
            raise AstroUserError(f"{f_pred} lists {_profiles(len(assumed))} for {n} instances", field=f_pred,
                                 fix=f"give one profile for every Predictor, or {n} separated by commas, "
                                     "one per instance in order")
        over["predictor.assumed_profile"] = assumed[0] if len(assumed) == 1 else assumed
    if not over:
        return cfg
    names = {"instances": f_inst if instances is not None else f_prof, "engine.profile": f_prof,
             "predictor.assumed_profile": f_pred}
    if "predictor.assumed_profile" not in over and isinstance(cfg.predictor.assumed_profile, list) \
            and len(cfg.predictor.assumed_profile) != n:
        raise AstroUserError(f"predictor.assumed_profile of {source} lists "
                             f"{_profiles(len(cfg.predictor.assumed_profile))} for {n} instances",
                             field="predictor.assumed_profile", fix=f"pass {f_pred} with one profile or {n}")
    return with_overrides(cfg, over, names, source)


def _profiles(n: int) -> str:
    return f"{n} profile{'' if n == 1 else 's'}"


def _compress(per: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per-instance group fields → `instances:` groups (runs of equal fields, in order)."""
    out: list[dict[str, Any]] = []
    for d in per:
        if out and {k: v for k, v in out[-1].items() if k != "count"} == d:
            out[-1]["count"] += 1
        else:
            out.append({"count": 1, **d})
    return out


def load_recipe(path: str | Path) -> ClusterConfig:
    """Load and validate a YAML recipe.

    Raises:
        AstroUserError: missing file, bad YAML, or an invalid field (named).
    """
    import yaml

    p = Path(path)
    if not p.is_file():
        from rps_astro_cli.data_paths import RECIPES_DIR

        alt = RECIPES_DIR / f"{path}.yaml"
        if not alt.is_file():
            raise AstroUserError(f"no recipe {str(path)!r}", field="--recipe",
                                 fix="give a YAML path or a name under recipes/")
        p = alt
    text = p.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise _yaml_error(p, exc) from None
    if data is None:
        raise AstroUserError(f"--recipe {p} is empty", field="--recipe",
                             fix="add at least `instances: N`, or drop --recipe to use the defaults")
    return parse_config(data, str(p))


def _yaml_error(path: Path, exc: Exception) -> AstroUserError:
    """One line naming the file, the 1-based line/column and PyYAML's problem (no quoted
    "<unicode string>" context)."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or type(exc).__name__
    pos = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return AstroUserError(f"--recipe {path}: invalid YAML{pos}: {' '.join(str(problem).split())}", field="--recipe",
                          fix="fix the recipe's YAML syntax")


def with_overrides(cfg: ClusterConfig, overrides: dict[str, Any], flags: dict[str, str] | None = None,
                   source: str = "flags") -> ClusterConfig:
    """A copy of `cfg` with dotted-path overrides (None values skipped), re-validated.
    Fields `cfg` left at their defaults stay unset (so defaults that depend on other
    fields, like k, are recomputed).

    Args:
        flags: dotted path → the command-line flag that gave it; errors name the flag.
        source: prefix for errors in fields not set by a flag (e.g. the recipe path).

    Raises:
        AstroUserError: an override makes a field invalid (named by its flag when known).
    """
    data = cfg.model_dump(exclude_unset=True)
    names: dict[str, str] = {}
    for path, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
        if flags and path in flags:
            names[path] = flags[path]
    return parse_config(data, source, names)
