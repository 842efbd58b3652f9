"""The sim engine runs the RPS policies with the profile's classifier and exports the
per-class queue metrics in /status and /metrics."""

from __future__ import annotations

import httpx

from conftest import hand_profile
from rps_astro_cli.engine.sim_engine import SimEngine
from rps_astro_cli.engine.sim_server import create_app
from rps_astro_cli.policies.build import build_instance_policy
from rps_astro_cli.policies.rps import profile_policy_params
from rps_astro_cli.protocol.http_server import ServerThread
from rps_astro_cli.sim.profile import load_profile


def test_engine_policy_picks_up_the_profiles_classifier():
    prof = load_profile("llava-onevision-7b-a100")
    assert SimEngine(prof, policy="rps").policy.describe()["classifier"] == "llava-onevision-7b-a100"
    assert profile_policy_params("fcfs", prof) == {}
    assert build_instance_policy("edf", None, prof).describe()["profile"] == "llava-onevision-7b-a100"
    assert build_instance_policy("rps", None, hand_profile()).describe()["classifier"] == "naive"  # none shipped


def test_status_and_metrics_carry_class_queue_metrics():
    with ServerThread(create_app(SimEngine(hand_profile(), policy="rps"))) as srv:
        st = httpx.get(f"{srv.url}/status").json()
        m = httpx.get(f"{srv.url}/metrics").text
    assert set(st["classes"]) == {"sand", "pebbles", "rocks"}
    assert st["classes"]["rocks"] == {"queue_len": 0, "mean_wait_s": 0.0, "prefill_backlog_s": 0.0}
    assert st["policy"]["name"] == "rps" and st["policy"]["alpha"] == [3.5, 2.5, 1.1]
    assert 'astro:class_queue_length{class="sand"' in m and "astro:class_prefill_backlog_seconds" in m
