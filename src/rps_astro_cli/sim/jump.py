"""The jump look-ahead engine behind `lookahead.predict` (Astrolabe §4 predictor;
DESIGN.md §2): an event loop over an instance snapshot that advances pure decode runs in
closed form. `lookahead.py` holds the public API and the step-by-step reference.

This module is plain Python and is also compiled with mypyc when the package is
installed (setup.py; same source, 3–5x faster; `ASTRO_PURE_PYTHON=1` skips the build
and the import of a build). `lookahead.py` loads this source instead of a compiled
build that is older than it, so an edit here always takes effect.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable
from operator import attrgetter
from typing import Any, cast

from rps_astro_cli.sim.policy import InstancePolicy
from rps_astro_cli.sim.fcfs import FCFSPolicy
from rps_astro_cli.sim.instance import InstanceConfig, InstanceSim
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.sim.status import RequestStatus

CANDIDATE_ID = "__candidate__"
PREEMPTED_ONLY = -1.0  # a step that only preempted: nothing ran, no time passed
MAX_LOOKAHEAD_STEPS = 2_000_000
_OKEY = attrgetter("okey")


# ---------------------------------------------------------------------------------------
# Fast jump look-ahead
# ---------------------------------------------------------------------------------------
#
# State is kept in "decode ticks": G counts the steps in which every pooled decoder
# advances by one token. A request in the *decode pool* (running, whole sequence
# computed but the token a decode feeds, KV blocks = ceil(computed / block_size)) is
# described by the tick it entered (`pool_g`) and its fields at that tick; at tick G it
# has computed + (G - pool_g) tokens. It needs a new KV block exactly at the ticks where
# its computed count is a multiple of block_size, i.e. at ticks ≡ (pool_g - computed)
# (mod block_size), so the pool's block demand over any run of ticks follows from the
# count of members per residue. Its last step is tick pool_g + target - generated - 1
# (a heap keyed by that tick gives the finishes).
#
# Between events the instance runs pure decode steps: step j of a jump takes
# shape_s(B, B) + decode_attn * (S + j*B) seconds (S = context summed over the B decoders,
# growing by B per step), an arithmetic series. Events that end a jump: the first finish,
# the step whose block allocation would fail (found from the per-residue counts), the
# candidate's arrival (after preprocessing). Steps that prefill, admit or preempt are run
# one at a time with the ordinary step logic, O(requests touched) each:
# - FCFS + chunked prefill (vLLM's default; the hot path): `_fcfs_chunked_loop` keeps all
#   state in local variables; it covers the layout FCFS keeps (pooled decoders, then at
#   most one partial prefill at the tail), admissions, and preemption, where the FCFS
#   victims are a suffix of the running list found by peeling it from the end;
# - other policies / prioritized prefill: `_fast_step_*` for steps without preemption
#   (FCFS preemption: `_fcfs_preempt_*`); a policy with `order_key` / `victim_key` has
#   the queue kept sorted by cached keys (`okey`, `vkey`) and is never asked; one with
#   `order_groups` / `victim_groups` is asked only about group heads / group lasts;
# - anything else (a preemption under another policy, an unusual running order) is
#   handed to `InstanceSim.step` itself on materialized requests (`_careful_step`), so
#   both look-aheads share one definition of a step.
# Cost: O(events), not O(steps); under KV pressure most steps are events (admit, preempt,
# readmit), which bounds the gain there (benchmarks/lookahead_speed.py).


class LReq:
    """A look-ahead request: the fields of `SimRequest` (same names, order and units;
    `InstanceSim` and the instance policies read and step it as one) plus the tick it
    joined the decode pool (`pool_g`, -1 = not pooled; its token/block fields are then
    current), the sequence number of its live heap entry (`pool_seq`), and its policy
    sort keys (`okey`, `vkey`, see `InstancePolicy.order_key` / `victim_key`).

    A class of its own rather than a `SimRequest` subclass so that mypyc can compile it
    (a compiled class cannot extend an interpreted one); tests/test_lookahead.py checks
    that the fields match."""

    __slots__ = (
        "request_id", "arrival_s", "prompt_tokens", "target_output_tokens", "modality",
        "vision_tokens", "encoder_s", "req_class", "predicted_output_tokens", "deadline_s",
        "num_computed_tokens", "num_generated_tokens", "kv_blocks", "num_preemptions",
        "first_scheduled_s", "first_token_s", "finish_s", "pool_g", "pool_seq", "okey", "vkey",
    )

    def __init__(self, request_id: str, arrival_s: float, prompt_tokens: int, target_output_tokens: int,
                 modality: str = "text", vision_tokens: int = 0, encoder_s: float = 0.0,
                 req_class: str | None = None, predicted_output_tokens: int | None = None,
                 deadline_s: float | None = None, num_computed_tokens: int = 0,
                 num_generated_tokens: int = 0, kv_blocks: int = 0) -> None:
        self.request_id = request_id
        self.arrival_s = arrival_s
        self.prompt_tokens = prompt_tokens
        self.target_output_tokens = target_output_tokens
        self.modality = modality
        self.vision_tokens = vision_tokens
        self.encoder_s = encoder_s
        self.req_class = req_class
        self.predicted_output_tokens = predicted_output_tokens
        self.deadline_s = deadline_s
        self.num_computed_tokens = num_computed_tokens
        self.num_generated_tokens = num_generated_tokens
        self.kv_blocks = kv_blocks
        self.num_preemptions = 0
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.finish_s: float | None = None
        self.pool_g = -1
        self.pool_seq = 0
        self.okey: Any = None  # the policy's `order_key` / `victim_key` values, when it has them
        self.vkey: Any = None

    @property
    def num_tokens(self) -> int:
        """Tokens in the sequence so far: prompt + generated (tokens)."""
        return self.prompt_tokens + self.num_generated_tokens

    @property
    def is_prefilling(self) -> bool:
        """As `SimRequest.is_prefilling`."""
        return self.num_tokens - self.num_computed_tokens > 1 or self.num_generated_tokens == 0

    @property
    def finished(self) -> bool:
        return self.num_generated_tokens >= self.target_output_tokens


def expected_tokens(predicted: int | None, generated: int, extension_tokens: int, default_output_tokens: int) -> int:
    """Output length the look-ahead assumes for a queued/running request (tokens): its
    predicted length (`default_output_tokens` when None/0), or `generated +
    extension_tokens` once generation has reached it (Astrolabe §4 auto-extension)."""
    pred = predicted if predicted else default_output_tokens
    if generated >= pred:
        return generated + extension_tokens
    return pred


def lreqs_from_status(reqs: Any, ext: int, dflt: int) -> list[LReq]:
    """`RequestStatus`es (a snapshot's running or waiting list) as look-ahead requests
    whose target is the expected output length."""
    out: list[LReq] = []
    for r0 in reqs:
        r = cast(RequestStatus, r0)
        g = r.generated_tokens
        out.append(LReq(
            r.request_id, r.arrival_s, r.prompt_tokens, expected_tokens(r.predicted_output_tokens, g, ext, dflt),
            r.modality, r.vision_tokens, r.encoder_s, r.req_class, r.predicted_output_tokens, r.deadline_s,
            r.computed_tokens, g, r.kv_blocks,
        ))
    return out


def lreqs_from_sim(reqs: Any, ext: int, dflt: int) -> list[LReq]:
    """`SimRequest`s (an `InstanceSim`'s running or waiting list) as look-ahead requests
    whose target is the expected output length (never the true one)."""
    out: list[LReq] = []
    for r0 in reqs:
        r = cast(SimRequest, r0)
        g = r.num_generated_tokens
        out.append(LReq(
            r.request_id, r.arrival_s, r.prompt_tokens, expected_tokens(r.predicted_output_tokens, g, ext, dflt),
            r.modality, r.vision_tokens, r.encoder_s, r.req_class, r.predicted_output_tokens, r.deadline_s,
            r.num_computed_tokens, g, r.kv_blocks,
        ))
    return out


def lreq_candidate(c: SimRequest) -> LReq:
    """The candidate (`lookahead.candidate_to_sim`) as a look-ahead request."""
    return LReq(
        c.request_id, c.arrival_s, c.prompt_tokens, c.target_output_tokens, c.modality,
        c.vision_tokens, c.encoder_s, c.req_class, c.predicted_output_tokens, c.deadline_s,
    )


def _next_chunk(r: LReq, budget: int, bs: int) -> tuple[int, int]:
    """The tokens an unpooled request computes next under a `budget` of tokens and the
    KV blocks they newly need: (min(uncomputed, budget), max(0, ceil((computed + n) /
    bs) - held blocks)), as vLLM V1's chunked-prefill running/waiting passes size them."""
    c = r.num_computed_tokens
    n = r.prompt_tokens + r.num_generated_tokens - c
    if n > budget:
        n = budget
    nb = -(-(c + n) // bs) - r.kv_blocks
    return n, (nb if nb > 0 else 0)


def _is_fcfs(policy: InstancePolicy) -> bool:
    """True when the policy orders and preempts exactly like FCFS (identity order, last
    running request as victim), so the look-ahead may skip calling it."""
    cls = type(policy)
    return (
        cls.order_waiting is FCFSPolicy.order_waiting
        and cls.preemption_victim is FCFSPolicy.preemption_victim
    )


class FastLookahead:
    """The event loop of `predict` (one instance per call)."""

    def __init__(self, cfg: InstanceConfig, latency: LatencyModel, policy: InstancePolicy,
                 running: list[LReq], waiting: list[LReq], free_blocks: int):
        self.cfg = cfg
        self.latency = latency
        self.policy: Any = policy  # interpreted policy objects; their lists hold LReq
        self.running = running
        self.waiting = waiting
        self.free = free_blocks
        bs = cfg.block_size
        self.bs = bs
        self.G = 0
        self.B = 0
        self.S = 0
        self.cnt2 = [0] * (2 * bs)
        self.heap: list[tuple[int, int, LReq]] = []
        self.nondec: list[LReq] = []
        self.seq = 0
        self._sim: InstanceSim | None = None
        # Queue order: FCFS keeps the list order; a policy with an `order_key` for these
        # requests (candidate included: the caller sets it in `run`) has the list kept
        # sorted by that key, so its head is the policy's head without asking; any other
        # policy is asked for the order at each step that admits.
        self.keyfn: Callable[[Any], Any] | None = None
        self.ordered = False
        self.vkeyed = False  # LReq.vkey names the victim (`InstancePolicy.victim_key`)
        self.grouped = False  # LReq.okey is (group, key) (`InstancePolicy.order_groups`)
        self.vgrouped = False  # LReq.vkey is (group, key) (`InstancePolicy.victim_groups`)
        self.tdep = False
        self.pending: list[tuple[float, LReq]] = []  # future queue arrivals (see `run`)
        self.pending_i = 0
        self.M = cfg.max_num_batched_tokens
        self.maxs = cfg.max_num_seqs
        # the step-shape tables (see `LatencyModel`), sized for every step a chunked
        # FCFS loop can schedule: batch ≤ running + admitted ≤ max(max_num_seqs, running) + 1,
        # tokens ≤ the budget
        latency.reserve(max(cfg.max_num_seqs, len(running)) + 1, cfg.max_num_batched_tokens)
        self.seq_s = latency.seq_s
        self.tok_s = latency.tok_s
        self.dec = latency._dec
        self.pre = latency._pre
        self._done = False
        self._rebuild()

    # -- pool maintenance ------------------------------------------------------------
    def _rebuild(self) -> None:
        """Re-derive the decode pool from explicit (materialized) running requests."""
        bs = self.bs
        self.cnt2 = [0] * (2 * bs)
        self.heap = []
        nondec: list[LReq] = []
        self.nondec = nondec
        self.B = self.S = 0
        for r in self.running:
            c = r.num_computed_tokens
            g = r.num_generated_tokens
            if g > 0 and r.prompt_tokens + g - c == 1 and r.kv_blocks == -(-c // bs) and g < r.target_output_tokens:
                self._join(r)
            else:
                r.pool_g = -1
                nondec.append(r)

    def _materialize(self) -> None:
        bs, G = self.bs, self.G
        for r in self.running:
            if r.pool_g >= 0:
                d = G - r.pool_g
                r.num_computed_tokens += d
                r.num_generated_tokens += d
                r.kv_blocks = -(-r.num_computed_tokens // bs)
                r.pool_g = -1

    def _careful_step(self, t: float) -> float | None:
        """One step by `InstanceSim.step` on materialized state; returns its duration
        (None when nothing could be scheduled)."""
        self._materialize()
        sim = self._sim
        if sim is None:
            sim = self._sim = InstanceSim(self.cfg, self.latency, self.policy)
        sim.running = cast(Any, self.running)
        sim.waiting = cast(Any, self.waiting)
        sim.free_blocks = self.free
        res = sim.step(t)
        self.free = sim.free_blocks
        self.G += 1
        if self.keyfn is not None:  # victims went to the front: stable re-sort
            self.waiting.sort(key=self.keyfn)
        self._rebuild()
        if not res.scheduled:
            return PREEMPTED_ONLY if res.preempted else None
        return res.duration_s

    def _group_heads(self) -> list[LReq]:
        """The first waiting request of each `order_groups` group (smallest key, queue
        order on ties; `okey` holds (group, key))."""
        best: dict[Any, LReq] = {}
        for w in self.waiting:
            g = w.okey[0]
            b = best.get(g)
            if b is None or w.okey[1] < b.okey[1]:
                best[g] = w
        return list(best.values())

    def _requeue(self, r: LReq) -> None:
        """A preempted request back to the queue: the front (vLLM `prepend_request`),
        or, in a key-sorted queue, before the first request of an equal key."""
        keyfn = self.keyfn
        if keyfn is None:
            self.waiting.insert(0, r)
        else:
            self.waiting.insert(bisect.bisect_left(self.waiting, keyfn(r), key=keyfn), r)

    def _arrive(self, t: float) -> tuple[float, bool]:
        """Queue every pending arrival due by `t` (in order). Returns (the next pending
        arrival time, or +inf; True when none is left)."""
        p, i = self.pending, self.pending_i
        while i < len(p) and t >= p[i][0]:
            self._enqueue(p[i][1])
            i += 1
        self.pending_i = i
        if i < len(p):
            return p[i][0], False
        return math.inf, True

    def _enqueue(self, r: LReq) -> None:
        """A new arrival (the candidate, a request done preprocessing) to the queue: the back, or, in a key-sorted
        queue, after the last request of an equal key."""
        keyfn = self.keyfn
        if keyfn is None:
            self.waiting.append(r)
        else:
            self.waiting.insert(bisect.bisect_right(self.waiting, keyfn(r), key=keyfn), r)

    def _pop_finished(self, t: float) -> bool:
        """Remove pooled requests whose last step is done; True if the candidate was one."""
        self.S, self.B, self.free, done = self._pop_due(t, self.G, self.S, self.B, self.free)
        return done

    def _pop_due(self, t: float, G: int, S: int, B: int, F: int) -> tuple[int, int, int, bool]:
        """`_pop_finished` on a loop's local state: remove every pooled decoder whose
        last tick is before tick G (it finished in the step that ended at `t`), giving
        back its KV blocks. Returns (context sum, decoders, free blocks, candidate
        finished)."""
        heap, bs, cnt2, run = self.heap, self.bs, self.cnt2, self.running
        done = False
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
            F += -(-c // bs)
            r.num_computed_tokens = c
            r.num_generated_tokens += G - pg
            r.kv_blocks = 0
            r.pool_g = -1
            run.remove(r)
            if r.request_id == CANDIDATE_ID:
                r.finish_s = t
                done = True
        return S, B, F, done

    def _join(self, r: LReq) -> None:
        """A request that just sampled (and did not finish) joins the decode pool."""
        G, bs = self.G, self.bs
        c = r.num_computed_tokens
        r.pool_g = G
        rho = (G - c) % bs
        self.cnt2[rho] += 1
        self.cnt2[rho + bs] += 1
        self.B += 1
        self.S += c + 1
        self.seq += 1
        r.pool_seq = self.seq
        heapq.heappush(self.heap, (G + r.target_output_tokens - r.num_generated_tokens - 1, self.seq, r))

    # -- admission test for jumps ---------------------------------------------------
    def _admission_blocked(self, t: float, fcfs: bool) -> bool:
        """True when no waiting request can be admitted at any step of a pure decode run
        starting now (the free pool only shrinks during it)."""
        waiting, cfg = self.waiting, self.cfg
        if not waiting or self.B >= cfg.max_num_seqs:
            return True
        chunked = cfg.chunked_prefill
        if chunked and cfg.max_num_batched_tokens - self.B <= 0:
            return True
        bs = self.bs
        if chunked:
            room = cfg.max_num_batched_tokens - self.B
            free_after = self.free - self.cnt2[self.G % bs]
        else:
            room = cfg.prefill_budget
            free_after = self.free
        if self.tdep or not self.ordered:
            # whatever order the policy picks, the head is blocked if every waiting
            # request that can be first is (its first chunk needs more blocks than are
            # free, or in prioritized mode its prompt exceeds the prefill budget): any
            # request, or with `order_groups` only the groups' heads
            for w in (self._group_heads() if self.grouped else waiting):
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
            n = min(n, cfg.max_num_batched_tokens - self.B)
            free_after = self.free - self.cnt2[self.G % self.bs]
        else:
            if n > cfg.prefill_budget:
                return True
            free_after = self.free
        nb = -(-(c + n) // self.bs) - head.kv_blocks
        return nb > 0 and nb > free_after

    # -- fast ordinary steps --------------------------------------------------------
    def _fast_step_chunked(self, t: float, fcfs: bool) -> float | None | bool:
        """One chunked-prefill step without preemption. Returns the duration, None when
        nothing was scheduled, or False when the careful path must run it."""
        cfg, bs = self.cfg, self.bs
        B = self.B
        running, nondec = self.running, self.nondec
        if nondec and running[B:] != nondec:
            return False
        budget = cfg.max_num_batched_tokens - B
        if budget < 0:
            return False
        free = self.free - (self.cnt2[self.G % bs] if B else 0)
        if free < 0:
            return self._fcfs_preempt_step(t, True) if fcfs else self._policy_preempt_chunked(t)
        sched: list[tuple[LReq, int, int]] = []
        for r in nondec:
            if budget <= 0:
                break
            n, nb = _next_chunk(r, budget, bs)
            if nb > free:
                return self._fcfs_preempt_step(t, True) if fcfs else self._policy_preempt_chunked(t)
            free -= nb
            sched.append((r, n, nb))
            budget -= n
        waiting = self.waiting
        if waiting and budget > 0 and len(running) < cfg.max_num_seqs:  # else no admission
            nrun = len(running)
            maxs = cfg.max_num_seqs
            order: list[LReq] = waiting if self.ordered else self.policy.order_waiting(waiting, t)
            admitted = 0
            for r in order:
                if nrun >= maxs or budget <= 0:
                    break
                n, nb = _next_chunk(r, budget, bs)
                if nb > free:
                    break
                free -= nb
                sched.append((r, n, nb))
                budget -= n
                nrun += 1
                admitted += 1
            if admitted:
                new = [e[0] for e in sched[len(sched) - admitted:]]
                if self.ordered:  # the admitted are the queue's head
                    del waiting[:admitted]
                else:
                    for r in new:
                        waiting.remove(r)
                running.extend(new)
                nondec.extend(new)
        if not B and not sched:
            return None
        return self._apply(t, sched, B, free, cfg.max_num_batched_tokens - budget, True)

    def _apply(self, t: float, sched: list[tuple[LReq, int, int]], B: int, free: int, num_tokens: int, decode_pool: bool) -> float:
        """Charge a fast step's latency and apply its outputs. `sched` lists the explicit
        (non-pooled) requests (request, new tokens, new blocks); `B` pooled decoders ride
        along when `decode_pool`."""
        bs = self.bs
        dctx = self.S if decode_pool else 0
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
        a = self.latency.shape_s(nb_sched, num_tokens)
        dur = a + self.dec * dctx + self.pre * pairs + enc
        end = t + dur
        self.free = free
        if decode_pool:
            self.G += 1
            self.S += B
        nondec = self.nondec
        done = False
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
                    self.running.remove(r)
                    self.free += r.kv_blocks
                    r.kv_blocks = 0
                    if r.request_id == CANDIDATE_ID:
                        done = True
                elif r.kv_blocks == -(-c // bs):
                    nondec.remove(r)
                    self._join(r)
                # else: holds more blocks than its tokens need (a snapshot taken with
                # look-ahead slots): it stays explicit, stepped one token at a time
        if decode_pool and self.heap and self.heap[0][0] < self.G:
            done = self._pop_finished(end) or done
        self._done = done
        return dur

    def _fast_step_prioritized(self, t: float, fcfs: bool) -> float | None | bool:
        cfg, bs = self.cfg, self.bs
        waiting, running = self.waiting, self.running
        free = self.free
        sched: list[tuple[LReq, int, int]] = []
        if waiting and len(running) < cfg.max_num_seqs:  # else no admission
            budget = cfg.prefill_budget
            nrun = len(running)
            maxs = cfg.max_num_seqs
            order: list[LReq] = waiting if self.ordered else self.policy.order_waiting(waiting, t)
            tokens = 0
            for r in order:
                c = r.num_computed_tokens
                n = r.prompt_tokens + r.num_generated_tokens - c
                if nrun >= maxs or n > budget:
                    break
                nb = -(-(c + n) // bs) - r.kv_blocks
                if nb > 0:
                    if nb > free:
                        break
                    free -= nb
                else:
                    nb = 0
                sched.append((r, n, nb))
                budget -= n
                tokens += n
                nrun += 1
            if sched:
                new = [e[0] for e in sched]
                if self.ordered:
                    del waiting[: len(new)]
                else:
                    for r in new:
                        waiting.remove(r)
                running.extend(new)
                self.nondec.extend(new)
                return self._apply(t, sched, 0, free, tokens, False)
        if self.nondec:
            return False
        B = self.B
        if not B:
            return None
        free -= self.cnt2[self.G % bs]
        if free < 0:
            return self._fcfs_preempt_step(t, False) if fcfs else False
        return self._apply(t, sched, B, free, B, True)

    def _policy_preempt_chunked(self, t: float) -> float | None:
        """A chunked-prefill step whose running pass runs out of KV blocks, for any
        policy: the pass of `InstanceSim._schedule_chunked` (the policy names each victim;
        a victim already scheduled in this step is taken out of it again) on the
        look-ahead's own state. Pooled requests are first re-based to the current tick,
        so the policy sees current fields; one the pass leaves unscheduled (it stopped
        at a request that preempted itself) is paused: re-based to the next tick with
        its tokens unchanged. No admissions follow a preemption.
        Returns the duration, or `PREEMPTED_ONLY`."""
        run, G, bs, cnt2 = self.running, self.G, self.bs, self.cnt2
        policy = self.policy
        for r in run:
            pg = r.pool_g
            if pg >= 0:
                if pg != G:
                    d = G - pg
                    r.num_computed_tokens += d
                    r.num_generated_tokens += d
                    r.pool_g = G
                r.kv_blocks = -(-r.num_computed_tokens // bs)
        F = self.free
        budget = self.M
        sched: list[tuple[LReq, int, int]] = []
        waiting, nondec = self.waiting, self.nondec
        preempted = False
        i = 0
        while i < len(run) and budget > 0:
            r = run[i]
            n, nb = _next_chunk(r, budget, bs)
            self_victim = False
            while nb > F:
                if self.vkeyed:  # the largest (vkey, index), without calling the policy
                    vidx = 0
                    vk = run[0].vkey
                    for j in range(1, len(run)):
                        kj = run[j].vkey
                        if not kj < vk:
                            vidx = j
                            vk = kj
                    victim = run[vidx]
                elif self.vgrouped:  # ask the policy among each group's last (key, index)
                    best: dict[Any, int] = {}
                    for j in range(len(run)):
                        g, kj = run[j].vkey
                        b = best.get(g)
                        if b is None or not kj < run[b].vkey[1]:
                            best[g] = j
                    idxs = sorted(best.values())
                    reps = [run[j] for j in idxs]
                    victim = policy.preemption_victim(reps, t)
                    vidx = idxs[reps.index(victim)]
                else:
                    victim = policy.preemption_victim(run, t)
                    vidx = run.index(victim)
                if vidx < i:  # already in this step: undo it (vLLM V1 does too)
                    for j, e in enumerate(sched):
                        if e[0] is victim:
                            budget += e[1]
                            del sched[j]
                            break
                    i -= 1
                del run[vidx]
                F += victim.kv_blocks
                if victim.pool_g >= 0:
                    vc = victim.num_computed_tokens
                    rho = (G - vc) % bs
                    cnt2[rho] -= 1
                    cnt2[rho + bs] -= 1
                    self.B -= 1
                    self.S -= vc + 1
                    victim.pool_g = -1  # its heap entry is now stale
                else:
                    nondec.remove(victim)
                victim.kv_blocks = 0
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                self._requeue(victim)
                preempted = True
                if victim is r:
                    self_victim = True
                    break
            if self_victim:
                break
            r.kv_blocks += nb
            F -= nb
            sched.append((r, n, nb))
            budget -= n
            i += 1
        assert preempted, "called without a failing allocation"
        scheduled = {id(e[0]) for e in sched}
        paused_ctx = 0
        for r in run:
            if r.pool_g >= 0 and id(r) not in scheduled:  # pause: same tokens at G + 1
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
                heapq.heappush(self.heap, (G + 1 + r.target_output_tokens - r.num_generated_tokens - 1,
                                           self.seq, r))
                paused_ctx += c + 1
        if not sched:
            self.free = F
            self.G = G + 1  # paused members were re-based to G + 1; nothing ran
            return PREEMPTED_ONLY
        pooled = 0
        explicit: list[tuple[LReq, int, int]] = []
        ntok = 0
        for r, n, _nb in sched:
            ntok += n
            if r.pool_g >= 0:
                pooled += 1
            else:
                explicit.append((r, n, 0))  # blocks already added
        self.S -= paused_ctx
        dur = self._apply(t, explicit, pooled, F, ntok, True)
        self.S += paused_ctx
        return dur

    def _fcfs_preempt_step(self, t: float, chunked: bool) -> float | bool:
        """A step whose running pass runs out of KV blocks, under FCFS (victim = the last
        running request): scan the running list in order, preempting from the tail until
        each allocation fits (vLLM V1 `Scheduler.schedule()`); no admissions follow a
        preemption. Returns the duration, or False for the careful path."""
        run, G, bs = self.running, self.G, self.bs
        F = self.free
        B, nondec = self.B, self.nondec
        if len(run) == B + len(nondec) and (not nondec or (chunked and run[B:] == nondec)):
            return self._fcfs_preempt_tail(t, chunked)
        budget = self.cfg.max_num_batched_tokens if chunked else MAX_LOOKAHEAD_STEPS
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
                    return False
                n, nb = _next_chunk(r, budget, bs)
            if nb > F:
                while nb > F and end > i:
                    end -= 1
                    v = run[end]
                    vg = v.pool_g
                    F += -(-(v.num_computed_tokens + G - vg) // bs) if vg >= 0 else v.kv_blocks
                if end == i:
                    break
            F -= nb
            budget -= n
            ntok += n
            if pg < 0:
                ents.append((r, n, nb))
            i += 1
        if end == len(run):
            return False
        for j in range(i, end):
            if run[j].pool_g >= 0:
                return False  # a pooled decoder would be left unscheduled
        return self._evict_tail(t, end, ents, F, ntok)

    def _fcfs_preempt_tail(self, t: float, chunked: bool) -> float | bool:
        """`_fcfs_preempt_step` when the running list is the B pooled decoders followed
        by the unpooled tail: O(victims + tail). Under FCFS the greedy pass (preempt the
        last request whenever the current allocation fails) keeps the longest prefix
        run[:e] whose block needs fit the free pool plus the blocks the suffix run[e:]
        held; that prefix is found by peeling the suffix from the end."""
        run, G, bs, B = self.running, self.G, self.bs, self.B
        F = self.free
        budget = self.cfg.max_num_batched_tokens - B if chunked else 0
        nd: list[tuple[LReq, int, int]] = []
        need = self.cnt2[G % bs] if B else 0
        ntok = B
        for r in self.nondec:
            if budget <= 0:
                nd.append((r, 0, 0))
                continue
            n, nb = _next_chunk(r, budget, bs)
            nd.append((r, n, nb))
            need += nb
            budget -= n
            ntok += n
        e = len(run)
        while need > F:
            e -= 1
            v = run[e]
            if e >= B:
                _r, n, nb = nd[e - B]
                need -= nb
                ntok -= n
                F += v.kv_blocks
            else:
                c = v.num_computed_tokens + G - v.pool_g
                if c % bs == 0:
                    need -= 1
                ntok -= 1
                F += -(-c // bs)
        if e == len(run):
            return False
        ents = [x for x in nd[: max(0, e - B)] if x[1] > 0]
        return self._evict_tail(t, e, ents, F - need, ntok)

    def _evict_tail(self, t: float, end: int, ents: list[tuple[LReq, int, int]], F: int, ntok: int) -> float:
        """Preempt run[end:] by recompute (they go to the front of waiting, in running
        order, as repeated vLLM `prepend_request` calls leave them), then run the step of
        the survivors: the pooled decoders plus `ents`, with `F` blocks left free."""
        run, G, bs = self.running, self.G, self.bs
        cnt2 = self.cnt2
        victims = run[end:]
        del run[end:]
        for v in victims:
            vg = v.pool_g
            if vg >= 0:
                c_e = v.num_computed_tokens
                d = G - vg
                rho = (vg - c_e) % bs
                cnt2[rho] -= 1
                cnt2[rho + bs] -= 1
                self.B -= 1
                self.S -= c_e + d + 1
                v.num_generated_tokens += d
                v.pool_g = -1
            else:
                self.nondec.remove(v)
            v.num_computed_tokens = 0
            v.kv_blocks = 0
            v.num_preemptions += 1
        self.waiting[:0] = victims
        B = self.B
        if not B and not ents:
            self.free = F  # the victims' blocks are free again; nothing ran
            return PREEMPTED_ONLY
        return self._apply(t, ents, B, F, ntok, True)

    def _jump_len(self, t: float, G: int, S: int, B: int, F: int, fmin: int, added: bool,
                  arrival: float) -> tuple[int, float, int, bool]:
        """Length of a pure decode run of the B pooled decoders from tick G (context sum S,
        F free blocks): up to the first finish (`fmin` = its last tick), until the clock
        reaches the candidate's `arrival` (when not yet `added`), and no further than the
        last step whose block allocations fit F.

        Returns (n steps, a = shape_s(B, B) in seconds, blocks the n steps allocate,
        exhausted: True when step n + 1 would run out of blocks). The run takes
        n*a + decode_attn*(n*S + B*n(n-1)/2) seconds (the caller adds it)."""
        bs, cnt2 = self.bs, self.cnt2
        n = fmin - G + 1
        a = self.latency.shape_s(B, B)
        dec = self.dec
        if not added and t + n * a + dec * (n * S + B * (n * (n - 1) // 2)) >= arrival:
            k = self._steps_to_reach(arrival - t, a, dec, S, B)
            if k < n:
                n = k
        r0 = G % bs
        q = n // bs
        need = q * B
        for j in range(r0, r0 + n - q * bs):  # (a loop, not sum(slice): no list built)
            need += cnt2[j]
        if need <= F:
            return n, a, need, False
        # the last step whose allocations fit: q whole periods of bs ticks (B blocks
        # each), then residues while the running need stays within what is left
        q = F // B
        rem = F - q * B
        acc = 0
        i = r0
        while True:
            acc += cnt2[i]
            if acc > rem:
                break
            i += 1
        return q * bs + i - r0, a, q * B + acc - cnt2[i], True  # step n + 1 would preempt

    @staticmethod
    def _peel_pooled(run: list[LReq], e: int, N: int, F: int, G: int, bs: int) -> tuple[int, int, int]:
        """FCFS victims off the pooled part of the running list: while the kept decoders
        run[:e] need N new blocks (one each whose context at tick G is a multiple of bs)
        and only F are free, drop run[e - 1] (its blocks return to F).
        Returns (e, N, F) for the kept prefix run[:e]."""
        while N > F:
            e -= 1
            v = run[e]
            c = v.num_computed_tokens + G - v.pool_g
            if c % bs == 0:
                N -= 1
            F += -(-c // bs)
        return e, N, F

    def _fcfs_chunked_loop(self, t: float, arrival: float, added: bool,
                           cand: LReq) -> tuple[float, int, int, float, bool, bool]:
        """The FCFS chunked-prefill event loop with all state in local variables (the
        hot path of `predict`). It handles the layout vLLM keeps under FCFS — the B
        pooled decoders followed by at most one partial prefill X at the tail — and
        every step that layout produces: jumps over pure decode runs (closed form),
        steps that continue X and/or admit waiting requests (completed prefills join the
        pool), and preemption by peeling FCFS victims off the tail (see
        `_fcfs_preempt_tail`). Anything else returns to `run` for one general step.
        Float operations per step are those of `_apply`.

        Returns (time, steps, events, next arrival, all arrived, candidate finished)."""
        run, waiting, nondec, heap, cnt2 = self.running, self.waiting, self.nondec, self.heap, self.cnt2
        G, S, B, F = self.G, self.S, self.B, self.free
        bs, M, maxs = self.bs, self.M, self.maxs
        seq_s, tok_s, dec, pre = self.seq_s, self.tok_s, self.dec, self.pre
        heappop, heappush = heapq.heappop, heapq.heappush
        seq = self.seq
        steps = events = 0
        done = False
        while steps <= MAX_LOOKAHEAD_STEPS:
            if not added and t >= arrival:
                arrival, added = self._arrive(t)
            room = M - B
            if B == 0 or room < 0:
                break
            x = None
            if nondec:
                if len(nondec) != 1 or len(run) != B + 1:
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
            n_t = cnt2[G % bs]
            # ---- jump over a pure decode run while the queue head cannot be admitted ----
            if x is None:
                if not waiting or B >= maxs or room == 0:
                    blocked = True
                else:
                    h = waiting[0]
                    hc = h.num_computed_tokens
                    hn = h.prompt_tokens + h.num_generated_tokens - hc
                    if hn > room:
                        hn = room
                    hk = -(-(hc + hn) // bs) - h.kv_blocks
                    blocked = hk > 0 and hk > F - n_t
                if blocked:
                    # jumps, finishes and preemptions until the head can be admitted
                    t, G, S, B, F, k, ev, arrival, added, done = self._d_run(t, G, S, B, F, added, arrival, cand)
                    steps += k
                    events += ev
                    if done:
                        break
                    continue
                elif hc == 0 and h.kv_blocks == 0 and h.prompt_tokens + h.num_generated_tokens > room:
                    # the head's prompt (or recompute) is longer than the budget: its
                    # admit / continue / preempt cycles tick by tick (see `_x_run`)
                    t, G, S, B, F, k, done = self._x_run(t, G, S, B, F, h, False, cand)
                    if k:
                        steps += k
                        events += k
                        if done:
                            break
                        continue
            elif x.prompt_tokens + x.num_generated_tokens - x.num_computed_tokens > room:
                # X continues with a partial chunk (see `_x_run`)
                t, G, S, B, F, k, done = self._x_run(t, G, S, B, F, x, True, cand)
                if k:
                    steps += k
                    events += k
                    if done:
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
            if need > F:
                # out of blocks: FCFS preempts the last running request until the
                # longest prefix whose needs fit (plus the victims' blocks) remains
                e = len(run)
                N = need
                Fx = F
                if x is not None:
                    e -= 1  # X is the last running request: always a victim
                    N -= xk
                    Fx += x.kv_blocks
                e, N, Fx = self._peel_pooled(run, e, N, Fx, G, bs)
                # `_evict_tail` then `_apply` of the B survivors, inlined for speed
                # (frequent under KV pressure: the calls cost ~8% of this loop at 48 running / 200 waiting)
                victims = run[e:]
                del run[e:]
                for v in victims:
                    vg = v.pool_g
                    if vg >= 0:
                        c_e = v.num_computed_tokens
                        d = G - vg
                        rho = (vg - c_e) % bs
                        cnt2[rho] -= 1
                        cnt2[rho + bs] -= 1
                        S -= c_e + d + 1
                        v.num_generated_tokens += d
                        v.pool_g = -1
                    else:
                        nondec.pop()
                    v.num_computed_tokens = 0
                    v.kv_blocks = 0
                    v.num_preemptions += 1
                waiting[:0] = victims
                B = e
                F = Fx - N
                events += 1
                if B == 0:
                    continue  # only preempted: no time passes
                t += seq_s[B] + tok_s[B] + dec * S + pre * 0.0 + 0.0
                G += 1
                S += B
                steps += 1
                if heap[0][0] < G:
                    S, B, F, done = self._pop_due(t, G, S, B, F)
                    if done:
                        break
                continue
            F -= need
            sched: list[tuple[LReq, int, int]] = []
            budget = room
            if xn > 0:
                sched.append((x, xn, xk))  # type: ignore[arg-type]
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
                        if hk > F:
                            break
                        F -= hk
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
            # `_apply`, inlined for speed (the per-step path of the hot loop)
            dctx = S
            pairs = 0.0
            enc = 0.0
            ntok = B
            for r, n, _k in sched:
                k0 = r.num_computed_tokens
                g = r.num_generated_tokens
                ntok += n
                if n == 1 and g > 0 and r.prompt_tokens + g - k0 == 1:
                    dctx += k0 + 1
                else:
                    pairs += n * k0 + n * (n + 1) / 2
                    if k0 == 0 and r.encoder_s:
                        enc += r.encoder_s
            bsz = B + len(sched)
            t += seq_s[bsz] + tok_s[ntok] + dec * dctx + pre * pairs + enc
            G += 1
            S += B
            steps += 1
            events += 1
            for r, n, k in sched:
                kv = r.kv_blocks = r.kv_blocks + k
                c = r.num_computed_tokens = r.num_computed_tokens + n
                g = r.num_generated_tokens
                if c >= r.prompt_tokens + g:
                    g += 1
                    r.num_generated_tokens = g
                    if r.first_token_s is None:
                        r.first_token_s = t
                    if g >= r.target_output_tokens:
                        nondec.remove(r)
                        run.remove(r)
                        F += kv
                        r.kv_blocks = 0
                        r.finish_s = t
                        if r is cand:
                            done = True
                    elif kv == -(-c // bs):  # `_join`, inlined for speed (the per-step path)
                        nondec.remove(r)
                        r.pool_g = G
                        rho = (G - c) % bs
                        cnt2[rho] += 1
                        cnt2[rho + bs] += 1
                        B += 1
                        S += c + 1
                        seq += 1
                        r.pool_seq = seq
                        heappush(heap, (G + r.target_output_tokens - g - 1, seq, r))
            if heap and heap[0][0] < G:
                S, B, F, popped = self._pop_due(t, G, S, B, F)
                done = popped or done
            if done:
                break
        self.G, self.S, self.B, self.free, self.seq = G, S, B, F, seq
        return t, steps, events, arrival, added, done

    def _d_run(self, t: float, G: int, S: int, B: int, F: int, added: bool, arrival: float,
               cand: LReq) -> tuple[float, int, int, int, int, int, int, float, bool, bool]:
        """The blocked regime of `_fcfs_chunked_loop`: all running requests are the B
        pooled decoders and the queue head cannot be admitted (or the queue is empty, or
        `max_num_seqs` is reached). Repeats, with all state in locals: a closed-form jump
        of the decoders (`_jump_len`) to the next decoder finish, to the candidate's
        arrival, or to the last step whose block allocations fit; then the finishes
        (`_pop_finished`) or the preemption of the step that runs out of blocks (FCFS:
        peel victims off the tail until the survivors' needs fit, `_peel_pooled`; they
        join the queue head in running order and the survivors decode one step).

        Stops, with the state consistent for the loop, when the queue head becomes
        admissible, the pool empties, or the candidate finishes. Float operations are
        those of the loop's jump and preemption step.

        Returns (time, tick, context sum, decoders, free blocks, steps, events, next
        arrival, all arrived, candidate finished)."""
        run, waiting, heap, cnt2 = self.running, self.waiting, self.heap, self.cnt2
        bs, M, maxs = self.bs, self.M, self.maxs
        seq_s, tok_s, dec, pre = self.seq_s, self.tok_s, self.dec, self.pre
        heappop = heapq.heappop
        steps = events = 0
        done = False
        while True:
            while True:  # drop stale heap tops (entries of preempted requests)
                top = heap[0]
                r = top[2]
                if r.pool_seq == top[1] and r.pool_g >= 0:
                    break
                heappop(heap)
            r0 = G % bs
            pop = False
            if cnt2[r0] <= F:  # (else the very next step runs out of blocks: no jump)
                n, a, need, exhausted = self._jump_len(t, G, S, B, F, top[0], added, arrival)
                t += n * a + dec * (n * S + B * (n * (n - 1) // 2))
                G += n
                S += n * B
                F -= need
                steps += n
                events += 1
                pop = heap[0][0] < G
            else:
                exhausted = True
            if exhausted and not pop:
                # ---- the step that runs out of blocks: FCFS preemption ----
                e, N, F = self._peel_pooled(run, B, cnt2[G % bs], F, G, bs)
                victims = run[e:]
                del run[e:]
                for v in victims:
                    vg = v.pool_g
                    c_e = v.num_computed_tokens
                    d = G - vg
                    rho = (vg - c_e) % bs
                    cnt2[rho] -= 1
                    cnt2[rho + bs] -= 1
                    S -= c_e + d + 1
                    v.num_generated_tokens += d
                    v.pool_g = -1
                    v.num_computed_tokens = 0
                    v.kv_blocks = 0
                    v.num_preemptions += 1
                waiting[:0] = victims
                B = e
                F -= N
                events += 1
                if B == 0:
                    break  # only preempted: no time passes
                t += seq_s[B] + tok_s[B] + dec * S + pre * 0.0 + 0.0
                G += 1
                S += B
                steps += 1
                pop = heap[0][0] < G
            if pop:
                S, B, F, done = self._pop_due(t, G, S, B, F)
                if done or B == 0:
                    break
            if not added and t >= arrival:
                arrival, added = self._arrive(t)
            # ---- still blocked? (the loop's admission test) ----
            room = M - B
            if waiting and B < maxs and room > 0:
                h = waiting[0]
                hc = h.num_computed_tokens
                hn = h.prompt_tokens + h.num_generated_tokens - hc
                if hn > room:
                    hn = room
                hk = -(-(hc + hn) // bs) - h.kv_blocks
                if hk <= 0 or hk <= F - cnt2[G % bs]:
                    break
        return t, G, S, B, F, steps, events, arrival, added, done

    def _x_run(self, t: float, G: int, S: int, B: int, F: int, x: LReq, x_in: bool,
               cand: LReq) -> tuple[float, int, int, int, int, int, bool]:
        """Steps of a long prefill X beside the B pooled decoders, one tick at a time with
        O(1) work each (the hot path under KV pressure: X is admitted, continues with
        partial chunks, is preempted and readmitted while decoders finish around it).

        X's prompt (or recompute) is longer than the budget the decoders leave, so every
        step here schedules exactly: the B decoders plus X's next chunk of `room` tokens
        (X running at the tail, `x_in`), or the B decoders alone after preempting X (FCFS
        victim = the last running request = X; X returns to the queue head with nothing
        computed), or X's admission from the queue head with a first chunk of `room`
        tokens (the budget is then spent: nothing else is admitted). Decoders that finish
        leave the pool at the end of their step, as `_pop_finished` does.

        Stops, with the state consistent for `_fcfs_chunked_loop`, before a step that is
        anything else: X's final chunk, X blocked at the queue head, a preemption that
        must also take decoders, an empty pool, or a full `max_num_seqs`; and after the
        candidate finishes. Float operations per step are those of `_apply`.

        Returns (time, tick, context sum, decoders, free blocks, steps, candidate done).
        """
        run, waiting, nondec, heap, cnt2 = self.running, self.waiting, self.nondec, self.heap, self.cnt2
        bs, M, maxs = self.bs, self.M, self.maxs
        seq_s, tok_s, dec, pre = self.seq_s, self.tok_s, self.dec, self.pre
        xt = x.prompt_tokens + x.num_generated_tokens
        xc = x.num_computed_tokens
        xkv = x.kv_blocks
        x_enc = x.encoder_s
        steps = 0
        done = False
        while B:
            room = M - B
            n_t = cnt2[G % bs]
            if x_in:
                if xt - xc <= room:
                    break  # X's final chunk: completes its prefill (general step)
                xk = -(-(xc + room) // bs) - xkv
                if xk < 0:
                    xk = 0
                if n_t + xk <= F:  # continue X's prefill
                    F -= n_t + xk
                    a = seq_s[B + 1] + tok_s[M]  # B + room = M tokens
                    enc = 0.0
                    if xc == 0 and x_enc:
                        enc += x_enc
                    t += a + dec * S + pre * (0.0 + (room * xc + room * (room + 1) / 2)) + enc
                    xc += room
                    xkv += xk
                else:  # out of blocks: X (the last running request) is the first victim
                    if n_t > F + xkv:
                        break  # decoders must go too (general step)
                    F += xkv - n_t
                    run.pop()
                    nondec.pop()
                    x.num_computed_tokens = xc = 0
                    x.kv_blocks = xkv = 0
                    x.num_preemptions += 1
                    waiting.insert(0, x)
                    x_in = False
                    t += seq_s[B] + tok_s[B] + dec * S + pre * 0.0 + 0.0
            else:  # X at the queue head with nothing computed: admit it with `room` tokens
                if B >= maxs:
                    break
                xk = -(-room // bs)
                if n_t + xk > F:
                    break  # blocked: the general loop jumps the decoders
                F -= n_t + xk
                del waiting[0]
                run.append(x)
                nondec.append(x)
                x_in = True
                a = seq_s[B + 1] + tok_s[M]
                enc = 0.0
                if x_enc:
                    enc += x_enc
                t += a + dec * S + pre * (0.0 + (room * 0 + room * (room + 1) / 2)) + enc
                xc = room
                xkv = xk
            G += 1
            S += B
            steps += 1
            if heap[0][0] < G:
                S, B, F, done = self._pop_due(t, G, S, B, F)
                if done:
                    break
        if x_in:
            x.num_computed_tokens = xc
            x.kv_blocks = xkv
        return t, G, S, B, F, steps, done

    # -- the loop -------------------------------------------------------------------
    def run(self, cand: LReq, t0: float,
            pending: list[tuple[float, LReq]] | None = None) -> tuple[float, float, int, int]:
        """Run until the candidate finishes: (TTFT s, E2E s from t0, steps, events).

        pending: the future queue arrivals in order, (time s, request), the candidate
        among them (`lookahead.arrivals_order`); default: the candidate alone at its
        `arrival_s`."""
        if pending is None:
            pending = [(cand.arrival_s, cand)]
        self.pending = pending
        self.pending_i = 0
        cfg, bs = self.cfg, self.bs
        fcfs = _is_fcfs(self.policy)
        chunked = cfg.chunked_prefill
        max_tok = cfg.max_num_batched_tokens
        maxs = cfg.max_num_seqs
        pbudget = cfg.prefill_budget
        if not fcfs:  # keys computed once per request (they do not change)
            everyone = [*self.running, *self.waiting, *(r for _t, r in pending)]
            okey = self.policy.order_key(everyone)
            if okey is not None:
                for r in everyone:
                    r.okey = okey(r)
                self.keyfn = _OKEY
                self.waiting.sort(key=_OKEY)
            elif self.policy.time_dependent:
                groups = self.policy.order_groups(everyone)
                if groups is not None:
                    for r in everyone:
                        r.okey = groups(r)
                    self.grouped = True
            vkey = self.policy.victim_key(everyone)
            if vkey is not None:
                for r in everyone:
                    r.vkey = vkey(r)
                self.vkeyed = True
            else:
                vgroups = self.policy.victim_groups(everyone)
                if vgroups is not None:
                    for r in everyone:
                        r.vkey = vgroups(r)
                    self.vgrouped = True
        self.ordered = fcfs or self.keyfn is not None
        tdep = self.tdep = bool(self.policy.time_dependent) and self.keyfn is None
        fcfs_chunked = fcfs and chunked and not tdep
        dec = self.latency.profile.decode_attn_s_per_ctx_token
        arrival = pending[0][0]
        t = t0
        added = False
        steps = 0
        events = 0
        self._done = False
        while True:
            events += 1
            if not added and t >= arrival:
                arrival, added = self._arrive(t)
            if fcfs_chunked:
                t, k, ev, arrival, added, done = self._fcfs_chunked_loop(t, arrival, added, cand)
                if ev:
                    steps += k
                    events += ev
                    if done:
                        break
                    if steps > MAX_LOOKAHEAD_STEPS:
                        raise RuntimeError("look-ahead exceeded MAX_LOOKAHEAD_STEPS")
                    continue
            B = self.B
            # ---- pure decode run: jump ----
            if B and not self.nondec and (not chunked or B <= max_tok):
                W = self.waiting
                if not W or B >= maxs or (chunked and max_tok <= B):
                    blocked = True
                elif self.ordered and not tdep:  # inline `_admission_blocked` for the head
                    head = W[0]
                    c = head.num_computed_tokens
                    n = head.prompt_tokens + head.num_generated_tokens - c
                    if chunked:
                        if n > max_tok - B:
                            n = max_tok - B
                        nb = -(-(c + n) // bs) - head.kv_blocks
                        blocked = nb > 0 and nb > self.free - self.cnt2[self.G % bs]
                    elif n > pbudget:
                        blocked = True
                    else:
                        nb = -(-(c + n) // bs) - head.kv_blocks
                        blocked = nb > 0 and nb > self.free
                else:
                    blocked = self._admission_blocked(t, fcfs)
            else:
                blocked = False
            if blocked:
                G, S, free, cnt2 = self.G, self.S, self.free, self.cnt2
                heap = self.heap
                while heap[0][2].pool_seq != heap[0][1] or heap[0][2].pool_g < 0:
                    heapq.heappop(heap)  # stale entries of preempted requests
                n, a, need, exhausted = self._jump_len(t, G, S, B, free, heap[0][0], added, arrival)
                if n > 0:
                    t += n * a + dec * (n * S + B * (n * (n - 1) // 2))
                    G += n
                    self.G = G
                    self.S = S + n * B
                    self.free = free - need
                    steps += n
                    if heap[0][0] < G and self._pop_finished(t):
                        break
                if exhausted and fcfs:
                    # the next step runs out of blocks: all running requests are pooled
                    # decoders, so peel FCFS victims off the tail until the decoders'
                    # needs fit (see `_fcfs_preempt_tail`), then run the survivors.
                    if not added and t >= arrival:
                        arrival, added = self._arrive(t)
                    run = self.running
                    B = self.B
                    if len(run) != B:
                        continue
                    e, N, F = self._peel_pooled(run, B, cnt2[G % bs], self.free, G, bs)
                    dur = self._evict_tail(t, e, [], F - N, e)
                    if dur == PREEMPTED_ONLY:
                        continue  # only preempted: no time passes
                    t += dur
                    steps += 1
                    if self._done:
                        break
                    continue
                if n > 0:
                    continue
            # ---- one ordinary step ----
            step: float | bool | None
            if chunked:
                step = self._fast_step_chunked(t, fcfs)
            else:
                step = self._fast_step_prioritized(t, fcfs)
            if step is False:
                step = self._careful_step(t)
                self._done = cand.finish_s is not None
            if step is None:
                if not added:
                    t = arrival
                    continue
                raise RuntimeError("look-ahead made no progress (instance cannot admit any request)")
            if step == PREEMPTED_ONLY:
                continue
            t += step
            steps += 1
            if self._done:
                break
            if steps > MAX_LOOKAHEAD_STEPS:
                raise RuntimeError("look-ahead exceeded MAX_LOOKAHEAD_STEPS")
        assert cand.first_token_s is not None and cand.finish_s is not None
        return cand.first_token_s - t0, cand.finish_s - t0, steps, events

    @staticmethod
    def _steps_to_reach(gap_s: float, a: float, dec: float, S: int, B: int) -> int:
        """Smallest k ≥ 1 with k*a + dec*(k*S + B*k*(k-1)/2) ≥ gap_s (steps of a pure
        decode run until the clock reaches `gap_s` ahead)."""

        def elapsed(k: int) -> float:
            return k * a + dec * (k * S + B * (k * (k - 1) // 2))

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
        while k > 1 and elapsed(k - 1) >= gap_s:
            k -= 1
        while elapsed(k) < gap_s:
            k += 1
        return k
