"""Several stateless schedulers on a stale status (issue 16, `simulate_cluster` with a list
of dispatch policies and `status_interval_s`): who sees what, by hand."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import linear_profile
from rps_astro_cli.cluster import TimedRequest, simulate_cluster
from rps_astro_cli.dispatch import make_dispatch
from rps_astro_cli.dispatch.base import DispatchPolicy
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.types import DispatchDecision, InstanceConfig

HAND = linear_profile()
CFG = InstanceConfig(block_size=16, num_gpu_blocks=1000, max_num_seqs=48, max_num_batched_tokens=512,
                     max_model_len=4096)


class FewestSeen(DispatchPolicy):
    """The instance with the fewest running + waiting requests in the status it is shown;
    ties → the lowest index (no randomness, so the assignment is known by hand)."""

    name = "fewest_seen"
    inputs = frozenset({"status"})

    def choose(self, loads, candidates, predictions, rng):
        best = min(candidates, key=lambda i: (loads[i].num_running + loads[i].num_waiting, i))
        return DispatchDecision(self.name, tuple(candidates), best, "fewest seen")


# four long requests (1,000 output tokens: none ends within the test's first second),
# 0.1 s apart; with S schedulers the n-th goes to scheduler n mod S
REQS = [TimedRequest(f"r{j}", 0.1 * (j + 1), 100, 1000) for j in range(4)]


def run(s: int, interval: float, pending: bool = True):
    return simulate_cluster(REQS, 2, [FewestSeen() for _ in range(s)], HAND, CFG, None, np.random.default_rng(0),
                            status_interval_s=interval, count_pending=pending)


def placed(res) -> list[int]:
    return [r.instance for r in res.records]


def test_live_state_alternates():
    # one scheduler on the live state: r0 → 0, r1 sees (1, 0) → 1, r2 (1, 1) → 0, r3 → 1
    res = run(1, 0.0)
    assert placed(res) == [0, 1, 0, 1] and res.herding is None
    one = simulate_cluster(REQS, 2, FewestSeen(), HAND, CFG, None, np.random.default_rng(0))
    assert placed(one) == placed(res) and [r.finish_s for r in one.records] == [r.finish_s for r in res.records]


def test_one_scheduler_with_its_pending_list_sees_everything_it_sent():
    # the status copy (taken at t = 0, empty) never refreshes within 10 s, but the only
    # scheduler's pending list holds every send: the live placement
    assert placed(run(1, 10.0)) == [0, 1, 0, 1]
    # without the pending list the copy shows (0, 0) to every decision: all on instance 0
    res = run(1, 10.0, pending=False)
    # copies at t = 0 and t = 10 (1,000 decode steps of ≥ 10 ms: the run ends past 10 s)
    assert placed(res) == [0, 0, 0, 0] and res.herding["refreshes"] == 2
    assert 10 < max(r.finish_s for r in res.records) < 20


def test_two_schedulers_herd_until_the_next_refresh():
    # A = r0, r2; B = r1, r3. Copy at t = 0: empty. r0 (A) → 0; r1 (B) does not know r0 → 0
    # (herding); r2 (A) has r0 pending → sees (1, 0) → 1; r3 (B) has r1 pending → 1
    res = run(2, 10.0)
    assert placed(res) == [0, 0, 1, 1]
    h = res.herding
    assert h["schedulers"] == 2 and h["requests_per_scheduler"] == [2, 2]
    # sends by the other scheduler to the chosen instance since the copy: r0 0, r1 1 (r0),
    # r2 0, r3 1 (r2) → mean 0.5
    assert h["unseen_sends_mean"] == pytest.approx(0.5)
    # no pending list: everyone sees the empty copy; unseen: 0, 1, 1, 2 (r0 and r2 by A)
    res = run(2, 10.0, pending=False)
    assert placed(res) == [0, 0, 0, 0] and res.herding["unseen_sends_mean"] == pytest.approx(1.0)


def test_refresh_shows_the_other_schedulers_sends():
    # Δ = 0.25: the copy taken at the t = 0.3 arrival (tick 0.25) shows r0 and r1 on
    # instance 0, so r2 (A) → 1; r3 (B) at 0.4 does not know r2 (same interval) → 1 too
    res = run(2, 0.25)
    assert placed(res) == [0, 0, 1, 1]
    # Δ = 0.15: ticks 0.15 (before r1), 0.3 (before r2): r1 sees r0 → 1; r2 sees (1, 1) → 0;
    # r3 at 0.4 (tick 0.3 already taken) has nothing pending, does not know r2: (1, 1) → 0
    assert placed(run(2, 0.15)) == [0, 1, 0, 0]


def test_power_of_k_under_herding_is_deterministic_and_bad_input_is_named():
    reqs = [TimedRequest(f"q{j}", 0.02 * j, 200, 50) for j in range(40)]

    def go():
        return simulate_cluster(reqs, 3, [make_dispatch("power_of_k", k="all") for _ in range(4)], HAND, CFG, None,
                                np.random.default_rng(1), status_interval_s=0.25)

    a, b = go(), go()
    assert [r.instance for r in a.records] == [r.instance for r in b.records]
    assert sum(a.herding["requests_per_scheduler"]) == 40 and a.herding["requests_per_scheduler"] == [10] * 4
    with pytest.raises(AstroUserError, match="finite"):
        simulate_cluster(reqs, 3, make_dispatch("round_robin"), HAND, CFG, None, np.random.default_rng(1),
                         status_interval_s=float("inf"))


def test_bench_flags_reach_the_virtual_cluster(tmp_path):
    import json

    from typer.testing import CliRunner

    from conftest import write_profile
    from rps_astro_cli.cli.main import app

    prof = write_profile(tmp_path, HAND)
    base = ["bench", "--virtual", "--instances", "2", "--profile", prof, "-w", "synthetic", "-n", "30",
            "--oracle-lengths", "--policies", "power_of_k", "--k", "all", "--request-rate", "20", "--no-report",
            "--json"]
    res = CliRunner().invoke(app, base + ["--schedulers", "3", "--status-interval", "0.25"])
    assert res.exit_code == 0, res.output
    rep = json.loads(next(x for x in res.output.splitlines() if x.startswith("{")))
    h = rep["runs"][0]["extras"]["herding"]
    assert h["schedulers"] == 3 and h["requests_per_scheduler"] == [10, 10, 10] and h["status_interval_s"] == 0.25
    assert rep["config"]["schedulers"] == 3 and rep["target"]["schedulers"] == 3
    res = CliRunner().invoke(app, base)  # the defaults: the single live dispatcher, report unchanged
    rep = json.loads(next(x for x in res.output.splitlines() if x.startswith("{")))
    assert "herding" not in rep["runs"][0]["extras"] and "schedulers" not in rep["config"]
    res = CliRunner().invoke(app, base + ["--status-interval", "-1"])
    assert res.exit_code == 2 and "--status-interval" in res.output and res.output.count("error:") == 1
