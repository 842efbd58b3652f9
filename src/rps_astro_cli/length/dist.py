"""Reply length as a distribution: quantiles, and the remaining length of a running request.

A `LengthDistribution` is a set of quantiles q_1 ≤ … ≤ q_K (tokens) at cumulative levels
p_1 < … < p_K, read as the CDF

    F(x) = 0                                   for x ≤ min_tokens (= 1 token by default)
    F(x) linear between the points (min_tokens, 0), (q_1, p_1), …, (q_K, p_K)
    F(x) = 1 − (1 − p_K) · exp(−(x − q_K) / tail_mean_tokens)      for x > q_K

i.e. uniform density between neighbouring quantiles and an exponential (memoryless) tail
above the last one with mean excess `tail_mean_tokens`.

`remaining_tokens(dist, g)` is the expected remaining reply length of a request that has
already generated g tokens and not finished, E[L − g | L > g]:

    E[L − g | L > g] = ∫_g^∞ (1 − F(x)) dx / (1 − F(g))

which, with the CDF above, is a sum of trapezoids over the quantile segments right of g
plus (1 − p_K) · tail_mean_tokens for the tail (and exactly tail_mean_tokens once g ≥ q_K).
`remaining_tokens(dist, 0)` is the distribution's mean.

Pure functions and a frozen dataclass; nothing here depends on a model.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

DEFAULT_LEVELS: tuple[float, ...] = (0.1, 0.25, 0.5, 0.75, 0.9)
"""Quantile levels a length model returns unless it was calibrated with others."""


@dataclass(frozen=True)
class LengthDistribution:
    """Predicted reply length of one request (module docstring gives the CDF).

    levels: cumulative probabilities p_1 < … < p_K, each in (0, 1).
    quantiles_tokens: q_1 ≤ … ≤ q_K, reply tokens at those levels (each ≥ min_tokens).
    tail_mean_tokens: mean excess above q_K of the exponential tail (tokens, > 0).
    min_tokens: where the CDF starts (tokens; a reply has at least 1 token).
    """

    levels: tuple[float, ...]
    quantiles_tokens: tuple[float, ...]
    tail_mean_tokens: float
    min_tokens: float = 1.0

    def __post_init__(self) -> None:
        p, q = self.levels, self.quantiles_tokens
        if len(p) == 0 or len(p) != len(q):
            raise ValueError(f"need as many levels as quantiles (≥ 1), got {len(p)} and {len(q)}")
        if not all(0.0 < a < 1.0 for a in p) or any(b <= a for a, b in zip(p, p[1:])):
            raise ValueError(f"levels must increase strictly inside (0, 1), got {p}")
        if any(not math.isfinite(v) for v in q) or q[0] < self.min_tokens or any(b < a for a, b in zip(q, q[1:])):
            raise ValueError(f"quantiles must be finite, ≥ min_tokens and non-decreasing, got {q}")
        if not (self.tail_mean_tokens > 0 and math.isfinite(self.tail_mean_tokens)):
            raise ValueError(f"tail_mean_tokens must be a positive number, got {self.tail_mean_tokens}")

    def _points(self) -> tuple[list[float], list[float]]:
        """The CDF's knots (x tokens, F(x)) up to the last quantile."""
        return [self.min_tokens, *self.quantiles_tokens], [0.0, *self.levels]

    def cdf(self, tokens: float) -> float:
        """F(tokens) = P(L ≤ tokens)."""
        xs, ps = self._points()
        if tokens <= xs[0]:
            return 0.0
        if tokens > xs[-1]:
            return 1.0 - (1.0 - ps[-1]) * math.exp(-(tokens - xs[-1]) / self.tail_mean_tokens)
        return float(np.interp(tokens, xs, ps))

    def quantile(self, level: float) -> float:
        """The reply length (tokens) at cumulative probability `level` in [0, 1)."""
        if not 0.0 <= level < 1.0:
            raise ValueError(f"level must be in [0, 1), got {level}")
        xs, ps = self._points()
        if level <= ps[-1]:
            # first knot at or above the level (flat CDF pieces cannot occur: levels increase)
            return float(np.interp(level, ps, xs))
        return xs[-1] + self.tail_mean_tokens * math.log((1.0 - ps[-1]) / (1.0 - level))

    @property
    def median_tokens(self) -> float:
        return self.quantile(0.5)

    @property
    def mean_tokens(self) -> float:
        return remaining_tokens(self, 0.0)


def remaining_tokens(dist: LengthDistribution, generated_tokens: float) -> float:
    """E[L − g | L > g] (tokens) for a request that has generated g = `generated_tokens` and
    not finished (module docstring). Always ≥ 0 and finite; for g past the last quantile
    it is the tail's mean excess. For g below `min_tokens` the condition holds surely and
    the answer is E[L] − g.

    Raises:
        ValueError: g is negative or not finite.
    """
    g = float(generated_tokens)
    if not (g >= 0.0 and math.isfinite(g)):
        raise ValueError(f"generated_tokens must be a finite number ≥ 0, got {generated_tokens}")
    xs, ps = dist._points()
    tail_mass = 1.0 - ps[-1]
    if g >= xs[-1]:
        return dist.tail_mean_tokens
    if g <= xs[0]:  # all of the mass lies above g: ∫_g^x0 1 dx + ∫_x0^∞ (1 − F)
        integral, survival = xs[0] - g, 1.0
        start = 0
    else:
        k = int(np.searchsorted(xs, g, side="right")) - 1  # xs[k] ≤ g < xs[k+1]
        f_g = ps[k] + (ps[k + 1] - ps[k]) * (g - xs[k]) / (xs[k + 1] - xs[k])
        survival = 1.0 - f_g
        integral = (xs[k + 1] - g) * ((1.0 - f_g) + (1.0 - ps[k + 1])) / 2.0
        start = k + 1
    for i in range(start, len(xs) - 1):
        integral += (xs[i + 1] - xs[i]) * ((1.0 - ps[i]) + (1.0 - ps[i + 1])) / 2.0
    integral += tail_mass * dist.tail_mean_tokens
    return integral / survival


def quantiles_from_point(point_tokens: float, log_offsets: Sequence[float], levels: Sequence[float],
                         tail_ratio: float) -> LengthDistribution:
    """The distribution of a model calibrated in log space: q_i = point · exp(offset_i)
    (clipped to ≥ 1 token and made non-decreasing), tail mean = tail_ratio · q_K."""
    q = np.maximum(1.0, float(point_tokens) * np.exp(np.asarray(log_offsets, dtype=np.float64)))
    q = np.maximum.accumulate(q)
    return LengthDistribution(tuple(float(v) for v in levels), tuple(float(v) for v in q),
                              tail_mean_tokens=max(1.0, float(tail_ratio) * float(q[-1])))


@dataclass(frozen=True)
class LogSpreadCalibration:
    """How a model's point prediction becomes a `LengthDistribution`, fitted on
    out-of-sample predictions (`fit_log_spread`).

    Predictions are binned by size (`bin_edges_tokens`, right-open bins); in bin b the
    quantile at levels[i] is point · exp(log_offsets[b][i]) and the tail above the last
    quantile has mean excess tail_ratios[b] · q_K.

    levels: quantile levels in (0, 1), increasing. bin_edges_tokens: point-prediction bin
    edges (tokens), increasing, one fewer than bins. log_offsets: per bin, per level,
    quantile of log(true / predicted) (natural log). tail_ratios: per bin, mean of
    (true − q_K) / q_K over the samples above q_K (dimensionless, > 0). n_fit: samples the
    calibration was fitted on.
    """

    levels: tuple[float, ...]
    bin_edges_tokens: tuple[float, ...]
    log_offsets: tuple[tuple[float, ...], ...]
    tail_ratios: tuple[float, ...]
    n_fit: int = 0

    def __post_init__(self) -> None:
        n_bins = len(self.bin_edges_tokens) + 1
        if len(self.log_offsets) != n_bins or len(self.tail_ratios) != n_bins:
            raise ValueError(f"need {n_bins} bins of offsets and tail ratios, got "
                             f"{len(self.log_offsets)} and {len(self.tail_ratios)}")
        if any(len(row) != len(self.levels) for row in self.log_offsets):
            raise ValueError("every bin needs one offset per level")
        if not all(0.0 < a < 1.0 for a in self.levels) or any(b <= a for a, b in zip(self.levels, self.levels[1:])):
            raise ValueError(f"levels must increase strictly inside (0, 1), got {self.levels}")
        flat = [*self.bin_edges_tokens, *self.tail_ratios, *(v for row in self.log_offsets for v in row)]
        if not all(math.isfinite(v) for v in flat) or any(r <= 0 for r in self.tail_ratios):
            raise ValueError("offsets, edges and tail ratios must be finite, tail ratios > 0")

    def distributions(self, points_tokens: Sequence[float]) -> list[LengthDistribution]:
        """One distribution per point prediction (tokens)."""
        pts = np.asarray(points_tokens, dtype=np.float64)
        bins = np.searchsorted(np.asarray(self.bin_edges_tokens), pts, side="right")
        return [quantiles_from_point(p, self.log_offsets[b], self.levels, self.tail_ratios[b])
                for p, b in zip(pts.tolist(), bins.tolist())]

    def to_dict(self) -> dict[str, object]:
        return {"levels": list(self.levels), "bin_edges_tokens": list(self.bin_edges_tokens),
                "log_offsets": [list(r) for r in self.log_offsets], "tail_ratios": list(self.tail_ratios),
                "n_fit": self.n_fit, "read_as": "q_level = point * exp(log_offset) per point-size bin"}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> LogSpreadCalibration:
        """Inverse of `to_dict`.

        Raises:
            ValueError: a field is missing or malformed (the message names it).
        """
        try:
            return cls(
                levels=tuple(float(v) for v in d["levels"]),  # type: ignore[union-attr]
                bin_edges_tokens=tuple(float(v) for v in d["bin_edges_tokens"]),  # type: ignore[union-attr]
                log_offsets=tuple(tuple(float(v) for v in row) for row in d["log_offsets"]),  # type: ignore[union-attr]
                tail_ratios=tuple(float(v) for v in d["tail_ratios"]),  # type: ignore[union-attr]
                n_fit=int(d.get("n_fit", 0)),  # type: ignore[arg-type]
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"distribution calibration: missing or malformed field {exc}") from None


def fit_log_spread(points_tokens: Sequence[float], true_tokens: Sequence[float], *,
                   levels: Sequence[float] = DEFAULT_LEVELS, n_bins: int = 3,
                   min_per_bin: int = 60) -> LogSpreadCalibration:
    """Calibrate quantiles from out-of-sample point predictions and the true lengths: bins
    are equal-count by predicted size (fewer when a bin would hold < `min_per_bin`
    samples), offsets are empirical quantiles of log(true / predicted) per bin (made
    non-decreasing across levels), tail ratios the mean relative excess above q_K.

    Raises:
        ValueError: shapes differ or there are fewer than 2 samples.
    """
    p = np.maximum(1.0, np.asarray(points_tokens, dtype=np.float64))
    y = np.maximum(1.0, np.asarray(true_tokens, dtype=np.float64))
    if p.shape != y.shape or p.ndim != 1 or len(p) < 2:
        raise ValueError(f"need two equal 1-D arrays of ≥ 2 samples, got {p.shape} and {y.shape}")
    n_bins = max(1, min(n_bins, len(p) // max(1, min_per_bin)))
    edges = np.quantile(p, np.arange(1, n_bins) / n_bins) if n_bins > 1 else np.zeros(0)
    edges = np.unique(edges)
    bins = np.searchsorted(edges, p, side="right")
    offsets: list[tuple[float, ...]] = []
    tails: list[float] = []
    lv = np.asarray(levels, dtype=np.float64)
    for b in range(len(edges) + 1):
        m = bins == b
        r = np.log(y[m] / p[m]) if m.any() else np.log(y / p)
        off = np.maximum.accumulate(np.quantile(r, lv))
        offsets.append(tuple(float(v) for v in off))
        q_last = p[m] * math.exp(off[-1]) if m.any() else p * math.exp(off[-1])
        yy = y[m] if m.any() else y
        above = yy > q_last
        excess = (yy[above] - q_last[above]) / q_last[above]
        tails.append(float(excess.mean()) if above.any() else 0.1)
    return LogSpreadCalibration(tuple(float(v) for v in lv), tuple(float(v) for v in edges), tuple(offsets),
                                tuple(max(1e-3, t) for t in tails), n_fit=len(p))


class CalibratedRemaining:
    """The look-ahead's remaining-length rule (`sim.remaining.RemainingRule`) read from a
    length model's own distribution calibration (issue 13 §2, "length as a distribution"):
    a request predicted at p tokens has the `LengthDistribution` `calibration` gives p, and
    once it has generated g tokens without finishing the look-ahead assumes it ends at

        statistic "mean":  g + E[L − g | L > g]                       (`remaining_tokens`)
        statistic "q<percent>" (e.g. "q50"): the conditional quantile F⁻¹(F(g) + q·(1 − F(g)))

    rounded up, ≥ g + 1, capped at `cap` (max_model_len − prompt). g = 0 gives the
    distribution's mean (or quantile) for a queued request instead of the point estimate.
    Distributions are memoised per integer prediction (predictions are integers ≤ 32,768,
    so the memo is bounded).

    calibration: the model's `LogSpreadCalibration` (meta.json fit.dist).
    statistic: "mean" or "q<percent>" in (0, 100).
    default_output_tokens: the prediction used for a request that has none (tokens).
    """

    def __init__(self, calibration: LogSpreadCalibration, statistic: str = "mean",
                 default_output_tokens: int = 256) -> None:
        self.calibration = calibration
        self.statistic = statistic
        if statistic == "mean":
            self._q = -1.0
        else:
            try:
                self._q = float(statistic[1:]) / 100.0 if statistic.startswith("q") else -1.0
            except ValueError:
                self._q = -1.0
            if not 0.0 < self._q < 1.0:
                raise ValueError("statistic must be 'mean' or 'q<percent>' with percent in (0, 100), "
                                 f"got {statistic!r}")
        self.default_output_tokens = default_output_tokens
        self._memo: dict[int, tuple[LengthDistribution, list[float], list[float], list[float]]] = {}

    def _dist(self, predicted: int) -> tuple[LengthDistribution, list[float], list[float], list[float]]:
        got = self._memo.get(predicted)
        if got is None:
            d = self.calibration.distributions([float(predicted)])[0]
            xs, ps = d._points()
            # suffix[i] = ∫_{xs[i]}^∞ (1 − F(x)) dx (trapezoids, then the exponential tail)
            suffix = [0.0] * len(xs)
            acc = (1.0 - ps[-1]) * d.tail_mean_tokens
            suffix[-1] = acc
            for i in range(len(xs) - 2, -1, -1):
                acc += (xs[i + 1] - xs[i]) * ((1.0 - ps[i]) + (1.0 - ps[i + 1])) / 2.0
                suffix[i] = acc
            got = (d, xs, ps, suffix)
            self._memo[predicted] = got
        return got

    def remaining(self, predicted: int | None, generated: int) -> float:
        """E[L − g | L > g] (tokens, float) for the prediction's distribution; equals
        `remaining_tokens(calibration.distributions([predicted])[0], generated)`."""
        p = int(predicted) if predicted else self.default_output_tokens
        d, xs, ps, suffix = self._dist(max(1, p))
        g = float(max(0, generated))
        if g >= xs[-1]:
            return d.tail_mean_tokens
        if g <= xs[0]:
            return (xs[0] - g) + suffix[0]
        k = bisect.bisect_right(xs, g) - 1  # xs[k] ≤ g < xs[k+1]
        f_g = ps[k] + (ps[k + 1] - ps[k]) * (g - xs[k]) / (xs[k + 1] - xs[k])
        integral = (xs[k + 1] - g) * ((1.0 - f_g) + (1.0 - ps[k + 1])) / 2.0 + suffix[k + 1]
        return integral / (1.0 - f_g)

    def expected_total(self, predicted: int | None, generated: int, cap: int | None = None) -> int:
        """Total output tokens the look-ahead assumes (class docstring)."""
        g = max(0, int(generated))
        if self._q < 0:
            val = g + self.remaining(predicted, g)
        else:
            p = int(predicted) if predicted else self.default_output_tokens
            d = self._dist(max(1, p))[0]
            f_g = d.cdf(float(g))
            val = d.quantile(min(f_g + self._q * (1.0 - f_g), 1.0 - 1e-12))
        out = max(g + 1, int(math.ceil(val)))
        if cap is not None:
            out = max(g + 1, min(out, cap)) if cap > g else g + 1
        return out

    def describe(self) -> dict[str, object]:
        return {"kind": "calibrated", "statistic": self.statistic, "bins": len(self.calibration.tail_ratios)}

