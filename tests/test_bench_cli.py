"""`astro bench` command line: one-line errors for bad arguments, a virtual run on a
hand-made profile with hand-computed latencies, sweeps, capacity and exit codes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rps_astro_cli.cli.main import app

runner = CliRunner()

# step = 10 ms + 0.1 ms per token; no per-sequence or attention terms
PROFILE = {"profile_id": "hand", "model": "m", "gpu": "g", "tp": 1,
           "coefficients": {"base_s": 0.010, "per_seq_s": 0.0, "token_knots": [0, 10000], "token_s": [0.0, 1.0],
                            "decode_attn_s_per_ctx_token": 0.0, "prefill_attn_s_per_token_pair": 0.0},
           "limits": {"block_size": 16, "num_gpu_blocks": 1056, "max_num_seqs": 48,
                      "max_num_batched_tokens": 512, "max_model_len": 4096}}


@pytest.fixture
def files(tmp_path):
    prof = tmp_path / "hand.json"
    prof.write_text(json.dumps(PROFILE))
    trace = tmp_path / "lt.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n100,3\n100,3\n")
    return prof, trace


@pytest.mark.parametrize("args,needle", [
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "-1"], "--request-rate"),
    (["--burstiness", "0"], "--burstiness"),
    (["--rates", "5,0"], "--rates"),
    (["-w", "nope"], "unknown workload"),
    (["--policies", "round_robin,bogus"], "unknown dispatch policy"),
    (["-w", "burstgpt", "--path", "/nonexistent.csv"], "no such file"),
    (["--slo", "ttft"], "--slo"),
    (["--fail-under", "0.9"], "needs an SLO"),
    (["--arrival", "trace"], "no timestamps"),
    (["--arrival", "sometimes"], "unknown arrival process"),
    (["--max-tokens", "lots"], "--max-tokens"),
])
def test_bad_arguments_one_line_exit_2(args, needle):
    res = runner.invoke(app, ["bench", "--virtual", "--no-report", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output
    assert res.output.count("error:") == 1


def test_no_target_is_a_user_error():
    res = runner.invoke(app, ["bench", "--no-report"])
    assert res.exit_code == 2 and "--cluster" in res.output
    res = runner.invoke(app, ["bench", "--no-report", "--base-url", "http://127.0.0.1:9", "--oracle-lengths"])
    assert res.exit_code == 2 and "only apply to --virtual" in res.output


def test_wrong_csv_columns(tmp_path):
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n1,2\n")
    res = runner.invoke(app, ["bench", "--virtual", "--no-report", "-w", "azure", "--path", str(bad)])
    assert res.exit_code == 2 and "lacks column" in res.output


def test_virtual_run_hand_computed(files, tmp_path):
    prof, trace = files
    out = tmp_path / "rep"
    # constant 1 req/s → arrivals 0 and 1; round-robin → each alone on its own instance.
    # TTFT = prefill step 0.010 + 100 × 0.0001 = 0.020 s; E2E = 0.020 + 2 decode steps × 0.0101 = 0.0402 s
    res = runner.invoke(app, ["bench", "--virtual", "--instances", "2", "--profile", str(prof), "-w", "length-trace",
                              "--path", str(trace), "--arrival", "constant", "--request-rate", "1",
                              "--policies", "round_robin", "--oracle-lengths", "--slo", "ttft:0.5", "--out", str(out)])
    assert res.exit_code == 0, res.output
    rep = json.loads((out / "report.json").read_text())
    m = rep["runs"][0]["metrics"]["overall"]
    assert m["ttft_s"]["mean"] == pytest.approx(0.020)
    assert m["e2e_s"]["mean"] == pytest.approx(0.0402)
    assert m["tpot_s"]["mean"] == pytest.approx(0.0101)
    assert m["duration_s"] == pytest.approx(1.0402)
    assert m["throughput_rps"] == pytest.approx(2 / 1.0402)
    assert m["slo"]["good"] == 2 and m["preemptions"] == 0
    rows = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert [r["instance"] for r in rows] == ["instance-0", "instance-1"]
    assert rep["config"]["seed"] == 0 and rep["target"]["mode"] == "virtual"
    assert "round_robin" in res.output  # the Rich summary table


def test_virtual_sweep_capacity_and_fail_under(files, tmp_path):
    prof, trace = files
    base = ["bench", "--virtual", "--instances", "1", "--profile", str(prof), "-w", "synthetic", "-n", "60",
            "--no-report", "--oracle-lengths"]
    res = runner.invoke(app, base + ["--rates", "1,2", "--policies", "round_robin,power_of_k", "--k", "1,all"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, base + ["--capacity", "--capacity-threshold", "1.0", "--policies", "round_robin"])
    assert res.exit_code == 0, res.output
    assert "SLO capacity" in res.output
    # an impossible SLO with --fail-under → exit 1
    res = runner.invoke(app, base + ["--request-rate", "50", "--slo", "ttft:0.0001", "--fail-under", "0.99"])
    assert res.exit_code == 1 and "fail:" in res.output


def test_json_output(files):
    prof, trace = files
    res = runner.invoke(app, ["bench", "--virtual", "--instances", "2", "--profile", str(prof), "-w", "length-trace",
                              "--path", str(trace), "--request-rate", "1", "--arrival", "constant", "--oracle-lengths",
                              "--no-report", "--json"])
    assert res.exit_code == 0, res.output
    line = [x for x in res.output.splitlines() if x.startswith("{")][0]
    rep = json.loads(line)
    assert rep["schema"] == "astro.bench/1"
    assert rep["runs"][0]["metrics"]["overall"]["ttft_s"]["mean"] == pytest.approx(0.020)
