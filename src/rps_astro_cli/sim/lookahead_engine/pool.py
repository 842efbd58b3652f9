"""The decode pool: the running requests that only decode, kept in "decode ticks".

The pool's clock, `tick`, counts the steps in which every member advances by one token.
A member (running, whole sequence computed but the token a decode feeds, KV blocks =
ceil(computed / block_size)) is described by the tick it joined (`LReq.pool_g`) and its
fields at that tick: at tick G it has computed + (G - pool_g) tokens. It needs a new KV
block exactly at the ticks where its computed count is a multiple of block_size, i.e. at
ticks ≡ (pool_g - computed) (mod block_size), so the pool's block demand over any run of
ticks follows from the count of members per residue (`residue_counts`, stored twice over
so that a run of up to block_size ticks from any residue is one slice). Its last step is
tick pool_g + target - generated - 1; a heap keyed by that tick (`finishes`) gives the
finishes in order. A member that leaves (preempted) keeps a stale heap entry, recognised
by its `pool_seq`.
"""

from __future__ import annotations

import heapq

from .request import LReq


class DecodePool:
    """The pooled decoders of one look-ahead (see the module docstring)."""

    def __init__(self, block_size: int) -> None:
        #: tokens per KV block
        self.block_size = block_size
        #: the pool's clock (decode ticks since the snapshot)
        self.tick = 0
        #: members (requests)
        self.size = 0
        #: context summed over the members at `tick` (tokens, each counting the token it feeds)
        self.ctx_tokens = 0
        #: members per tick residue (mod block_size) at which they need a new block, twice over
        self.residue_counts: list[int] = [0] * (2 * block_size)
        #: heap of (last tick, sequence number, member); entries of departed members are stale
        self.finishes: list[tuple[int, int, LReq]] = []
        #: sequence number of the latest heap entry
        self.seq = 0

    def clear(self) -> None:
        """No members (the tick is kept)."""
        self.residue_counts = [0] * (2 * self.block_size)
        self.finishes = []
        self.size = self.ctx_tokens = 0

    def blocks_next_tick(self) -> int:
        """KV blocks the members newly need in the step at `tick`."""
        return self.residue_counts[self.tick % self.block_size]

    def join(self, r: LReq) -> None:
        """A request that just sampled (and did not finish) joins at `tick`."""
        G, bs = self.tick, self.block_size
        c = r.num_computed_tokens
        r.pool_g = G
        rho = (G - c) % bs
        self.residue_counts[rho] += 1
        self.residue_counts[rho + bs] += 1
        self.size += 1
        self.ctx_tokens += c + 1
        self.seq += 1
        r.pool_seq = self.seq
        heapq.heappush(self.finishes, (G + r.target_output_tokens - r.num_generated_tokens - 1, self.seq, r))

    def top(self) -> tuple[int, int, LReq]:
        """The live heap entry of the next member to finish (stale entries of departed
        members are dropped). The pool must not be empty."""
        heap = self.finishes
        while True:
            top = heap[0]
            r = top[2]
            if r.pool_seq == top[1] and r.pool_g >= 0:
                return top
            heapq.heappop(heap)

    def pop_due(self, t: float, running: list[LReq]) -> int:
        """Remove every member whose last tick is before `tick` (it finished in the step
        that ended at `t`: its `finish_s`) from the pool and from `running`. Returns the
        KV blocks they give back."""
        heap, bs, cnt2 = self.finishes, self.block_size, self.residue_counts
        G, S, B = self.tick, self.ctx_tokens, self.size
        freed = 0
        while heap and heap[0][0] < G:
            _f, sq, r = heapq.heappop(heap)
            pg = r.pool_g
            if r.pool_seq != sq or pg < 0:
                continue  # stale entry of a preempted request
            c_e = r.num_computed_tokens
            c = c_e + G - pg
            rho = (pg - c_e) % bs
            cnt2[rho] -= 1
            cnt2[rho + bs] -= 1
            B -= 1
            S -= c + 1
            freed += -(-c // bs)
            r.num_computed_tokens = c
            r.num_generated_tokens += G - pg
            r.kv_blocks = 0
            r.pool_g = -1
            running.remove(r)
            r.finish_s = t
        self.ctx_tokens, self.size = S, B
        return freed

    def leave(self, v: LReq) -> None:
        """Member `v` leaves at `tick` (it is being preempted): its generated count is
        brought up to date; its heap entry goes stale. The caller resets its KV state."""
        vg = v.pool_g
        c_e = v.num_computed_tokens
        d = self.tick - vg
        bs = self.block_size
        rho = (vg - c_e) % bs
        self.residue_counts[rho] -= 1
        self.residue_counts[rho + bs] -= 1
        self.size -= 1
        self.ctx_tokens -= c_e + d + 1
        v.num_generated_tokens += d
        v.pool_g = -1

    def evict_tail(self, running: list[LReq], end: int, explicit: list[LReq], waiting: list[LReq]) -> None:
        """Preempt running[end:] by recompute (pooled members leave the pool, the others
        leave `explicit`): they go to the front of `waiting`, in running order, as
        repeated vLLM `prepend_request` calls leave them."""
        victims = running[end:]
        del running[end:]
        for v in victims:
            if v.pool_g >= 0:
                self.leave(v)
            else:
                explicit.remove(v)
            v.num_computed_tokens = 0
            v.kv_blocks = 0
            v.num_preemptions += 1
        waiting[:0] = victims

    def rebase(self, running: list[LReq]) -> None:
        """Bring every member's fields up to `tick` (it re-joins at `tick`, same residue)."""
        G, bs = self.tick, self.block_size
        for r in running:
            pg = r.pool_g
            if pg >= 0:
                if pg != G:
                    d = G - pg
                    r.num_computed_tokens += d
                    r.num_generated_tokens += d
                    r.pool_g = G
                r.kv_blocks = -(-r.num_computed_tokens // bs)

    def pause(self, r: LReq) -> None:
        """Member `r`, re-based to `tick`, is not scheduled in the step at `tick`: it
        re-joins at tick + 1 with the same tokens (a new heap entry; the old one goes
        stale). Its context stays counted in `ctx_tokens`: the caller takes it out for
        the step."""
        G, bs, cnt2 = self.tick, self.block_size, self.residue_counts
        c = r.num_computed_tokens
        rho = (G - c) % bs
        cnt2[rho] -= 1
        cnt2[rho + bs] -= 1
        rho = (G + 1 - c) % bs
        cnt2[rho] += 1
        cnt2[rho + bs] += 1
        r.pool_g = G + 1
        self.seq += 1
        r.pool_seq = self.seq
        heapq.heappush(self.finishes, (G + 1 + r.target_output_tokens - r.num_generated_tokens - 1, self.seq, r))

    def materialize(self, running: list[LReq]) -> None:
        """Write the members' current fields back (they leave the pool; `rebuild` after)."""
        bs, G = self.block_size, self.tick
        for r in running:
            if r.pool_g >= 0:
                d = G - r.pool_g
                r.num_computed_tokens += d
                r.num_generated_tokens += d
                r.kv_blocks = -(-r.num_computed_tokens // bs)
                r.pool_g = -1

    def rebuild(self, running: list[LReq]) -> list[LReq]:
        """Re-derive the pool from explicit (materialized) running requests; returns the
        others (prefilling, finished, or holding spare blocks), in running order."""
        bs = self.block_size
        self.clear()
        explicit: list[LReq] = []
        for r in running:
            c = r.num_computed_tokens
            g = r.num_generated_tokens
            if g > 0 and r.prompt_tokens + g - c == 1 and r.kv_blocks == -(-c // bs) and g < r.target_output_tokens:
                self.join(r)
            else:
                r.pool_g = -1
                explicit.append(r)
        return explicit

    def peel(self, running: list[LReq], keep: int, need: int, free: int) -> tuple[int, int, int]:
        """FCFS victims off the pooled part of the running list: while the kept members
        running[:keep] need `need` new blocks at `tick` (one each whose context is a
        multiple of block_size) and only `free` are free, drop running[keep - 1] (its
        blocks return to `free`). Returns (keep, need, free) for the kept prefix."""
        G, bs = self.tick, self.block_size
        while need > free:
            keep -= 1
            v = running[keep]
            c = v.num_computed_tokens + G - v.pool_g
            if c % bs == 0:
                need -= 1
            free += -(-c // bs)
        return keep, need, free
