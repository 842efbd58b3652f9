"""The look-ahead's copy of one instance (`InstanceView`): its limits, its requests (the
decode pool, the other running requests, the queue), its free KV blocks, and how its
policy is consulted."""

from __future__ import annotations

import bisect
from collections.abc import Callable
from operator import attrgetter
from typing import Any, cast

from rps_astro_cli.sim.fcfs import FCFSPolicy
from rps_astro_cli.sim.instance import InstanceConfig, InstanceSim
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.policy import InstancePolicy

from .decode_run import DecodeRun
from .outcome import StepOutcome
from .pool import DecodePool
from .request import LReq


def _uncached(cfg: InstanceConfig) -> InstanceConfig:
    """`cfg` with prefix caching off (the look-ahead's own steps never hash blocks)."""
    if not cfg.enable_prefix_caching:
        return cfg
    return InstanceConfig(cfg.block_size, cfg.num_gpu_blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                          cfg.max_model_len, cfg.chunked_prefill, cfg.prefill_budget_tokens, False)


_OKEY = attrgetter("okey")


def _group_key(r: LReq) -> Any:
    """The key of a request inside its `order_groups` group."""
    return r.okey[1]


def is_fcfs(policy: InstancePolicy) -> bool:
    """True when the policy orders and preempts exactly like FCFS (identity order, last
    running request as victim), so the look-ahead may skip calling it."""
    cls = type(policy)
    return (
        cls.order_waiting is FCFSPolicy.order_waiting
        and cls.preemption_victim is FCFSPolicy.preemption_victim
    )


class InstanceView:
    """One instance as the look-ahead steps it. The running list is the pool's members
    (in running order, their token fields as of the tick they joined) and the `explicit`
    requests (prefilling, or holding spare blocks), whose fields are current."""

    def __init__(self, cfg: InstanceConfig, latency: LatencyModel, policy: InstancePolicy,
                 running: list[LReq], waiting: list[LReq], free_blocks: int) -> None:
        #: the batching limits
        self.cfg = cfg
        #: the memoized step-latency model
        self.latency = latency
        #: the instance policy (interpreted objects; their lists hold LReq)
        self.policy: Any = policy
        #: running requests, in running order
        self.running = running
        #: the waiting queue, in queue order (the policy's, when `ordered`)
        self.waiting = waiting
        #: free KV blocks
        self.free = free_blocks
        #: tokens per KV block
        self.bs = cfg.block_size
        #: the step's token budget (max_num_batched_tokens)
        self.token_budget = cfg.max_num_batched_tokens
        #: most requests in a batch (max_num_seqs)
        self.max_seqs = cfg.max_num_seqs
        #: chunked prefill (else prioritized prefill)
        self.chunked = cfg.chunked_prefill
        #: prioritized mode's prefill budget (tokens)
        self.prefill_budget = cfg.prefill_budget
        #: the running requests that decode in lockstep, in closed form
        self.pool = DecodePool(cfg.block_size)
        #: sizes the pool's next pure decode run
        self.decode_run = DecodeRun(latency)
        #: the other running requests, in running order
        self.explicit: list[LReq] = []
        # the step-shape tables (see `LatencyModel`), sized for every step a chunked
        # FCFS loop can schedule: batch ≤ running + admitted ≤ max(max_num_seqs, running) + 1,
        # tokens ≤ the budget
        latency.reserve(max(cfg.max_num_seqs, len(running)) + 1, cfg.max_num_batched_tokens)
        #: seconds per step by batch size (`LatencyModel.seq_s`)
        self.seq_s = latency.seq_s
        #: seconds per step by token count (`LatencyModel.tok_s`)
        self.tok_s = latency.tok_s
        #: seconds of decode attention per context token
        self.dec = latency._dec
        #: seconds of prefill attention per token pair
        self.pre = latency._pre
        #: the policy's waiting-side preemption (`InstancePolicy.preempts_for_waiting`):
        #: a waiting request that does not fit may preempt running ones it outranks
        self.pwait = bool(policy.preempts_for_waiting)
        #: the policy orders and preempts as FCFS (it is never asked)
        self.fcfs = is_fcfs(policy) and not self.pwait
        # Queue order: FCFS keeps the list order; a policy with an `order_key` for these
        # requests has the list kept sorted by that key (`keyfn`), so its head is the
        # policy's head without asking; any other policy is asked at each step that admits.
        #: the sort key of a key-sorted queue, else None
        self.keyfn: Callable[[Any], Any] | None = None
        #: the queue's list order is the policy's order
        self.ordered = self.fcfs
        #: LReq.vkey names the victim (`InstancePolicy.victim_key`)
        self.vkeyed = False
        #: LReq.okey is (group, key) (`InstancePolicy.order_groups`)
        self.grouped = False
        #: `InstancePolicy.victim_groups`: LReq.vgrp is the group's index, LReq.vkey the
        #: key inside its group
        self.vgrouped = False
        #: victim groups (`vgrp` runs over 0 .. vgroup_count - 1)
        self.vgroup_count = 0
        #: the policy's `victim_merge_key` (with `vgrouped`), else None: then the policy
        #: is asked for the victim among the groups' representatives
        self.vmerge_key: Callable[[Any, float], Any] | None = None
        #: the queue order is the merge of the `order_groups` groups by the policy's
        #: `order_merge_key` of their heads (`MergeCursor`): `groups` holds each group's
        #: waiting members in group order, `LReq.qpos` their queue order
        self.merged = False
        #: the policy's `order_merge_key` (merged queues)
        self.merge_key: Callable[[Any, float], Any] | None = None
        #: per group (`LReq.grp`), its waiting requests by (group key, qpos) (merged queues)
        self.groups: list[list[LReq]] = []
        #: the qpos the next request put at the front / the back of the queue gets
        self.q_front = -1
        self.q_back = 0
        #: the policy's order changes with time and has no key
        self.tdep = False
        #: seconds of the last step that ran (`StepOutcome.RAN`)
        self.step_s = 0.0
        self._sim: InstanceSim | None = None
        self.rebuild()

    # -- the pool and the explicit requests -------------------------------------------
    def rebuild(self) -> None:
        """Re-derive the pool and `explicit` from materialized running requests."""
        self.explicit = self.pool.rebuild(self.running)

    def careful_step(self, t: float) -> StepOutcome:
        """One step by `InstanceSim.step` itself on materialized requests, so that both
        look-aheads share one definition of a step (any step the fast paths do not
        cover)."""
        pool = self.pool
        pool.materialize(self.running)
        sim = self._sim
        if sim is None:
            # no prefix cache in the look-ahead: the candidate's hit arrives as computed
            # tokens (`CandidateRequest.cached_tokens`), and LReq has no block hashes
            sim = self._sim = InstanceSim(_uncached(self.cfg), self.latency, self.policy)
        sim.running = cast(Any, self.running)
        sim.waiting = cast(Any, self.waiting)
        sim.free_blocks = self.free
        res = sim.step(t)
        self.free = sim.free_blocks
        pool.tick += 1
        if self.keyfn is not None:  # victims went to the front: stable re-sort
            self.waiting.sort(key=self.keyfn)
        if self.merged:
            self.build_groups()
        self.rebuild()
        if not res.scheduled:
            return StepOutcome.PREEMPTED_ONLY if res.preempted else StepOutcome.IDLE
        self.step_s = res.duration_s
        return StepOutcome.RAN

    def cache_policy_keys(self, pending: list[tuple[float, LReq]]) -> None:
        """Ask a non-FCFS policy once for its sort keys over every request of the
        look-ahead (running, waiting, and the `pending` arrivals; the keys do not change)
        and cache them on the requests:
        an `order_key` makes the queue key-sorted (`keyfn`, `ordered`); else, for a
        time-dependent policy, `order_groups` (`grouped`); a `victim_key` (`vkeyed`),
        else `victim_groups` (`vgrouped`, with its `victim_merge_key` if any). Then
        `ordered` and `tdep` are set."""
        policy = self.policy
        if not self.fcfs:
            everyone = [*self.running, *self.waiting, *(r for _t, r in pending)]
            groups: Any = None
            okey = policy.order_key(everyone)
            if okey is not None:
                for r in everyone:
                    r.okey = okey(r)
                self.keyfn = _OKEY
                self.waiting.sort(key=_OKEY)
            elif policy.time_dependent:
                groups = policy.order_groups(everyone)
                if groups is not None:
                    for r in everyone:
                        r.okey = groups(r)
                    self.grouped = True
                    mkey = policy.order_merge_key(everyone)
                    if mkey is not None:
                        ids: dict[Any, int] = {}
                        for r in everyone:
                            g = r.okey[0]
                            gi = ids.get(g)
                            if gi is None:
                                gi = ids[g] = len(ids)
                            r.grp = gi
                        self.groups = [[] for _ in range(len(ids))]
                        self.merge_key = mkey
                        self.merged = True
                        self.build_groups()
            vkey = policy.victim_key(everyone)
            if vkey is not None:
                for r in everyone:
                    r.vkey = vkey(r)
                self.vkeyed = True
            else:
                vgroups = policy.victim_groups(everyone)
                if vgroups is not None:
                    if self.grouped and vgroups == groups:  # the same function: the same values
                        for r in everyone:
                            r.vkey = r.okey
                    else:
                        for r in everyone:
                            r.vkey = vgroups(r)
                    vids: dict[Any, int] = {}
                    for r in everyone:  # (group, key) → the group's index and the key
                        g, k = r.vkey
                        gi = vids.get(g)
                        if gi is None:
                            gi = vids[g] = len(vids)
                        r.vgrp = gi
                        r.vkey = k
                    self.vgroup_count = len(vids)
                    self.vmerge_key = policy.victim_merge_key(everyone)
                    self.vgrouped = True
        self.ordered = self.fcfs or self.keyfn is not None
        self.tdep = bool(policy.time_dependent) and self.keyfn is None

    # -- the queue ----------------------------------------------------------------------
    def build_groups(self) -> None:
        """Number the queue in its list order (`qpos`) and sort it into `groups` (merged
        queues)."""
        groups = self.groups
        for gl in groups:
            gl.clear()
        waiting = self.waiting
        for i in range(len(waiting)):
            w = waiting[i]
            w.qpos = i
            groups[w.grp].append(w)
        for gl in groups:
            gl.sort(key=_group_key)  # stable: queue order on ties
        self.q_front = -1
        self.q_back = len(waiting)

    def group_heads(self) -> list[LReq]:
        """The first waiting request of each `order_groups` group (smallest key, queue
        order on ties; `okey` holds (group, key))."""
        if self.merged:
            return [gl[0] for gl in self.groups if gl]
        best: dict[Any, LReq] = {}
        for w in self.waiting:
            g = w.okey[0]
            b = best.get(g)
            if b is None or w.okey[1] < b.okey[1]:
                best[g] = w
        return list(best.values())

    def requeue(self, r: LReq) -> None:
        """A preempted request back to the queue: the front (vLLM `prepend_request`),
        or, in a key-sorted queue, before the first request of an equal key."""
        keyfn = self.keyfn
        if keyfn is None:
            self.waiting.insert(0, r)
            if self.merged:
                r.qpos = self.q_front
                self.q_front -= 1
                gl = self.groups[r.grp]
                gl.insert(bisect.bisect_left(gl, r.okey[1], key=_group_key), r)
        else:
            self.waiting.insert(bisect.bisect_left(self.waiting, keyfn(r), key=keyfn), r)

    def enqueue(self, r: LReq) -> None:
        """A new arrival (the candidate, a request done preprocessing) to the queue: the
        back, or, in a key-sorted queue, after the last request of an equal key."""
        keyfn = self.keyfn
        if keyfn is None:
            self.waiting.append(r)
            if self.merged:
                r.qpos = self.q_back
                self.q_back += 1
                gl = self.groups[r.grp]
                gl.insert(bisect.bisect_right(gl, r.okey[1], key=_group_key), r)
        else:
            self.waiting.insert(bisect.bisect_right(self.waiting, keyfn(r), key=keyfn), r)

    def admission_blocked(self, t: float) -> bool:
        """True when no waiting request can be admitted at any step of a pure decode run
        starting now (the free pool only shrinks during it)."""
        waiting, cfg, pool = self.waiting, self.cfg, self.pool
        B = pool.size
        if not waiting or B >= cfg.max_num_seqs:
            return True
        chunked = cfg.chunked_prefill
        if chunked and cfg.max_num_batched_tokens - B <= 0:
            return True
        bs = self.bs
        if chunked:
            room = cfg.max_num_batched_tokens - B
            free_after = self.free - pool.blocks_next_tick()
        else:
            room = cfg.prefill_budget
            free_after = self.free
        if self.tdep or not self.ordered:
            # whatever order the policy picks, the head is blocked if every waiting
            # request that can be first is (its first chunk needs more blocks than are
            # free, or in prioritized mode its prompt exceeds the prefill budget): any
            # request, or with `order_groups` only the groups' heads
            for w in (self.group_heads() if self.grouped else waiting):
                c = w.num_computed_tokens
                n = w.prompt_tokens + w.num_generated_tokens - c
                if n > room:
                    if not chunked:
                        continue
                    n = room
                nb = -(-(c + n) // bs) - w.kv_blocks
                if nb <= 0 or nb <= free_after:
                    break
            else:
                return True
            if self.tdep:
                return False
        head: LReq = waiting[0] if self.ordered else self.policy.order_waiting(waiting, t)[0]
        c = head.num_computed_tokens
        n = head.prompt_tokens + head.num_generated_tokens - c
        if chunked:
            n = min(n, cfg.max_num_batched_tokens - B)
            free_after = self.free - pool.blocks_next_tick()
        else:
            if n > cfg.prefill_budget:
                return True
            free_after = self.free
        nb = -(-(c + n) // bs) - head.kv_blocks
        return nb > 0 and nb > free_after


class MergeCursor:
    """A merged queue's order at one time `t`, taken lazily from the front (`peek`,
    `take`, then `commit`): the next request is the group head with the smallest
    (`order_merge_key`(head, t), group key, qpos). The policy is asked for one key per
    head, and only while two or more groups have requests left. The
    `InstancePolicy.order_merge_key` contract makes this `order_waiting`."""

    def __init__(self, view: InstanceView, t: float) -> None:
        key = view.merge_key
        assert key is not None
        #: the view's groups (`InstanceView.groups`)
        self.groups = view.groups
        #: the policy's merge key
        self.key = key
        #: the time the order is taken at (s)
        self.t = t
        n = len(self.groups)
        #: per group, how many of its requests were taken
        self.pos = [0] * n
        #: per group, its current head's merge key (when `known`)
        self.keys: list[Any] = [None] * n
        #: per group, whether `keys` holds its current head's key
        self.known = [False] * n
        #: the group of the request `peek` returned last
        self.best = -1

    def peek(self) -> LReq | None:
        """The next request in the order (None when every request was taken)."""
        groups, pos = self.groups, self.pos
        left = 0
        last = -1
        for g in range(len(groups)):
            if pos[g] < len(groups[g]):
                left += 1
                last = g
        if left <= 1:  # one group left: its order
            self.best = last
            return groups[last][pos[last]] if left else None
        keys, known, key, t = self.keys, self.known, self.key, self.t
        best = -1
        bk: Any = None
        bh: LReq | None = None
        for g in range(len(groups)):
            gl = groups[g]
            i = pos[g]
            if i < len(gl):
                h = gl[i]
                if not known[g]:
                    keys[g] = key(h, t)
                    known[g] = True
                k = keys[g]
                if bh is None or k < bk:
                    best, bk, bh = g, k, h
                elif not bk < k:  # equal keys: the group key, then the queue order
                    hk, bhk = h.okey[1], bh.okey[1]
                    if hk < bhk or (not bhk < hk and h.qpos < bh.qpos):
                        best, bk, bh = g, k, h
        self.best = best
        return bh

    def take(self) -> None:
        """Move past the request `peek` returned."""
        g = self.best
        self.pos[g] += 1
        self.known[g] = False

    def commit(self) -> None:
        """Drop the taken requests from their groups (the caller drops them from the
        queue list)."""
        for g in range(len(self.groups)):
            n = self.pos[g]
            if n:
                del self.groups[g][:n]
