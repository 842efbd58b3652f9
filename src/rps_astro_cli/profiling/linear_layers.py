"""Linear-layer (and all-reduce) time: piecewise-linear fits of the per-layer operators of
a Vidur `mlp.csv` (`LinearFit`, `fit_linear_layers`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.profiling.fitting import (
    DEFAULT_KNOTS,
    HoldoutError,
    eval_piecewise,
    fit_piecewise,
    glitch_mask,
    holdout_mask,
    parse_num,
    read_rows,
    usable_knots,
)

LAYER_OPS: tuple[str, ...] = (
    "attn_pre_proj",
    "attn_post_proj",
    "attn_rope",
    "input_layernorm",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_down_proj",
    "mlp_act",
    "add",
)
STEP_OPS: tuple[str, ...] = ("emb",)


@dataclass
class LinearFit:
    """Fitted linear-layer time: `knots` (tokens) → `values_ms` (whole model, one step)."""

    knots: list[int]
    values_ms: list[float]
    error: dict[str, Any]
    sources: dict[str, Any] = field(default_factory=dict)

    def at(self, n: float) -> float:
        """Linear-layer time (ms) at n tokens."""
        return float(eval_piecewise(np.asarray(self.knots, float), np.asarray(self.values_ms), np.asarray([n]))[0])


def _op_series(rows: list[dict[str, str]], op: str, tp: int) -> tuple[np.ndarray, np.ndarray]:
    sel = [r for r in rows if int(float(r.get("num_tensor_parallel_workers", "1") or 1)) == tp]
    if not sel:
        raise AstroUserError(f"no rows with num_tensor_parallel_workers={tp}", field="tp")
    col = f"time_stats.{op}.median"
    if col not in sel[0]:
        raise AstroUserError(f"CSV lacks column {col}", field="--data-dir")
    x = np.array([float(r["num_tokens"]) for r in sel])
    y = np.array([parse_num(r[col]) for r in sel])
    return x, y


def fit_allreduce(path: Path, rng: np.random.Generator,
                  size_knots: tuple[int, ...] | None = None) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Piecewise-linear fit of all-reduce time (ms) by message size (bytes), on
    `size_knots` (default: 16 geometric steps over the data's range; knots with < 2
    readings in the segment before them are dropped, which keeps noisy small-message
    readings averaged over a wide first segment).

    Returns (size knots, ms values, info with held-out error)."""
    rows = read_rows(path)
    x = np.array([float(r["size"]) for r in rows])
    y = np.array([parse_num(r["time_stats.all_reduce.median"]) for r in rows])
    good = glitch_mask(x, y)
    hold = holdout_mask(x.size, rng)
    tr, te = good & ~hold, good & hold
    if size_knots is None:
        size_knots = tuple(int(v) for v in np.geomspace(x[good].min(), x[good].max(), 16))
    kn = usable_knots(x[tr], size_knots)
    vals = fit_piecewise(x[tr], y[tr], kn)
    err = HoldoutError.of(eval_piecewise(kn, vals, x[te]), y[te])
    info = {"error": err.to_dict(), "rows": int(x.size), "rows_excluded_glitch": int((~good).sum())}
    return kn, vals, info


def fit_linear_layers(
    mlp_csv: Path,
    *,
    tp: int,
    num_layers: int,
    rng: np.random.Generator,
    hidden: int | None = None,
    allreduce_csv: Path | None = None,
    knots: tuple[int, ...] = DEFAULT_KNOTS,
    kv_save_ms_per_token_layer: float = 0.0,
) -> LinearFit:
    """Fit the whole-model linear-layer time per step (ms) as a function of tokens.

    Per op: glitch filter, seeded 80/20 split of rows, piecewise-linear least squares on
    the 80%. The model-level table is Σ_ops fit × num_layers + emb fit +
    kv_save_ms_per_token_layer × n × num_layers (+ 2 × num_layers × all-reduce of
    n·hidden·2 bytes when allreduce_csv is given). Held-out error: on held-out rows
    where every op reading is valid, predicted vs measured model-level sum.

    Raises:
        AstroUserError: missing file/columns or no rows for `tp`.
    """
    rows = read_rows(mlp_csv)
    ops = LAYER_OPS + STEP_OPS
    xs, ys, goods = {}, {}, {}
    for op in ops:
        x, y = _op_series(rows, op, tp)
        xs[op], ys[op], goods[op] = x, y, glitch_mask(x, y)
    x0 = xs[ops[0]]
    hold = holdout_mask(x0.size, rng)
    per_op: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    excluded: dict[str, int] = {}
    for op in ops:
        tr = goods[op] & ~hold
        kn = usable_knots(xs[op][tr], knots)
        per_op[op] = (kn, fit_piecewise(xs[op][tr], ys[op][tr], kn))
        excluded[op] = int((~goods[op]).sum())
    # a sum of piecewise-linear functions is piecewise linear on the union of their knots
    # ... plus the full data range, so held-out end rows (e.g. 1 token) still get a knot
    kn_all = np.asarray(sorted({float(k) for kn, _ in per_op.values() for k in kn} | {x0.min(), x0.max()}),
                        dtype=float)
    per_op_vals = {op: eval_piecewise(kn, v, kn_all) for op, (kn, v) in per_op.items()}
    layer_vals = sum(per_op_vals[op] for op in LAYER_OPS)
    model_vals = layer_vals * num_layers + per_op_vals["emb"] + kv_save_ms_per_token_layer * kn_all * num_layers

    def _ar(n: np.ndarray) -> np.ndarray:
        return np.zeros_like(n, dtype=float)

    ar_info: dict[str, Any] | None = None
    if allreduce_csv is not None:
        if not hidden:
            raise AstroUserError("hidden size needed for the all-reduce term", field="hidden")
        ar_kn, ar_vals, ar_info = fit_allreduce(allreduce_csv, rng, tuple(int(k) * hidden * 2 for k in knots))

        def _ar(n: np.ndarray) -> np.ndarray:  # noqa: F811
            return eval_piecewise(ar_kn, ar_vals, np.asarray(n, float) * hidden * 2.0)

        model_vals = model_vals + 2 * num_layers * _ar(kn_all)
    model_vals = np.maximum.accumulate(np.maximum(model_vals, 1e-6))

    # held-out: rows where all ops are valid
    all_good = np.logical_and.reduce([goods[op] for op in ops])
    te = all_good & hold
    meas = sum(ys[op][te] for op in LAYER_OPS) * num_layers + ys["emb"][te]
    pred_layer = sum(eval_piecewise(*per_op[op], x0[te]) for op in LAYER_OPS)
    pred = pred_layer * num_layers + eval_piecewise(*per_op["emb"], x0[te])
    err = HoldoutError.of(pred, meas)
    error = {
        "linear_layers": {
            **err.to_dict(),
            "what": f"per-step sum of {len(LAYER_OPS)} per-layer ops × {num_layers} layers + emb, "
            "TP-rank time, held-out rows of the mlp CSV",
        },
        "rows": int(x0.size),
        "rows_excluded_glitch_per_op": excluded,
        "per_op_holdout_mape_pct": {
            op: HoldoutError.of(eval_piecewise(*per_op[op], xs[op][goods[op] & hold]),
                                ys[op][goods[op] & hold]).mape_pct
            for op in ops if (goods[op] & hold).any()
        },
    }
    if ar_info is not None:
        error["all_reduce"] = {**ar_info["error"], "what": "one all-reduce, held-out rows of the network CSV",
                               "rows_excluded_glitch": ar_info["rows_excluded_glitch"]}
    src = {
        "file": Path(mlp_csv).name,
        "columns": [f"time_stats.{op}.median" for op in ops] + ["num_tokens", "num_tensor_parallel_workers"],
        "rows": f"num_tensor_parallel_workers == {tp}",
        "formula": f"token_s(n) = [Σ_layer_ops f_op(n) × {num_layers} + f_emb(n)"
        + (f" + kv_save {kv_save_ms_per_token_layer:.3g} ms/token/layer × n × {num_layers}"
           if kv_save_ms_per_token_layer else "")
        + (f" + 2 × {num_layers} × allreduce(n × {hidden} × 2 bytes)" if allreduce_csv else "")
        + "] / 1000, f = piecewise-linear least squares on 80% of rows, then made non-decreasing",
    }
    if allreduce_csv is not None:
        src["all_reduce_file"] = Path(allreduce_csv).name
    return LinearFit([int(k) for k in kn_all], [float(v) for v in model_vals], error, src)
