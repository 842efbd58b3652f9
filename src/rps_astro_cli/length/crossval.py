"""Cross-validated comparison of length models: K folds by conversation × several seeds.

One held-out split of ~400 pairs moves MAE by ±10 tokens and τ by ±0.03 from seed to
seed, so model choices are made on folds: for each seed, the conversation ids are
permuted by `np.random.default_rng(seed)` and dealt into K folds (id i of the permutation
→ fold i mod K). Each fold in turn is the test set; of the other conversations a seeded
`val_frac` share is validation (model selection inside `fit`) and the rest training.
Every model and the baselines see the same folds; a conversation is never on both sides.

Per fold and model: MAE, Kendall τ-b and, for the same fold, the median baseline's MAE
(fitted on the fold's train + val), so the comparison "MAE ≤ 0.8 × median" is a paired
ratio per fold; the same on the fold's first turns only (pairs without history — what a
dispatcher sees for a single-turn request); for models with a distribution calibration
the share of true lengths inside the predicted [p10, p90] and the mean pinball loss over
the predicted quantiles (tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.length.base import LENGTH_MODELS, LengthModel
from rps_astro_cli.length.data import LengthDataset, load_length_data, split_by_conversation
from rps_astro_cli.length.evaluate import compute_metrics
from rps_astro_cli.length.pipeline import build_model, fit_rng
from rps_astro_cli.length.store import load_length_model, resolve_artifact

DEFAULT_FOLDS = 5
DEFAULT_SEEDS = (0, 1, 2)
CV_VAL_FRAC = 0.125
"""Share of a fold's non-test conversations used for validation (0.1 of all at K = 5)."""


@dataclass(frozen=True)
class ModelRecipe:
    """How to train one model arm afresh on each fold.

    label: the name shown in tables. model: registry name. context_turns: earlier turns
    prepended to its prompts (ignored by models that read the history themselves).
    """

    label: str
    model: str
    context_turns: int = 0


def recipe_for(spec: str, context_turns: int | None = None) -> ModelRecipe:
    """A recipe from an artifact name/folder (its recorded model and context turns) or a
    registry name (context from `context_turns`, default 0). `NAME@N` sets the context.

    Raises:
        AstroUserError: neither an artifact nor a registered model.
    """
    name, _, ctx = spec.partition("@")
    if ctx:
        try:
            ct = int(ctx)
        except ValueError:
            raise AstroUserError(f"{spec!r}: context turns after '@' must be an integer", field="--model") from None
        return ModelRecipe(spec, LENGTH_MODELS.get(name).name, ct)
    try:
        art = load_length_model(resolve_artifact(name))
        ct = art.context_turns if context_turns is None else context_turns
        return ModelRecipe(Path(name).name, art.meta.model, ct)
    except AstroUserError:
        if name not in LENGTH_MODELS:
            raise
    return ModelRecipe(name, name, context_turns or 0)


@dataclass
class CVResult:
    """rows: one dict per (model, seed, fold) (keys in `cross_validate`'s docstring).
    summary: per model label, mean / min / max of each metric over the folds.
    n_pairs / n_conversations: the data. folds, seeds: the protocol. notes: loader notes."""

    rows: list[dict[str, Any]]
    summary: dict[str, dict[str, dict[str, float]]]
    n_pairs: int
    n_conversations: int
    folds: int
    seeds: tuple[int, ...]
    notes: list[str] = field(default_factory=list)


def fold_of(conversation_ids: Sequence[str], *, folds: int, seed: int) -> np.ndarray:
    """Fold index (0..folds−1) of each sample: sorted unique ids permuted by
    `np.random.default_rng(seed)`, the i-th of the permutation in fold i mod `folds`."""
    ids = sorted(set(conversation_ids))
    perm = np.random.default_rng(seed).permutation(len(ids))
    where = {ids[j]: i % folds for i, j in enumerate(perm)}
    return np.array([where[c] for c in conversation_ids], dtype=np.int64)


def pinball_loss(quantiles: np.ndarray, levels: Sequence[float], y: np.ndarray) -> float:
    """Mean pinball (quantile) loss in tokens: quantiles shape (n, K) at `levels`, y (n,)."""
    lv = np.asarray(levels, dtype=np.float64)[None, :]
    d = y[:, None] - quantiles
    return float(np.mean(np.maximum(lv * d, (lv - 1.0) * d)))


def _fold_metrics(model: LengthModel, test: LengthDataset, median_tokens: float) -> dict[str, Any]:
    y = test.targets.astype(np.float64)
    pred = model.predict_samples(test.samples).astype(np.float64)
    first = test.first_turn_mask
    m = compute_metrics(y, pred)
    row: dict[str, Any] = {"n": len(y), "mae": m.mae, "kendall_tau": m.kendall_tau, "bias": m.bias,
                           "median_mae": float(np.abs(median_tokens - y).mean())}
    row["mae_ratio"] = row["mae"] / row["median_mae"]
    row["n_first"] = int(first.sum())
    if first.sum() >= 2:
        mf = compute_metrics(y[first], pred[first])
        row.update(mae_first=mf.mae, kendall_tau_first=mf.kendall_tau,
                   median_mae_first=float(np.abs(median_tokens - y[first]).mean()))
        row["mae_ratio_first"] = row["mae_first"] / row["median_mae_first"]
    if model.calibration is not None:
        dists = model.predict_dist_samples(test.samples)
        levels = dists[0].levels
        q = np.array([d.quantiles_tokens for d in dists])
        row["pinball"] = pinball_loss(q, levels, y)
        lo, hi = (np.array([d.quantile(a) for d in dists]) for a in (0.1, 0.9))
        row["coverage_p10_p90"] = float(np.mean((y >= lo) & (y <= hi)))
    return row


def cross_validate(
    data: str | Path,
    models: Sequence[ModelRecipe],
    *,
    folds: int = DEFAULT_FOLDS,
    seeds: Sequence[int] = DEFAULT_SEEDS,
    tokenizer: str | None = None,
    baselines: bool = True,
    progress: Callable[[str], None] | None = None,
) -> CVResult:
    """Train each recipe (and the `median` / `linear-prompt` baselines) on every fold of
    every seed and score it on the fold (module docstring).

    Row keys: model, seed, fold, n, mae, kendall_tau, bias, median_mae, mae_ratio (= mae /
    median_mae), n_first, mae_first, kendall_tau_first, median_mae_first, mae_ratio_first,
    and for calibrated models pinball, coverage_p10_p90.

    Raises:
        AstroUserError: fewer than 2 folds, no seeds, or a fold without test/train rows.
    """
    if folds < 2:
        raise AstroUserError(f"need at least 2 folds, got {folds}", field="--cv")
    if not seeds:
        raise AstroUserError("need at least one seed", field="--cv-seeds")
    arms = list(models)
    if baselines:
        arms += [ModelRecipe(b, b) for b in ("median", "linear-prompt") if b not in {a.label for a in arms}]
    labels = [a.label for a in arms]
    if len(set(labels)) != len(labels):
        raise AstroUserError(f"two models share a label in {labels}", field="--model", fix="name each model once")
    datasets: dict[int, LengthDataset] = {}

    def data_for(ct: int) -> LengthDataset:
        if ct not in datasets:
            datasets[ct] = load_length_data(data, tokenizer=tokenizer, context_turns=ct)
        return datasets[ct]

    base = data_for(0)
    cids = base.conversation_ids
    rows: list[dict[str, Any]] = []
    for seed in seeds:
        fold_idx = fold_of(cids, folds=folds, seed=seed)
        for k in range(folds):
            te = np.flatnonzero(fold_idx == k)
            rest = np.flatnonzero(fold_idx != k)
            if len(te) == 0 or len(rest) == 0:
                raise AstroUserError(f"fold {k} of seed {seed} has no test or no training rows", field="--cv")
            fold_rng = np.random.default_rng([seed, k])
            inner = split_by_conversation(base.subset(rest), test_frac=0.0, val_frac=CV_VAL_FRAC, rng=fold_rng)
            val_ids = set(inner.val.conversation_ids)
            tr = [int(i) for i in rest if cids[i] not in val_ids]
            va = [int(i) for i in rest if cids[i] in val_ids]
            median_tokens = float(np.median(base.targets[np.r_[tr, va].astype(np.int64)]))
            for arm in arms:
                if progress:
                    progress(f"seed {seed} fold {k + 1}/{folds}: {arm.label}")
                ds = data_for(0 if LENGTH_MODELS.get(arm.model).reads_history else arm.context_turns)
                model = build_model(arm.model)
                if arm.model in ("median", "linear-prompt"):  # fitted on train + val, as eval-length does
                    model.fit(ds.subset(tr + va), None, rng=fit_rng(seed))
                else:
                    model.meta.data["context_turns"] = arm.context_turns
                    model.meta.fit = model.fit(ds.subset(tr), ds.subset(va), rng=fit_rng(seed)) or {}
                model.meta.data["context_turns"] = arm.context_turns
                metrics = _fold_metrics(model, ds.subset(te.tolist()), median_tokens)
                row = {"model": arm.label, "seed": seed, "fold": k, **metrics}
                rows.append(row)
    return CVResult(rows, summarize(rows), len(base), len(set(cids)), folds, tuple(seeds), list(base.notes))


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per model: {metric: {mean, min, max, std}} over its rows (NaN-aware)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for label in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == label]
        keys = [k for k in mine[0] if k not in ("model", "seed", "fold") and isinstance(mine[0][k], (int, float))]
        out[label] = {}
        for key in keys:
            v = np.array([r.get(key, np.nan) for r in mine], dtype=np.float64)
            v = v[np.isfinite(v)]
            out[label][key] = ({"mean": float(v.mean()), "min": float(v.min()), "max": float(v.max()),
                                "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0}
                               if len(v) else {"mean": np.nan, "min": np.nan, "max": np.nan, "std": np.nan})
    return out


def markdown_cv_table(res: CVResult) -> str:
    """One row per model: mean [min–max] over folds of MAE, the paired MAE ratio to the
    median baseline, τ, and the same on first turns; coverage / pinball where calibrated."""
    def cell(s: dict[str, dict[str, float]], key: str, nd: int) -> str:
        v = s.get(key)
        if v is None or not np.isfinite(v["mean"]):
            return "–"
        return f"{v['mean']:.{nd}f} [{v['min']:.{nd}f}–{v['max']:.{nd}f}]"

    cols = [("mae", "MAE tok", 1), ("mae_ratio", "MAE / median", 3), ("kendall_tau", "τ", 3),
            ("mae_ratio_first", "first turns: MAE / median", 3), ("kendall_tau_first", "first turns: τ", 3),
            ("coverage_p10_p90", "in [p10, p90]", 3), ("pinball", "pinball tok", 1)]
    lines = ["| model | " + " | ".join(c[1] for c in cols) + " |", "| --- | " + " | ".join("---" for _ in cols) + " |"]
    for label, s in res.summary.items():
        lines.append(f"| {label} | " + " | ".join(cell(s, k, nd) for k, _, nd in cols) + " |")
    return "\n".join(lines) + "\n"
