"""SLO capacity: the highest request rate at which a latency percentile stays within its
SLO (Astrolabe §5: "SLO capacity", P99 TTFT ≤ 10 s on 12 × A30 → 31.6 QPS).

Probe value v(λ) = the `percentile`-th percentile of `metric` over all requests of a run
at rate λ, a failed request counting as +∞ (`metrics.slo_percentile_value`). λ meets the
goal ⇔ v(λ) ≤ threshold. Latency grows with load, so v is assumed non-decreasing in λ.

- With a grid (`--rates`): every rate is probed in ascending order; capacity = the highest
  rate below the first failing one.
- Without: start at `start_rps`, double while the goal is met (up to `max_rps`), halve
  while it is not (down to `min_rps`), then bisect the bracket [pass, fail] until
  (hi − lo) / lo ≤ `tolerance`; capacity = lo.
- `interpolated_rps`: linear interpolation of v between the last passing and first
  failing probe to where it crosses the threshold (None when v is ∞ at the failing side,
  or when that probe failed steady state rather than the latency goal).

Steady state (`steady_state`): a latency percentile alone is not enough — a short run
whose requests all fit in the cluster's batch slots absorbs any "rate" as one burst and
meets a TTFT goal while the queue grows. So λ also has to reach steady state: over the
second half of the arrival window (t_mid, t_last], t_mid = (t_first + t_last) / 2 of the
requests' planned arrival times, the completed throughput (successful requests finishing
in that half / its length) must be ≥ `STEADY_MIN_RATIO` × the offered throughput
(arrivals in that half / its length). In steady state both are λ (after the warm-up of
about one mean E2E, which the first half absorbs); when the queue grows the completed
throughput is the service rate μ < λ; in an absorbed burst it is ~0. A run whose arrival
window is shorter than `STEADY_MIN_WINDOW_E2E` × the mean E2E is too short to tell
(`steady_state` says so in `short`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class CapacityGoal:
    """metric (ttft/tpot/e2el/nlat) at `percentile` must be ≤ `threshold_s` seconds."""

    metric: str = "ttft"
    percentile: float = 99.0
    threshold_s: float = 10.0

    def describe(self) -> str:
        return f"P{self.percentile:g} {self.metric} ≤ {self.threshold_s:g} s"


@dataclass
class CapacityResult:
    """Outcome of one capacity search.

    label: the policy variant. capacity_rps: highest passing rate (None if even the
    lowest probe failed). interpolated_rps: see module docstring. probes: (rate, value,
    meets) in probe order. note: why the search stopped early, if it did.
    """

    label: str
    goal: CapacityGoal
    capacity_rps: float | None
    interpolated_rps: float | None
    probes: list[tuple[float, float | None, bool]] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "goal": self.goal.describe(), "metric": self.goal.metric,
                "percentile": self.goal.percentile, "threshold_s": self.goal.threshold_s,
                "capacity_rps": self.capacity_rps, "interpolated_rps": self.interpolated_rps,
                "probes": [{"rate_rps": r, "value_s": (None if v is None else (v if math.isfinite(v) else "inf")),
                            "meets": ok} for r, v, ok in self.probes],
                "note": self.note}


STEADY_MIN_RATIO = 0.8
"""Completed / offered throughput over the second half of the arrivals below this ⇒ the
queue grows (or the run is an absorbed burst): the rate does not meet the goal."""
STEADY_MIN_WINDOW_E2E = 10.0
"""An arrival window shorter than this many mean E2Es is too short to show steady state."""


@dataclass(frozen=True)
class SteadyState:
    """Steady-state check of one run (module docstring).

    offered_rps / achieved_rps: arrivals / completions per second over the second half of
    the arrival window (None when the window is empty: one request, or all sent at once).
    window_s: t_last − t_first of the planned arrivals (s). mean_e2e_s: over successful
    requests (None when none). steady: achieved ≥ `STEADY_MIN_RATIO` × offered (True when
    it cannot be measured). short: window_s < `STEADY_MIN_WINDOW_E2E` × mean_e2e_s.
    """

    offered_rps: float | None
    achieved_rps: float | None
    window_s: float
    mean_e2e_s: float | None
    steady: bool
    short: bool

    def to_dict(self) -> dict[str, Any]:
        return {"offered_rps": self.offered_rps, "achieved_rps": self.achieved_rps, "window_s": self.window_s,
                "mean_e2e_s": self.mean_e2e_s, "steady": self.steady, "short": self.short}


def steady_state(records: Sequence[Any], min_ratio: float = STEADY_MIN_RATIO) -> SteadyState:
    """Steady-state check of one run's `RequestRecord`s (uses `scheduled_s`, `success`,
    `finish_s`, `e2e_s`; seconds from the run's start). See the module docstring."""
    if not records:
        return SteadyState(None, None, 0.0, None, True, False)
    arr = [r.scheduled_s for r in records]
    t0, t1 = min(arr), max(arr)
    window = t1 - t0
    e2e = [r.e2e_s for r in records if r.e2e_s is not None]
    mean_e2e = sum(e2e) / len(e2e) if e2e else None
    short = mean_e2e is not None and window < STEADY_MIN_WINDOW_E2E * mean_e2e
    if window <= 0:
        return SteadyState(None, None, window, mean_e2e, True, short)
    mid = (t0 + t1) / 2
    half = t1 - mid
    n_arr = sum(1 for a in arr if a > mid)
    n_done = sum(1 for r in records if r.success and r.finish_s is not None and mid < r.finish_s <= t1)
    return SteadyState(n_arr / half, n_done / half, window, mean_e2e, n_done >= min_ratio * n_arr - 1e-9, short)


def search_capacity(probe: Callable[[float], Any], goal: CapacityGoal, *,
                    rates: Sequence[float] | None = None, start_rps: float = 4.0, min_rps: float = 0.5,
                    max_rps: float = 256.0, tolerance: float = 0.02, max_probes: int = 24,
                    label: str = "") -> CapacityResult:
    """Search the SLO capacity with `probe(rate) → percentile value (s)` or
    `→ (value, steady)` (module docstring).

    A probe returning None (no value at all, e.g. every output empty) counts as failing;
    so does one whose `steady` is False, whatever its value (listed in the note).
    """
    probes: list[tuple[float, float | None, bool]] = []
    seen: dict[float, bool] = {}
    unsteady: list[float] = []

    def test(rate: float) -> bool:
        got = probe(rate)
        v, steady = got if isinstance(got, tuple) else (got, True)
        ok = v is not None and v <= goal.threshold_s
        if ok and not steady:
            unsteady.append(rate)
            ok = False
        probes.append((rate, v, ok))
        seen[rate] = ok
        return ok

    note = ""
    if rates:
        best = None
        for r in sorted(rates):
            if test(r):
                best = r
            else:
                break
        if best is not None and best == max(rates):
            note = "every rate of the grid met the goal: capacity may be higher"
        return CapacityResult(label, goal, best, _interpolate(probes, goal), probes, _join(note, unsteady))

    lo: float | None = None
    hi: float | None = None
    r = min(max(start_rps, min_rps), max_rps)
    if test(r):
        lo = r
        while lo < max_rps and len(probes) < max_probes:
            nxt = min(lo * 2, max_rps)
            if test(nxt):
                lo = nxt
            else:
                hi = nxt
                break
        if hi is None:
            note = f"met the goal up to the search bound {max_rps:g} req/s: raise --capacity-max-rate"
    else:
        hi = r
        while hi > min_rps and len(probes) < max_probes:
            nxt = max(hi / 2, min_rps)
            if test(nxt):
                lo = nxt
                break
            hi = nxt
        if lo is None:
            note = f"missed the goal even at {min_rps:g} req/s, the lowest rate searched"
    while lo is not None and hi is not None and (hi - lo) / lo > tolerance and len(probes) < max_probes:
        mid = (lo + hi) / 2
        if test(mid):
            lo = mid
        else:
            hi = mid
    if len(probes) >= max_probes and not note:
        note = f"stopped after {max_probes} probes"
    return CapacityResult(label, goal, lo, _interpolate(probes, goal), probes, _join(note, unsteady))


def _join(note: str, unsteady: list[float]) -> str:
    if not unsteady:
        return note
    rates = ", ".join(f"{r:.3g}" for r in sorted(unsteady))
    msg = (f"not steady at {rates} req/s: the latency goal held but completions fell below "
           f"{STEADY_MIN_RATIO:.0%} of arrivals (queue growing), so those rates fail")
    return f"{note}; {msg}" if note else msg


def _interpolate(probes: list[tuple[float, float | None, bool]], goal: CapacityGoal) -> float | None:
    passing = [(r, v) for r, v, ok in probes if ok and v is not None]
    failing = [(r, v) for r, v, ok in probes if not ok]
    if not passing or not failing:
        return None
    r0, v0 = max(passing)
    above = [(r, v) for r, v in failing if r > r0]
    if not above:
        return None
    r1, v1 = min(above)
    if v1 is None or not math.isfinite(v1) or v1 <= v0 or v1 <= goal.threshold_s:
        return None  # v1 ≤ threshold: it failed steady state, not the latency goal
    return r0 + (goal.threshold_s - v0) * (r1 - r0) / (v1 - v0)
