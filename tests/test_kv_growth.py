"""The KV headroom gate that counts the running requests' future KV growth (issue 13,
round 6) and the per-request-confidence remaining rule: hand-computed cases."""

from __future__ import annotations

import asyncio
import json

import numpy as np

import rps_astro_cli.types as t
from rps_astro_cli.dispatch import make_dispatch
from rps_astro_cli.dispatch.base import decide
from rps_astro_cli.dispatch.stages import KvHeadroomFilter
from rps_astro_cli.length.dist import CalibratedRemaining, ConfidentRemaining, LogSpreadCalibration
from rps_astro_cli.types import InstanceLoad, LatencyEstimate, kv_growth_peak_blocks

CFG = t.InstanceConfig(block_size=16, num_gpu_blocks=100, max_num_seqs=48, max_model_len=1024)


def test_peak_growth_counts_blocks_freed_by_requests_that_finish_first():
    # X: 160 tokens in 10 blocks, 32 to go → at its last step 192 tokens = 12 blocks;
    # Y: 16 tokens in 1 block, 100 to go → 48 tokens = 3 blocks at t = 32, 116 = 8 at t = 100.
    # Held H = 11. t = 32: 12 + 3 − 11 = 4; t = 100 (X has finished, its 10 blocks freed):
    # 8 − 11 = −3 → the peak is 4 blocks (the sum of each one's growth would be 2 + 7 = 9)
    assert kv_growth_peak_blocks([(160, 10, 32), (16, 1, 100)], 16) == 4
    # one request: 100 tokens in 7 blocks, 60 to go → 160 tokens = 10 blocks → 3
    assert kv_growth_peak_blocks([(100, 7, 60)], 16) == 3
    # a request still to prefill: 40 tokens, 0 blocks, nothing to decode → ceil(40/16) = 3
    assert kv_growth_peak_blocks([(40, 0, 0)], 16) == 3
    assert kv_growth_peak_blocks([], 16) == 0


def _status(name: str, free: int, running: tuple[t.RequestStatus, ...]) -> t.InstanceStatus:
    return t.InstanceStatus(name, 0.0, CFG, free, running=running)


def _gate_statuses(free1: int = 18) -> tuple[t.InstanceStatus, t.InstanceStatus]:
    # e0: one request of 96 prompt + 4 generated tokens in 7 blocks, predicted 324 → 320
    # to go → 420 tokens = ceil(420/16) = 27 blocks: growth 20.
    e0 = _status("e0", 30, (t.RequestStatus("a", 0.0, 96, num_computed_tokens=100, generated_tokens=4,
                                             predicted_output_tokens=324, kv_blocks=7),))
    # e1: 60 + 20 tokens in 5 blocks, predicted 30 → 10 to go (90 tokens = 6 blocks); and
    # 30 + 40 in 5 blocks, already past its prediction of 20 → the auto-extension, 10 to go
    # (80 tokens = 5 blocks). H = 10; t = 10, both running: 6 + 5 − 10 = 1 → growth 1.
    e1 = _status("e1", free1, (
        t.RequestStatus("b", 0.0, 60, num_computed_tokens=80, generated_tokens=20, predicted_output_tokens=30,
                        kv_blocks=5),
        t.RequestStatus("c", 0.0, 30, num_computed_tokens=70, generated_tokens=40, predicted_output_tokens=20,
                        kv_blocks=5)))
    return e0, e1


def _gate_loads(free1: int = 18) -> list[InstanceLoad]:
    loads = []
    for i, st in enumerate(_gate_statuses(free1)):
        loads.append(InstanceLoad(i, **InstanceLoad.status_fields(st, kv_growth=True), request_prompt_tokens=48))
    return loads


def test_status_fields_project_each_running_request_growth():
    e0, e1 = _gate_loads()
    assert (e0.kv_growth_blocks, e1.kv_growth_blocks) == (20, 1)


class _StatusResp:
    status = 200

    def __init__(self, body: bytes):
        self.body = body

    async def read(self) -> bytes:
        return self.body


class _StatusClients:
    """The scheduler's `Clients` as far as the health loop's /status poll uses them:
    engine URL → the `InstanceStatus` its `GET /status` answers."""

    def __init__(self, by_url: dict[str, t.InstanceStatus]):
        self.by_url = by_url

    async def get(self, url: str, path: str, timeout_s: float = 1.0) -> tuple[int, bytes]:
        return 404, b""  # GET /version (prefix_tokenizer auto asks each engine's kind once)

    def pool(self, url: str):
        st = self.by_url[url]

        class _Pool:
            async def request(self, method: str, path: str):
                # a prediction-guided policy polls with its prefix-cache delta
                assert method == "GET" and path.split("?")[0] == "/status", path
                return _StatusResp(json.dumps(st.to_dict()).encode())
        return _Pool()


def _live_load_fields(monkeypatch, policy: str, **params) -> tuple[list[dict[str, int]], int]:
    """One health-loop /status poll of e0 and e1 by a scheduler with `policy`: each
    instance's stored load fields, and how many times the KV growth projection ran."""
    from rps_astro_cli.services.scheduler import InstanceEndpoint, SchedulerSettings
    from rps_astro_cli.services.scheduler.app import Scheduler

    calls = []
    real = t.kv_growth_peak_blocks

    def counted(rows, bs):
        calls.append(len(rows))
        return real(rows, bs)

    monkeypatch.setattr(t, "kv_growth_peak_blocks", counted)
    statuses = dict(zip(("http://e0", "http://e1"), _gate_statuses()))
    sched = Scheduler(SchedulerSettings(
        instances=tuple(InstanceEndpoint(f"e{i}", url, None) for i, url in enumerate(statuses)),
        policy=policy, policy_params=params, length_model="baseline", served_models=("m",)))
    assert sched.health.needs_status
    sched.health.clients = _StatusClients(statuses)  # type: ignore[assignment]
    states = [sched.instances[0], sched.instances[1]]
    asyncio.run(sched.health.check_all(with_services=False))
    assert all(st.healthy for st in states)
    return [st.load_fields for st in states], len(calls)


def test_live_status_poll_projects_kv_growth_only_for_a_policy_that_needs_it(monkeypatch):
    # default power_of_k (the KV gate without growth) and llumnix read /status but not
    # the growth: the poll stores the other fields (by hand from _gate_statuses: e0 30
    # free of 100, 1 running; e1 18 free, 2 running; no waiting queue) and never runs
    # the O(n²) projection; the dispatch then sees kv_growth_blocks None
    for policy, params in (("power_of_k", {}), ("llumnix", {})):
        fields, calls = _live_load_fields(monkeypatch, policy, **params)
        assert calls == 0, policy
        assert [(f["kv_blocks_free"], f["kv_blocks_total"], f["num_running"], f["num_waiting"],
                 f["waiting_blocks_needed"], f["kv_block_size"], f["max_num_seqs"]) for f in fields] == [
            (30, 100, 1, 0, 0, 16, 48), (18, 100, 2, 0, 0, 16, 48)], policy
        assert all("kv_growth_blocks" not in f for f in fields), policy
        assert InstanceLoad(0, **fields[0]).kv_growth_blocks is None


def test_live_status_poll_projects_kv_growth_for_power_of_k_kv_growth(monkeypatch):
    # power_of_k kv_growth=true: one projection per instance per poll, the growth worked
    # out by hand in _gate_statuses (e0 20 blocks, e1 1), the other fields as without it
    fields, calls = _live_load_fields(monkeypatch, "power_of_k", kv_growth=True)
    assert calls == 2
    assert [f["kv_growth_blocks"] for f in fields] == [20, 1]
    assert [(f["kv_blocks_free"], f["num_running"]) for f in fields] == [(30, 1), (18, 2)]


def test_growth_gate_verdict_by_hand():
    # reserve 10 % of 100 blocks = 10; this request's 48-token prompt = 3 blocks.
    # today's headroom: e0 30 − 3 = 27, e1 18 − 3 = 15 → both pass;
    # with growth: e0 27 − 20 = 7 < 10 fails, e1 15 − 1 = 14 passes → only e1.
    loads = _gate_loads()
    by = {ld.index: ld for ld in loads}
    assert KvHeadroomFilter(0.1)(by, [0, 1]) == [0, 1]
    grow = KvHeadroomFilter(0.1, growth=True)
    assert grow.needs_kv_growth and grow(by, [0, 1]) == [1]
    # e1 with 13 free: today 10 passes, with growth 9 fails → no instance covers its
    # growth: today's gate decides (both), not "all pass" by accident
    by2 = {ld.index: ld for ld in _gate_loads(free1=13)}
    assert grow(by2, [0, 1]) == [0, 1]
    # e1 with 12 free: today 9 fails → today's gate keeps e0 only, growth cannot add e1
    by3 = {ld.index: ld for ld in _gate_loads(free1=12)}
    assert grow(by3, [0, 1]) == [0]


def test_power_of_k_kv_growth_asks_only_the_instances_whose_headroom_covers_the_growth():
    loads = _gate_loads()
    asked = []

    def predict(cands):
        asked.append(sorted(cands))
        return {i: LatencyEstimate(0.1 * (2 - i), 1.0, 1, 1) for i in cands}  # e0 0.2 s, e1 0.1 s

    pol = make_dispatch("power_of_k", kv_growth=True)
    assert pol.needs_kv_growth and not make_dispatch("power_of_k").needs_kv_growth
    assert pol.describe()["kv_growth"] is True
    dec = decide(pol, loads, np.random.default_rng(0), predict)
    assert asked == [[1]] and dec.choice == 1
    decide(make_dispatch("power_of_k"), loads, np.random.default_rng(0), predict)
    assert asked[-1] == [0, 1]  # the default gate: both


CAL = LogSpreadCalibration(levels=(0.1, 0.5, 0.9), bin_edges_tokens=(100.0,),
                           log_offsets=((-1.5, 0.0, 1.5), (-0.5, 0.0, 0.5)), tail_ratios=(0.5, 0.2))


def test_confident_remaining_uses_the_distribution_only_in_wide_bins():
    # bin 0 (predictions < 100): p10–p90 log width 3.0 > 2 → the distribution;
    # bin 1: width 1.0 → the point estimate with the 10-token auto-extension
    rule = ConfidentRemaining(CAL, max_log_width=2.0)
    dist = CalibratedRemaining(CAL, "mean")
    assert rule.uncertain(50) and not rule.uncertain(100) and not rule.uncertain(400)
    assert rule.expected_total(50, 0) == dist.expected_total(50, 0) != 50
    assert rule.expected_total(50, 30, 500) == dist.expected_total(50, 30, 500)
    assert rule.expected_total(200, 0) == 200
    assert rule.expected_total(200, 150) == 200
    assert rule.expected_total(200, 250) == 260  # past its prediction: g + 10
    assert rule.expected_total(200, 0, cap=120) == 120
    # a wider threshold: every bin counts as confident
    assert ConfidentRemaining(CAL, max_log_width=5.0).expected_total(50, 0) == 50
