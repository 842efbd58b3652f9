"""Per-request state inside the instance model (mutable, slotted: the hot path)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request's state in an instance.

    Token fields are counts of tokens; times are seconds on the owning clock (engine
    wall clock, or virtual time).

    prompt_tokens: prompt length including vision tokens (tokens).
    target_output_tokens: the request ends when this many tokens are generated. The sim
        engine sets the true length; the Predictor sets the predicted length (with
        auto-extension applied).
    num_computed_tokens: tokens whose KV is computed (prefill progress; reset to 0 on
        preemption, since vLLM V1 preempts by recompute).
    num_generated_tokens: output tokens sampled so far (kept across preemption).
    kv_blocks: KV blocks currently held.
    encoder_s: vision-encoder time charged to the step holding the first prefill chunk
        (seconds; 0 for text). Charged again after a preemption (recompute).
    req_class: "sand" / "pebbles" / "rocks" when a classifier labelled it, else None.
    block_hashes: chained hashes of the sequence's known full KV blocks (the prompt's,
        and the reply's when the workload knows its token ids; `sim.prefix_cache.
        block_hashes`); () = none known, the request never hits or fills the prefix cache.
    cache_refs: hashes of the cached blocks this request holds (None = none); its other
        `kv_blocks` are private. hashed_blocks: leading full blocks already checked
        against the cache (hit or registered). num_cached_tokens: prompt tokens served
        from the prefix cache at its first admission (vLLM's per-request figure).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    target_output_tokens: int
    modality: str = "text"
    vision_tokens: int = 0
    encoder_s: float = 0.0
    req_class: str | None = None
    predicted_output_tokens: int | None = None
    deadline_s: float | None = None
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    kv_blocks: int = 0
    num_preemptions: int = 0
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    block_hashes: tuple[int, ...] = ()
    cache_refs: list[int] | None = None
    hashed_blocks: int = 0
    num_cached_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens in the sequence so far: prompt + generated (tokens)."""
        return self.prompt_tokens + self.num_generated_tokens

    @property
    def is_prefilling(self) -> bool:
        """True while part of the sequence (the prompt, or a recompute) is uncomputed
        beyond the single token a decode step feeds."""
        return self.num_tokens - self.num_computed_tokens > 1 or self.num_generated_tokens == 0

    @property
    def finished(self) -> bool:
        return self.num_generated_tokens >= self.target_output_tokens
