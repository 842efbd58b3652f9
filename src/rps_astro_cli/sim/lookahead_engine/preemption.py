"""Steps of the general loop whose running pass runs out of KV blocks: under any policy
(`policy_preempt_chunked`) and under FCFS, whose victims are a suffix of the running list
(`fcfs_preempt_step`, `fcfs_preempt_tail`, `evict_tail`). vLLM V1 preempts by recompute
and admits nothing in a step that preempted."""

from __future__ import annotations

from typing import Any

from .apply import apply_step
from .instance_view import InstanceView
from .outcome import StepOutcome
from .request import MAX_LOOKAHEAD_STEPS, LReq, next_chunk


def _current(v: InstanceView, r: LReq, scheduled: bool) -> None:
    """Bring a pool member's token fields up to the pool's tick (it re-joins there, same
    residue), with its KV blocks as they stand in the step being formed: one more token's
    worth when it is already `scheduled` in it. Other requests are left as they are."""
    pg = r.pool_g
    if pg >= 0:
        G = v.pool.tick
        if pg != G:
            d = G - pg
            r.num_computed_tokens += d
            r.num_generated_tokens += d
            r.pool_g = G
        c = r.num_computed_tokens + 1 if scheduled else r.num_computed_tokens
        r.kv_blocks = -(-c // v.bs)


def _victim(v: InstanceView, run: list[LReq], t: float, i: int) -> tuple[LReq, int]:
    """The policy's preemption victim among `run` and its index; run[:i] are already
    scheduled in the step being formed. The policy sees current fields."""
    if v.vkeyed:  # the largest (vkey, index), without calling the policy
        vidx = 0
        vk = run[0].vkey
        for j in range(1, len(run)):
            kj = run[j].vkey
            if not kj < vk:
                vidx = j
                vk = kj
        return run[vidx], vidx
    policy = v.policy
    if not v.vgrouped:
        for j in range(len(run)):
            _current(v, run[j], j < i)
        victim = policy.preemption_victim(run, t)
        return victim, run.index(victim)
    # among each group's last (key, index): its representative
    best = [-1] * v.vgroup_count
    for j in range(len(run)):
        r = run[j]
        g = r.vgrp
        b = best[g]
        if b < 0 or not r.vkey < run[b].vkey:
            best[g] = j
    idxs = sorted([j for j in best if j >= 0])
    if len(idxs) == 1:
        return run[idxs[0]], idxs[0]
    for j in idxs:
        _current(v, run[j], j < i)
    mkey = v.vmerge_key
    if mkey is not None:  # the smallest key, the latest on ties
        vidx = -1
        bk: Any = None
        for j in idxs:
            k = mkey(run[j], t)
            if vidx < 0 or not bk < k:
                vidx = j
                bk = k
        return run[vidx], vidx
    reps = [run[j] for j in idxs]
    victim = policy.preemption_victim(reps, t)
    return victim, idxs[reps.index(victim)]


def waiting_preempts(v: InstanceView, w: LReq, cands: list[LReq], t: float, scheduled: bool) -> bool:
    """Under waiting-side preemption (`InstanceView.pwait`): whether `InstanceSim`'s
    admission, stopped at `w` (its first chunk does not fit), would preempt for it: the
    policy's victim among `cands` (the running requests, then those admitted so far in
    this step; pool members `scheduled` in it or not) is outranked by `w`. True also
    when that cannot be told without the engine's exact fields (the policy is asked
    about the victim on them: the caller hands the step to `InstanceSim`)."""
    if not cands:
        return False
    if not v.vkeyed and v.vmerge_key is None:
        return True
    victim, _j = _victim(v, cands, t, len(cands) if scheduled else 0)
    _current(v, victim, scheduled)
    return bool(v.policy.outranks(w, victim, t))


def policy_preempt_chunked(v: InstanceView, t: float) -> StepOutcome:
    """A chunked-prefill step whose running pass runs out of KV blocks, for any
    policy: the pass of `InstanceSim._schedule_chunked` (the policy names each victim;
    a victim already scheduled in this step is taken out of it again) on the
    look-ahead's own state. Pool members keep their pooled fields (a member at tick G
    needs a new block iff its computed count is a multiple of block_size, and holds
    ceil(computed / block_size) blocks); only those the policy is asked about are
    brought up to date (`_current`). The pass ends at some run[i] (a request that
    preempted itself, the budget, or the end): run[:i] are scheduled, and the pool
    members from there on are paused: re-based to the next tick with their tokens
    unchanged. No admissions follow a preemption. O(running) integer work plus the
    victims (no call per running request)."""
    run, bs, pool = v.running, v.bs, v.pool
    G = pool.tick
    F = v.free
    budget = v.token_budget
    sched: list[tuple[LReq, int, int]] = []  # the explicit requests scheduled
    pooled = 0  # the pool members scheduled
    ntok = 0
    nondec = v.explicit
    preempted = False
    i = 0
    while i < len(run) and budget > 0:
        r = run[i]
        pg = r.pool_g
        if pg >= 0:
            n = 1
            nb = 1 if (r.num_computed_tokens + G - pg) % bs == 0 else 0
        else:
            n, nb = next_chunk(r, budget, bs)
        self_victim = False
        while nb > F:
            victim, vidx = _victim(v, run, t, i)
            vg = victim.pool_g
            if vg >= 0:  # ceil(computed / bs) blocks, one more if it is in this step
                c = victim.num_computed_tokens + G - vg
                F += -(-(c + 1 if vidx < i else c) // bs)
            else:
                F += victim.kv_blocks
            if vidx < i:  # already in this step: undo it (vLLM V1 does too)
                if vg >= 0:
                    pooled -= 1
                    budget += 1
                    ntok -= 1
                else:
                    for j, e in enumerate(sched):
                        if e[0] is victim:
                            budget += e[1]
                            ntok -= e[1]
                            del sched[j]
                            break
                i -= 1
            del run[vidx]
            if vg >= 0:
                pool.leave(victim)
            else:
                nondec.remove(victim)
            victim.kv_blocks = 0
            victim.num_computed_tokens = 0
            victim.num_preemptions += 1
            v.requeue(victim)
            preempted = True
            if victim is r:
                self_victim = True
                break
        if self_victim:
            break
        if pg >= 0:
            pooled += 1
        else:
            r.kv_blocks += nb
            sched.append((r, n, 0))  # (its blocks are added already)
        F -= nb
        budget -= n
        ntok += n
        i += 1
    assert preempted, "called without a failing allocation"
    paused_ctx = 0
    for j in range(i, len(run)):  # not scheduled: a member pauses (same tokens at tick + 1)
        r = run[j]
        if r.pool_g >= 0:
            _current(v, r, False)
            pool.pause(r)
            paused_ctx += r.num_computed_tokens + 1
    if not pooled and not sched:
        v.free = F
        pool.tick += 1  # paused members were re-based to the next tick; nothing ran
        return StepOutcome.PREEMPTED_ONLY
    pool.ctx_tokens -= paused_ctx
    v.step_s = apply_step(v, t, sched, pooled, F, ntok, True)
    pool.ctx_tokens += paused_ctx
    return StepOutcome.RAN


def fcfs_preempt_step(v: InstanceView, t: float, chunked: bool) -> StepOutcome:
    """A step whose running pass runs out of KV blocks, under FCFS (victim = the last
    running request): scan the running list in order, preempting from the tail until
    each allocation fits (vLLM V1 `Scheduler.schedule()`); no admissions follow a
    preemption."""
    run, bs, pool = v.running, v.bs, v.pool
    G = pool.tick
    F = v.free
    B, nondec = pool.size, v.explicit
    if len(run) == B + len(nondec) and (not nondec or (chunked and run[B:] == nondec)):
        return fcfs_preempt_tail(v, t, chunked)
    budget = v.token_budget if chunked else MAX_LOOKAHEAD_STEPS
    end = len(run)
    i = 0
    ents: list[tuple[LReq, int, int]] = []
    ntok = 0
    while i < end and budget > 0:
        r = run[i]
        pg = r.pool_g
        if pg >= 0:
            n = 1
            nb = 1 if (G - pg + r.num_computed_tokens) % bs == 0 else 0
        else:
            if not chunked:
                return StepOutcome.UNSUPPORTED
            n, nb = next_chunk(r, budget, bs)
        if nb > F:
            while nb > F and end > i:
                end -= 1
                w = run[end]
                wg = w.pool_g
                F += -(-(w.num_computed_tokens + G - wg) // bs) if wg >= 0 else w.kv_blocks
            if end == i:
                break
        F -= nb
        budget -= n
        ntok += n
        if pg < 0:
            ents.append((r, n, nb))
        i += 1
    if end == len(run):
        return StepOutcome.UNSUPPORTED
    for j in range(i, end):
        if run[j].pool_g >= 0:
            return StepOutcome.UNSUPPORTED  # a pooled decoder would be left unscheduled
    return evict_tail(v, t, end, ents, F, ntok)


def fcfs_preempt_tail(v: InstanceView, t: float, chunked: bool) -> StepOutcome:
    """`fcfs_preempt_step` when the running list is the B pool members followed by
    the explicit tail: O(victims + tail). Under FCFS the greedy pass (preempt the last
    request whenever the current allocation fails) keeps the longest prefix run[:e]
    whose block needs fit the free pool plus the blocks the suffix run[e:] held; that
    prefix is found by peeling the suffix from the end."""
    run, bs, pool = v.running, v.bs, v.pool
    G, B = pool.tick, pool.size
    F = v.free
    budget = v.token_budget - B if chunked else 0
    nd: list[tuple[LReq, int, int]] = []
    need = pool.blocks_next_tick() if B else 0
    ntok = B
    for r in v.explicit:
        if budget <= 0:
            nd.append((r, 0, 0))
            continue
        n, nb = next_chunk(r, budget, bs)
        nd.append((r, n, nb))
        need += nb
        budget -= n
        ntok += n
    e = len(run)
    while need > F:
        e -= 1
        w = run[e]
        if e >= B:
            _r, n, nb = nd[e - B]
            need -= nb
            ntok -= n
            F += w.kv_blocks
        else:
            c = w.num_computed_tokens + G - w.pool_g
            if c % bs == 0:
                need -= 1
            ntok -= 1
            F += -(-c // bs)
    if e == len(run):
        return StepOutcome.UNSUPPORTED
    ents = [x for x in nd[: max(0, e - B)] if x[1] > 0]
    return evict_tail(v, t, e, ents, F - need, ntok)


def evict_tail(v: InstanceView, t: float, end: int, ents: list[tuple[LReq, int, int]], F: int,
               ntok: int) -> StepOutcome:
    """Preempt run[end:] by recompute (`DecodePool.evict_tail`), then run the step of
    the survivors: the pool's members plus `ents`, with `F` blocks left free and
    `ntok` tokens."""
    pool = v.pool
    pool.evict_tail(v.running, end, v.explicit, v.waiting)
    B = pool.size
    if not B and not ents:
        v.free = F  # the victims' blocks are free again; nothing ran
        return StepOutcome.PREEMPTED_ONLY
    v.step_s = apply_step(v, t, ents, B, F, ntok, True)
    return StepOutcome.RAN
