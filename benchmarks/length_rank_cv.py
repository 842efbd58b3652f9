"""Length-model ranking variants on the cross-validation folds (issue 13, round 5).

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python benchmarks/length_rank_cv.py --seeds 0,1,2 --variants all

The folds are `length.crossval`'s (5 folds by conversation × seeds; each fold's train +
validation rows fit the model, its test rows score it; the median baseline on the same
train + validation rows gives the paired MAE ratio). For every fold, chat-gbm's stage 1
(`ChatGBMLengthModel.fit_features`: the hashed-n-gram ridge text score, out of fold for
the training rows, and the history / dense cues) runs once with the fold's `fit_rng(seed)`
and is cached under `--cache`; the variants differ only in stage 2 (what is fitted on
those features), so they are compared on identical inputs. Variant "l1" is the shipped
stage 2 (`fit_trees`) and reproduces `astro eval-length --cv`'s chat-gbm rows.

Selection protocol: `--select-seeds` (default 0) are the folds a variant is picked on;
the table reports the others separately ("held-out seeds"), so a pick is not scored on the
folds that chose it. Seeds share the data (a conversation is in some test fold of every
seed), so held-out seeds guard against fold-level luck, not against the data sample.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.length.chat_gbm import GBM_PARAMS, OOF_FOLDS, SHIFTS, ChatGBMLengthModel
from rps_astro_cli.length.crossval import CV_VAL_FRAC, fold_of
from rps_astro_cli.length.data import load_length_data, split_by_conversation
from rps_astro_cli.length.pipeline import fit_rng
from rps_astro_cli.length.prompts import prepare_prompts, truncate_prompt

_WORDS = re.compile(r"(\d{2,5})\s*(?:-|to)?\s*(?:\d{2,5}\s*)?words?\b", re.I)
_ITEMS = re.compile(r"\b(\d{1,3})\s+(?:\w+\s+)?(?:ideas|examples|questions|tips|names|points|steps|ways|titles|"
                    r"items|reasons|options|bullet|sentences|paragraphs|lines|slides|tweets|posts|headlines|"
                    r"taglines|words)\b", re.I)
_LONG = re.compile(r"\b(essay|article|blog|story|script|report|proposal|outline|plan|curriculum|lesson|guide|"
                   r"detailed|in detail|comprehensive|step[- ]by[- ]step|chapter|speech|cover letter)\b", re.I)
_SHORT = re.compile(r"\b(short|brief|briefly|one sentence|one word|one line|concise|yes or no|tl;?dr|only answer|"
                    r"just answer|single word)\b", re.I)
_CODE_ASK = re.compile(r"\b(code|function|program|script|class|implement|python|javascript|sql|java|c\+\+|react|"
                       r"regex|api)\b", re.I)
_TRANSFORM = re.compile(r"\b(rewrite|rephrase|paraphrase|translate|correct|fix|proofread|improve|edit|summari[sz]e|"
                        r"shorten)\b", re.I)
_YESNO = re.compile(r"^\s*(is|are|do|does|did|can|could|will|would|should|was|were|have|has)\b", re.I)
_WRITE = re.compile(r"^\s*(please\s+)?(write|create|generate|make|compose|draft|give|list|provide|design|develop|"
                    r"build|suggest|brainstorm)\b", re.I)
_EXPLAIN = re.compile(r"^\s*(please\s+)?(explain|describe|what|how|why|tell me|compare|discuss|analy[sz]e)\b", re.I)
_ROLEPLAY = re.compile(r"\b(act as|i want you to act|pretend|you are a|roleplay|reply with|respond with|"
                       r"do not (?:write|explain)|don't (?:write|explain)|only reply)\b", re.I)


def first_turn_cues(text: str) -> list[float]:
    """Cheap prompt cues for a request without history (benchmark-only until shipped):
    a requested word count, a requested number of items, asks for long / short output,
    code, a transformation of pasted text, a yes/no question, an imperative "write …" /
    "explain …", a role-play instruction, and the share of the text after its first line."""
    w = _WORDS.search(text)
    it = _ITEMS.search(text)
    first_line = text.split("\n", 1)[0]
    return [
        math.log1p(float(w.group(1))) if w else -1.0,
        math.log1p(float(it.group(1))) if it else -1.0,
        float(len(_LONG.findall(text)) > 0),
        float(len(_SHORT.findall(text)) > 0),
        float(_CODE_ASK.search(text) is not None),
        float(_TRANSFORM.search(text) is not None),
        float(_YESNO.match(text) is not None),
        float(_WRITE.match(text) is not None),
        float(_EXPLAIN.match(text) is not None),
        float(_ROLEPLAY.search(text) is not None),
        1.0 - len(first_line) / max(1, len(text)),
    ]


DATA = Path(os.environ.get("ASTRO_DATA_DIR", "/work/shared/data")) / "sharegpt/sharegpt_v3_sample500.json"


def fold_features(ds, seed: int, k: int, folds: int, cache: Path) -> dict[str, np.ndarray]:
    """Stage-1 features of one CV fold (cached): F/y/inner folds of the train + val rows,
    F/y/first-turn mask of the test rows, the median baseline's tokens, and the
    first-turn cues of both sides."""
    f = cache / f"s{seed}_f{k}.npz"
    if f.is_file():
        with np.load(f) as z:
            return {key: z[key] for key in z.files}
    cids = ds.conversation_ids
    fold_idx = fold_of(cids, folds=folds, seed=seed)
    te = np.flatnonzero(fold_idx == k)
    rest = np.flatnonzero(fold_idx != k)
    inner = split_by_conversation(ds.subset(rest), test_frac=0.0, val_frac=CV_VAL_FRAC,
                                  rng=np.random.default_rng([seed, k]))
    val_ids = set(inner.val.conversation_ids)
    tr = [int(i) for i in rest if cids[i] not in val_ids]
    va = [int(i) for i in rest if cids[i] in val_ids]
    median_tokens = float(np.median(ds.targets[np.r_[tr, va].astype(np.int64)]))
    m = ChatGBMLengthModel()
    rng = fit_rng(seed)
    F, y, inner_folds = m.fit_features(ds.subset(tr), ds.subset(va), rng=rng)
    # the rng state after stage 1 seeds stage 2 (as fit does): keep its next draws
    gbm_seeds = rng.integers(2**31, size=OOF_FOLDS + 1)
    test = ds.subset(te.tolist())
    texts = prepare_prompts([s.text for s in test.samples]).texts
    hist = [tuple(truncate_prompt(h)[0] for h in s.history) for s in test.samples]
    F_te = m.tree_features(texts, hist)
    train_texts = [truncate_prompt(s.text)[0] for s in (ds.subset(tr).samples + ds.subset(va).samples)]
    out = {"F": F, "y": y, "folds": inner_folds, "gbm_seeds": gbm_seeds, "F_te": F_te,
           "y_te": test.targets.astype(np.float64), "first_te": test.first_turn_mask,
           "median": np.array(median_tokens),
           "C": np.array([first_turn_cues(t) for t in train_texts]),
           "C_te": np.array([first_turn_cues(t) for t in texts])}
    cache.mkdir(parents=True, exist_ok=True)
    np.savez(f, **out)
    return out


# ---- stage-2 variants: (F, ly, inner folds, rng seeds) -> predict(F_test) -> log tokens

def _hgb(loss: str = "absolute_error", **over: Any) -> Callable[[np.ndarray, np.ndarray, int], Any]:
    from sklearn.ensemble import HistGradientBoostingRegressor

    def fit(X: np.ndarray, ly: np.ndarray, seed: int) -> Callable[[np.ndarray], np.ndarray]:
        p = dict(GBM_PARAMS, loss=loss, **over)
        est = HistGradientBoostingRegressor(**p, random_state=int(seed)).fit(X, ly)
        return est.predict
    return fit


def _bag(base: Callable, n: int) -> Callable:
    """Mean log prediction of `n` fits on bootstrap resamples of the rows."""
    def fit(X: np.ndarray, ly: np.ndarray, seed: int) -> Callable[[np.ndarray], np.ndarray]:
        r = np.random.default_rng(seed)
        preds = []
        for _ in range(n):
            rows = r.integers(len(ly), size=len(ly))
            preds.append(base(X[rows], ly[rows], int(r.integers(2**31))))
        return lambda Z: np.mean([p(Z) for p in preds], axis=0)
    return fit


def _avg(*fits: Callable, weights: tuple[float, ...] | None = None) -> Callable:
    def fit(X: np.ndarray, ly: np.ndarray, seed: int) -> Callable[[np.ndarray], np.ndarray]:
        ps = [f(X, ly, seed) for f in fits]
        w = np.asarray(weights or [1.0] * len(ps)) / sum(weights or [1.0] * len(ps))
        return lambda Z: sum(wi * p(Z) for wi, p in zip(w, ps))
    return fit


_RANK_MEMO: dict[tuple[int, int, int], Callable[[np.ndarray], np.ndarray]] = {}


def _ranknet(n_iter: int = 150, lr: float = 0.1, leaves: int = 4, min_leaf: int = 20) -> Callable:
    """Boosted trees on the RankNet pairwise logistic loss over all pairs with y_i ≠ y_j
    (Kendall τ counts every pair once), Newton leaf values; the score is then mapped to
    log tokens by a 1-D median (L1) line fitted on the training rows, so the output is a
    length and the ranking is the score's. Fits are memoised per (rows, seed), so a blend
    reuses them."""
    from sklearn.tree import DecisionTreeRegressor

    def fit(X: np.ndarray, ly: np.ndarray, seed: int) -> Callable[[np.ndarray], np.ndarray]:
        key = (len(ly), int(np.round(ly.sum() * 1e6)), seed)
        if key in _RANK_MEMO:
            return _RANK_MEMO[key]
        n = len(ly)
        lyf = ly.astype(np.float32)
        sgn = np.sign(lyf[:, None] - lyf[None, :])  # +1 where i should rank above j
        pair = np.abs(sgn)
        scale = np.float32(2.0 * n / max(1.0, float(pair.sum())))
        s = np.zeros(n, np.float32)
        trees = []
        for it in range(n_iter):
            d = s[:, None] - s[None, :]
            sig = 1.0 / (1.0 + np.exp(sgn * d))  # σ(−sgn·d): the pair's loss slope
            g = -(sgn * sig).sum(axis=1) * scale
            h = (pair * sig * (1 - sig)).sum(axis=1) * scale + 1e-6
            t = DecisionTreeRegressor(max_leaf_nodes=leaves, min_samples_leaf=min_leaf,
                                      random_state=seed + it).fit(X, -g / h, sample_weight=h)
            leaf = t.apply(X)
            val = np.zeros(t.tree_.node_count, np.float32)
            gs = np.bincount(leaf, weights=g, minlength=len(val))
            hs = np.bincount(leaf, weights=h, minlength=len(val))
            val[:] = -gs / (hs + 1.0)  # Newton step per leaf, λ = 1
            s += np.float32(lr) * val[leaf]
            trees.append((t, val))

        def score(Z: np.ndarray) -> np.ndarray:
            return sum(lr * val[t.apply(Z)] for t, val in trees)

        a, b = _l1_line(s.astype(np.float64), ly)
        out = lambda Z: a + b * score(Z)  # noqa: E731
        _RANK_MEMO[key] = out
        return out
    return fit


def _pct_target(loss: str) -> Callable:
    """Trees fitted to the training rows' percentile rank of y (a Spearman-like target: a
    2-token and a 20-token reply are one rank step apart, not a log-scale chasm), the score
    mapped back to log tokens by a 1-D median line on the training rows."""
    from scipy.stats import rankdata

    def fit(X: np.ndarray, ly: np.ndarray, seed: int) -> Callable[[np.ndarray], np.ndarray]:
        pct = (rankdata(ly) - 0.5) / len(ly)
        p = _hgb(loss)(X, pct, seed)
        a, b = _l1_line(p(X), ly)
        return lambda Z: a + b * p(Z)
    return fit


def _l1_line(x: np.ndarray, ly: np.ndarray) -> tuple[float, float]:
    from sklearn.linear_model import QuantileRegressor

    q = QuantileRegressor(quantile=0.5, alpha=0.0, solver="highs").fit(x[:, None], ly)
    return float(q.intercept_), float(q.coef_[0])


def _with_cues(base: Callable) -> Callable:
    """Marker: the variant sees the first-turn cues appended to F."""
    base.with_cues = True  # type: ignore[attr-defined]
    return base


VARIANTS: dict[str, Callable[[], Callable]] = {
    "l1": lambda: _hgb(),
    "l2": lambda: _hgb("squared_error"),
    "l1+l2": lambda: _avg(_hgb(), _hgb("squared_error")),
    "bag5": lambda: _bag(_hgb(), 5),
    "bag10": lambda: _bag(_hgb(), 10),
    "ranknet": lambda: _ranknet(),
    "pct-l2": lambda: _pct_target("squared_error"),
    "pct-l1": lambda: _pct_target("absolute_error"),
    "l1+ranknet": lambda: _avg(_hgb(), _ranknet()),
    "l1+cues": lambda: _with_cues(_hgb()),
    "bag5+cues": lambda: _with_cues(_bag(_hgb(), 5)),
    "l1+l2+cues": lambda: _with_cues(_avg(_hgb(), _hgb("squared_error"))),
}


def evaluate_variant(name: str, fx: dict[str, np.ndarray]) -> dict[str, float]:
    from scipy.stats import kendalltau

    fit = VARIANTS[name]()
    cues = getattr(fit, "with_cues", False)
    F = np.column_stack([fx["F"], fx["C"]]) if cues else fx["F"]
    F_te = np.column_stack([fx["F_te"], fx["C_te"]]) if cues else fx["F_te"]
    y, folds, seeds = fx["y"], fx["folds"], fx["gbm_seeds"]
    ly = np.log(y)
    oof = np.empty(len(y))
    for k in range(OOF_FOLDS):  # the shift for MAE from inner out-of-fold predictions, as fit_trees
        tr, te = np.flatnonzero(folds != k), np.flatnonzero(folds == k)
        oof[te] = fit(F[tr], ly[tr], int(seeds[k]))(F[te])
    shift = float(SHIFTS[int(np.argmin([np.abs(np.exp(oof + s) - y).mean() for s in SHIFTS]))])
    pred = np.rint(np.clip(np.exp(np.minimum(fit(F, ly, int(seeds[-1]))(F_te) + shift, 20.0)), 1, None))
    y_te, first, med = fx["y_te"], fx["first_te"].astype(bool), float(fx["median"])
    row = {"mae": float(np.abs(pred - y_te).mean()), "tau": float(kendalltau(pred, y_te).statistic)}
    row["mae_ratio"] = row["mae"] / float(np.abs(med - y_te).mean())
    row["tau_first"] = float(kendalltau(pred[first], y_te[first]).statistic)
    row["mae_ratio_first"] = float(np.abs(pred[first] - y_te[first]).mean() / np.abs(med - y_te[first]).mean())
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--select-seeds", default="0", help="seeds whose folds a variant is picked on")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--variants", default="all")
    ap.add_argument("--only-folds", default=None, help="comma-separated fold indices to run (default: all)")
    ap.add_argument("--cache", type=Path, default=Path("runs/length/rank_cv_cache"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    sel = {int(s) for s in args.select_seeds.split(",")}
    names = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    for n in names:
        if n not in VARIANTS:
            ap.error(f"--variants: unknown {n!r}; known: {', '.join(VARIANTS)}")
    ds = load_length_data(args.data, context_turns=0)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for seed in seeds:
        for k in range(args.folds):
            if args.only_folds is not None and str(k) not in args.only_folds.split(","):
                continue
            fx = fold_features(ds, seed, k, args.folds, args.cache)
            for n in names:
                rows.append({"variant": n, "seed": seed, "fold": k, **evaluate_variant(n, fx)})
                print(f"  {n}: " + json.dumps({key: round(v, 4) for key, v in rows[-1].items() if key != "variant"}),
                      file=sys.stderr, flush=True)
            print(f"seed {seed} fold {k} done ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))
    keys = ("tau", "mae_ratio", "tau_first", "mae_ratio_first")
    print("| variant | folds | " + " | ".join(keys) + " | τ − l1 (paired, mean [min–max]) |")
    print("|---|---|" + "---|" * (len(keys) + 1))
    for part, want in (("selection seeds", True), ("held-out seeds", False)):
        mine = [r for r in rows if (r["seed"] in sel) == want]
        if not mine:
            continue
        for n in names:
            rs = [r for r in mine if r["variant"] == n]
            base = {(r["seed"], r["fold"]): r["tau"] for r in mine if r["variant"] == "l1"}
            cells = [f"{np.mean([r[k] for r in rs]):.3f} [{min(r[k] for r in rs):.3f}–{max(r[k] for r in rs):.3f}]"
                     for k in keys]
            d = [r["tau"] - base[(r["seed"], r["fold"])] for r in rs if (r["seed"], r["fold"]) in base]
            dd = f"{np.mean(d):+.4f} [{min(d):+.4f}–{max(d):+.4f}]" if d else "–"
            print(f"| {n} | {part} ({len(rs)}) | " + " | ".join(cells) + f" | {dd} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
