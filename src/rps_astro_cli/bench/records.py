"""One row per request, the same for live and virtual runs (`requests.jsonl`).

Times are seconds on the bench's clock, measured from the start of the run (live: the
client's monotonic clock; virtual: the simulation's clock). Metric formulas are in
`metrics.py` and `docs/metrics.md`; the per-request ones are properties here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """What happened to one request.

    request_id / modality: from the workload.
    req_class: class used for per-class metrics: the engine-reported class when known
        (`class_source = "engine"`: an `x-astro-class` response header, the class astro's
        engines show for the request in `/status` while it runs, or the class the virtual
        cluster's instance policy used), else by modality (text → sand, image → pebbles,
        video → rocks; `class_source = "modality"`).
    prompt_tokens: prompt tokens (the server's `usage.prompt_tokens` when reported, else
        the bench's count; includes vision tokens in virtual runs).
    output_tokens: tokens actually received (`usage.completion_tokens` when reported,
        else counted from the text — `output_tokens_source` says which).
    expected_output_tokens: the workload's reference reply length (tokens).
    predicted_output_tokens: the length tagger's prediction when known (tokens).
    scheduled_s: planned send time. sent_s: actual send time (later than scheduled when
        `--max-concurrency` made it wait). first_token_s: arrival of the first chunk that
        carries content. finish_s: arrival of the last content chunk (stream end when no
        content came, or when the request failed).
    itl_s: gaps between consecutive content chunks (s); empty when unknown (virtual runs).
    success / error: failed requests keep their error text and are kept apart in metrics.
    instance: the instance that served it (`x-astro-instance`), when known.
    server_request_id: the response's `id` (the engine's request id), when sent.
    preemptions: times it was preempted (virtual runs; None when unknown).
    predicted_ttft_s / predicted_e2e_s: the dispatcher's prediction for the chosen
        instance, when known (for the predictor-error metric).
    isolated_e2e_s: E2E when alone on an instance (for relative SLOs), when computed.
    engine_arrival_s: when the engine stamped the request's arrival, i.e. the start of its
        own input processing (vLLM's `arrival_time`), on the bench's clock; after `sent_s`
        when it waited for the front end (another request's preprocessing). None when
        unknown (live runs).
    """

    request_id: str
    modality: str = "text"
    req_class: str = "sand"
    class_source: str = "modality"
    prompt_tokens: int = 0
    output_tokens: int = 0
    output_tokens_source: str = "usage"
    expected_output_tokens: int = 0
    predicted_output_tokens: int | None = None
    scheduled_s: float = 0.0
    sent_s: float = 0.0
    first_token_s: float | None = None
    finish_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    success: bool = False
    error: str | None = None
    instance: str | None = None
    server_request_id: str | None = None
    preemptions: int | None = None
    predicted_ttft_s: float | None = None
    predicted_e2e_s: float | None = None
    isolated_e2e_s: float | None = None
    finish_reason: str | None = None  # the stream's last finish_reason ("stop", "length", ...), when sent
    max_tokens: int | None = None  # the max_tokens the request asked for (None: not sent)
    engine_arrival_s: float | None = None
    # its per-request SLO class (`--slo-class`, sent as x-slo-class / x-slo-* headers) and
    # targets (s), None without one; refused: the scheduler refused it at admission (HTTP
    # 429 live; `refused` in the virtual cluster): not a success, counted apart from errors
    slo_class: str | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    refused: bool = False

    @property
    def meets_request_slo(self) -> bool | None:
        """Whether it met its own SLO class's targets (succeeded, TTFT ≤ slo_ttft_s, TPOT ≤
        slo_tpot_s where defined); None without a class."""
        if self.slo_class is None:
            return None
        if not self.success:
            return False
        t, p = self.ttft_s, self.tpot_s
        return not ((self.slo_ttft_s is not None and (t is None or t > self.slo_ttft_s))
                    or (self.slo_tpot_s is not None and p is not None and p > self.slo_tpot_s))

    @property
    def truncated(self) -> bool:
        """Ended by length before its `max_tokens` (e.g. cut at the model's context limit):
        shorter than asked."""
        return (self.success and self.finish_reason == "length" and self.max_tokens is not None
                and self.output_tokens < self.max_tokens)

    # -- per-request metrics (formulas: docs/metrics.md) ------------------------------------
    @property
    def ttft_s(self) -> float | None:
        """TTFT = first_token_s − sent_s; None without a content chunk or on failure."""
        if not self.success or self.first_token_s is None:
            return None
        return self.first_token_s - self.sent_s

    @property
    def ttft_harness_s(self) -> float | None:
        """TTFT as the RPS-Serve authors' harness counts it = first_token_s −
        engine_arrival_s: the request's own input processing + engine queue + first
        scheduling to first token, without waiting behind other requests' preprocessing
        (docs/metrics.md). None when the engine arrival is unknown or on failure."""
        if not self.success or self.first_token_s is None or self.engine_arrival_s is None:
            return None
        return self.first_token_s - self.engine_arrival_s

    @property
    def e2e_s(self) -> float | None:
        """E2E = finish_s − sent_s; None on failure."""
        if not self.success or self.finish_s is None:
            return None
        return self.finish_s - self.sent_s

    @property
    def tpot_s(self) -> float | None:
        """TPOT = (E2E − TTFT) / (n − 1), only for n = output_tokens ≥ 2."""
        e, t = self.e2e_s, self.ttft_s
        if e is None or t is None or self.output_tokens < 2:
            return None
        return (e - t) / (self.output_tokens - 1)

    @property
    def normalized_s_per_token(self) -> float | None:
        """Normalized latency = E2E / n, only for n ≥ 1 (s/token)."""
        e = self.e2e_s
        if e is None or self.output_tokens < 1:
            return None
        return e / self.output_tokens

    def value(self, metric: str) -> float | None:
        """Per-request value of `ttft`, `tpot`, `e2el` or `nlat` (seconds / s per token)."""
        return {"ttft": self.ttft_s, "tpot": self.tpot_s, "e2el": self.e2e_s,
                "nlat": self.normalized_s_per_token}[metric]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ttft_s=self.ttft_s, ttft_harness_s=self.ttft_harness_s, e2e_s=self.e2e_s, tpot_s=self.tpot_s,
                 truncated=self.truncated, normalized_s_per_token=self.normalized_s_per_token)
        return d
