"""benchmarks/peer_routers.py CPU pinning: the CPU-list syntax both ways, the flag checks,
and `pin_tree` on a real process tree (a child with a thread and a grandchild): every
thread of every process ends on the set, as /proc/<pid>/task/<tid>/status shows it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import load_script

pr = load_script("benchmarks/peer_routers.py", "peer_routers_pin")


def test_cpu_lists_parse_and_format_like_the_kernel() -> None:
    assert pr.parse_cpus("0") == {0}
    assert pr.parse_cpus("0-2,5") == {0, 1, 2, 5}
    assert pr.parse_cpus(" 3 , 1-1") == {1, 3}
    assert pr.format_cpus({0, 1, 2, 5}) == "0-2,5"
    assert pr.format_cpus({4, 0, 2}) == "0,2,4"
    assert pr.format_cpus({7}) == "7"
    with pytest.raises(ValueError, match="no CPU in"):
        pr.parse_cpus("")
    for bad in ("2-1", "a", "-1", "0-x"):  # each named in the message, not int()'s own words
        with pytest.raises(ValueError, match=f"bad CPU range '{bad}'"):
            pr.parse_cpus(bad)


def test_pinning_flags_must_come_together_and_be_disjoint(capsys) -> None:
    with pytest.raises(SystemExit):
        pr.parse_args(["--arms", "astro/power_of_k", "--engine-cpus", "0"])
    assert "--engine-cpus and --front-cpus go together" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pr.parse_args(["--arms", "astro/power_of_k", "--engine-cpus", "0", "--front-cpus", "0"])
    assert "two disjoint sets" in capsys.readouterr().err
    cpu = min(os.sched_getaffinity(0))
    with pytest.raises(SystemExit):  # a CPU this process may not use is refused
        pr.parse_args(["--arms", "astro/power_of_k", "--engine-cpus", str(cpu), "--front-cpus", "4096"])
    assert "within this process's CPUs" in capsys.readouterr().err


CHILD = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
print(g.pid, flush=True)
time.sleep(30)
"""


def test_pin_tree_pins_every_thread_of_a_child_and_its_grandchild() -> None:
    cpu = min(os.sched_getaffinity(0))
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        deadline = time.monotonic() + 10
        while len(list(Path(f"/proc/{child.pid}/task").iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pr.process_tree(child.pid) == [child.pid, grandchild]
        assert pr.pin_tree(child.pid, frozenset({cpu})) == str(cpu)
        tids = [int(t.name) for t in Path(f"/proc/{child.pid}/task").iterdir()]
        assert len(tids) >= 2  # the main thread and the sleeping one
        for t in tids:
            assert pr.cpus_allowed(child.pid, t) == {cpu}
        assert pr.cpus_allowed(grandchild) == {cpu}
        assert pr.cpus_allowed(os.getpid()) == os.sched_getaffinity(0)  # the caller untouched
    finally:
        for p in pr.process_tree(child.pid)[::-1]:
            try:
                os.kill(p, 9)
            except ProcessLookupError:
                pass
        child.wait(10)


def test_steal_fraction_from_two_proc_stat_readings() -> None:
    # hand-made /proc/stat: between the readings cpu0 spends 100 ticks (30 of them stolen),
    # cpu1 100 ticks (none stolen); the machine line is their sum: 30 / 200 = 0.15
    before = pr.read_cpu_times("cpu  100 0 50 800 0 0 0 10 5 0\n"
                               "cpu0 50 0 25 400 0 0 0 10 5 0\ncpu1 50 0 25 400 0 0 0 0 0 0\nintr 1 2\n")
    after = pr.read_cpu_times("cpu  160 0 70 890 0 0 0 40 25 0\n"
                              "cpu0 80 0 35 430 0 0 0 40 25 0\ncpu1 80 0 35 460 0 0 0 0 0 0\nintr 9 9\n")
    out = pr.steal_fractions(before, after)
    assert out["host_steal_fraction"] == pytest.approx(0.15)
    assert out["cpu_steal_fraction"] == {"cpu0": pytest.approx(0.30), "cpu1": 0.0}
    # counters that did not move, or a machine without /proc/stat: no figure, no error
    assert pr.steal_fractions(before, before)["host_steal_fraction"] is None
    assert pr.steal_fractions({}, {}) == {"host_steal_fraction": None, "cpu_steal_fraction": {}}


def test_this_machines_proc_stat_parses() -> None:
    if not Path("/proc/stat").exists():
        pytest.skip("no /proc/stat")
    now = pr.read_cpu_times()
    assert len(now["cpu"]) >= 8 and f"cpu{min(os.sched_getaffinity(0))}" in now
