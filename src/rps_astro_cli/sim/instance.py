"""The vLLM-V1-faithful instance model: continuous batching with chunked prefill (or
prioritized prefill), paged KV blocks and preemption by recompute.

One `step(now_s)` follows vLLM V1's `Scheduler.schedule()` (vllm/v1/core/sched/
scheduler.py) then the model runner's output handling:

1. Running requests, in running order, each get `num_tokens - num_computed_tokens`
   new tokens (1 for a decode, the next chunk for an unfinished prefill), capped by the
   step's token budget (`max_num_batched_tokens`). A request needs
   ceil((computed + new) / block_size) KV blocks; when the pool cannot supply them, the
   policy's victim is preempted by recompute (blocks freed, computed tokens reset, put
   at the front of the waiting queue) until the allocation fits or the victim is the
   request itself.
2. Only if nothing was preempted: waiting requests, in the policy's order, are admitted
   while the batch has room (`max_num_seqs`), budget is left and their first chunk's
   blocks fit (head-of-line: the first that does not fit stops admission). A policy
   with `preempts_for_waiting` (RPS-Serve's scheduler, which keeps running and waiting
   requests in one priority order: a waiting request may preempt a lower-priority running
   one for KV) first preempts the policy's victim while the waiting request `outranks`
   it, retrying after each; a victim already in this step's batch leaves it (its budget
   returns), as in the running pass.
3. The step takes `LatencyModel.step_s(...)` seconds. Every scheduled request whose
   whole sequence is now computed samples one token at the step's end; a request that
   reaches its target length finishes and frees its blocks.

Automatic prefix caching (`config.enable_prefix_caching`, on by default as in vLLM V1;
`sim/prefix_cache.py`): a waiting request with no computed tokens first takes its longest
run of cached full blocks (at least one token is always computed) and prefills only the
rest; its blocks are cached as they fill; freed blocks keep their hash in an LRU free
queue. A request without block hashes takes only anonymous blocks, so on length-only
workloads the model is exactly the uncached one.

Prioritized-prefill mode (`chunked_prefill=False`, vLLM's pre-chunking default): if any
waiting request can be admitted whole within the prefill budget, the step is
prefill-only (running decodes pause); otherwise it is a decode step of every running
request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.policy import InstancePolicy
from rps_astro_cli.sim.prefix_cache import PrefixCache
from rps_astro_cli.sim.request import SimRequest

# the `/status` limits, defined with the wire types (import them from there). Re-exported (`as`: explicitly,
# for mypy) only for the compiled look-ahead engine (`lookahead_engine/engine.py`, `instance_view.py`),
# which imports it from here; drop this once that package is next rebuilt.
from rps_astro_cli.types import InstanceConfig as InstanceConfig


@dataclass(slots=True)
class StepResult:
    """What one engine step did.

    duration_s: step latency (seconds; 0 when nothing was scheduled).
    shape: the step's latency features (see the field).
    scheduled: (request, new tokens computed) pairs, in batch order.
    sampled: requests that produced one output token at the step's end.
    finished: requests that completed in this step (blocks already freed).
    preempted: requests preempted by recompute while forming this step.
    """

    duration_s: float = 0.0
    # (batch size, new tokens, decode context tokens, prefill pairs, encoder s): the
    # features its latency was computed from (`sim.calibration.StepShape`)
    shape: tuple[int, int, int, float, float] = (0, 0, 0, 0.0, 0.0)
    scheduled: list[tuple[SimRequest, int]] = field(default_factory=list)
    sampled: list[SimRequest] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)
    preempted: list[SimRequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class StatusNames:
    """The names of an engine's `/status` (`types.InstanceStatus`) on a simulated
    instance or a copy of one (anything with `config` and `free_blocks`), so one reader of
    an instance's state serves both (`dispatch.loads.status_fields_of`)."""

    config: InstanceConfig
    free_blocks: int

    @property
    def limits(self) -> InstanceConfig:
        return self.config

    @property
    def kv_blocks_free(self) -> int:
        return self.free_blocks

    @property
    def kv_blocks_total(self) -> int:
        return self.config.num_gpu_blocks


class InstanceSim(StatusNames):
    """One instance's scheduler + KV cache + step clock (see module docstring).

    The caller owns time: `step(now_s)` forms and "runs" one batch starting at `now_s`
    and returns its duration; token/finish times are stamped `now_s + duration_s`.
    """

    def __init__(self, config: InstanceConfig, latency: LatencyModel, policy: InstancePolicy):
        self.config = config
        self.latency = latency
        self.policy = policy
        self.running: list[SimRequest] = []
        self.waiting: list[SimRequest] = []
        self.free_blocks = config.num_gpu_blocks
        self.num_preemptions_total = 0
        self.num_steps_total = 0
        # the prefix cache's table and free-queue order (None: caching off)
        self.cache: PrefixCache | None = PrefixCache(config.num_gpu_blocks) if config.enable_prefix_caching else None
        # prompt tokens looked up in / served from the prefix cache at admission (tokens;
        # vLLM's prefix_cache_queries / prefix_cache_hits)
        self.prefix_cache_queries_tokens = 0
        self.prefix_cache_hits_tokens = 0

    # -- queue ops -------------------------------------------------------------------
    def add(self, req: SimRequest) -> None:
        """Queue a new request (appended to the waiting queue)."""
        self.waiting.append(req)

    def abort(self, req: SimRequest) -> bool:
        """Remove a request wherever it is and free its blocks. True if it was present."""
        for q in (self.running, self.waiting):
            if req in q:
                q.remove(req)
                self._release(req)
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_blocks_used(self) -> int:
        return self.config.num_gpu_blocks - self.free_blocks

    # -- internals -------------------------------------------------------------------
    def _release(self, req: SimRequest) -> None:
        """Give back `req`'s blocks (cached ones keep their hash in the free queue)."""
        if self.cache is None:
            self.free_blocks += req.kv_blocks
        else:
            refs = req.cache_refs or ()
            self.free_blocks += self.cache.release(req.kv_blocks - len(refs), refs)
            req.cache_refs = None
            req.hashed_blocks = 0
        req.kv_blocks = 0

    def _allocate(self, req: SimRequest, num_new: int) -> bool:
        need = self.config.blocks_for(req.num_computed_tokens + num_new) - req.kv_blocks
        if need <= 0:
            return True
        if need > self.free_blocks:
            return False
        if self.cache is not None:
            self.cache.take(need)
        self.free_blocks -= need
        req.kv_blocks += need
        return True

    def _admit_cached(self, req: SimRequest, budget: int, chunked: bool) -> int | None:
        """Admit a fresh (or preempted) request with its prefix-cache hit: the new tokens
        to compute this step, or None when they do not fit (nothing is taken then)."""
        cache = self.cache
        assert cache is not None
        bs = self.config.block_size
        total = req.num_tokens
        hits, hits_free = cache.lookup(req.block_hashes, (total - 1) // bs)
        computed = hits * bs
        num_new = total - computed
        if chunked:
            num_new = min(num_new, budget)
        elif num_new > budget:
            return None
        need = self.config.blocks_for(computed + num_new) - hits
        if need + hits_free > self.free_blocks:
            return None
        if hits:
            touched = list(req.block_hashes[:hits])
            cache.touch(touched)
            self.free_blocks -= hits_free
            req.cache_refs = touched
            req.hashed_blocks = hits
            req.num_computed_tokens = computed
            if req.first_scheduled_s is None:
                req.num_cached_tokens = computed
        cache.take(need)
        self.free_blocks -= need
        req.kv_blocks = hits + need
        self.prefix_cache_queries_tokens += total
        self.prefix_cache_hits_tokens += computed
        return num_new

    def _preempt(self, victim: SimRequest) -> None:
        self.running.remove(victim)
        self._release(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.insert(0, victim)

    def _schedule_running(self, now_s: float, out: StepResult, budget: int | None) -> int:
        """Schedule running requests in running order; return the budget left.

        `budget` None = a prioritized-prefill decode step (one token each, no budget).
        When blocks run out, the policy's victim is preempted until the allocation fits
        or the victim is the request itself (which ends the pass, as in vLLM V1).
        """
        sched = out.scheduled
        i = 0
        while i < len(self.running) and (budget is None or budget > 0):
            req = self.running[i]
            num_new = 1 if budget is None else min(req.num_tokens - req.num_computed_tokens, budget)
            preempted_self = False
            while not self._allocate(req, num_new):
                victim = self.policy.preemption_victim(self.running, now_s)
                if self.running.index(victim) < i:  # already in this batch: undo it (vLLM V1 does too)
                    for j, (r, n) in enumerate(sched):
                        if r is victim:
                            if budget is not None:
                                budget += n
                            del sched[j]
                            break
                    i -= 1
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                break
            sched.append((req, num_new))
            if budget is not None:
                budget -= num_new
            i += 1
        return budget or 0

    def _admit_waiting(self, now_s: float, out: StepResult, budget: int, chunked: bool) -> None:
        """Admit waiting requests in the policy's order while the batch has room, budget
        is left and the first chunk's blocks fit (head-of-line: the first that does not
        fit stops admission). Without chunking a prompt must fit the budget whole."""
        policy = self.policy
        for req in policy.order_waiting(self.waiting, now_s):
            if len(self.running) >= self.config.max_num_seqs or budget <= 0:
                break
            while True:
                if self.cache is not None and req.kv_blocks == 0 and req.num_computed_tokens == 0:
                    got = self._admit_cached(req, budget, chunked)
                else:
                    got = req.num_tokens - req.num_computed_tokens
                    if chunked:
                        got = min(got, budget)
                    elif got > budget:
                        got = None
                    if got is not None and not self._allocate(req, got):
                        got = None
                if got is not None or not policy.preempts_for_waiting or not self.running:
                    break
                victim = policy.preemption_victim(self.running, now_s)
                if not policy.outranks(req, victim, now_s):
                    break
                for j, (r, n) in enumerate(out.scheduled):  # in this step's batch: it leaves it
                    if r is victim:
                        budget += n
                        del out.scheduled[j]
                        break
                self._preempt(victim)
                out.preempted.append(victim)
            if got is None:
                break
            num_new = got
            self.waiting.remove(req)
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new

    def _schedule_chunked(self, now_s: float, out: StepResult) -> None:
        budget = self._schedule_running(now_s, out, self.config.max_num_batched_tokens)
        if not out.preempted and self.waiting:
            self._admit_waiting(now_s, out, budget, chunked=True)

    def _schedule_prioritized(self, now_s: float, out: StepResult) -> None:
        if self.waiting:
            self._admit_waiting(now_s, out, self.config.prefill_budget, chunked=False)
        if not out.scheduled:
            self._schedule_running(now_s, out, None)

    # -- the step --------------------------------------------------------------------
    def step(self, now_s: float) -> StepResult:
        """Form one batch at `now_s`, charge its latency and apply its outputs."""
        out = StepResult()
        if self.config.chunked_prefill:
            self._schedule_chunked(now_s, out)
        else:
            self._schedule_prioritized(now_s, out)
        if not out.scheduled:
            return out
        num_tokens = 0
        decode_ctx = 0
        pairs = 0.0
        enc = 0.0
        for req, n in out.scheduled:
            num_tokens += n
            k = req.num_computed_tokens
            if n == 1 and req.num_generated_tokens > 0 and req.num_tokens - k == 1:
                decode_ctx += k + 1
            else:
                pairs += LatencyModel.prefill_pairs(n, k)
                if k == 0 and req.encoder_s:
                    enc += req.encoder_s
        dur = self.latency.step_s(len(out.scheduled), num_tokens, decode_ctx, pairs, enc)
        out.duration_s = dur
        out.shape = (len(out.scheduled), num_tokens, decode_ctx, pairs, enc)
        end_s = now_s + dur
        self.num_steps_total += 1
        cache = self.cache
        bs = self.config.block_size
        for req, n in out.scheduled:
            if req.first_scheduled_s is None:
                req.first_scheduled_s = now_s
            req.num_computed_tokens += n
            if cache is not None and req.block_hashes:
                full = min(req.num_computed_tokens // bs, len(req.block_hashes))
                if full > req.hashed_blocks:
                    refs = req.cache_refs
                    if refs is None:
                        refs = req.cache_refs = []
                    for h in req.block_hashes[req.hashed_blocks:full]:
                        if cache.register(h):
                            refs.append(h)
                    req.hashed_blocks = full
            if req.num_computed_tokens >= req.num_tokens:
                req.num_generated_tokens += 1
                out.sampled.append(req)
                if req.first_token_s is None:
                    req.first_token_s = end_s
                if req.num_generated_tokens >= req.target_output_tokens:
                    req.finish_s = end_s
                    out.finished.append(req)
        for req in out.finished:
            self.running.remove(req)
            self._release(req)
        return out
