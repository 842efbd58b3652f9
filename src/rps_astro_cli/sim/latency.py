"""Memoized step-latency model over an `ExecutionProfile` (see `sim/profile.py` for the
formula and its sources)."""

from __future__ import annotations

from rps_astro_cli.sim.profile import ExecutionProfile


class LatencyModel:
    """Step latency in seconds, with the (batch size, token count) part memoized as in
    the Astrolabe paper (§4, "memoize batch latency per (batch size, token count)").

    The profile's shape term is separable, `(base + per_seq * batch_size) +
    linear(num_tokens)` (`ExecutionProfile.shape_s`), so the memo is two tables:
    `seq_s[b] = base + per_seq * b` and `tok_s[n] = linear(n)` (seconds), and
    `shape_s(b, n) = seq_s[b] + tok_s[n]`, bit-identical to the profile's formula. Hot
    loops call `reserve` once and then index the tables directly.
    """

    __slots__ = ("profile", "seq_s", "tok_s", "_dec", "_pre")

    def __init__(self, profile: ExecutionProfile):
        self.profile = profile
        self.seq_s: list[float] = []
        self.tok_s: list[float] = []
        self._dec = profile.decode_attn_s_per_ctx_token
        self._pre = profile.prefill_attn_s_per_token_pair

    def reserve(self, max_batch_size: int, max_num_tokens: int) -> None:
        """Fill the tables so `seq_s[b]` and `tok_s[n]` exist for every b ≤
        max_batch_size and n ≤ max_num_tokens (sequences, tokens; ≥ 0)."""
        p, seq, tok = self.profile, self.seq_s, self.tok_s
        for b in range(len(seq), max_batch_size + 1):
            seq.append(p.base_s + p.per_seq_s * b)
        for n in range(len(tok), max_num_tokens + 1):
            tok.append(p.linear_s(n))

    def shape_s(self, batch_size: int, num_tokens: int) -> float:
        """Memoized `base + per_seq * batch_size + linear(num_tokens)` (seconds)."""
        try:
            return self.seq_s[batch_size] + self.tok_s[num_tokens]
        except IndexError:
            self.reserve(max(batch_size, 2 * len(self.seq_s)), max(num_tokens, 2 * len(self.tok_s)))
            return self.seq_s[batch_size] + self.tok_s[num_tokens]

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
