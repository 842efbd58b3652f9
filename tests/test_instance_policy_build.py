"""One build path for instance policies (issue 15): the sim engine (`astro serve`), the
vLLM plugin's builder, `astro bench --virtual` and `astro simulate` all build a policy
from (name, params, profile) with `policies.build.build_instance_policy`, so one policy
name on one profile makes the same decisions on every path."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from rps_astro_cli.bench.virtual import instance_policy_factory
from rps_astro_cli.engine.backends import EngineOptions, build_sim_engine
from rps_astro_cli.engine.sim_engine import SimEngine
from rps_astro_cli.engine.vllm_bridge import ENV_POLICY, ENV_POLICY_PARAMS, ENV_PROFILE_ID, policy_from_env
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.policies import build_instance_policy, make_policy
from rps_astro_cli.sim.profile import load_profile
from rps_astro_cli.sim.request import SimRequest

LLAVA = "llava-onevision-7b-a100"


def _requests() -> list[SimRequest]:
    """text (short, long), image (729 vision tokens), video (32 frames × 196), one
    arrival order; fresh objects each call (policies label `req_class` in place)."""
    return [
        SimRequest("video", 0.0, 6300, 700, modality="video", vision_tokens=6272, encoder_s=0.03),
        SimRequest("image", 0.1, 760, 140, modality="image", vision_tokens=729, encoder_s=0.02),
        SimRequest("text-long", 0.2, 3000, 300),
        SimRequest("text", 0.3, 40, 100),
    ]


def _decisions(policy) -> dict:
    reqs = _requests()
    out: dict = {"order": [r.request_id for r in policy.order_waiting(reqs, now_s=1.0)]}
    if hasattr(policy, "classify"):
        out["classes"] = [policy.classify(r) for r in _requests()]
    if hasattr(policy, "deadline"):
        out["deadlines"] = [round(policy.deadline(r), 9) for r in _requests()]
    victim = policy.preemption_victim(_requests(), now_s=1.0)
    out["victim"] = victim.request_id
    return out


def _paths(name: str, params: dict) -> dict[str, object]:
    prof = load_profile(LLAVA)
    env = {ENV_POLICY: name, ENV_POLICY_PARAMS: json.dumps(params), ENV_PROFILE_ID: LLAVA}
    serve = (SimEngine(prof, policy=name).policy if not params else
             build_sim_engine(EngineOptions(profile=LLAVA, instance_policy=name, instance_policy_params=params)).policy)
    return {
        "serve (sim engine)": serve,
        "serve (build_sim_engine)": build_sim_engine(
            EngineOptions(profile=LLAVA, instance_policy=name, instance_policy_params=params)).policy,
        "vllm plugin (policy_from_env)": policy_from_env(env),
        "bench --virtual": instance_policy_factory(name, params, prof)(),
    }


@pytest.mark.parametrize("name,params", [("rps", {}), ("static_class", {}), ("edf", {}), ("edf", {"slo_scale": 3}),
                                         ("naive_class", {}), ("fcfs", {})])
def test_every_path_makes_the_same_decisions(name, params):
    ref = _decisions(build_instance_policy(name, params, LLAVA))
    for path, pol in _paths(name, params).items():
        assert _decisions(pol) == ref, path


def test_the_profile_changes_the_decisions_so_the_comparison_can_fail():
    # rps on the LLaVA profile uses its shipped classifier, which labels the 729-token image
    # differently from the naive modality class (pebbles); without the profile it is naive.
    smart = _decisions(build_instance_policy("rps", {}, LLAVA))
    naive = _decisions(build_instance_policy("rps", {}, None))
    assert naive["classes"] == ["rocks", "pebbles", "sand", "sand"]
    assert smart["classes"] != naive["classes"]
    # edf: deadline = arrival + 5 × isolated E2E on the run's profile, not the default Llama one
    llava = _decisions(build_instance_policy("edf", {}, LLAVA))["deadlines"]
    llama = _decisions(build_instance_policy("edf", {}, "llama-2-7b-a30"))["deadlines"]
    assert llava != llama
    # explicit parameters win over the profile's defaults
    forced = build_instance_policy("rps", {"classifier": "naive"}, LLAVA)
    assert _decisions(forced)["classes"] == naive["classes"]


def test_bench_virtual_records_carry_the_builders_classes(monkeypatch):
    """A real virtual run (mix-mh, rps, the LLaVA profile): every record's class is the one
    the builder's policy gives that request, and differs from the naive classes somewhere."""
    import rps_astro_cli.policies.build as build
    from rps_astro_cli.bench.config import BenchConfig
    from rps_astro_cli.bench.virtual import VirtualTarget
    from rps_astro_cli.bench.workload_base import WorkloadOptions
    from rps_astro_cli.bench.workloads import load_workload
    from rps_astro_cli.tokens import load_counter

    built: list[dict] = []
    real = build.build_instance_policy
    monkeypatch.setattr(build, "build_instance_policy",
                        lambda *a, **k: built.append(real(*a, **k).describe()) or real(*a, **k))
    cfg = BenchConfig.flat(workload="mix-mh", num_requests=16, seed=3, request_rate=2.0, virtual=True,
                           instances=1, profile=LLAVA, instance_policy="rps", oracle_lengths=True)
    counter = load_counter(None)
    wl = load_workload("mix-mh", WorkloadOptions(num_requests=16, counter=counter), np.random.default_rng(3))
    tgt = VirtualTarget(cfg, wl, counter)
    tgt.use_policy("round_robin", None)
    times = [0.02 * i for i in range(len(wl.requests))]  # a burst: the policy orders a queue
    vreqs, _ = tgt.virtual_requests(times)
    recs, _ = tgt.run(wl.requests, times, lambda r: None)
    pol = build_instance_policy("rps", {}, LLAVA)
    expected = {v.request_id: pol.classify(SimRequest(v.request_id, v.arrival_s, v.prompt_tokens, v.output_tokens,
                                                      modality=v.modality, vision_tokens=v.vision_tokens))
                for v in vreqs}
    done = [r for r in recs if r.success and r.class_source == "engine"]  # the policy labelled them
    assert len(done) >= len(recs) // 2
    assert {r.request_id: r.req_class for r in done} == {r.request_id: expected[r.request_id] for r in done}
    assert built and all(d["classifier"] == LLAVA for d in built)  # the shipped smart classifier, not naive


def test_simulate_builds_through_the_builder_with_its_profile(monkeypatch, tmp_path):
    import rps_astro_cli.policies as policies
    from rps_astro_cli.cli.main import app

    calls: list[tuple] = []
    real = policies.build_instance_policy

    def spy(name, params, profile, fields=None):
        calls.append((name, dict(params or {}), getattr(profile, "profile_id", profile)))
        return real(name, params, profile, fields=fields)

    monkeypatch.setattr(policies, "build_instance_policy", spy)
    trace = tmp_path / "t.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n100,20\n3000,50\n40,10\n")
    res = CliRunner().invoke(app, ["simulate", "--path", str(trace), "-n", "6", "--request-rate", "4",
                                   "--instances", "1",
                                   "--profile", LLAVA, "--instance-policy", "edf", "--out", str(tmp_path / "r.jsonl")])
    assert res.exit_code == 0, res.output
    assert calls and all(c == ("edf", {}, LLAVA) for c in calls)


def test_unknown_profile_for_the_vllm_plugin_is_one_line_naming_the_variable():
    with pytest.raises(AstroUserError) as exc:
        policy_from_env({ENV_POLICY: "rps", ENV_PROFILE_ID: "no-such-profile"})
    assert exc.value.field == ENV_PROFILE_ID


def test_make_policy_is_still_the_profile_free_constructor():
    assert make_policy("rps").describe()["classifier"] == "naive"
    assert np.isfinite(make_policy("edf").deadline(SimRequest("x", 0.0, 10, 10)))
