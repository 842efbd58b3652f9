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
  failing probe to where it crosses the threshold (None when v is ∞ at the failing side).
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


def search_capacity(probe: Callable[[float], float | None], goal: CapacityGoal, *,
                    rates: Sequence[float] | None = None, start_rps: float = 4.0, min_rps: float = 0.5,
                    max_rps: float = 256.0, tolerance: float = 0.02, max_probes: int = 24,
                    label: str = "") -> CapacityResult:
    """Search the SLO capacity with `probe(rate) → percentile value (s)` (module docstring).

    A probe returning None (no value at all, e.g. every output empty) counts as failing.
    """
    probes: list[tuple[float, float | None, bool]] = []
    seen: dict[float, bool] = {}

    def test(rate: float) -> bool:
        v = probe(rate)
        ok = v is not None and v <= goal.threshold_s
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
        return CapacityResult(label, goal, best, _interpolate(probes, goal), probes, note)

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
            note = f"met the goal up to --capacity-max-rps {max_rps:g}"
    else:
        hi = r
        while hi > min_rps and len(probes) < max_probes:
            nxt = max(hi / 2, min_rps)
            if test(nxt):
                lo = nxt
                break
            hi = nxt
        if lo is None:
            note = f"missed the goal even at --capacity-min-rps {min_rps:g}"
    while lo is not None and hi is not None and (hi - lo) / lo > tolerance and len(probes) < max_probes:
        mid = (lo + hi) / 2
        if test(mid):
            lo = mid
        else:
            hi = mid
    if len(probes) >= max_probes and not note:
        note = f"stopped after {max_probes} probes"
    return CapacityResult(label, goal, lo, _interpolate(probes, goal), probes, note)


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
    if v1 is None or not math.isfinite(v1) or v1 <= v0:
        return None
    return r0 + (goal.threshold_s - v0) * (r1 - r0) / (v1 - v0)
