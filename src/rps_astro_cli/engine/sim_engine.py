"""The sim engine's async core: one `InstanceSim` stepped in wall-clock time.

Clock: the engine keeps *simulated* seconds, `now_s = (loop.time() - t0) / time_scale`
(time_scale 1.0 = real time, 0.1 = ten times faster). Every time the engine reports
(`arrival_s`, `/status` `time_s`, TTFT/E2E metrics) is on this clock, so waiting times
computed by the Predictor from a snapshot are in the model's seconds at any time_scale.

Loop (one asyncio task):
1. no work → wait on an event set by `submit` / `abort` / `close`;
2. `res = inst.step(start_s)` where `start_s` is the previous step's scheduled end (so
   sleep overshoot does not accumulate), or now after idling or when the loop lags more
   than `max_lag_s` behind (then it resynchronizes instead of bursting);
3. sleep until the wall time of `start_s + res.duration_s`;
4. deliver: each sampled request's queue gets its new generated-token count; a finished
   request's queue then gets `FINISHED`.

Multimodal requests wait their preprocessing time (`VisionCharge.preprocess_s`) before
joining the waiting queue; their encoder time is charged to their first prefill step
by `InstanceSim`.

Output length (`target_output_tokens`): `max_tokens` under `ignore_eos`; else the client's
`vllm_xargs.astro_output_tokens` capped by max_tokens; else a draw from the profile's
`output_len` lognormal(mu, sigma) rounded and clipped to [1, min(output_len.max_tokens,
max_tokens)] with the engine's seeded `numpy.random.Generator` (with the request's `seed`:
a Generator of that seed, so the seed repeats the length). `stop` strings can end the
output earlier (`engine.synthetic`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from rps_astro_cli.engine.synthetic import OutputText, plan_output
from rps_astro_cli.policies.build import build_instance_policy
from rps_astro_cli.protocol.media import VisionCharge
from rps_astro_cli.protocol.openai import resolve_max_tokens
from rps_astro_cli.protocol.openai_types import ParsedRequest
from rps_astro_cli.rps.estimator import ProfileImpactEstimator
from rps_astro_cli.rps.queue_metrics import class_queue_metrics
from rps_astro_cli.sim.instance import InstanceSim
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.policy import InstancePolicy
from rps_astro_cli.sim.prefix_cache import block_hashes
from rps_astro_cli.sim.profile import ExecutionProfile
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.sim.status import request_status, snapshot
from rps_astro_cli.types import InstanceConfig, InstanceStatus

log = logging.getLogger(__name__)

FINISHED = -1  # queue marker after the last token count


class EngineFault(RuntimeError):
    """The engine failed while serving a request (a server fault, not a user mistake)."""


class EngineShutdown(EngineFault):
    """The engine stopped (shut down, or its drain period ended) before the request did."""


@dataclass(eq=False)
class EngineRequest:
    """One served request: the instance model's state plus its delivery queue.

    sim: the `SimRequest` inside the `InstanceSim`. queue: receives generated-token counts
    (int, increasing), then `FINISHED`, or an `EngineFault`. max_tokens: the resolved
    output bound (tokens). finish_reason: "length" if it stopped at max_tokens, else
    "stop". aborted: set by `SimEngine.abort`.
    """

    sim: SimRequest
    max_tokens: int
    finish_reason: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    preprocess_task: asyncio.Task | None = None
    ready_s: float | None = None  # engine clock: when preprocessing ends (it joins the queue)
    aborted: bool = False
    done: bool = False
    # the output text when the request has a seed or stop strings (`engine.synthetic`); None: the plain cycle
    text: OutputText | None = None
    last_token_s: float | None = None  # engine clock: when its latest token was delivered

    @property
    def request_id(self) -> str:
        return self.sim.request_id

    @property
    def prompt_tokens(self) -> int:
        return self.sim.prompt_tokens

    @property
    def output_tokens(self) -> int:
        return self.sim.target_output_tokens


@dataclass
class EngineCounters:
    """Monotonic totals for `/metrics`.

    prompt_tokens_total: prompt tokens of admitted requests. generation_tokens_total:
    tokens sampled. requests_finished_total / requests_aborted_total: counts.
    steps_total: engine steps run. steps_late_total: steps whose outputs were delivered
    more than `LATE_WALL_S` wall seconds after their scheduled end (the loop not keeping
    up). lag_wall_s_max: the largest such delay seen (wall seconds).
    """

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    requests_finished_total: int = 0
    requests_aborted_total: int = 0
    # requests ended per vLLM finished_reason ("stop", "length", "abort"; the failed: "error")
    finished_by_reason: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0,
                                                                         "error": 0})
    steps_total: int = 0
    steps_late_total: int = 0
    lag_wall_s_max: float = 0.0


LATE_WALL_S = 0.005
STEP_LOG = 4096  # steps a sim engine keeps for its Predictor's calibration (`steps_since`)


class SimEngine:
    """Runs `InstanceSim` in wall-clock time (see module docstring).

    profile: the execution profile. policy: an instance policy name or object.
    seed: seed of the engine's Generator (output-length draws). time_scale: wall seconds
    per simulated second (> 0). instance_id: name in `/status`. config_overrides: fields
    of `InstanceConfig` (num_gpu_blocks, max_num_seqs, max_num_batched_tokens,
    max_model_len, chunked_prefill); None values are ignored.
    on_first_token(ttft_s) / on_token(itl_s) (every later token: the gap since the
    request's previous one) / on_finish(er, end_s) (a request's last token, engine
    clock): optional callbacks, simulated seconds.

    Raises:
        AstroUserError: bad policy name or limits (from the policy registry / InstanceConfig).
    """

    def __init__(self, profile: ExecutionProfile, *, policy: str | InstancePolicy = "fcfs",
                 seed: int = 0, time_scale: float = 1.0, instance_id: str = "engine-0",
                 max_lag_s: float = 0.25, **config_overrides):
        from rps_astro_cli.errors import AstroUserError

        if not (time_scale > 0 and math.isfinite(time_scale)):
            raise AstroUserError(f"must be a finite number > 0 (wall seconds per engine second), got {time_scale}",
                                 field="--time-scale",
                                 fix="pass e.g. 1 for real time or 0.01 to run 100x faster (for instant answers, "
                                     "a virtual run: astro bench --virtual)")
        self.profile = profile
        self.config = InstanceConfig.from_profile(profile, **config_overrides)
        self.policy = build_instance_policy(policy, None, profile) if isinstance(policy, str) else policy
        self._impact = ProfileImpactEstimator(profile)  # per-class prefill backlog estimates
        self.inst = InstanceSim(self.config, LatencyModel(profile), self.policy)
        if self.inst.cache is not None:  # `/status?prefix_since=N`: the cached set's changes
            self.inst.cache.track_events(4 * self.config.num_gpu_blocks)
        self.rng = np.random.default_rng(seed)
        # the latest steps' shapes and durations (`steps_since`), for the Predictor's calibration
        self.step_log: collections.deque[tuple[int, int, int, float, float, float]] = collections.deque(maxlen=STEP_LOG)
        self.steps_logged = 0
        self.time_scale = float(time_scale)
        self.instance_id = instance_id
        self.max_lag_s = max_lag_s
        self.counters = EngineCounters()
        self.on_first_token = None
        self.on_token = None
        self.on_finish = None
        self._live: dict[str, EngineRequest] = {}
        self._ids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._closing = False
        self.draining = False  # set on SIGTERM: new requests are refused, in-flight ones finish

    def not_ready_reason(self) -> str | None:
        """None when the engine takes new requests, else why not (for `GET /ready`)."""
        if self._task is None:
            return "engine loop not started"
        if self._closing or self._task.done():
            return "engine loop stopped"
        if self.draining:
            return "draining: shutting down, finishing in-flight requests"
        return None

    # -- clock -----------------------------------------------------------------------
    def now_s(self) -> float:
        """Simulated seconds since `start()`."""
        return (self._loop.time() - self._t0) / self.time_scale

    def _wall(self, sim_s: float) -> float:
        return self._t0 + sim_s * self.time_scale

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        """Start the loop task on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self._wake = asyncio.Event()
        self._closing = False
        self._task = asyncio.create_task(self._run(), name=f"sim-engine-{self.instance_id}")

    async def close(self) -> None:
        """Stop the loop; pending requests get an `EngineFault`."""
        self._closing = True
        if self._wake:
            self._wake.set()
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for er in list(self._live.values()):
            self._fail(er, EngineShutdown("engine shut down"))

    def fail_all(self, reason: str) -> int:
        """End every live request with `EngineShutdown(reason)` (the drain period is
        over); returns how many."""
        live = list(self._live.values())
        for er in live:
            self._fail(er, EngineShutdown(reason))
        return len(live)

    def is_live(self, request_id: str) -> bool:
        """Whether a request with this id is queued or running now."""
        return request_id in self._live

    @property
    def num_live(self) -> int:
        """Requests admitted and not ended (preprocessing, waiting or running)."""
        return len(self._live)

    # -- requests --------------------------------------------------------------------
    def target_output_tokens(self, req: ParsedRequest, max_tokens: int,
                             rng: np.random.Generator | None = None) -> tuple[int, str]:
        """(output length, finish_reason) per the module docstring's rule; a drawn length
        comes from `rng` (default: the engine's Generator)."""
        if req.ignore_eos:
            return max_tokens, "length"
        if req.output_tokens is not None:
            n = min(req.output_tokens, max_tokens)
        else:
            d = self.profile.output_len
            draw = round(float((rng or self.rng).lognormal(d.mu, d.sigma)))
            n = max(1, min(draw, d.max_tokens, max_tokens))
        return n, ("length" if n >= max_tokens else "stop")

    def output_plan(self, req: ParsedRequest, max_tokens: int) -> tuple[int, str, OutputText | None]:
        """(output length, finish_reason, text) of a request. With a `seed`, its own
        Generator draws the length (when drawn) and the words, so a seed repeats its
        output; with `stop` strings, the output ends at the first one the text forms
        (`engine.synthetic.plan_output`; finish_reason "stop")."""
        rng = np.random.default_rng(req.seed) if req.seed is not None else None
        out, reason = self.target_output_tokens(req, max_tokens, rng)
        if rng is None and not req.stop:
            return out, reason, None
        text = plan_output(out, rng, req.stop, req.min_tokens, req.include_stop_str_in_output)
        if text.stop_reason is not None:
            return text.num_tokens, "stop", text
        return out, reason, text

    def submit(self, req: ParsedRequest, charge: VisionCharge = VisionCharge(),
               request_id: str | None = None, token_ids: Sequence[int] = ()) -> EngineRequest:
        """Admit a validated request: resolve its lengths and queue it (after its
        preprocessing delay, if any). Must be called on the engine's event loop.
        token_ids: the prompt's token ids (`protocol.openai.prompt_token_ids`) for the
        prefix cache; () = none, the request neither hits nor fills it.

        Raises:
            ApiError: 400 when prompt (+ max_tokens) exceeds max_model_len.
            RuntimeError: the engine was not started.
        """
        prompt = req.text_tokens + charge.vision_tokens
        max_tokens = resolve_max_tokens(req, prompt, self.config.max_model_len)
        if self._wake is None:
            raise RuntimeError("SimEngine.submit before start()")
        out, reason, text = self.output_plan(req, max_tokens)
        rid = request_id or f"req-{next(self._ids)}"
        sim = SimRequest(
            request_id=rid, arrival_s=self.now_s(), prompt_tokens=prompt, target_output_tokens=out,
            modality=req.modality, vision_tokens=charge.vision_tokens, encoder_s=charge.encoder_s,
            req_class=req.req_class, predicted_output_tokens=req.predicted_output_tokens,
            block_hashes=block_hashes(token_ids[:prompt], self.config.block_size) if token_ids else (),
        )
        er = EngineRequest(sim=sim, max_tokens=max_tokens, finish_reason=reason, text=text)
        self._live[rid] = er
        if charge.preprocess_s > 0:
            er.ready_s = sim.arrival_s + charge.preprocess_s
            er.preprocess_task = asyncio.create_task(self._preprocess(er, charge.preprocess_s))
        else:
            self._enqueue(er)
        return er

    async def _preprocess(self, er: EngineRequest, seconds: float) -> None:
        await asyncio.sleep(seconds * self.time_scale)
        if not er.aborted:
            self._enqueue(er)

    def _enqueue(self, er: EngineRequest) -> None:
        self.counters.prompt_tokens_total += er.sim.prompt_tokens
        self.inst.add(er.sim)
        self._wake.set()

    def abort(self, er: EngineRequest) -> None:
        """Stop a request (client gone): remove it from the instance and free its blocks."""
        if er.done or er.aborted:
            return
        er.aborted = True
        if er.preprocess_task and not er.preprocess_task.done():
            er.preprocess_task.cancel()
        self.inst.abort(er.sim)
        self._live.pop(er.request_id, None)
        self.counters.requests_aborted_total += 1
        self.counters.finished_by_reason["abort"] += 1
        self._wake.set()

    def _fail(self, er: EngineRequest, exc: Exception) -> None:
        self.inst.abort(er.sim)
        self._live.pop(er.request_id, None)
        if not er.done:
            self.counters.finished_by_reason["error"] += 1
        er.done = True
        er.queue.put_nowait(exc)

    # -- state -----------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.inst.running)

    @property
    def num_waiting(self) -> int:
        return len(self.inst.waiting)

    @property
    def num_preprocessing(self) -> int:
        return sum(1 for er in self._live.values() if er.preprocess_task and not er.preprocess_task.done())

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use (0–1; vLLM's `kv_cache_usage_perc`)."""
        return self.inst.num_blocks_used / self.config.num_gpu_blocks

    def status(self) -> InstanceStatus:
        """The `/status` snapshot at the engine's now, with the requests still in
        multimodal preprocessing as `arriving` (each with its `ready_s`)."""
        now = self.now_s()
        snap = snapshot(self.instance_id, now, self.inst, self.profile.profile_id)
        arriving = tuple(
            replace(request_status(er.sim), ready_s=er.ready_s)
            for er in self._live.values()
            if er.preprocess_task is not None and not er.preprocess_task.done() and not er.aborted
        )
        return replace(snap, classes=self.class_metrics(now), arriving=arriving)

    def class_metrics(self, now_s: float | None = None) -> dict[str, dict[str, float]]:
        """Per-class queue length, mean wait and prefill backlog of the waiting queue
        (RPS-Serve's queue manager; `rps.queue_metrics.class_queue_metrics`)."""
        now = now_s if now_s is not None else self.now_s() if self._loop is not None else 0.0
        return class_queue_metrics(self.inst.waiting, now, self._impact, getattr(self.policy, "classify", None))

    # -- the loop --------------------------------------------------------------------
    async def _run(self) -> None:
        inst = self.inst
        loop = self._loop
        wake = self._wake
        next_start_s: float | None = None
        while not self._closing:
            if not inst.has_work:
                wake.clear()
                await wake.wait()
                next_start_s = None
                continue
            now = self.now_s()
            start = now if next_start_s is None or now - next_start_s > self.max_lag_s else next_start_s
            try:
                res = inst.step(start)
            except Exception:  # a server fault: fail the live requests, keep serving
                log.exception("sim engine step failed; failing %d live requests", len(self._live))
                for er in list(self._live.values()):
                    self._fail(er, EngineFault("engine step failed"))
                inst.running.clear()
                inst.waiting.clear()
                inst.free_blocks = self.config.num_gpu_blocks
                next_start_s = None
                continue
            if not res.scheduled:  # nothing schedulable: wait for an arrival or abort
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), timeout=1.0)
                except TimeoutError:
                    pass
                next_start_s = None
                continue
            end = start + res.duration_s
            delay = self._wall(end) - loop.time()
            await asyncio.sleep(delay if delay > 0 else 0)
            lag = loop.time() - self._wall(end)
            c = self.counters
            c.steps_total += 1
            if lag > LATE_WALL_S:
                c.steps_late_total += 1
                if lag > c.lag_wall_s_max:
                    c.lag_wall_s_max = lag
            self._log_step(res.shape, res.duration_s)
            self._deliver(res, end)
            next_start_s = end

    def _log_step(self, shape: tuple[int, int, int, float, float], duration_s: float) -> None:
        self.step_log.append((*shape, duration_s))
        self.steps_logged += 1

    def steps_since(self, seq: int) -> dict[str, object]:
        """The steps logged after step number `seq` still in the log (`STEP_LOG` most):
        {"seq": steps logged in all, "rows": [[batch size, new tokens, decode context
        tokens, prefill pairs, encoder s, duration s (engine seconds)], ...]} — what a
        Predictor calibrates its step model from (`sim.calibration`)."""
        n = self.steps_logged - max(0, seq)
        rows = list(self.step_log)[-n:] if 0 < n else []
        return {"seq": self.steps_logged, "rows": [list(r) for r in rows]}

    def _deliver(self, res, end_s: float) -> None:
        live = self._live
        self.counters.generation_tokens_total += len(res.sampled)
        for req in res.sampled:
            er = live.get(req.request_id)
            if er is None:  # aborted while the step ran
                continue
            n = req.num_generated_tokens
            er.queue.put_nowait(n)
            if er.last_token_s is None:
                if self.on_first_token is not None:
                    self.on_first_token(end_s - req.arrival_s)
            elif self.on_token is not None:
                self.on_token(end_s - er.last_token_s)
            er.last_token_s = end_s
        for req in res.finished:
            er = live.pop(req.request_id, None)
            if er is None:
                continue
            er.done = True
            er.queue.put_nowait(FINISHED)
            self.counters.requests_finished_total += 1
            self.counters.finished_by_reason[er.finish_reason] += 1
            if self.on_finish is not None:
                self.on_finish(er, end_s)
