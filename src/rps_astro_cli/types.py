"""astro's request vocabulary: the value types every layer passes around, and the one
JSON codec both ends of each wire use.

This module is the bottom layer: it imports nothing of astro's but `errors`. Each type
is a plain dataclass with a comment per field and its unit in the name; times are
seconds, sizes are tokens or KV blocks.

Wires and their codec (the encoder and the decoder of each body live side by side here,
so the two ends cannot drift apart):

- engine `GET /status` → Predictor, scheduler: `InstanceStatus.to_dict` /
  `InstanceStatus.from_dict` (each queued or running request a `RequestStatus`).
- scheduler → Predictor `POST /predict` and tagger `POST /tag` → scheduler: the bodies
  (`PredictRequest`, `PendingRequest`, `PredictReply`, `TagResult`) and their codec
  live in `protocol/service_wire.py`; what they carry that the simulator and the
  dispatch policies also use lives here: the request being placed (`CandidateRequest`)
  and its predicted latencies (`LatencyEstimate`, what the dispatch policy sees).
- scheduler `GET /decisions`: `DecisionRecord.to_dict` (one per front-door request,
  holding its `DispatchDecision`).

Names follow vLLM where vLLM has one: `num_computed_tokens` (tokens whose KV is
computed). Decoders still accept `computed_tokens`, the name `/status` used before.

Decoders raise `AstroUserError` naming the offending field; services turn it into a
400 (or, for an engine's `/status`, a 503 "engine status unavailable").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from rps_astro_cli.errors import AstroUserError

#: Request modalities astro tells apart (RPS-Serve's sand / pebbles / rocks by default).
MODALITIES = ("text", "image", "video")
#: What a prediction-guided dispatch minimises: the candidate's E2E or its TTFT.
OBJECTIVES = ("e2e", "ttft")


# ---------------------------------------------------------------------------------------
# Instance limits
# ---------------------------------------------------------------------------------------


class _ProfileLimits(Protocol):
    """The batching limits an execution profile carries (see `sim/profile.py`)."""

    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class InstanceConfig:
    """Batching limits of one instance (vLLM's `SchedulerConfig` + cache config); the
    `limits` object of `/status`."""

    # tokens per KV block (16)
    block_size: int = 16
    # KV blocks in the pool (1056 for Llama-2-7B on A30)
    num_gpu_blocks: int = 1056
    # most requests in one batch (48 in the Astrolabe setup)
    max_num_seqs: int = 48
    # token budget per step (512, the chunk size)
    max_num_batched_tokens: int = 512
    # longest sequence, prompt + output (tokens)
    max_model_len: int = 4096
    # True = vLLM V1 chunked prefill; False = prioritized prefill
    chunked_prefill: bool = True
    # prioritized mode's token budget for one prefill batch (tokens; None =
    # max(max_num_batched_tokens, max_model_len) so any prompt fits)
    prefill_budget_tokens: int | None = None
    # vLLM V1 automatic prefix caching (on by default, as in vLLM; `sim/prefix_cache.py`)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) <= 0:
                raise AstroUserError(f"must be > 0, got {getattr(self, name)}", field=name)
        if self.num_gpu_blocks * self.block_size < self.max_model_len:
            raise AstroUserError(
                f"num_gpu_blocks × block_size = {self.num_gpu_blocks * self.block_size} tokens "
                f"is below max_model_len = {self.max_model_len}",
                field="num_gpu_blocks",
                fix="raise num_gpu_blocks or lower max_model_len",
            )

    @property
    def prefill_budget(self) -> int:
        return self.prefill_budget_tokens or max(self.max_num_batched_tokens, self.max_model_len)

    @classmethod
    def from_profile(cls, profile: _ProfileLimits, **overrides: Any) -> InstanceConfig:
        """The profile's default limits, with `overrides` (None values ignored)."""
        base = cls(
            block_size=profile.block_size,
            num_gpu_blocks=profile.num_gpu_blocks,
            max_num_seqs=profile.max_num_seqs,
            max_num_batched_tokens=profile.max_num_batched_tokens,
            max_model_len=profile.max_model_len,
        )
        return replace(base, **{k: v for k, v in overrides.items() if v is not None})

    def blocks_for(self, tokens: int) -> int:
        """KV blocks holding `tokens` tokens: ceil(tokens / block_size)."""
        return -(-tokens // self.block_size)


# ---------------------------------------------------------------------------------------
# Engine status (`GET /status`)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestStatus:
    """One queued, running or arriving request as an engine's `/status` shows it. Times
    are on the engine's clock (s)."""

    # the engine's request id
    request_id: str
    # when the request arrived (engine clock, s)
    arrival_s: float
    # prompt length, vision tokens included (tokens)
    prompt_tokens: int
    # tokens whose KV is computed (prefill progress; vLLM's name). Wire key
    # `num_computed_tokens`; `computed_tokens` is accepted on input
    num_computed_tokens: int = 0
    # output tokens sampled so far (tokens)
    generated_tokens: int = 0
    # the tagger's predicted output length (tokens); None → the Predictor's default
    predicted_output_tokens: int | None = None
    # "text" / "image" / "video"
    modality: str = "text"
    # prompt tokens that come from media (tokens)
    vision_tokens: int = 0
    # vision-encoder time still to charge to its first prefill step (s)
    encoder_s: float = 0.0
    # "sand" / "pebbles" / "rocks" when classified, else None
    req_class: str | None = None
    # KV blocks it holds
    kv_blocks: int = 0
    # its deadline (engine clock, s), or None
    deadline_s: float | None = None
    # for a request still in preprocessing (`InstanceStatus.arriving`): when it joins
    # the waiting queue (engine clock, s); None for queued and running requests
    ready_s: float | None = None
    # for a request not yet admitted (no KV blocks, nothing computed): prompt tokens its
    # prefix-cache lookup hits now (tokens; the look-ahead starts its prefill past them).
    # Wire key omitted when 0
    cached_tokens: int = 0

    @property
    def computed_tokens(self) -> int:
        """The old name of `num_computed_tokens` (tokens); kept while callers move."""
        return self.num_computed_tokens

    def to_dict(self) -> dict[str, Any]:
        """The `/status` JSON object of this request (keys in field order)."""
        return {
            "request_id": self.request_id,
            "arrival_s": self.arrival_s,
            "prompt_tokens": self.prompt_tokens,
            "num_computed_tokens": self.num_computed_tokens,
            "generated_tokens": self.generated_tokens,
            "predicted_output_tokens": self.predicted_output_tokens,
            "modality": self.modality,
            "vision_tokens": self.vision_tokens,
            "encoder_s": self.encoder_s,
            "req_class": self.req_class,
            "kv_blocks": self.kv_blocks,
            "deadline_s": self.deadline_s,
            "ready_s": self.ready_s,
            **({"cached_tokens": self.cached_tokens} if self.cached_tokens else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RequestStatus:
        """Parse one request object of a `/status` body.

        Raises:
            TypeError: `d` is not an object with these fields (`InstanceStatus.from_dict`
                names the list and index).
        """
        if "computed_tokens" in d:  # the name /status used before num_computed_tokens
            d = dict(d)
            d.setdefault("num_computed_tokens", d.pop("computed_tokens"))
        return cls(**d)


@dataclass(frozen=True)
class InstanceStatus:
    """A point-in-time snapshot of one instance: what an engine's `GET /status` returns
    (the sim engine and the vLLM plugin alike) and what the Predictor simulates forward
    from. All times on the engine's clock (s); `time_s` is "now" there, so a request's
    wait is `time_s - arrival_s`.

    JSON: {"instance_id", "time_s", "policy": {"name", ...}, "profile_id", "limits":
    {InstanceConfig's fields}, "kv_blocks_free", "kv_blocks_total",
    "num_preemptions_total", "running": [RequestStatus...] (batch order), "waiting":
    [...] (queue order, front first), "arriving": [...] (still in preprocessing, each
    with `ready_s`), "classes": {class: {"queue_len", "mean_wait_s",
    "prefill_backlog_s"}}}; readers ignore other top-level keys (the vLLM plugin adds
    `plugin`).
    """

    # the instance's name ("e0", "engine-2")
    instance_id: str
    # the engine's now (engine clock, s)
    time_s: float
    # the instance's batching limits
    limits: InstanceConfig
    # KV blocks not held by any request
    kv_blocks_free: int
    # running requests, in batch order
    running: tuple[RequestStatus, ...] = ()
    # waiting requests, in queue order (front first)
    waiting: tuple[RequestStatus, ...] = ()
    # the instance policy's `describe()` ({"name": ..., its parameters})
    policy: dict[str, Any] = field(default_factory=lambda: {"name": "fcfs"})
    # the execution profile id the engine runs ("" = unknown)
    profile_id: str = ""
    # preemptions since the engine started (count)
    num_preemptions_total: int = 0
    # per request class: {"queue_len", "mean_wait_s", "prefill_backlog_s"} (optional)
    classes: dict[str, Any] = field(default_factory=dict)
    # requests still in multimodal preprocessing (each with `ready_s`)
    arriving: tuple[RequestStatus, ...] = ()

    @property
    def kv_blocks_total(self) -> int:
        """KV blocks in the pool."""
        return self.limits.num_gpu_blocks

    def to_dict(self) -> dict[str, Any]:
        """The `/status` body."""
        return {
            "instance_id": self.instance_id,
            "time_s": self.time_s,
            "policy": self.policy,
            "profile_id": self.profile_id,
            "limits": asdict(self.limits),
            "kv_blocks_free": self.kv_blocks_free,
            "kv_blocks_total": self.kv_blocks_total,
            "num_preemptions_total": self.num_preemptions_total,
            "running": [r.to_dict() for r in self.running],
            "waiting": [r.to_dict() for r in self.waiting],
            "arriving": [r.to_dict() for r in self.arriving],
            "classes": self.classes,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> InstanceStatus:
        """Parse a `/status` body.

        Raises:
            AstroUserError: a required field is missing or malformed.
        """
        try:
            lim = dict(d["limits"])
            lim.pop("prefill_budget", None)
            return cls(
                instance_id=str(d.get("instance_id", "")),
                time_s=float(d["time_s"]),
                limits=InstanceConfig(**lim),
                kv_blocks_free=int(d["kv_blocks_free"]),
                running=_requests(d, "running"),
                waiting=_requests(d, "waiting"),
                policy=d.get("policy") or {"name": "fcfs"},
                profile_id=d.get("profile_id", ""),
                num_preemptions_total=int(d.get("num_preemptions_total", 0)),
                classes=d.get("classes") or {},
                arriving=_requests(d, "arriving"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, AstroUserError):
                raise
            raise AstroUserError(f"malformed status snapshot: {exc!r}", field="status") from None


def _requests(d: Mapping[str, Any], key: str) -> tuple[RequestStatus, ...]:
    """The `key` list of a `/status` body as `RequestStatus`es.

    Raises:
        AstroUserError: an entry is not an object with RequestStatus's fields (the
            message names the list and the entry's index).
    """
    out = []
    for i, r in enumerate(d.get(key) or ()):
        try:
            out.append(RequestStatus.from_dict(r))
        except TypeError as exc:
            names = ", ".join(RequestStatus.__dataclass_fields__)
            raise AstroUserError(f"{key}[{i}]: {exc}", field="status",
                                 fix=f"each entry takes the fields {names}") from None
    return tuple(out)


# ---------------------------------------------------------------------------------------
# The request being placed, and its predicted latency (carried by `POST /predict`)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CandidateRequest:
    """The request being placed, as the scheduler describes it to a Predictor."""

    # prompt length, vision tokens included (tokens, ≥ 1)
    prompt_tokens: int
    # the tagger's (or the oracle's) output length (tokens, ≥ 1)
    predicted_output_tokens: int
    # "text" / "image" / "video"
    modality: str = "text"
    # prompt tokens that come from media (tokens; informational)
    vision_tokens: int = 0
    # vision-encoder time charged to its first prefill step (s)
    encoder_s: float = 0.0
    # CPU preprocessing before it reaches the engine queue (s)
    preprocess_s: float = 0.0
    # "sand" / "pebbles" / "rocks" when classified, else None
    req_class: str | None = None
    # its deadline on the engine clock (s), or None
    deadline_s: float | None = None
    # its prompt tokens already in this instance's prefix cache (tokens, ≥ 0): the
    # look-ahead starts its prefill there (at most prompt_tokens − 1, as vLLM)
    cached_tokens: int = 0


@dataclass(frozen=True)
class LatencyEstimate:
    """Predicted latencies of a candidate, in seconds from the snapshot time."""

    # until its first output token (s)
    ttft_s: float
    # until its last output token (s)
    e2e_s: float
    # engine steps the look-ahead advanced (jumps count their steps; 0 when the
    # estimate came over the wire)
    steps_simulated: int
    # loop iterations the look-ahead ran (equals steps for the step-by-step one)
    events: int


# ---------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """What the dispatcher knows of one instance without predicting."""

    # position in the cluster's instance list
    index: int
    # passes health checks (circuit breaker closed)
    healthy: bool = True
    # requests the dispatcher sent there that have not ended (count)
    outstanding_requests: int = 0
    # KV blocks free in the latest status (None if unknown)
    kv_blocks_free: int | None = None
    # KV blocks in the pool (None if unknown)
    kv_blocks_total: int | None = None
    # running requests in the latest status (None if unknown)
    num_running: int | None = None
    # waiting requests in the latest status (None if unknown)
    num_waiting: int | None = None
    # KV blocks the waiting queue still needs for its prompts (None if unknown)
    waiting_blocks_needed: int | None = None
    # tokens of this request's prompt cached on the instance (prefix cache; None if unknown)
    prefix_hit_tokens: int | None = None
    # this request's prompt length (tokens; None if unknown): the hit's denominator
    request_prompt_tokens: int | None = None
    # the instance served the previous turn of this request's session
    served_session: bool = False
    # tokens per KV block on the instance (None if unknown)
    kv_block_size: int | None = None
    # KV blocks the prompts of requests forwarded there after its latest status still
    # need (the live scheduler's pending list; None: none known, as in the virtual
    # cluster, whose status never lags)
    pending_blocks_needed: int | None = None
    # requests forwarded there after its latest status (count; None: none known)
    pending_requests: int | None = None
    # the instance's batch limit, vLLM's max_num_seqs (None if unknown)
    max_num_seqs: int | None = None


@dataclass(frozen=True)
class DispatchDecision:
    """One dispatch decision."""

    # the policy's name
    policy: str
    # instance indices considered
    candidates: tuple[int, ...]
    # the chosen instance index
    choice: int
    # short text: "lowest e2e", "fallback: no predictor answered", ...
    reason: str
    # index → (ttft_s, e2e_s) for the candidates whose prediction arrived
    predictions: Mapping[int, tuple[float, float]] = field(default_factory=dict)
    # time spent deciding, predict RPCs included (µs; filled by the caller)
    decide_us: float = 0.0
    # time per pipeline stage (filter, sample, predict, score, pick; µs), when
    # `dispatch.decide` ran it
    stage_us: Mapping[str, float] = field(default_factory=dict)
    # candidates whose Predictor answered but whose step model was not trusted (its
    # recent error too high, `sim.calibration`): compared by load instead
    untrusted: tuple[int, ...] = ()
    # admission (a request with a TTFT SLO, `dispatch.admission`): why it was refused
    # (e.g. "slo_ttft_unmeetable"; `choice` is then not used), else None
    refused: str | None = None
    # admission's verdict for a judged request ("headroom", "no_prediction", ...), else None
    admission: str | None = None
    # for a refusal: the suggested Retry-After (seconds), else 0
    retry_after_s: int = 0
    # index → the Predictor's own (ttft_s, e2e_s) where outcome correction changed it
    # (`dispatch.outcome`; `predictions` holds what the policy compared)
    uncorrected: Mapping[int, tuple[float, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "policy": self.policy,
            "candidates": list(self.candidates),
            "predictions": {str(k): {"ttft_s": v[0], "e2e_s": v[1]} for k, v in self.predictions.items()},
            "choice": self.choice,
            "reason": self.reason,
            "decide_us": self.decide_us,
            "stage_us": dict(self.stage_us),
        }
        if self.untrusted:
            out["untrusted"] = list(self.untrusted)
        if self.uncorrected:
            out["uncorrected"] = {str(k): {"ttft_s": v[0], "e2e_s": v[1]} for k, v in self.uncorrected.items()}
        if self.admission is not None:
            out["admission"] = self.admission
        if self.refused is not None:
            out["refused"] = self.refused
            out["retry_after_s"] = self.retry_after_s
        return out


@dataclass
class DecisionRecord:
    """What the scheduler keeps of one front-door request (`GET /decisions`), for
    predictor-error analysis. Mutable: filled in as the request goes through.

    JSON: the fields below with the decision's own keys (`DispatchDecision.to_dict`)
    spliced in after `tag_wait_us`; a field that is None is left out.
    """

    # sequence number of the request at this scheduler (1, 2, ...)
    request: int
    # "chat" or "completions"
    endpoint: str
    # prompt length the dispatch used (tokens)
    prompt_tokens: int
    # output length the dispatch used (tokens)
    predicted_output_tokens: int
    # time waiting for the tagger after parsing (µs)
    tag_wait_us: float
    # times the request was sent to another instance after a failure (0 or 1)
    retries: int = 0
    # the last dispatch decision (None when no instance could be chosen)
    decision: DispatchDecision | None = None
    # the chosen instance's name
    instance: str | None = None
    # forward → first response chunk, as the scheduler saw it (s; streaming only)
    observed_ttft_s: float | None = None
    # forward → end of the response (s)
    observed_e2e_s: float | None = None
    # scheduler overhead (µs; see services/scheduler)
    overhead_us: float | None = None
    # the decision was made while the tagger worked (text, objective ttft): its
    # look-aheads stopped at the candidate's first token, so its predictions' e2e_s
    # equal their ttft_s
    early_dispatch: bool = False
    # forwarded before its tag landed (`SchedulerSettings.late_tag`): `tag_wait_us` is 0
    # and `predicted_output_tokens` is the tag's once it landed
    late_tag: bool = False
    # ok | client_error | engine_error | midstream_error | no_instance |
    # client_disconnected | refused (admission: the decision's `refused` says why)
    outcome: str | None = None
    # when the front door received the request (Unix time, s): lines the log up with
    # a client's send times and with other schedulers' logs
    received_unix_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "request": self.request,
            "endpoint": self.endpoint,
            "prompt_tokens": self.prompt_tokens,
            "predicted_output_tokens": self.predicted_output_tokens,
            "retries": self.retries,
            "tag_wait_us": self.tag_wait_us,
        }
        if self.decision is not None:
            d.update(self.decision.to_dict())
        for k in ("instance", "observed_ttft_s", "observed_e2e_s", "overhead_us", "outcome", "received_unix_s"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        if self.early_dispatch:
            d["early_dispatch"] = True
        if self.late_tag:
            d["late_tag"] = True
        return d


__all__ = [
    "MODALITIES", "OBJECTIVES", "CandidateRequest", "DecisionRecord", "DispatchDecision", "InstanceConfig",
    "InstanceLoad", "InstanceStatus", "LatencyEstimate", "RequestStatus",
]
