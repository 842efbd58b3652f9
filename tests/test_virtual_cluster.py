"""Virtual-time cluster simulation (issue 2 §6): hand-computed records on a hand-made
profile (step = 10 ms + 0.1 ms per token), determinism, prediction-guided dispatch."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from conftest import linear_profile
from rps_astro_cli.cluster import TimedRequest, simulate_cluster
from rps_astro_cli.dispatch import make_dispatch
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.types import InstanceConfig

HAND = linear_profile()
CFG = InstanceConfig(block_size=16, num_gpu_blocks=1000, max_num_seqs=48, max_num_batched_tokens=512,
                     max_model_len=4096)


def test_two_instances_round_robin_hand_computed() -> None:
    reqs = [
        TimedRequest("r0", 0.0, 100, 2),
        TimedRequest("r1", 0.0, 200, 1),
        TimedRequest("r2", 0.005, 50, 3),
        TimedRequest("r3", 0.1, 10, 1, preprocess_s=0.02),
    ]
    res = simulate_cluster(reqs, 2, make_dispatch("round_robin"), HAND, CFG, None, np.random.default_rng(0))
    rec = {r.request_id: r for r in res.records}
    assert [r.request_id for r in res.records] == ["r0", "r1", "r2", "r3"]
    assert [rec[k].instance for k in ("r0", "r1", "r2", "r3")] == [0, 1, 0, 1]
    # instance 0: step @0: r0 prefill 100 tok -> 0.02 (r0 token 1); r2 arrives mid-step.
    #   step @0.02: r0 decode + r2 50 = 51 tok -> 0.0151, ends 0.0351 (r0 done, r2 token 1)
    #   steps @0.0351, @0.0452: r2 decodes 0.0101 each -> r2 done at 0.0553.
    assert rec["r0"].first_token_s == pytest.approx(0.02, abs=1e-12)
    assert rec["r0"].finish_s == pytest.approx(0.0351, abs=1e-12)
    assert rec["r2"].first_scheduled_s == pytest.approx(0.02, abs=1e-12)
    assert rec["r2"].ttft_s == pytest.approx(0.0301, abs=1e-12)
    assert rec["r2"].e2e_s == pytest.approx(0.0503, abs=1e-12)
    # instance 1: r1 200 tok -> 0.03, its only token. r3 arrives 0.1, preprocessing 0.02,
    #   enqueued at 0.12, 10 tok -> 0.011: done at 0.131 (TTFT = E2E = 0.031 from arrival).
    assert rec["r1"].e2e_s == pytest.approx(0.03, abs=1e-12)
    assert rec["r3"].enqueue_s == pytest.approx(0.12, abs=1e-12)
    assert rec["r3"].ttft_s == pytest.approx(0.031, abs=1e-12) and rec["r3"].e2e_s == pytest.approx(0.031, abs=1e-12)
    assert res.steps_per_instance == [4, 2]
    assert res.requests_per_instance == [2, 2]
    assert res.preemptions_per_instance == [0, 0]
    assert res.makespan_s == pytest.approx(0.131, abs=1e-12)
    assert all(r.predicted_e2e_s is None for r in res.records)  # round-robin does not predict


def test_preemptions_are_counted_per_instance() -> None:
    # One instance with 6 blocks: three 32-token prompts fill it; the second step preempts
    # the last one (see test_instance_model); counted once.
    cfg = InstanceConfig(block_size=16, num_gpu_blocks=6, max_num_seqs=48, max_num_batched_tokens=512,
                         max_model_len=96)
    reqs = [TimedRequest("A", 0.0, 32, 10), TimedRequest("B", 0.0, 32, 10), TimedRequest("C", 0.0, 32, 3)]
    res = simulate_cluster(reqs, 1, make_dispatch("round_robin"), HAND, cfg, None, np.random.default_rng(0))
    rec = {r.request_id: r for r in res.records}
    assert res.preemptions_per_instance == [1]
    assert [rec[k].num_preemptions for k in "ABC"] == [0, 0, 1]
    assert rec["C"].finish_s == pytest.approx(0.1348, abs=1e-12)


def test_busy_instance_prediction_is_shifted_to_arrival() -> None:
    # One instance. r0 (400 tok, 3 out) starts at 0: 400 tok -> 0.05. r1 (100 tok, 2 out)
    # arrives at 0.01 while that step runs. Look-ahead from the step's end (0.05):
    # r0 decode + r1 100 = 101 tok -> 0.0201 (r1 token 1 at 0.0701), then both decode
    # 0.0102 -> 0.0803 (r1 done). From arrival: TTFT 0.0601, E2E 0.0703 — also what happens.
    reqs = [TimedRequest("r0", 0.0, 400, 3), TimedRequest("r1", 0.01, 100, 2)]
    res = simulate_cluster(reqs, 1, make_dispatch("power_of_k", k=1), HAND, CFG, None, np.random.default_rng(0))
    r1 = res.records[1]
    assert r1.predicted_ttft_s == pytest.approx(0.0601, abs=1e-12)
    assert r1.predicted_e2e_s == pytest.approx(0.0703, abs=1e-12)
    assert r1.ttft_s == pytest.approx(0.0601, abs=1e-12) and r1.e2e_s == pytest.approx(0.0703, abs=1e-12)
    assert r1.decide_us > 0


def test_prediction_sees_a_request_still_in_preprocessing() -> None:
    # One instance. r0 (image, 400 tok, 3 out) is dispatched at 0 and spends 0.2 s in
    # preprocessing; r1 (text, 300 tok, 3 out) arrives at 0.19: prefill 0.19–0.23 (300 tok
    # → 0.04). r0 joins the queue at 0.2, so the next step is r1's decode + r0's 400-token
    # prefill (0.0501 → 0.2801), then both decode (0.0102 → 0.2903): r1's E2E 0.1003 s.
    # The look-ahead at 0.19 must count r0 (seeing only the empty queue it would say
    # 0.04 + 2 × 0.0101 = 0.0602).
    reqs = [TimedRequest("r0", 0.0, 400, 3, modality="image", vision_tokens=300, preprocess_s=0.2),
            TimedRequest("r1", 0.19, 300, 3)]
    res = simulate_cluster(reqs, 1, make_dispatch("power_of_k", k=1), HAND, CFG, None, np.random.default_rng(0))
    r1 = res.records[1]
    assert r1.ttft_s == pytest.approx(0.04, abs=1e-12) and r1.e2e_s == pytest.approx(0.1003, abs=1e-12)
    assert r1.predicted_ttft_s == pytest.approx(0.04, abs=1e-12)
    assert r1.predicted_e2e_s == pytest.approx(0.1003, abs=1e-12)


def test_prediction_guided_dispatch_avoids_the_loaded_instance() -> None:
    # r0 is long (400 prompt, 50 out); r1 arrives 1 ms later and must go to the idle
    # instance, where its predicted (and actual) E2E is 0.02 + 0.0101 = 0.0301.
    reqs = [TimedRequest("r0", 0.0, 400, 50), TimedRequest("r1", 0.001, 100, 2)]
    for seed in range(3):
        res = simulate_cluster(reqs, 2, make_dispatch("power_of_k", k="all"), HAND, CFG, None,
                               np.random.default_rng(seed))
        r0, r1 = res.records
        assert r1.instance != r0.instance
        assert r1.predicted_e2e_s == pytest.approx(0.0301, abs=1e-12)
        assert r1.e2e_s == pytest.approx(0.0301, abs=1e-12)


def _workload(n: int, seed: int) -> list[TimedRequest]:
    g = np.random.default_rng(seed)
    t = np.cumsum(g.exponential(0.02, n))
    return [TimedRequest(f"q{i}", float(t[i]), int(g.integers(1, 300)), int(g.integers(1, 200)),
                         predicted_output_tokens=int(g.integers(1, 200))) for i in range(n)]


def test_deterministic_for_a_seed() -> None:
    reqs = _workload(150, 1)

    def run(seed: int, policy: str):
        res = simulate_cluster(reqs, 3, make_dispatch(policy), HAND, CFG, None, np.random.default_rng(seed))
        return [replace(r, decide_us=0.0) for r in res.records]

    a, b = run(7, "random"), run(7, "random")
    assert a == b
    assert [r.instance for r in run(8, "random")] != [r.instance for r in a]
    p1, p2 = run(3, "power_of_k"), run(3, "power_of_k")
    assert p1 == p2
    assert all(r.finish_s is not None and r.finish_s >= r.first_token_s >= r.arrival_s for r in p1)
    assert sum(r.output_tokens for r in p1) == sum(r.output_tokens for r in reqs)


def test_bad_input_names_the_field() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(AstroUserError, match="max_model_len"):
        simulate_cluster([TimedRequest("x", 0.0, 4000, 200)], 1, make_dispatch("round_robin"), HAND, CFG, None, rng)
    with pytest.raises(AstroUserError, match="num_instances"):
        simulate_cluster([], 0, make_dispatch("round_robin"), HAND, CFG, None, rng)
    with pytest.raises(AstroUserError, match="rng"):
        simulate_cluster([], 1, make_dispatch("round_robin"), HAND, CFG, None, None)
    with pytest.raises(AstroUserError, match="output_tokens"):
        simulate_cluster([TimedRequest("x", 0.0, 10, 0)], 1, make_dispatch("round_robin"), HAND, CFG, None, rng)


def test_read_length_trace_and_simulate_cli(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app
    from rps_astro_cli.cluster import read_length_trace

    trace = tmp_path / "t.csv"
    trace.write_text("Timestamp,Model,Request tokens,Response tokens\n0,x,20,5\n1,x,30,0\n2,x,40,7\n")
    assert read_length_trace(trace).tolist() == [[20, 5], [40, 7]]  # failed row (0 reply) dropped
    out = tmp_path / "rec.jsonl"
    r = CliRunner().invoke(app, ["simulate", "--path", str(trace), "-n", "5", "--instances", "2",
                                 "--request-rate", "50", "--policy", "round_robin", "--out", str(out)])
    assert r.exit_code == 0, r.output
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [x["prompt_tokens"] for x in recs] == [20, 40, 20, 40, 20]
    assert [x["instance"] for x in recs] == [0, 1, 0, 1, 0]
    assert all(x["finish_s"] >= x["first_token_s"] >= x["arrival_s"] for x in recs)
    bad = CliRunner().invoke(app, ["simulate", "--path", str(trace), "--request-rate", "0", "--out", str(out)])
    assert bad.exit_code == 2 and "--request-rate" in bad.output


def test_simulate_dataset_needs_the_data_folder(tmp_path) -> None:
    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app

    help_text = " ".join(CliRunner().invoke(app, ["simulate", "--help"], env={"COLUMNS": "200"}).output.split())
    assert "Shipped" not in help_text and "sample-data folder" in help_text
    r = CliRunner().invoke(app, ["simulate", "--dataset", "azure-conv", "--out", str(tmp_path / "r.jsonl")],
                           env={"ASTRO_DATA_DIR": str(tmp_path / "absent")})
    assert r.exit_code == 2 and "ASTRO_DATA_DIR" in r.output and "--dataset azure-conv" in r.output
    empty = tmp_path / "empty"
    empty.mkdir()
    r = CliRunner().invoke(app, ["simulate", "--dataset", "azure-conv", "--out", str(tmp_path / "r.jsonl")],
                           env={"ASTRO_DATA_DIR": str(empty)})
    assert r.exit_code == 2 and "missing from the sample-data folder" in r.output
