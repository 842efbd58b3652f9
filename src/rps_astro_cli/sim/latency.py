"""Memoized step-latency model over an `ExecutionProfile` (see `sim/profile.py` for the
formula and its sources)."""

from __future__ import annotations

from rps_astro_cli.sim.profile import ExecutionProfile


class LatencyModel:
    """Step latency in seconds, with the (batch size, token count) part memoized as in
    the Astrolabe paper (§4, "memoize batch latency per (batch size, token count)")."""

    __slots__ = ("profile", "_memo", "_dec", "_pre")

    def __init__(self, profile: ExecutionProfile):
        self.profile = profile
        self._memo: dict[tuple[int, int], float] = {}
        self._dec = profile.decode_attn_s_per_ctx_token
        self._pre = profile.prefill_attn_s_per_token_pair

    def shape_s(self, batch_size: int, num_tokens: int) -> float:
        """Memoized `base + per_seq * batch_size + linear(num_tokens)` (seconds)."""
        key = (batch_size, num_tokens)
        v = self._memo.get(key)
        if v is None:
            v = self.profile.shape_s(batch_size, num_tokens)
            self._memo[key] = v
        return v

    def step_s(
        self,
        batch_size: int,
        num_tokens: int,
        decode_ctx_tokens: int,
        prefill_pairs: float,
        encoder_s: float = 0.0,
    ) -> float:
        """Latency of one step (seconds).

        batch_size: requests scheduled in the step; num_tokens: new tokens computed;
        decode_ctx_tokens: sum over decoding requests of the context each attends
        (tokens, including the new one); prefill_pairs: sum over prefill chunks of
        c*k + c*(c+1)/2; encoder_s: vision-encoder seconds charged to this step.
        """
        if batch_size == 0:
            return 0.0
        return (
            self.shape_s(batch_size, num_tokens)
            + self._dec * decode_ctx_tokens
            + self._pre * prefill_pairs
            + encoder_s
        )

    @staticmethod
    def prefill_pairs(chunk_tokens: int, computed_tokens: int) -> float:
        """Attention pairs of a chunk of `chunk_tokens` new tokens after
        `computed_tokens` already in the KV cache: c*k + c*(c+1)/2."""
        c = chunk_tokens
        return c * computed_tokens + c * (c + 1) / 2
