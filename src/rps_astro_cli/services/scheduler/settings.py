"""The scheduler's configuration: the instances it dispatches to and its knobs."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rps_astro_cli.discovery.kubernetes import KubeApi, WatchSettings
from rps_astro_cli.dispatch.admission import RequestSlo
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.protocol.limits import CostLimits
from rps_astro_cli.services.http_common import DEFAULT_MAX_BODY_BYTES

# where a prefix-aware policy gets a text prompt's token ids (`SchedulerSettings.prefix_tokenizer`)
PREFIX_TOKENIZERS = ("auto", "engine", "fallback")


@dataclass(frozen=True)
class InstanceEndpoint:
    """One instance the scheduler dispatches to."""

    # label in headers and metrics ("engine-0")
    name: str
    # its OpenAI-compatible server
    engine_url: str
    # its Predictor sidecar, or None (no predictions for it)
    predictor_url: str | None = None
    # the profile its in-process look-ahead simulates (`predict_in_process`); None: the
    # scheduler's `profile`, else the one its engine reports
    profile: str | None = None


@dataclass(frozen=True)
class DiscoverySettings:
    """Instances from the Kubernetes API instead of a static list (docs/deploy-kubernetes.md)."""

    # the API server and namespace (`KubeApi.in_cluster()` inside a pod)
    api: KubeApi
    # the engines' Service whose EndpointSlices are the instances, and the port names
    watch: WatchSettings
    # longest the startup waits for the first list (then it serves, 503 until instances appear)
    sync_timeout_s: float = 10.0


def seed_from_pod_name(pod_name: str | None) -> int:
    """A dispatch seed per scheduler replica: the first 8 bytes of SHA-256 of the pod
    name (env HOSTNAME in a pod), so two replicas do not draw identical candidate sets;
    0 without a name."""
    if not pod_name:
        return 0
    return int.from_bytes(hashlib.sha256(pod_name.encode()).digest()[:8], "big")


@dataclass(frozen=True)
class SchedulerSettings:
    """Scheduler configuration (all times in seconds).

    instances: the engines (≥ 1, or none with `discovery`). discovery: instances from the
    Kubernetes API (added / removed while running), or None for the static list.
    policy / policy_params: a registered dispatch policy and its constructor arguments
    (power_of_k: k, objective; llumnix: variant).
    tagger_url: the tagger service, or None to tag in-process with `length_model`.
    predict_deadline_s: deadline of the parallel predict RPCs (50 ms).
    tag_deadline_s: deadline of the tag RPC; on miss `default_output_tokens` is used.
    health_interval_s: health-check period; status_interval_s: `/status` poll period
    for status-based policies (llumnix); recheck_interval_s: how often instances out of
    rotation are re-checked (readmission delay). max_body_bytes: front-door body limit.
    served_models: model names accepted (empty = learn them from the engines).
    api_key: bearer token required on /v1/* when set. internal_token: the cluster's
    internal token, sent on every call to engines, Predictors and the tagger (None: none
    sent; `protocol.internal_auth`). seed: the dispatch Generator's seed.
    upstream_timeout_s: read timeout towards engines. decisions_kept: ring size.
    predictor_breaker_failures / predictor_breaker_s: after that many consecutive
    late/failed predict RPCs a Predictor is not asked for that long (then probed again).
    oracle_lengths: use the request's true length (`vllm_xargs.astro_output_tokens`, which
    the bench sends) as the predicted length when present — the Astrolabe "oracle"
    ablation; the tagger is still called for the modality facts.
    early_dispatch: when the decision reads no reply length (objective ttft, or a policy
        that asks no Predictor), a text request's decision starts while the tagger
        works, on the parser's prompt tokens (the tagger counts the same way) and
        `default_output_tokens` (its own reply length does not change its TTFT); the
        look-aheads stop at its first token, so the decision's `e2e_s` predictions
        equal its TTFT ones.
    late_tag: with early dispatch, forward a text request without waiting for its tag
        when nothing reads the predicted length before it lands: every look-ahead runs in
        this process (`predict_in_process`, no sidecar reads the engine's `/status`
        directly) or the policy asks no Predictor, and every engine's in-instance policy
        is fcfs (known from its `/status`: a policy that polls none waits for tags). The
        request goes with an `x-request-id` (`astro-` + 16 hex digits) and the tag's
        length, when it lands, is put on its pending entry and on its rows of the
        engine's later `/status` polls (`instances.late_lengths_onto`) — what the engine
        would have shown had the length been in the body. Takes the tag's wait off the
        critical path.
    predict_in_process: an instance without a Predictor URL is predicted in the
        scheduler's own process — the sidecar's `services.predictor.Predictor` look-ahead
        on the engine's `/status` from the scheduler's status poll (or its own fetch),
        with the pending list — instead of being left unscored: no RPC hop, for a small
        fleet on few cores (the sidecars' reason is spreading look-ahead CPU over pods).
    count_pending: send each Predictor the requests forwarded to its engine that its
    `/status` may not show yet (`protocol.service_wire.PendingRequest`; issue 13 §2); pending_keep_s: how
    long after it was sent a request is still listed (≥ the Predictor's
    status_max_age_s + its pending margin, else a stale snapshot misses it).
    time_scale: wall seconds per engine second of the sim engines behind it (their
    `--time-scale`; 1 for vLLM): the scheduler observes latencies in wall seconds and the
    Predictors answer in engine seconds, so the observed ones are divided by it before
    the prediction-error metrics compare them.
    prefix_tokenizer: where a policy that reads prefix-cache hits gets a text prompt's
        token ids for its block hashes: `engine` (the engine's `POST /tokenize`, the ids
        vLLM caches by), `fallback` (astro's fallback tokenizer: the ids the sim engine
        caches by), `auto` (engine ids once some engine's `/version` says it is not an
        astro sim engine, else fallback ids; `prompt_ids.py`).
    tokenize_deadline_s: deadline of that `/tokenize` RPC, from its start; on miss the
        fallback ids are hashed (`astro:dispatch_fallbacks_total{reason="tokenize timeout"}`).
        The RPC itself ends after `clients.RPC_BOUND_S` (1 s) whatever the deadline.
    health_timeout_s: deadline of one engine health check or `/status` poll; a miss
        takes the engine out of rotation until a check passes.
    admission: what the dispatch does with a request whose TTFT SLO no candidate is
        predicted to meet (`dispatch.admission`): "reject" (HTTP 429, `Retry-After`),
        "queue" (one in time but without room anywhere waits in the router queue,
        `FrontDoor.first_decision`), or "off" (dispatch it anyway). Requests without an
        SLO are never judged.
    slo_classes: class name → its `RequestSlo` defaults, chosen by the `x-slo-class`
        header or a class named like the request's model.
    calibration: "online" (default): correct each instance's predicted TTFT / E2E by
        what its own requests were then served with (`dispatch.outcome`: a robust affine
        fit per instance, applied only while it beats the raw estimate) — the part of a
        real engine's latency no step model sees (API server, HTTP, later arrivals) — and
        let the in-process Predictors (`predict_in_process`) refit their step models from
        the engines' steps; "off": neither. The recipe's `predictor.calibration`.
    """

    instances: tuple[InstanceEndpoint, ...]
    policy: str = "power_of_k"
    policy_params: dict[str, Any] = field(default_factory=dict)
    tagger_url: str | None = None
    length_model: str | None = None
    profile: str | None = None
    predict_deadline_s: float = 0.05
    tag_deadline_s: float = 0.05
    default_output_tokens: int = 256
    health_interval_s: float = 0.5
    status_interval_s: float = 0.1
    recheck_interval_s: float = 0.1
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    served_models: tuple[str, ...] = ()
    api_key: str | None = None
    internal_token: str | None = None
    seed: int = 0
    upstream_timeout_s: float = 600.0
    decisions_kept: int = 1000
    predictor_breaker_failures: int = 3
    predictor_breaker_s: float = 1.0
    oracle_lengths: bool = False
    early_dispatch: bool = True
    predict_in_process: bool = False
    late_tag: bool = True
    count_pending: bool = True
    pending_keep_s: float = 1.0
    discovery: DiscoverySettings | None = None
    time_scale: float = 1.0
    prefix_tokenizer: str = "auto"
    tokenize_deadline_s: float = 0.02
    health_timeout_s: float = 1.0
    admission: str = "reject"
    slo_classes: Mapping[str, RequestSlo] = field(default_factory=dict)
    calibration: str = "online"
    # what one request may ask for (n, output tokens, logprobs; $ASTRO_MAX_*) and the most
    # response bytes relayed for it
    cost_limits: CostLimits = field(default_factory=CostLimits.from_env)

    def __post_init__(self) -> None:
        if self.calibration not in ("online", "off"):
            raise AstroUserError(f"unknown calibration {self.calibration!r}", field="calibration",
                                 fix="use online or off")
        if self.prefix_tokenizer not in PREFIX_TOKENIZERS:
            raise AstroUserError(f"unknown prefix tokenizer {self.prefix_tokenizer!r}", field="prefix_tokenizer",
                                 fix="use one of: auto, engine, fallback")
        if not self.health_timeout_s > 0:
            raise AstroUserError(f"must be > 0 s, got {self.health_timeout_s}", field="health_timeout_s",
                                 fix="give a deadline such as 1.0 (1 s)")
        if not self.tokenize_deadline_s > 0:
            raise AstroUserError(f"must be > 0 s, got {self.tokenize_deadline_s}", field="tokenize_deadline_s",
                                 fix="give a deadline such as 0.02 (20 ms)")
