"""`astro bench` validates every flag and named file before loading data or starting runs."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from rps_astro_cli.cli.main import app

runner = CliRunner()


@pytest.mark.parametrize("args,needle,not_needle", [
    (["--cluster", "/nonexistent.json"], "--cluster: no such file: /nonexistent.json", None),
    (["--virtual", "--k", "0"], "--k: got '0'", None),
    (["--virtual", "--policies", "power_of_k", "--k", "2,x"], "--k: got 'x'", None),
    (["--virtual", "--length-model", "bogus"], "--length-model", "--model:"),
    (["--virtual", "--profile", "/nonexistent-profile.json"], "--profile", None),
    (["--virtual", "--instance-policy", "bogus"], "bogus", None),
    (["--virtual", "--objective", "fast"], "--objective: unknown objective 'fast'", None),
    (["--base-url", "http://127.0.0.1:9", "--objective", "ttft"], "--objective only apply to --virtual", None),
])
def test_flags_fail_before_the_workload_loads(args, needle, not_needle):
    res = runner.invoke(app, ["bench", "--no-report", "-n", "3", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output
    assert "workload" not in res.output  # the "workload ...: N requests" line never came
    assert "done" not in res.output       # nor a progress bar
    if not_needle:
        assert not_needle not in res.output


def test_help_at_80_columns_shows_every_option_name_whole():
    import re

    import rps_astro_cli.cli.bench as cli_bench

    names = re.findall(r'typer\.Option\("([^"]+)"', open(cli_bench.__file__).read())
    flags = {f for n in names for f in n.split("/")}
    res = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert res.exit_code == 0
    assert "…" not in res.output
    assert all(len(line) <= 80 for line in res.output.splitlines())
    shown = set(re.findall(r"--[a-z](?:[a-z-]*[a-z])?", res.output))
    assert {"--max-prompt-tokens", "--prediction-noise-fraction", "--no-send-true-lengths"} <= flags
    assert flags <= shown, f"cut or missing in --help: {sorted(flags - shown)}"


def test_bench_config_sections_validate_and_report_json_keeps_the_flat_schema():
    import math

    from rps_astro_cli.bench.config import BenchConfig, ClusterSection, SloSection
    from rps_astro_cli.errors import AstroUserError

    cfg = BenchConfig.flat(virtual=True, instances=3, seed=7, request_rate=math.inf, api_key="secret")
    assert cfg.cluster.instances == 3 and cfg.workload.seed == 7 and cfg.target.api_key == "secret"
    d = cfg.to_dict()
    # report.json's "config" (schema astro.bench/1): the flat flag names, in the order they
    # have always had, the key dropped and infinite rates written as "inf"
    assert list(d) == [
        "workload", "path", "num_requests", "seed", "tokenizer", "image_dir", "video_dir", "max_frames",
        "min_tokens", "max_prompt_tokens", "max_total_tokens", "arrival", "request_rate", "burstiness",
        "time_scale", "max_concurrency", "rates", "cluster", "base_url", "model", "endpoint",
        "send_true_lengths", "max_tokens", "ignore_eos", "timeout_s", "virtual", "instances",
        "profile", "instance_policy", "policies", "ks", "objective", "oracle_lengths", "prediction_noise",
        "prediction_noise_fraction", "length_model", "max_num_seqs", "remaining_length", "slo", "slo_scale", "capacity",
        "capacity_metric", "capacity_percentile", "capacity_threshold_s", "capacity_min_rps",
        "capacity_start_rps", "capacity_max_rps", "capacity_tolerance", "fail_under", "out_dir",
        "ttft_definition", "sampling", "input_len", "output_len", "warmup"]
    assert d["request_rate"] == "inf" and d["instances"] == 3 and "api_key" not in d
    # a saved config repeats the run
    again = BenchConfig.flat(**{**d, "request_rate": math.inf, "api_key": "secret"})
    assert again == cfg
    # each section names the flag it checks; cross-section rules live on BenchConfig
    with pytest.raises(AstroUserError, match="--instances: must be ≥ 1, got 0"):
        ClusterSection(instances=0)
    with pytest.raises(AstroUserError, match=r"--fail-under needs an SLO \(add --slo ttft:10"):
        SloSection(fail_under=0.9)
    with pytest.raises(AstroUserError, match="--cluster: no target"):
        BenchConfig()
    with pytest.raises(TypeError, match="bogus"):
        BenchConfig.flat(virtual=True, bogus=1)
