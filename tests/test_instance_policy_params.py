"""Instance-policy parameters are declared by the policy and checked once, whichever way
they come: code, a recipe, `astro serve engine`, `astro simulate`, `astro bench --virtual`."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from rps_astro_cli.cli.main import app
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.policies import make_policy
from rps_astro_cli.services.config import parse_config

runner = CliRunner()


def test_rps_regulator_parameters_from_strings_and_json():
    p = make_policy("rps", alpha="[3, 2, 1]", beta={"sand": 0.1, "pebbles": 0.01, "rocks": 0.001})
    d = p.describe()
    assert d["alpha"] == [3.0, 2.0, 1.0] and d["beta"] == [0.1, 0.01, 0.001]
    with pytest.raises(AstroUserError) as ei:
        make_policy("rps", alpha="[3, 2]", fields={"alpha": "--instance-param alpha"})
    assert ei.value.field == "--instance-param alpha" and "needs 3 values" in str(ei.value)
    with pytest.raises(AstroUserError) as ei:
        make_policy("rps", alpha=[3, 2, 0])  # the regulator's own rule: α > 0
    assert "must be > 0" in str(ei.value)
    assert make_policy("edf", slo_scale="2.5").describe()["slo_scale"] == 2.5
    with pytest.raises(AstroUserError, match="takes no parameter 'slo'"):
        make_policy("edf", slo=2)


def test_recipe_instance_policy_params_are_checked_and_converted():
    cfg = parse_config({"engine": {"instance_policy": "edf", "instance_policy_params": {"slo_scale": "3"}}})
    assert cfg.engine.instance_policy_params == {"slo_scale": 3.0}
    with pytest.raises(AstroUserError) as ei:
        parse_config({"engine": {"instance_policy": "edf", "instance_policy_params": {"slo_scale": 0}}}, "r.yaml")
    assert ei.value.field == "engine.instance_policy_params.slo_scale" and "> 0" in str(ei.value)
    with pytest.raises(AstroUserError) as ei:
        parse_config({"engine": {"instance_policy": "fifo"}})
    assert ei.value.field == "engine.instance_policy" and "fcfs" in str(ei.value)


def test_cli_entry_points_use_the_declaration(tmp_path):
    r = runner.invoke(app, ["serve", "engine", "--instance-policy", "edf", "--instance-param", "slo_scale=-1"])
    assert r.exit_code == 2 and "--instance-param slo_scale" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["serve", "--instance-policy", "fcfs", "--instance-param", "x=1",
                            "--run-dir", str(tmp_path)])
    assert r.exit_code == 2 and "--instance-param x" in r.output and "takes no parameters" in r.output
    trace = tmp_path / "t.csv"
    trace.write_text("prompt_tokens,output_tokens\n100,20\n300,5\n50,40\n")
    out = tmp_path / "r.jsonl"
    r = runner.invoke(app, ["simulate", "--path", str(trace), "-n", "10", "--instances", "2",
                            "--instance-policy", "rps", "--instance-param", "alpha=[3,2,1]", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert len(out.read_text().splitlines()) == 10
    r = runner.invoke(app, ["simulate", "--path", str(trace), "--instance-policy", "rps",
                            "--instance-param", "alpha=[3,2]", "--out", str(out)])
    assert r.exit_code == 2 and "--instance-param alpha" in r.output
    r = runner.invoke(app, ["bench", "--virtual", "--no-report", "-n", "3", "--instance-policy", "edf",
                            "--instance-param", "slo_scale=nope"])
    assert r.exit_code == 2 and "--instance-param slo_scale" in r.output
    r = runner.invoke(app, ["bench", "--virtual", "--no-report", "-n", "4", "-w", "synthetic", "--instances", "1",
                            "--policies", "round_robin", "--instance-policy", "edf", "--instance-param", "slo_scale=2"])
    assert r.exit_code == 0, r.output


def test_describe_round_trips_through_the_declaration():
    # the Predictor rebuilds an engine's policy from its /status `policy` (describe()):
    # every key must be a declared parameter that reproduces the same description
    from rps_astro_cli.policies import INSTANCE_POLICIES

    for name in INSTANCE_POLICIES.names():
        d = make_policy(name).describe()
        spec = {k: v for k, v in d.items() if k != "name"}
        assert make_policy(name, **spec).describe() == d, name
