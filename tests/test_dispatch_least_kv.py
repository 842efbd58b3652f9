"""`least_kv` (the worked example of CONTRIBUTING.md): hand-made loads, its parameter
through every entry point (make_dispatch, a recipe, `astro serve`, `astro simulate`,
`astro bench --virtual`)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from typer.testing import CliRunner

from rps_astro_cli.cli.main import app
from rps_astro_cli.dispatch import make_dispatch
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.services.config import parse_config
from rps_astro_cli.types import InstanceLoad

runner = CliRunner()

# free KV blocks 100, 96, 80 and one instance without a status yet
LOADS = [InstanceLoad(0, True, 5, kv_blocks_free=100, kv_blocks_total=200),
         InstanceLoad(1, True, 0, kv_blocks_free=96, kv_blocks_total=200),
         InstanceLoad(2, True, 0, kv_blocks_free=80, kv_blocks_total=200),
         InstanceLoad(3, True, 0)]


def test_most_free_blocks_wins_and_unknown_status_is_skipped():
    p = make_dispatch("least_kv")
    assert p.inputs == {"status"}
    d = p.choose(LOADS, [0, 1, 2, 3], {}, np.random.default_rng(0))
    assert d.choice == 0 and d.reason == "most free KV blocks"  # 100 free; more outstanding does not matter
    assert p.describe() == {"name": "least_kv", "tie_blocks": 0}


def test_tie_blocks_makes_near_equal_instances_ties():
    p = make_dispatch("least_kv", tie_blocks="4")  # a flag's string, converted by the declaration
    rng = np.random.default_rng(1)
    picks = Counter(p.choose(LOADS, [0, 1, 2, 3], {}, rng).choice for _ in range(200))
    assert set(picks) == {0, 1}  # 96 is within 4 of 100; 80 is not
    assert 60 < picks[0] < 140
    assert make_dispatch("least_kv", tie_blocks=3).choose(LOADS, [0, 1, 2], {}, rng).choice == 0


def test_no_status_anywhere_falls_back_to_fewest_outstanding():
    loads = [InstanceLoad(0, True, 4), InstanceLoad(1, True, 2)]
    d = make_dispatch("least_kv").choose(loads, [0, 1], {}, np.random.default_rng(0))
    assert d.choice == 1 and d.reason.startswith("fallback: no status")


def test_bad_tie_blocks_names_the_field_and_the_bound():
    with pytest.raises(AstroUserError) as ei:
        make_dispatch("least_kv", tie_blocks=-1)
    assert ei.value.field == "tie_blocks" and "≥ 0" in str(ei.value)
    with pytest.raises(AstroUserError, match="takes no parameter 'k'"):
        make_dispatch("least_kv", k=2)


def test_recipe_params_reach_the_policy():
    cfg = parse_config({"instances": 2, "predictor": {"enabled": False},
                        "scheduler": {"policy": "least_kv", "params": {"tie_blocks": 8}}})
    assert cfg.scheduler.policy_params() == {"tie_blocks": 8}  # no predictors needed: it reads /status
    with pytest.raises(AstroUserError) as ei:
        parse_config({"scheduler": {"policy": "least_kv", "params": {"tie_blocks": "many"}}}, "r.yaml")
    assert ei.value.field == "scheduler.params.tie_blocks" and str(ei.value).startswith("r.yaml: ")
    # params win over a flat key: `astro serve --recipe R --param k=3` overrides R's `k: 2`
    cfg = parse_config({"instances": 4, "scheduler": {"policy": "power_of_k", "k": 2, "params": {"k": "3"}}})
    assert cfg.scheduler.policy_params() == {"k": 3, "objective": "ttft"}  # objective: the default


def test_serve_flags_are_checked_by_the_declaration(tmp_path):
    r = runner.invoke(app, ["serve", "--policy", "least_kv", "--param", "tie_blocks=-2", "--run-dir", str(tmp_path)])
    assert r.exit_code == 2 and "--param tie_blocks" in r.output and "≥ 0" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["serve", "scheduler", "--engine", "http://a", "--policy", "least_kv",
                            "--param", "tie_blocks=x"])
    assert r.exit_code == 2 and "--param tie_blocks" in r.output
    r = runner.invoke(app, ["serve", "scheduler", "--engine", "http://a", "--policy", "least_kv", "--param", "oops"])
    assert r.exit_code == 2 and "NAME=VALUE" in r.output


def _trace(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("prompt_tokens,output_tokens\n" + "".join(f"{50 + 37 * i % 400},{5 + 13 * i % 60}\n"
                                                           for i in range(20)))
    return p


def test_simulate_runs_least_kv_with_its_parameter(tmp_path):
    out = tmp_path / "r.jsonl"
    r = runner.invoke(app, ["simulate", "--path", str(_trace(tmp_path)), "--instances", "3", "-n", "30",
                            "--request-rate", "20", "--policy", "least_kv", "--param", "tie_blocks=16",
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 30 and {rec["instance"] for rec in recs} <= {0, 1, 2}
    r = runner.invoke(app, ["simulate", "--path", str(_trace(tmp_path)), "--policy", "least_kv",
                            "--param", "tie_blocks=-1", "--out", str(out)])
    assert r.exit_code == 2 and "--param tie_blocks" in r.output


def test_bench_virtual_runs_least_kv_with_its_parameter(tmp_path):
    r = runner.invoke(app, ["bench", "--virtual", "--no-report", "--json", "-w", "synthetic", "-n", "12",
                            "--request-rate", "5", "--instances", "2", "--policies", "least_kv,round_robin",
                            "--param", "tie_blocks=8"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output.strip().splitlines()[-1])
    assert [run["policy"] for run in rep["runs"]] == ["least_kv", "round_robin"]
    r = runner.invoke(app, ["bench", "--virtual", "--no-report", "-n", "3", "--policies", "round_robin",
                            "--param", "tie_blocks=8"])
    assert r.exit_code == 2 and "no dispatch policy of this run (round_robin) takes 'tie_blocks'" in r.output
