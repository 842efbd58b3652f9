"""`FastLookahead`: the event loop of `lookahead.predict` (one per call).

Cost: O(events), not O(steps). Pure decode runs are jumped in closed form
(`decode_run`); steps that prefill, admit or preempt are run one at a time,
O(requests touched) each:
- FCFS + chunked prefill (vLLM's default; the hot path): `fcfs_loop` keeps its state in
  local variables; it covers the layout FCFS keeps (pool members, then at most one
  partial prefill at the tail), admissions, and preemption, where the FCFS victims are a
  suffix of the running list found by peeling it from the end;
- other policies / prioritized prefill: `fast_step` for steps without preemption
  (`preemption` for the others); a policy with `order_key` / `victim_key` has the queue
  kept sorted by cached keys (`okey`, `vkey`) and is never asked; one with
  `order_groups` / `victim_groups` is asked only about group heads / group lasts, and
  with `order_merge_key` (mixed-class `rps`) the queue is kept per group and the order
  taken head by head (`InstanceView.merged`, `MergeCursor`);
- anything else (a preemption under another policy, an unusual running order) is handed
  to `InstanceSim.step` itself on materialized requests (`InstanceView.careful_step`);
- waiting-side preemption (`preempts_for_waiting`, `rps preempt_waiting=true`): no decode
  run is jumped while a queued request is blocked on KV blocks; a step whose admission
  stops at a request that outranks the policy's victim (`preemption.waiting_preempts`)
  is handed to `InstanceSim.step`.
Under KV pressure most steps are events (admit, preempt, readmit), which bounds the gain
there (benchmarks/lookahead_speed.py).
"""

from __future__ import annotations

from rps_astro_cli.sim.instance import InstanceConfig
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.policy import InstancePolicy

from .fast_step import chunked_step, prioritized_step
from .fcfs_loop import fcfs_chunked_loop
from .instance_view import InstanceView
from .loop_state import LoopState
from .outcome import StepOutcome
from .preemption import evict_tail
from .request import MAX_LOOKAHEAD_STEPS, LReq


class FastLookahead:
    """The event loop of `predict` over one snapshot (one instance per call)."""

    def __init__(self, cfg: InstanceConfig, latency: LatencyModel, policy: InstancePolicy,
                 running: list[LReq], waiting: list[LReq], free_blocks: int) -> None:
        #: the instance being simulated
        self.view = InstanceView(cfg, latency, policy, running, waiting, free_blocks)

    def run(self, cand: LReq, t0: float, pending: list[tuple[float, LReq]] | None = None) -> LoopState:
        """Run from `t0` until the candidate finishes; the returned state holds its TTFT
        and E2E (seconds from t0), the steps simulated and the events run.

        pending: the future queue arrivals in order, (time s, request), the candidate
        among them (`lookahead.arrivals_order`); default: the candidate alone at its
        `arrival_s`.

        Raises:
            RuntimeError: the instance can never admit the candidate (no progress), or
                more than MAX_LOOKAHEAD_STEPS steps.
        """
        if pending is None:
            pending = [(cand.arrival_s, cand)]
        v = self.view
        lp = LoopState(cand, t0, pending)
        v.cache_policy_keys(pending)
        cfg, bs, pool = v.cfg, v.bs, v.pool
        fcfs, tdep = v.fcfs, v.tdep
        chunked = cfg.chunked_prefill
        max_tok = cfg.max_num_batched_tokens
        maxs = cfg.max_num_seqs
        pbudget = cfg.prefill_budget
        fcfs_chunked = fcfs and chunked and not tdep
        dec = v.latency.profile.decode_attn_s_per_ctx_token
        plan = v.decode_run
        while True:
            lp.events += 1
            if not lp.added and lp.t >= lp.arrival:
                lp.arrive(v, lp.t)
            if fcfs_chunked and fcfs_chunked_loop(v, lp):
                if lp.done:
                    break
                if lp.steps > MAX_LOOKAHEAD_STEPS:
                    raise RuntimeError("look-ahead exceeded MAX_LOOKAHEAD_STEPS")
                continue
            B = pool.size
            # ---- pure decode run: jump ----
            if B and not v.explicit and (not chunked or B <= max_tok):
                W = v.waiting
                if not W or B >= maxs or (chunked and max_tok <= B):
                    blocked = True
                elif v.pwait:  # a head that does not fit may preempt (`preempt_waiting`): step
                    blocked = False
                elif v.ordered and not tdep:  # `InstanceView.admission_blocked` for the head, inlined
                    head = W[0]
                    c = head.num_computed_tokens
                    n = head.prompt_tokens + head.num_generated_tokens - c
                    if chunked:
                        if n > max_tok - B:
                            n = max_tok - B
                        nb = -(-(c + n) // bs) - head.kv_blocks
                        blocked = nb > 0 and nb > v.free - pool.blocks_next_tick()
                    elif n > pbudget:
                        blocked = True
                    else:
                        nb = -(-(c + n) // bs) - head.kv_blocks
                        blocked = nb > 0 and nb > v.free
                else:
                    blocked = v.admission_blocked(lp.t)
            else:
                blocked = False
            if blocked:
                G, S, free = pool.tick, pool.ctx_tokens, v.free
                top = pool.top()
                plan.plan(pool, lp.t, G, S, B, free, top[0], lp.added, lp.arrival)
                n = plan.steps
                if n > 0:
                    a = plan.shape_s
                    lp.t += n * a + dec * (n * S + B * (n * (n - 1) // 2))
                    G += n
                    pool.tick = G
                    pool.ctx_tokens = S + n * B
                    v.free = free - plan.blocks
                    lp.steps += n
                    if pool.finishes[0][0] < G:
                        v.free += pool.pop_due(lp.t, v.running)
                        if lp.done:
                            break
                if plan.exhausted and fcfs:
                    # the next step runs out of blocks: all running requests are pool
                    # members, so peel FCFS victims off the tail until their needs fit
                    # (see `preemption.fcfs_preempt_tail`), then run the survivors.
                    if not lp.added and lp.t >= lp.arrival:
                        lp.arrive(v, lp.t)
                    run = v.running
                    B = pool.size
                    if len(run) != B:
                        continue
                    e, N, F = pool.peel(run, B, pool.blocks_next_tick(), v.free)
                    if evict_tail(v, lp.t, e, [], F - N, e) is StepOutcome.PREEMPTED_ONLY:
                        continue  # only preempted: no time passes
                    lp.t += v.step_s
                    lp.steps += 1
                    if lp.done:
                        break
                    continue
                if n > 0:
                    continue
            # ---- one ordinary step ----
            step = chunked_step(v, lp.t) if chunked else prioritized_step(v, lp.t)
            if step is StepOutcome.UNSUPPORTED:
                step = v.careful_step(lp.t)
            if step is StepOutcome.IDLE:
                if not lp.added:
                    lp.t = lp.arrival
                    continue
                raise RuntimeError("look-ahead made no progress (instance cannot admit any request)")
            if step is StepOutcome.PREEMPTED_ONLY:
                continue
            lp.t += v.step_s
            lp.steps += 1
            if lp.done:
                break
            if lp.steps > MAX_LOOKAHEAD_STEPS:
                raise RuntimeError("look-ahead exceeded MAX_LOOKAHEAD_STEPS")
        assert cand.first_token_s is not None and cand.finish_s is not None
        return lp
