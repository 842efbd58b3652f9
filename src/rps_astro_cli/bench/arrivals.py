"""Arrival processes: when each request is sent (seconds from the start of a run).

Inter-arrival gaps `g_i` (the first request is sent at t = 0, request i at Σ_{j<i} g_j):

- `poisson`: g ~ Exponential(mean 1/λ) — gamma with shape 1.
- `gamma` with burstiness b (the shape, as in `vllm bench serve --burstiness`):
  g ~ Gamma(shape = b, scale = 1/(λ·b)), so E[g] = 1/λ and CV[g] = 1/√b. b < 1 is
  burstier than Poisson, b > 1 smoother; b = ∞ is constant spacing. (The Astrolabe
  paper's bursty runs use b from 0.25 to 2.0.)
- `constant`: g = 1/λ.
- `trace`: the workload's own timestamps × `time_scale` (0.5 = twice as fast).
- λ = ∞ (`--request-rate inf`): every request at t = 0 (a closed burst; combine with
  `--max-concurrency` for a closed-loop run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rps_astro_cli.errors import AstroUserError

ARRIVAL_KINDS = ("poisson", "gamma", "constant", "trace")


def parse_positive(text: str | float, flag: str, allow_inf: bool = True, fix_inf: str | None = None) -> float:
    """Parse a rate/shape flag: a number > 0, or `inf` when `allow_inf`.

    Raises:
        AstroUserError: not a number, ≤ 0, NaN, or inf when not allowed (`fix_inf`: what
            to pass instead).
    """
    try:
        v = float(text)
    except (TypeError, ValueError):
        raise AstroUserError(f"expected a number, got {text!r}", field=flag) from None
    if math.isnan(v) or v <= 0:
        raise AstroUserError(f"must be > 0, got {text}", field=flag,
                             fix="use a positive number" + (" or inf" if allow_inf else ""))
    if math.isinf(v) and not allow_inf:
        raise AstroUserError(f"must be a finite number > 0, got {text}", field=flag,
                             fix=fix_inf or "pass a finite positive number")
    return v


def parse_rates(text: str) -> list[float]:
    """`--rates 10,15,20` → [10.0, 15.0, 20.0] (each > 0, finite, strictly increasing after sorting
    duplicates away).

    Raises:
        AstroUserError: empty list or a bad value.
    """
    vals = sorted({parse_positive(t.strip(), "--rates", allow_inf=False) for t in str(text).split(",") if t.strip()})
    if not vals:
        raise AstroUserError("expected comma-separated rates, e.g. 10,15,20", field="--rates")
    return vals


@dataclass(frozen=True)
class ArrivalSpec:
    """An arrival process.

    kind: one of ARRIVAL_KINDS.
    rate_rps: λ, requests per second (> 0; inf = all at once). Unused by `trace`.
    burstiness: gamma shape b (> 0; inf = constant). Poisson ⇔ b = 1.
    time_scale: multiplies trace timestamps (> 0).
    """

    kind: str = "poisson"
    rate_rps: float = math.inf
    burstiness: float = 1.0
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise AstroUserError(f"unknown arrival process {self.kind!r}", field="--arrival",
                                 fix=f"choose one of: {', '.join(ARRIVAL_KINDS)}")
        for name, flag in (("rate_rps", "--request-rate"), ("burstiness", "--burstiness"),
                           ("time_scale", "--time-scale")):
            v = getattr(self, name)
            if math.isnan(v) or v <= 0:
                raise AstroUserError(f"must be > 0, got {v}", field=flag)

    @property
    def effective_shape(self) -> float:
        """Gamma shape actually used: 1 for poisson, ∞ for constant, else `burstiness`."""
        return {"poisson": 1.0, "constant": math.inf}.get(self.kind, self.burstiness)

    def with_rate(self, rate_rps: float) -> ArrivalSpec:
        return ArrivalSpec(self.kind, rate_rps, self.burstiness, self.time_scale)

    def describe(self) -> str:
        if self.kind == "trace":
            return f"trace replay × {self.time_scale:g}"
        if math.isinf(self.rate_rps):
            return "all at t=0 (rate inf)"
        b = self.effective_shape
        name = "poisson" if b == 1 else "constant" if math.isinf(b) else f"gamma(b={b:g})"
        return f"{name} {self.rate_rps:g} req/s"


def arrival_times(spec: ArrivalSpec, n: int, rng: np.random.Generator,
                  trace_s: list[float | None] | None = None) -> np.ndarray:
    """Send times (seconds from the start, shape (n,), non-decreasing, first = 0).

    Raises:
        AstroUserError: `trace` asked for but the workload has no timestamps.
    """
    if n <= 0:
        return np.zeros(0)
    if spec.kind == "trace":
        if not trace_s or len(trace_s) < n or any(t is None for t in trace_s[:n]):
            raise AstroUserError("this workload has no timestamps to replay", field="--arrival",
                                 fix="use --arrival poisson/gamma/constant with --request-rate")
        t = np.asarray(trace_s[:n], dtype=float)
        bad = np.flatnonzero(~np.isfinite(t))
        if bad.size:
            raise AstroUserError(f"request {int(bad[0])}'s trace timestamp is {t[bad[0]]}; timestamps must be "
                                 "finite seconds", field="timestamp", fix="fix or drop that row of the trace")
        return (t - t[0]) * spec.time_scale
    if math.isinf(spec.rate_rps):
        return np.zeros(n)
    b = spec.effective_shape
    if math.isinf(b):
        gaps = np.full(n - 1, 1.0 / spec.rate_rps)
    else:
        gaps = rng.gamma(shape=b, scale=1.0 / (spec.rate_rps * b), size=n - 1)
    return np.concatenate(([0.0], np.cumsum(gaps)))
