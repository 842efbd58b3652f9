"""Live `astro bench --cluster cluster.json --instance-policies fcfs,rps` (issue 15): one
run per in-instance policy, each on a fresh cluster started from cluster.json's recipe
with that policy; every run carries `instance_policy`, and the engines' own `/status`
reports it. A tiny sim fleet (one engine, no Predictor or tagger, round_robin, time
scale 0.05); every start is bounded and every process is stopped at the end."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from rps_astro_cli.bench import workload_base, workloads
from rps_astro_cli.bench.workload_base import BenchRequest
from rps_astro_cli.cli.main import app
from rps_astro_cli.services.cluster import ClusterSupervisor
from rps_astro_cli.services.config import parse_config

RECIPE = {"name": "tiny", "instances": 1, "restart_crashed": 0,
          # the recipe was written for rps: its parameter must reach rps and not fcfs
          "engine": {"time_scale": 0.05, "instance_policy": "rps",
                     "instance_policy_params": {"classifier": "naive"}},
          "predictor": {"enabled": False}, "tagger": {"enabled": False},
          "scheduler": {"policy": "round_robin", "health_interval_ms": 200.0}}


@pytest.fixture
def tiny_fleet(tmp_path, monkeypatch):
    """(cluster.json path, every supervisor started meanwhile): the user's fleet, and,
    through the patched `start`, the ones the bench starts."""
    started: list[ClusterSupervisor] = []
    real_start = ClusterSupervisor.start

    def start(self, timeout_s=None):
        started.append(self)
        return real_start(self, timeout_s=30.0)

    monkeypatch.setattr(ClusterSupervisor, "start", start)
    cj = tmp_path / "cluster.json"
    user = ClusterSupervisor(parse_config(RECIPE), tmp_path / "user", cluster_json=cj, report=lambda line: None)
    reqs = [BenchRequest(f"q{i}", "one two three", 3, 4 + i) for i in range(4)]
    workloads.WORKLOADS._items["tiny-live-test"] = lambda opts, rng: workload_base.Workload("tiny", reqs, "test")
    try:
        user.start()
        yield cj, started
    finally:
        del workloads.WORKLOADS._items["tiny-live-test"]
        for sup in started:
            sup.stop(grace_s=3)


@pytest.mark.slow  # three fleets start (the user's, one per policy): ~10 s alone, a minute on a loaded host
def test_live_instance_policies_restart_the_fleet_per_policy(tiny_fleet):
    cj, started = tiny_fleet
    res = CliRunner().invoke(app, ["bench", "--cluster", str(cj), "-w", "tiny-live-test", "--request-rate", "inf",
                                   "--instance-policies", "fcfs,rps", "--request-timeout", "30", "--no-report",
                                   "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    runs = rep["runs"]
    assert [r["instance_policy"] for r in runs] == ["fcfs", "rps"]
    assert [r["label"].split(" · ")[0] for r in runs] == ["fcfs", "rps"]
    # what the engines themselves ran (their /status), on a fresh fleet each
    assert [r["extras"]["engine_instance_policies"] for r in runs] == [["fcfs"], ["rps"]]
    assert rep["target"]["instance_policies"] == ["fcfs", "rps"]
    for r in runs:  # the same four requests, all served (outputs of 4..7 tokens)
        o = r["metrics"]["overall"]
        assert (o["num_requests"], o["num_completed"]) == (4, 4)
    # the user's fleet, then one per policy; the bench stopped its own before returning
    assert len(started) == 3
    bench_children = [c for sup in started[1:] for c in sup.children]
    assert bench_children and all(c.proc is not None and c.proc.poll() is not None for c in bench_children)
    assert all(c.proc.poll() is None for c in started[0].children)  # the user's fleet is left running
    assert started[1].cfg.engine.instance_policy_params == {}  # fcfs declares no parameter
    assert started[2].cfg.engine.instance_policy_params == {"classifier": "naive"}


def test_live_instance_policies_need_cluster_json():
    res = CliRunner().invoke(app, ["bench", "--base-url", "http://127.0.0.1:9", "--instance-policies", "fcfs,rps"])
    assert res.exit_code == 2 and "--instance-policies" in res.output and "Traceback" not in res.output
