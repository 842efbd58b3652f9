"""Virtual target: multimodal request pricing, too-long requests, prediction noise."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import write_profile
from rps_astro_cli.bench.config import BenchConfig
from rps_astro_cli.bench.media import MediaItem
from rps_astro_cli.bench.virtual import NoisyDispatch, VirtualTarget
from rps_astro_cli.bench.workload_base import BenchRequest, Workload
from rps_astro_cli.dispatch.base import DispatchPolicy
from rps_astro_cli.sim.profile import ExecutionProfile, VisionCosts
from rps_astro_cli.types import DispatchDecision, InstanceLoad, LatencyEstimate


def hand_profile(tmp_path):
    prof = ExecutionProfile("mm", "m", "g", 1, base_s=0.01, per_seq_s=0.0, token_knots=(0, 10_000),
                            token_s=(0.0, 1.0), decode_attn_s_per_ctx_token=0.0,
                            prefill_attn_s_per_token_pair=0.0, max_model_len=2048,
                            vision=VisionCosts(tokens_per_image=500, tokens_per_frame=100,
                                               preprocess_s_per_image=0.2, preprocess_s_per_frame=0.05,
                                               encoder_s_per_image=0.03, encoder_s_per_frame=0.01))
    return Path(write_profile(tmp_path, prof, "mm.json"))


def test_virtual_requests_price_media_and_fail_too_long(tmp_path):
    reqs = [BenchRequest("t", "hi", 10, 5),
            BenchRequest("i", "look", 20, 5, "image", (MediaItem("image", stand_in=True),)),
            BenchRequest("v", "watch", 30, 5, "video", (MediaItem("video", stand_in=True, num_frames=8),)),
            BenchRequest("long", "x", 2000, 100)]
    cfg = BenchConfig.flat(virtual=True, profile=str(hand_profile(tmp_path)), oracle_lengths=True)
    tgt = VirtualTarget(cfg, Workload("w", reqs, "test"), len)
    vreqs, failed = tgt.virtual_requests([0.0, 1.0, 2.0, 3.0])
    by = {v.request_id: v for v in vreqs}
    assert (by["t"].prompt_tokens, by["t"].vision_tokens, by["t"].req_class) == (10, 0, "sand")
    # image: 20 + 500 vision tokens, encoder 0.03 s, preprocess 0.2 s, pebbles
    assert (by["i"].prompt_tokens, by["i"].encoder_s,
            by["i"].preprocess_s, by["i"].req_class) == (520, 0.03, 0.2, "pebbles")
    # video: 30 + 8 × 100 tokens, encoder 8 × 0.01, preprocess 8 × 0.05, rocks
    assert by["v"].prompt_tokens == 830 and by["v"].encoder_s == pytest.approx(0.08)
    assert by["v"].preprocess_s == pytest.approx(0.4) and by["v"].req_class == "rocks"
    assert [f.request_id for f in failed] == ["long"] and not failed[0].success and "max_model_len" in failed[0].error


class _Capture(DispatchPolicy):
    name = "capture"
    inputs = frozenset({"predictions"})

    def choose(self, loads, candidates, predictions, rng):
        self.seen = dict(predictions)
        return DispatchDecision(self.name, tuple(candidates), candidates[0], "first")


def test_prediction_noise_multiplies_each_prediction():
    inner = _Capture()
    pol = NoisyDispatch(inner, 0.5, np.random.default_rng(5))
    preds = {0: LatencyEstimate(1.0, 10.0, 0, 0), 1: LatencyEstimate(2.0, 20.0, 0, 0)}
    pol.choose([InstanceLoad(0), InstanceLoad(1)], [0, 1], preds, np.random.default_rng(0))
    z = np.random.default_rng(5).standard_normal(4)  # the same draws, in order
    f = [max(0.0, 1 + 0.5 * x) for x in z]
    assert inner.seen[0].ttft_s == pytest.approx(1.0 * f[0]) and inner.seen[0].e2e_s == pytest.approx(10.0 * f[1])
    assert inner.seen[1].ttft_s == pytest.approx(2.0 * f[2]) and inner.seen[1].e2e_s == pytest.approx(20.0 * f[3])
    assert "predictions" in pol.inputs and pol.describe()["prediction_noise_sigma"] == 0.5


def test_prediction_noise_keeps_the_inner_policys_needs():
    # the virtual cluster fills what the policy it holds needs: the wrapper must say
    # what the wrapped one needs
    from rps_astro_cli.dispatch import make_dispatch

    for params in ({"kv_reserve_frac": 0.0, "tie_tolerance_s": 0.0}, {}):
        inner = make_dispatch("power_of_k", **params)
        pol = NoisyDispatch(inner, 0.5, np.random.default_rng(5))
        assert pol.inputs == inner.inputs and "predictions" in pol.inputs, params


def test_objective_reaches_power_of_k_only(tmp_path):
    reqs = [BenchRequest("t", "hi", 10, 5)]
    cfg = BenchConfig.flat(virtual=True, profile=str(hand_profile(tmp_path)), oracle_lengths=True, objective="ttft")
    tgt = VirtualTarget(cfg, Workload("w", reqs, "test"), len)
    tgt.use_policy("power_of_k", "2")
    assert tgt.make_dispatch(np.random.default_rng(0)).describe() == {"name": "power_of_k", "k": 2, "objective": "ttft",
                                                                 "pin_cached": True, "kv_reserve_frac": 0.1,
                                                                 "tie_tolerance_s": 0.02}
    tgt.use_policy("llumnix", None)  # no objective to set: left alone
    assert tgt.make_dispatch(np.random.default_rng(0)).name == "llumnix"


def test_report_folder_for_a_multimodal_sweep(tmp_path):
    from rps_astro_cli.bench.runner import run_bench

    prof = hand_profile(tmp_path)
    out = tmp_path / "rep"
    res = run_bench(BenchConfig.flat(virtual=True, profile=str(prof), instances=2, workload="mix-mh", num_requests=20,
                                max_frames=2, rates=[1.0, 2.0], policies=["round_robin"], oracle_lengths=True,
                                slo_scale=5.0, out_dir=str(out)))
    assert res.exit_code == 0 and len(res.runs) == 2
    groups = set(res.runs[0].metrics)
    assert groups == {"overall", "sand", "pebbles", "rocks"}
    md = (out / "report.md").read_text()
    assert "| round_robin @ poisson 1 req/s | rocks |" in md
    html = (out / "report.html").read_text()
    for title in ("Latency CDFs", "Latency vs request rate", "Per-class latency"):
        assert f"<h2>{title}</h2>" in html
    rows = (out / "requests.jsonl").read_text().splitlines()
    assert len(rows) == 40  # 20 requests × 2 runs
