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
