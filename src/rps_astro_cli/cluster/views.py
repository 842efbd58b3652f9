"""What a scheduler of the virtual cluster sees of the instances when it dispatches
(`cluster.virtual`'s module docstring): the live instances (`_LiveSeen`), or, with several
schedulers or a stale status, the status copies refreshed every Δ plus the scheduler's
own pending list (`_Herding`, `_StatusView`, `_Seen`)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from rps_astro_cli.cluster.instance import VirtualInstance
from rps_astro_cli.dispatch.loads import DispatchRequest, StatusRow, status_fields_of
from rps_astro_cli.sim.instance import StatusNames
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.types import InstanceConfig


class _StatusView(StatusNames):
    """An instance as a status copy shows it: what `predict_instance` and the loads read."""

    def __init__(self, sim: Any, running: list[SimRequest], waiting: list[SimRequest], free_blocks: int):
        self.config, self.latency, self.policy, self.cache = sim.config, sim.latency, sim.policy, sim.cache
        self.running, self.waiting, self.free_blocks = running, waiting, free_blocks
        self.num_preemptions_total = sim.num_preemptions_total


class _SeenBase:
    """The `dispatch.loads.InstanceView` part of `_Seen` / `_LiveSeen`: `sim` is the
    instance (or its stale copy), `sessions` the sessions' last instances."""

    __slots__ = ("index", "sim", "cfg", "sessions")
    healthy = True
    index: int
    sim: Any
    cfg: InstanceConfig
    sessions: dict[str, int]

    @property
    def caches_prefixes(self) -> bool:
        return self.sim.cache is not None

    def status_row(self) -> StatusRow:
        return status_fields_of(self.sim)

    def prefix_hit_tokens(self, req: DispatchRequest) -> int | None:
        cache = self.sim.cache
        if cache is None:
            return None
        hit: int = cache.lookup(req.block_hashes, (req.prompt_tokens - 1) // req.block_size)[0] * req.block_size
        return hit

    def served_session(self, session_id: str | None) -> bool:
        return session_id is not None and self.sessions.get(session_id) == self.index


class _Seen(_SeenBase):
    """One instance as a scheduler sees it through a status copy (a
    `dispatch.loads.InstanceView`, and what its look-ahead reads): the copy, its
    outstanding requests, its step's end and whether it was stepping, the requests still
    preprocessing, and the sessions' last instances."""

    __slots__ = ("outstanding", "busy_until", "stepping", "arriving")

    def __init__(self, index: int, sim: Any, outstanding: int, busy_until: float, stepping: bool,
                 arriving: list[SimRequest], cfg: InstanceConfig, sessions: dict[str, int]):
        self.index, self.sim, self.cfg, self.sessions = index, sim, cfg, sessions
        self.outstanding, self.busy_until, self.stepping, self.arriving = outstanding, busy_until, stepping, arriving


class _LiveSeen(_SeenBase):
    """One instance as a scheduler reading the live state sees it: `_Seen`'s names, read
    from the instance itself."""

    __slots__ = ("inst", "arriving")

    def __init__(self, inst: VirtualInstance, sessions: dict[str, int]):
        self.index, self.sim, self.cfg, self.sessions = inst.index, inst.sim, inst.config, sessions
        self.inst, self.arriving = inst, inst.arriving

    @property
    def outstanding(self) -> int:
        return self.inst.outstanding

    @property
    def busy_until(self) -> float:
        return self.inst.busy_until

    @property
    def stepping(self) -> bool:
        return self.inst.stepping


class _Herding:
    """Status copies refreshed every Δ, each scheduler's pending list, and the herding
    figures (`cluster.virtual`'s module docstring). Δ = 0: the schedulers read the live
    instances.

    summary(): schedulers, status_interval_s, count_pending; requests_per_scheduler;
    refreshes (status copies taken); queue_spread_mean — over the decisions, the mean of
    (longest − shortest) true queue (waiting + preprocessing requests) across the
    instances just after the request joined; unseen_sends_mean — over the decisions, the
    mean number of requests the other schedulers had sent to the chosen instance since
    its status copy (sends this scheduler could not know of; 0 when Δ = 0).
    """

    def __init__(self, live: list[_LiveSeen], s: int, interval_s: float, count_pending: bool):
        n = len(live)
        self.live_views = live
        self.insts = [v.inst for v in live]
        self.n, self.s, self.interval, self.count_pending = n, s, interval_s, count_pending
        self.snaps: list[_StatusView] = []
        self.snap_t: float | None = None
        self.snap_out = [inst.outstanding for inst in self.insts]
        self.snap_busy = [inst.busy_until for inst in self.insts]
        self.snap_stepping = [inst.stepping for inst in self.insts]
        self.snap_arriving: list[list[SimRequest]] = [[] for _ in range(n)]
        self.pending: list[list[list[SimRequest]]] = [[[] for _ in range(n)] for _ in range(s)]  # [sched][inst]
        self.per_sched = [0] * s
        self.refreshes = 0
        self._spread_sum = 0.0
        self._unseen_sum = 0
        self._decisions = 0

    @property
    def live(self) -> bool:
        return self.interval <= 0

    def refresh(self, now: float) -> None:
        """Before the event at `now`: a new copy when a refresh time kΔ ≤ now has passed
        since the last one (the state then is the state after every earlier event)."""
        if self.live:
            return
        tick = float(np.floor(now / self.interval) * self.interval)
        if self.snap_t is not None and tick <= self.snap_t:
            return
        self.snap_t = tick
        self.refreshes += 1
        insts = self.insts
        self.snaps = [_StatusView(sim, [copy.copy(r) for r in sim.running], [copy.copy(r) for r in sim.waiting],
                                  sim.free_blocks) for sim in (inst.sim for inst in insts)]
        self.snap_out = [inst.outstanding for inst in insts]
        self.snap_busy = [inst.busy_until for inst in insts]
        self.snap_stepping = [inst.stepping for inst in insts]
        self.snap_arriving = [[copy.copy(r) for r in inst.arriving] for inst in insts]
        for per in self.pending:  # sent before the copy: the status shows them now
            for q in per:
                q.clear()

    def views(self, sched: int, now: float) -> list[_Seen] | list[_LiveSeen]:
        """The instances as scheduler `sched` sees them at `now`: the status copies plus
        its own pending list — sent requests already at the engine queue join the copy's
        waiting queue, those still preprocessing its arriving list."""
        if self.live:
            return self.live_views
        views: list[_Seen] = []
        for i, v in enumerate(self.snaps):
            own = self.pending[sched][i] if self.count_pending else []
            lv = self.live_views[i]
            if own:
                queued = [r for r in own if r.arrival_s <= now]
                sim: _StatusView = _StatusView(v, v.running, v.waiting + queued, v.free_blocks)
                arr = self.snap_arriving[i] + [r for r in own if r.arrival_s > now]
            else:
                sim, arr = v, self.snap_arriving[i]
            views.append(_Seen(i, sim, self.snap_out[i] + len(own), self.snap_busy[i], self.snap_stepping[i], arr,
                               lv.cfg, lv.sessions))
        return views

    def sent(self, sched: int, i: int, sr: SimRequest) -> None:
        """Scheduler `sched` sent `sr` to instance `i` (after the instance got it)."""
        unseen = 0 if self.live else sum(len(self.pending[o][i]) for o in range(self.s) if o != sched)
        if not self.live:
            self.pending[sched][i].append(copy.copy(sr))
        self.per_sched[sched] += 1
        queues = [len(inst.sim.waiting) + len(inst.arriving) for inst in self.insts]
        self._spread_sum += max(queues) - min(queues)
        self._unseen_sum += unseen
        self._decisions += 1

    def summary(self) -> dict[str, Any]:
        d = max(1, self._decisions)
        return {"schedulers": self.s, "status_interval_s": self.interval, "count_pending": self.count_pending,
                "requests_per_scheduler": list(self.per_sched), "refreshes": self.refreshes,
                "queue_spread_mean": self._spread_sum / d, "unseen_sends_mean": self._unseen_sum / d}
