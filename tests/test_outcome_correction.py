"""Outcome correction (`dispatch.outcome`): predictions corrected by served latencies."""

from __future__ import annotations

import numpy as np
import pytest

from rps_astro_cli.cluster import TimedRequest, simulate_cluster
from rps_astro_cli.dispatch import make_dispatch
from rps_astro_cli.dispatch.outcome import Affine, OutcomeCorrection, OutcomeFit, fit_affine, median_ape
from rps_astro_cli.sim.profile import load_profile
from rps_astro_cli.types import LatencyEstimate


def test_fit_recovers_a_known_offset_and_scale_despite_noise_and_outliers():
    rng = np.random.default_rng(3)
    pred = rng.uniform(0.02, 2.0, 400)
    served = (0.03 + 1.8 * pred) * (1 + rng.normal(0, 0.03, 400))
    served[::20] *= 4.0  # 5 % outliers: a step that waited on the host
    fit = fit_affine(pred, served)
    assert fit.scale == pytest.approx(1.8, rel=0.03)
    assert fit.offset_s == pytest.approx(0.03, abs=0.004)


def test_fit_of_an_engine_faster_than_its_model_is_a_ratio_through_zero():
    pred = np.linspace(0.1, 1.0, 50)
    fit = fit_affine(pred, 0.7 * pred)  # no negative overhead: offset 0, scale 0.7 exactly
    assert fit.offset_s == 0.0
    assert fit.scale == pytest.approx(0.7, rel=1e-9)


def test_scale_is_bounded():
    pred = np.linspace(0.1, 1.0, 50)
    assert fit_affine(pred, 10.0 * pred).scale == 4.0


def test_a_right_model_is_left_exactly_as_it_is():
    f = OutcomeFit(min_samples=16)
    rng = np.random.default_rng(0)
    for p in rng.uniform(0.05, 1.0, 100):
        f.observe(p, p * (1 + rng.normal(0, 0.01)))  # 1 % noise, no bias
    assert f.refits > 0 and not f.applied
    assert f.correct(0.4321) == 0.4321


def test_a_biased_model_is_corrected_after_min_samples_and_its_error_falls():
    f = OutcomeFit(min_samples=16, refit_every=8)
    rng = np.random.default_rng(1)
    for p in rng.uniform(0.05, 1.0, 15):
        f.observe(p, 0.02 + 2.0 * p)
    assert not f.applied and f.correct(0.5) == 0.5  # 15 < min_samples: the raw estimate
    for p in rng.uniform(0.05, 1.0, 100):
        f.observe(p, (0.02 + 2.0 * p) * (1 + rng.normal(0, 0.05)))
    assert f.applied
    assert f.correct(0.5) == pytest.approx(1.02, rel=0.05)
    st = f.state()
    assert st["samples"] == 115
    # out of sample: the raw estimate is ~50 % off, the correction in force ~4 % (5 % noise)
    assert st["recent_ape_raw"] > 0.4 and st["recent_ape"] < 0.1


def test_median_ape_by_hand():
    pred = np.array([1.0, 2.0, 4.0])
    served = np.array([2.0, 2.0, 2.0])
    # |1-2|/2 = 0.5, 0, |4-2|/2 = 1 → median 0.5; with scale 0.5 and offset 1: 1.5, 2, 3 → 0.25, 0, 0.5
    assert median_ape(Affine(), pred, served) == 0.5
    assert median_ape(Affine(1.0, 0.5), pred, served) == 0.25


def test_correction_per_instance_and_e2e_not_below_ttft():
    oc = OutcomeCorrection(min_samples=4, refit_every=1)
    for p in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6):
        oc.observe("engine-1", (p, 1.0), (3.0 * p, 1.0))  # TTFT 3× what was predicted, E2E right
    est = LatencyEstimate(0.5, 0.6, 7, 3)
    assert oc.correct("engine-0", est) is est  # no outcomes there: untouched
    c = oc.correct("engine-1", est)
    assert c.ttft_s == pytest.approx(1.5, rel=1e-6)
    assert c.e2e_s == c.ttft_s  # E2E (uncorrected 0.6) cannot end before the first token
    assert (c.steps_simulated, c.events) == (7, 3)
    raw: dict[int, tuple[float, float]] = {}
    out = oc.correct_all({0: "engine-0", 1: "engine-1"}, {0: est, 1: est}, raw)
    assert out[0] is est and raw == {1: (0.5, 0.6)}
    assert oc.state()["engine-1"]["ttft"]["applied"] is True


def _virtual(calibration: str | None, length_factor: float, seed: int = 0):
    prof = load_profile("llama-2-7b-a30")
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / 3.0, 400))
    reqs = []
    for k in range(400):
        out = int(rng.integers(20, 400))
        reqs.append(TimedRequest(f"r{k}", float(t[k]), int(rng.integers(20, 800)), out,
                                 predicted_output_tokens=max(1, int(out * length_factor))))
    return simulate_cluster(reqs, 2, make_dispatch("power_of_k", k="all", objective="e2e"), prof,
                            rng=np.random.default_rng(seed), calibration=calibration)


def test_virtual_e2e_predictions_of_underestimated_lengths_are_corrected():
    # the length tagger predicts half of every reply: the look-ahead's E2E is about half
    res = _virtual("online", 0.5)
    assert res.outcome_correction is not None
    e2e = [res.outcome_correction[str(i)]["e2e"] for i in range(2)]
    assert all(f["applied"] for f in e2e)
    assert all(1.4 < f["scale"] < 2.6 for f in e2e)  # type: ignore[operator]

    def ape(recs):
        v = [abs(r.predicted_e2e_s - r.e2e_s) / r.e2e_s for r in recs[100:] if r.predicted_e2e_s]
        return float(np.median(v))

    assert ape(res.records) < 0.6 * ape(_virtual(None, 0.5).records)


def test_virtual_without_online_calibration_has_no_correction():
    assert _virtual(None, 0.5).outcome_correction is None
    assert _virtual("off", 0.5).outcome_correction is None
