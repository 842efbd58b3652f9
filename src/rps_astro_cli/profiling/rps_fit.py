"""`astro fit`: impact estimator + request classifier from a workload profile, saved
with metadata (RPS-Serve §3.3–3.4; see `estimator` and `classifier` for the models)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.rps.classifier import (
    FEATURES,
    RPS_ARTIFACTS_DIR,
    ClassifierFit,
    file_sha256,
    fit_classifier,
    save_classifier,
)
from rps_astro_cli.rps.estimator import EstimatorMetrics, fit_estimator
from rps_astro_cli.rps.records import read_profile_csv


@dataclass(frozen=True)
class FitReport:
    """What `fit_profile` produced.

    out_dir: the artifact folder. estimator_metrics: held-out accuracy per modality.
    classifier: the k-means fit (counts, crosstab vs modality, naive agreement).
    metadata: the dict written to `metadata.json`.
    """

    out_dir: Path
    estimator_metrics: list[EstimatorMetrics]
    classifier: ClassifierFit
    metadata: dict[str, Any]


def fit_profile(
    profile_csv: str | Path,
    name: str,
    out_root: str | Path = RPS_ARTIFACTS_DIR,
    seed: int = 0,
    test_fraction: float = 0.2,
) -> FitReport:
    """Fit, evaluate and save into `<out_root>/<name>/`.

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
            "kind": "k-means, k=3, 10 restarts",
            "seed": seed,
            "order": "clusters sorted by the sum of standardized centroid coordinates: sand < pebbles < rocks",
            "centroids": cfit.classifier.centroids_original(),
            "counts": cfit.counts,
            "crosstab_modality_by_class": cfit.crosstab,
            "naive_agreement": cfit.naive_agreement,
        },
        "versions": {"scikit-learn": sklearn.__version__},
    }
    out = save_classifier(cfit.classifier, Path(out_root) / name, meta)
    return FitReport(out, metrics, cfit, meta)
