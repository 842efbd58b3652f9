"""The impact estimator (RPS-Serve §3.3): a request's prefill latency and KV footprint
before it runs, from (prompt tokens, vision tokens, modality).

Two implementations with the same two methods (`prefill_s`, `kv_tokens`):

- `ImpactEstimator`: fitted from a workload profile (`fit_estimator`). Text: ordinary
  least squares on prompt tokens (the paper's "lightweight linear regression"). Image and
  video: linear quantile regression at the 90th percentile on (text tokens, vision
  tokens), so the estimate errs high ("avoid under-estimation", §3.3). KV footprint:
  least squares on (text tokens, vision tokens) per modality. Models are stored as plain
  coefficients, so a prediction is a few multiplications (no sklearn on the hot path).
- `ProfileImpactEstimator`: read straight from an `ExecutionProfile` (what the sim engine
  charges), via `isolated_latency`. Used where no fitted estimator is at hand (EDF
  deadlines, queue backlog in the sim engine).

`isolated_latency` computes a request's TTFT and E2E when it runs alone on an instance,
exactly as `InstanceSim` would step it (chunks of `max_num_batched_tokens`, encoder time
in the first chunk, one decode step per further output token). RPS-Serve sets its SLO
to 5 × this isolated E2E (§4.1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.rps.records import ProfileRecord
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.profile import ExecutionProfile
from rps_astro_cli.types import MODALITIES

MIN_PREFILL_S = 1e-4
"""Floor on estimated prefill latency (s): a linear fit can go ≤ 0 at tiny prompts and
the classifier takes its log."""


# -- isolated latency (exact for the sim) ---------------------------------------------
@dataclass(frozen=True)
class IsolatedLatency:
    """Latency of one request alone on an instance (seconds).

    ttft_s: arrival → first token (preprocessing + encoder + prefill chunks).
    e2e_s: arrival → last token. prefill_s: the prefill steps incl. encoder.
    """

    ttft_s: float
    e2e_s: float
    prefill_s: float


def isolated_latency(
    latency: LatencyModel | ExecutionProfile,
    prompt_tokens: int,
    output_tokens: int,
    encoder_s: float = 0.0,
    preprocess_s: float = 0.0,
    chunk_tokens: int | None = None,
) -> IsolatedLatency:
    """TTFT / E2E of a request running alone (chunked prefill, batch of 1).

    Prefill: chunks c_i = min(remaining, chunk_tokens) after k_i computed tokens, each a
    step of `step_s(1, c_i, 0, c_i*k_i + c_i(c_i+1)/2)`, the first also charged
    `encoder_s`. Decode j = 1 … out−1 attends prompt + j tokens:
    Σ = (out−1)·shape_s(1, 1) + d·((out−1)·prompt + (out−1)·out/2).

    Args:
        latency: the step model (or a profile, wrapped on the fly).
        chunk_tokens: prefill chunk (tokens); defaults to the profile's
            `max_num_batched_tokens`.

    Raises:
        AstroUserError: prompt_tokens < 1 or output_tokens < 1.
    """
    lm = latency if isinstance(latency, LatencyModel) else LatencyModel(latency)
    if prompt_tokens < 1 or output_tokens < 1:
        raise AstroUserError(
            f"prompt_tokens and output_tokens must be ≥ 1, got {prompt_tokens}, {output_tokens}",
            field="tokens",
        )
    chunk = chunk_tokens or lm.profile.max_num_batched_tokens
    prefill = 0.0
    k = 0
    first = True
    while k < prompt_tokens:
        c = min(prompt_tokens - k, chunk)
        prefill += lm.step_s(1, c, 0, LatencyModel.prefill_pairs(c, k), encoder_s if first else 0.0)
        first = False
        k += c
    n = output_tokens - 1
    decode = n * lm.shape_s(1, 1) + lm.profile.decode_attn_s_per_ctx_token * (n * prompt_tokens + n * (n + 1) / 2)
    ttft = preprocess_s + prefill
    return IsolatedLatency(ttft_s=ttft, e2e_s=ttft + decode, prefill_s=prefill)


def _encoder_for(profile: ExecutionProfile, vision_tokens: int, modality: str) -> float:
    v = profile.vision
    if v is None or vision_tokens <= 0:
        return 0.0
    if modality == "video":
        return vision_tokens / v.tokens_per_frame * v.encoder_s_per_frame
    return vision_tokens / v.tokens_per_image * v.encoder_s_per_image


class ProfileImpactEstimator:
    """Impact estimates read from an execution profile (exact for the sim engine).

    prefill_s: `isolated_latency(...).prefill_s` with the encoder time of
    `vision_tokens` (per image for images, per frame for videos); kv_tokens: the prompt.
    Memoized per (prompt tokens, vision tokens, modality).
    """

    def __init__(self, profile: ExecutionProfile | LatencyModel):
        self.latency = profile if isinstance(profile, LatencyModel) else LatencyModel(profile)
        self._memo: dict[tuple[int, int, str], float] = {}

    def prefill_s(self, prompt_tokens: int, vision_tokens: int, modality: str) -> float:
        key = (prompt_tokens, vision_tokens, modality)
        v = self._memo.get(key)
        if v is None:
            enc = _encoder_for(self.latency.profile, vision_tokens, modality)
            v = isolated_latency(self.latency, max(1, prompt_tokens), 1, enc).prefill_s
            if len(self._memo) > 100_000:
                self._memo.clear()
            self._memo[key] = v
        return v

    def kv_tokens(self, prompt_tokens: int, vision_tokens: int, modality: str) -> float:
        return float(prompt_tokens)


# -- fitted estimator ------------------------------------------------------------------
@dataclass(frozen=True)
class LinearModel:
    """y = intercept + coef_text · text_tokens + coef_vision · vision_tokens."""

    intercept: float
    coef_text: float
    coef_vision: float

    def __call__(self, text_tokens: float, vision_tokens: float) -> float:
        return self.intercept + self.coef_text * text_tokens + self.coef_vision * vision_tokens


@dataclass(frozen=True)
class ImpactEstimator:
    """Fitted per-modality models (see module docstring).

    prefill: modality → model of engine-side prefill latency (s, encoder included).
    kv: modality → model of the KV footprint (tokens).
    kinds: modality → "ols" or "quantile-0.9", how the prefill model was fitted.
    A modality absent from the profile falls back to the text model on the whole prompt.
    """

    prefill: dict[str, LinearModel]
    kv: dict[str, LinearModel]
    kinds: dict[str, str] = field(default_factory=dict)

    def _model(self, table: dict[str, LinearModel], modality: str) -> tuple[LinearModel, bool]:
        m = table.get(modality)
        if m is not None:
            return m, False
        if "text" in table:
            return table["text"], True
        return next(iter(table.values())), True

    def prefill_s(self, prompt_tokens: int, vision_tokens: int, modality: str) -> float:
        """Estimated prefill latency (s, ≥ MIN_PREFILL_S)."""
        m, whole = self._model(self.prefill, modality)
        y = m(prompt_tokens, 0) if whole else m(prompt_tokens - vision_tokens, vision_tokens)
        return y if y > MIN_PREFILL_S else MIN_PREFILL_S

    def kv_tokens(self, prompt_tokens: int, vision_tokens: int, modality: str) -> float:
        """Estimated KV footprint (tokens, ≥ 1)."""
        m, whole = self._model(self.kv, modality)
        y = m(prompt_tokens, 0) if whole else m(prompt_tokens - vision_tokens, vision_tokens)
        return y if y > 1.0 else 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prefill": {k: asdict(v) for k, v in self.prefill.items()},
            "kv": {k: asdict(v) for k, v in self.kv.items()},
            "kinds": dict(self.kinds),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ImpactEstimator:
        return cls(
            prefill={k: LinearModel(**v) for k, v in d["prefill"].items()},
            kv={k: LinearModel(**v) for k, v in d["kv"].items()},
            kinds=dict(d.get("kinds", {})),
        )


@dataclass(frozen=True)
class EstimatorMetrics:
    """Held-out accuracy of one modality's prefill model.

    n_train / n_test: rows used. mae_ms: mean absolute error on the test rows (ms).
    under_rate: share of test rows the model under-estimates. kv_mae_tokens: KV model MAE.
    in_sample: True when too few rows to hold any out (metrics are then on training rows).
    """

    modality: str
    kind: str
    n_train: int
    n_test: int
    mae_ms: float
    under_rate: float
    kv_mae_tokens: float
    in_sample: bool


def _split(n: int, test_fraction: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, bool]:
    idx = rng.permutation(n)
    n_test = int(round(n * test_fraction))
    if n < 5 or n_test < 1:
        return idx, idx, True
    return idx[n_test:], idx[:n_test], False


def _features(rows: Sequence[ProfileRecord], modality: str) -> np.ndarray:
    if modality == "text":
        return np.array([[r.prompt_tokens] for r in rows], dtype=float)
    return np.array([[r.text_tokens, r.vision_tokens] for r in rows], dtype=float)


def _as_linear(intercept: float, coef: np.ndarray, modality: str) -> LinearModel:
    if modality == "text":
        return LinearModel(float(intercept), float(coef[0]), float(coef[0]))
    return LinearModel(float(intercept), float(coef[0]), float(coef[1]))


def fit_estimator(
    records: Sequence[ProfileRecord],
    rng: np.random.Generator,
    test_fraction: float = 0.2,
    quantile: float = 0.9,
) -> tuple[ImpactEstimator, list[EstimatorMetrics]]:
    """Fit the per-modality models on a random (1 − test_fraction) split and report
    held-out MAE; then refit on all rows for the returned estimator.

    Raises:
        AstroUserError: no usable rows, or a modality with fewer than 3 rows.
    """
    from sklearn.linear_model import LinearRegression, QuantileRegressor

    usable = [r for r in records if math.isfinite(r.impact_s) and r.prompt_tokens > 0]
    if not usable:
        raise AstroUserError("the profile has no usable rows", field="profile", fix="run `astro profile`")
    prefill: dict[str, LinearModel] = {}
    kv: dict[str, LinearModel] = {}
    kinds: dict[str, str] = {}
    metrics: list[EstimatorMetrics] = []
    for modality in MODALITIES:
        rows = [r for r in usable if r.modality == modality]
        if not rows:
            continue
        if len(rows) < 3:
            raise AstroUserError(
                f"only {len(rows)} {modality} rows (need ≥ 3)", field="profile",
                fix=f"profile more {modality} requests or leave {modality} out of --modalities",
            )
        X = _features(rows, modality)
        y = np.array([r.impact_s for r in rows])
        ykv = np.array([r.kv_tokens for r in rows], dtype=float)
        kind = "ols" if modality == "text" else f"quantile-{quantile:g}"

        def make(modality: str = modality):
            if modality == "text":
                return LinearRegression()
            return QuantileRegressor(quantile=quantile, alpha=0.0, solver="highs")

        tr, te, in_sample = _split(len(rows), test_fraction, rng)
        m = make().fit(X[tr], y[tr])
        pred = np.maximum(m.predict(X[te]), MIN_PREFILL_S)
        mkv = LinearRegression().fit(X[tr], ykv[tr])
        metrics.append(
            EstimatorMetrics(
                modality=modality,
                kind=kind,
                n_train=len(tr),
                n_test=len(te),
                mae_ms=float(np.mean(np.abs(pred - y[te])) * 1000.0),
                under_rate=float(np.mean(pred < y[te] - 1e-12)),
                kv_mae_tokens=float(np.mean(np.abs(mkv.predict(X[te]) - ykv[te]))),
                in_sample=in_sample,
            )
        )
        full = make().fit(X, y)
        fkv = LinearRegression().fit(X, ykv)
        prefill[modality] = _as_linear(full.intercept_, full.coef_, modality)
        kv[modality] = _as_linear(fkv.intercept_, fkv.coef_, modality)
        kinds[modality] = kind
    return ImpactEstimator(prefill=prefill, kv=kv, kinds=kinds), metrics
