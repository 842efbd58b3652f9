"""Bench metrics, SLOs and the capacity search on hand-made records with hand-computed values."""

from __future__ import annotations

import math

import pytest

from rps_astro_cli.bench.capacity import CapacityGoal, search_capacity
from rps_astro_cli.bench.metrics import Dist, all_metrics, group_metrics, percentile, slo_percentile_value
from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.bench.slo import isolated_e2e_s, parse_slo
from rps_astro_cli.errors import AstroUserError


def rec(rid, sent, first, finish, n, ok=True, cls="sand", itl=(), pred_len=None, pred_e2e=None, pre=None):
    return RequestRecord(rid, req_class=cls, sent_s=sent, first_token_s=first, finish_s=finish, output_tokens=n,
                         success=ok, error=None if ok else "HTTP 500: boom", itl_s=list(itl),
                         predicted_output_tokens=pred_len, predicted_e2e_s=pred_e2e, preemptions=pre)


def test_percentile_with_zero_and_one_sample():
    assert percentile([], 99) is None
    assert percentile([3.5], 50) == 3.5 and percentile([3.5], 99) == 3.5
    assert Dist.of([]) == Dist(0, None, None, None, None)
    assert Dist.of([None, 2.0]) == Dist(1, 2.0, 2.0, 2.0, 2.0)
    # linear interpolation: [1, 2, 3, 4] P90 = 1 + 0.9 * 3 = 3.7
    assert percentile([4, 1, 3, 2], 90) == pytest.approx(3.7)


def test_hand_computed_group():
    # a: sent 0, first 1, last 3, 5 tokens → TTFT 1, E2E 3, TPOT 0.5, norm 0.6
    # b: sent 1, first 1.5, last 1.5, 1 token → TTFT 0.5, E2E 0.5, no TPOT, norm 0.5
    # c: 0-token success: sent 2, finish 2.5 → E2E 0.5, no TTFT/TPOT/norm
    # d: failed, sent 3, finish 4 (the run ends at 4 → T = 4 − 0 = 4)
    rs = [rec("a", 0, 1, 3, 5, itl=[0.5, 0.5, 0.5, 0.5], pred_len=4, pred_e2e=2.0, pre=2),
          rec("b", 1, 1.5, 1.5, 1, pred_len=3, pre=0),
          rec("c", 2, None, 2.5, 0),
          rec("d", 3, None, 4.0, 0, ok=False)]
    slo = parse_slo(["ttft:0.8", "e2el:2"])
    m = group_metrics(rs, slo)
    assert (m.num_requests, m.num_completed, m.num_failed) == (4, 3, 1)
    assert m.duration_s == 4.0
    assert m.ttft_s == Dist(2, 0.75, 0.75, pytest.approx(0.95), pytest.approx(0.995))
    assert m.tpot_s == Dist(1, 0.5, 0.5, 0.5, 0.5)
    assert m.e2e_s.count == 3 and m.e2e_s.mean == pytest.approx(4 / 3)
    assert m.normalized_s_per_token.mean == pytest.approx((0.6 + 0.5) / 2)
    assert m.itl_s.count == 4 and m.itl_s.p99 == 0.5
    assert m.throughput_rps == pytest.approx(3 / 4)
    assert m.total_output_tokens == 6 and m.output_tokens_per_s == pytest.approx(6 / 4)
    # SLO: a misses ttft (1 > 0.8, by 0.2) and e2el (3 > 2, by 1); b, c good; d failed → 2 good of 4
    assert m.slo.good == 2 and m.slo.violation_rate == pytest.approx(0.5)
    assert m.slo.goodput_rps == pytest.approx(2 / 4)
    assert m.slo.per_metric["ttft"] == {"violations": 1, "rate": pytest.approx(1 / 3),
                                        "severity_mean_s": pytest.approx(0.2)}
    assert m.slo.per_metric["e2el"]["severity_mean_s"] == pytest.approx(1.0)
    assert m.preemptions == 2
    # length error: |4 − 5| and |3 − 1| → MAE 1.5, MAPE (0.2 + 2) / 2 = 1.1
    assert m.length_mae_tokens == pytest.approx(1.5) and m.length_mape == pytest.approx(1.1)
    # predictor E2E: |2 − 3| = 1 → MAE 1, MAPE 1/3
    assert m.predictor_e2e_mae_s == pytest.approx(1.0) and m.predictor_e2e_mape == pytest.approx(1 / 3)
    assert m.errors == {"HTTP 500: boom": 1}  # the full reason, not only its status


def test_all_failed_gives_na_not_crash():
    rs = [rec("x", 0, None, 1, 0, ok=False), rec("y", 0.5, None, 2, 0, ok=False)]
    m = group_metrics(rs, parse_slo(["ttft:1"]))
    assert m.num_completed == 0 and m.ttft_s.mean is None and m.e2e_s.p99 is None
    assert m.throughput_rps == 0.0 and m.slo.good == 0 and m.slo.violation_rate == 1.0
    assert m.slo.per_metric["ttft"]["rate"] is None
    assert slo_percentile_value(rs, "ttft", 99) == math.inf


def test_single_sample_and_per_class():
    rs = [rec("a", 0, 0.2, 1.2, 3, cls="sand"), rec("b", 0, 2.0, 4.0, 5, cls="rocks")]
    out = all_metrics(rs)
    assert set(out) == {"overall", "sand", "rocks"}
    assert out["rocks"].ttft_s == Dist(1, 2.0, 2.0, 2.0, 2.0)
    assert out["sand"].duration_s == 4.0  # the run's T, not the class's own span
    assert out["sand"].throughput_rps == pytest.approx(1 / 4)


def test_slo_parsing():
    s = parse_slo(["ttft:500ms", "e2el:60", "tpot:0.1s"], 5)
    assert dict(s.thresholds_s) == {"ttft": 0.5, "e2el": 60.0, "tpot": 0.1} and s.e2e_scale == 5
    for bad in (["foo:1"], ["ttft"], ["ttft:0"], ["ttft:1", "ttft:2"], ["ttft:-3"]):
        with pytest.raises(AstroUserError):
            parse_slo(bad)
    with pytest.raises(AstroUserError):
        parse_slo([], -1)


def test_relative_slo_uses_isolated_e2e():
    r = rec("a", 0, 0.1, 1.0, 10)
    r.isolated_e2e_s = 0.15
    slo = parse_slo([], 5)  # threshold 0.75 s
    m = group_metrics([r], slo)
    assert m.slo.good == 0 and m.slo.per_metric["e2el"]["severity_mean_s"] == pytest.approx(0.25)


def test_isolated_e2e_on_a_hand_made_profile():
    from rps_astro_cli.sim.profile import ExecutionProfile

    # step = 10 ms + 0.1 ms per token (no per-seq or attention terms)
    prof = ExecutionProfile("hand", "m", "g", 1, base_s=0.010, per_seq_s=0.0, token_knots=(0, 10_000),
                            token_s=(0.0, 1.0), decode_attn_s_per_ctx_token=0.0, prefill_attn_s_per_token_pair=0.0)
    # prompt 100 tokens: prefill step 0.010 + 0.010 = 0.020 s → token 1; then 2 decodes of 0.0101 s
    assert isolated_e2e_s(prof, 100, 3) == pytest.approx(0.020 + 2 * 0.0101)
    # 1,200-token prompt: chunks 512 / 512 / 176 → 3 steps; 1 output token
    assert isolated_e2e_s(prof, 1200, 1) == pytest.approx(3 * 0.010 + 0.1200)


def test_capacity_bisection_and_grid():
    calls = []

    def probe(rate):  # P99 TTFT grows linearly: v = rate / 4 → meets 10 s up to 40 req/s
        calls.append(rate)
        return rate / 4

    res = search_capacity(probe, CapacityGoal("ttft", 99, 10.0), start_rps=4, tolerance=0.01)
    assert calls[:5] == [4, 8, 16, 32, 64]
    assert 40 * 0.99 <= res.capacity_rps <= 40
    assert res.interpolated_rps == pytest.approx(40.0)
    grid = search_capacity(lambda r: r / 4 if r < 50 else math.inf, CapacityGoal(threshold_s=10.0),
                           rates=[10, 20, 30, 45, 60])
    assert grid.capacity_rps == 30 and [p[0] for p in grid.probes] == [10, 20, 30, 45]
    assert grid.interpolated_rps == pytest.approx(40.0)
    none = search_capacity(lambda r: math.inf, CapacityGoal(), start_rps=1, min_rps=0.25)
    assert none.capacity_rps is None and "even at" in none.note


def test_capacity_probes_left_bounds_the_search_hand_computed():
    """v(rate) = rate / 10 s against a 1 s goal, start 4 req/s, tolerance 0.02, bound 256:
    4 and 8 meet it, 16 misses → bracket [8, 16]: at most ⌈log2(1 / 0.02)⌉ = 6 probes
    left, at least ⌈log2(0.5 / 0.02)⌉ = 5; the bisection then runs 12 ✗, 10 ✓, 11 ✗,
    10.5 ✗, 10.25 ✗, 10.125 ✗ (6 probes) and stops at [10, 10.125]. Before any miss
    (after 4 ✓): at least 1, at most 6 doublings to 256 + 6 = 12. Each probe is reported
    to `on_record` with the search as it stands."""
    from rps_astro_cli.bench.capacity import CapacityGoal, CapacitySearch, search_capacity

    goal = CapacityGoal("ttft", 99.0, 1.0)
    s = CapacitySearch(goal, start_rps=4.0, tolerance=0.02, max_rps=256.0)
    assert s.probes_left() == (1, None)
    seen = []
    for _ in range(3):
        (r,) = s.next_rates()
        s.record(r, r / 10)
        seen.append((r, s.probes_left()))
    assert seen == [(4.0, (1, 12)), (8.0, (1, 11)), (16.0, (5, 6))]
    left_after = []
    res = search_capacity(lambda r: r / 10, goal, start_rps=4.0, tolerance=0.02, max_rps=256.0,
                          on_record=lambda srch, r, ok: left_after.append((r, ok, srch.probes_left()[1])))
    assert [r for r, _, _ in left_after] == [4.0, 8.0, 16.0, 12.0, 10.0, 11.0, 10.5, 10.25, 10.125]
    assert [n for _, _, n in left_after][2:] == [6, 5, 4, 3, 2, 1, 0]
    assert res.capacity_rps == 10.0


def test_capacity_probe_line_says_value_bracket_and_time_left():
    """The console line of a probe, width 2: 4 req/s meets the 1 s goal (0.4 s), 8 req/s
    meets it out of steady state (a miss): bracket [4, 8]; the mean 10 s per probe so far
    times the most probes left."""
    from rps_astro_cli.bench.capacity import CapacitySearch
    from rps_astro_cli.cli.bench import probe_line

    s = CapacitySearch(CapacityGoal("ttft", 99.0, 1.0), rates=None, start_rps=4.0, width=2, tolerance=0.02)
    assert s.next_rates() == [4.0, 8.0]
    s.record(4.0, 0.4)
    s.record(8.0, (0.8, False))  # met the goal out of steady state: a miss
    (lo_r, hi_r) = s.bracket()
    assert (lo_r, hi_r) == (4.0, 8.0)
    line = probe_line(s, 8.0, False, {"walls": [8.0, 12.0]})
    # width 2: each round cuts the bracket by 3: ⌈log3(1 / 0.02)⌉ = 4 rounds (8 probes) at most,
    # ⌈log3(0.5 / 0.02)⌉ = 3 rounds (6) at least; 8 × 10 s
    assert line == ("  probe 2 at 8 req/s: ttft p99 0.8 s vs 1 s → missed (not in steady state); "
                    "bracket [4, 8] req/s; 6–8 probes left, ≈ 80 s")
