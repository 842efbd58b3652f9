"""`apply_step`: charge one step's latency and apply its outputs (the general loop's
steps; the FCFS loop inlines the same float operations)."""

from __future__ import annotations

from .instance_view import InstanceView
from .request import LReq


def apply_step(v: InstanceView, t: float, sched: list[tuple[LReq, int, int]], B: int, free: int,
               num_tokens: int, decode_pool: bool) -> float:
    """Charge a step's latency and apply its outputs; returns its seconds. `sched` lists
    the explicit (non-pooled) requests (request, new tokens, new blocks); the pool's `B`
    members ride along when `decode_pool`; `free` blocks are left once it is scheduled."""
    bs, pool = v.bs, v.pool
    dctx = pool.ctx_tokens if decode_pool else 0
    pairs = 0.0
    enc = 0.0
    for r, n, _nb in sched:
        k = r.num_computed_tokens
        g = r.num_generated_tokens
        if n == 1 and g > 0 and r.prompt_tokens + g - k == 1:
            dctx += k + 1
        else:
            pairs += n * k + n * (n + 1) / 2  # LatencyModel.prefill_pairs
            if k == 0 and r.encoder_s:
                enc += r.encoder_s
    nb_sched = B + len(sched) if decode_pool else len(sched)
    # LatencyModel.step_s, same float operations in the same order
    seq_s, tok_s = v.seq_s, v.tok_s
    if nb_sched < len(seq_s) and num_tokens < len(tok_s):  # (the tables `LatencyModel.shape_s` reads)
        a = seq_s[nb_sched] + tok_s[num_tokens]
    else:
        a = v.latency.shape_s(nb_sched, num_tokens)
    dur = a + v.dec * dctx + v.pre * pairs + enc
    end = t + dur
    v.free = free
    if decode_pool:
        pool.tick += 1
        pool.ctx_tokens += B
    nondec = v.explicit
    for r, n, nb in sched:
        r.kv_blocks += nb
        c = r.num_computed_tokens = r.num_computed_tokens + n
        if c >= r.prompt_tokens + r.num_generated_tokens:
            g = r.num_generated_tokens = r.num_generated_tokens + 1
            if r.first_token_s is None:
                r.first_token_s = end
            if g >= r.target_output_tokens:
                nondec.remove(r)
                r.finish_s = end
                v.running.remove(r)
                v.free += r.kv_blocks
                r.kv_blocks = 0
            elif r.kv_blocks == -(-c // bs):
                nondec.remove(r)
                pool.join(r)
            # else: holds more blocks than its tokens need (a snapshot taken with
            # look-ahead slots): it stays explicit, stepped one token at a time
    if decode_pool and pool.finishes and pool.finishes[0][0] < pool.tick:
        v.free += pool.pop_due(end, v.running)
    return dur
