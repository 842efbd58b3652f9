"""Baselines reported beside the learned length models.

- `median`: every request gets the training set's median reply length (the MAE-optimal
  constant).
- `linear-prompt`: reply tokens = a + b · prompt tokens, fitted by least absolute
  deviations (so it is comparable with the MAE-optimal median; ordinary least squares
  would chase the long tail) on prompt tokens counted with the shared fallback counter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.length.base import LENGTH_MODELS, LengthModel, LengthModelMeta, ProgressFn
from rps_astro_cli.length.data import LengthDataset
from rps_astro_cli.tokens import count_tokens_fallback

_PARAMS_FILE = "baseline.json"


def _read_params(directory: Path, keys: tuple[str, ...]) -> dict[str, float]:
    fp = directory / _PARAMS_FILE
    try:
        d = json.loads(fp.read_text(encoding="utf-8"))
        return {k: float(d[k]) for k in keys}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise AstroUserError(f"{fp}: unreadable baseline parameters ({exc!r})", field="--model") from None


@LENGTH_MODELS.register("median")
class MedianBaseline(LengthModel):
    """Predicts the training median for every prompt."""

    name = "median"

    def __init__(self, median_tokens: float = 1.0):
        super().__init__()
        self.median_tokens = float(median_tokens)

    def fit(self, train: LengthDataset, val: LengthDataset | None, *, rng: np.random.Generator,
            progress: ProgressFn | None = None) -> dict[str, Any]:
        self.median_tokens = float(np.median(train.targets))
        return {"median_tokens": self.median_tokens}

    def _predict_raw(self, texts: list[str]) -> np.ndarray:
        return np.full(len(texts), self.median_tokens)

    def params(self) -> dict[str, Any]:
        return {"median_tokens": self.median_tokens}

    def save_files(self, directory: Path) -> None:
        (directory / _PARAMS_FILE).write_text(json.dumps(self.params()) + "\n", encoding="utf-8")

    @classmethod
    def load_files(cls, directory: Path, meta: LengthModelMeta) -> MedianBaseline:
        return cls(**_read_params(directory, ("median_tokens",)))


def _lad_line(x: np.ndarray, y: np.ndarray, iters: int = 100) -> tuple[float, float]:
    """Least-absolute-deviation line y ≈ a + b·x by iteratively reweighted least squares."""
    X = np.column_stack([np.ones_like(x), x])
    w = np.ones_like(y)
    coef = np.zeros(2)
    for _ in range(iters):
        sw = np.sqrt(w)
        coef_new, *_ = np.linalg.lstsq(X * sw[:, None], y * sw, rcond=None)
        if np.allclose(coef_new, coef, rtol=1e-9, atol=1e-9):
            break
        coef = coef_new
        w = 1.0 / np.maximum(np.abs(y - X @ coef), 1e-6)
    return float(coef[0]), float(coef[1])


@LENGTH_MODELS.register("linear-prompt")
class LinearPromptBaseline(LengthModel):
    """reply tokens = intercept + slope · prompt tokens (LAD fit)."""

    name = "linear-prompt"

    def __init__(self, intercept_tokens: float = 1.0, slope: float = 0.0):
        super().__init__()
        self.intercept_tokens = float(intercept_tokens)
        self.slope = float(slope)

    def fit(self, train: LengthDataset, val: LengthDataset | None, *, rng: np.random.Generator,
            progress: ProgressFn | None = None) -> dict[str, Any]:
        x = np.array([count_tokens_fallback(p) for p in train.prompts], dtype=np.float64)
        self.intercept_tokens, self.slope = _lad_line(x, train.targets.astype(np.float64))
        return self.params()

    def _predict_raw(self, texts: list[str]) -> np.ndarray:
        x = np.array([count_tokens_fallback(t) for t in texts], dtype=np.float64)
        return self.intercept_tokens + self.slope * x

    def params(self) -> dict[str, Any]:
        return {"intercept_tokens": self.intercept_tokens, "slope": self.slope}

    def save_files(self, directory: Path) -> None:
        (directory / _PARAMS_FILE).write_text(json.dumps(self.params()) + "\n", encoding="utf-8")

    @classmethod
    def load_files(cls, directory: Path, meta: LengthModelMeta) -> LinearPromptBaseline:
        return cls(**_read_params(directory, ("intercept_tokens", "slope")))
