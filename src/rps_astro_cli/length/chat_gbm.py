"""`chat-gbm`: the CPU default length model — boosted trees over the conversation so far
and a hashed n-gram score of the message.

Why: on ShareGPT the strongest cue of a reply's length is the conversation itself — the
previous reply's length alone ranks later turns with Kendall τ ≈ 0.45, while the best
text-only model ranks with τ ≈ 0.25. `classic` saw the previous turn only as more
n-grams. This model reads a chat as (last user message, earlier turns) (`reads_history`):

1. Text score: ridge regression of log(reply tokens) on the message alone — hashed word
   1–2-grams and character 3–5-grams (as `classic`: log tf, idf, L2 rows) plus
   `classic.dense_cues`, weight DENSE_WEIGHT.
2. History cues (`history_features`, from the last HISTORY_TURNS turns): whether there is
   any history, log number of earlier turns, log tokens of the last three replies and of
   their median, mean and max, log tokens of the previous user message, whether the last
   reply stopped mid-sentence or held code, log characters of the whole history, the
   message's log tokens and its log ratio to the previous user message, and whether the
   message asks to continue. A missing value (no such reply) is MISSING = −1, below every
   log count, so a tree separates it with one split (scikit-learn's own NaN route fails
   on a column that is missing in every row of a fold).
3. Gradient-boosted trees (scikit-learn HistGradientBoostingRegressor, absolute-error
   loss on log tokens: the conditional median, which is MAE-optimal and keeps the ranking)
   over [text score, history cues, dense cues]. The text score the trees train on is
   out-of-fold (5 folds by conversation), so they learn how far to trust it on unseen text.
4. prediction = exp(tree output + shift), `shift` minimizing absolute error on out-of-fold
   tree predictions; the same out-of-fold predictions calibrate the quantiles
   (`length.dist.fit_log_spread`, 3 bins by predicted size), so `predict_dists` works.

Hyper-parameters were chosen by 5-fold × 3-seed cross-validation by conversation on the
ShareGPT V3 sample (BENCHMARKS.md), not on one split. The artifact holds numbers only
(idf and ridge weights over hashed columns, flattened tree arrays, scalers) in `model.npz`
loaded with `allow_pickle=False`; prediction walks the trees with numpy (no scikit-learn
estimator is unpickled), so one prompt costs well under the 2 ms tagger budget.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.length.base import LENGTH_MODELS, LengthModel, LengthModelMeta, ProgressFn
from rps_astro_cli.length.classic import (
    N_DENSE,
    dense_matrix,
    design_matrix,
    init_text_weights,
    load_linear_weights,
    ngram_window,
    tf_matrix,
)
from rps_astro_cli.length.data import LengthDataset
from rps_astro_cli.length.dist import fit_log_spread
from rps_astro_cli.length.prompts import truncate_prompt
from rps_astro_cli.tokens import count_tokens_fallback

N_HASH = 2**18
DENSE_WEIGHT = 0.3
TEXT_ALPHA = 1.0
HISTORY_TURNS = 8
COUNT_EDGE_CHARS = 2048
N_HISTORY = 15
MISSING = -1.0
"""A history cue that does not exist for this request (e.g. no earlier reply)."""
OOF_FOLDS = 5
GBM_PARAMS: dict[str, Any] = {"loss": "absolute_error", "learning_rate": 0.05, "max_iter": 300,
                              "max_leaf_nodes": 4, "min_samples_leaf": 20, "l2_regularization": 1.0}
SHIFTS = np.linspace(-1.0, 1.0, 81)
_WEIGHTS_FILE = "model.npz"
_SENTENCE_END = frozenset(".!?)]}\"'`*:;")
_TREE_ARRAYS = ("tree_feature", "tree_threshold", "tree_left", "tree_right", "tree_value", "tree_missing_left",
                "tree_roots")


def approx_tokens(text: str) -> float:
    """Fallback tokens of `text`, counted exactly up to 2·COUNT_EDGE_CHARS characters;
    longer texts count their first and last COUNT_EDGE_CHARS and scale by length (a chat
    can carry many 30k-character turns: this bounds the tagger's work per turn)."""
    if len(text) <= 2 * COUNT_EDGE_CHARS:
        return float(count_tokens_fallback(text))
    edges = count_tokens_fallback(text[:COUNT_EDGE_CHARS]) + count_tokens_fallback(text[-COUNT_EDGE_CHARS:])
    return edges * len(text) / (2 * COUNT_EDGE_CHARS)


def history_features(message: str, history: tuple[str, ...] | list[str]) -> list[float]:
    """The N_HISTORY history cues of one request (module docstring, item 2); MISSING = absent."""
    recent = list(history[-HISTORY_TURNS:])
    replies = [approx_tokens(t) for t in recent[::-1][0::2]]  # most recent first
    users = [approx_tokens(t) for t in recent[::-1][1::2]]
    miss = MISSING
    msg = math.log1p(approx_tokens(message))
    last = recent[-1].rstrip() if recent else ""

    def rep(i: int) -> float:
        return math.log1p(replies[i]) if len(replies) > i else miss

    return [
        float(bool(history)),
        math.log1p(len(history)),
        rep(0), rep(1), rep(2),
        math.log1p(float(np.median(replies))) if replies else miss,
        math.log1p(float(np.mean(replies))) if replies else miss,
        math.log1p(max(replies)) if replies else miss,
        math.log1p(users[0]) if users else miss,
        float(last[-1:] not in _SENTENCE_END) if last else miss,
        float("```" in last) if recent else miss,
        math.log1p(sum(len(t) for t in history)),
        msg,
        msg - math.log1p(users[0]) if users else miss,
        float(bool(re.match(r"\s*(continue|go on|more)\b", message, re.IGNORECASE))),
    ]


class TreeEnsemble:
    """Additive regression trees in flat arrays, evaluated level by level with numpy.

    Node i: split feature `feature[i]` at `threshold[i]` (x ≤ threshold → `left[i]`,
    else `right[i]`; NaN → left when `missing_left[i]`), or a leaf (`left[i] == -1`) of
    value `value[i]`. Tree t starts at node `roots[t]`. Output = baseline + Σ leaf values.
    """

    def __init__(self, feature: np.ndarray, threshold: np.ndarray, left: np.ndarray, right: np.ndarray,
                 value: np.ndarray, missing_left: np.ndarray, roots: np.ndarray, baseline: float):
        self.feature = feature.astype(np.int64)
        self.threshold = threshold.astype(np.float64)
        self.left = left.astype(np.int64)
        self.right = right.astype(np.int64)
        self.value = value.astype(np.float64)
        self.missing_left = missing_left.astype(bool)
        self.roots = roots.astype(np.int64)
        self.baseline = float(baseline)

    @classmethod
    def from_sklearn(cls, est: Any) -> TreeEnsemble:
        """Flatten a fitted HistGradientBoostingRegressor (numeric features only)."""
        feats, thr, left, right, val, miss, roots = [], [], [], [], [], [], []
        offset = 0
        for (tree,) in est._predictors:  # one tree per iteration for a regressor
            nodes = tree.nodes
            if nodes["is_categorical"].any():
                raise ValueError("categorical splits are not supported")
            leaf = nodes["is_leaf"].astype(bool)
            roots.append(offset)
            feats.append(np.where(leaf, 0, nodes["feature_idx"]))
            thr.append(np.where(leaf, 0.0, nodes["num_threshold"]))
            left.append(np.where(leaf, -1, nodes["left"].astype(np.int64) + offset))
            right.append(np.where(leaf, -1, nodes["right"].astype(np.int64) + offset))
            val.append(np.where(leaf, nodes["value"], 0.0))
            miss.append(nodes["missing_go_to_left"].astype(bool))
            offset += len(nodes)
        cat = np.concatenate
        return cls(cat(feats), cat(thr), cat(left), cat(right), cat(val), cat(miss), np.array(roots),
                   float(np.ravel(est._baseline_prediction)[0]))

    def predict(self, X: np.ndarray) -> np.ndarray:
        """Ensemble output for rows of X (shape (n, n_features))."""
        X = np.asarray(X, dtype=np.float64)
        node = np.broadcast_to(self.roots, (X.shape[0], len(self.roots))).copy()
        rows = np.arange(X.shape[0])[:, None]
        for _ in range(64):  # deeper than any tree here; stops when every walk is at a leaf
            inner = self.left[node] >= 0
            if not inner.any():
                break
            x = X[rows, self.feature[node]]
            go_left = np.where(np.isnan(x), self.missing_left[node], x <= self.threshold[node])
            node = np.where(inner, np.where(go_left, self.left[node], self.right[node]), node)
        return self.baseline + self.value[node].sum(axis=1)


def _group_folds(conversation_ids: list[str], k: int, rng: np.random.Generator) -> np.ndarray:
    ids = sorted(set(conversation_ids))
    perm = rng.permutation(len(ids))
    where = {ids[j]: i % k for i, j in enumerate(perm)}
    return np.array([where[c] for c in conversation_ids], dtype=np.int64)


@LENGTH_MODELS.register("chat-gbm")
class ChatGBMLengthModel(LengthModel):
    """Boosted trees over history cues and a hashed n-gram text score (module docstring)."""

    name = "chat-gbm"
    reads_history = True

    def __init__(self, n_hash: int = N_HASH):
        super().__init__()
        init_text_weights(self, n_hash)
        self.text_intercept = 0.0
        self.shift = 0.0
        self.trees: TreeEnsemble | None = None

    # ---- features

    def _tf(self, texts: list[str]) -> sp.csr_matrix:
        return tf_matrix(self._word, self._char, texts)

    @staticmethod
    def _design(X_tf: sp.csr_matrix, D: np.ndarray, idf: np.ndarray, mean: np.ndarray,
                std: np.ndarray) -> sp.csr_matrix:
        return design_matrix(X_tf, D, idf, mean, std)

    @staticmethod
    def _dense(texts: list[str]) -> np.ndarray:
        return dense_matrix(texts)

    def _text_scores(self, texts: list[str], D: np.ndarray) -> np.ndarray:
        """The ridge text score of each text: (tf·idf)/‖tf·idf‖ · coef + dense part, computed
        on the two hashed blocks directly (no stacked or normalized copy: this is the
        tagger's hot path)."""
        win = [ngram_window(t) for t in texts]
        n = len(texts)
        dot = np.zeros(n)
        sq = np.zeros(n)
        for block, X in enumerate((self._word.transform(win), self._char.transform(win))):
            cols = X.indices + block * self.n_hash
            w = np.log1p(X.data) * self.idf[cols]
            rows = np.repeat(np.arange(n), np.diff(X.indptr))
            dot += np.bincount(rows, weights=w * self.coef[cols], minlength=n)
            sq += np.bincount(rows, weights=w * w, minlength=n)
        norms = np.sqrt(sq)
        Dz = (D - self.dense_mean) / self.dense_std * DENSE_WEIGHT
        lin = np.divide(dot, norms, out=np.zeros(n), where=norms > 0)
        return lin + Dz @ self.dense_coef + self.text_intercept

    # ---- training

    def fit(self, train: LengthDataset, val: LengthDataset | None, *, rng: np.random.Generator,
            progress: ProgressFn | None = None) -> dict[str, Any]:
        """Fit on train + val together (hyper-parameters are fixed, chosen by
        cross-validation; see the module docstring)."""
        F, y, folds = self.fit_features(train, val, rng=rng, progress=progress)
        return self.fit_trees(F, y, folds, rng=rng, progress=progress)

    def fit_features(self, train: LengthDataset, val: LengthDataset | None, *, rng: np.random.Generator,
                     progress: ProgressFn | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Stage 1 of `fit`: the text score (out-of-fold for the returned rows, and the final
        ridge fit on all of them, stored in the model) and the tree features.

        Returns (F, y, folds): the training rows' tree features (out-of-fold text score,
        history cues, dense cues), their reply tokens, and the out-of-fold fold of each row
        (by conversation, drawn from `rng`), which `fit_trees` reuses."""
        from sklearn.linear_model import Ridge

        def tell(msg: str, frac: float) -> None:
            if progress:
                progress(msg, frac)

        data = LengthDataset(train.samples + (val.samples if val is not None else []))
        if len(data) < 4 * OOF_FOLDS:
            raise AstroUserError(f"chat-gbm needs ≥ {4 * OOF_FOLDS} training pairs, got {len(data)}", field="--data")
        texts = [truncate_prompt(s.text)[0] for s in data.samples]
        hist = [tuple(truncate_prompt(h)[0] for h in s.history) for s in data.samples]
        y = data.targets.astype(np.float64)
        ly = np.log(y)
        tell("features", 0.05)
        X_tf = self._tf(texts)
        D = self._dense(texts)
        H = np.array([history_features(t, h) for t, h in zip(texts, hist)], dtype=np.float64)
        folds = _group_folds(data.conversation_ids, OOF_FOLDS, rng)

        def text_fit(rows: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray]:
            Xr = X_tf[rows]
            df = np.bincount(Xr.indices, minlength=Xr.shape[1])
            idf = np.log((1.0 + len(rows)) / (1.0 + df)) + 1.0
            mean, std = D[rows].mean(axis=0), D[rows].std(axis=0)
            std[std == 0] = 1.0
            reg = Ridge(alpha=TEXT_ALPHA).fit(self._design(Xr, D[rows], idf, mean, std), ly[rows])
            return reg, idf, mean, std

        oof_text = np.empty(len(y))
        for k in range(OOF_FOLDS):
            tell(f"text score, fold {k + 1}/{OOF_FOLDS}", 0.1 + 0.4 * k / OOF_FOLDS)
            tr, te = np.flatnonzero(folds != k), np.flatnonzero(folds == k)
            reg, idf, mean, std = text_fit(tr)
            oof_text[te] = reg.predict(self._design(X_tf[te], D[te], idf, mean, std))
        reg, self.idf, self.dense_mean, self.dense_std = text_fit(np.arange(len(y)))
        self.coef = reg.coef_[: 2 * self.n_hash].copy()
        self.dense_coef = reg.coef_[2 * self.n_hash :].copy()
        self.text_intercept = float(reg.intercept_)
        return np.column_stack([oof_text, H, D]), y, folds

    def fit_trees(self, F: np.ndarray, y: np.ndarray, folds: np.ndarray, *, rng: np.random.Generator,
                  progress: ProgressFn | None = None) -> dict[str, Any]:
        """Stage 2 of `fit`: out-of-fold trees (for the shift and the quantile calibration),
        then the final trees on every row. F, y, folds: `fit_features`' output."""
        from sklearn.ensemble import HistGradientBoostingRegressor

        def tell(msg: str, frac: float) -> None:
            if progress:
                progress(msg, frac)

        ly = np.log(y)

        def gbm() -> Any:
            return HistGradientBoostingRegressor(**GBM_PARAMS, random_state=int(rng.integers(2**31)))

        oof = np.empty(len(y))
        for k in range(OOF_FOLDS):
            tell(f"trees, fold {k + 1}/{OOF_FOLDS}", 0.5 + 0.3 * k / OOF_FOLDS)
            tr, te = np.flatnonzero(folds != k), np.flatnonzero(folds == k)
            oof[te] = gbm().fit(F[tr], ly[tr]).predict(F[te])
        errs = [np.abs(np.exp(oof + s) - y).mean() for s in SHIFTS]
        self.shift = float(SHIFTS[int(np.argmin(errs))])
        cal = fit_log_spread(np.exp(oof + self.shift), y)
        tell("final fit", 0.85)
        self.trees = TreeEnsemble.from_sklearn(gbm().fit(F, ly))
        tell("done", 1.0)
        return {"shift": self.shift, "n_fit": len(y), "oof_mae": float(np.abs(np.exp(oof + self.shift) - y).mean()),
                "oof_folds": OOF_FOLDS, "dist": cal.to_dict()}

    def tree_features(self, texts: list[str], histories: list[tuple[str, ...]]) -> np.ndarray:
        """The trees' input rows for (message, earlier turns) pairs (texts as the tagger
        reads them), with the fitted text score."""
        D = self._dense(texts)
        H = np.array([history_features(t, h) for t, h in zip(texts, histories)], dtype=np.float64)
        return np.column_stack([self._text_scores(texts, D), H.reshape(len(texts), N_HISTORY), D])

    # ---- prediction

    def _predict_raw(self, texts: list[str]) -> np.ndarray:
        return self._predict_raw_turns(texts, [()] * len(texts))

    def _predict_raw_turns(self, texts: list[str], histories: list[tuple[str, ...]]) -> np.ndarray:
        if self.trees is None:
            raise AstroUserError("chat-gbm model is not trained or loaded", field="--model")
        return np.exp(np.minimum(self.trees.predict(self.tree_features(texts, histories)) + self.shift, 20.0))

    # ---- persistence

    def params(self) -> dict[str, Any]:
        return {"n_hash": self.n_hash, "word_ngrams": [1, 2], "char_wb_ngrams": [3, 5], "dense_weight": DENSE_WEIGHT,
                "text_alpha": TEXT_ALPHA, "history_turns": HISTORY_TURNS, "gbm": dict(GBM_PARAMS),
                "shift": self.shift, "target": "log(reply tokens)", "reads_history": True}

    def save_files(self, directory: Path) -> None:
        t = self.trees
        if t is None:
            raise AstroUserError("chat-gbm model is not trained", field="--model")
        np.savez_compressed(
            directory / _WEIGHTS_FILE,
            idf=self.idf.astype(np.float32), coef=self.coef.astype(np.float32),
            dense_mean=self.dense_mean, dense_std=self.dense_std, dense_coef=self.dense_coef,
            scalars=np.array([self.text_intercept, self.shift, t.baseline]),
            tree_feature=t.feature.astype(np.int32), tree_threshold=t.threshold,
            tree_left=t.left.astype(np.int32), tree_right=t.right.astype(np.int32), tree_value=t.value,
            tree_missing_left=t.missing_left, tree_roots=t.roots.astype(np.int32),
        )

    @classmethod
    def load_files(cls, directory: Path, meta: LengthModelMeta) -> ChatGBMLengthModel:
        fp, n_hash, a = load_linear_weights(directory, meta, "chat-gbm", _TREE_ARRAYS)
        n_nodes = a["tree_value"].shape[0]
        for key in ("tree_feature", "tree_threshold", "tree_left", "tree_right", "tree_missing_left"):
            if a[key].shape != (n_nodes,):
                raise AstroUserError(f"{fp}: tree array {key!r} has {a[key].shape}, expected ({n_nodes},)",
                                     field="--model", fix="retrain the artifact")
        n_feat = 1 + N_HISTORY + N_DENSE
        kids = np.concatenate([a["tree_left"], a["tree_right"]])
        if (n_nodes == 0 or a["tree_feature"].min(initial=0) < 0 or a["tree_feature"].max(initial=0) >= n_feat
                or kids.max(initial=-1) >= n_nodes or kids.min(initial=-1) < -1
                or a["tree_roots"].min(initial=0) < 0 or a["tree_roots"].max(initial=0) >= n_nodes):
            raise AstroUserError(f"{fp}: tree arrays point outside the model", field="--model",
                                 fix="retrain the artifact")
        if not np.all(np.isfinite(a["tree_value"])):
            raise AstroUserError(f"{fp}: array 'tree_value' holds NaN/inf", field="--model")
        m = cls(n_hash=n_hash)
        m.idf, m.coef = a["idf"].astype(np.float64), a["coef"].astype(np.float64)
        m.dense_mean, m.dense_std, m.dense_coef = a["dense_mean"], a["dense_std"], a["dense_coef"]
        m.text_intercept, m.shift, baseline = (float(v) for v in a["scalars"])
        m.trees = TreeEnsemble(a["tree_feature"], a["tree_threshold"], a["tree_left"], a["tree_right"],
                               a["tree_value"], a["tree_missing_left"], a["tree_roots"], baseline)
        return m
