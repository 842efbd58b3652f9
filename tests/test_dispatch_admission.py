"""Per-request SLOs and admission (issue 33): hand-computed headroom cases, the SLO
parser, and the virtual cluster's refusals (profile: step = 10 ms + 0.1 ms per token)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import linear_profile
from rps_astro_cli.cluster import TimedRequest, simulate_cluster
from rps_astro_cli.dispatch import decide, make_dispatch
from rps_astro_cli.dispatch.admission import (
    DEFAULT_ADMISSION,
    Admission,
    RequestSlo,
    judge,
    least_headroom,
    parse_request_slo,
    parse_slo_class,
    room_of,
)
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.types import InstanceConfig, InstanceLoad, LatencyEstimate

HAND = linear_profile()
CFG = InstanceConfig(block_size=16, num_gpu_blocks=1000, max_num_seqs=48, max_num_batched_tokens=512,
                     max_model_len=4096)
SLO_1S = RequestSlo(ttft_ms=1000.0)


# -- judge: hand-computed -------------------------------------------------------------------
def test_feasible_set_with_the_margin() -> None:
    # ×1.1: 0.5 → 0.55 ≤ 1 (meets), 0.95 → 1.045 > 1 (misses), 0.9 → 0.99 ≤ 1 (meets)
    v = judge(SLO_1S, [0, 1, 2], {0: 0.5, 1: 0.95, 2: 0.9}, Admission())
    assert v.admit and v.feasible == (0, 2) and v.reason == "headroom"
    # margin 0: 0.95 meets too
    assert judge(SLO_1S, [0, 1, 2], {0: 0.5, 1: 0.95, 2: 0.9}, Admission(margin_frac=0.0)).feasible == (0, 1, 2)
    # least headroom among the feasible: the highest predicted TTFT
    assert least_headroom((0, 2), {0: 0.5, 2: 0.9}) == 2
    assert least_headroom((3, 1), {3: 0.5, 1: 0.5}) == 1  # ties: the lowest index


def test_no_candidate_meets_it() -> None:
    # best 2.0 s × 1.1 = 2.2 s, 1.2 s over the 1 s target → Retry-After ceil(1.2) = 2
    v = judge(SLO_1S, [0, 1], {0: 2.0, 1: 3.5}, Admission("reject"))
    assert not v.admit and v.reason == "slo_ttft_unmeetable" and v.retry_after_s == 2
    off = judge(SLO_1S, [0, 1], {0: 2.0, 1: 3.5}, Admission("off"))
    assert off.admit and off.feasible == () and off.reason == "no_headroom_off"
    # no prediction arrived: fail open
    assert judge(SLO_1S, [0, 1], {}, Admission()).reason == "no_prediction"
    # a candidate that did not answer is not feasible
    assert judge(SLO_1S, [0, 1], {1: 0.1}, Admission()).feasible == (1,)


def test_room_rule() -> None:
    # 0 is predicted faster but has no room now (its TTFT waits on running requests):
    # only 1 meets the target; without the rule both do
    v = judge(SLO_1S, [0, 1], {0: 0.1, 1: 0.5}, Admission(), {0: False, 1: True})
    assert v.feasible == (1,)
    assert judge(SLO_1S, [0, 1], {0: 0.1, 1: 0.5}, Admission(require_room=False), {0: False}).feasible == (0, 1)
    # neither has room → refused (Retry-After from the best prediction: 0.11 s over nothing → 1)
    v = judge(SLO_1S, [0, 1], {0: 0.1, 1: 0.5}, Admission(), {0: False, 1: False})
    assert not v.admit and v.retry_after_s == 1
    # room_of: slots and blocks left ≥ 0 (unknown = room)
    assert room_of(0, 0) and room_of(None, None) and not room_of(-1, 50) and not room_of(3, -1)
    assert room_of(2, 10, 0.2, 10.0) and not room_of(2, 9, 0.2, 10.0) and not room_of(0, 50, 0.2, 10.0)


def test_decide_room_from_the_status() -> None:
    # slots left = max_num_seqs − running − waiting − pending − 1: instance 0: 4 − 3 − 1 − 0 − 1 = −1
    # (no room); instance 1: 4 − 1 − 0 − 0 − 1 = 2 ≥ 5 % of 4; blocks: 100 − 10 − 0 − ceil(64 / 16)
    # = 86 ≥ 5 % of 200 on both
    def load(i: int, running: int, waiting: int) -> InstanceLoad:
        return InstanceLoad(i, kv_blocks_free=100, kv_blocks_total=200, num_running=running, num_waiting=waiting,
                            waiting_blocks_needed=10, request_prompt_tokens=64, kv_block_size=16, max_num_seqs=4)

    pol = make_dispatch("power_of_k", kv_reserve_frac=0.0, tie_tolerance_s=0.0)
    loads = [load(0, 3, 1), load(1, 1, 0)]
    d = decide(pol, loads, np.random.default_rng(0), _preds({0: 0.1, 1: 0.5}), SLO_1S, Admission())
    assert d.choice == 1 and d.admission == "headroom"
    d = decide(pol, loads, np.random.default_rng(0), _preds({0: 0.1, 1: 0.5}), SLO_1S,
               Admission(require_room=False))
    assert d.choice == 0


def test_lower_priority_needs_more_room() -> None:
    # one instance: max_num_seqs 20, 17 running → 20 − 17 − 0 − 0 − 1 = 2 slots left; blocks
    # 1000 − 0 − 0 − 4 = 996 of 1000. Reserve = 5 % + 5 % × priority of 20 slots:
    # priority 0 → 1, 1 → 2 (2 ≥ both: admitted), 2 → 3 (> 2: refused)
    ld = [InstanceLoad(0, kv_blocks_free=1000, kv_blocks_total=1000, num_running=17, num_waiting=0,
                       waiting_blocks_needed=0, request_prompt_tokens=64, kv_block_size=16, max_num_seqs=20)]
    pol = make_dispatch("power_of_k", kv_reserve_frac=0.0, tie_tolerance_s=0.0)
    got = [decide(pol, ld, np.random.default_rng(0), _preds({0: 0.1}), RequestSlo(1000.0, None, p),
                  Admission()).refused for p in (0, 1, 2)]
    assert got == [None, None, "slo_ttft_unmeetable"]


def test_bad_admission_settings_name_the_field() -> None:
    with pytest.raises(AstroUserError) as e:
        Admission("hold")
    assert e.value.field == "admission"
    with pytest.raises(AstroUserError) as e:
        Admission("queue", queue_max=0)
    assert e.value.field == "admission_queue_max"
    with pytest.raises(AstroUserError) as e:
        Admission("queue", queue_retry_s=float("inf"))
    assert e.value.field == "admission_queue_retry_s"
    with pytest.raises(AstroUserError):
        Admission(prefer="middle")
    with pytest.raises(AstroUserError):
        Admission(margin_frac=-0.1)
    with pytest.raises(AstroUserError):
        Admission(room_reserve_frac=1.0)
    with pytest.raises(AstroUserError):
        Admission(priority_reserve_frac=-0.1)


# -- decide with admission ----------------------------------------------------------------
def _preds(ttft: dict[int, float]):
    def predict(cands: list[int]) -> dict[int, LatencyEstimate]:
        return {i: LatencyEstimate(ttft[i], ttft[i] + 1.0, 0, 0) for i in cands if i in ttft}
    return predict


def test_decide_prefers_candidates_within_the_slo() -> None:
    pol = make_dispatch("power_of_k", kv_reserve_frac=0.0, tie_tolerance_s=0.0)
    loads = [InstanceLoad(i) for i in range(3)]
    preds = _preds({0: 0.5, 1: 0.95, 2: 0.9})
    slo = RequestSlo(ttft_ms=1000.0)
    # most headroom: the policy's own rule (lowest predicted TTFT) over {0, 2} → 0
    d = decide(pol, loads, np.random.default_rng(0), preds, slo, Admission())
    assert d.choice == 0 and d.refused is None and d.admission == "headroom"
    d = decide(pol, loads, np.random.default_rng(0), preds, slo, Admission(prefer="least"))
    assert d.choice == 2  # 0.9 × 1.1 = 0.99 ≤ 1; 1 (1.045) is excluded
    # unmeetable → refused, with the reason in the decision record
    d = decide(pol, loads, np.random.default_rng(0), preds, RequestSlo(ttft_ms=400.0), Admission())
    assert d.refused == "slo_ttft_unmeetable" and d.retry_after_s == 1  # 0.55 − 0.4 → 1 s
    assert d.to_dict()["refused"] == "slo_ttft_unmeetable"
    # no SLO (or no TTFT target): exactly the policy
    for s in (None, RequestSlo(tpot_ms=50.0)):
        d = decide(pol, loads, np.random.default_rng(0), preds, s, Admission())
        assert d.choice == 0 and d.admission is None and "admission" not in d.to_dict()


def test_policy_without_predictions_is_not_judged() -> None:
    pol = make_dispatch("least_requests")
    loads = [InstanceLoad(0, True, 3), InstanceLoad(1, True, 1)]
    d = decide(pol, loads, np.random.default_rng(0), _preds({}), RequestSlo(ttft_ms=1.0), Admission())
    assert d.choice == 1 and d.refused is None


# -- the SLO parser -----------------------------------------------------------------------
CLASSES = {"interactive": RequestSlo(1000.0, 100.0, 0, "interactive"),
           "batch": RequestSlo(30000.0, None, 5, "batch")}


def test_parse_headers_body_and_classes() -> None:
    assert parse_request_slo({}) is None
    assert parse_request_slo({"x-slo-ttft-ms": "250", "x-slo-tpot-ms": "20"}, 3) == RequestSlo(250.0, 20.0, 3)
    assert parse_request_slo({"x-slo-class": "batch"}, None, CLASSES) == CLASSES["batch"]
    # header overrides the class's value; the body's priority overrides its priority
    assert parse_request_slo({"x-slo-class": "batch", "x-slo-ttft-ms": "5000"}, -1, CLASSES) == \
        RequestSlo(5000.0, None, -1, "batch")
    # a class named like the model
    assert parse_request_slo({}, None, CLASSES, model="interactive") == CLASSES["interactive"]
    assert parse_request_slo({}, None, CLASSES, model="llama") is None


@pytest.mark.parametrize(("headers", "priority", "field"), [
    ({"x-slo-ttft-ms": "fast"}, None, "x-slo-ttft-ms"),
    ({"x-slo-ttft-ms": "-5"}, None, "x-slo-ttft-ms"),
    ({"x-slo-tpot-ms": "inf"}, None, "x-slo-tpot-ms"),
    ({}, "high", "priority"),
    ({}, 1.5, "priority"),
    ({}, True, "priority"),
    ({"x-slo-class": "gold"}, None, "x-slo-class"),
])
def test_bad_slo_values_name_the_header(headers, priority, field) -> None:
    with pytest.raises(AstroUserError) as e:
        parse_request_slo(headers, priority, CLASSES)
    assert e.value.field == field


def test_recipe_class() -> None:
    assert parse_slo_class({"ttft_ms": 1000, "tpot_ms": 100, "priority": 0}, "interactive") == CLASSES["interactive"]
    with pytest.raises(AstroUserError) as e:
        parse_slo_class({"ttft": 1000}, "x")
    assert "scheduler.slo_classes.x" in e.value.field


# -- the virtual cluster ------------------------------------------------------------------
def test_virtual_request_that_cannot_meet_its_slo_is_refused() -> None:
    # One instance. r0 (400 tok, 3 out) runs 0–0.05; r1 (100 tok) arrives at 0.01 and its
    # predicted (and true) TTFT is 0.0601 s (test_virtual_cluster). × 1.1 = 0.06611 s:
    # a 65 ms target is refused, a 70 ms one admitted.
    def run(ttft_ms: float | None, admission: Admission | None = DEFAULT_ADMISSION):
        slo = None if ttft_ms is None else RequestSlo(ttft_ms, None, 0, "interactive")
        reqs = [TimedRequest("r0", 0.0, 400, 3), TimedRequest("r1", 0.01, 100, 2, slo=slo)]
        return simulate_cluster(reqs, 1, make_dispatch("power_of_k", k=1), HAND, CFG, None,
                                np.random.default_rng(0), admission=admission)

    refused = run(65.0).records[1]
    assert refused.refused == "slo_ttft_unmeetable" and refused.instance == -1
    assert refused.first_token_s is None and refused.slo_class == "interactive"
    ok = run(70.0).records[1]
    assert ok.refused is None and ok.ttft_s == pytest.approx(0.0601, abs=1e-12)
    # admission off / no SLO: dispatched as before
    assert run(65.0, Admission("off")).records[1].ttft_s == pytest.approx(0.0601, abs=1e-12)
    def strip(res):
        return [{k: v for k, v in r.to_dict().items() if k != "decide_us"} for r in res.records]
    assert strip(run(None)) == strip(run(None, None))


def test_virtual_headroom_rule() -> None:
    # Two instances. r0 (400 tok, 50 out) goes to one at 0; r1 (100 tok) at 0.001:
    # loaded instance TTFT = 0.05 + 0.0201 − 0.001 = 0.0691 s, idle one 0.02 s.
    # Target 100 ms, margin 0: both meet it; "least" headroom picks the loaded one,
    # "most" the idle one. Target 50 ms: only the idle one.
    def run(ttft_ms: float, prefer: str):
        reqs = [TimedRequest("r0", 0.0, 400, 50),
                TimedRequest("r1", 0.001, 100, 2, slo=RequestSlo(ttft_ms))]
        res = simulate_cluster(reqs, 2, make_dispatch("power_of_k"), HAND, CFG, None, np.random.default_rng(1),
                               admission=Admission(margin_frac=0.0, prefer=prefer))
        return res.records[0].instance, res.records[1]

    loaded, r1 = run(100.0, "least")
    assert r1.instance == loaded and r1.predicted_ttft_s == pytest.approx(0.0691, abs=1e-12)
    loaded, r1 = run(100.0, "most")
    assert r1.instance == 1 - loaded and r1.ttft_s == pytest.approx(0.02, abs=1e-12)
    loaded, r1 = run(50.0, "least")
    assert r1.instance == 1 - loaded


# -- entry points: astro serve scheduler / epp flags, the recipe -------------------------
def test_scheduler_flags_and_recipe_carry_admission_and_classes() -> None:
    from rps_astro_cli.cli.serve import DispatchFlags, _scheduler_settings
    from rps_astro_cli.services.config import parse_config

    kw = {"engine": ["http://e:1"], "predictor": ["http://p:1"]}
    s = _scheduler_settings(DispatchFlags(**kw, admission="off", slo_class=[
        "interactive:ttft_ms=1000,tpot_ms=100,priority=0", "batch:ttft_ms=30000,priority=1"]),
        decisions_kept=1, max_body_bytes=100, api_key=None)
    assert s.admission == "off" and s.slo_classes == CLASSES | {"batch": RequestSlo(30000.0, None, 1, "batch")}
    assert _scheduler_settings(DispatchFlags(**kw), decisions_kept=1, max_body_bytes=100,
                               api_key=None).admission == "reject"
    assert _scheduler_settings(DispatchFlags(**kw, admission="queue"), decisions_kept=1, max_body_bytes=100,
                               api_key=None).admission == "queue"
    for bad, field in ((dict(admission="hold"), "--admission"), (dict(slo_class=["x:ttft=1"]), "--slo-class"),
                       (dict(slo_class=["x:ttft_ms=-1"]), "--slo-class")):
        with pytest.raises(AstroUserError) as e:
            _scheduler_settings(DispatchFlags(**kw, **bad), decisions_kept=1, max_body_bytes=100, api_key=None)
        assert e.value.field == field
    cfg = parse_config({"instances": 2, "scheduler": {"admission": "off", "slo_classes": {
        "gold": {"ttft_ms": 500, "priority": 0}}}}, "recipe x")
    assert cfg.scheduler.admission == "off"
    assert cfg.scheduler.slo_class_map() == {"gold": RequestSlo(500.0, None, 0, "gold")}
    with pytest.raises(AstroUserError) as e:
        parse_config({"instances": 2, "scheduler": {"slo_classes": {"gold": {"ttft": 500}}}}, "recipe x")
    assert e.value.field == "scheduler.slo_classes"


# -- queue mode: the router queue (hand-computed) -----------------------------------------
def test_queue_mode_waits_only_when_in_time_but_without_room() -> None:
    from rps_astro_cli.dispatch.admission import NO_ROOM

    q = Admission("queue")
    # 0.1 s × 1.1 meets 1 s but neither has room: wait for room
    v = judge(SLO_1S, [0, 1], {0: 0.1, 1: 0.5}, q, {0: False, 1: False})
    assert not v.admit and v.reason == NO_ROOM
    # no prediction meets it: waiting cannot help (the look-ahead counts the queue ahead)
    v = judge(SLO_1S, [0, 1], {0: 2.0, 1: 3.5}, q, {0: True, 1: True})
    assert not v.admit and v.reason == "slo_ttft_unmeetable" and v.retry_after_s == 2
    # room somewhere: admitted as in reject mode
    assert judge(SLO_1S, [0, 1], {0: 0.1, 1: 0.5}, q, {0: False, 1: True}).feasible == (1,)


def test_router_queue_order_and_shedding() -> None:
    from rps_astro_cli.dispatch.admission import RouterQueue, remaining_slo

    rq = RouterQueue(3)
    assert rq.offer("batch-late", 1, 30.0) is None
    assert rq.offer("inter-late", 0, 5.0) is None
    assert rq.offer("inter-early", 0, 2.0) is None
    # full: a priority-1 arrival with a later deadline than the held one is the least important
    assert rq.offer("batch-later", 1, 40.0) == "batch-later"
    # a priority-0 arrival sheds the held priority-1 one
    assert rq.offer("inter-mid", 0, 3.0) == "batch-late"
    assert rq.take_all() == ["inter-early", "inter-mid", "inter-late"] and len(rq) == 0
    # what is left of a 1,000 ms target 0.25 s after arrival; nothing left after 1 s
    assert remaining_slo(SLO_1S, 10.0, 10.25).ttft_ms == pytest.approx(750.0)
    assert remaining_slo(SLO_1S, 10.0, 11.0) is None


def test_virtual_queue_mode_dispatches_when_room_appears() -> None:
    # One instance with 2 batch slots. r0 (400 tok, 3 out): prefill 0–0.05, decodes
    # 0.05–0.0601–0.0702 (10 ms + 0.1 ms/token). r1 (100 tok) arrives at 0.01: r0 holds
    # one slot, so 2 − 1 − 1 = 0 slots would be left, under the 5 % reserve: no room.
    # Its predicted TTFT meets the target, so "queue" holds it; retries at 0.06 (r0 still
    # running) and 0.11 (done): dispatched at 0.11, prefill alone 10 + 0.1 × 100 = 20 ms,
    # TTFT = 0.13 − 0.01 = 0.12 s. With an 80 ms target what is left at 0.11 is < 0:
    # refused. "reject" refuses it at once.
    cfg = InstanceConfig(block_size=16, num_gpu_blocks=1000, max_num_seqs=2, max_num_batched_tokens=512,
                         max_model_len=4096)

    def run(ttft_ms: float, mode: str):
        reqs = [TimedRequest("r0", 0.0, 400, 3), TimedRequest("r1", 0.01, 100, 2, slo=RequestSlo(ttft_ms))]
        return simulate_cluster(reqs, 1, make_dispatch("power_of_k"), HAND, cfg, None, np.random.default_rng(0),
                                admission=Admission(mode)).records[1]

    r1 = run(500.0, "queue")
    assert r1.refused is None and r1.arrival_s == 0.01 and r1.dispatch_s == pytest.approx(0.11, abs=1e-12)
    assert r1.ttft_s == pytest.approx(0.12, abs=1e-12)
    late = run(80.0, "queue")
    assert late.refused == "slo_ttft_unmeetable" and late.first_token_s is None and late.arrival_s == 0.01
    assert run(500.0, "reject").refused == "slo_ttft_unmeetable"


def test_virtual_queue_mode_sheds_the_less_important_first() -> None:
    # as above, with a router queue of one: r1 (priority 1) is held, r2 (priority 0)
    # arrives at 0.02 and takes its place: r1 is refused as shed; r2 is decided again at
    # the queue's next turns, 0.06 (r0 running) and 0.11 (room): dispatched at 0.11
    cfg = InstanceConfig(block_size=16, num_gpu_blocks=1000, max_num_seqs=2, max_num_batched_tokens=512,
                         max_model_len=4096)
    reqs = [TimedRequest("r0", 0.0, 400, 3),
            TimedRequest("r1", 0.01, 100, 2, slo=RequestSlo(500.0, None, 1)),
            TimedRequest("r2", 0.02, 100, 2, slo=RequestSlo(500.0, None, 0))]
    res = simulate_cluster(reqs, 1, make_dispatch("power_of_k"), HAND, cfg, None, np.random.default_rng(0),
                           admission=Admission("queue", queue_max=1))
    r1, r2 = res.records[1], res.records[2]
    assert r1.refused == "router_queue_full" and r1.dispatch_s == 0.02
    assert r2.refused is None and r2.dispatch_s == pytest.approx(0.11, abs=1e-12)
