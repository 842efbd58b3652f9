"""Parallel virtual sweeps (issue 16): the capacity search in rounds of several rates
(hand-traced rounds, the same answer as the one-rate-at-a-time search within its
tolerance), and every executor (in-process rounds, a process pool, Ray tasks) giving
the serial run's report."""

from __future__ import annotations

import json
import os
import sys

import pytest
from typer.testing import CliRunner

from rps_astro_cli.bench import executors
from rps_astro_cli.bench.capacity import CapacityGoal, CapacitySearch, search_capacity
from rps_astro_cli.bench.config import BenchConfig
from rps_astro_cli.bench.report import report_dict
from rps_astro_cli.bench.runner import run_bench
from rps_astro_cli.cli.main import app
from rps_astro_cli.errors import AstroUserError

runner = CliRunner()

# step = 10 ms + 0.1 ms per token; no per-sequence or attention terms (as test_bench_cli)
PROFILE = {"profile_id": "hand", "model": "m", "gpu": "g", "tp": 1,
           "coefficients": {"base_s": 0.010, "per_seq_s": 0.0, "token_knots": [0, 10000], "token_s": [0.0, 1.0],
                            "decode_attn_s_per_ctx_token": 0.0, "prefill_attn_s_per_token_pair": 0.0},
           "limits": {"block_size": 16, "num_gpu_blocks": 256, "max_num_seqs": 8,
                      "max_num_batched_tokens": 512, "max_model_len": 4096}}

WALL_CLOCK = {"created_unix_s", "wall_s", "sim_wall_s", "decide_us"}  # differ between any two runs
EXECUTION = {"executor", "ray_address", "workers"}  # where it ran, in the config


def comparable(rep: dict) -> dict:
    """report.json without its wall-clock fields, the executor settings and the argv."""
    def strip(o):
        if isinstance(o, dict):
            return {k: strip(v) for k, v in o.items() if k not in WALL_CLOCK}
        if isinstance(o, list):
            return [strip(v) for v in o]
        return o

    out = strip(rep)
    out["config"] = {k: v for k, v in out["config"].items() if k not in EXECUTION}
    out.pop("command", None)
    return out


# -- the search in rounds ----------------------------------------------------------------

def test_width_one_is_the_doubling_then_bisection_search():
    # v = rate / 4 ≤ 10 ⇔ rate ≤ 40; start 4: doubling 4, 8, 16, 32 pass, 64 fails; bisection
    # (lo + hi) / 2: 48 F, 40 P, 44 F, 42 F, 41 F, 40.5 F, 40.25 F → (40.25 − 40) / 40 ≤ 0.01
    res = search_capacity(lambda r: r / 4, CapacityGoal(threshold_s=10.0), start_rps=4, tolerance=0.01)
    assert [p[0] for p in res.probes] == [4, 8, 16, 32, 64, 48, 40, 44, 42, 41, 40.5, 40.25]
    assert res.capacity_rps == 40 and res.rounds is None and "width" not in res.to_dict()


def test_width_three_rounds_by_hand():
    # round 1: start × 2^j, j = −1, 0, 1 → 2, 4, 8 pass; round 2: doublings 16, 32, 64 → 64 fails;
    # round 3: [32, 64] needs n = 3 points (32 / 2 > 0.01 × 32): 40 P, 48 F, 56 F; round 4: [40, 48]
    # → 42, 44, 46 F; round 5: [40, 42] → 40.5, 41, 41.5 F; round 6: [40, 40.5], one point
    # (0.5 / 2 ≤ 0.4) → 40.25 F; (40.25 − 40) / 40 ≤ 0.01: done
    res = search_capacity(lambda r: r / 4, CapacityGoal(threshold_s=10.0), start_rps=4, tolerance=0.01, width=3)
    rates = [p[0] for p in res.probes]
    assert rates == [2, 4, 8, 16, 32, 64, 40, 48, 56, 42, 44, 46, 40.5, 41, 41.5, 40.25]
    assert res.capacity_rps == 40 and res.rounds == 6
    assert res.to_dict()["width"] == 3 and res.to_dict()["rounds"] == 6


def test_width_n_answer_within_the_tolerance_of_width_one():
    # for a non-decreasing v both searches end with lo passing, hi failing, (hi − lo) / lo ≤ tol:
    # both answers lie in [c / (1 + tol), c] for the true capacity c
    tol = 0.02
    for i in range(150):
        c = 0.7 * 1.05 ** i  # 0.7 … 1,000 req/s

        def v(r, c=c):
            return 10.0 * r / c

        one = search_capacity(v, CapacityGoal(threshold_s=10.0), start_rps=4, tolerance=tol, max_rps=2048)
        for w in (2, 3, 5):
            many = search_capacity(v, CapacityGoal(threshold_s=10.0), start_rps=4, tolerance=tol, max_rps=2048,
                                   width=w)
            for got in (one.capacity_rps, many.capacity_rps):
                assert c / (1 + tol) * (1 - 1e-12) <= got <= c
            assert many.rounds < len(one.probes)


def test_grid_in_rounds_stops_at_the_round_with_a_failure():
    grid = search_capacity(lambda r: r / 4 if r < 50 else float("inf"), CapacityGoal(threshold_s=10.0),
                           rates=[10, 20, 30, 45, 60, 80], width=2)
    # rounds (10, 20), (30, 45): 45 / 4 > 10 fails → stop; capacity = highest pass below it
    assert [p[0] for p in grid.probes] == [10, 20, 30, 45] and grid.capacity_rps == 30 and grid.rounds == 2


def test_bracket_ignores_a_pass_above_a_failure():
    # non-monotone v: the bracket is [highest pass below the lowest failure, lowest failure]
    s = CapacitySearch(CapacityGoal(threshold_s=1.0), start_rps=8, width=3)
    assert s.next_rates() == [4, 8, 16]
    for r, v in ((4, 0.5), (8, 2.0), (16, 0.5)):
        s.record(r, v)
    assert s.bracket() == (4, 8)
    with pytest.raises(RuntimeError):
        s.record(5, 0.1)  # not asked for


# -- executors give the serial report ----------------------------------------------------

@pytest.fixture
def prof(tmp_path):
    p = tmp_path / "hand.json"
    p.write_text(json.dumps(PROFILE))
    return p


def flags(prof, **over):
    base = dict(virtual=True, instances=2, profile=str(prof), workload="synthetic", num_requests=40,
                oracle_lengths=True, policies=["round_robin", "power_of_k"], ks=["2"], capacity=True,
                capacity_threshold_s=0.5, capacity_start_rps=8.0, capacity_tolerance=0.05)
    base.update(over)
    return base


def test_in_process_rounds_equal_the_serial_loop(prof, monkeypatch):
    serial = report_dict(run_bench(BenchConfig.flat(**flags(prof))))
    monkeypatch.setattr(executors, "make_executor", lambda execution, target: executors.InProcessExecutor(target))
    rounds = report_dict(run_bench(BenchConfig.flat(**flags(prof, executor="processes"))))
    assert rounds["config"]["executor"] == "processes"
    assert comparable(rounds) == comparable(serial)
    assert [c["label"] for c in serial["capacity"]] == ["round_robin", "power_of_k k=2"]
    assert len(serial["runs"]) == sum(len(c["probes"]) for c in serial["capacity"]) > 4
    # a --rates sweep: one round of every rate × variant, listed variant by variant
    sw = flags(prof, capacity=False, rates=[2.0, 4.0, 8.0])
    monkeypatch.undo()
    serial_sweep = report_dict(run_bench(BenchConfig.flat(**sw)))
    monkeypatch.setattr(executors, "make_executor", lambda execution, target: executors.InProcessExecutor(target))
    par_sweep = report_dict(run_bench(BenchConfig.flat(**sw, executor="processes")))
    assert comparable(par_sweep) == comparable(serial_sweep)
    assert [r["label"] for r in serial_sweep["runs"]][:2] == ["round_robin @ poisson 2 req/s",
                                                             "round_robin @ poisson 4 req/s"]


@pytest.mark.slow
def test_process_pool_equals_serial(prof):
    # spawn workers unpickle the target (length model and tokenizer callables left out)
    f = flags(prof, capacity_width=2)
    serial = report_dict(run_bench(BenchConfig.flat(**f)))
    pool = report_dict(run_bench(BenchConfig.flat(**f, executor="processes", workers=2)))
    assert comparable(pool) == comparable(serial)
    assert all(c["width"] == 2 and c["rounds"] >= 2 for c in serial["capacity"])


def _cli_json(args: list[str]) -> dict:
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return json.loads(next(x for x in res.output.splitlines() if x.startswith("{")))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ray_json_equals_serial_json(prof):
    # CI installs ray for this test (.ci/run, ASTRO_REQUIRE_RAY=1): there it must run, not skip
    if os.environ.get("ASTRO_REQUIRE_RAY") != "1":
        pytest.importorskip("ray")
    base = ["bench", "--virtual", "--instances", "2", "--profile", str(prof), "-w", "synthetic", "-n", "40",
            "--oracle-lengths", "--policies", "round_robin,power_of_k", "--k", "2", "--no-report", "--json"]
    cap = ["--capacity", "--capacity-threshold", "0.5", "--capacity-start-rate", "8", "--capacity-width", "2"]
    serial = _cli_json(base + cap)
    ray_rep = _cli_json(base + cap + ["--executor", "ray", "--workers", "2"])
    assert ray_rep["config"]["executor"] == "ray"
    assert comparable(ray_rep) == comparable(serial)
    assert serial["capacity"][0]["capacity_rps"] is not None and serial["capacity"][0]["rounds"] >= 2


def test_ray_missing_is_one_line_error(prof, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray → ImportError
    with pytest.raises(AstroUserError) as exc:
        executors.import_ray()
    assert exc.value.field == "--executor" and "rps_astro_cli[ray]" in str(exc.value.fix)
    res = runner.invoke(app, ["bench", "--virtual", "--no-report", "--profile", str(prof), "-w", "synthetic",
                              "-n", "4", "--oracle-lengths", "--executor", "ray"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert res.output.count("error:") == 1 and "--executor ray needs Ray" in res.output


@pytest.mark.parametrize("args,needle", [
    (["--executor", "threads"], "unknown executor"),
    (["--ray-address", "auto"], "--ray-address"),
    (["--executor", "processes", "--workers", "0"], "--workers"),
    (["--workers", "2"], "--workers sizes a parallel executor"),
    (["--executor", "ray", "--ray-address", "auto", "--workers", "2"], "--workers"),
    (["--capacity-width", "0"], "--capacity-width"),
])
def test_bad_executor_flags_one_line_exit_2(args, needle):
    res = runner.invoke(app, ["bench", "--virtual", "--no-report", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output and res.output.count("error:") == 1


def test_live_runs_stay_serial():
    res = runner.invoke(app, ["bench", "--no-report", "--base-url", "http://127.0.0.1:9", "--executor", "processes"])
    assert res.exit_code == 2 and "--executor" in res.output and "add --virtual" in res.output
