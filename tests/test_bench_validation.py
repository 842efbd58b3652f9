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
