"""`classic`: the CPU default length model — a linear model on hashed n-grams.

Features of a prompt (truncated as in `length.prompts`):
- hashed word 1–2-grams and hashed character 3–5-grams inside word boundaries
  (scikit-learn `HashingVectorizer`, 2^18 columns each) of the prompt's first
  NGRAM_HEAD_CHARS and last NGRAM_TAIL_CHARS characters (n-gram analysis is the
  costly part: this bounds a 30k-character prompt at a few ms), sublinear tf (log1p), idf
  weights fitted on the training prompts, rows L2-normalized. Hashing means the artifact
  holds column indices and weights only — no vocabulary, so no prompt text is stored.
- eight cheap dense cues, standardized: log characters, log fallback tokens, log lines,
  log question marks, code fence present, log digits, code punctuation present, share of
  non-ASCII characters (language).

Target: log(reply tokens), fitted by ridge regression; prediction = exp(score + shift),
where `shift` is the constant that minimizes absolute error on out-of-fold training
predictions (exp of a least-squares log fit estimates the geometric mean, which sits
below the median on ShareGPT's left-skewed log lengths; MAE wants the median). The ridge
`alpha` is picked on the validation split by MAE; the final model is refitted on train +
val with the chosen alpha and shift.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.length.base import LENGTH_MODELS, LengthModel, LengthModelMeta, ProgressFn
from rps_astro_cli.length.data import LengthDataset
from rps_astro_cli.length.prompts import truncate_prompt
from rps_astro_cli.tokens import count_tokens_fallback

N_HASH = 2**18
N_DENSE = 8
DENSE_WEIGHT = 0.3
NGRAM_HEAD_CHARS = 3072
NGRAM_TAIL_CHARS = 1024
ALPHAS = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
SHIFTS = np.linspace(-1.0, 1.0, 81)
_WEIGHTS_FILE = "model.npz"
_CODE_PUNCT = re.compile(r"[{};=]")
_DIGIT = re.compile(r"\d")


def ngram_window(text: str) -> str:
    """The part of a prompt whose n-grams are hashed: all of it up to
    NGRAM_HEAD_CHARS + NGRAM_TAIL_CHARS characters, else its head and tail."""
    if len(text) <= NGRAM_HEAD_CHARS + NGRAM_TAIL_CHARS:
        return text
    return text[:NGRAM_HEAD_CHARS] + "\n" + text[-NGRAM_TAIL_CHARS:]


def _vectorizers(n_hash: int) -> tuple[Any, Any]:
    from sklearn.feature_extraction.text import HashingVectorizer

    common = dict(n_features=n_hash, alternate_sign=False, norm=None, dtype=np.float64)
    word = HashingVectorizer(analyzer="word", ngram_range=(1, 2), **common)
    char = HashingVectorizer(analyzer="char_wb", ngram_range=(3, 5), **common)
    return word, char


def dense_cues(text: str) -> list[float]:
    """The eight dense cues of one prompt (see module docstring), unstandardized."""
    n = len(text)
    return [
        np.log1p(n),
        np.log1p(count_tokens_fallback(text)),
        np.log1p(text.count("\n")),
        np.log1p(text.count("?")),
        float("```" in text),
        np.log1p(len(_DIGIT.findall(text))),
        float(_CODE_PUNCT.search(text) is not None),
        ((n - len(text.encode("ascii", "ignore"))) / n) if n else 0.0,
    ]


def init_text_weights(model: Any, n_hash: int) -> None:
    """The untrained text part both hashed-n-gram models share: the two vectorizers, idf and
    ridge weights over [word | char] columns, and the dense cues' standardization."""
    model.n_hash = n_hash
    model._word, model._char = _vectorizers(n_hash)
    model.idf = np.ones(2 * n_hash)
    model.coef = np.zeros(2 * n_hash)
    model.dense_mean = np.zeros(N_DENSE)
    model.dense_std = np.ones(N_DENSE)
    model.dense_coef = np.zeros(N_DENSE)


def tf_matrix(word: Any, char: Any, texts: list[str]) -> sp.csr_matrix:
    """log(1 + tf) of the word and char hashed n-grams of each text's n-gram window,
    stacked [word | char] (shape (n, 2·n_hash))."""
    win = [ngram_window(t) for t in texts]
    X = sp.hstack([word.transform(win), char.transform(win)], format="csr")
    np.log1p(X.data, out=X.data)
    return X


def dense_matrix(texts: list[str]) -> np.ndarray:
    """The dense cues of each text, unstandardized (shape (n, N_DENSE))."""
    return np.array([dense_cues(t) for t in texts], dtype=np.float64).reshape(len(texts), N_DENSE)


def design_matrix(X_tf: sp.csr_matrix, D: np.ndarray, idf: np.ndarray, dense_mean: np.ndarray,
                  dense_std: np.ndarray) -> sp.csr_matrix:
    """Ridge design: idf-weighted, row-L2-normalized tf (rows of zeros stay zero) beside the
    standardized dense cues × DENSE_WEIGHT."""
    from sklearn.preprocessing import normalize

    X = X_tf.copy()
    X.data *= idf[X.indices]
    X = normalize(X, norm="l2", copy=False)
    Dz = (D - dense_mean) / dense_std * DENSE_WEIGHT
    return sp.hstack([X, sp.csr_matrix(Dz)], format="csr")


@LENGTH_MODELS.register("classic")
class ClassicLengthModel(LengthModel):
    """Ridge regression on hashed n-gram tf-idf + dense cues, log target (module docstring)."""

    name = "classic"

    def __init__(self, n_hash: int = N_HASH):
        super().__init__()
        init_text_weights(self, n_hash)
        self.intercept = 0.0
        self.shift = 0.0
        self.alpha = 1.0

    # ---- features

    def _text_matrix(self, texts: list[str]) -> sp.csr_matrix:
        return tf_matrix(self._word, self._char, texts)

    def _weighted(self, X: sp.csr_matrix) -> sp.csr_matrix:
        """idf-weighted, row-L2-normalized copy of a tf matrix (rows of zeros stay zero)."""
        from sklearn.preprocessing import normalize

        X = X.copy()
        X.data *= self.idf[X.indices]
        return normalize(X, norm="l2", copy=False)

    def _dense(self, texts: list[str]) -> np.ndarray:
        return dense_matrix(texts)

    def _design(self, X_text: sp.csr_matrix, D: np.ndarray) -> sp.csr_matrix:
        return design_matrix(X_text, D, self.idf, self.dense_mean, self.dense_std)

    # ---- training

    def fit(self, train: LengthDataset, val: LengthDataset | None, *, rng: np.random.Generator,
            progress: ProgressFn | None = None) -> dict[str, Any]:
        from sklearn.linear_model import Ridge

        def tell(msg: str, frac: float) -> None:
            if progress:
                progress(msg, frac)

        if len(train) < 10:
            raise AstroUserError(f"classic needs ≥ 10 training pairs, got {len(train)}", field="--data")
        has_val = val is not None and len(val) > 0
        tr_texts = [truncate_prompt(p)[0] for p in train.prompts]
        va_texts = [truncate_prompt(p)[0] for p in val.prompts] if has_val else []
        tell("features", 0.05)
        Xt_tr, D_tr = self._text_matrix(tr_texts), self._dense(tr_texts)
        y_tr = train.targets.astype(np.float64)
        Xt_va = self._text_matrix(va_texts) if has_val else None
        D_va = self._dense(va_texts) if has_val else None
        y_va = val.targets.astype(np.float64) if has_val else None

        def prepare(Xt: sp.csr_matrix, D: np.ndarray) -> None:
            n = Xt.shape[0]
            df = np.bincount(Xt.indices, minlength=Xt.shape[1])
            self.idf = np.log((1.0 + n) / (1.0 + df)) + 1.0
            self.dense_mean = D.mean(axis=0)
            self.dense_std = D.std(axis=0)
            self.dense_std[self.dense_std == 0] = 1.0

        def oof_shift(A: sp.csr_matrix, ly: np.ndarray, y: np.ndarray, alpha: float) -> float:
            folds = rng.permutation(len(y)) % 5
            oof = np.empty(len(y))
            for k in range(5):
                m = folds == k
                oof[m] = Ridge(alpha=alpha).fit(A[~m], ly[~m]).predict(A[m])
            errs = [np.abs(np.exp(oof + s) - y).mean() for s in SHIFTS]
            return float(SHIFTS[int(np.argmin(errs))])

        prepare(Xt_tr, D_tr)
        A_tr = self._design(Xt_tr, D_tr)
        ly_tr = np.log(y_tr)
        scores: dict[float, float] = {}
        best = (np.inf, ALPHAS[0], 0.0)
        for i, alpha in enumerate(ALPHAS if has_val else (1.0,)):
            tell(f"alpha {alpha}", 0.1 + 0.7 * i / len(ALPHAS))
            shift = oof_shift(A_tr, ly_tr, y_tr, alpha)
            if has_val:
                pred = np.exp(Ridge(alpha=alpha).fit(A_tr, ly_tr).predict(self._design(Xt_va, D_va)) + shift)
                scores[alpha] = float(np.abs(pred - y_va).mean())
                if scores[alpha] < best[0]:
                    best = (scores[alpha], alpha, shift)
            else:
                best = (np.nan, alpha, shift)
        _, self.alpha, self.shift = best
        tell("final fit", 0.9)
        if has_val:  # refit on train + val with the chosen alpha and shift
            Xt_all = sp.vstack([Xt_tr, Xt_va], format="csr")
            D_all = np.vstack([D_tr, D_va])
            y_all = np.concatenate([y_tr, y_va])
        else:
            Xt_all, D_all, y_all = Xt_tr, D_tr, y_tr
        prepare(Xt_all, D_all)
        reg = Ridge(alpha=self.alpha).fit(self._design(Xt_all, D_all), np.log(y_all))
        self.coef = reg.coef_[: 2 * self.n_hash].copy()
        self.dense_coef = reg.coef_[2 * self.n_hash :].copy()
        self.intercept = float(reg.intercept_)
        tell("done", 1.0)
        return {"alpha": self.alpha, "shift": self.shift, "val_mae_by_alpha": scores}

    # ---- prediction

    def _predict_raw(self, texts: list[str]) -> np.ndarray:
        Xw = self._weighted(self._text_matrix(texts))
        Dz = (self._dense(texts) - self.dense_mean) / self.dense_std * DENSE_WEIGHT
        score = Xw @ self.coef + Dz @ self.dense_coef + self.intercept + self.shift
        return np.exp(np.minimum(score, 20.0))

    # ---- persistence

    def params(self) -> dict[str, Any]:
        return {
            "n_hash": self.n_hash, "word_ngrams": [1, 2], "char_wb_ngrams": [3, 5],
            "dense_weight": DENSE_WEIGHT, "alpha": self.alpha, "shift": self.shift,
            "ngram_window_chars": [NGRAM_HEAD_CHARS, NGRAM_TAIL_CHARS],
            "target": "log(reply tokens)",
        }

    def save_files(self, directory: Path) -> None:
        np.savez_compressed(
            directory / _WEIGHTS_FILE,
            idf=self.idf, coef=self.coef,
            dense_mean=self.dense_mean, dense_std=self.dense_std, dense_coef=self.dense_coef,
            scalars=np.array([self.intercept, self.shift, self.alpha]),
        )

    @classmethod
    def load_files(cls, directory: Path, meta: LengthModelMeta) -> ClassicLengthModel:
        _, n_hash, arrays = load_linear_weights(directory, meta, "classic", ())
        m = cls(n_hash=n_hash)
        m.idf = arrays["idf"].astype(np.float64)
        m.coef = arrays["coef"].astype(np.float64)
        m.dense_mean, m.dense_std, m.dense_coef = arrays["dense_mean"], arrays["dense_std"], arrays["dense_coef"]
        m.intercept, m.shift, m.alpha = (float(v) for v in arrays["scalars"])
        return m


LINEAR_ARRAYS = ("idf", "coef", "dense_mean", "dense_std", "dense_coef", "scalars")


def load_linear_weights(directory: Path, meta: LengthModelMeta, kind: str,
                        extra: tuple[str, ...]) -> tuple[Path, int, dict[str, np.ndarray]]:
    """The weights file of a hashed n-gram + dense-feature model (`classic`, and the
    linear stage of `chat-gbm`): `meta.params.n_hash` checked, the arrays `LINEAR_ARRAYS`
    + `extra` read, the linear ones checked for shape and NaN/inf. Returns (the file,
    n_hash, the arrays); raises AstroUserError naming the file and the array."""
    fp = directory / _WEIGHTS_FILE
    n_hash = meta.params.get("n_hash")
    if not isinstance(n_hash, int) or n_hash <= 0:
        raise AstroUserError(f"{directory}/meta.json: params.n_hash must be a positive int, got {n_hash!r}",
                             field="--model")
    try:
        with np.load(fp, allow_pickle=False) as z:
            arrays = {k: z[k] for k in LINEAR_ARRAYS + extra}
    except (OSError, ValueError, KeyError) as exc:
        raise AstroUserError(f"{fp}: unreadable {kind} weights ({exc})", field="--model") from None
    expect = {"idf": 2 * n_hash, "coef": 2 * n_hash, "dense_mean": N_DENSE, "dense_std": N_DENSE,
              "dense_coef": N_DENSE, "scalars": 3}
    for key, size in expect.items():
        if arrays[key].shape != (size,):
            raise AstroUserError(
                f"{fp}: array {key!r} has shape {arrays[key].shape}, expected ({size},) for n_hash={n_hash}",
                field="--model", fix="the weights do not match meta.json; retrain the artifact",
            )
        if not np.all(np.isfinite(arrays[key])):
            raise AstroUserError(f"{fp}: array {key!r} holds NaN/inf", field="--model")
    return fp, n_hash, arrays
