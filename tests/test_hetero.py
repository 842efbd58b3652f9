"""Heterogeneous fleets (issue 31, Build 1): a recipe's `instances:` as groups, each with
its own profile, expanded once (`services.config.instance_specs`) and used by
`astro serve` (each engine and each Predictor its own profile, cluster.json per
instance), `astro bench --virtual` and `astro simulate` (one profile and one
`InstanceConfig` per instance; `--profile P1,P2,…`, `--predictor-profile`). Bad recipes and
flag counts fail with one line naming the field, exit code 2.

The KV-block counts below are the shipped profiles' own (`artifacts/profiles/*.json`,
`limits.num_gpu_blocks`): llama-2-7b-a100 7609, llama-2-7b-a30 1056 (the Astrolabe
paper's A30 setup, ARCHITECTURE.md §2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rps_astro_cli.cli.main import app
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.services.cluster import ClusterSupervisor
from rps_astro_cli.services.config import instance_specs, load_recipe, parse_config, with_fleet

runner = CliRunner()
A100, A30 = "llama-2-7b-a100", "llama-2-7b-a30"
BLOCKS = {A100: 7609, A30: 1056}
RECIPE = "hetero-2xa100-2xa30-llama2-7b"


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


# -- the recipe and its expansion ------------------------------------------------------
def test_shipped_hetero_recipe_expands_per_instance(tmp_path):
    cfg = load_recipe(RECIPE)
    assert cfg.num_instances == 4 and cfg.heterogeneous
    specs = instance_specs(cfg)
    assert [s.profile for s in specs] == [A100, A100, A30, A30]
    assert [s.group for s in specs] == [0, 0, 1, 1] and [s.index for s in specs] == [0, 1, 2, 3]
    assert [s.assumed_profile for s in specs] == [A100, A100, A30, A30]  # default: each its engine's own
    assert all(s.engine.max_num_seqs == 48 and s.engine.max_num_batched_tokens == 512 for s in specs)
    sup = ClusterSupervisor(cfg, tmp_path / "run")
    assert [_flag(sup._engine_argv(i), "--profile") for i in range(4)] == [A100, A100, A30, A30]
    assert [_flag(sup._predictor_argv(i, "http://e"), "--profile") for i in range(4)] == [A100, A100, A30, A30]
    # cluster.json's "recipe" is the validated dump: it parses back to the same fleet
    again = parse_config(json.loads(json.dumps(cfg.model_dump())), "cluster.json")
    assert instance_specs(again) == specs


def test_group_overrides_and_assumed_profile_reach_the_children(tmp_path):
    cfg = parse_config({"instances": [{"count": 1, "profile": A100},
                                      {"count": 2, "profile": A30, "num_gpu_blocks": 500, "time_scale": 0.5}],
                        "engine": {"num_gpu_blocks": 900, "time_scale": 0.1},
                        "predictor": {"assumed_profile": [A30, A30, A100]}}, "r.yaml")
    sup = ClusterSupervisor(cfg, tmp_path / "run")
    argv = [sup._engine_argv(i) for i in range(3)]
    assert [_flag(a, "--num-gpu-blocks") for a in argv] == ["900", "500", "500"]  # the group's wins over engine:
    assert [_flag(a, "--time-scale") for a in argv] == ["0.1", "0.5", "0.5"]
    assert [_flag(a, "--seed") for a in argv] == ["0", "1", "2"]
    assert [_flag(sup._predictor_argv(i, "u"), "--profile") for i in range(3)] == [A30, A30, A100]
    assert sup.time_scale == 0.1  # mixed scales: engine.time_scale converts observed times


def test_fleet_flags():
    base = parse_config({"instances": [{"count": 2, "profile": A100, "max_num_seqs": 8},
                                       {"count": 2, "profile": A30}]}, "r.yaml")
    # one profile per instance: a group whose instances now differ is split, its max_num_seqs kept
    got = instance_specs(with_fleet(base, profile=f"{A30},{A100},{A30},{A30}", predictor_profile=A30))
    assert [(s.profile, s.engine.max_num_seqs, s.assumed_profile) for s in got] == [
        (A30, 8, A30), (A100, 8, A30), (A30, None, A30), (A30, None, A30)]
    # one profile for all replaces every group's
    assert {s.profile for s in instance_specs(with_fleet(base, profile=A30))} == {A30}
    # no count anywhere: the list sets it
    two = with_fleet(parse_config({}), profile=f"{A100},{A30}")
    assert [s.profile for s in instance_specs(two)] == [A100, A30]
    # an int recipe with --instances and a single profile stays a count
    assert with_fleet(parse_config({"instances": 2}), instances=3, profile=A100).instances == 3


@pytest.mark.parametrize("data,field,text", [
    ({"instances": [{"count": 2}, {"count": 0}]}, "instances[1].count", "instances[1].count: must be ≥ 1"),
    ({"instances": [{"count": 1, "profile": "h100-dreams"}]}, "instances[0].profile", "no profile 'h100-dreams'"),
    ({"instances": [{"count": 1, "gpu": "a100"}]}, "instances[0].gpu", "unknown field"),
    ({"instances": [{"profile": A30}]}, "instances[0].count", "Field required"),
    ({"instances": []}, "instances", "at least 1"),
    ({"instances": [{"count": 200}, {"count": 100}]}, "instances", "add up to 300, more than 256"),
    ({"instances": 2, "predictor": {"assumed_profile": [A30]}}, "predictor.assumed_profile", "1 profile for 2"),
    ({"instances": 2, "predictor": {"assumed_profile": [A30, "x"]}}, "predictor.assumed_profile[1]", "no profile"),
])
def test_bad_recipes_name_the_field_in_one_line(data, field, text):
    with pytest.raises(AstroUserError) as ei:
        parse_config(data, "r.yaml")
    msg = str(ei.value)
    assert ei.value.field == field and text in msg and "\n" not in msg and msg.startswith("r.yaml: ")
    if "no profile" in text:
        assert A100 in msg and A30 in msg  # the shipped ones are listed


@pytest.mark.parametrize("argv,needle", [
    (["serve", "--profile", f"{A100},{A30}", "--instances", "3"], "--profile lists 2 profiles for 3 instances"),
    (["serve", "--recipe", RECIPE, "--instances", "3"], "--instances 3: the instance groups"),
    (["serve", "--predictor-profile", f"{A30},{A30}", "--instances", "3"], "--predictor-profile lists 2 profiles"),
    (["serve", "--profile", "nope"], "--profile: no profile 'nope'"),
    (["bench", "--virtual", "--no-report", "--profile", f"{A100},{A30}", "--instances", "3"],
     "--profile lists 2 profiles for 3 instances"),
    (["bench", "--virtual", "--no-report", "--recipe", RECIPE, "--profile", f"{A100},{A30}"],
     "--profile lists 2 profiles for 4 instances"),
    (["bench", "--virtual", "--no-report", "--predictor-profile", f"{A30},{A30},{A30}", "--instances", "2"],
     "--predictor-profile lists 3 profiles for 2 instances"),
    (["bench", "--no-report", "--base-url", "http://127.0.0.1:9", "--predictor-profile", A30], "only apply to"),
    (["simulate", "--path", "T", "--profile", f"{A100},{A30}", "--instances", "3"],
     "--profile lists 2 profiles for 3 instances"),
    (["simulate", "--path", "T", "--recipe", RECIPE, "--predictor-profile", "gone"], "--predictor-profile: no"),
])
def test_bad_flag_counts_exit_2_in_one_line(tmp_path, argv, needle):
    trace = tmp_path / "t.csv"
    trace.write_text("prompt_tokens,output_tokens\n100,20\n")
    argv = [str(trace) if a == "T" else a for a in argv]
    res = runner.invoke(app, [*argv, "--run-dir", str(tmp_path / "r")] if argv[0] == "serve" else argv)
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output and res.output.count("error:") == 1


def test_bad_recipe_through_the_commands(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"instances:\n  - {{count: 2, profile: {A100}}}\n  - {{count: 0, profile: {A30}}}\n")
    for argv in (["serve", "--recipe", str(bad), "--run-dir", str(tmp_path / "r")],
                 ["bench", "--virtual", "--no-report", "--recipe", str(bad)]):
        res = runner.invoke(app, argv)
        assert res.exit_code == 2 and "instances[1].count: must be ≥ 1" in res.output, res.output
        assert "Traceback" not in res.output


def test_in_process_predictors_get_their_engines_profiles(monkeypatch):
    """`--predict-in-process` (recipe predictor.in_process): the supervisor passes one
    --predictor-profile per engine; each in-process look-ahead simulates its own."""
    from types import SimpleNamespace

    import rps_astro_cli.services.scheduler as sched_pkg
    from rps_astro_cli.services.scheduler.predictions import PredictClient

    got: dict = {}
    monkeypatch.setattr(sched_pkg, "run_scheduler", lambda settings, *a, **k: got.setdefault("s", settings))
    engines = ["--engine", "http://127.0.0.1:9", "--engine", "http://127.0.0.1:10"]
    res = runner.invoke(app, ["serve", "scheduler", *engines, "--predict-in-process", "--policy", "power_of_k",
                              "--profile", A100, "--predictor-profile", A100, "--predictor-profile", A30])
    assert res.exit_code == 0, res.output
    s = got["s"]
    assert [ep.profile for ep in s.instances] == [A100, A30]
    pc = PredictClient(s, None, None, None, "power_of_k")  # type: ignore[arg-type]
    assert [pc.local_predictor(SimpleNamespace(ep=ep, status=None)).settings.profile
            for ep in s.instances] == [A100, A30]
    res = runner.invoke(app, ["serve", "scheduler", *engines, "--predict-in-process",
                              "--predictor-profile", A30])
    assert res.exit_code == 2 and "1 --predictor-profile for 2 --engine" in res.output, res.output


# -- the virtual cluster -----------------------------------------------------------------
@pytest.fixture
def spy(monkeypatch):
    """Records what `astro bench --virtual` / `astro simulate` hand the virtual cluster."""
    import rps_astro_cli.cluster as cluster_pkg
    import rps_astro_cli.cluster.virtual as cv

    seen: list[dict] = []
    real = cv.simulate_cluster

    def wrapped(requests, num_instances, dispatch, latency, config=None, instance_policy_factory=None, rng=None,
                **kw):
        seen.append({"num_instances": num_instances, "latency": latency, "config": config, **kw})
        return real(requests, num_instances, dispatch, latency, config, instance_policy_factory, rng, **kw)

    monkeypatch.setattr(cv, "simulate_cluster", wrapped)
    monkeypatch.setattr(cluster_pkg, "simulate_cluster", wrapped)
    return seen


def _ids(seq) -> list[str]:
    return [getattr(x, "profile", x).profile_id for x in seq]


def test_bench_virtual_runs_each_instance_on_its_own_profile(tmp_path, spy):
    out = tmp_path / "rep"
    res = runner.invoke(app, ["bench", "--virtual", "--recipe", RECIPE, "-w", "synthetic", "-n", "40",
                              "--request-rate", "8", "--oracle-lengths", "--policies", "power_of_k",
                              "--out", str(out)])
    assert res.exit_code == 0, res.output
    (call,) = spy
    assert call["num_instances"] == 4 and _ids(call["latency"]) == [A100, A100, A30, A30]
    # the per-instance config comes from each instance's profile
    assert [c.num_gpu_blocks for c in call["config"]] == [7609, 7609, 1056, 1056]
    assert [c.max_num_seqs for c in call["config"]] == [48] * 4
    assert call.get("predictor_latency") is None  # each Predictor: its engine's own model
    rep = json.loads((out / "report.json").read_text())
    tg = rep["target"]
    assert tg["instances"] == 4 and tg["instance_profiles"] == {
        "instance-0": A100, "instance-1": A100, "instance-2": A30, "instance-3": A30}
    assert tg["instance_kv_blocks"] == {"instance-0": 7609, "instance-1": 7609, "instance-2": 1056,
                                        "instance-3": 1056}
    assert tg["engine_limits"]["num_gpu_blocks"] == "per instance" and "predictor_profiles" not in tg
    md = (out / "report.md").read_text()
    assert f"instance-0: {A100}" in md and f"instance-3: {A30}" in md
    m = rep["runs"][0]["metrics"]["overall"]
    assert m["num_completed"] == 40


def test_bench_virtual_profile_list_and_mismatched_predictors(tmp_path, spy):
    out = tmp_path / "rep"
    res = runner.invoke(app, ["bench", "--virtual", "--profile", f"{A30},{A100}", "--predictor-profile", A30,
                              "-w", "synthetic", "-n", "20", "--request-rate", "4", "--oracle-lengths",
                              "--policies", "power_of_k", "--out", str(out)])
    assert res.exit_code == 0, res.output
    (call,) = spy
    assert call["num_instances"] == 2  # the list set the count
    assert _ids(call["latency"]) == [A30, A100] and [c.num_gpu_blocks for c in call["config"]] == [1056, 7609]
    assert _ids(call["predictor_latency"]) == [A30, A30]
    tg = json.loads((out / "report.json").read_text())["target"]
    assert tg["predictor_profiles"] == {"instance-0": A30, "instance-1": A30}
    assert tg["instance_profiles"] == {"instance-0": A30, "instance-1": A100}
    assert json.loads((out / "report.json").read_text())["config"]["predictor_profile"] == A30


def test_homogeneous_runs_keep_one_profile_and_config(tmp_path, spy):
    res = runner.invoke(app, ["bench", "--virtual", "--profile", A30, "--instances", "2", "-w", "synthetic",
                              "-n", "6", "--oracle-lengths", "--policies", "round_robin", "--no-report"])
    assert res.exit_code == 0, res.output
    (call,) = spy
    assert call["latency"].profile_id == A30 and call["config"].num_gpu_blocks == 1056
    assert "predictor_latency" not in call


def test_simulate_with_the_hetero_recipe(tmp_path, spy):
    trace = tmp_path / "t.csv"
    trace.write_text("prompt_tokens,output_tokens\n100,50\n300,120\n50,20\n700,200\n")
    out = tmp_path / "r.jsonl"
    res = runner.invoke(app, ["simulate", "--path", str(trace), "--recipe", RECIPE, "-n", "40", "--request-rate", "8",
                              "--out", str(out)])
    assert res.exit_code == 0, res.output
    (call,) = spy
    assert _ids(call["latency"]) == [A100, A100, A30, A30]
    assert [c.num_gpu_blocks for c in call["config"]] == [7609, 7609, 1056, 1056]
    assert f"2 × {A100} + 2 × {A30}" in res.output and "power_of_k" in res.output  # the recipe's policy
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(recs) == 40 and {r["instance"] for r in recs} <= {0, 1, 2, 3}
    spy.clear()
    res = runner.invoke(app, ["simulate", "--path", str(trace), "--profile", f"{A100},{A30}", "-n", "10",
                              "--predictor-profile", f"{A30},{A100}", "--policy", "power_of_k", "--out", str(out)])
    assert res.exit_code == 0, res.output
    (call,) = spy
    assert _ids(call["latency"]) == [A100, A30] and _ids(call["predictor_latency"]) == [A30, A100]
    assert "Predictors told" in res.output


# -- a live fleet ----------------------------------------------------------------------
@pytest.mark.slow
def test_serve_starts_each_engine_and_predictor_on_its_profile(tmp_path):
    import httpx

    from rps_astro_cli.protocol.internal_auth import token_headers

    cfg = parse_config({"instances": [{"count": 1, "profile": A100}, {"count": 1, "profile": A30}],
                        "engine": {"time_scale": 0.05}, "tagger": {"enabled": False},
                        "predictor": {"assumed_profile": [A100, A100], "in_process": False}}, "test")
    sup = ClusterSupervisor(cfg, tmp_path / "run", tmp_path / "cluster.json", report=lambda line: None)
    try:
        info = sup.start()
        assert [(i["profile"], i["assumed_profile"]) for i in info["instances"]] == [(A100, A100), (A30, A100)]
        assert info["profile"] == A100 and info["time_scale"] == 0.05
        on_disk = json.loads((tmp_path / "cluster.json").read_text())
        assert [i["profile"] for i in on_disk["instances"]] == [A100, A30]
        hdr = token_headers(sup.internal_token)
        for inst, prof in zip(info["instances"], (A100, A30)):
            st = httpx.get(inst["status_url"], headers=hdr, timeout=5.0).json()
            assert st["profile_id"] == prof and st["limits"]["num_gpu_blocks"] == BLOCKS[prof]
        assert [_flag(p.argv, "--profile") for p in sup.predictors] == [A100, A100]
    finally:
        sup.stop()
