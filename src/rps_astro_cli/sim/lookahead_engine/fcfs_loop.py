"""The FCFS chunked-prefill event loop: the hot path of `predict` (vLLM's default
scheduler), with the loop's state in local variables."""

from __future__ import annotations

import heapq

from .apply import apply_step
from .blocked_run import blocked_run
from .instance_view import InstanceView
from .long_prefill import long_prefill_run
from .loop_state import LoopState
from .request import MAX_LOOKAHEAD_STEPS, LReq


def fcfs_chunked_loop(v: InstanceView, lp: LoopState) -> int:
    """Advance `lp` under FCFS with chunked prefill while the instance keeps the layout
    vLLM keeps under FCFS — the pool's members followed by at most one partial prefill
    X at the tail — through every step that layout produces: jumps over pure decode runs
    (closed form, `blocked_run`), steps that continue X and/or admit waiting requests
    (completed prefills join the pool), long prefills beside the pool (`long_prefill_run`),
    and preemption by peeling FCFS victims off the tail (see
    `preemption.fcfs_preempt_tail`). Anything else returns to the general loop for one
    step. Each ordinary step is `apply.apply_step` (one definition of a step's latency
    and outputs for both loops).

    Returns the events it ran (0: none; the general loop runs the next step). The
    candidate's `finish_s` is set when it finished."""
    pool = v.pool
    run, waiting, nondec, heap, cnt2 = v.running, v.waiting, v.explicit, pool.finishes, pool.residue_counts
    # the loop's state, in locals: pool tick, context sum, members; free KV blocks
    tick, ctx, members, free = pool.tick, pool.ctx_tokens, pool.size, v.free
    bs, max_tokens, maxs = v.bs, v.token_budget, v.max_seqs
    seq_s, tok_s, dec, pre = v.seq_s, v.tok_s, v.dec, v.pre
    cand = lp.cand
    t, arrival, added = lp.t, lp.arrival, lp.added
    heappop = heapq.heappop
    seq = pool.seq
    steps = steps0 = lp.steps
    events = events0 = lp.events
    done = False
    while steps - steps0 <= MAX_LOOKAHEAD_STEPS:
        if not added and t >= arrival:
            lp.arrive(v, t)
            arrival, added = lp.arrival, lp.added
        room = max_tokens - members
        if members == 0 or room < 0:
            break
        x: LReq | None = None
        if nondec:
            if len(nondec) != 1 or len(run) != members + 1:
                break
            x = nondec[0]
            if run[-1] is not x:
                break
        while True:  # drop stale heap tops (entries of preempted requests)
            top = heap[0]
            r = top[2]
            if r.pool_seq == top[1] and r.pool_g >= 0:
                break
            heappop(heap)
        n_t = cnt2[tick % bs]
        sub = 0  # which sub-loop takes over: 1 blocked run, 2 long prefill at the head, 3 X continues
        long_x = x  # the long prefill of sub-loops 2 and 3
        # ---- jump over a pure decode run while the queue head cannot be admitted ----
        if x is None:
            if not waiting or members >= maxs or room == 0:
                blocked = True
            else:
                h = waiting[0]
                hc = h.num_computed_tokens
                hn = h.prompt_tokens + h.num_generated_tokens - hc
                if hn > room:
                    hn = room
                hk = -(-(hc + hn) // bs) - h.kv_blocks
                blocked = hk > 0 and hk > free - n_t
            if blocked:
                sub = 1  # jumps, finishes and preemptions until the head can be admitted
            elif hc == 0 and h.kv_blocks == 0 and h.prompt_tokens + h.num_generated_tokens > room:
                # the head's prompt (or recompute) is longer than the budget: its
                # admit / continue / preempt cycles tick by tick (see `long_prefill_run`)
                sub = 2
                long_x = h
        elif x.prompt_tokens + x.num_generated_tokens - x.num_computed_tokens > room:
            sub = 3  # X continues with a partial chunk (see `long_prefill_run`)
        if sub:
            pool.tick, pool.ctx_tokens, pool.size, v.free, pool.seq = tick, ctx, members, free, seq
            lp.t, lp.arrival, lp.added, lp.steps, lp.events = t, arrival, added, steps, events
            if sub == 1:
                blocked_run(v, lp)
                ran = True
            else:
                assert long_x is not None
                ran = long_prefill_run(v, lp, long_x, sub == 3)
            tick, ctx, members, free, seq = pool.tick, pool.ctx_tokens, pool.size, v.free, pool.seq
            t, arrival, added, steps, events = lp.t, lp.arrival, lp.added, lp.steps, lp.events
            if ran:
                if cand.finish_s is not None:
                    done = True
                    break
                continue
        # ---- one step: decoders, then X's next chunk ----
        need = n_t
        xn = xk = 0
        if x is not None:
            xc = x.num_computed_tokens
            xn = x.prompt_tokens + x.num_generated_tokens - xc
            if xn > room:
                xn = room
            if xn > 0:
                xk = -(-(xc + xn) // bs) - x.kv_blocks
                if xk < 0:
                    xk = 0
            need += xk
        if need > free:
            # out of blocks: FCFS preempts the last running request until the
            # longest prefix whose needs fit (plus the victims' blocks) remains
            e = len(run)
            need_kept = need
            free_x = free
            if x is not None:
                e -= 1  # X is the last running request: always a victim
                need_kept -= xk
                free_x += x.kv_blocks
            pool.tick = tick
            e, need_kept, free_x = pool.peel(run, e, need_kept, free_x)
            # `preemption.evict_tail` then `apply_step` of the survivors, inlined
            pool.ctx_tokens, pool.size = ctx, members
            pool.evict_tail(run, e, nondec, waiting)
            ctx, members = pool.ctx_tokens, pool.size
            free = free_x - need_kept
            events += 1
            if members == 0:
                continue  # only preempted: no time passes
            t += seq_s[members] + tok_s[members] + dec * ctx + pre * 0.0 + 0.0
            tick += 1
            ctx += members
            steps += 1
            if heap[0][0] < tick:
                pool.tick, pool.ctx_tokens, pool.size = tick, ctx, members
                free += pool.pop_due(t, run)
                ctx, members = pool.ctx_tokens, pool.size
                if cand.finish_s is not None:
                    done = True
                    break
            continue
        free -= need
        sched: list[tuple[LReq, int, int]] = []
        budget = room
        if x is not None and xn > 0:
            sched.append((x, xn, xk))
            budget -= xn
        if waiting and budget > 0:
            nrun = len(run)
            nw = len(waiting)
            i = 0
            while i < nw and nrun < maxs and budget > 0:
                h = waiting[i]
                hc = h.num_computed_tokens
                hn = h.prompt_tokens + h.num_generated_tokens - hc
                if hn > budget:
                    hn = budget
                hk = -(-(hc + hn) // bs) - h.kv_blocks
                if hk > 0:
                    if hk > free:
                        break
                    free -= hk
                else:
                    hk = 0
                sched.append((h, hn, hk))
                budget -= hn
                nrun += 1
                i += 1
            if i:
                adm = waiting[:i]
                del waiting[:i]
                run.extend(adm)
                nondec.extend(adm)
        pool.tick, pool.ctx_tokens, pool.size, pool.seq = tick, ctx, members, seq
        t += apply_step(v, t, sched, members, free, max_tokens - budget, True)
        tick, ctx, members, free, seq = pool.tick, pool.ctx_tokens, pool.size, v.free, pool.seq
        steps += 1
        events += 1
        done = cand.finish_s is not None
        if done:
            break
    pool.tick, pool.ctx_tokens, pool.size, v.free, pool.seq = tick, ctx, members, free, seq
    lp.t, lp.arrival, lp.added, lp.steps, lp.events = t, arrival, added, steps, events
    return events - events0
