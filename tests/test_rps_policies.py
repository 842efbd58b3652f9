"""RPS-Serve policies: priority regulator values, orderings and victims worked out by hand."""

from __future__ import annotations

import math

import pytest

from conftest import hand_profile, req
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.policies import INSTANCE_POLICIES, make_policy
from rps_astro_cli.policies.priority import PriorityRegulator
from rps_astro_cli.sim.instance import InstanceSim
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.types import InstanceConfig


def test_all_policies_registered():
    for name in ("fcfs", "edf", "naive_class", "static_class", "naive_aging", "rps"):
        assert name in INSTANCE_POLICIES


# -- regulator values --------------------------------------------------------------------
def test_priority_sand_after_2s():
    reg = PriorityRegulator()
    expect = 0.1 + 1 - math.exp(-0.05 * 2**3.5)  # 2^3.5 = 11.3137; exp(-0.565685) = 0.567971
    assert reg.priority("sand", 2.0) == pytest.approx(expect, abs=1e-12)
    assert reg.priority("sand", 2.0) == pytest.approx(0.532029, abs=1e-6)
    assert reg.score("sand", 2.0) == pytest.approx(-math.log(0.532029), abs=1e-5)


def test_priority_pebbles_rocks_and_fresh():
    reg = PriorityRegulator()
    # pebbles after 10 s: 10^2.5 = 316.2278, × 0.003 = 0.9486833, exp(−·) = 0.3872506
    assert reg.priority("pebbles", 10.0) == pytest.approx(0.05 + 1 - 0.3872506, abs=1e-6)
    # rocks after 60 s: 60^1.1 = 90.35795, × 0.00075 = 0.0677685, 1 − exp(−·) = 0.0655232
    assert reg.priority("rocks", 60.0) == pytest.approx(0.0655232, abs=1e-6)
    assert reg.priority("sand", 0.0) == pytest.approx(0.1)
    assert reg.score("pebbles", 0.0) == pytest.approx(-math.log(0.05))
    assert reg.score("rocks", 0.0) == math.inf  # S_rocks = 0: a fresh rock is last
    assert reg.priority("sand", -3.0) == pytest.approx(0.1)  # negative wait counts as 0


def test_regulator_parameters_are_configurable_and_checked():
    reg = PriorityRegulator(static_priority={"sand": 0.5, "pebbles": 0.2, "rocks": 0.1},
                            alpha=(1, 1, 1), beta=(1, 1, 1))
    assert reg.priority("rocks", 1.0) == pytest.approx(0.1 + 1 - math.exp(-1))
    with pytest.raises(AstroUserError, match="beta"):
        PriorityRegulator(beta=(0.05, 0.0, 0.001))
    with pytest.raises(AstroUserError, match="alpha"):
        PriorityRegulator(alpha=(1, 2))
    with pytest.raises(AstroUserError, match="static_priority"):
        PriorityRegulator(static_priority={"sand": 0.1, "pebbles": 0.05})
    p = make_policy("rps", alpha=(1.0, 1.0, 1.0))
    assert p.describe()["alpha"] == [1.0, 1.0, 1.0]


# -- orderings -----------------------------------------------------------------------------
def test_rps_orders_a_mixed_queue():
    now = 100.0
    a = req("A", 0.0, "video", 5000)      # rock,   w=100: 100^1.1=158.489 → P = 0.112074
    e = req("E", 90.0, "video", 5000)     # rock,   w=10:  10^1.1=12.589   → P = 0.009398
    b = req("B", 95.0, "image", 2000)     # pebble, w=5:   5^2.5=55.902    → P = 0.204396
    d = req("D", 98.0)                    # sand,   w=2                    → P = 0.532029
    f = req("F", 99.0, "image", 2000)     # pebble, w=1                    → P = 0.052996
    c = req("C", 99.9)                    # sand,   w=0.1: 0.1^3.5·0.05    → P = 0.100016
    pol = make_policy("rps")
    order = pol.order_waiting([a, e, b, d, f, c], now)
    assert [r.request_id for r in order] == ["D", "B", "A", "C", "F", "E"]
    assert pol.regulator.priority("rocks", 100.0) == pytest.approx(0.112074, abs=1e-6)
    assert pol.regulator.priority("pebbles", 5.0) == pytest.approx(0.204396, abs=1e-6)
    assert a.req_class == "rocks" and b.req_class == "pebbles" and c.req_class == "sand"  # labelled


def test_rock_overtakes_fresh_sand_after_the_crossover():
    # 1 − exp(−0.00075 w^1.1) = 0.1  ⇔  w = (−ln 0.9 / 0.00075)^(1/1.1) = 140.4807^(0.90909) = 89.61 s
    w_star = (-math.log(0.9) / 0.00075) ** (1 / 1.1)
    assert w_star == pytest.approx(89.61, abs=0.01)
    pol = make_policy("rps")
    assert pol.regulator.crossover_wait_s("rocks", "sand") == pytest.approx(w_star, rel=1e-12)
    for w, first in ((w_star - 0.05, "sand"), (w_star + 0.05, "rock")):
        now = 1000.0
        rock = req("rock", now - w, "video", 6000)
        sand = req("sand", now)
        assert pol.order_waiting([rock, sand], now)[0].request_id == first
    # pebbles vs fresh sand: (−ln 0.95 / 0.003)^(1/2.5) = 17.0978^0.4 = 3.113 s
    assert pol.regulator.crossover_wait_s("pebbles", "sand") == pytest.approx(3.113, abs=1e-3)


def test_static_and_naive_class_and_aging_orders():
    now = 10.0
    v = req("v", 0.0, "video", 900)   # short video: smart label says pebbles
    v.req_class = "pebbles"
    i = req("i", 1.0, "image", 800)
    t = req("t", 2.0)
    t2 = req("t2", 0.5)
    static = make_policy("static_class").order_waiting([v, i, t, t2], now)
    assert [r.request_id for r in static] == ["t2", "t", "v", "i"]
    # naive ignores the label: the video is a rock
    assert [r.request_id for r in make_policy("naive_class").order_waiting([v, i, t, t2], now)] == ["t2", "t", "i", "v"]
    assert [r.request_id for r in make_policy("naive_aging").order_waiting([t, i, v, t2], now)] == ["v", "t2", "i", "t"]


def test_edf_orders_by_deadline():
    prof = hand_profile()
    # isolated E2E = prefill (0.01 + 0.0001·100 = 0.02) + (out − 1) · (0.01 + 0.0001) decode steps
    x = req("X", 0.0, prompt=100, out=10)     # 0.02 + 9·0.0101 = 0.1109 → deadline 5·0.1109 = 0.5545
    z = req("Z", 0.1, prompt=100, out=50, deadline_s=0.5)
    y = req("Y", 0.3, prompt=100, out=2)      # 0.02 + 0.0101 = 0.0301 → 0.3 + 0.1505 = 0.4505
    pol = make_policy("edf", slo_scale=5.0, profile=prof)
    assert [r.request_id for r in pol.order_waiting([x, z, y], 1.0)] == ["Y", "Z", "X"]
    assert x.deadline_s == pytest.approx(0.5545)
    assert y.deadline_s == pytest.approx(0.4505)
    assert pol.preemption_victim([x, y, z], 1.0) is x
    with pytest.raises(AstroUserError, match="slo_scale"):
        make_policy("edf", slo_scale=0)


# -- preemption victims --------------------------------------------------------------------
def test_rps_victim_is_worst_score_but_never_sand_while_heavier_runs():
    pol = make_policy("rps")
    now = 100.0
    sand_young = req("s", 99.9)                # score −log 0.100016 = 2.302
    rock_old = req("r", 0.0, "video", 5000)    # score −log 0.112074 = 2.189 (better than the sand!)
    pebble = req("p", 95.0, "image", 2000)     # score −log 0.204396 = 1.588
    assert pol.preemption_victim([sand_young, rock_old, pebble], now) is rock_old
    assert pol.preemption_victim([rock_old, sand_young], now) is rock_old
    s_old = req("s_old", 98.0)                 # P 0.532
    assert pol.preemption_victim([sand_young, s_old], now) is sand_young  # only sand: worst score
    assert make_policy("static_class").preemption_victim([pebble, sand_young, rock_old,
                                                          req("r2", 1.0, "video")], now).request_id == "r2"
    assert make_policy("naive_aging").preemption_victim([s_old, sand_young, rock_old], now) is sand_young


def test_unknown_classifier_is_a_user_error():
    with pytest.raises(AstroUserError, match="classifier"):
        make_policy("rps", classifier="no-such-classifier")


# -- in the instance model -----------------------------------------------------------------
def test_sand_flows_past_queued_rocks_in_the_instance():
    prof = hand_profile()
    cfg = InstanceConfig.from_profile(prof)
    out = {}
    for name in ("fcfs", "rps"):
        inst = InstanceSim(cfg, LatencyModel(prof), make_policy(name))
        inst.add(req("rock", 0.0, "video", 2000, out=5))
        inst.add(req("sand", 0.0, "text", 100, out=1))
        t = 0.0
        while inst.has_work:
            res = inst.step(t)
            t += res.duration_s
            for r in res.finished:
                out[(name, r.request_id)] = r.first_token_s
    # rps at t=0: both fresh; sand P=0.1 > rock P=0 → sand (100) + rock chunk (412) in step 1:
    # 0.01 + 0.0001·512 = 0.0612 s
    assert out[("rps", "sand")] == pytest.approx(0.0612)
    # fcfs: rock 512/512/512/464 then sand gets 48 of step 4 and its last 52 in step 5:
    # 4 × 0.0612 + step 5 (rock decode 1 + sand 52 = 53 tokens: 0.01 + 0.0053) = 0.2601
    assert out[("fcfs", "sand")] == pytest.approx(4 * 0.0612 + 0.0153)


def test_vectorized_order_equals_the_regulator_formula_on_random_queues():
    import numpy as np

    rng = np.random.default_rng(7)
    pol = make_policy("rps")
    reg = PriorityRegulator()
    mods = ("text", "image", "video")
    for _ in range(50):
        now = 500.0
        q = [req(f"r{i}", float(now - rng.exponential(30.0)), mods[int(rng.integers(0, 3))]) for i in range(40)]
        q.append(req("fresh-rock-a", now, "video"))
        q.append(req("fresh-rock-b", now, "video"))  # P = 0 tie: arrival, then position
        ref = sorted(range(len(q)),
                     key=lambda i: (-reg.priority(pol.classify(q[i]), now - q[i].arrival_s), q[i].arrival_s, i))
        assert [r.request_id for r in pol.order_waiting(q, now)] == [q[i].request_id for i in ref]
