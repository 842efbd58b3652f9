"""Load-aware and prediction-guided dispatch policies, on hand-made loads/predictions."""

from collections import Counter

import numpy as np
import pytest

from rps_astro_cli.dispatch import make_dispatch
from rps_astro_cli.dispatch.guided import LlumnixDispatch, parse_k
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.types import InstanceLoad, LatencyEstimate


def est(ttft: float, e2e: float) -> LatencyEstimate:
    return LatencyEstimate(ttft, e2e, 0, 0)


def test_registry_has_all_policies():
    for name in ("round_robin", "random", "least_requests", "llumnix", "power_of_k"):
        assert make_dispatch(name).name == name


def test_least_requests_picks_fewest_and_skips_unhealthy():
    p = make_dispatch("least_requests")
    rng = np.random.default_rng(0)
    loads = [InstanceLoad(0, True, 3), InstanceLoad(1, False, 0), InstanceLoad(2, True, 1), InstanceLoad(3, True, 2)]
    cands = p.candidates(loads, rng)
    assert cands == [0, 2, 3]
    d = p.choose(loads, cands, {}, rng)
    assert d.choice == 2 and d.policy == "least_requests"


def test_least_requests_random_tie_break():
    p = make_dispatch("least_requests")
    rng = np.random.default_rng(1)
    loads = [InstanceLoad(0, True, 1), InstanceLoad(1, True, 1), InstanceLoad(2, True, 5)]
    picks = Counter(p.choose(loads, [0, 1, 2], {}, rng).choice for _ in range(200))
    assert set(picks) == {0, 1}
    assert 60 < picks[0] < 140  # uniform between the two tied ones


# Loads for llumnix, worked by hand:
#   astrolabe (Llumnix-): -(free - need) / max(running, 1)
#     L0: -(100-20)/4 = -20    L1: -(60-0)/2 = -30    L2: -(300-200)/10 = -10   → L1
#   code: -(free - 0.01*1000 - need) / (running + waiting)
#     L0: -(100-10-20)/5 = -14 L1: -(60-10-0)/5 = -10 L2: -(300-10-200)/15 = -6 → L0
LOADS = [
    InstanceLoad(0, True, 0, kv_blocks_free=100, kv_blocks_total=1000, num_running=4, num_waiting=1,
                 waiting_blocks_needed=20),
    InstanceLoad(1, True, 0, kv_blocks_free=60, kv_blocks_total=1000, num_running=2, num_waiting=3,
                 waiting_blocks_needed=0),
    InstanceLoad(2, True, 0, kv_blocks_free=300, kv_blocks_total=1000, num_running=10, num_waiting=5,
                 waiting_blocks_needed=200),
]


def test_llumnix_astrolabe_variant_loads_and_choice():
    p = LlumnixDispatch()
    assert [p.load(ld) for ld in LOADS] == [-20.0, -30.0, -10.0]
    d = p.choose(LOADS, [0, 1, 2], {}, np.random.default_rng(0))
    assert d.choice == 1 and d.reason == "lowest load"


def test_llumnix_code_variant_loads_and_choice():
    p = LlumnixDispatch(variant="code")
    assert [p.load(ld) for ld in LOADS] == pytest.approx([-14.0, -10.0, -6.0])
    assert p.choose(LOADS, [0, 1, 2], {}, np.random.default_rng(0)).choice == 0
    idle = InstanceLoad(3, True, 0, kv_blocks_free=10, kv_blocks_total=1000, num_running=0, num_waiting=0,
                        waiting_blocks_needed=0)
    assert p.load(idle) == float("-inf")


def test_llumnix_without_status_falls_back_to_least_requests():
    p = LlumnixDispatch()
    loads = [InstanceLoad(0, True, 4), InstanceLoad(1, True, 2)]
    d = p.choose(loads, [0, 1], {}, np.random.default_rng(0))
    assert d.choice == 1 and d.reason.startswith("fallback")


def test_llumnix_bad_variant_names_field():
    with pytest.raises(AstroUserError, match="variant"):
        LlumnixDispatch(variant="paperish")


def test_power_of_k_samples_k_distinct_healthy():
    p = make_dispatch("power_of_k", k=2)
    rng = np.random.default_rng(0)
    loads = [InstanceLoad(i, i != 3) for i in range(6)]
    seen = Counter()
    for _ in range(300):
        c = p.candidates(loads, rng)
        assert len(c) == 2 and len(set(c)) == 2 and 3 not in c
        seen.update(c)
    assert set(seen) == {0, 1, 2, 4, 5}
    assert min(seen.values()) > 80  # uniform: 600 picks over 5 instances ≈ 120 each


def test_power_of_k_all_is_full_fanout():
    p = make_dispatch("power_of_k", k="all")
    loads = [InstanceLoad(i, i != 1) for i in range(4)]
    assert sorted(p.candidates(loads, np.random.default_rng(0))) == [0, 2, 3]
    assert sorted(make_dispatch("power_of_k", k=9).candidates(loads, np.random.default_rng(0))) == [0, 2, 3]


def test_power_of_k_picks_lowest_objective():
    loads = [InstanceLoad(i) for i in range(3)]
    preds = {0: est(0.5, 3.0), 1: est(0.1, 4.0), 2: est(0.9, 2.0)}
    rng = np.random.default_rng(0)
    d = make_dispatch("power_of_k", k="all", objective="e2e").choose(loads, [0, 1, 2], preds, rng)
    assert d.choice == 2 and d.reason == "lowest e2e"
    assert d.predictions[1] == (0.1, 4.0)
    d = make_dispatch("power_of_k", k="all", objective="ttft").choose(loads, [0, 1, 2], preds, rng)
    assert d.choice == 1 and d.reason == "lowest ttft"


def test_power_of_k_tie_break_is_random():
    loads = [InstanceLoad(i) for i in range(2)]
    p = make_dispatch("power_of_k", objective="e2e", tie_tolerance_s=0.0)
    rng = np.random.default_rng(3)
    picks = Counter(p.choose(loads, [0, 1], {0: est(1, 2), 1: est(1, 2)}, rng).choice for _ in range(200))
    assert set(picks) == {0, 1}
    # float noise far below 1 µs (engines with different clocks) is still a tie
    noisy = {0: est(1, 0.022556408074422052), 1: est(1, 0.02255640807443271)}
    picks = Counter(p.choose(loads, [0, 1], noisy, rng).choice for _ in range(200))
    assert set(picks) == {0, 1}
    assert p.choose(loads, [0, 1], {0: est(1, 2.0), 1: est(1, 2.0 + 2e-6)}, rng).choice == 0


def test_power_of_k_unanswered_candidate_competes_on_load():
    """A candidate whose Predictor did not answer is not starved (issue 11): it and the
    best predicted candidate are compared by load — outstanding requests here, where no
    status is known (`test_power_of_k_falls_back_to_llumnix_load_where_status_is_known`)."""
    rng = np.random.default_rng(0)
    p = make_dispatch("power_of_k", k="all", objective="e2e")
    preds = {0: est(0.1, 1.0), 2: est(0.1, 0.5)}  # 2 is the best predicted; 1 did not answer
    loads = [InstanceLoad(0, True, 0), InstanceLoad(1, True, 0), InstanceLoad(2, True, 9)]
    d = p.choose(loads, [0, 1, 2], preds, rng)
    assert d.choice == 1 and d.reason == "fallback: a predictor did not answer; lowest load"
    loads = [InstanceLoad(0, True, 0), InstanceLoad(1, True, 9), InstanceLoad(2, True, 3)]
    d = p.choose(loads, [0, 1, 2], preds, rng)
    assert d.choice == 2  # the busier unanswered one loses; 0 (predicted worse than 2) is out of the comparison
    assert d.predictions == {0: (0.1, 1.0), 2: (0.1, 0.5)}
    # equal load: a random tie between the best predicted and the unanswered one
    loads = [InstanceLoad(i, True, 0) for i in range(3)]
    assert {p.choose(loads, [0, 1, 2], preds, rng).choice for _ in range(50)} == {1, 2}


def test_power_of_k_no_prediction_falls_back_to_least_requests_over_all_healthy():
    loads = [InstanceLoad(0, True, 5), InstanceLoad(1, True, 3), InstanceLoad(2, True, 1), InstanceLoad(3, False, 0)]
    d = make_dispatch("power_of_k", k=2).choose(loads, [0, 1], {}, np.random.default_rng(0))
    assert d.choice == 2  # fewest outstanding among healthy, not only among the 2 sampled
    assert d.reason.startswith("fallback: no predictor answered")


def test_power_of_k_falls_back_to_llumnix_load_where_status_is_known():
    """Issue 31's degradation: where a candidate has no usable prediction (late, down, or
    an untrusted model) and every candidate has a status, the comparison is Llumnix- load
    (−(free − waiting blocks needed) / running), not outstanding requests. By hand:
    instance 0: free 100, needs 0, 4 running → −25; 1: free 20, needs 10, 1 running → −10;
    2: free 90, 3 running → −30 (the lowest load), though it has the most outstanding."""
    def ld(i, out, free, need, running):
        return InstanceLoad(i, True, out, kv_blocks_free=free, kv_blocks_total=200, num_running=running,
                            num_waiting=0, waiting_blocks_needed=need, kv_block_size=16, max_num_seqs=48)

    loads = [ld(0, 1, 100, 0, 4), ld(1, 0, 20, 10, 1), ld(2, 9, 90, 0, 3)]
    p = make_dispatch("power_of_k", k="all", objective="e2e", kv_reserve_frac=0)  # the tie-break reads status
    d = p.choose(loads, [0, 1, 2], {}, np.random.default_rng(0))
    assert d.choice == 2 and d.reason == "fallback: no predictor answered; lowest load"
    d = p.choose(loads, [0, 1, 2], {0: est(0.1, 0.2)}, np.random.default_rng(0))  # 1 and 2 unanswered
    assert d.choice == 2 and d.reason == "fallback: a predictor did not answer; lowest load"
    # the paper's Po2 reads no status: outstanding requests decide
    po2 = make_dispatch("power_of_k", k="all", objective="e2e", kv_reserve_frac=0, tie_tolerance_s=0)
    assert po2.choose(loads, [0, 1, 2], {}, np.random.default_rng(0)).choice == 1


@pytest.mark.parametrize("bad", [0, -1, "none", 1.5, True])
def test_parse_k_rejects_bad_values(bad):
    with pytest.raises(AstroUserError, match="k"):
        parse_k(bad)


def test_parse_k_accepts_ints_and_all():
    assert parse_k(2) == 2 and parse_k("3") == 3 and parse_k("all") is None and parse_k("ALL") is None


def test_power_of_k_unknown_objective():
    with pytest.raises(AstroUserError, match="objective"):
        make_dispatch("power_of_k", objective="throughput")


# -- k="auto": bounded look-aheads on a large fleet (issue 32) ------------------------------
def _status(i: int, free: int, running: int, hit: int | None = None) -> InstanceLoad:
    return InstanceLoad(i, True, running, kv_blocks_free=free, kv_blocks_total=1000, num_running=running,
                        num_waiting=0, waiting_blocks_needed=0, prefix_hit_tokens=hit)


def test_auto_k_is_full_fanout_up_to_eight_instances():
    pol = make_dispatch("power_of_k")  # the default k
    assert pol.describe()["k"] == "auto"
    for n in (1, 5, 8):
        loads = [_status(i, 500 + 50 * i, 1) for i in range(n)]
        assert sorted(pol.candidates(loads, np.random.default_rng(0))) == list(range(n))


def test_auto_k_keeps_the_eight_least_loaded_of_a_larger_fleet():
    # Llumnix- load (astrolabe) = -(free blocks) / running: instance i has 10·i free blocks
    # per running request, so the least loaded are the highest indices
    loads = [_status(i, 10 * i, 1) for i in range(20)]
    pol = make_dispatch("power_of_k", kv_reserve_frac=0)
    cands = pol.candidates(loads, np.random.default_rng(0))
    assert sorted(cands) == list(range(12, 20))
    # an instance holding the request's prefix is kept whatever its load, plus 7 least loaded
    loads[3] = _status(3, 30, 1, hit=512)
    cands = pol.candidates(loads, np.random.default_rng(0))
    assert cands[0] == 3 and sorted(cands[1:]) == list(range(13, 20))


def test_auto_k_ranks_instances_without_status_last_and_breaks_ties_at_random():
    loads = [_status(i, 500, 1) for i in range(10)] + [InstanceLoad(10 + j, True, 0) for j in range(6)]
    pol = make_dispatch("power_of_k", kv_reserve_frac=0)
    seen = set()
    for seed in range(30):
        cands = pol.candidates(loads, np.random.default_rng(seed))
        assert len(cands) == 8 and all(i < 10 for i in cands)  # the 6 without a status never
        seen.update(cands)
    assert seen == set(range(10))  # equal loads: each of the ten is drawn some time


def test_auto_k_asks_at_most_eight_predictors():
    from rps_astro_cli.dispatch import decide

    loads = [_status(i, 10 * (i % 13), 1 + i % 3) for i in range(64)]
    asked: list[list[int]] = []

    def predict(cands):
        asked.append(list(cands))
        return {i: LatencyEstimate(0.01 * (i % 5), 1.0, 0, 0) for i in cands}

    d = decide(make_dispatch("power_of_k"), loads, np.random.default_rng(1), predict)
    assert len(asked) == 1 and len(asked[0]) == 8 and d.choice in asked[0]
