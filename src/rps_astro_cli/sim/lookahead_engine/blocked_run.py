"""The blocked regime of the FCFS loop: every running request is a pool member and the
queue head cannot be admitted (or the queue is empty, or `max_num_seqs` is reached)."""

from __future__ import annotations

from .instance_view import InstanceView
from .loop_state import LoopState


def blocked_run(v: InstanceView, lp: LoopState) -> None:
    """Advance `lp` through the blocked regime. Repeats, with the loop's state in locals:
    a closed-form jump of the pool (`DecodeRun.plan`) to the next member's finish, to
    the next queue arrival, or to the last step whose block allocations fit; then the
    finishes (`DecodePool.pop_due`) or the preemption of the step that runs out of
    blocks (FCFS: peel victims off the tail until the survivors' needs fit,
    `DecodePool.peel`; they join the queue head in running order and the survivors
    decode one step).

    Stops, with the state consistent for the FCFS loop, when the queue head becomes
    admissible, the pool empties, or the candidate finishes. Float operations are those
    of the FCFS loop's jump and preemption step."""
    pool, plan = v.pool, v.decode_run
    run, waiting, heap, cnt2 = v.running, v.waiting, pool.finishes, pool.residue_counts
    tick, ctx, members, free = pool.tick, pool.ctx_tokens, pool.size, v.free
    bs, max_tokens, maxs = v.bs, v.token_budget, v.max_seqs
    seq_s, tok_s, dec, pre = v.seq_s, v.tok_s, v.dec, v.pre
    cand = lp.cand
    t, arrival, added = lp.t, lp.arrival, lp.added
    steps, events = lp.steps, lp.events
    while True:
        top = pool.top()
        pop = False
        if cnt2[tick % bs] <= free:  # (else the very next step runs out of blocks: no jump)
            plan.plan(pool, t, tick, ctx, members, free, top[0], added, arrival)
            n, a = plan.steps, plan.shape_s
            exhausted = plan.exhausted
            t += n * a + dec * (n * ctx + members * (n * (n - 1) // 2))
            tick += n
            ctx += n * members
            free -= plan.blocks
            steps += n
            events += 1
            pop = heap[0][0] < tick
        else:
            exhausted = True
        if exhausted and not pop:
            # ---- the step that runs out of blocks: FCFS preemption ----
            pool.tick, pool.ctx_tokens, pool.size = tick, ctx, members
            e, need, free = pool.peel(run, members, cnt2[tick % bs], free)
            pool.evict_tail(run, e, v.explicit, waiting)
            ctx, members = pool.ctx_tokens, pool.size
            free -= need
            events += 1
            if members == 0:
                break  # only preempted: no time passes
            t += seq_s[members] + tok_s[members] + dec * ctx + pre * 0.0 + 0.0
            tick += 1
            ctx += members
            steps += 1
            pop = heap[0][0] < tick
        if pop:
            pool.tick, pool.ctx_tokens, pool.size = tick, ctx, members
            free += pool.pop_due(t, run)
            ctx, members = pool.ctx_tokens, pool.size
            if cand.finish_s is not None or members == 0:
                break
        if not added and t >= arrival:
            lp.arrive(v, t)
            arrival, added = lp.arrival, lp.added
        # ---- still blocked? (the FCFS loop's admission test) ----
        room = max_tokens - members
        if waiting and members < maxs and room > 0:
            h = waiting[0]
            hc = h.num_computed_tokens
            hn = h.prompt_tokens + h.num_generated_tokens - hc
            if hn > room:
                hn = room
            hk = -(-(hc + hn) // bs) - h.kv_blocks
            if hk <= 0 or hk <= free - cnt2[tick % bs]:
                break
    pool.tick, pool.ctx_tokens, pool.size, v.free = tick, ctx, members, free
    lp.t, lp.arrival, lp.added, lp.steps, lp.events = t, arrival, added, steps, events
