"""Ordinary steps of the general loop (other policies, prioritized prefill) without
preemption, in O(requests touched): `chunked_step` and `prioritized_step`."""

from __future__ import annotations

from .apply import apply_step
from .instance_view import InstanceView, MergeCursor
from .outcome import StepOutcome
from .preemption import fcfs_preempt_step, policy_preempt_chunked, waiting_preempts
from .request import LReq, next_chunk


def _with_new(running: list[LReq], sched: list[tuple[LReq, int, int]], admitted: int) -> list[LReq]:
    """The running list as `InstanceSim` holds it during admission: the running requests,
    then the last `admitted` entries of `sched` (admitted in this step, in order)."""
    return running + [e[0] for e in sched[len(sched) - admitted:]] if admitted else running


def chunked_step(v: InstanceView, t: float) -> StepOutcome:
    """One chunked-prefill step at `t`: the pool and the explicit requests (which must be
    the running list's tail), then admissions in the policy's order; a failing block
    allocation hands the step to the preemption passes."""
    cfg, bs, pool = v.cfg, v.bs, v.pool
    B = pool.size
    running, nondec = v.running, v.explicit
    if nondec and running[B:] != nondec:
        return StepOutcome.UNSUPPORTED
    budget = cfg.max_num_batched_tokens - B
    if budget < 0:
        return StepOutcome.UNSUPPORTED
    free = v.free - (pool.blocks_next_tick() if B else 0)
    if free < 0:
        return fcfs_preempt_step(v, t, True) if v.fcfs else policy_preempt_chunked(v, t)
    sched: list[tuple[LReq, int, int]] = []
    for r in nondec:
        if budget <= 0:
            break
        n, nb = next_chunk(r, budget, bs)
        if nb > free:
            return fcfs_preempt_step(v, t, True) if v.fcfs else policy_preempt_chunked(v, t)
        free -= nb
        sched.append((r, n, nb))
        budget -= n
    waiting = v.waiting
    if waiting and budget > 0 and len(running) < cfg.max_num_seqs:  # else no admission
        nrun = len(running)
        maxs = cfg.max_num_seqs
        admitted = 0
        if v.merged:  # the policy's order, head by head
            cur = MergeCursor(v, t)
            while nrun < maxs and budget > 0:
                h = cur.peek()
                if h is None:
                    break
                n, nb = next_chunk(h, budget, bs)
                if nb > free:
                    if v.pwait and waiting_preempts(v, h, _with_new(running, sched, admitted), t, True):
                        return StepOutcome.UNSUPPORTED  # (nothing changed yet)
                    break
                cur.take()
                free -= nb
                sched.append((h, n, nb))
                budget -= n
                nrun += 1
                admitted += 1
            cur.commit()
        else:
            order: list[LReq] = waiting if v.ordered else v.policy.order_waiting(waiting, t)
            for r in order:
                if nrun >= maxs or budget <= 0:
                    break
                n, nb = next_chunk(r, budget, bs)
                if nb > free:
                    if v.pwait and waiting_preempts(v, r, _with_new(running, sched, admitted), t, True):
                        return StepOutcome.UNSUPPORTED  # (nothing changed yet)
                    break
                free -= nb
                sched.append((r, n, nb))
                budget -= n
                nrun += 1
                admitted += 1
        if admitted:
            new = [e[0] for e in sched[len(sched) - admitted:]]
            if v.ordered:  # the admitted are the queue's head
                del waiting[:admitted]
            else:
                for r in new:
                    waiting.remove(r)
            running.extend(new)
            nondec.extend(new)
    if not B and not sched:
        return StepOutcome.IDLE
    v.step_s = apply_step(v, t, sched, B, free, cfg.max_num_batched_tokens - budget, True)
    return StepOutcome.RAN


def prioritized_step(v: InstanceView, t: float) -> StepOutcome:
    """One prioritized-prefill step at `t`: a prefill-only step of the waiting requests
    that fit whole within the prefill budget, else a decode step of the pool."""
    cfg, bs, pool = v.cfg, v.bs, v.pool
    waiting, running = v.waiting, v.running
    free = v.free
    sched: list[tuple[LReq, int, int]] = []
    if waiting and len(running) < cfg.max_num_seqs:  # else no admission
        budget = cfg.prefill_budget
        nrun = len(running)
        maxs = cfg.max_num_seqs
        tokens = 0
        cur = MergeCursor(v, t) if v.merged else None
        order: list[LReq] = waiting if v.ordered or cur is not None else v.policy.order_waiting(waiting, t)
        i = 0
        while True:  # the policy's order (head by head when merged)
            if cur is not None:
                q = cur.peek()
                if q is None:
                    break
                r = q
            elif i < len(order):
                r = order[i]
            else:
                break
            i += 1
            c = r.num_computed_tokens
            n = r.prompt_tokens + r.num_generated_tokens - c
            if nrun >= maxs:
                break
            nb = -(-(c + n) // bs) - r.kv_blocks
            if n > budget or (nb > 0 and nb > free):
                # (InstanceSim tries waiting-side preemption for either shortage)
                if v.pwait and budget > 0 and waiting_preempts(v, r, _with_new(running, sched, len(sched)), t,
                                                               False):
                    return StepOutcome.UNSUPPORTED  # (nothing changed yet)
                break
            if nb > 0:
                free -= nb
            else:
                nb = 0
            if cur is not None:
                cur.take()
            sched.append((r, n, nb))
            budget -= n
            tokens += n
            nrun += 1
        if cur is not None:
            cur.commit()
        if sched:
            new = [e[0] for e in sched]
            if v.ordered:
                del waiting[: len(new)]
            else:
                for r in new:
                    waiting.remove(r)
            running.extend(new)
            v.explicit.extend(new)
            v.step_s = apply_step(v, t, sched, 0, free, tokens, False)
            return StepOutcome.RAN
    if v.explicit:
        return StepOutcome.UNSUPPORTED
    B = pool.size
    if not B:
        return StepOutcome.IDLE
    free -= pool.blocks_next_tick()
    if free < 0:
        return fcfs_preempt_step(v, t, False) if v.fcfs else StepOutcome.UNSUPPORTED
    v.step_s = apply_step(v, t, sched, B, free, B, True)
    return StepOutcome.RAN
