"""`rps` with mixed classes in the Predictor's look-ahead (issue 15): the policy's waiting
order is the merge of its classes (each oldest first) by the heads' −P (`order_merge_key`),
and the look-ahead asks for the key of class heads only (`InstanceView.merged`,
`MergeCursor`) instead of for the whole order at every step. Its estimates must equal the
step-by-step reference and the compiled engine the interpreted one."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from rps_astro_cli.policies import make_policy
from rps_astro_cli.policies import rps as rps_module
from rps_astro_cli.policies.build import build_instance_policy
from rps_astro_cli.sim import engine_build, lookahead
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.lookahead import predict, predict_stepwise
from rps_astro_cli.sim.profile import load_profile
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.types import CandidateRequest, InstanceConfig, InstanceStatus, RequestStatus

MODALITIES = ("text", "image", "video")


def _reqs(g: np.random.Generator, n: int, grid_s: float = 0.25) -> list[SimRequest]:
    """n requests of mixed modalities, arrivals on a grid (ties between and inside classes)."""
    return [SimRequest(f"q{i}", float(g.integers(0, 40)) * grid_s, int(g.integers(1, 300)), 10,
                       modality=str(g.choice(MODALITIES))) for i in range(n)]


def _merge_reference(pol, ws: list[SimRequest], now: float) -> list[SimRequest]:
    """The `order_merge_key` contract, literally: each group in its group order (stable:
    queue order on ties), then repeatedly the head with the smallest (key, group key,
    queue position)."""
    groups, key = pol.order_groups(ws), pol.order_merge_key(ws)
    pos = {id(r): i for i, r in enumerate(ws)}
    by: dict = {}
    for r in ws:
        by.setdefault(groups(r)[0], []).append(r)
    lists = [sorted(v, key=lambda r: groups(r)[1]) for v in by.values()]
    out = []
    while any(lists):
        heads = [(key(gl[0], now), groups(gl[0])[1], pos[id(gl[0])], j) for j, gl in enumerate(lists) if gl]
        j = min(heads)[3]
        out.append(lists[j].pop(0))
    return out


def test_neg_priority_is_the_regulators_priority_bit_for_bit() -> None:
    # The look-ahead's key and the policy's order use −P computed with the regulator's
    # own floating-point operations: equal bit for bit, from "not yet arrived" to saturated.
    g = np.random.default_rng(5)
    for params in ({}, {"static_priority": [0.3, 0.3, 0.3], "alpha": [1.0, 2.0, 0.7], "beta": [0.5, 0.1, 2.0]}):
        pol = make_policy("rps", **params)
        for _ in range(3000):
            r = SimRequest("x", float(g.uniform(0, 100)), 10, 1, modality=str(g.choice(MODALITIES)))
            now = r.arrival_s + float(g.choice([-1.0, 0.0, 1e-9, 0.3, 2.0, 7.5, 40.0, 1e4])) * float(g.uniform(0, 1))
            c = pol.classify(r)
            assert pol.neg_priority(r, now) == -pol.regulator.priority(c, now - r.arrival_s)


@pytest.mark.parametrize("params", [{}, {"static_priority": [0.2, 0.2, 0.2], "alpha": [2.0, 2.0, 2.0],
                                         "beta": [0.5, 0.5, 0.5]}])
def test_rps_order_is_the_merge_of_its_classes(params: dict) -> None:
    # Any subset, any queue order, any time. With equal parameters for every class the
    # heads tie on −P whenever their waits are equal, so the tie rules (arrival, then
    # queue position) decide.
    pol = make_policy("rps", **params)
    g = np.random.default_rng(41)
    for _ in range(150):
        reqs = _reqs(g, int(g.integers(2, 60)))
        for now in (5.0, 9.1, 60.0, 1e3):
            sub = [r for r in reqs if g.random() < 0.7] or reqs[:2]
            g.shuffle(sub)
            assert pol.order_waiting(sub, now) == _merge_reference(pol, sub, now)


def test_rps_order_merges_even_when_priority_rounds_against_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    # A P that is not monotone in the wait (as a rounding step of exp/pow could make it):
    # the sort by (−P, arrival, position) would put a younger request of a class before an
    # older one; the order stays the merge (each class oldest first).
    class Wiggly:
        inf = math.inf

        @staticmethod
        def exp(x: float) -> float:
            return math.exp(x) * (1.0 + 0.2 * math.sin(40.0 * x))

    monkeypatch.setattr(rps_module, "math", Wiggly)
    pol = make_policy("rps", alpha=[1.0, 1.0, 1.0], beta=[0.5, 0.3, 0.2])
    g = np.random.default_rng(8)
    differs = 0
    for _ in range(60):
        reqs = _reqs(g, 30, grid_s=0.05)
        now = 3.0
        order = pol.order_waiting(reqs, now)
        assert order == _merge_reference(pol, reqs, now)
        by_sort = sorted(range(len(reqs)), key=lambda i: (pol.neg_priority(reqs[i], now), reqs[i].arrival_s, i))
        differs += [reqs[i] for i in by_sort] != order
    assert differs > 0  # the fall-back ran


def _labelled(pol, r: RequestStatus) -> RequestStatus:
    """As the engine's /status reports it: with the class the policy gave it."""
    return dataclasses.replace(r, req_class=pol.classify(SimRequest(r.request_id, 0.0, r.prompt_tokens, 1,
                                                                    modality=r.modality,
                                                                    vision_tokens=r.vision_tokens)))


def _mm_snapshot(g: np.random.Generator, cfg: InstanceConfig, n_run: int, n_wait: int):
    """A multimodal snapshot on the LLaVA profile's limits, KV scaled down so that it runs
    short: text, one image (729 vision tokens) or an 8-frame video (1,568), arrivals over
    the last 2 s (on a 0.1 s grid: ties), some queued requests preempted ones."""
    bs = cfg.block_size
    running, used = [], 0
    def media() -> tuple[str, int]:
        m = str(g.choice(MODALITIES, p=[0.4, 0.4, 0.2]))
        return m, {"text": 0, "image": 729, "video": 1568}[m]
    for i in range(n_run):
        m, v = media()
        p = int(g.integers(20, 600)) + v
        gen = int(g.integers(1, 200))
        c = p + gen - 1
        kv = -(-c // bs)
        if used + kv > cfg.num_gpu_blocks - 4:
            break
        used += kv
        running.append(RequestStatus(f"r{i}", float(g.integers(0, 20)) * 0.1, p, c, gen, int(g.integers(2, 300)),
                                     kv_blocks=kv, modality=m, vision_tokens=v))
    waiting = []
    for i in range(n_wait):
        m, v = media()
        gen = int(g.choice([0, 0, 0, 0, 5]))
        waiting.append(RequestStatus(f"w{i}", float(g.integers(0, 20)) * 0.1, int(g.integers(20, 900)) + v, 0, gen,
                                     int(g.integers(1, 300)), modality=m, vision_tokens=v))
    m, v = media()
    cand = CandidateRequest(int(g.integers(20, 600)) + v, int(g.integers(1, 200)), modality=m, vision_tokens=v,
                            preprocess_s=float(g.choice([0.0, 0.3])))
    status = InstanceStatus("i", 2.0, cfg, cfg.num_gpu_blocks - used, tuple(running), tuple(waiting))
    return status, cand


def _llava():
    prof = load_profile("llava-onevision-7b-a100")
    pol = build_instance_policy("rps", None, prof)  # the shipped smart classifier
    return prof, pol


def test_mixed_rps_lookahead_equals_stepwise_and_takes_the_merged_path() -> None:
    # The llava profile's limits (256 sequences, 2,048-token steps; a quarter of the
    # trials in prioritized-prefill mode) with small KV pools (preemptions under rps) and
    # its own (every queued request gets admitted).
    prof, pol = _llava()
    lat = LatencyModel(prof)
    base = InstanceConfig.from_profile(prof)
    g = np.random.default_rng(15)
    merged = 0
    for trial in range(24):
        cfg = dataclasses.replace(base, num_gpu_blocks=int(g.choice([600, 1500, base.num_gpu_blocks])),
                                  max_model_len=8192, chunked_prefill=trial % 4 != 3)
        status, cand = _mm_snapshot(g, cfg, int(g.integers(0, 24)), int(g.integers(2, 60)))
        if trial % 2:
            status = dataclasses.replace(status, running=tuple(_labelled(pol, r) for r in status.running),
                                         waiting=tuple(_labelled(pol, r) for r in status.waiting))
        ref = predict_stepwise(status, cand, lat, pol)
        got = predict(status, cand, lat, pol)
        assert got.steps_simulated == ref.steps_simulated
        assert got.ttft_s == pytest.approx(ref.ttft_s, rel=1e-9, abs=1e-12)
        assert got.e2e_s == pytest.approx(ref.e2e_s, rel=1e-9, abs=1e-12)
        eng = lookahead.engine
        run = eng.lreqs_from_status(status.running, 10, 256)
        wait = eng.lreqs_from_status(status.waiting, 10, 256)
        fl = eng.FastLookahead(cfg, lat, pol, run, wait, status.kv_blocks_free)
        fl.view.cache_policy_keys([])
        merged += fl.view.merged
    assert merged >= 20  # mixed classes almost always: the merged queue is what was tested


def test_mixed_rps_compiled_and_source_engines_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    if not lookahead.NATIVE:
        pytest.skip("this install has no mypyc build of sim/lookahead_engine/ (the source is what runs)")
    native = lookahead.engine
    source = engine_build.load_source("rps_astro_cli.sim._engine_source_for_merge_test")
    prof, pol = _llava()
    lat = LatencyModel(prof)
    base = InstanceConfig.from_profile(prof)
    g = np.random.default_rng(16)
    for _ in range(16):
        cfg = dataclasses.replace(base, num_gpu_blocks=int(g.choice([600, 1500, base.num_gpu_blocks])),
                                  max_model_len=8192, chunked_prefill=bool(g.random() < 0.75))
        status, cand = _mm_snapshot(g, cfg, int(g.integers(0, 24)), int(g.integers(2, 60)))
        monkeypatch.setattr(lookahead, "engine", native)
        a = predict(status, cand, lat, pol)
        monkeypatch.setattr(lookahead, "engine", source)
        b = predict(status, cand, lat, pol)
        assert a == b
