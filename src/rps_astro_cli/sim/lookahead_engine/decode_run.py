"""A pure decode run of the pool, in closed form.

Between events the instance runs pure decode steps: step j of a run takes
shape_s(B, B) + decode_attn * (S + j*B) seconds (B members, S their context summed,
growing by B per step), an arithmetic series. A run ends at the first member's finish,
at the step whose block allocation would fail (found from the pool's per-residue
counts), or when the clock reaches the next queue arrival.
"""

from __future__ import annotations

import math

from rps_astro_cli.sim.latency import LatencyModel

from .pool import DecodePool
from .request import MAX_LOOKAHEAD_STEPS


class DecodeRun:
    """The length of the next pure decode run (`plan`), reused across runs."""

    def __init__(self, latency: LatencyModel) -> None:
        #: the step-latency model (its memoized `shape_s`)
        self.latency = latency
        #: seconds of decode attention per context token
        self.dec = latency._dec
        #: steps in the run
        self.steps = 0
        #: shape_s(B, B) of each of its steps (seconds)
        self.shape_s = 0.0
        #: KV blocks its steps allocate
        self.blocks = 0
        #: True when the step after the run would run out of KV blocks
        self.exhausted = False

    def plan(self, pool: DecodePool, t: float, G: int, S: int, B: int, free: int, last_tick: int,
             added: bool, arrival: float) -> None:
        """Size a run of the pool's B members (context sum S) from tick G (the caller's
        current values; the pool gives its residue counts) at clock `t`, `free` blocks:
        up to the first finish (`last_tick` = its last tick), until the clock reaches
        `arrival` (when not yet `added`), and no further than the last step whose block
        allocations fit `free`. The run takes n*a + dec*(n*S + B*n(n-1)/2) seconds (n =
        `steps`, a = `shape_s`; the caller adds it)."""
        bs, cnt2 = pool.block_size, pool.residue_counts
        n = last_tick - G + 1
        a = self.latency.shape_s(B, B)
        dec = self.dec
        if not added and t + n * a + dec * (n * S + B * (n * (n - 1) // 2)) >= arrival:
            k = steps_to_reach(arrival - t, a, dec, S, B)
            if k < n:
                n = k
        self.shape_s = a
        r0 = G % bs
        q = n // bs
        need = q * B
        for j in range(r0, r0 + n - q * bs):  # (a loop, not sum(slice): no list built)
            need += cnt2[j]
        if need <= free:
            self.steps, self.blocks, self.exhausted = n, need, False
            return
        # the last step whose allocations fit: q whole periods of bs ticks (B blocks
        # each), then residues while the running need stays within what is left
        q = free // B
        rem = free - q * B
        acc = 0
        i = r0
        while True:
            acc += cnt2[i]
            if acc > rem:
                break
            i += 1
        self.steps, self.blocks, self.exhausted = q * bs + i - r0, q * B + acc - cnt2[i], True


def _elapsed(k: int, a: float, dec: float, S: int, B: int) -> float:
    """Seconds of the first k steps of a decode run (see the module docstring)."""
    return k * a + dec * (k * S + B * (k * (k - 1) // 2))


def steps_to_reach(gap_s: float, a: float, dec: float, S: int, B: int) -> int:
    """Smallest k ≥ 1 with k*a + dec*(k*S + B*k*(k-1)/2) ≥ gap_s (steps of a pure
    decode run until the clock reaches `gap_s` ahead)."""
    first = a + dec * S
    if first <= 0.0:
        return MAX_LOOKAHEAD_STEPS
    qa = dec * B / 2.0
    qb = first - qa
    if qa > 0.0:
        x = (-qb + math.sqrt(qb * qb + 4.0 * qa * gap_s)) / (2.0 * qa)
    else:
        x = gap_s / qb
    k = max(1, int(math.ceil(x)))
    while k > 1 and _elapsed(k - 1, a, dec, S, B) >= gap_s:
        k -= 1
    while _elapsed(k, a, dec, S, B) < gap_s:
        k += 1
    return k
