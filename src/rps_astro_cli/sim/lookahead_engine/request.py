"""The look-ahead's request (`LReq`) and its builders from snapshots and `SimRequest`s."""

from __future__ import annotations

from typing import Any, Final, cast

from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.types import RequestStatus

CANDIDATE_ID: Final = "__candidate__"
MAX_LOOKAHEAD_STEPS: Final = 2_000_000


class LReq:
    """A look-ahead request: the fields of `SimRequest` (same names, order and units;
    `InstanceSim` and the instance policies read and step it as one) plus the tick it
    joined the decode pool (`pool_g`, -1 = not pooled; its token/block fields are then
    current), the sequence number of its live heap entry (`pool_seq`), its policy
    sort keys (`okey`, `vkey`, see `InstancePolicy.order_key` / `victim_key`), and, under
    a policy with `order_merge_key`, its group's index (`grp`) and a number that orders
    the queue as its list does (`qpos`; see `InstanceView.merged`), and under one with
    `victim_groups` its victim group's index (`vgrp`).

    A class of its own rather than a `SimRequest` subclass so that mypyc can compile it
    (a compiled class cannot extend an interpreted one); tests/test_lookahead.py checks
    that the fields match."""

    __slots__ = (
        "request_id", "arrival_s", "prompt_tokens", "target_output_tokens", "modality",
        "vision_tokens", "encoder_s", "req_class", "predicted_output_tokens", "deadline_s",
        "num_computed_tokens", "num_generated_tokens", "kv_blocks", "num_preemptions",
        "first_scheduled_s", "first_token_s", "finish_s", "pool_g", "pool_seq", "okey", "vkey",
        "grp", "qpos", "vgrp",
    )

    def __init__(self, request_id: str, arrival_s: float, prompt_tokens: int, target_output_tokens: int,
                 modality: str = "text", vision_tokens: int = 0, encoder_s: float = 0.0,
                 req_class: str | None = None, predicted_output_tokens: int | None = None,
                 deadline_s: float | None = None, num_computed_tokens: int = 0,
                 num_generated_tokens: int = 0, kv_blocks: int = 0) -> None:
        self.request_id = request_id
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.target_output_tokens = target_output_tokens
        self.modality = modality
        self.vision_tokens = vision_tokens
        self.encoder_s = encoder_s
        self.req_class = req_class
        self.predicted_output_tokens = predicted_output_tokens
        self.deadline_s = deadline_s
        self.num_computed_tokens = num_computed_tokens
        self.num_generated_tokens = num_generated_tokens
        self.kv_blocks = kv_blocks
        self.num_preemptions = 0
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.pool_g = -1
        self.pool_seq = 0
        self.okey: Any = None  # the policy's `order_key` / `victim_key` values, when it has them
        self.vkey: Any = None  # (`victim_groups`: the key inside its group)
        self.grp = -1  # index of its `order_groups` group in `InstanceView.groups` (merged queues)
        self.qpos = 0  # queue position number: smaller = nearer the front (merged queues)
        self.vgrp = -1  # index of its `victim_groups` group (`InstanceView.vgroup_count`)

    @property
    def num_tokens(self) -> int:
        """Tokens in the sequence so far: prompt + generated (tokens)."""
        return self.prompt_tokens + self.num_generated_tokens

    @property
    def is_prefilling(self) -> bool:
        """As `SimRequest.is_prefilling`."""
        return self.num_tokens - self.num_computed_tokens > 1 or self.num_generated_tokens == 0

    @property
    def finished(self) -> bool:
        return self.num_generated_tokens >= self.target_output_tokens


def expected_tokens(predicted: int | None, generated: int, extension_tokens: int, default_output_tokens: int) -> int:
    """Output length the look-ahead assumes for a queued/running request (tokens): its
    predicted length (`default_output_tokens` when None/0), or `generated +
    extension_tokens` once generation has reached it (Astrolabe §4 auto-extension)."""
    pred = predicted if predicted else default_output_tokens
    if generated >= pred:
        return generated + extension_tokens
    return pred


def lreqs_from_status(reqs: Any, ext: int, dflt: int) -> list[LReq]:
    """`RequestStatus`es (a snapshot's running or waiting list) as look-ahead requests
    whose target is the expected output length; a request not yet admitted (no blocks,
    nothing computed) starts past its prefix-cache hit `cached_tokens` (at least one
    token left to compute)."""
    out: list[LReq] = []
    for r0 in reqs:
        r = cast(RequestStatus, r0)
        g = r.generated_tokens
        c = r.num_computed_tokens
        kv = r.kv_blocks
        hit = r.cached_tokens
        if hit > 0 and kv == 0 and c == 0:
            c = min(hit, r.prompt_tokens + g - 1)
        out.append(LReq(
            r.request_id, r.arrival_s, r.prompt_tokens, expected_tokens(r.predicted_output_tokens, g, ext, dflt),
            r.modality, r.vision_tokens, r.encoder_s, r.req_class, r.predicted_output_tokens, r.deadline_s,
            c, g, kv,
        ))
    return out


def lreqs_from_sim(reqs: Any, ext: int, dflt: int) -> list[LReq]:
    """`SimRequest`s (an `InstanceSim`'s running or waiting list) as look-ahead requests
    whose target is the expected output length (never the true one)."""
    out: list[LReq] = []
    for r0 in reqs:
        r = cast(SimRequest, r0)
        g = r.num_generated_tokens
        out.append(LReq(
            r.request_id, r.arrival_s, r.prompt_tokens, expected_tokens(r.predicted_output_tokens, g, ext, dflt),
            r.modality, r.vision_tokens, r.encoder_s, r.req_class, r.predicted_output_tokens, r.deadline_s,
            r.num_computed_tokens, g, r.kv_blocks,
        ))
    return out


def lreq_candidate(c: SimRequest) -> LReq:
    """The candidate (`lookahead.candidate_to_sim`) as a look-ahead request."""
    return LReq(
        c.request_id, c.arrival_s, c.prompt_tokens, c.target_output_tokens, c.modality,
        c.vision_tokens, c.encoder_s, c.req_class, c.predicted_output_tokens, c.deadline_s,
        c.num_computed_tokens,
    )


def next_chunk(r: LReq, budget: int, bs: int) -> tuple[int, int]:
    """The tokens an unpooled request computes next under a `budget` of tokens and the
    KV blocks they newly need: (min(uncomputed, budget), max(0, ceil((computed + n) /
    bs) - held blocks)), as vLLM V1's chunked-prefill running/waiting passes size them."""
    c = r.num_computed_tokens
    n = r.prompt_tokens + r.num_generated_tokens - c
    if n > budget:
        n = budget
    nb = -(-(c + n) // bs) - r.kv_blocks
    return n, (nb if nb > 0 else 0)
