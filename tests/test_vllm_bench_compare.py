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
