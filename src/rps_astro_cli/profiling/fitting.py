"""The fitting toolkit: CSV rows, the seeded held-out split and its error
(`HoldoutError`), the glitch filter, continuous piecewise-linear least squares."""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.errors import AstroUserError

DEFAULT_KNOTS: tuple[int, ...] = (
    1, 16, 32, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512, 640, 768, 1024,
    1280, 1536, 2048, 2560, 3072, 3584, 4096,
)
HOLDOUT_FRAC = 0.2
GLITCH_RATIO = 3.0


@dataclass
class HoldoutError:
    """Held-out error of one fitted term: rows, MAPE (%), MAE and max abs error (ms)."""

    n_rows: int
    mape_pct: float
    mae_ms: float
    max_abs_ms: float

    @classmethod
    def of(cls, pred_ms: np.ndarray, true_ms: np.ndarray) -> HoldoutError:
        """Error of predictions vs measurements (both ms, same shape)."""
        err = np.abs(pred_ms - true_ms)
        return cls(
            n_rows=int(true_ms.size),
            mape_pct=round(float(np.mean(err / true_ms) * 100.0), 2),
            mae_ms=round(float(np.mean(err)), 4),
            max_abs_ms=round(float(np.max(err)), 4),
        )

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def read_rows(path: Path) -> list[dict[str, str]]:
    """All rows of a CSV file as dicts (strings).

    Raises:
        AstroUserError: the file is missing or empty.
    """
    path = Path(path)
    if not path.is_file():
        raise AstroUserError(f"missing input file {path}", field="--data-dir",
                             fix="point it at a folder holding profiles/*.csv and traces/ (e.g. ../shared/data)")
    with path.open(newline="") as fh:
        rows = list(csv.DictReader(fh))
    if not rows:
        raise AstroUserError(f"{path} has no rows", field="--data-dir")
    return rows


def parse_num(s: str | None) -> float:
    """Parse a CSV cell; empty or unparsable → NaN."""
    try:
        return float(s) if s not in (None, "") else math.nan
    except ValueError:
        return math.nan


def holdout_mask(n: int, rng: np.random.Generator, frac: float = HOLDOUT_FRAC) -> np.ndarray:
    """Boolean mask of length n, True for a random `round(frac*n)` held-out rows."""
    mask = np.zeros(n, dtype=bool)
    k = int(round(frac * n))
    if k:
        mask[rng.choice(n, size=k, replace=False)] = True
    return mask


def glitch_mask(x: np.ndarray, y: np.ndarray, ratio: float = GLITCH_RATIO, k: int = 8) -> np.ndarray:
    """True where reading y (at size x) is usable: finite, positive, not above `ratio` ×
    the median of its k nearest neighbours in x (a spike), and not below 1/`ratio` × the
    median of the last 5 accepted readings at smaller x (operator time does not drop
    3-fold with more work; this catches runs of bogus ~0.002 ms readings)."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    ok = np.isfinite(y) & (y > 0)
    idx = np.flatnonzero(ok)
    out = np.zeros(x.shape, dtype=bool)
    if idx.size <= 2:
        out[idx] = True
        return out
    xs, ys = x[idx], y[idx]
    spike = np.zeros(idx.size, dtype=bool)
    for j in range(idx.size):
        d = np.abs(xs - xs[j])
        d[j] = np.inf
        nb = np.argsort(d, kind="stable")[: min(k, idx.size - 1)]
        spike[j] = ys[j] > ratio * float(np.median(ys[nb]))
    accepted: list[float] = []
    for j in np.argsort(xs, kind="stable"):
        if spike[j]:
            continue
        if accepted and ys[j] < float(np.median(accepted[-5:])) / ratio:
            continue
        accepted.append(float(ys[j]))
        out[idx[j]] = True
    return out


def hat_basis(x: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Design matrix (len(x), len(knots)) of continuous piecewise-linear hat functions;
    x outside the knot range is extrapolated linearly from the end segments."""
    x = np.asarray(x, dtype=float)
    kn = np.asarray(knots, dtype=float)
    B = np.zeros((x.size, kn.size))
    i = np.clip(np.searchsorted(kn, x, side="right") - 1, 0, kn.size - 2)
    t = (x - kn[i]) / (kn[i + 1] - kn[i])
    rows = np.arange(x.size)
    B[rows, i] = 1.0 - t
    B[rows, i + 1] = t
    return B


def fit_piecewise(x: np.ndarray, y: np.ndarray, knots: np.ndarray) -> np.ndarray:
    """Least-squares values at `knots` of a continuous piecewise-linear f with f(x) ≈ y.

    Knots must have training data in an adjacent segment; callers drop the others first
    (`usable_knots`). Returns values (same length as knots, units of y)."""
    B = hat_basis(x, knots)
    vals, *_ = np.linalg.lstsq(B, y, rcond=None)
    return vals


def usable_knots(x: np.ndarray, knots: tuple[int, ...]) -> np.ndarray:
    """Knots clipped to the data range, keeping only those with ≥ 2 data points in
    the segments next to them (so the least-squares problem is well posed)."""
    lo, hi = float(np.min(x)), float(np.max(x))
    ks = sorted({k for k in knots if lo <= k <= hi} | {int(lo), int(math.ceil(hi))})
    keep = [ks[0]]
    for k in ks[1:]:
        seg = np.sum((x > keep[-1]) & (x <= k))
        if seg >= 2 or k == ks[-1]:
            keep.append(k)
    return np.asarray(keep, dtype=float)


def eval_piecewise(knots: np.ndarray, vals: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Evaluate the piecewise-linear function (linear extrapolation past the ends)."""
    return hat_basis(x, knots) @ vals
