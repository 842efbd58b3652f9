"""Length as a distribution: the CDF read from quantiles, the conditional remaining length
E[L − g | L > g] on hand-computed cases, and the calibration from point predictions."""

import math

import numpy as np
import pytest

from rps_astro_cli.length.dist import (
    LengthDistribution,
    LogSpreadCalibration,
    fit_log_spread,
    remaining_tokens,
)

# One quantile: F rises linearly from (1 token, 0) to (101 tokens, 0.5), then an exponential
# tail with mean excess 100 tokens. So L is U[1, 101] with probability 1/2, else 101 + Exp(100).
ONE = LengthDistribution(levels=(0.5,), quantiles_tokens=(101.0,), tail_mean_tokens=100.0)


def test_cdf_and_quantiles_of_one_quantile():
    assert ONE.cdf(1) == 0.0 and ONE.cdf(51) == pytest.approx(0.25) and ONE.cdf(101) == pytest.approx(0.5)
    # tail: 1 − 0.5·exp(−100/100)
    assert ONE.cdf(201) == pytest.approx(1 - 0.5 * math.exp(-1))
    assert ONE.quantile(0.25) == pytest.approx(51.0)
    # 0.75 = 1 − 0.5·exp(−x/100) → x = 100·ln 2
    assert ONE.quantile(0.75) == pytest.approx(101 + 100 * math.log(2))
    assert ONE.median_tokens == pytest.approx(101.0)


def test_remaining_tokens_hand_computed():
    # g = 0: E[L] = ½·51 (mean of U[1,101]) + ½·(101 + 100) = 126
    assert remaining_tokens(ONE, 0) == pytest.approx(126.0)
    assert ONE.mean_tokens == pytest.approx(126.0)
    # g = 51: P(L > 51) = 0.75; given that, with prob ⅓ L ~ U[51,101] (remaining 25 on average),
    # with prob ⅔ L = 101 + Exp(100) (remaining 50 + 100): 25/3 + 100
    assert remaining_tokens(ONE, 51) == pytest.approx(25 / 3 + 100)
    # past the last quantile the tail is memoryless: 100 whatever g is
    assert remaining_tokens(ONE, 101) == pytest.approx(100.0)
    assert remaining_tokens(ONE, 5000) == pytest.approx(100.0)


def test_remaining_tokens_two_quantiles():
    d = LengthDistribution(levels=(0.5, 0.9), quantiles_tokens=(11.0, 31.0), tail_mean_tokens=10.0)
    # g = 21: F(21) = 0.7, survival 0.3. ∫_21^31 (1−F) = 10·(0.3 + 0.1)/2 = 2; tail 0.1·10 = 1
    assert d.cdf(21) == pytest.approx(0.7)
    assert remaining_tokens(d, 21) == pytest.approx((2 + 1) / 0.3)
    # g = 6: F = 0.25; ∫_6^11 = 5·(0.75 + 0.5)/2 = 3.125; ∫_11^31 = 20·(0.5 + 0.1)/2 = 6; tail 1
    assert remaining_tokens(d, 6) == pytest.approx((3.125 + 6 + 1) / 0.75)
    # remaining length decreases less than one for one as g grows inside a segment, never < 0
    gs = np.linspace(0, 60, 121)
    assert all(remaining_tokens(d, g) > 0 for g in gs)


def test_remaining_tokens_rejects_bad_input_and_bad_dists():
    with pytest.raises(ValueError, match="generated_tokens"):
        remaining_tokens(ONE, -1)
    with pytest.raises(ValueError, match="levels"):
        LengthDistribution(levels=(0.5, 0.5), quantiles_tokens=(10.0, 20.0), tail_mean_tokens=1.0)
    with pytest.raises(ValueError, match="quantiles"):
        LengthDistribution(levels=(0.1, 0.5), quantiles_tokens=(20.0, 10.0), tail_mean_tokens=1.0)
    with pytest.raises(ValueError, match="tail_mean"):
        LengthDistribution(levels=(0.5,), quantiles_tokens=(10.0,), tail_mean_tokens=0.0)


def test_fit_log_spread_hand_computed():
    # every prediction 100; log(true/pred) = ln .5, 0, 0, ln 2, ln 4 → median 0;
    # above q = 100: 200 and 400, relative excess 1 and 3 → tail ratio 2
    cal = fit_log_spread([100] * 5, [50, 100, 100, 200, 400], levels=(0.5,), n_bins=1)
    assert cal.log_offsets == ((0.0,),) and cal.tail_ratios == (2.0,) and cal.n_fit == 5
    (d,) = cal.distributions([50])
    assert d.quantiles_tokens == (50.0,) and d.tail_mean_tokens == pytest.approx(100.0)
    assert LogSpreadCalibration.from_dict(cal.to_dict()) == cal
    with pytest.raises(ValueError, match="missing or malformed"):
        LogSpreadCalibration.from_dict({"levels": [0.5]})


def test_fit_log_spread_bins_by_prediction_size():
    rng = np.random.default_rng(0)
    small = rng.uniform(10, 20, 200)
    big = rng.uniform(500, 600, 200)
    # small predictions are exact, big ones scatter ×/÷ e around the truth
    y = np.r_[small, big * np.exp(rng.uniform(-1, 1, 200))]
    cal = fit_log_spread(np.r_[small, big], y, levels=(0.1, 0.5, 0.9), n_bins=2)
    assert len(cal.bin_edges_tokens) == 1 and 20 <= cal.bin_edges_tokens[0] <= 500
    assert cal.log_offsets[0] == pytest.approx((0.0, 0.0, 0.0), abs=1e-9)
    assert cal.log_offsets[1] == pytest.approx((-0.8, 0.0, 0.8), abs=0.15)


# ---- CalibratedRemaining: the look-ahead's rule read from a model's calibration --------

def _one_bin_calibration():
    from rps_astro_cli.length.dist import LogSpreadCalibration

    # one bin, one level: q50 = the point itself, tail mean excess = 1.0 × q50
    return LogSpreadCalibration(levels=(0.5,), bin_edges_tokens=(), log_offsets=((0.0,),), tail_ratios=(1.0,))


def test_calibrated_remaining_hand_computed():
    from rps_astro_cli.length.dist import CalibratedRemaining

    rule = CalibratedRemaining(_one_bin_calibration())
    # p = 100: F linear from (1, 0) to (100, 0.5), then 1 − 0.5·exp(−(x − 100)/100).
    # E[L] = ∫_0^1 1 + ∫_1^100 (1 − F) + 0.5·100 = 1 + 99·(1 + 0.5)/2 + 50 = 125.25
    assert rule.remaining(100, 0) == pytest.approx(125.25)
    assert rule.expected_total(100, 0) == 126
    # g = 1 = min_tokens: 74.25 + 50 = 124.25 remaining → total ceil(125.25) = 126
    assert rule.remaining(100, 1) == pytest.approx(124.25)
    # past the last quantile the tail is memoryless: 100 more tokens
    assert rule.expected_total(100, 200) == 300
    assert rule.expected_total(100, 200, cap=250) == 250
    assert rule.expected_total(100, 260, cap=250) == 261  # cap ≤ g: just g + 1
    # conditional median: g = 0 → q50 = 100; g = 200 → F = 1 − 0.5/e, level 1 − 0.25/e,
    # 100 + 100·ln(0.5 / (0.25/e)) = 100 + 100·(ln 2 + 1) = 269.3 → 270
    med = CalibratedRemaining(_one_bin_calibration(), "q50")
    assert med.expected_total(100, 0) == 100
    assert med.expected_total(100, 200) == 270


def test_calibrated_remaining_matches_remaining_tokens():
    from rps_astro_cli.length.dist import CalibratedRemaining, LogSpreadCalibration, remaining_tokens

    cal = LogSpreadCalibration(levels=(0.1, 0.5, 0.9), bin_edges_tokens=(200.0,),
                               log_offsets=((-1.0, 0.0, 0.7), (-0.5, 0.1, 0.4)), tail_ratios=(0.5, 0.2))
    rule = CalibratedRemaining(cal)
    for p in (50, 150, 300, 900):
        d = cal.distributions([p])[0]
        for g in (0, 1, 10, 49, 120, 400, 2000):
            assert rule.remaining(p, g) == pytest.approx(remaining_tokens(d, g), rel=1e-9)
            assert rule.expected_total(p, g) >= g + 1


def test_calibrated_remaining_bad_statistic():
    from rps_astro_cli.length.dist import CalibratedRemaining

    with pytest.raises(ValueError, match="statistic"):
        CalibratedRemaining(_one_bin_calibration(), "q150")
