"""The request classifier (RPS-Serve §3.4): sand / pebbles / rocks.

Smart classifier (`RequestClassifier`): the features of a request are
    x = (log prefill_s, log kv_tokens)
estimated by the impact estimator, standardized with the profile's mean and standard
deviation; the class is the nearest of three k-means centroids (k = 3, fitted on the
profile's measured features), and the centroids are ordered by the sum of their
standardized coordinates — the smallest combined time + memory is sand, then pebbles,
then rocks. A long text prompt whose footprint matches an image therefore lands with
the images, which the naive classifier cannot do.

Naive classifier (`NaiveClassifier`, the paper's baseline): text → sand, image →
pebbles, video → rocks; any other modality → pebbles (the middle class).

Saved by `save_classifier` into `artifacts/rps/<name>/`: `classifier.joblib` (plain
dicts and floats, no sklearn objects) and `metadata.json` (profile hash, features,
metrics, centroids).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.data_paths import ARTIFACTS_DIR
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.rps.classes import CLASSES, naive_class
from rps_astro_cli.rps.estimator import ImpactEstimator
from rps_astro_cli.rps.records import ProfileRecord
from rps_astro_cli.types import MODALITIES

RPS_ARTIFACTS_DIR = ARTIFACTS_DIR / "rps"
FEATURES = ("log_prefill_s", "log_kv_tokens")

class NaiveClassifier:
    """Baseline classifier by modality label only (same `classify` signature as the
    smart one)."""

    name = "naive"

    def classify(self, prompt_tokens: int, vision_tokens: int, modality: str) -> str:
        return naive_class(modality)


class RequestClassifier:
    """k-means (k = 3) classifier on standardized (log prefill_s, log kv_tokens).

    Args:
        estimator: the impact estimator giving prefill_s and kv_tokens of a request.
        mean, std: per-feature standardization (2 floats each; std > 0).
        centroids: 3 × 2 standardized centroids ordered sand, pebbles, rocks.
        name: artifact name (for `describe`).

    `classify` is memoized by (prompt tokens, vision tokens, modality).
    """

    def __init__(
        self,
        estimator: ImpactEstimator,
        mean: Sequence[float],
        std: Sequence[float],
        centroids: Sequence[Sequence[float]],
        name: str = "",
    ):
        if len(centroids) != 3 or any(len(c) != 2 for c in centroids):
            raise AstroUserError("needs 3 centroids of 2 features", field="classifier")
        if any(s <= 0 for s in std):
            raise AstroUserError("standard deviations must be > 0", field="classifier")
        self.estimator = estimator
        self.mean = (float(mean[0]), float(mean[1]))
        self.std = (float(std[0]), float(std[1]))
        self.centroids = tuple((float(c[0]), float(c[1])) for c in centroids)
        self.name = name
        self._memo: dict[tuple[int, int, str], str] = {}

    def features(self, prompt_tokens: int, vision_tokens: int, modality: str) -> tuple[float, float]:
        """Standardized (log prefill_s, log kv_tokens) of a request."""
        p = self.estimator.prefill_s(prompt_tokens, vision_tokens, modality)
        kv = self.estimator.kv_tokens(prompt_tokens, vision_tokens, modality)
        return self.standardize(p, kv)

    def standardize(self, prefill_s: float, kv_tokens: float) -> tuple[float, float]:
        return (
            (math.log(max(prefill_s, 1e-9)) - self.mean[0]) / self.std[0],
            (math.log(max(kv_tokens, 1.0)) - self.mean[1]) / self.std[1],
        )

    def nearest(self, z: tuple[float, float]) -> str:
        best, best_d = 0, math.inf
        for i, (c0, c1) in enumerate(self.centroids):
            d = (z[0] - c0) ** 2 + (z[1] - c1) ** 2
            if d < best_d:
                best, best_d = i, d
        return CLASSES[best]

    def classify(self, prompt_tokens: int, vision_tokens: int, modality: str) -> str:
        """sand / pebbles / rocks for a request of these token counts and modality."""
        key = (prompt_tokens, vision_tokens, modality)
        c = self._memo.get(key)
        if c is None:
            c = self.nearest(self.features(prompt_tokens, vision_tokens, modality))
            if len(self._memo) > 100_000:
                self._memo.clear()
            self._memo[key] = c
        return c

    def centroids_original(self) -> list[dict[str, float]]:
        """Centroids in original units: prefill_s (s) and kv_tokens (tokens)."""
        return [
            {
                "class": CLASSES[i],
                "prefill_s": math.exp(c0 * self.std[0] + self.mean[0]),
                "kv_tokens": math.exp(c1 * self.std[1] + self.mean[1]),
            }
            for i, (c0, c1) in enumerate(self.centroids)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "astro-rps-classifier/1",
            "name": self.name,
            "features": list(FEATURES),
            "mean": list(self.mean),
            "std": list(self.std),
            "centroids": [list(c) for c in self.centroids],
            "classes": list(CLASSES),
            "estimator": self.estimator.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestClassifier:
        return cls(
            estimator=ImpactEstimator.from_dict(d["estimator"]),
            mean=d["mean"],
            std=d["std"],
            centroids=d["centroids"],
            name=d.get("name", ""),
        )


def threshold_classifier(
    estimator: ImpactEstimator, mean: Sequence[float], std: Sequence[float], t_sand: float, t_rocks: float,
    name: str = "",
) -> RequestClassifier:
    """Classes by the combined score S = z_prefill + z_kv of the standardized features
    (the order the k-means classes are sorted by): S < t_sand → sand, t_sand < S < t_rocks
    → pebbles, S > t_rocks → rocks.

    Stored as an ordinary 3-centroid `RequestClassifier`: centroids (s_i / 2, s_i / 2) on
    the diagonal with s = (2 t_sand − m, m, 2 t_rocks − m), m = (t_sand + t_rocks) / 2.
    The squared distance to centroid i is const − s_i · S + s_i² / 2, so the nearest
    centroid changes exactly where S = (s_i + s_j) / 2, i.e. at t_sand and t_rocks.

    Raises:
        AstroUserError: t_sand ≥ t_rocks.
    """
    if not t_sand < t_rocks:
        raise AstroUserError(f"needs t_sand < t_rocks, got {t_sand} ≥ {t_rocks}", field="classifier")
    m = (t_sand + t_rocks) / 2
    s = (2 * t_sand - m, m, 2 * t_rocks - m)
    return RequestClassifier(estimator, mean, std, [(x / 2, x / 2) for x in s], name=name)


# -- fitting ---------------------------------------------------------------------------
@dataclass(frozen=True)
class ClassifierFit:
    """Result of `fit_classifier`.

    classifier: the fitted classifier. counts: class → profile rows in it.
    crosstab: modality → class → rows (smart vs naive: the naive class of a modality is
    fixed, so every off-diagonal cell is a request the naive classifier files
    differently). naive_agreement: share of rows where smart == naive.
    """

    classifier: RequestClassifier
    counts: dict[str, int]
    crosstab: dict[str, dict[str, int]]
    naive_agreement: float


def fit_classifier(
    records: Sequence[ProfileRecord], estimator: ImpactEstimator, seed: int = 0, name: str = ""
) -> ClassifierFit:
    """k-means (k = 3, 10 restarts, `random_state=seed`) on the measured, standardized
    (log impact_s, log kv_tokens) of the profile rows; centroids ordered by the sum of
    their coordinates.

    Raises:
        AstroUserError: fewer than 3 usable rows, or features without spread.
    """
    from sklearn.cluster import KMeans

    rows = [r for r in records if math.isfinite(r.impact_s) and r.impact_s > 0 and r.kv_tokens > 0]
    if len(rows) < 3:
        raise AstroUserError(f"needs ≥ 3 usable rows, got {len(rows)}", field="profile")
    F = np.array([[math.log(r.impact_s), math.log(r.kv_tokens)] for r in rows])
    mean = F.mean(axis=0)
    std = F.std(axis=0)
    if np.any(std <= 0):
        raise AstroUserError(
            "prefill latency or KV tokens do not vary across the profile", field="profile",
            fix="profile growing text lengths, image counts and frame counts",
        )
    Z = (F - mean) / std
    km = KMeans(n_clusters=3, n_init=10, random_state=seed).fit(Z)
    order = np.argsort(km.cluster_centers_.sum(axis=1))
    clf = RequestClassifier(estimator, mean, std, km.cluster_centers_[order], name=name)
    labels = [clf.nearest((float(z[0]), float(z[1]))) for z in Z]
    counts = {c: labels.count(c) for c in CLASSES}
    crosstab = {
        m: {c: sum(1 for r, lab in zip(rows, labels) if r.modality == m and lab == c) for c in CLASSES}
        for m in MODALITIES
        if any(r.modality == m for r in rows)
    }
    agree = sum(1 for r, lab in zip(rows, labels) if naive_class(r.modality) == lab) / len(rows)
    return ClassifierFit(clf, counts, crosstab, agree)


# -- artifacts -------------------------------------------------------------------------
def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_classifier(clf: RequestClassifier, out_dir: str | Path, metadata: dict[str, Any]) -> Path:
    """Write `classifier.joblib` and `metadata.json` into `out_dir` (created)."""
    import joblib

    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    joblib.dump(clf.to_dict(), d / "classifier.joblib")
    (d / "metadata.json").write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
    return d


def list_classifiers() -> list[str]:
    """Classifier artifacts shipped in `artifacts/rps/`."""
    if not RPS_ARTIFACTS_DIR.is_dir():
        return []
    return sorted(p.parent.name for p in RPS_ARTIFACTS_DIR.glob("*/classifier.joblib"))


_LOADED: dict[str, RequestClassifier] = {}


def load_classifier(name_or_path: str | Path) -> RequestClassifier:
    """Load a classifier by artifact name (`artifacts/rps/<name>/`) or folder path.
    Cached per resolved path.

    Raises:
        AstroUserError: no such artifact, or an unreadable one.
    """
    p = Path(name_or_path)
    if not (p / "classifier.joblib").is_file():
        p = RPS_ARTIFACTS_DIR / str(name_or_path)
    f = p / "classifier.joblib"
    if not f.is_file():
        raise AstroUserError(
            f"no classifier {str(name_or_path)!r}", field="classifier",
            fix=f"run `astro fit` or use one of: {', '.join(list_classifiers()) or '(none shipped)'}",
        )
    key = str(f.resolve())
    clf = _LOADED.get(key)
    if clf is None:
        import joblib

        try:
            clf = RequestClassifier.from_dict(joblib.load(f))
        except (KeyError, TypeError, ValueError, EOFError) as exc:
            raise AstroUserError(f"{f} is not a valid classifier: {exc!r}", field="classifier") from None
        _LOADED[key] = clf
    return clf
