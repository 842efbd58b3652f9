"""`BenchConfig`: everything one `run_bench` needs, in validated sections.

Sections (each a frozen dataclass that checks its own fields when built, naming the
`astro bench` flag and the fix; `BenchConfig` checks the rules that span sections):

- `workload` (`WorkloadSection`): which requests (see `bench.workloads`);
- `arrivals` (`ArrivalSection`): when they are sent (see `bench.arrivals`);
- `target` (`TargetSection`): the live server or cluster and how the client talks to it
  (see `bench.client`);
- `cluster` (`ClusterSection`): the virtual cluster, and the dispatch policies to compare
  (live too);
- `slo` (`SloSection`): SLOs and the exit-code threshold (see `bench.slo`);
- `capacity` (`CapacitySection`): the SLO-capacity search (see `bench.capacity`);
- `output` (`OutputSection`): the report folder;
- `execution` (`ExecutionSection`): where the runs of a virtual sweep execute (in this
  process one after another, a pool of local processes, or Ray tasks; see
  `bench.executors`). It never changes a result.

Times in seconds, rates in requests/s. `BenchConfig.flat(**flags)` builds one from the
flat flag names (`num_requests=`, `request_rate=`, `virtual=`...; what `astro bench`
passes), and `to_dict()` writes that same flat form into report.json
(schema "astro.bench/1"), so a saved config still repeats a run. Checks that read files
or registries (the cluster file, the profile, policy names) run in `run_bench`, before
any data loads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from rps_astro_cli.errors import AstroUserError

CAPACITY_METRICS = ("ttft", "tpot", "e2el", "nlat")
ENDPOINTS = ("chat", "completions")
TTFT_DEFINITIONS = ("astro", "vllm")  # --ttft-definition (docs/metrics.md "TTFT and ITL definitions")
SAMPLINGS = ("astro", "vllm")  # --sampling: whose dataset draw


@dataclass(frozen=True)
class WorkloadSection:
    """Which requests to send (`bench.workloads`)."""

    name: str = "sharegpt"              # registered workload (-w): sharegpt, llava-instruct, burstgpt, mix-mh...
    path: str | None = None             # data file or folder (--path); None: the data folder, hub, synthetic
    num_requests: int = 200             # requests to load (-n)
    seed: int = 0                       # seeds the workload sample, arrivals and policies (--seed)
    tokenizer: str | None = None        # Hugging Face tokenizer for token counts; None: the fallback counter
    image_dir: str | None = None        # folder of the LLaVA-Instruct images
    video_dir: str | None = None        # folder of the LLaVA-Video videos
    max_frames: int = 32                # frames sampled per video
    min_tokens: int = 4                 # drop records whose prompt or reply is shorter (tokens)
    max_prompt_tokens: int = 1024       # drop records whose prompt is longer (tokens)
    max_total_tokens: int = 2048        # drop records whose prompt + reply is longer (tokens)
    multi_turn: bool | None = None      # replay conversations turn by turn (--multi-turn); None: off
    think_time_s: float | None = None   # mean think time between a reply and the next turn (s); None: 2 s
    sampling: str = "astro"             # astro: astro's draw; vllm: vllm bench serve's (filter, order, arrivals)
    input_len: int = 1024               # the random workload's prompt length (tokens; --input-len)
    output_len: int = 128               # the random workload's reply length; custom rows without one (--output-len)
    slo_classes: list[str] | None = None  # --slo-class NAME:ttft_ms=..,tpot_ms=..,share=..,priority=.. (issue 33)

    def __post_init__(self) -> None:
        if self.slo_classes:
            from rps_astro_cli.bench.slo import parse_slo_classes

            parse_slo_classes(self.slo_classes)  # checks names, keys, values and shares
        if self.sampling not in SAMPLINGS:
            raise AstroUserError(f"unknown sampling {self.sampling!r}", field="--sampling",
                                 fix="use astro or vllm")


@dataclass(frozen=True)
class ArrivalSection:
    """When requests are sent (`bench.arrivals`)."""

    process: str = "poisson"            # arrival process (--arrival): poisson, gamma, constant, trace
    request_rate_rps: float = math.inf  # offered rate (--request-rate); inf: all at t = 0
    burstiness: float = 1.0             # gamma shape (--burstiness); 1 = Poisson
    time_scale: float = 1.0             # trace replay: multiply inter-arrival times by this
    max_concurrency: int | None = None  # at most this many requests in flight (None: unbounded)
    rates_rps: list[float] | None = None  # a sweep of rates (--rates), overrides request_rate_rps
    warmup_requests: int = 0            # live: requests sent (all at once) before each run, not measured (--warmup)
    max_seconds: float | None = None    # requests planned later than this after the start are not sent (--max-seconds)

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise AstroUserError(f"must be ≥ 1, got {self.max_concurrency}", field="--max-concurrency")
        if self.warmup_requests < 0:
            raise AstroUserError(f"must be ≥ 0, got {self.warmup_requests}", field="--warmup")
        if self.max_seconds is not None and not (self.max_seconds > 0 and math.isfinite(self.max_seconds)):
            raise AstroUserError(f"must be a finite number of seconds > 0, got {self.max_seconds}",
                                 field="--max-seconds", fix="e.g. --max-seconds 60")


def check_base_url(url: str) -> None:
    """`--base-url` is an http:// or https:// URL with a host (a trailing /v1 is fine:
    `bench.client.server_root` drops it).

    Raises:
        AstroUserError: names --base-url and the URL to pass instead.
    """
    from urllib.parse import urlsplit

    if "://" not in url:
        raise AstroUserError(f"{url!r} has no http:// or https:// scheme", field="--base-url",
                             fix=f"pass --base-url http://{url}")
    try:
        u = urlsplit(url)
        host = u.hostname
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise AstroUserError(f"{url!r} is not a URL: {exc}", field="--base-url",
                             fix="pass the server's URL, e.g. http://127.0.0.1:8000") from None
    if u.scheme not in ("http", "https"):
        raise AstroUserError(f"{url!r}: scheme {u.scheme!r} is not http or https", field="--base-url",
                             fix="pass an http:// or https:// URL, e.g. http://127.0.0.1:8000")
    if not host:
        raise AstroUserError(f"{url!r} names no host", field="--base-url",
                             fix="pass the server's URL, e.g. http://127.0.0.1:8000")


@dataclass(frozen=True)
class TargetSection:
    """The live target and how the client talks to it (`bench.client`)."""

    cluster: str | None = None          # astro serve's cluster.json (--cluster)
    base_url: str | None = None         # any OpenAI-compatible server (--base-url)
    model: str | None = None            # model name to send; None: the server's first model
    endpoint: str = "chat"              # chat or completions
    send_true_lengths: bool = True      # send the reference reply length (vllm_xargs, ignore_eos)
    max_tokens: str = "auto"            # auto, reference, none or a positive integer
    ignore_eos: bool = False            # ask the server to ignore end-of-sequence
    timeout_s: float = 600.0            # deadline of each whole request, sent → last byte (s)
    api_key: str | None = None          # bearer key; never written to the report
    ttft_definition: str = "astro"      # astro: first non-empty text, text chunks as ITL; vllm: any chunk

    def __post_init__(self) -> None:
        if self.cluster and self.base_url:
            raise AstroUserError("give --cluster or --base-url, not both", field="--base-url")
        if self.base_url:
            check_base_url(self.base_url)
        if not (isinstance(self.timeout_s, (int, float)) and math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise AstroUserError(f"must be a finite number of seconds > 0, got {self.timeout_s}",
                                 field="--request-timeout",
                                 fix="e.g. --request-timeout 600 (the deadline of each whole request)")
        mt = self.max_tokens
        if mt not in ("auto", "reference", "none") and not (mt.isdigit() and int(mt) > 0):
            raise AstroUserError(f"got {mt!r}", field="--max-tokens",
                                 fix="use auto, reference, none or a positive integer")
        if self.ttft_definition not in TTFT_DEFINITIONS:
            raise AstroUserError(f"unknown definition {self.ttft_definition!r}", field="--ttft-definition",
                                 fix="use astro or vllm")
        if self.endpoint not in ENDPOINTS:
            raise AstroUserError(f"unknown endpoint {self.endpoint!r}", field="--endpoint",
                                 fix="use chat or completions")


@dataclass(frozen=True)
class ClusterSection:
    """The virtual cluster (`cluster.virtual`), and the dispatch policies to compare."""

    virtual: bool = False               # run the virtual-time cluster instead of a live target
    instances: int = 4                  # virtual instances
    profile: str | None = None          # execution profile id or file, or P1,P2,… one per instance (virtual);
                                        # None: the recipe's, else chosen by the workload's media
    predictor_profile: str | None = None  # virtual: the profile(s) the Predictors are told (P or P1,P2,…);
                                          # None: each its own engine's
    calibration: str | None = None      # virtual: online | off | none (the Predictors' step-model calibration,
                                        # `cluster.virtual`); None: online when --predictor-profile differs, else none
    instance_policy: str = "fcfs"       # in-instance policy of every virtual instance
    instance_policies: list[str] | None = None  # --instance-policies: a run each (live: a fresh cluster each)
    recipe: str | None = None           # --recipe NAME|PATH: engine limits, profile, instance policy (virtual)
    chunked_prefill: bool = True        # vLLM V1 chunked prefill (virtual; from a recipe's engine, no flag)
    preprocess_slots: int | None = None  # front-end preprocessing slots per instance (virtual; recipe)
    policies: list[str] | None = None   # dispatch policies to compare (live: one cluster per policy)
    ks: list[str] | None = None         # power_of_k's k values ("all" = full fan-out)
    objective: str | None = None        # power_of_k objective: e2e or ttft
    policy_params: dict[str, str] | None = None  # --param NAME=VALUE: to each policy of the run declaring NAME
    instance_policy_params: dict[str, str] | None = None  # --instance-param NAME=VALUE (virtual)
    oracle_lengths: bool = False        # give the dispatcher true output lengths
    prediction_noise: float = 0.0       # σ of the (1 + σ·z) noise on each latency prediction
    prediction_noise_fraction: float = 1.0  # share of predictions that get the noise
    length_model: str | None = None     # the tagger's length model (length.resolve spec)
    remaining_length: str = "none"      # look-ahead length rule (sim.remaining): none, default or a table JSON
    max_num_seqs: int | None = None     # per-instance batch limit; None: the profile's
    schedulers: int = 1                 # stateless scheduler replicas, each dispatching on its own (virtual)
    status_interval_s: float = 0.0      # instance status copied every this many s (virtual; 0: live state)
    admission: str = "reject"           # requests with an SLO no instance can meet: reject | queue | off (virtual)

    def __post_init__(self) -> None:
        if self.admission not in ("off", "reject", "queue"):
            raise AstroUserError(f"unknown admission mode {self.admission!r}", field="--admission",
                                 fix="use reject, queue or off")
        if isinstance(self.schedulers, bool) or not isinstance(self.schedulers, int) or self.schedulers < 1:
            raise AstroUserError(f"must be a whole number ≥ 1, got {self.schedulers!r}", field="--schedulers")
        if not (math.isfinite(self.status_interval_s) and self.status_interval_s >= 0):
            raise AstroUserError(f"must be a finite number ≥ 0, got {self.status_interval_s!r}",
                                 field="--status-interval", fix="pass seconds, e.g. 0.25 (a Predictor's "
                                 "status_max_age_s), or 0 for the live state")
        if self.instances < 1:
            raise AstroUserError(f"must be ≥ 1, got {self.instances}", field="--instances")
        if self.calibration is not None and self.calibration not in ("online", "off", "none"):
            raise AstroUserError(f"got {self.calibration!r}", field="--calibration", fix="use online, off or none")
        if self.prediction_noise < 0:
            raise AstroUserError("must be ≥ 0", field="--prediction-noise")
        if self.objective is not None:  # checked by the parameter that declares it (power_of_k's)
            from rps_astro_cli.dispatch import alias_param

            alias_param("objective").check(self.objective, field="--objective")
        if not 0 <= self.prediction_noise_fraction <= 1:
            raise AstroUserError("must be in [0, 1]", field="--prediction-noise-fraction")
        for k in self.ks or []:
            from rps_astro_cli.dispatch import alias_param
            from rps_astro_cli.params import ParamError

            try:
                alias_param("k").convert(k)
            except ParamError:
                raise AstroUserError(f"got {k!r}", field="--k",
                                     fix="use positive integers, all or auto, e.g. --k 2,4,all") from None


@dataclass(frozen=True)
class SloSection:
    """SLOs (`bench.slo`) and the exit-code threshold."""

    specs: list[str] | None = None      # --slo metric:seconds entries, e.g. ["ttft:10"]
    e2e_scale: float | None = None      # --slo-scale: SLO = this × the request's isolated E2E
    fail_under: float | None = None     # exit 1 when SLO attainment (good / all) is below this in a run

    def __post_init__(self) -> None:
        if self.fail_under is not None and not (0 <= self.fail_under <= 1):
            raise AstroUserError("must be a fraction in [0, 1]", field="--fail-under")
        if self.fail_under is not None and not self.specs and self.e2e_scale is None:
            raise AstroUserError("--fail-under needs an SLO", field="--fail-under",
                                 fix="add --slo ttft:10 or --slo-scale 5")


@dataclass(frozen=True)
class CapacitySection:
    """The SLO-capacity search (`bench.capacity`)."""

    enabled: bool = False               # search SLO capacity (--capacity)
    metric: str = "ttft"                # ttft, tpot, e2el or nlat
    percentile: float = 99.0            # the percentile that must meet the threshold, in (0, 100]
    threshold_s: float | None = None    # None: the --slo value of `metric`, else 10 s (Astrolabe)
    min_rps: float = 0.5                # search bounds and start (req/s)
    start_rps: float = 4.0
    max_rps: float = 256.0
    tolerance: float = 0.02             # stop when the bracket is this narrow (relative)
    width: int = 1                      # rates probed per round (--capacity-width; 1: doubling, then bisection)

    def __post_init__(self) -> None:
        if isinstance(self.width, bool) or not isinstance(self.width, int) or self.width < 1:
            raise AstroUserError(f"must be a whole number ≥ 1, got {self.width!r}", field="--capacity-width",
                                 fix="pass 1 (one rate at a time) or the number of rates to probe per round, "
                                     "e.g. the executor's workers")
        if not (0 < self.percentile <= 100):
            raise AstroUserError("must be in (0, 100]", field="--capacity-percentile")
        if self.metric not in CAPACITY_METRICS:
            raise AstroUserError(f"unknown metric {self.metric!r}", field="--capacity-metric",
                                 fix="choose ttft, tpot, e2el or nlat")


EXECUTORS = ("serial", "processes", "ray")


@dataclass(frozen=True)
class ExecutionSection:
    """Where the runs (probes) of a virtual sweep execute (`bench.executors`)."""

    executor: str = "serial"            # serial (this process), processes (local pool) or ray (Ray tasks)
    ray_address: str | None = None      # --executor ray: the cluster to join (None: start a local Ray)
    workers: int | None = None          # processes: pool size; ray: CPUs of the local Ray (None: all cores)

    def __post_init__(self) -> None:
        if self.executor not in EXECUTORS:
            raise AstroUserError(f"unknown executor {self.executor!r}", field="--executor",
                                 fix="choose serial, processes or ray")
        if self.ray_address is not None and self.executor != "ray":
            raise AstroUserError("--ray-address names the Ray cluster of --executor ray", field="--ray-address",
                                 fix="add --executor ray, or drop --ray-address")
        if self.workers is not None and (isinstance(self.workers, bool) or not isinstance(self.workers, int)
                                         or self.workers < 1):
            raise AstroUserError(f"must be a whole number ≥ 1, got {self.workers!r}", field="--workers",
                                 fix="pass the number of parallel runs, e.g. 2")
        if self.workers is not None and self.executor == "serial":
            raise AstroUserError("--workers sizes a parallel executor", field="--workers",
                                 fix="add --executor processes or --executor ray")
        if self.workers is not None and self.ray_address is not None:
            raise AstroUserError("--workers sizes the local Ray; a joined cluster has its own CPUs",
                                 field="--workers", fix="drop --workers, or drop --ray-address")


@dataclass(frozen=True)
class OutputSection:
    """Where the report goes."""

    out_dir: str | None = None          # report folder; None: no files


# Flat flag name → (section, field), in the order report.json has always listed them.
FLAT_FIELDS: dict[str, tuple[str, str]] = {
    "workload": ("workload", "name"), "path": ("workload", "path"),
    "num_requests": ("workload", "num_requests"), "seed": ("workload", "seed"),
    "tokenizer": ("workload", "tokenizer"), "image_dir": ("workload", "image_dir"),
    "video_dir": ("workload", "video_dir"), "max_frames": ("workload", "max_frames"),
    "min_tokens": ("workload", "min_tokens"), "max_prompt_tokens": ("workload", "max_prompt_tokens"),
    "max_total_tokens": ("workload", "max_total_tokens"),
    "arrival": ("arrivals", "process"), "request_rate": ("arrivals", "request_rate_rps"),
    "burstiness": ("arrivals", "burstiness"), "time_scale": ("arrivals", "time_scale"),
    "max_concurrency": ("arrivals", "max_concurrency"), "rates": ("arrivals", "rates_rps"),
    "cluster": ("target", "cluster"), "base_url": ("target", "base_url"), "model": ("target", "model"),
    "endpoint": ("target", "endpoint"), "send_true_lengths": ("target", "send_true_lengths"),
    "max_tokens": ("target", "max_tokens"), "ignore_eos": ("target", "ignore_eos"),
    "timeout_s": ("target", "timeout_s"), "api_key": ("target", "api_key"),
    "virtual": ("cluster", "virtual"), "instances": ("cluster", "instances"),
    "profile": ("cluster", "profile"), "instance_policy": ("cluster", "instance_policy"),
    "instance_policies": ("cluster", "instance_policies"), "recipe": ("cluster", "recipe"),
    "policies": ("cluster", "policies"), "ks": ("cluster", "ks"), "objective": ("cluster", "objective"),
    "oracle_lengths": ("cluster", "oracle_lengths"), "prediction_noise": ("cluster", "prediction_noise"),
    "prediction_noise_fraction": ("cluster", "prediction_noise_fraction"),
    "length_model": ("cluster", "length_model"), "max_num_seqs": ("cluster", "max_num_seqs"),
    "remaining_length": ("cluster", "remaining_length"),
    "slo": ("slo", "specs"), "slo_scale": ("slo", "e2e_scale"),
    "capacity": ("capacity", "enabled"), "capacity_metric": ("capacity", "metric"),
    "capacity_percentile": ("capacity", "percentile"), "capacity_threshold_s": ("capacity", "threshold_s"),
    "capacity_min_rps": ("capacity", "min_rps"), "capacity_start_rps": ("capacity", "start_rps"),
    "capacity_max_rps": ("capacity", "max_rps"), "capacity_tolerance": ("capacity", "tolerance"),
    "fail_under": ("slo", "fail_under"), "out_dir": ("output", "out_dir"),
    # policy parameters (issue 12): written to report.json only when given, so the flat
    # schema of runs without them is unchanged
    "policy_params": ("cluster", "policy_params"), "instance_policy_params": ("cluster", "instance_policy_params"),
    # heterogeneous fleets (issue 31): only when given
    "predictor_profile": ("cluster", "predictor_profile"), "calibration": ("cluster", "calibration"),
    # multi-turn sessions (issue 14): likewise only when given
    "multi_turn": ("workload", "multi_turn"), "think_time": ("workload", "think_time_s"),
    # parallel sweeps (issue 16): likewise only when not the default
    "capacity_width": ("capacity", "width"), "executor": ("execution", "executor"),
    "schedulers": ("cluster", "schedulers"), "status_interval_s": ("cluster", "status_interval_s"),
    "ray_address": ("execution", "ray_address"), "workers": ("execution", "workers"),
    # vLLM comparability (issue 17): the TTFT/ITL definition is in every report; the sampling always
    "ttft_definition": ("target", "ttft_definition"), "sampling": ("workload", "sampling"),
    "input_len": ("workload", "input_len"), "output_len": ("workload", "output_len"),
    "warmup": ("arrivals", "warmup_requests"), "max_seconds": ("arrivals", "max_seconds"),
    # per-request SLO classes and admission (issue 33): only when given / not the default
    "slo_classes": ("workload", "slo_classes"), "admission": ("cluster", "admission"),
}
OPTIONAL_FLAT = ("policy_params", "instance_policy_params", "instance_policies", "recipe", "multi_turn",
                 "think_time", "ray_address", "workers", "max_seconds", "predictor_profile", "calibration",
                 "slo_classes")
DEFAULT_FLAT = {"capacity_width": 1, "executor": "serial", "schedulers": 1, "status_interval_s": 0.0,
                "admission": "reject"}
"""Flat names left out of report.json while they hold these defaults (the schema of a
serial run is unchanged)."""


@dataclass(frozen=True)
class BenchConfig:
    """Everything a bench run needs (see module docstring); saved in report.json."""

    workload: WorkloadSection = field(default_factory=WorkloadSection)
    arrivals: ArrivalSection = field(default_factory=ArrivalSection)
    target: TargetSection = field(default_factory=TargetSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    slo: SloSection = field(default_factory=SloSection)
    capacity: CapacitySection = field(default_factory=CapacitySection)
    output: OutputSection = field(default_factory=OutputSection)
    execution: ExecutionSection = field(default_factory=ExecutionSection)

    def __post_init__(self) -> None:
        """Rules that span sections.

        Raises:
            AstroUserError: names the flag and the fix.
        """
        virtual, tgt = self.cluster.virtual, self.target
        if virtual and (tgt.cluster or tgt.base_url):
            raise AstroUserError("--virtual runs the simulated cluster; it takes no --cluster/--base-url",
                                 field="--virtual", fix="drop one of them")
        if not virtual and not tgt.cluster and not tgt.base_url:
            raise AstroUserError("no target", field="--cluster",
                                 fix="pass --cluster cluster.json, --base-url URL, or --virtual")
        if not virtual:
            c = self.cluster
            flags = [f for f, on in (("--oracle-lengths", c.oracle_lengths),
                                     ("--prediction-noise", c.prediction_noise > 0),
                                     ("--objective", c.objective is not None),
                                     ("--instance-param", bool(c.instance_policy_params)),
                                     ("--recipe", c.recipe is not None),
                                     ("--predictor-profile", c.predictor_profile is not None),
                                     ("--calibration (live: each Predictor's own; `astro serve --calibration`)",
                                      c.calibration is not None),
                                     ("--profile P1,P2,…", "," in (c.profile or "")),
                                     ("--length-model", c.length_model is not None),
                                     ("--max-num-seqs", c.max_num_seqs is not None),
                                     ("--schedulers", c.schedulers != 1),
                                     ("--status-interval", c.status_interval_s != 0)) if on]
            if flags:
                raise AstroUserError(f"{', '.join(flags)} only apply to --virtual runs", field=flags[0].split()[0],
                                     fix="add --virtual, or set them in the cluster's recipe for astro serve")
            if c.instance_policies and not tgt.cluster:
                raise AstroUserError("live --instance-policies restarts the cluster once per policy from the recipe "
                                     "in cluster.json", field="--instance-policies",
                                     fix="pass --cluster cluster.json (written by astro serve), or add --virtual")
        if self.arrivals.max_seconds is not None and self.workload.multi_turn:
            raise AstroUserError("a duration limit cuts sessions mid-conversation", field="--max-seconds",
                                 fix="use -n to size a --multi-turn run")
        if virtual and self.arrivals.warmup_requests:
            raise AstroUserError("the virtual cluster starts cold by design; warm-up requests apply to live targets",
                                 field="--warmup", fix="drop --warmup, or run against --cluster/--base-url")
        if self.execution.executor != "serial" and not virtual:
            raise AstroUserError("a live cluster serves one run at a time; parallel runs are for the virtual "
                                 "cluster", field="--executor", fix="add --virtual, or drop --executor")
        if self.arrivals.process == "trace" and (self.arrivals.rates_rps or self.capacity.enabled):
            raise AstroUserError("trace replay has no rate to sweep", field="--arrival",
                                 fix="use --time-scale, or a poisson/gamma arrival for --rates/--capacity")

    @classmethod
    def flat(cls, **flags: Any) -> BenchConfig:
        """Build from the flat flag names of `FLAT_FIELDS` (what `astro bench` passes and
        report.json's "config" holds); unnamed ones keep their defaults.

        Raises:
            TypeError: an unknown name (as a dataclass constructor would).
            AstroUserError: a bad value (names the flag).
        """
        unknown = sorted(set(flags) - set(FLAT_FIELDS))
        if unknown:
            raise TypeError(f"BenchConfig.flat() got unexpected keyword arguments {', '.join(unknown)}")
        per: dict[str, dict[str, Any]] = {}
        for name, value in flags.items():
            section, attr = FLAT_FIELDS[name]
            per.setdefault(section, {})[attr] = value
        types = {f.name: f.default_factory for f in fields(cls)}  # type: ignore[misc]
        return cls(**{s: types[s](**kw) for s, kw in per.items()})

    def to_dict(self) -> dict[str, Any]:
        """The flat form (FLAT_FIELDS order), without `api_key`; infinite rates as "inf"."""
        d: dict[str, Any] = {}
        for name, (section, attr) in FLAT_FIELDS.items():
            if name == "api_key":
                continue
            v = getattr(getattr(self, section), attr)
            if v is None and name in OPTIONAL_FLAT:
                continue
            if name in DEFAULT_FLAT and v == DEFAULT_FLAT[name]:
                continue
            d[name] = list(v) if isinstance(v, list) else v
        for k in ("request_rate", "burstiness"):
            if isinstance(d[k], float) and math.isinf(d[k]):
                d[k] = "inf"
        return d
