"""The Predictor's look-ahead runs the instance's own policy: under `rps` a sand
candidate is predicted to overtake queued rocks (hand-computed step times)."""

from __future__ import annotations

import pytest

from conftest import hand_profile
from rps_astro_cli.policies import make_policy
from rps_astro_cli.sim import lookahead
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.types import InstanceConfig, InstanceStatus, RequestStatus

PREDICTORS = [lookahead.predict_stepwise] + ([lookahead.predict] if hasattr(lookahead, "predict") else [])


def _status() -> InstanceStatus:
    prof = hand_profile()
    rocks = tuple(
        RequestStatus(request_id=f"rock{i}", arrival_s=9.0, prompt_tokens=2000, predicted_output_tokens=50,
                      modality="video", vision_tokens=1960, encoder_s=0.2)
        for i in (1, 2)
    )
    return InstanceStatus(instance_id="i0", time_s=10.0, limits=InstanceConfig.from_profile(prof),
                          kv_blocks_free=prof.num_gpu_blocks, waiting=rocks)


@pytest.mark.parametrize("predict", PREDICTORS)
def test_sand_candidate_overtakes_queued_rocks(predict):
    status = _status()
    lm = LatencyModel(hand_profile())
    cand = lookahead.CandidateRequest(prompt_tokens=100, predicted_output_tokens=2)
    rps = predict(status, cand, lm, make_policy("rps"))
    fcfs = predict(status, cand, lm, make_policy("fcfs"))
    # rps at t=10: sand P = 0.1 beats rocks that waited 1 s (P = 1 − e^−0.00075 = 0.00075):
    # step 1 = sand 100 + rock1 412 tokens + rock1's encoder 0.2 s = 0.01 + 0.0512 + 0.2
    assert rps.ttft_s == pytest.approx(0.2612)
    # step 2: sand's decode + rock1's next 511 tokens = 0.0612
    assert rps.e2e_s == pytest.approx(0.2612 + 0.0612)
    # fcfs: rock1 512/512/512/464 (+48 of rock2, its encoder 0.2 s), rock2 511/511/511/419 with
    # rock1 decoding, sand gets 92 tokens in step 8 and its last 8 in step 9 (10 tokens: 0.011)
    assert fcfs.ttft_s == pytest.approx(2 * 0.2612 + 6 * 0.0612 + 0.011)
    assert rps.ttft_s < fcfs.ttft_s / 3
