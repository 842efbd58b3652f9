"""The RPS-Serve testbed (issue 15): the recipe's engine limits reach the virtual cluster,
LLaVA-OneVision's AnyRes image tokens, the harness's frames-by-duration rule, and
`--instance-policies` (one run per policy, `instance_policy` in each run)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from rps_astro_cli.bench.workloads_chat import VIDEO_CAPTION_TOKENS, _draw_caption_tokens, frames_for_duration
from rps_astro_cli.cli.main import app
from rps_astro_cli.services.config import load_recipe
from rps_astro_cli.sim.profile import anyres_tokens, load_profile


@pytest.mark.parametrize("size,tokens", [
    ((640, 480), 2929),  # the authors' most common record (testbed note); by hand: grid 2×2 → 54×54
                         # patches, cropped to 40×54 = 2,160 + 40 newlines + 729 base
    ((500, 375), 1728),  # the recorded minimum: grid 1×2 → 27×54 cropped to 27×36 = 972 + 27 + 729
    ((640, 640), 3699),  # the recorded maximum: grid 2×2 uncropped 54×54 = 2,916 + 54 + 729
])
def test_anyres_tokens_match_the_authors_records(size, tokens):
    assert anyres_tokens(*size) == tokens
    assert load_profile("llava-onevision-7b-a100-testbed").vision.image_tokens(*size) == tokens


def test_fixed_rule_profiles_keep_their_tokens_per_image():
    v = load_profile("llava-onevision-7b-a100").vision
    assert v.image_tokens(640, 480) == 729 and v.video_tokens(32) == 32 * 196


def test_frames_scale_linearly_with_duration():
    assert frames_for_duration(1.0) == 8 and frames_for_duration(180.0) == 32
    assert frames_for_duration(90.5) == 20  # 8 + 24 × 89.5 / 179 = 20
    assert frames_for_duration(600.0) == 32 and frames_for_duration(180.0, max_frames=16) == 16


def test_caption_replies_stay_in_the_recorded_range():
    rng = np.random.default_rng(0)
    x = np.array([_draw_caption_tokens(rng) for _ in range(4000)])
    assert x.min() >= VIDEO_CAPTION_TOKENS["min"] and x.max() <= VIDEO_CAPTION_TOKENS["max"]
    assert abs(x.mean() - 700) < 30  # recorded mean ≈ 700


def test_recipes_carry_the_harness_limits():
    for name, blocks in (("rps-serve-testbed", 2048), ("rps-serve-testbed-50", 1024), ("rps-serve-testbed-25", 512)):
        e = load_recipe(name).engine
        assert (e.num_gpu_blocks, e.max_num_batched_tokens, e.max_num_seqs, e.chunked_prefill) == (blocks, 32768,
                                                                                                  256, True)
        assert e.max_model_len == min(32768, blocks * 16)


def _bench(*args: str) -> dict:
    res = CliRunner().invoke(app, ["bench", "--virtual", "--no-report", "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_bench_virtual_recipe_and_instance_policies():
    rep = _bench("--recipe", "rps-serve-testbed-50", "-w", "mix-mh", "-n", "40", "--request-rate", "2",
                 "--instance-policies", "fcfs,rps", "--seed", "2")
    t = rep["target"]
    assert t["recipe"] == "rps-serve-testbed-50" and t["profile"] == "llava-onevision-7b-a100-testbed"
    assert t["engine_limits"]["num_gpu_blocks"] == 1024 and t["engine_limits"]["max_num_batched_tokens"] == 32768
    assert t["instances"] == 1
    assert [r["instance_policy"] for r in rep["runs"]] == ["fcfs", "rps"]
    assert all(r["policy"] == "round_robin" for r in rep["runs"])  # the recipe's dispatch policy
    # same traffic for both: the same requests finish under each policy
    n = [r["metrics"]["overall"]["num_requests"] for r in rep["runs"]]
    assert n == [40, 40]


def test_recipe_needs_virtual():
    res = CliRunner().invoke(app, ["bench", "--recipe", "rps-serve-testbed", "--base-url", "http://127.0.0.1:9"])
    assert res.exit_code == 2 and "--recipe" in res.output and "Traceback" not in res.output


def test_instance_param_must_be_declared_by_some_policy():
    res = CliRunner().invoke(app, ["bench", "--virtual", "--no-report", "-n", "4", "--instance-policies", "fcfs",
                                   "--instance-param", "classifier=naive"])
    assert res.exit_code == 2 and "--instance-param classifier" in res.output


# -- the harness's TTFT and its single front end (issue 15) ------------------------------------
def _two_on_one_front_end(slots):
    """A video (0.2 s preprocessing) then, 0.05 s later, a text request, on one instance."""
    from rps_astro_cli.cluster.virtual import simulate_cluster
    from rps_astro_cli.cluster.workload import TimedRequest
    from rps_astro_cli.dispatch import make_dispatch

    reqs = [TimedRequest("v", 0.0, 1000, 2, modality="video", vision_tokens=900, preprocess_s=0.2),
            TimedRequest("t", 0.05, 10, 2)]
    return simulate_cluster(reqs, 1, make_dispatch("round_robin"), load_profile("llava-onevision-7b-a100-testbed"),
                            rng=np.random.default_rng(0), preprocess_slots=slots).records


def test_one_front_end_slot_makes_text_wait_behind_a_video_preprocessing():
    v, t = _two_on_one_front_end(1)
    # by hand: the video holds the only slot 0 → 0.2 s; the text, sent at 0.05 s, starts (and,
    # with no preprocessing of its own, ends) its input processing at 0.2 s
    assert v.preprocess_start_s == 0.0 and v.enqueue_s == pytest.approx(0.2)
    assert t.preprocess_start_s == pytest.approx(0.2) and t.enqueue_s == pytest.approx(0.2)
    v2, t2 = _two_on_one_front_end(None)  # default: each on its own, at once
    assert t2.preprocess_start_s == 0.05 and t2.enqueue_s == 0.05 and v2.enqueue_s == pytest.approx(0.2)


def test_harness_ttft_leaves_out_the_wait_for_the_front_end():
    from rps_astro_cli.bench.metrics import group_metrics
    from rps_astro_cli.bench.records import RequestRecord

    # sent at 1.0, its own input processing starts at 1.3 (0.3 s behind another's), first token at 2.0
    r = RequestRecord("a", sent_s=1.0, engine_arrival_s=1.3, first_token_s=2.0, finish_s=3.0, output_tokens=5,
                      success=True)
    assert r.ttft_s == pytest.approx(1.0) and r.ttft_harness_s == pytest.approx(0.7)
    m = group_metrics([r])
    assert m.ttft_harness_s.mean == pytest.approx(0.7) and m.ttft_s.mean == pytest.approx(1.0)
    assert group_metrics([RequestRecord("b", sent_s=0, first_token_s=1, finish_s=2, output_tokens=2,
                                        success=True)]).ttft_harness_s is None  # live: unknown


def test_rps_waiting_preemption_takes_kv_from_a_lower_priority_running_request():
    from rps_astro_cli.policies.rps import RPSPolicy
    from rps_astro_cli.sim.instance import InstanceSim
    from rps_astro_cli.sim.latency import LatencyModel
    from rps_astro_cli.sim.request import SimRequest
    from rps_astro_cli.types import InstanceConfig

    prof = load_profile("llava-onevision-7b-a100-testbed")
    cfg = InstanceConfig(block_size=16, num_gpu_blocks=10, max_num_seqs=8, max_num_batched_tokens=4096,
                         max_model_len=160, enable_prefix_caching=False)
    for flag, expect_victim in ((False, False), (True, True)):
        sim = InstanceSim(cfg, LatencyModel(prof), RPSPolicy(preempt_waiting=flag))
        rock = SimRequest("rock", 0.0, 120, 30, modality="video", req_class="rocks")  # 8 of 10 blocks
        sim.add(rock)
        sim.step(0.0)
        assert sim.free_blocks == 2
        # a pebble arrives at 1 s needing 4 blocks; at 2 s (waited 1 s) its P = 0.05 + 1 − e^(−0.003) ≈ 0.053
        # beats the rock's (waited 2 s) P = 1 − e^(−0.00075 · 2^1.1) ≈ 0.0016
        peb = SimRequest("peb", 1.0, 60, 5, modality="image", req_class="pebbles")
        sim.add(peb)
        res = sim.step(2.0)
        assert (rock in res.preempted) is expect_victim
        assert (peb in sim.running) is expect_victim and (rock in sim.running) is not expect_victim


def test_bench_virtual_recipe_runs_its_dispatch_policy_as_serve_would():
    # recipes/astrolabe-llama2-7b-a30.yaml: power_of_k, k 2, objective e2e, params kv_reserve_frac 0,
    # tie_tolerance_s 0 (the paper's Po2) — a virtual run takes them unless a flag says otherwise
    rep = _bench("--recipe", "astrolabe-llama2-7b-a30", "-n", "6", "--request-rate", "4", "--oracle-lengths")
    d = rep["runs"][0]["extras"]["dispatch_policy"]
    assert (d["name"], d["k"], d["objective"], d["kv_reserve_frac"], d["tie_tolerance_s"]) == ("power_of_k", 2, "e2e",
                                                                                              0.0, 0.0)
    rep = _bench("--recipe", "astrolabe-llama2-7b-a30", "-n", "6", "--request-rate", "4", "--oracle-lengths",
                 "--objective", "ttft", "--k", "all")
    d = rep["runs"][0]["extras"]["dispatch_policy"]
    assert (d["k"], d["objective"], d["kv_reserve_frac"]) == ("all", "ttft", 0.0)  # flags win; params kept
    rep = _bench("--recipe", "astrolabe-llama2-7b-a30", "-n", "6", "--request-rate", "4", "--policies", "round_robin")
    assert rep["runs"][0]["extras"]["dispatch_policy"] == {"name": "round_robin"}
