"""The jump look-ahead (`predict`) equals the step-by-step reference (`predict_stepwise`)
on randomized snapshots (issue 2 §4), plus hand-computed look-ahead cases."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import linear_profile
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.sim import lookahead
from rps_astro_cli.sim.fcfs import FCFSPolicy
from rps_astro_cli.sim.instance import InstanceSim
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.lookahead import predict, predict_instance, predict_stepwise
from rps_astro_cli.sim.policy import InstancePolicy
from rps_astro_cli.sim.profile import ExecutionProfile
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.sim.status import snapshot
from rps_astro_cli.types import CandidateRequest, InstanceConfig, InstanceStatus, RequestStatus

HAND = linear_profile()


class ShortestPromptFirst(InstancePolicy):
    """Test policy: static order (not time-dependent), non-FCFS victim."""

    name = "spf"
    time_dependent = False

    def order_waiting(self, waiting: Sequence[SimRequest], now_s: float) -> list[SimRequest]:
        return sorted(waiting, key=lambda r: (r.prompt_tokens, r.request_id))

    def preemption_victim(self, running: Sequence[SimRequest], now_s: float) -> SimRequest:
        return max(running, key=lambda r: (r.num_tokens, r.request_id))


class Aging(InstancePolicy):
    """Test policy: order changes with time (like RPS aging); victim = oldest arrival."""

    name = "aging"
    time_dependent = True

    def order_waiting(self, waiting: Sequence[SimRequest], now_s: float) -> list[SimRequest]:
        return sorted(waiting, key=lambda r: (r.prompt_tokens - 2000.0 * (now_s - r.arrival_s), r.request_id))

    def preemption_victim(self, running: Sequence[SimRequest], now_s: float) -> SimRequest:
        return min(running, key=lambda r: (r.arrival_s, r.request_id))


POLICIES = {"fcfs": FCFSPolicy, "spf": ShortestPromptFirst, "aging": Aging}


@st.composite
def scenarios(draw):
    prof = ExecutionProfile(
        profile_id="rand", model="m", gpu="g", tp=1,
        base_s=draw(st.floats(0.002, 0.02)), per_seq_s=draw(st.sampled_from([0.0, 5e-5])),
        token_knots=(0, 128, 512, 4096), token_s=(0.0, 0.002, 0.01, 0.08),
        decode_attn_s_per_ctx_token=draw(st.sampled_from([0.0, 1e-7, 7e-7])),
        prefill_attn_s_per_token_pair=draw(st.sampled_from([0.0, 1e-8])),
    )
    bs = draw(st.sampled_from([4, 16]))
    max_len = 512
    blocks = draw(st.integers(max_len // bs, 6 * max_len // bs))  # small pools force preemption
    cfg = InstanceConfig(
        block_size=bs, num_gpu_blocks=blocks, max_num_seqs=draw(st.integers(1, 12)),
        max_num_batched_tokens=draw(st.sampled_from([16, 64, 128, 512])), max_model_len=max_len,
        chunked_prefill=draw(st.booleans()),
    )
    now = draw(st.floats(0.0, 5.0))
    running, used = [], 0
    for i in range(draw(st.integers(0, cfg.max_num_seqs))):
        p = draw(st.integers(1, 200))
        if draw(st.integers(0, 4)) > 0:  # decoding
            g = draw(st.integers(1, 120))
            c = p + g - 1
        else:  # partial prefill (or a recompute in progress)
            g = draw(st.sampled_from([0, 0, 3]))
            c = draw(st.integers(0, p + g - 1))
        # KV blocks for the computed tokens; sometimes more (a snapshot taken with
        # look-ahead slots) or fewer (topped up by the next allocation)
        kv = max(0, -(-c // bs) + draw(st.sampled_from([0, 0, 0, 0, 0, 1, 3, -1])))
        if used + kv > blocks:
            break
        used += kv
        pred = draw(st.one_of(st.none(), st.integers(1, 150)))  # None -> default length
        running.append(RequestStatus(f"r{i}", draw(st.floats(0.0, now)), p, c, g, pred, kv_blocks=kv,
                                     encoder_s=draw(st.sampled_from([0.0, 0.0, 0.01]))))
    waiting = []
    for i in range(draw(st.integers(0, 12))):
        p = draw(st.integers(1, 250))
        g = draw(st.sampled_from([0, 0, 0, 7]))  # g > 0: a preempted-like entry
        waiting.append(RequestStatus(f"w{i}", draw(st.floats(0.0, now)), p, 0, g,
                                     draw(st.one_of(st.none(), st.integers(1, 150))),
                                     encoder_s=draw(st.sampled_from([0.0, 0.0, 0.02]))))
    status = InstanceStatus("i", now, cfg, blocks - used, tuple(running), tuple(waiting))
    cand = CandidateRequest(
        prompt_tokens=draw(st.integers(1, 200)), predicted_output_tokens=draw(st.integers(1, 150)),
        preprocess_s=draw(st.sampled_from([0.0, 0.05, 0.3])) + draw(st.floats(0.0, 1e-3)),
        encoder_s=draw(st.sampled_from([0.0, 0.03])),
    )
    kw = {"extension_tokens": draw(st.sampled_from([10, 2])),
          "default_output_tokens": draw(st.sampled_from([256, 30]))}
    return LatencyModel(prof), status, cand, kw


def _same(a, b) -> None:
    assert b.steps_simulated == a.steps_simulated
    assert b.ttft_s == pytest.approx(a.ttft_s, rel=1e-9, abs=1e-12)
    assert b.e2e_s == pytest.approx(a.e2e_s, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_jump_equals_stepwise(policy: str, sc) -> None:
    lat, status, cand, kw = sc
    ref = predict_stepwise(status, cand, lat, POLICIES[policy](), **kw)
    got = predict(status, cand, lat, POLICIES[policy](), **kw)
    _same(ref, got)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios())
def test_first_token_only_keeps_the_ttft(policy: str, sc) -> None:
    # nothing before the candidate's first token depends on how long it then decodes:
    # stopping there gives the full look-ahead's TTFT, on both look-aheads
    lat, status, cand, kw = sc
    full = predict(status, cand, lat, POLICIES[policy](), **kw)
    short = predict(status, cand, lat, POLICIES[policy](), first_token_only=True, **kw)
    ref = predict_stepwise(status, cand, lat, POLICIES[policy](), first_token_only=True, **kw)
    assert short.ttft_s == pytest.approx(full.ttft_s, rel=1e-9, abs=1e-12)
    assert short.e2e_s == short.ttft_s
    assert short.steps_simulated <= full.steps_simulated
    _same(ref, short)


def test_first_token_only_stops_at_the_first_token() -> None:
    # hand-computed: an empty instance, a 100-token prompt and 50 predicted tokens; the
    # full look-ahead runs the prefill step and 49 decode steps, the short one the prefill:
    # 10 ms + 100 tokens × 0.1 ms = 20 ms
    lat = LatencyModel(HAND)
    status = InstanceStatus("i", 0.0, InstanceConfig(max_model_len=2048), 1000, (), ())
    full = predict(status, CandidateRequest(100, 50), lat, FCFSPolicy())
    short = predict(status, CandidateRequest(100, 50), lat, FCFSPolicy(), first_token_only=True)
    assert (full.steps_simulated, short.steps_simulated) == (50, 1)
    assert short.ttft_s == short.e2e_s == full.ttft_s == pytest.approx(0.020)


def test_jump_takes_few_events_on_a_long_decode_run() -> None:
    # 8 decoders with 1000 tokens to go and an empty queue: a handful of events, 1000+ steps.
    cfg = InstanceConfig(max_model_len=4096)
    running = tuple(RequestStatus(f"r{i}", 0.0, 100, 100 + i, i + 1, 1000 + i, kv_blocks=-(-(100 + i) // 16))
                    for i in range(8))
    status = InstanceStatus("i", 0.0, cfg, cfg.num_gpu_blocks - sum(r.kv_blocks for r in running), running)
    lat = LatencyModel(HAND)
    cand = CandidateRequest(50, 1200)
    ref = predict_stepwise(status, cand, lat, FCFSPolicy())
    got = predict(status, cand, lat, FCFSPolicy())
    _same(ref, got)
    assert got.steps_simulated == 1200 and got.events < 40


def test_hand_computed_lookahead() -> None:
    # Running: R (prompt 10, 5 generated, predicted 7 -> 2 more decodes). Candidate: 100-token
    # prompt, 3 predicted tokens, arriving now. Step latency 10 ms + 0.1 ms/token.
    # step 1: R 1 + cand 100 = 101 tok -> 0.0201 (cand's 1st token; R at 6)
    # step 2: R 1 + cand 1 -> 0.0102 (R done at 7)      step 3: cand 1 -> 0.0101 (done)
    # TTFT 0.0201, E2E 0.0201 + 0.0102 + 0.0101 = 0.0404.
    cfg = InstanceConfig(max_model_len=4096)
    status = InstanceStatus("i", 2.0, cfg, cfg.num_gpu_blocks - 1,
                            (RequestStatus("R", 1.0, 10, 14, 5, 7, kv_blocks=1),))
    for fn in (predict, predict_stepwise):
        est = fn(status, CandidateRequest(100, 3), LatencyModel(HAND), FCFSPolicy())
        assert est.ttft_s == pytest.approx(0.0201, abs=1e-12)
        assert est.e2e_s == pytest.approx(0.0404, abs=1e-12)
        assert est.steps_simulated == 3


def test_auto_extension_past_predicted_length() -> None:
    # R has generated 9 tokens but was predicted 5 -> assumed to end within 10 more:
    # target 19 -> 10 more decodes. Candidate (10 prompt, 1 token) arrives after 0.05 s of
    # preprocessing: steps of R alone take 0.0101 s; the 5th step ends at 0.0505 >= 0.05,
    # so the 6th step admits the candidate (R 1 + cand 10 = 11 tok -> 0.0111).
    # TTFT = E2E = 0.0505 + 0.0111 = 0.0616.
    cfg = InstanceConfig(max_model_len=4096)
    status = InstanceStatus("i", 0.0, cfg, cfg.num_gpu_blocks - 2,
                            (RequestStatus("R", 0.0, 10, 18, 9, 5, kv_blocks=2),))
    for fn in (predict, predict_stepwise):
        est = fn(status, CandidateRequest(10, 1, preprocess_s=0.05), LatencyModel(HAND), FCFSPolicy())
        assert est.ttft_s == pytest.approx(0.0616, abs=1e-12)
        assert est.e2e_s == pytest.approx(0.0616, abs=1e-12)


def test_predict_instance_matches_snapshot_path_and_hides_true_lengths() -> None:
    cfg = InstanceConfig(block_size=16, num_gpu_blocks=64, max_num_seqs=8, max_num_batched_tokens=128,
                         max_model_len=512)
    lat = LatencyModel(HAND)
    inst = InstanceSim(cfg, lat, FCFSPolicy())
    for i in range(6):
        # true length 300 (what the engine will generate), predicted 40 (what the Predictor sees)
        inst.add(SimRequest(f"q{i}", 0.0, 60 + 10 * i, 300, predicted_output_tokens=40))
    t = 0.0
    for _ in range(7):
        t += inst.step(t).duration_s
    cand = CandidateRequest(80, 20)
    a = predict(snapshot("x", t, inst), cand, lat, FCFSPolicy())
    b = predict_instance(inst, t, cand)
    assert (a.ttft_s, a.e2e_s, a.steps_simulated) == (b.ttft_s, b.e2e_s, b.steps_simulated)
    assert inst.running and all(r.num_computed_tokens > 0 for r in inst.running)  # state untouched


def test_candidate_too_long_is_a_user_error() -> None:
    cfg = InstanceConfig(max_model_len=256, num_gpu_blocks=16)
    status = InstanceStatus("i", 0.0, cfg, 16)
    with pytest.raises(AstroUserError, match="max_model_len"):
        predict(status, CandidateRequest(200, 100), LatencyModel(HAND), FCFSPolicy())


def _seeded_scenario(g: np.random.Generator):
    """A snapshot under KV pressure: small pools, budgets smaller than many prompts."""
    prof = ExecutionProfile(
        profile_id="sweep", model="m", gpu="g", tp=1,
        base_s=float(g.uniform(0.005, 0.02)), per_seq_s=float(g.choice([0.0, 1e-4])),
        token_knots=(0, 128, 512, 4096), token_s=(0.0, 0.002, 0.01, 0.08),
        decode_attn_s_per_ctx_token=float(g.choice([0.0, 1e-7, 3e-7])),
        prefill_attn_s_per_token_pair=float(g.choice([0.0, 1e-9])),
    )
    bs = int(g.choice([4, 16]))
    max_len = 512
    blocks = int(g.integers(max_len // bs, 4 * max_len // bs + 1))
    cfg = InstanceConfig(block_size=bs, num_gpu_blocks=blocks, max_num_seqs=int(g.integers(2, 13)),
                         max_num_batched_tokens=int(g.choice([16, 24, 64, 128])), max_model_len=max_len)
    running, used = [], 0
    for i in range(int(g.integers(0, cfg.max_num_seqs + 1))):
        p = int(g.integers(1, 200))
        gen = int(g.integers(1, 100))
        c = p + gen - 1
        kv = -(-c // bs)
        if used + kv > blocks:
            break
        used += kv
        running.append(RequestStatus(f"r{i}", 0.0, p, c, gen, int(g.integers(1, 150)), kv_blocks=kv))
    waiting = tuple(RequestStatus(f"w{i}", 0.0, int(g.integers(1, 300)), 0, 0, int(g.integers(1, 150)),
                                  encoder_s=float(g.choice([0.0, 0.0, 0.02])))
                    for i in range(int(g.integers(0, 16))))
    status = InstanceStatus("i", 1.0, cfg, blocks - used, tuple(running), waiting)
    cand = CandidateRequest(int(g.integers(1, 200)), int(g.integers(1, 150)),
                            preprocess_s=float(g.choice([0.0, 0.2])) + float(g.uniform(0, 1e-3)))
    return LatencyModel(prof), status, cand


def test_jump_equals_stepwise_seeded_sweep() -> None:
    # A deterministic sweep of the KV-pressure regime (admit / continue / preempt cycles),
    # where boundary conditions of the fast paths are exercised most.
    g = np.random.default_rng(2024)
    for _ in range(400):
        lat, status, cand = _seeded_scenario(g)
        _same(predict_stepwise(status, cand, lat, FCFSPolicy()), predict(status, cand, lat, FCFSPolicy()))


# --- the engine package (sim/lookahead_engine/), compiled by mypyc at install or interpreted --

def _source_engine():
    """sim/lookahead_engine/ loaded from its source under another package name: the
    interpreted engine, whatever the install built."""
    from rps_astro_cli.sim import engine_build

    return engine_build.load_source("rps_astro_cli.sim._engine_source_for_test")


def test_engine_request_mirrors_simrequest_fields() -> None:
    # LReq is SimRequest's field list (same order, so the same positional constructor)
    # plus the pool bookkeeping; InstanceSim and the policies step it as a SimRequest.
    # The prefix-cache fields are not mirrored: the look-ahead's InstanceSim runs with
    # caching off and never reads them (the candidate's hit comes as computed tokens).
    cache_fields = {"block_hashes", "cache_refs", "hashed_blocks", "num_cached_tokens"}
    names = [f.name for f in dataclasses.fields(SimRequest) if f.name not in cache_fields]
    for engine in (lookahead.engine, _source_engine()):
        args = ("a", 1.5, 20, 30, "image", 4, 0.25, "rocks", 7, 9.0, 5, 6, 2)
        r, lr = SimRequest(*args), engine.LReq(*args)
        for n in names:  # every SimRequest field, with the same value
            assert getattr(lr, n) == getattr(r, n), n
        assert (lr.pool_g, lr.pool_seq) == (-1, 0)
        assert (lr.num_tokens, lr.is_prefilling, lr.finished) == (r.num_tokens, r.is_prefilling, r.finished)


def test_compiled_and_source_engines_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    # The mypyc build must compute exactly what the source does (same IEEE double
    # operations in the same order), under every policy kind.
    if not lookahead.NATIVE:
        pytest.skip("this install has no mypyc build of sim/lookahead_engine/ (the source is what runs)")
    native, source = lookahead.engine, _source_engine()
    g = np.random.default_rng(11)
    for _ in range(120):
        lat, status, cand = _seeded_scenario(g)
        for pol in (FCFSPolicy(), ShortestPromptFirst(), Aging()):
            monkeypatch.setattr(lookahead, "engine", native)
            a = predict(status, cand, lat, pol)
            monkeypatch.setattr(lookahead, "engine", source)
            b = predict(status, cand, lat, pol)
            assert a == b


def test_a_build_older_than_any_engine_file_is_stale(tmp_path) -> None:
    # engine_build imports the build only when every module of the package has one no
    # older than its source (2 s slack); else the whole package runs from source.
    import importlib.machinery
    import os

    from rps_astro_cli.sim import engine_build

    ext = importlib.machinery.EXTENSION_SUFFIXES[0]
    for m in ("__init__", "pool", "engine"):
        (tmp_path / f"{m}.py").write_text("")
    assert engine_build.build_state(tmp_path) == "none"
    for m in ("__init__", "pool", "engine"):
        (tmp_path / f"{m}{ext}").write_bytes(b"")
        os.utime(tmp_path / f"{m}.py", (1000.0, 1000.0))
        os.utime(tmp_path / f"{m}{ext}", (1001.5, 1001.5))
    assert engine_build.build_state(tmp_path) == "current"
    os.utime(tmp_path / "pool.py", (1003.0, 1003.0))  # edited 1.5 s after its build: within the slack
    assert engine_build.build_state(tmp_path) == "current"
    os.utime(tmp_path / "pool.py", (1004.0, 1004.0))  # 2.5 s after: stale
    assert engine_build.build_state(tmp_path) == "stale"
    os.utime(tmp_path / "pool.py", (1000.0, 1000.0))
    (tmp_path / "new_module.py").write_text("")  # a module the build does not have
    assert engine_build.build_state(tmp_path) == "stale"


def test_ci_runs_the_build() -> None:
    # Where the install was required to compile the engine (.ci/run), the look-ahead
    # must run that build: a silent fall-back to the source would hide a broken build.
    import os

    if os.environ.get("ASTRO_REQUIRE_BUILD") != "1" and os.environ.get("CI", "").lower() != "true":
        pytest.skip("the build is required only in CI (ASTRO_REQUIRE_BUILD=1 or CI=true)")
    if os.environ.get("ASTRO_PURE_PYTHON") == "1":
        pytest.skip("ASTRO_PURE_PYTHON=1: the source runs on purpose")
    assert lookahead.NATIVE


def test_pure_python_switch() -> None:
    # ASTRO_PURE_PYTHON=1 runs the source even where a build exists.
    import os
    import subprocess
    import sys

    code = ("from rps_astro_cli.sim import lookahead as L; import sys; "
            "print(L.NATIVE, all(m.__file__.endswith('.py') for n, m in sys.modules.items() "
            "if n.startswith('rps_astro_cli.sim.lookahead_engine')))")
    env = {**os.environ, "ASTRO_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


# --- policies whose order is a sort key: the look-ahead keeps its queue sorted ----------

def _mixed(g: np.random.Generator, status: InstanceStatus, modalities: tuple[str, ...]) -> InstanceStatus:
    """The snapshot with arrivals spread over the last second (ties kept: 0.25 s grid)
    and modalities drawn from `modalities` (image/video requests get vision tokens)."""
    def redo(r: RequestStatus) -> RequestStatus:
        m = str(g.choice(modalities))
        return dataclasses.replace(r, arrival_s=float(g.integers(0, 5)) * 0.25, modality=m,
                                   vision_tokens=0 if m == "text" else min(r.prompt_tokens, 150))
    return dataclasses.replace(status, running=tuple(map(redo, status.running)),
                               waiting=tuple(map(redo, status.waiting)))


KEYED = ["naive_aging", "naive_class", "static_class", "edf", "rps"]


@pytest.mark.parametrize("name", KEYED)
def test_order_and_victim_keys_give_the_policy_decisions(name: str) -> None:
    # The `order_key` / `victim_key` contracts: any subset, any queue order, any time →
    # the policy's order is the stable sort by key, its victim the largest (key, index).
    from rps_astro_cli.policies import make_policy

    g = np.random.default_rng(3)
    for trial in range(60):
        mods = ("text",) if trial % 2 else ("text", "image", "video")
        reqs = [SimRequest(f"q{i}", float(g.integers(0, 6)) * 0.5, int(g.integers(1, 300)), 10,
                           modality=str(g.choice(mods)), vision_tokens=int(g.integers(0, 100)))
                for i in range(int(g.integers(2, 30)))]
        pol = make_policy(name)
        key = pol.order_key(reqs)
        if key is None:  # only rps, only with mixed classes
            assert name == "rps" and len({pol.classify(r) for r in reqs}) > 1
            continue
        vkey = pol.victim_key(reqs)
        assert vkey is not None
        for now in (3.0, 3.7, 50.0, 1e4):
            sub = [r for r in reqs if g.random() < 0.7] or reqs[:1]
            g.shuffle(sub)
            assert pol.order_waiting(sub, now) == sorted(sub, key=key)
            best = max(range(len(sub)), key=lambda i: (vkey(sub[i]), i))
            assert pol.preemption_victim(sub, now) is sub[best]


@pytest.mark.parametrize("name", KEYED)
def test_keyed_policies_jump_equals_stepwise(name: str) -> None:
    # Under KV pressure (admit / preempt / readmit), one class and mixed classes.
    from rps_astro_cli.policies import make_policy

    g = np.random.default_rng(17)
    for trial in range(160):
        lat, status, cand = _seeded_scenario(g)
        status = _mixed(g, status, ("text",) if trial % 2 else ("text", "image", "video"))
        pol = make_policy(name, profile=lat.profile) if name == "edf" else make_policy(name)
        _same(predict_stepwise(status, cand, lat, pol), predict(status, cand, lat, pol))


def test_rps_order_and_victim_groups_with_mixed_classes() -> None:
    # `order_groups`: each class appears oldest first (queue order on ties) in the
    # policy's order; `victim_groups`: the victim is the one chosen among each class's
    # youngest. Any subset, any queue order, times from "just arrived" to saturated P.
    from rps_astro_cli.policies import make_policy

    pol = make_policy("rps")
    g = np.random.default_rng(23)
    for _ in range(200):
        reqs = [SimRequest(f"q{i}", float(g.integers(0, 40)) * 0.25, int(g.integers(1, 300)), 10,
                           modality=str(g.choice(("text", "image", "video"))))
                for i in range(int(g.integers(2, 40)))]
        groups, vgroups = pol.order_groups(reqs), pol.victim_groups(reqs)
        for now in (10.0, 12.3, 60.0, 1e3):
            sub = [r for r in reqs if g.random() < 0.7] or reqs[:1]
            g.shuffle(sub)
            order = pol.order_waiting(sub, now)
            for cls in {groups(r)[0] for r in sub}:
                members = [r for r in sub if groups(r)[0] == cls]
                assert [r for r in order if groups(r)[0] == cls] == sorted(members, key=lambda r: groups(r)[1])
            best: dict = {}
            for i, r in enumerate(sub):
                c, k = vgroups(r)
                if c not in best or not k < vgroups(sub[best[c]])[1]:
                    best[c] = i
            reps = [sub[i] for i in sorted(best.values())]
            assert pol.preemption_victim(sub, now) is pol.preemption_victim(reps, now)


# --- requests still in preprocessing (`InstanceStatus.arriving`) -----------------------

def _with_arriving(g: np.random.Generator, status: InstanceStatus) -> InstanceStatus:
    """The snapshot plus 0–4 requests still in preprocessing, ready from 'now' (or
    earlier: it must then join at once) to 0.4 s ahead, some at the same time."""
    now = status.time_s
    arriving = tuple(
        RequestStatus(f"a{i}", now - 0.1, int(g.integers(1, 300)), predicted_output_tokens=int(g.integers(1, 150)),
                      modality=str(g.choice(("text", "image"))), encoder_s=float(g.choice([0.0, 0.02])),
                      ready_s=now + float(g.choice([-0.05, 0.0, 0.1, 0.1, 0.25, 0.4])))
        for i in range(int(g.integers(0, 5))))
    return dataclasses.replace(status, arriving=arriving)


@pytest.mark.parametrize("name", ["fcfs", "spf", "aging", *KEYED])
def test_arriving_requests_jump_equals_stepwise(name: str) -> None:
    from rps_astro_cli.policies import make_policy

    g = np.random.default_rng(31)
    for trial in range(120):
        lat, status, cand = _seeded_scenario(g)
        status = _with_arriving(g, _mixed(g, status, ("text",) if trial % 2 else ("text", "image")))
        if name in POLICIES:
            pol = POLICIES[name]()
        else:
            pol = make_policy(name, profile=lat.profile) if name == "edf" else make_policy(name)
        _same(predict_stepwise(status, cand, lat, pol), predict(status, cand, lat, pol))


def test_a_request_in_preprocessing_delays_the_candidate() -> None:
    # Hand-made: empty instance, step = 10 ms + 0.1 ms/token. A 100-token request ready
    # at 0.05 s and the candidate (100 tokens, 2 output tokens) arriving at 0.1 s.
    # Without the arriving request: prefill at 0.1 → first token at 0.1 + 0.020.
    # With it: its prefill 0.05–0.07, decodes of 0.0101 s end at 0.0801, 0.0902, 0.1003;
    # the candidate (arrived at 0.1) joins the step from 0.1003: 100 + 1 tokens, 0.0201 s
    # → first token at 0.1204; its decode beside a's: 2 tokens, 0.0102 s → 0.1306.
    cfg = InstanceConfig(max_model_len=4096)
    lat = LatencyModel(HAND)
    cand = CandidateRequest(100, 2, preprocess_s=0.1)
    bare = InstanceStatus("i", 0.0, cfg, cfg.num_gpu_blocks)
    a = RequestStatus("a", 0.0, 100, predicted_output_tokens=50, ready_s=0.05)
    busy = dataclasses.replace(bare, arriving=(a,))
    for predict_fn in (predict_stepwise, predict):
        e0 = predict_fn(bare, cand, lat, FCFSPolicy())
        e1 = predict_fn(busy, cand, lat, FCFSPolicy())
        assert e0.ttft_s == pytest.approx(0.1 + 0.020, abs=1e-12)
        assert e1.ttft_s == pytest.approx(0.1204, abs=1e-12)
        assert e1.e2e_s == pytest.approx(0.1306, abs=1e-12)
