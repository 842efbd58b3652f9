"""Per-class queue metrics (RPS-Serve §3.5) on a hand-made waiting list."""

from __future__ import annotations

import pytest

from conftest import hand_profile, req
from rps_astro_cli.policies import make_policy
from rps_astro_cli.rps.estimator import ProfileImpactEstimator
from rps_astro_cli.rps.queue_metrics import class_queue_metrics


def test_class_queue_metrics_by_hand():
    est = ProfileImpactEstimator(hand_profile())
    waiting = [
        req("t1", 8.0, prompt=100),                       # sand, w=2, prefill 0.01 + 0.0100 = 0.02
        req("t2", 9.0, prompt=1000),                      # sand, w=1, 512 + 488: 0.0612 + 0.0588 = 0.12
        req("v", 4.0, "video", prompt=300, vision_tokens=196),  # rock, w=6, encoder 0.05 + 0.01 + 0.03 = 0.09
    ]
    m = class_queue_metrics(waiting, 10.0, est)
    assert m["sand"]["queue_len"] == 2
    assert m["sand"]["mean_wait_s"] == pytest.approx(1.5)
    assert m["sand"]["prefill_backlog_s"] == pytest.approx(0.02 + 0.12)
    assert m["rocks"] == pytest.approx({"queue_len": 1, "mean_wait_s": 6.0, "prefill_backlog_s": 0.09})
    assert m["pebbles"] == {"queue_len": 0, "mean_wait_s": 0.0, "prefill_backlog_s": 0.0}
    # a policy's classifier can be passed in; labels win over modality
    waiting[0].req_class = "pebbles"
    m2 = class_queue_metrics(waiting, 10.0, None, classify=make_policy("rps").classify)
    assert m2["pebbles"]["queue_len"] == 1 and m2["sand"]["queue_len"] == 1
    assert m2["sand"]["prefill_backlog_s"] == 0.0  # no estimator → no backlog
