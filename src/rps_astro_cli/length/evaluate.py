"""Metrics, latency measurement and reports for response-length models.

Definitions (y = true reply tokens ≥ 1, ŷ = predicted tokens, n samples):
- MAE = mean |ŷ − y| (tokens). Median AE = median |ŷ − y| (tokens).
- MAPE = 100 · mean(|ŷ − y| / max(y, MAPE_FLOOR_TOKENS)) (percent). The floor keeps a
  one-token reply predicted as 20 tokens from counting as a 1,900% error and dominating
  the mean; targets ≥ 16 tokens (one KV block) are unaffected. `mape_raw` (denominator y)
  is reported too.
- Kendall τ: τ-b between ŷ and y (scipy.stats.kendalltau) — how well the model ranks
  requests, which is what a scheduler uses.
- Bucket accuracy: share of samples whose predicted bucket equals the true one, buckets
  [1, 64), [64, 256), [256, 512), [512, ∞) tokens.
- Latency: per-request wall time of `predict`, in ms: batch 1 = one call per prompt;
  batched = calls of BATCH_SIZE prompts, time / BATCH_SIZE per request; p50/p99 over calls.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.length.base import LengthModel
from rps_astro_cli.length.data import LengthSample

MAPE_FLOOR_TOKENS = 16
BUCKET_EDGES = (64, 256, 512)
BUCKET_LABELS = ("<64", "64-256", "256-512", ">=512")
BATCH_SIZE = 32


@dataclass(frozen=True)
class LengthMetrics:
    """Accuracy of one model on one split (module docstring defines each field).

    n: samples. mae / median_ae: tokens. mape / mape_raw: percent. kendall_tau: [-1, 1].
    bucket_accuracy: [0, 1]. bias: mean(ŷ − y) tokens (negative = under-predicts).
    """

    n: int
    mae: float
    mape: float
    mape_raw: float
    median_ae: float
    kendall_tau: float
    bucket_accuracy: float
    bias: float


@dataclass(frozen=True)
class LatencyStats:
    """Per-request prediction latency in milliseconds (module docstring)."""

    p50_ms_batch1: float
    p99_ms_batch1: float
    p50_ms_batched: float
    p99_ms_batched: float
    batch_size: int


def bucket_of(tokens: np.ndarray) -> np.ndarray:
    """Bucket index 0..3 of each length (edges BUCKET_EDGES, right-open)."""
    return np.searchsorted(np.asarray(BUCKET_EDGES), np.asarray(tokens), side="right")


def compute_metrics(y_true: Sequence[float], y_pred: Sequence[float]) -> LengthMetrics:
    """Accuracy metrics of predictions `y_pred` against `y_true` (both shape (n,), tokens).

    Raises:
        ValueError: shapes differ or n == 0.
    """
    from scipy.stats import kendalltau

    y = np.asarray(y_true, dtype=np.float64)
    p = np.asarray(y_pred, dtype=np.float64)
    if y.shape != p.shape or y.ndim != 1 or len(y) == 0:
        raise ValueError(f"need two equal non-empty 1-D arrays, got {y.shape} and {p.shape}")
    err = np.abs(p - y)
    tau = float(kendalltau(p, y).statistic) if len(y) > 1 else float("nan")
    return LengthMetrics(
        n=len(y),
        mae=float(err.mean()),
        mape=float(100.0 * np.mean(err / np.maximum(y, MAPE_FLOOR_TOKENS))),
        mape_raw=float(100.0 * np.mean(err / np.maximum(y, 1.0))),
        median_ae=float(np.median(err)),
        kendall_tau=tau if np.isfinite(tau) else float("nan"),
        bucket_accuracy=float(np.mean(bucket_of(p) == bucket_of(y))),
        bias=float(np.mean(p - y)),
    )


def measure_latency(model: LengthModel, prompts: Sequence[str], *, max_calls: int = 200,
                    batch_size: int = BATCH_SIZE, budget_s: float = 30.0) -> LatencyStats:
    """Time `model.predict` on `prompts` (up to `max_calls` single calls and up to
    `max_calls // 4` batched calls, each phase stopping early once it has spent `budget_s`
    / 2 seconds, with at least one call) after one warm-up call."""
    prompts = list(prompts)
    if not prompts:
        return LatencyStats(float("nan"), float("nan"), float("nan"), float("nan"), batch_size)
    model.predict(prompts[:1])
    single = []
    for p in prompts[:max_calls]:
        t0 = time.perf_counter()
        model.predict([p])
        single.append((time.perf_counter() - t0) * 1e3)
        if sum(single) > budget_s * 500:
            break
    batched = []
    n_batches = max(1, min(max_calls // 4, len(prompts) // batch_size))
    for b in range(n_batches):
        chunk = prompts[b * batch_size : (b + 1) * batch_size] or prompts[:batch_size]
        t0 = time.perf_counter()
        model.predict(chunk)
        batched.append((time.perf_counter() - t0) * 1e3 / len(chunk))
        if sum(batched) * batch_size > budget_s * 500:
            break
    return LatencyStats(
        p50_ms_batch1=float(np.percentile(single, 50)), p99_ms_batch1=float(np.percentile(single, 99)),
        p50_ms_batched=float(np.percentile(batched, 50)), p99_ms_batched=float(np.percentile(batched, 99)),
        batch_size=batch_size,
    )


def evaluate_model(model: LengthModel, prompts: Sequence[str], targets: np.ndarray, *,
                   latency: bool = True, max_latency_calls: int = 200,
                   samples: Sequence[LengthSample] | None = None,
                   ) -> tuple[dict[str, Any], np.ndarray, list[str]]:
    """Metrics (+ latency) of `model` on (prompts, targets) as one flat dict, its
    predictions (shape (n,)), and the model's notes on the inputs (truncations...).
    With `samples` (the same pairs), predictions come from `model.predict_samples`, so a
    model that reads the conversation history sees it; latency is timed on `prompts`."""
    pred = model.predict_samples(samples) if samples is not None else model.predict(list(prompts))
    notes = list(model.last_notes)
    row: dict[str, Any] = asdict(compute_metrics(targets, pred))
    if latency:
        row.update(asdict(measure_latency(model, prompts, max_calls=max_latency_calls)))
    return row, pred, notes


# -------------------------------------------------------------------------- reports


def _fmt(v: Any, nd: int = 1) -> str:
    if isinstance(v, float):
        return "n/a" if not np.isfinite(v) else f"{v:.{nd}f}"
    return str(v)


def markdown_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One Markdown table, a row per model (keys of `results`); ctx = context turns read."""
    cols = [("mae", "MAE (tok)", 1), ("mape", "MAPE %", 1), ("median_ae", "median AE", 1),
            ("kendall_tau", "Kendall τ", 3), ("bucket_accuracy", "bucket acc", 3),
            ("p50_ms_batch1", "p50 ms b=1", 3), ("p99_ms_batch1", "p99 ms b=1", 3),
            ("p50_ms_batched", f"p50 ms/req b={BATCH_SIZE}", 3)]
    lines = ["| model | ctx | n | " + " | ".join(c[1] for c in cols) + " |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in cols) + " |"]
    for name, r in results.items():
        lines.append(f"| {name} | {r.get('context_turns', 0)} | {r.get('n', '')} | "
                     + " | ".join(_fmt(r.get(k, float('nan')), nd) for k, _, nd in cols) + " |")
    return "\n".join(lines) + "\n"


def write_report(results: Mapping[str, Mapping[str, Any]], predictions: Mapping[str, np.ndarray],
                 targets: np.ndarray, out_dir: str | Path, *, header: str = "") -> list[Path]:
    """Write `metrics.json`, `metrics.md`, `scatter.png` (predicted vs true, log-log) and
    `error_cdf.png` (CDF of |ŷ − y|) into `out_dir`. Returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "metrics.json", out / "metrics.md", out / "scatter.png", out / "error_cdf.png"]
    paths[0].write_text(json.dumps(results, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    paths[1].write_text((header + "\n\n" if header else "") + markdown_table(results), encoding="utf-8")

    y = np.asarray(targets, dtype=np.float64)
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for name, p in predictions.items():
        ax.scatter(y, np.asarray(p), s=8, alpha=0.5, label=name)
    lim = (1, max(2.0, float(y.max()) * 1.2))
    ax.plot(lim, lim, "k--", lw=1)
    ax.set(xscale="log", yscale="log", xlim=lim, ylim=lim, xlabel="true reply tokens",
           ylabel="predicted tokens", title="Predicted vs true response length")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[2], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for name, p in predictions.items():
        e = np.sort(np.abs(np.asarray(p, dtype=np.float64) - y))
        ax.plot(e, np.arange(1, len(e) + 1) / len(e), label=name)
    ax.set(xlabel="|predicted − true| (tokens)", ylabel="fraction of requests", title="Absolute error CDF")
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[3], dpi=110)
    plt.close(fig)
    return paths
