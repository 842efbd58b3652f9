"""Virtual target: the workload on the virtual-time cluster simulation
(`rps_astro_cli.cluster.virtual.simulate_cluster`), N instances and a dispatch policy, in
simulated seconds.

The fleet is a recipe's (`--recipe`; `instances:` a count or groups, each with its own
profile and limits) or N instances of one profile, with the flags applied
(`bench_fleet`: `--instances`, `--profile P` or `P1,P2,…` one per instance,
`--predictor-profile P[,…]`), expanded per instance by `services.config.instance_specs`:
each instance runs its own profile with its engine limits (`InstanceConfig` from that
profile), and its Predictor's look-ahead simulates its `assumed_profile` (default: its
own). The report's target names each instance's profile when they differ.

Per request the simulation gets: arrival (s), prompt tokens = text tokens + vision tokens
(images × `vision.tokens_per_image` + frames × `vision.tokens_per_frame` of the
profile; the first instance's in a heterogeneous fleet, which serves one model), the true
output length, the dispatcher's predicted output length (the length
model's, or the true one with `--oracle-lengths`), modality, and the
vision encoder / preprocessing seconds of the profile; no class, so the instance policy
classifies it (RPS's smart classifier, or by modality) and the bench reports the class the
policy used (`class_source = "engine"`). A request longer than the smallest
`max_model_len` of the fleet fails (as a live engine would answer 400). Instance
policies that take defaults from a profile (edf, rps) take the first instance's.

`--prediction-noise σ`: the dispatch policy is wrapped (`NoisyDispatch`) so that each
latency prediction it sees is multiplied by max(0, 1 + σ·z), z ~ N(0, 1) drawn
independently per prediction from the run's generator; `--prediction-noise-fraction f`
noises each prediction only with probability f.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.bench.workload_base import MODALITY_CLASS, BenchRequest, Workload
from rps_astro_cli.cluster.workload import TimedRequest
from rps_astro_cli.dispatch.base import DispatchPolicy
from rps_astro_cli.dispatch.stages import PREDICTIONS
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.sim.profile import ExecutionProfile
from rps_astro_cli.tokens import TokenCounter
from rps_astro_cli.types import DispatchDecision, InstanceLoad


class NoisyDispatch(DispatchPolicy):
    """Wraps a policy; multiplies a latency prediction by max(0, 1 + σ·z), z ~ N(0, 1) —
    every prediction when `fraction` = 1, else each with probability `fraction` (the
    Astrolabe robustness grid is (noise level, share of predictions noised)). Every
    pipeline stage but the scoring input is the inner policy's."""

    def __init__(self, inner: DispatchPolicy, sigma: float, rng: np.random.Generator, fraction: float = 1.0):
        self.inner, self.sigma, self.rng, self.fraction = inner, sigma, rng, fraction
        self.name = inner.name  # type: ignore[misc]

    @property
    def inputs(self) -> frozenset[str]:
        return self.inner.inputs

    def filter(self, loads: Sequence[InstanceLoad]) -> list[int]:
        return self.inner.filter(loads)

    def sample(self, pool: list[int], rng: np.random.Generator,
               loads: Sequence[InstanceLoad] | None = None) -> list[int]:
        return self.inner.sample(pool, rng, loads)

    def candidates(self, loads: Sequence[InstanceLoad], rng: np.random.Generator) -> list[int]:
        return self.inner.candidates(loads, rng)

    def choose(self, loads: Sequence[InstanceLoad], candidates: Sequence[int], predictions: Mapping[int, Any],
               rng: np.random.Generator) -> DispatchDecision:
        noisy = {}
        for i, est in predictions.items():
            f1, f2 = (max(0.0, 1.0 + self.sigma * z) for z in self.rng.standard_normal(2))
            if self.fraction < 1.0 and self.rng.random() >= self.fraction:
                noisy[i] = est
                continue
            noisy[i] = replace(est, ttft_s=est.ttft_s * f1, e2e_s=est.e2e_s * f2)
        return self.inner.choose(loads, candidates, noisy, rng)

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "prediction_noise_sigma": self.sigma,
                "prediction_noise_fraction": self.fraction}

    def __getattr__(self, item: str) -> Any:  # e.g. k, objective
        return getattr(self.inner, item)


@dataclass(frozen=True)
class VirtualFleet:
    """The virtual cluster's instances, one entry each, in instance order."""

    # the profile each instance's engine runs, its engine limits (recipe) applied
    profiles: tuple[ExecutionProfile, ...]
    # the profile each instance's Predictor is told; None: each its own engine's
    assumed: tuple[ExecutionProfile, ...] | None = None

    @property
    def heterogeneous(self) -> bool:
        """Some instance runs another profile (or other limits) than the first."""
        return any(p != self.profiles[0] for p in self.profiles)

    def describe(self) -> dict[str, Any]:
        """Per instance ("instance-i"): its profile id and KV blocks, and the Predictor's
        profile where it differs from the engine's; {} for a homogeneous fleet told its own."""
        if not self.heterogeneous and self.assumed is None:
            return {}
        names = [f"instance-{i}" for i in range(len(self.profiles))]
        out: dict[str, Any] = {
            "instance_profiles": {n: p.profile_id for n, p in zip(names, self.profiles)},
            "instance_kv_blocks": {n: p.num_gpu_blocks for n, p in zip(names, self.profiles)},
            "instance_max_num_seqs": {n: p.max_num_seqs for n, p in zip(names, self.profiles)}}
        if self.assumed is not None:
            out["predictor_profiles"] = {n: a.profile_id for n, a in zip(names, self.assumed)}
        return out


def _fleet_value(profiles: Sequence[ExecutionProfile], name: str) -> Any:
    """A limit every instance shares, or "per instance" (see the target's instance_* keys)."""
    vals = {getattr(p, name) for p in profiles}
    return vals.pop() if len(vals) == 1 else "per instance"


def bench_fleet(cfg, media: bool = False, recipe=None):
    """The virtual cluster's fleet as an `astro serve` config: the recipe's (`recipe`, else
    `cfg.cluster.recipe`'s) or N instances of the default profile (a multimodal one when
    the workload has `media`), with `--instances`, `--profile` and `--predictor-profile`
    applied (`services.config.with_fleet`); expand it with `instance_specs`.

    Raises:
        AstroUserError: one line naming the flag or recipe field (an unknown profile, a
            profile count that is not the instance count).
    """
    from rps_astro_cli.services.config import parse_config, with_fleet

    c = cfg.cluster
    rc = recipe if recipe is not None else (load_bench_recipe(c.recipe) if c.recipe else None)
    if rc is None:
        rc = parse_config({"engine": {"profile": "llava-onevision-7b-a100" if media else "llama-2-7b-a30"}}, "defaults")
    return with_fleet(rc, instances=c.instances, profile=c.profile, predictor_profile=c.predictor_profile,
                      source=f"recipe {c.recipe}" if c.recipe else "defaults")


def load_fleet(fleet_cfg) -> VirtualFleet:
    """Load every instance's profile (each file once), its engine limits from the
    config applied, as `astro serve` gives them to its engines; and the Predictors' when
    some is told another than its engine's."""
    from rps_astro_cli.services.config import instance_specs
    from rps_astro_cli.sim.profile import load_profile

    loaded: dict[str, ExecutionProfile] = {}

    def load(ref: str) -> ExecutionProfile:
        if ref not in loaded:
            loaded[ref] = load_profile(ref)
        return loaded[ref]

    specs = instance_specs(fleet_cfg)
    profiles = []
    for s in specs:
        lim = {k: getattr(s.engine, k) for k in ("num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
                                                 "max_model_len") if getattr(s.engine, k) is not None}
        profiles.append(replace(load(s.profile), **lim) if lim else load(s.profile))
    assumed = None
    if any(s.assumed_profile != s.profile for s in specs):
        assumed = tuple(load(s.assumed_profile) for s in specs)
    return VirtualFleet(tuple(profiles), assumed)


def load_bench_length_model(spec: str | None) -> tuple[str, Callable[..., int]]:
    """`length.resolve.resolve_length_model(spec)` (the tagger's loader), its user errors
    re-worded to name `--length-model` (the loader names the tagger's own `--model`).

    Raises:
        AstroUserError: field "--length-model" — the artifact is missing or cannot load.
    """
    from rps_astro_cli.length.resolve import resolve_length_model

    try:
        return resolve_length_model(spec)
    except AstroUserError as exc:
        text = str(exc)
        if exc.field and text.startswith(f"{exc.field}: "):
            text = text[len(exc.field) + 2:]
        raise AstroUserError(text, field="--length-model") from None


class VirtualTarget:
    """Runs the workload on the virtual cluster (see module docstring)."""

    simulate: Callable[..., tuple[list[RequestRecord], dict[str, Any]]] | None = None  # tests may inject a fake

    def __init__(self, cfg, wl: Workload, counter: TokenCounter,
                 length_model: tuple[str, Callable[..., int]] | None = None):
        """length_model: (name, predict) already loaded by `load_bench_length_model`
        (else it is loaded here unless `cfg.cluster.oracle_lengths`)."""
        self.cfg = cfg
        self.wl = wl
        self.counter = counter
        media = any(r.media for r in wl.requests)
        self.recipe = load_bench_recipe(cfg.cluster.recipe) if cfg.cluster.recipe else None
        eng = self.recipe.engine if self.recipe is not None else None
        # the recipe's engine limits (per group) override the profiles', as `astro serve` does
        self.fleet = load_fleet(bench_fleet(cfg, media, self.recipe))
        self.profile = self.fleet.profiles[0]  # vision costs, instance-policy defaults (one model per fleet)
        self.max_model_len = min(p.max_model_len for p in self.fleet.profiles)
        self.chunked_prefill = True
        self.preprocess_slots: int | None = None
        if eng is not None:
            self.chunked_prefill = bool(eng.chunked_prefill)
            self.preprocess_slots = eng.preprocess_slots
        self.instance_policy: str = cfg.cluster.instance_policy
        text_only = next((p for p in self.fleet.profiles if p.vision is None), None)
        if media and text_only is not None:
            raise AstroUserError(f"profile {text_only.profile_id} is text-only but the workload has media",
                                 field="--profile", fix="use a multimodal profile, e.g. llava-onevision-7b-a100")
        self.policy: str = "round_robin"
        self.k: str | None = None
        self.length_model_name = "oracle"
        if length_model is not None and not cfg.cluster.oracle_lengths:
            self.length_model_name, self._predict_len = length_model
        else:
            self._predict_len = None if cfg.cluster.oracle_lengths else self._load_length_model()
        self._predicted = [self._predicted_len(r) for r in wl.requests]
        from rps_astro_cli.tokens import load_token_ids

        self._token_ids = load_token_ids(cfg.workload.tokenizer)

    def __getstate__(self) -> dict[str, Any]:
        """For a worker process or Ray task (`bench.executors`): everything but the loaded
        callables — the length model (its predictions are in `_predicted` already) and
        the token counter / ids (reloaded from `cfg.workload.tokenizer`)."""
        state = dict(self.__dict__)
        for name in ("_predict_len", "counter", "_token_ids"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        from rps_astro_cli.tokens import load_counter, load_token_ids

        self.__dict__.update(state)
        self._predict_len = None
        self.counter = load_counter(self.cfg.workload.tokenizer)
        self._token_ids = load_token_ids(self.cfg.workload.tokenizer)

    def _load_length_model(self):
        self.length_model_name, fn = load_bench_length_model(self.cfg.cluster.length_model)
        return fn

    def _predicted_len(self, r: BenchRequest) -> int:
        if self._predict_len is None:
            return max(1, r.output_tokens)
        return max(1, int(self._predict_len(r.prompt_text() if r.prompt else "", r.prompt_tokens)))

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def describe(self) -> dict[str, Any]:
        return {"mode": "virtual", "instances": len(self.fleet.profiles), "profile": self.profile.profile_id,
                **self.fleet.describe(),
                "instance_policy": self.cfg.cluster.instance_policy, "length_model": self.length_model_name,
                **({"instance_policies": list(self.cfg.cluster.instance_policies)}
                   if self.cfg.cluster.instance_policies else {}),
                **({"recipe": self.recipe.name, "engine_limits": {
                    **{k: _fleet_value(self.fleet.profiles, k)
                       for k in ("num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len")},
                    "chunked_prefill": self.chunked_prefill, "preprocess_slots": self.preprocess_slots}}
                   if self.recipe is not None else {}),
                "remaining_length": None if self.cfg.cluster.oracle_lengths else self.cfg.cluster.remaining_length,
                "prediction_noise_sigma": self.cfg.cluster.prediction_noise,
                "prediction_noise_fraction": self.cfg.cluster.prediction_noise_fraction,
                "max_num_seqs": self.cfg.cluster.max_num_seqs,
                **({"schedulers": self.cfg.cluster.schedulers, "status_interval_s": self.cfg.cluster.status_interval_s}
                   if self.cfg.cluster.schedulers > 1 or self.cfg.cluster.status_interval_s > 0 else {})}

    def use_instance_policy(self, name: str | None) -> None:
        """The in-instance policy of the next runs (None: `cfg.cluster.instance_policy`)."""
        self.instance_policy = name or self.cfg.cluster.instance_policy

    def instance_policy_params(self, name: str) -> dict[str, Any]:
        """Parameters for instance policy `name`: the recipe's `engine.instance_policy_params`
        that `name` declares (a recipe written for rps may set its classifier; fcfs takes
        none), then `--instance-param`s, which win."""
        from rps_astro_cli.policies import INSTANCE_POLICIES

        declared = {p.name for p in INSTANCE_POLICIES.get(name).params}
        base = dict(self.recipe.engine.instance_policy_params) if self.recipe is not None else {}
        base.update(self.cfg.cluster.instance_policy_params or {})
        return {k: v for k, v in base.items() if k in declared}

    def use_policy(self, policy: str | None, k: str | None) -> None:
        self.policy = policy or "round_robin"
        self.k = k

    def make_dispatch(self, rng: np.random.Generator) -> DispatchPolicy:
        from rps_astro_cli.dispatch import dispatch_params, make_dispatch

        # flags reach the policies that declare them: --param NAME=VALUE, --k, --objective
        c = self.cfg.cluster
        declared = {p.name for p in dispatch_params(self.policy)}
        params: dict[str, Any] = {n: v for n, v in (c.policy_params or {}).items() if n in declared}
        fields = {n: f"--param {n}" for n in params}
        if self.k is not None and "k" in declared:
            params["k"], fields["k"] = self.k, "--k"
        if c.objective is not None and "objective" in declared:
            params["objective"], fields["objective"] = c.objective, "--objective"
        pol = make_dispatch(self.policy, fields=fields, **params)
        if self.cfg.cluster.prediction_noise > 0:
            pol = NoisyDispatch(pol, self.cfg.cluster.prediction_noise, rng, self.cfg.cluster.prediction_noise_fraction)
        return pol

    def virtual_requests(self, times: list[float]) -> tuple[list[TimedRequest], list[RequestRecord]]:
        """(requests that fit the profile, failed records of those that do not); each
        request's `req_class` is its modality's class (the report's fallback label).

        Multi-turn: first turns take the arrival times in order (the rate is session
        starts per second); a later turn follows its previous turn (closed loop), and
        fails with it when that one does not fit. Text requests carry their token ids
        (prompt, then the reply's when a later turn holds it) for the prefix cache."""
        v = self.profile.vision
        out, failed = [], []
        starts = iter(times)
        kept: set[str] = set()
        prev_of: dict[str, str] = {}
        for r in self.wl.requests:
            if r.session_id:
                prev_of[f"{r.session_id}#{r.turn}"] = r.request_id
        for r, pred in zip(self.wl.requests, self._predicted):
            follows = prev_of.get(f"{r.session_id}#{r.turn - 1}") if r.session_id and r.turn > 0 else None
            nxt = 0.0 if follows is not None else next(starts, None)
            if nxt is None:  # past --max-seconds: not sent
                continue
            t = float(nxt)
            if follows is not None and follows not in kept:
                failed.append(RequestRecord(r.request_id, r.modality, MODALITY_CLASS.get(r.modality, "sand"),
                                            prompt_tokens=r.prompt_tokens, expected_output_tokens=r.output_tokens,
                                            success=False, error="its previous turn failed"))
                continue
            vt = enc = pre = 0.0
            if r.media and v is not None:  # images by the profile's size rule, videos per frame (+ per video)
                vt = sum(v.image_tokens(m.width_px, m.height_px) if m.kind == "image" else v.video_tokens(m.num_frames)
                         for m in r.media)
                enc = r.num_images * v.encoder_s_per_image + r.num_frames * v.encoder_s_per_frame
                pre = r.num_images * v.preprocess_s_per_image + r.num_frames * v.preprocess_s_per_frame
            p = r.prompt_tokens + int(vt)
            if p + r.output_tokens > self.max_model_len:
                failed.append(RequestRecord(r.request_id, r.modality, MODALITY_CLASS.get(r.modality, "sand"),
                                            prompt_tokens=p, expected_output_tokens=r.output_tokens, scheduled_s=t,
                                            sent_s=t, finish_s=t, success=False,
                                            error=f"too long: prompt + output = {p + r.output_tokens} > "
                                                  f"max_model_len {self.max_model_len}"))
                continue
            ids = None
            if r.prompt and not r.media:
                ids = self._token_ids(r.prompt)
                if r.reply:
                    ids += self._token_ids(r.reply)[:r.output_tokens]
                ids = tuple(ids)
            kept.add(r.request_id)
            out.append(TimedRequest(r.request_id, float(t), p, max(1, r.output_tokens), pred, r.modality,
                                    int(vt), enc, pre, MODALITY_CLASS.get(r.modality, "sand"), token_ids=ids,
                                    session_id=r.session_id or None, follows=follows, think_s=r.think_s,
                                    turn=r.turn))
        return out, failed

    def run(self, requests: list[BenchRequest], times: list[float],
            on_done: Callable[[RequestRecord], None]) -> tuple[list[RequestRecord], dict[str, Any]]:
        rng = np.random.default_rng([self.cfg.workload.seed, 11])
        vreqs, failed = self.virtual_requests(times)
        sim = self.simulate or _simulate_cluster
        ipol = self.instance_policy
        cfg = self.cfg
        if ipol != cfg.cluster.instance_policy or self.recipe is not None or cfg.cluster.instance_policies:
            cfg = replace(cfg, cluster=replace(cfg.cluster, instance_policy=ipol, chunked_prefill=self.chunked_prefill,
                                               preprocess_slots=self.preprocess_slots,
                                               instance_policy_params=self.instance_policy_params(ipol) or None))
        dispatch: Any = self.make_dispatch(rng)
        if cfg.cluster.schedulers > 1:  # one fresh policy per scheduler replica
            dispatch = [dispatch] + [self.make_dispatch(rng) for _ in range(cfg.cluster.schedulers - 1)]
        recs, extras = sim(vreqs, cfg, self.fleet, dispatch, rng)
        extras = {**extras, "instance_policy": ipol}
        by_id = {r.request_id: r for r in recs + failed}
        out = [by_id[r.request_id] for r in requests if r.request_id in by_id]  # --max-seconds: unsent dropped
        for r in out:
            on_done(r)
        return out, extras

    def fill_isolated(self, records: list[RequestRecord]) -> None:
        """Isolated E2E of each record on the profile of the instance that served it."""
        from rps_astro_cli.bench.slo import isolated_for

        by_inst: dict[str, list[RequestRecord]] = {}
        for r in records:
            by_inst.setdefault(r.instance or "", []).append(r)
        for name, recs in by_inst.items():
            i = int(name.removeprefix("instance-")) if name.removeprefix("instance-").isdigit() else 0
            isolated_for(recs, self.fleet.profiles[i] if i < len(self.fleet.profiles) else self.profile)


def bench_remaining(cfg, dispatch: DispatchPolicy):
    """The look-ahead's remaining-length rule for this run (`sim.remaining`): the
    `--remaining-length` table when the policy predicts with tagged lengths; None (the
    auto-extension rule) for "none", for `--oracle-lengths` (true lengths need no
    conditioning) and for policies that do not predict.

    Raises:
        AstroUserError: field "--remaining-length" — the table is missing or malformed.
    """
    from rps_astro_cli.sim.remaining import load_remaining

    spec = cfg.cluster.remaining_length
    if spec in (None, "", "none") or cfg.cluster.oracle_lengths or PREDICTIONS not in dispatch.inputs:
        return None
    try:
        return load_remaining(spec)
    except AstroUserError as exc:
        text = str(exc)
        if exc.field and text.startswith(f"{exc.field}: "):
            text = text[len(exc.field) + 2:]
        raise AstroUserError(text, field="--remaining-length",
                             fix="pass default, none, or a table JSON (scripts/fit_remaining_table.py)") from None


def load_bench_recipe(spec: str):
    """The `astro serve` recipe `spec` (a name under recipes/ or a YAML path) for a virtual
    run: its engine section gives the profile, the engine limits, the instance policy and
    its parameters; `instances`, `scheduler.policy` and its `k` / `objective` / `params`
    are the defaults of `--instances` / `--policies` / `--k` / `--objective` / `--param`
    (`recipe_flag_defaults`).

    Raises:
        AstroUserError: field "--recipe" — missing file, bad YAML or an invalid field.
    """
    from rps_astro_cli.services.config import load_recipe

    rc = load_recipe(spec)
    if rc.engine.backend != "sim" and rc.engine.backend != "vllm":
        raise AstroUserError(f"recipe {spec}: unknown engine backend {rc.engine.backend!r}", field="--recipe")
    return rc


def recipe_flag_defaults(spec: str | None) -> dict[str, Any]:
    """What a recipe sets for the flags a user left out: instances, instance_policy, the
    dispatch policy and its k, objective and params, as `astro serve` would run them
    ({} without a recipe). A policy takes only the ones it declares."""
    if not spec:
        return {}
    rc = load_bench_recipe(spec)
    sc = rc.scheduler
    return {"instances": rc.num_instances, "instance_policy": rc.engine.instance_policy,
            "policies": [sc.policy], "ks": [str(sc.k)], "objective": sc.objective,
            "policy_params": {k: str(v) for k, v in sc.params.items()} or None}


def instance_policy_factory(name: str, params: Mapping[str, Any] | None, profile) -> Callable[[], Any]:
    """A fresh instance policy per virtual instance, each built by
    `policies.build.build_instance_policy(name, params, profile)`; the first is built now,
    so an unknown name or bad parameter fails (naming `--instance-param NAME`) before the run.

    Raises:
        AstroUserError: unknown policy name or a bad parameter.
    """
    from rps_astro_cli.policies.build import build_instance_policy

    ip = dict(params or {})
    fields = {n: f"--instance-param {n}" for n in ip}
    build_instance_policy(name, ip, profile, fields=fields)
    return lambda: build_instance_policy(name, ip, profile, fields=fields)


def _simulate_cluster(vreqs: list[TimedRequest], cfg, fleet: VirtualFleet,
                      dispatch: DispatchPolicy | list[DispatchPolicy],
                      rng: np.random.Generator) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Run `cluster.virtual.simulate_cluster` and convert its records to `RequestRecord`s
    (times: virtual seconds; sent = arrival at the dispatcher). A list of policies: one
    per scheduler replica, on a status copied every `--status-interval` s (extras
    "herding": `ClusterResult.herding`). A heterogeneous `fleet`: one profile and one
    `InstanceConfig` (from that profile) per instance; Predictors told other profiles:
    `predictor_latency`, one per instance."""
    from rps_astro_cli.cluster.virtual import simulate_cluster
    from rps_astro_cli.types import InstanceConfig

    profile = fleet.profiles[0]
    make_policy = instance_policy_factory(cfg.cluster.instance_policy, cfg.cluster.instance_policy_params, profile)
    configs = [InstanceConfig.from_profile(p, max_num_seqs=cfg.cluster.max_num_seqs,
                                           chunked_prefill=cfg.cluster.chunked_prefill) for p in fleet.profiles]
    latency: Any = list(fleet.profiles) if fleet.heterogeneous else profile
    icfg: Any = configs if fleet.heterogeneous else configs[0]
    extra: dict[str, Any] = {} if fleet.assumed is None else {"predictor_latency": list(fleet.assumed)}
    # the Predictors' calibration (issue 31): online by default where their profile is not their engine's
    cal = cfg.cluster.calibration or ("online" if fleet.assumed is not None else "none")
    if cal != "none":
        extra["calibration"] = cal
    # per-request SLO classes (issue 33): drawn by share from the workload's seed alone
    from rps_astro_cli.bench.slo import assign_slo_classes, parse_slo_classes
    from rps_astro_cli.dispatch.admission import Admission

    classes = assign_slo_classes([v.request_id for v in vreqs], parse_slo_classes(cfg.workload.slo_classes),
                                 cfg.workload.seed)
    # req_class None: the instance policy classifies (RPS's smart classifier, or by modality)
    timed = [replace(v, req_class=None, slo=classes[v.request_id].slo if v.request_id in classes else None)
             for v in vreqs]
    first = dispatch[0] if isinstance(dispatch, list) else dispatch
    res = simulate_cluster(timed, len(fleet.profiles), dispatch, latency, icfg,
                           make_policy, rng,
                           remaining=bench_remaining(cfg, first), status_interval_s=cfg.cluster.status_interval_s,
                           preprocess_slots=cfg.cluster.preprocess_slots, admission=Admission(cfg.cluster.admission),
                           **extra)
    out = []
    for v, r in zip(vreqs, res.records):
        ok = r.finish_s is not None
        c = classes.get(v.request_id)
        engine_cls = r.req_class if r.req_class in ("sand", "pebbles", "rocks") else None
        out.append(RequestRecord(
            request_id=r.request_id, modality=v.modality, req_class=engine_cls or v.req_class,
            class_source="engine" if engine_cls else "modality",
            prompt_tokens=r.prompt_tokens, output_tokens=r.output_tokens if ok else 0,
            output_tokens_source="simulated", expected_output_tokens=v.output_tokens,
            predicted_output_tokens=r.predicted_output_tokens, scheduled_s=r.arrival_s, sent_s=r.arrival_s,
            engine_arrival_s=r.preprocess_start_s,
            first_token_s=r.first_token_s, finish_s=r.finish_s, success=ok,
            error=None if ok or r.refused else "did not finish",
            instance=f"instance-{r.instance}" if r.refused is None else None,
            preemptions=r.num_preemptions, predicted_ttft_s=r.predicted_ttft_s, predicted_e2e_s=r.predicted_e2e_s,
            slo_class=c.name if c else None, slo_ttft_s=c.slo.ttft_s if c else None,
            slo_tpot_s=c.slo.tpot_ms / 1000 if c and c.slo.tpot_ms is not None else None,
            refused=r.refused is not None))
    dec = [r.decide_us for r in res.records]
    extras: dict[str, Any] = {
              "preemptions_total": res.num_preemptions, "preemptions_per_instance": res.preemptions_per_instance,
              "requests_per_instance": res.requests_per_instance, "makespan_s": res.makespan_s,
              "sim_wall_s": res.wall_s, "dispatch_policy": res.dispatch,
              "decide_us": {"mean": float(np.mean(dec)) if dec else None,
                            "p50": float(np.percentile(dec, 50)) if dec else None,
                            "p99": float(np.percentile(dec, 99)) if dec else None},
              "prefix_cache_queries_tokens": res.prefix_cache_queries_tokens,
              "prefix_cache_hits_tokens": res.prefix_cache_hits_tokens}
    if res.herding is not None:
        extras["herding"] = res.herding
    if res.calibration is not None:  # each Predictor's calibrator at the end, and how often load decided for it
        extras["calibration"] = res.calibration
        extras["decisions_with_untrusted_predictors"] = sum(r.untrusted_predictors > 0 for r in res.records)
    if res.outcome_correction is not None:  # each instance's outcome correction at the end
        extras["outcome_correction"] = res.outcome_correction
    if any(v.session_id for v in vreqs):
        extras["per_turn"] = per_turn_metrics(vreqs, res.records)
    return out, extras


def per_turn_metrics(vreqs: Sequence[TimedRequest], records: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """Per multi-turn turn index: requests, TTFT mean / P50 / P99 (s) of the finished
    ones, and the share of their prompt tokens served from the prefix cache."""
    by: dict[int, list[tuple[float, int, int]]] = {}
    for v, r in zip(vreqs, records):
        if r.first_token_s is not None:
            by.setdefault(v.turn, []).append((r.first_token_s - r.arrival_s, r.cached_tokens, r.prompt_tokens))
    out: dict[str, dict[str, Any]] = {}
    for turn in sorted(by):
        rows = by[turn]
        ttft = np.array([a for a, _, _ in rows])
        out[str(turn)] = {"num_requests": len(rows), "ttft_mean_s": float(ttft.mean()),
                          "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
                          "cached_prompt_share": sum(c for _, c, _ in rows) / max(1, sum(p for _, _, p in rows))}
    return out
