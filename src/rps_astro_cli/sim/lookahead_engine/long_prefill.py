"""A long prefill beside the decode pool, under FCFS with chunked prefill: the hot path
under KV pressure (the prefill X is admitted, continues with partial chunks, is
preempted and readmitted while the pool's members finish around it)."""

from __future__ import annotations

from .instance_view import InstanceView
from .loop_state import LoopState
from .request import LReq


def long_prefill_run(v: InstanceView, lp: LoopState, x: LReq, x_in: bool) -> bool:
    """Steps of the long prefill `x` beside the pool, one tick at a time with O(1) work
    each. X's prompt (or recompute) is longer than the budget the members leave, so
    every step here schedules exactly: the members plus X's next chunk of `room` tokens
    (X running at the tail, `x_in`), or the members alone after preempting X (FCFS
    victim = the last running request = X; X returns to the queue head with nothing
    computed), or X's admission from the queue head with a first chunk of `room`
    tokens (the budget is then spent: nothing else is admitted). Members that finish
    leave the pool at the end of their step, as `DecodePool.pop_due` does.

    Stops, with the state consistent for the FCFS loop, before a step that is anything
    else: X's final chunk, X blocked at the queue head, a preemption that must also take
    members, an empty pool, or a full `max_num_seqs`; and after the candidate finishes.
    Float operations per step are those of `apply.apply_step`.

    Returns True when it ran a step (each counts as a step and an event of `lp`)."""
    pool = v.pool
    run, waiting, nondec, heap, cnt2 = v.running, v.waiting, v.explicit, pool.finishes, pool.residue_counts
    tick, ctx, members, free = pool.tick, pool.ctx_tokens, pool.size, v.free
    bs, max_tokens, maxs = v.bs, v.token_budget, v.max_seqs
    seq_s, tok_s, dec, pre = v.seq_s, v.tok_s, v.dec, v.pre
    cand = lp.cand
    t = lp.t
    xt = x.prompt_tokens + x.num_generated_tokens
    xc = x.num_computed_tokens
    xkv = x.kv_blocks
    x_enc = x.encoder_s
    steps = 0
    while members:
        room = max_tokens - members
        n_t = cnt2[tick % bs]
        if x_in:
            if xt - xc <= room:
                break  # X's final chunk: completes its prefill (general step)
            xk = -(-(xc + room) // bs) - xkv
            if xk < 0:
                xk = 0
            if n_t + xk <= free:  # continue X's prefill
                free -= n_t + xk
                a = seq_s[members + 1] + tok_s[max_tokens]  # members + room = max_tokens tokens
                enc = 0.0
                if xc == 0 and x_enc:
                    enc += x_enc
                t += a + dec * ctx + pre * (0.0 + (room * xc + room * (room + 1) / 2)) + enc
                xc += room
                xkv += xk
            else:  # out of blocks: X (the last running request) is the first victim
                if n_t > free + xkv:
                    break  # members must go too (general step)
                free += xkv - n_t
                run.pop()
                nondec.pop()
                x.num_computed_tokens = xc = 0
                x.kv_blocks = xkv = 0
                x.num_preemptions += 1
                waiting.insert(0, x)
                x_in = False
                t += seq_s[members] + tok_s[members] + dec * ctx + pre * 0.0 + 0.0
        else:  # X at the queue head with nothing computed: admit it with `room` tokens
            if members >= maxs:
                break
            xk = -(-room // bs)
            if n_t + xk > free:
                break  # blocked: the FCFS loop jumps the pool
            free -= n_t + xk
            del waiting[0]
            run.append(x)
            nondec.append(x)
            x_in = True
            a = seq_s[members + 1] + tok_s[max_tokens]
            enc = 0.0
            if x_enc:
                enc += x_enc
            t += a + dec * ctx + pre * (0.0 + (room * 0 + room * (room + 1) / 2)) + enc
            xc = room
            xkv = xk
        tick += 1
        ctx += members
        steps += 1
        if heap[0][0] < tick:
            pool.tick, pool.ctx_tokens, pool.size = tick, ctx, members
            free += pool.pop_due(t, run)
            ctx, members = pool.ctx_tokens, pool.size
            if cand.finish_s is not None:
                break
    if x_in:
        x.num_computed_tokens = xc
        x.kv_blocks = xkv
    pool.tick, pool.ctx_tokens, pool.size, v.free = tick, ctx, members, free
    lp.t = t
    lp.steps += steps
    lp.events += steps
    return steps > 0
