"""`astro fit`: impact estimator + request classifier from a workload profile, saved
with metadata (RPS-Serve §3.3–3.4; see `estimator` and `classifier` for the models)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.rps.classes import CLASSES
from rps_astro_cli.rps.classifier import (
    FEATURES,
    RPS_ARTIFACTS_DIR,
    ClassifierFit,
    RequestClassifier,
    file_sha256,
    fit_classifier,
    save_classifier,
    threshold_classifier,
)
from rps_astro_cli.rps.estimator import EstimatorMetrics, ImpactEstimator, fit_estimator
from rps_astro_cli.rps.records import ProfileRecord, read_profile_csv
from rps_astro_cli.types import MODALITIES

Scorer = Callable[[RequestClassifier | None], float]
"""A fit objective: the score of a classifier (None = the naive classes by modality);
lower is better (e.g. the change of mean TTFT vs FCFS, %, on a replay of the profile)."""

SELECT_QUANTILES = tuple(q / 20 for q in range(1, 20))
"""Candidate class boundaries: these quantiles (5 % … 95 %) of the profile rows' combined
score, every pair t_sand < t_rocks."""


@dataclass(frozen=True)
class Candidate:
    """One classifier the objective scored.

    kind: "kmeans" or "thresholds". t_sand / t_rocks: the boundaries on the combined score
    (None for k-means). crosstab: modality → class → profile rows, as the classifier
    files them at run time (estimated features). score: the objective's value.
    """

    kind: str
    t_sand: float | None
    t_rocks: float | None
    crosstab: dict[str, dict[str, int]]
    score: float


@dataclass(frozen=True)
class Selection:
    """What `select_classifier` chose.

    objective: the objective's description. chosen: the best candidate (lowest score).
    kmeans: the k-means candidate. naive_score: the naive classes' score on the same
    objective (a reference; never chosen: the smart classifier is what is fitted).
    candidates: every distinct candidate scored (same row labels scored once).
    """

    objective: str
    chosen: Candidate
    kmeans: Candidate
    naive_score: float
    candidates: list[Candidate] = field(default_factory=list)


def _crosstab(clf: RequestClassifier, rows: Sequence[ProfileRecord]) -> tuple[dict[str, dict[str, int]], tuple]:
    labels = tuple(clf.classify(r.prompt_tokens, r.vision_tokens, r.modality) for r in rows)
    ct = {m: {c: sum(1 for r, lab in zip(rows, labels) if r.modality == m and lab == c) for c in CLASSES}
          for m in MODALITIES if any(r.modality == m for r in rows)}
    return ct, labels


def select_classifier(
    records: Sequence[ProfileRecord], estimator: ImpactEstimator, kmeans: RequestClassifier, score: Scorer,
    objective: str, quantiles: Sequence[float] = SELECT_QUANTILES, name: str = "",
) -> tuple[RequestClassifier, Selection]:
    """Pick the classifier by the objective the deployment is judged on, not by k-means'
    own (within-cluster spread of the features, which says nothing about latency).

    Candidates: the k-means classifier, and class boundaries t_sand < t_rocks on the
    combined score S = z_prefill + z_kv (`threshold_classifier`, k-means' standardization)
    at every pair of `quantiles` of the rows' S — S from the impact estimator's
    estimates, the features the classifier sees at run time. Candidates that file every
    profile row the same way are scored once. The lowest score wins (ties: k-means, then
    the first pair).
    """
    rows = [r for r in records if math.isfinite(r.impact_s) and r.prompt_tokens > 0]
    S = sorted(sum(kmeans.features(r.prompt_tokens, r.vision_tokens, r.modality)) for r in rows)
    cuts = sorted({S[min(len(S) - 1, int(q * len(S)))] for q in quantiles})
    # a boundary between two sorted rows' scores, so it never sits on a row
    ts = sorted({(a + b) / 2 for a, b in zip(S, S[1:]) if a < b and any(a <= c < b for c in cuts)})
    seen: dict[tuple, float] = {}
    ct, labels = _crosstab(kmeans, rows)
    km = Candidate("kmeans", None, None, ct, score(kmeans))
    seen[labels] = km.score
    cands = [km]
    best_clf, best = kmeans, km
    for i, t1 in enumerate(ts):
        for t2 in ts[i + 1:]:
            clf = threshold_classifier(estimator, kmeans.mean, kmeans.std, t1, t2, name=name)
            ct, labels = _crosstab(clf, rows)
            if labels in seen:
                continue
            c = Candidate("thresholds", t1, t2, ct, score(clf))
            seen[labels] = c.score
            cands.append(c)
            if c.score < best.score:
                best_clf, best = clf, c
    return best_clf, Selection(objective, best, km, score(None), cands)


@dataclass(frozen=True)
class FitReport:
    """What `fit_profile` produced.

    out_dir: the artifact folder. estimator_metrics: held-out accuracy per modality.
    classifier: the saved classifier's fit (counts, crosstab vs modality, naive agreement).
    metadata: the dict written to `metadata.json`. selection: the objective's choice, when
    one was given.
    """

    out_dir: Path
    estimator_metrics: list[EstimatorMetrics]
    classifier: ClassifierFit
    metadata: dict[str, Any]
    selection: Selection | None = None


def fit_profile(
    profile_csv: str | Path,
    name: str,
    out_root: str | Path = RPS_ARTIFACTS_DIR,
    seed: int = 0,
    test_fraction: float = 0.2,
    score: Scorer | None = None,
    objective: str = "",
) -> FitReport:
    """Fit, evaluate and save into `<out_root>/<name>/`. With `score` (an objective, e.g.
    `bench.rps_select.replay_scorer`), the classifier is chosen by it among k-means and
    class boundaries on the combined score (`select_classifier`); without, k-means.

    Raises:
        AstroUserError: unreadable profile, too few rows, bad test fraction.
    """
    import sklearn

    from rps_astro_cli.errors import AstroUserError

    if not 0.0 <= test_fraction < 1.0:
        raise AstroUserError(f"must be in [0, 1), got {test_fraction}", field="--test-fraction")
    if not name or "/" in name or name.startswith("."):
        raise AstroUserError(f"invalid artifact name {name!r}", field="--name", fix="use e.g. llava-onevision-7b-a100")
    records = read_profile_csv(profile_csv)
    rng = np.random.default_rng(seed)
    estimator, metrics = fit_estimator(records, rng, test_fraction)
    cfit = fit_classifier(records, estimator, seed=seed, name=name)
    selection = None
    if score is not None:
        chosen, selection = select_classifier(records, estimator, cfit.classifier, score, objective, name=name)
        if chosen is not cfit.classifier:
            counts = {c: sum(selection.chosen.crosstab[m][c] for m in selection.chosen.crosstab) for c in CLASSES}
            n = sum(counts.values())
            agree = sum(selection.chosen.crosstab[m][c] for m in selection.chosen.crosstab for c in CLASSES
                        if c == {"text": "sand", "image": "pebbles", "video": "rocks"}.get(m)) / max(1, n)
            cfit = ClassifierFit(chosen, counts, selection.chosen.crosstab, agree)
    meta = {
        "name": name,
        "created_by": "astro fit",
        "created_utc": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "profile": {"path": str(profile_csv), "sha256": file_sha256(profile_csv), "rows": len(records)},
        "features": list(FEATURES),
        "feature_note": "standardized (log prefill_s incl. encoder, log KV tokens); prefill from the impact "
                        "estimator at run time, measured in the profile at fit time",
        "estimator": {
            "text": "ordinary least squares on prompt tokens",
            "image/video": "linear quantile regression (q=0.9) on (text tokens, vision tokens)",
            "kv": "least squares on (text tokens, vision tokens) per modality",
            "metrics": [asdict(m) for m in metrics],
        },
        "classifier": {
            "kind": "k-means, k=3, 10 restarts" if selection is None or selection.chosen.kind == "kmeans"
                    else "class boundaries on the combined score z_prefill + z_kv, chosen by the objective",
            "seed": seed,
            "order": "clusters sorted by the sum of standardized centroid coordinates: sand < pebbles < rocks",
            "centroids": cfit.classifier.centroids_original(),
            "counts": cfit.counts,
            "crosstab_modality_by_class": cfit.crosstab,
            "naive_agreement": cfit.naive_agreement,
        },
        "versions": {"scikit-learn": sklearn.__version__},
    }
    if selection is not None:
        meta["classifier"]["selection"] = {
            "objective": selection.objective,
            "chosen": asdict(selection.chosen),
            "kmeans": asdict(selection.kmeans),
            "naive_classes_score": selection.naive_score,
            "candidates_scored": len(selection.candidates),
            "candidates": [{"t_sand": c.t_sand, "t_rocks": c.t_rocks, "score": c.score, "crosstab": c.crosstab}
                           for c in selection.candidates],
        }
    out = save_classifier(cfit.classifier, Path(out_root) / name, meta)
    return FitReport(out, metrics, cfit, meta, selection)
