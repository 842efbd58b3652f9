"""benchmarks/vllm_bench_compare.py's knobs: CPU sets for the fleet and the load generators,
and the diagnostic arm that runs `vllm bench serve` with aiohttp's trust_env off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import load_script

cmp = load_script("benchmarks/vllm_bench_compare.py", "vllm_bench_compare")


def test_cpu_lists_parse_as_taskset_does():
    assert cmp.parse_cpus("0") == {0}
    assert cmp.parse_cpus("0,2-4") == {0, 2, 3, 4}
    assert cmp.parse_cpus(None) is None
    with pytest.raises(SystemExit, match="no CPU"):
        cmp.parse_cpus(" , ")


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
