"""A virtual cluster's workload: `TimedRequest`s, and a minimal length-trace workload
(`read_length_trace` + `poisson_workload`; the bench builds richer ones)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rps_astro_cli.dispatch.admission import RequestSlo
from rps_astro_cli.errors import AstroUserError


@dataclass(frozen=True, slots=True)
class TimedRequest:
    """One request of a virtual workload.

    request_id: unique id. arrival_s: arrival at the dispatcher (virtual seconds).
    prompt_tokens: prompt length incl. vision tokens (tokens, ≥ 1).
    output_tokens: true output length; the engine generates exactly this many (≥ 1).
    predicted_output_tokens: what the dispatcher and Predictors see (tokens); None =
        the true length (oracle). Clipped to [1, max_model_len - prompt_tokens].
    modality: text / image / video. vision_tokens: tokens from media (included in
        prompt_tokens). encoder_s: vision-encoder seconds charged to the step holding
        its first prefill chunk. preprocess_s: CPU preprocessing seconds between
        dispatch and the engine queue. req_class: sand / pebbles / rocks or None.
    deadline_s: absolute deadline (virtual seconds) for deadline-aware policies, or None.
    token_ids: the prompt's token ids, then the reply's when known (a multi-turn replay
        knows them); None = unknown, no prefix caching for this request.
    session_id: the conversation it belongs to (None = none). follows: request_id of
        the previous turn; this one arrives `think_s` seconds after that one finishes.
        turn: its 0-based turn in the conversation (reporting only; the simulation
        reads `follows`).
    slo: its TTFT/TPOT targets and priority; with a TTFT target it is judged by
        `simulate_cluster`'s `admission` (None = today's behaviour).
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    predicted_output_tokens: int | None = None
    modality: str = "text"
    vision_tokens: int = 0
    encoder_s: float = 0.0
    preprocess_s: float = 0.0
    req_class: str | None = None
    deadline_s: float | None = None
    token_ids: tuple[int, ...] | None = None
    session_id: str | None = None
    follows: str | None = None
    think_s: float = 0.0
    slo: RequestSlo | None = None  # its SLO and priority (`dispatch.admission`); None = none
    turn: int = 0


# -- a minimal length-trace workload (the bench issue builds richer ones) ---------------
_PROMPT_COLS = ("num_prefill_tokens", "prompt_tokens", "ContextTokens", "Request tokens")
_OUTPUT_COLS = ("num_decode_tokens", "output_tokens", "GeneratedTokens", "Response tokens")


def read_length_trace(path: str | Path) -> np.ndarray:
    """(prompt_tokens, output_tokens) rows of a CSV length trace, shape (n, 2), int64.

    Accepts the Astrolabe/Vidur trace (`num_prefill_tokens,num_decode_tokens,...`), the
    Azure LLM inference trace (`ContextTokens,GeneratedTokens`), BurstGPT
    (`Request tokens,Response tokens`) or plain `prompt_tokens,output_tokens` headers.
    Rows with a non-positive prompt or output (e.g. BurstGPT failures) are dropped.

    Raises:
        AstroUserError: unreadable file, or no recognised prompt/output columns.
    """
    import csv

    p = Path(path)
    if not p.is_file():
        raise AstroUserError(f"no such trace file: {p}", field="--path")
    with p.open(newline="") as f:
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise AstroUserError(f"{p} is empty", field="--path") from None
        pc = next((header.index(c) for c in _PROMPT_COLS if c in header), None)
        oc = next((header.index(c) for c in _OUTPUT_COLS if c in header), None)
        if pc is None or oc is None:
            raise AstroUserError(
                f"{p}: no prompt/output token columns in header {header}", field="--path",
                fix=f"name them one of {_PROMPT_COLS} and {_OUTPUT_COLS}",
            )
        rows = []
        for n, row in enumerate(reader, start=2):
            try:
                a, b = int(float(row[pc])), int(float(row[oc]))
            except (ValueError, IndexError):
                raise AstroUserError(f"{p}:{n}: not a number in the token columns", field="--path") from None
            if a > 0 and b > 0:
                rows.append((a, b))
    if not rows:
        raise AstroUserError(f"{p}: no usable rows", field="--path")
    return np.asarray(rows, dtype=np.int64)


def poisson_workload(lengths: np.ndarray, num_requests: int, rate_per_s: float, max_model_len: int,
                     rng: np.random.Generator) -> list[TimedRequest]:
    """`num_requests` text requests cycling through `lengths` rows (those with prompt +
    output ≤ max_model_len, in file order) with Poisson arrivals at `rate_per_s`
    (exponential gaps from `rng`), oracle predicted lengths.

    Raises:
        AstroUserError: rate ≤ 0, num_requests < 1, or no row fits max_model_len.
    """
    if not rate_per_s > 0:
        raise AstroUserError(f"must be > 0, got {rate_per_s}", field="--request-rate")
    if num_requests < 1:
        raise AstroUserError(f"must be ≥ 1, got {num_requests}", field="--num-requests")
    fit = lengths[lengths.sum(axis=1) <= max_model_len]
    if len(fit) == 0:
        raise AstroUserError(f"no trace row fits max_model_len {max_model_len}", field="--path")
    rows = fit[np.arange(num_requests) % len(fit)]
    t = np.cumsum(rng.exponential(1.0 / rate_per_s, size=num_requests))
    return [TimedRequest(f"req-{i}", float(t[i]), int(p), int(o)) for i, (p, o) in enumerate(rows)]
