"""Impact estimator and classifier: hand-computed latencies, regressions and classes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import hand_profile, req
from rps_astro_cli.policies import make_policy
from rps_astro_cli.rps.classifier import NaiveClassifier, RequestClassifier
from rps_astro_cli.rps.estimator import ImpactEstimator, LinearModel, fit_estimator, isolated_latency
from rps_astro_cli.rps.records import ProfileRecord
from rps_astro_cli.sim.instance import InstanceSim
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.types import InstanceConfig


def test_isolated_latency_by_hand_and_equal_to_the_instance_model():
    prof = hand_profile()
    iso = isolated_latency(prof, 1200, 5, encoder_s=0.2, preprocess_s=0.5)
    # chunks 512 (+ encoder 0.2), 512, 176: 0.2612 + 0.0612 + 0.0276; 4 decodes × 0.0101
    assert iso.prefill_s == pytest.approx(0.2612 + 0.0612 + 0.0276)
    assert iso.ttft_s == pytest.approx(0.5 + 0.35)
    assert iso.e2e_s == pytest.approx(0.85 + 4 * 0.0101)
    # the same request alone in InstanceSim (with attention terms switched on)
    prof2 = hand_profile(decode_attn_s_per_ctx_token=1e-6, prefill_attn_s_per_token_pair=1e-9)
    inst = InstanceSim(InstanceConfig.from_profile(prof2), LatencyModel(prof2), make_policy("fcfs"))
    r = req("a", 0.0, "video", 1200, out=7, encoder_s=0.2)
    inst.add(r)
    t = 0.0
    while inst.has_work:
        t += inst.step(t).duration_s
    iso2 = isolated_latency(prof2, 1200, 7, encoder_s=0.2)
    assert r.first_token_s == pytest.approx(iso2.ttft_s, rel=1e-12)
    assert r.finish_s == pytest.approx(iso2.e2e_s, rel=1e-12)


def _rec(key, modality, prompt, vision, impact_s, n_images=0):
    return ProfileRecord(key, modality, n_images, 0, prompt, vision, prompt, 8, 0.0, 0.0, impact_s, impact_s, impact_s)


def test_fit_estimator_recovers_linear_text_and_the_90th_percentile_for_images():
    recs = [_rec(f"t{n}", "text", n, 0, 0.01 + 0.0001 * n) for n in (10, 100, 500, 1000, 2000, 4000)]
    # images: 10 rows per size with offsets 0, 1, ..., 9 ms above 0.1 + 0.0001·vision
    for k in (1, 2, 3, 4):
        for j in range(10):
            recs.append(_rec(f"i{k}-{j}", "image", 50 + 729 * k, 729 * k, 0.1 + 0.0001 * 729 * k + 0.001 * j, k))
    est, metrics = fit_estimator(recs, np.random.default_rng(0), test_fraction=0.0)
    t = est.prefill["text"]
    assert t.intercept == pytest.approx(0.01, abs=1e-9) and t.coef_text == pytest.approx(0.0001, rel=1e-6)
    assert est.prefill_s(3000, 0, "text") == pytest.approx(0.31, rel=1e-6)
    # the 0.9-quantile of offsets {0..9 ms} lies in [8, 9] ms
    y = est.prefill_s(50 + 2916, 2916, "image")
    assert 0.1 + 0.2916 + 0.008 - 1e-6 <= y <= 0.1 + 0.2916 + 0.009 + 1e-6
    assert est.kv_tokens(50 + 2916, 2916, "image") == pytest.approx(2966, rel=1e-6)
    m = {x.modality: x for x in metrics}
    assert m["text"].mae_ms == pytest.approx(0.0, abs=1e-6) and m["image"].kind == "quantile-0.9"
    assert m["image"].under_rate <= 0.1 + 1e-9  # at most the top decile lies above the line
    assert est.prefill_s(19_700, 19_600, "video") == pytest.approx(0.01 + 0.0001 * 19_700)  # text fallback
    assert ImpactEstimator.from_dict(est.to_dict()) == est


def _hand_classifier() -> RequestClassifier:
    est = ImpactEstimator(
        prefill={"text": LinearModel(0.0, 0.0001, 0.0001), "image": LinearModel(0.1, 0.0, 0.0001)},
        kv={"text": LinearModel(0.0, 1.0, 1.0), "image": LinearModel(0.0, 1.0, 1.0)},
    )
    cents = [(math.log(0.01), math.log(100)), (math.log(0.4), math.log(3000)), (math.log(3.0), math.log(20000))]
    return RequestClassifier(est, mean=(0.0, 0.0), std=(1.0, 1.0), centroids=cents, name="hand")


def test_long_text_with_an_image_footprint_is_classed_with_the_image():
    clf = _hand_classifier()
    # text 3000 tokens: prefill 0.3 s, 3000 KV tokens → (ln 0.3, ln 3000) = (−1.20, 8.01): pebbles centroid
    # (−0.92, 8.01) is 0.29 away; sand (−4.61, 4.61) and rocks (1.10, 9.90) are > 2.9 away
    assert clf.classify(3000, 0, "text") == "pebbles"
    # an image of 2900 vision + 100 text tokens: 0.1 + 0.29 = 0.39 s, 3000 tokens → pebbles
    assert clf.classify(3000, 2900, "image") == "pebbles"
    assert clf.classify(100, 0, "text") == "sand"
    assert clf.classify(19_700, 19_600, "video") == "rocks"  # 1.97 s, 19 700 tokens
    assert NaiveClassifier().classify(3000, 0, "text") == "sand"  # the naive baseline misses it
    assert RequestClassifier.from_dict(clf.to_dict()).centroids == clf.centroids

    long_text, image, short = req("long", 0.0, "text", 3000), req("img", 1.0, "image",
                                                                  3000, vision_tokens=2900), req("short", 2.0)
    smart = make_policy("static_class", classifier=clf).order_waiting([long_text, image, short], 5.0)
    assert [r.request_id for r in smart] == ["short", "long", "img"]
    assert long_text.req_class == "pebbles"
    long_text.req_class = None
    naive = make_policy("naive_class").order_waiting([long_text, image, short], 5.0)
    assert [r.request_id for r in naive] == ["long", "short", "img"]
