"""benchmarks/vllm_bench_compare.py's knobs: CPU sets for the fleet and the load generators,
and the diagnostic arm that runs `vllm bench serve` with aiohttp's trust_env off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO, load_script

cmp = load_script("benchmarks/vllm_bench_compare.py", "vllm_bench_compare")


@pytest.mark.parametrize("argv, named", [
    (["--fleet-cpus", "x"], "--fleet-cpus"),
    (["--client-cpus", "3-1"], "--client-cpus"),
    (["--fleet-cpus", "0", "--client-cpus", "0-1"], "overlap"),
    (["--seeds", "0-x"], "--seeds"),
    (["--seeds", "3-1"], "--seeds"),
    (["--policy", "round-robin"], "round_robin"),  # the message lists the names
])
def test_bad_cpu_lists_exit_2_naming_the_flag(argv, named):
    r = subprocess.run([sys.executable, str(REPO / "benchmarks/vllm_bench_compare.py"), *argv],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_long_gaps_counts_only_gaps_over_the_threshold():
    per = [{"itl": [0.03, 0.2, 0.1]}, None, {"itl": [1.9]}, {"itl": []}]
    assert cmp.long_gaps(per) == 2  # 0.2 and 1.9; exactly 0.1 is not over
    assert cmp.long_gaps(per, over_s=0.02) == 4


def test_a_pinned_child_runs_on_the_given_cpus_only():
    cpu = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                         capture_output=True, text=True, check=True, preexec_fn=cmp.pinned(frozenset({cpu})))
    assert out.stdout.strip() == f"[{cpu}]"
    assert cmp.pinned(None) is None


PROBE = ("import asyncio, aiohttp\n"
         "async def m():\n"
         "    s = aiohttp.ClientSession(trust_env=True)\n"
         "    print(s.trust_env)\n"
         "    await s.close()\n"
         "asyncio.run(m())\n")


@pytest.mark.parametrize("trust_env, shown", [(True, "True"), (False, "False")])
def test_the_diagnostic_prefix_turns_aiohttp_trust_env_off(trust_env, shown):
    pytest.importorskip("aiohttp")
    prefix = cmp.vllm_cmd("/venv/bin/vllm", trust_env)[2].removesuffix(cmp.VLLM_SHIM)
    out = subprocess.run([sys.executable, "-c", prefix + PROBE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == shown


def test_arms_rotate_so_each_runs_first_equally_often():
    assert [cmp.arm_order(["vllm", "astro"], i) for i in range(4)] == [
        ["vllm", "astro"], ["astro", "vllm"], ["vllm", "astro"], ["astro", "vllm"]]
    three = [cmp.arm_order(["vllm", "astro", "vllm_noenv"], i) for i in range(3)]
    assert [o[0] for o in three] == ["vllm", "astro", "vllm_noenv"]
    assert all(sorted(o) == ["astro", "vllm", "vllm_noenv"] for o in three)


def _run(value: float) -> dict:
    """One arm's result with every metric (mean and P99) at `value`."""
    return {"mean": {m: value for m, _ in cmp.METRICS}, "p99": {m: value for m, _ in cmp.METRICS}}


def test_the_table_across_seeds_gives_per_seed_medians_and_vllms_own_repeat_spread():
    per_seed = {
        # seed 0: astro / vllm per repeat 1.0 / 1.0 and 1.0 / 1.25 = 0.8 → median 0.9; vllm against
        # itself 1.25 / 1.0 → 25 %
        0: {"vllm": [_run(1.0), _run(1.25)], "astro": [_run(1.0), _run(1.0)]},
        # seed 4: 2.04 / 2.0 = 1.02 and 1.0 → median 1.01 (within 3 %); vllm against itself 0 %
        4: {"vllm": [_run(2.0), _run(2.0)], "astro": [_run(2.04), _run(2.0)]},
    }
    rows = cmp.across_seeds_table(per_seed).splitlines()
    assert rows[0].startswith("| metric | seed 0 | seed 4 | median of seeds |")
    assert "median of all 4 pairs" in rows[0]
    assert len(rows) == 2 + 2 * len(cmp.METRICS)
    p99_ttft = next(r for r in rows if r.startswith("| p99 TTFT |"))
    cells = [c.strip() for c in p99_ttft.strip("|").split("|")]
    # per-seed medians, their median (0.955) and range, seeds within 3 %, median of the 4
    # pairs (0.8, 1.0, 1.0, 1.02 → 1.0), vllm vs itself (0 % and 25 % → median 12.5 %)
    assert cells[1:] == ["0.900", "1.010", "0.955", "0.900–1.010", "1 of 2", "1.000", "12.5% / 25.0%"]


@pytest.mark.parametrize("caching, policy", [(False, None), (False, "round_robin"), (True, "round_robin"),
                                             (True, None)])
def test_the_started_fleets_recipe_is_one_astro_serve_accepts(tmp_path, caching, policy):
    from rps_astro_cli.services.config import load_recipe

    text = cmp.fleet_recipe(caching, policy)
    if caching and policy is None:
        assert text == ""  # nothing to override: astro serve runs without --recipe
        return
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    cfg = load_recipe(path)
    assert cfg.engine.enable_prefix_caching is caching
    assert cfg.scheduler.policy == (policy or "power_of_k")


def _fd(rows):
    """An arm's front-door records from (received_unix_s, observed_ttft_s, instance)."""
    return {"front_door": [{"received_unix_s": t, "observed_ttft_s": x, "instance": i} for t, x, i in rows]}


def test_front_door_pairs_match_engines_across_runs_and_count_step_apart_copies():
    # vLLM's run started on engine-1, astro's on engine-0: the names swap, every copy met
    # "the same" engine. Arrival offsets from each run's first request: prompt 1 vllm 0.5002,
    # astro 0.5000 (+0.2 ms, later) and 20 ms slower; prompt 2 −0.3 ms (earlier) and 15 ms
    # slower; prompt 3 +1 ms, 5 ms apart (under the 10 ms line). Astro's records arrive
    # in another order in the log: they are sorted by arrival.
    v = _fd([(100.0, 0.030, "engine-1"), (100.5002, 0.080, "engine-0"), (101.0, 0.075, "engine-1"),
             (101.501, 0.040, "engine-0")])
    a = _fd([(200.5, 0.060, "engine-1"), (200.0, 0.031, "engine-0"), (201.0003, 0.060, "engine-0"),
             (201.5, 0.035, "engine-1")])
    f = cmp.front_door_pairs(v, a)
    assert f["pairs"] == 4 and f["same_engine"] == 4
    assert f["apart"] == 2 and f["later_slower"] == 1
    # offsets vllm − astro: 0, +0.2, −0.3, +1.0 ms → median +0.1 ms
    assert abs(f["arrival_offset_median_s"] - 0.0001) < 1e-9
    assert cmp.front_door_pairs({}, a) == {"pairs": 0.0}


def test_pooled_ttft_percentiles_over_every_seed_and_repeat():
    def run(ttfts):
        return {"per": [{"ttft": t} for t in ttfts] + [None]}  # a failed request counts nowhere

    # vLLM 1..100 ms, astro the same × 1.1 in two repeats over two seeds: every ratio 1.1
    v = [x / 1000 for x in range(1, 101)]
    per_seed = {0: {"vllm": [run(v[:50])], "astro": [run([x * 1.1 for x in v[:50]])]},
                1: {"vllm": [run(v[50:])], "astro": [run([x * 1.1 for x in v[50:]])]}}
    line = cmp.pooled_ttft_line(per_seed)
    assert line.startswith("pooled over 100 / 100 requests")
    assert "P90 1.100, P95 1.100, P99 1.100, mean 1.100" in line
