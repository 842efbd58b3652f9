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
    width: int = 1  # rates probed per round (`CapacitySearch`); 1: one after another
    rounds: int | None = None  # rounds of probes (width > 1 only; with width 1 it is the probe count)

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "goal": self.goal.describe(), "metric": self.goal.metric,
                "percentile": self.goal.percentile, "threshold_s": self.goal.threshold_s,
                "capacity_rps": self.capacity_rps, "interpolated_rps": self.interpolated_rps,
                "probes": [{"rate_rps": r, "value_s": (None if v is None else (v if math.isfinite(v) else "inf")),
                            "meets": ok} for r, v, ok in self.probes],
                "note": self.note,
                **({"width": self.width, "rounds": self.rounds} if self.width > 1 else {})}


STEADY_MIN_RATIO = 0.8
"""Completed / offered throughput over the second half of the arrivals below this ⇒ the
queue grows (or the run is an absorbed burst): the rate does not meet the goal."""
STEADY_MIN_WINDOW_E2E = 10.0
"""An arrival window shorter than this many mean E2Es is too short to show steady state."""


def requests_for_steady_state(rate_rps: float, mean_e2e_s: float) -> int:
    """Requests a run at `rate_rps` needs for its arrivals to span `STEADY_MIN_WINDOW_E2E`
    mean E2Es (`mean_e2e_s`, as a shorter probe measured it; a longer run's is no
    shorter), rounded up to a hundred."""
    return max(100, math.ceil(rate_rps * STEADY_MIN_WINDOW_E2E * mean_e2e_s / 100) * 100)


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
                    label: str = "", width: int = 1,
                    on_record: Callable[[CapacitySearch, float, bool], None] | None = None) -> CapacityResult:
    """Search the SLO capacity with `probe(rate) → percentile value (s)` or
    `→ (value, steady)` (module docstring), one round of `width` rates after another
    (`CapacitySearch`; the rates of a round are probed in ascending order).

    A probe returning None (no value at all, e.g. every output empty) counts as failing;
    so does one whose `steady` is False, whatever its value (listed in the note).
    """
    search = CapacitySearch(goal, rates=rates, start_rps=start_rps, min_rps=min_rps, max_rps=max_rps,
                            tolerance=tolerance, max_probes=max_probes, label=label, width=width)
    while batch := search.next_rates():
        for r in batch:
            ok = search.record(r, probe(r))
            if on_record is not None:
                on_record(search, r, ok)
    return search.result()


class CapacitySearch:
    """The capacity search as a state machine, so that an executor can probe the rates of
    a round in parallel: `next_rates()` gives the round's rates (ascending; [] when the
    search is over), `record(rate, got)` takes each one's probe result (value or
    (value, steady)), `result()` the outcome.

    The bracket after any round: hi = the lowest failing rate probed, lo = the highest
    passing rate below hi. A round of width W (`width`):
    - first round: start × 2^j for j = −⌊(W−1)/2⌋ … ⌈(W−1)/2⌉ (W = 1: the start alone);
    - no failing rate yet: the next W doublings above lo (up to `max_rps`);
    - no passing rate yet: the next W halvings below hi (down to `min_rps`);
    - a bracket: n = min(W, the fewest that reach the tolerance) evenly spaced rates
      (lo·(n+1−i) + hi·i)/(n+1), i = 1…n, so the bracket shrinks (n+1)× per round;
    - a grid (`rates`): the next W grid rates ascending, until a round holds a failure;
      capacity = the highest passing rate below the lowest failing one.
    Width 1 is today's search exactly (doubling, halving, bisection at (lo + hi)/2): the
    same rates in the same order. Same answer rule for W > 1: it stops, as W = 1 does,
    with lo passing, hi failing and (hi − lo)/lo ≤ `tolerance`; when v(λ) is
    non-decreasing both brackets hold the true capacity c, so both answers lie in
    [c/(1 + tolerance), c] and differ by less than a factor (1 + tolerance). A round is
    cut to the probes left of `max_probes` (a grid is not).
    """

    def __init__(self, goal: CapacityGoal, *, rates: Sequence[float] | None = None, start_rps: float = 4.0,
                 min_rps: float = 0.5, max_rps: float = 256.0, tolerance: float = 0.02, max_probes: int = 24,
                 label: str = "", width: int = 1):
        if width < 1:
            raise ValueError(f"width must be ≥ 1, got {width}")
        self.goal, self.label, self.width = goal, label, width
        self.grid = sorted(rates) if rates else None
        self.start = min(max(start_rps, min_rps), max_rps)
        self.min_rps, self.max_rps, self.tolerance, self.max_probes = min_rps, max_rps, tolerance, max_probes
        self.probes: list[tuple[float, float | None, bool]] = []  # (rate, value, meets) in probe order
        self.unsteady: list[float] = []  # rates whose latency met the goal but not steady state
        self.rounds = 0  # rounds asked for so far
        self.note = ""
        self._pending: list[float] = []  # rates of the current round not yet recorded
        self._done = False

    # -- the bracket -----------------------------------------------------------------------
    def bracket(self) -> tuple[float | None, float | None]:
        """(lo, hi) as the class docstring defines them (None: no such rate yet)."""
        fails = [r for r, _, ok in self.probes if not ok]
        hi = min(fails) if fails else None
        passes = [r for r, _, ok in self.probes if ok and (hi is None or r < hi)]
        return (max(passes) if passes else None), hi

    def _left(self) -> int:
        return self.max_probes - len(self.probes)

    def probes_left(self) -> tuple[int, int | None]:
        """(at least, at most) probes still to run, from the bracket and the rules above
        (None: no bound yet). With a bracket, W-rate rounds cut (hi − lo) by W + 1 each,
        until it is within the tolerance of lo, which only grows: at most
        ⌈log_{W+1}((hi − lo) / (tol · lo))⌉ rounds, at least the same with hi for lo
        (r rounds: r · W probes; width 1 is plain bisection). Before a
        bracket: at least one more round (a doubling or halving), at most the doublings
        (halvings) to the search bound plus the bisection of the widest possible bracket
        (factor 2) after it. Capped by `max_probes`; a grid: its untried rates."""
        import math

        if self._done:
            return 0, 0
        left = self._left()
        if self.grid is not None:
            n = 0 if any(not ok for _, _, ok in self.probes) else len([r for r in self.grid if r not in
                                                                        {p[0] for p in self.probes}])
            return min(1, n), n
        w = self.width

        def bisect_probes(ratio: float) -> int:
            if ratio <= self.tolerance:
                return 0
            return math.ceil(math.log(ratio / self.tolerance) / math.log(w + 1) - 1e-9) * w

        if not self.probes:
            return min(w, left), None
        lo, hi = self.bracket()
        if lo is not None and hi is not None:
            return min(bisect_probes((hi - lo) / hi), left), min(bisect_probes((hi - lo) / lo), left)
        if hi is None:  # doubling from lo up to max_rps
            assert lo is not None
            steps = math.ceil(math.log2(self.max_rps / lo) - 1e-9) if lo < self.max_rps else 0
        else:  # halving from hi down to min_rps
            steps = math.ceil(math.log2(hi / self.min_rps) - 1e-9) if hi > self.min_rps else 0
        if steps == 0:
            return 0, 0
        most = min(steps + bisect_probes(1.0), left)  # the last step leaves a factor-2 bracket
        return min(1, most), most

    def next_rates(self) -> list[float]:
        """The next round's rates, ascending ([] when the search is over). Every rate of a
        round has to be `record`ed before the next call."""
        if self._pending:
            raise RuntimeError(f"rates {self._pending} of the last round were not recorded")
        if self._done:
            return []
        batch = self._plan()
        if not batch:
            self._done = True
            self._finish_note()
            return []
        self.rounds += 1
        self._pending = list(batch)
        return batch

    def _plan(self) -> list[float]:
        seen = {r for r, _, _ in self.probes}
        if self.grid is not None:  # every grid rate up to the first failing one (max_probes does not apply)
            if any(not ok for _, _, ok in self.probes):
                return []
            return [r for r in self.grid if r not in seen][:self.width]
        w = min(self.width, self._left())
        if not self.probes:
            lo_j = -((self.width - 1) // 2)
            ladder = [min(max(self.start * 2.0 ** j, self.min_rps), self.max_rps)
                      for j in range(lo_j, lo_j + self.width)]
            return sorted(dict.fromkeys(ladder))[:max(w, 0)] if w > 0 else []
        if w <= 0:
            return []
        lo, hi = self.bracket()
        if hi is None:  # every rate met the goal: double up to max_rps
            assert lo is not None
            out, r = [], lo
            while r < self.max_rps and len(out) < w:
                r = min(r * 2, self.max_rps)
                out.append(r)
            return [x for x in out if x not in seen]
        if lo is None:  # every rate missed: halve down to min_rps
            out, r = [], hi
            while r > self.min_rps and len(out) < w:
                r = max(r / 2, self.min_rps)
                out.append(r)
            return sorted(x for x in out if x not in seen)
        if (hi - lo) / lo <= self.tolerance:
            return []
        n = 1
        while n < w and (hi - lo) / (n + 1) > self.tolerance * lo:
            n += 1
        return [(lo * (n + 1 - i) + hi * i) / (n + 1) for i in range(1, n + 1)]

    def record(self, rate: float, got: Any) -> bool:
        """Take the probe result of `rate` (a value, or (value, steady)); → it meets the goal."""
        if rate not in self._pending:
            raise RuntimeError(f"rate {rate} was not asked for in this round")
        self._pending.remove(rate)
        v, steady = got if isinstance(got, tuple) else (got, True)
        ok = v is not None and v <= self.goal.threshold_s
        if ok and not steady:
            self.unsteady.append(rate)
            ok = False
        self.probes.append((rate, v, ok))
        return ok

    def _finish_note(self) -> None:
        lo, hi = self.bracket()
        if self.grid is not None:
            if lo is not None and lo == max(self.grid):
                self.note = "every rate of the grid met the goal: capacity may be higher"
            return
        if hi is None and lo is not None:
            self.note = f"met the goal up to the search bound {self.max_rps:g} req/s: raise --capacity-max-rate"
        elif lo is None:
            self.note = f"missed the goal even at {self.min_rps:g} req/s, the lowest rate searched"
        elif len(self.probes) >= self.max_probes:
            self.note = f"stopped after {self.max_probes} probes"

    def result(self) -> CapacityResult:
        """The outcome (call after `next_rates()` returned [])."""
        lo, _ = self.bracket()
        res = CapacityResult(self.label, self.goal, lo, _interpolate(self.probes, self.goal, lo), list(self.probes),
                             _join(self.note, self.unsteady))
        if self.width > 1:
            res.width, res.rounds = self.width, self.rounds
        return res


def _join(note: str, unsteady: list[float]) -> str:
    if not unsteady:
        return note
    rates = ", ".join(f"{r:.3g}" for r in sorted(unsteady))
    msg = (f"not steady at {rates} req/s: the latency goal held but completions fell below "
           f"{STEADY_MIN_RATIO:.0%} of arrivals (queue growing), so those rates fail")
    return f"{note}; {msg}" if note else msg


def _interpolate(probes: list[tuple[float, float | None, bool]], goal: CapacityGoal,
                 capacity: float | None) -> float | None:
    passing = [(r, v) for r, v, ok in probes if ok and v is not None and capacity is not None and r <= capacity]
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
