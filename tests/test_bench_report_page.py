"""The HTML report reads as a page (markdown-it-py renders report.md: no literal Markdown,
no Python reprs, no JSON blobs; the setup is a table; plots have captions) and the console
summary fits 80 columns without wrapping a number."""

from __future__ import annotations

import json
import re

from typer.testing import CliRunner

from rps_astro_cli.bench.config import BenchConfig
from rps_astro_cli.bench.metrics import all_metrics
from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.bench.report import write_report
from rps_astro_cli.bench.report_md import fmt
from rps_astro_cli.bench.runner import BenchResult, RunResult
from rps_astro_cli.cli.main import app

PROFILE = {"profile_id": "hand", "model": "m", "gpu": "g", "tp": 1,
           "coefficients": {"base_s": 0.010, "per_seq_s": 0.0, "token_knots": [0, 10000], "token_s": [0.0, 1.0],
                            "decode_attn_s_per_ctx_token": 0.0, "prefill_attn_s_per_token_pair": 0.0},
           "limits": {"block_size": 16, "num_gpu_blocks": 1056, "max_num_seqs": 48,
                      "max_num_batched_tokens": 512, "max_model_len": 4096}}


def _result() -> BenchResult:
    recs = [RequestRecord(f"r{i}", output_tokens=4, expected_output_tokens=4, sent_s=i, scheduled_s=i,
                          first_token_s=i + 0.5, finish_s=i + 2.0, itl_s=[0.5, 0.5, 0.5], success=True)
            for i in range(5)]
    run = RunResult("power_of_k k=2 @ poisson 4 req/s", "power_of_k", "2", 4.0, "poisson", all_metrics(recs), recs,
                    {"send_lag_s_p99": 0.002, "send_lag_s_max": 0.003, "outputs_equal_expected": 5,
                     "outputs_completed": 5})
    cfg = BenchConfig.flat(base_url="http://127.0.0.1:9", ttft_definition="vllm", sampling="vllm")
    wl = {"name": "sharegpt", "source": "--path data/sharegpt.json", "num_requests": 5, "modalities": {"text": 5},
          "skipped": {"fewer_than_2_turns": 3, "vllm_length_filter": 2}, "notes": {}, "warnings": [],
          "has_timestamps": False}
    target = {"mode": "live", "base_url": "http://127.0.0.1:9", "model": "m*x",
              "policy": {"name": "power_of_k", "k": 2},
              "ttft_definition": "vllm", "reply_lengths": "max_tokens with ignore_eos: the dataset's reply length"}
    return BenchResult(cfg, wl, target, [run], warnings=["the bench sent requests late (send lag P99 121 ms)"])


def test_html_report_has_no_raw_markdown_reprs_or_json(tmp_path):
    write_report(_result(), tmp_path)
    page = (tmp_path / "report.html").read_text()
    text = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)
    body = re.sub(r"<style>.*?</style>", "", text, flags=re.S)
    visible = re.sub(r"<[^>]+>", "", body)
    for raw in ("**", "|---", "| ", "{'", '{"', "':", '":', "[{", "None", "True", "False"):
        assert raw not in visible, (raw, visible[max(0, visible.find(raw) - 80):visible.find(raw) + 80])
    assert "<strong>warning:</strong>" in body and "<blockquote>" in body  # the warning is rendered, not literal
    setup = body[body.index("<h2>Setup</h2>"):body.index("<h2>Summary")]
    assert "<table>" in setup and "<td>TTFT/ITL definition</td>" in setup
    assert "as vllm bench serve: TTFT at the first chunk with choices" in setup
    assert "<td>fewer_than_2_turns: 3, vllm_length_filter: 2</td>" in setup
    assert "<td>name: power_of_k, k: 2</td>" in setup and "m*x" in setup  # a literal star in a value stays
    assert "5 of 5 completed replies had exactly the dataset" in setup
    figs = re.findall(r"<figure>.*?</figure>", page, flags=re.S)
    assert figs and all("<figcaption>" in f and "<img" in f for f in figs)
    assert "classList.toggle('zoom')" in page and "figure.zoom img" in page  # click-to-zoom on every plot


def test_console_summary_fits_80_columns_without_wrapping_a_number(tmp_path):
    prof = tmp_path / "hand.json"
    prof.write_text(json.dumps(PROFILE))
    trace = tmp_path / "lt.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "".join(f"{100 + 7 * i},{3 + i % 5}\n"
                                                                       for i in range(12)))
    out = tmp_path / "rep"
    args = ["bench", "--virtual", "--instances", "2", "--profile", str(prof), "-w", "length-trace", "--path",
            str(trace), "-n", "12", "--request-rate", "3", "--policies", "round_robin,power_of_k", "--oracle-lengths",
            "--out", str(out)]
    res = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines and max(len(line) for line in lines) <= 80
    rep = json.loads((out / "report.json").read_text())
    for run in rep["runs"]:
        m = run["metrics"]["overall"]
        for v in (m["ttft_s"]["mean"], m["ttft_s"]["p99"], m["tpot_s"]["mean"], m["e2e_s"]["mean"], m["e2e_s"]["p99"]):
            assert re.search(rf"(?<![\d.]){re.escape(fmt(v))}(?![\d.])", res.stdout), (fmt(v), res.stdout)
        row = next(line for line in lines if f"{m['num_completed']}/{m['num_requests']}" in line
                   and fmt(m["e2e_s"]["p99"]) in line)
        assert fmt(m["ttft_s"]["mean"]) in row  # one row holds the run's figures: no cell wrapped to a next line
    wide = CliRunner().invoke(app, [*args[:-2], "--no-report", "--wide"], env={"COLUMNS": "80"})
    assert wide.exit_code == 0 and "out tok/s" in wide.stdout and "goodput" in wide.stdout
