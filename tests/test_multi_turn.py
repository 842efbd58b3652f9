"""Multi-turn sessions and shared-prefix traffic (issue 14): the loaders on tiny files,
the virtual cluster's closed loop and prefix hits, worked out by hand.

Token counts use the fallback counter: a word of ≤ 4 characters is 1 token.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import linear_profile
from rps_astro_cli.bench.workload_base import WorkloadOptions
from rps_astro_cli.bench.workloads import load_workload
from rps_astro_cli.cluster import TimedRequest, simulate_cluster
from rps_astro_cli.dispatch import make_dispatch
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.tokens import token_ids_fallback
from rps_astro_cli.types import InstanceConfig

HAND = linear_profile()
CFG = InstanceConfig(block_size=4, num_gpu_blocks=1000, max_num_seqs=48, max_num_batched_tokens=512,
                     max_model_len=2048)


def _conv(*turns: tuple[str, str]) -> list[dict]:
    return [{"from": f, "value": v} for f, v in turns]


def _file(tmp_path):
    data = [
        {"id": "s1", "conversations": _conv(("human", "aa bb cc dd"), ("gpt", "ee ff gg hh"),
                                            ("human", "ii jj kk ll"), ("gpt", "mm nn"),
                                            ("human", "oo pp qq rr"), ("gpt", "ss tt uu vv"))},
        {"id": "s2", "conversations": _conv(("gpt", "hello there"), ("human", "one two six ten"),
                                            ("gpt", "red blue gold pink"))},
        {"id": "s3", "conversations": _conv(("human", "solo"))},
    ]
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(data))
    return p


def test_sharegpt_multi_turn_sessions_by_hand(tmp_path) -> None:
    opts = WorkloadOptions(path=_file(tmp_path), num_requests=10, multi_turn=True, think_time_s=3.0)
    wl = load_workload("sharegpt", opts, np.random.default_rng(0))
    by = {r.request_id: r for r in wl.requests}
    # s1: turn 1's reply "mm nn" has 2 tokens < min_tokens 4 → the session ends there: 1 turn
    # kept, 2 counted too short. s2: the leading gpt turn is dropped → 1 turn. s3: no pair.
    assert sorted(by) == ["sharegpt-s1-t0", "sharegpt-s2-t0"]
    assert wl.skipped == {"turn_too_short": 2, "no_human_gpt_pair": 1}
    assert wl.notes == {"sessions": 2, "leading_gpt_turn": 1}
    opts = WorkloadOptions(path=_file(tmp_path), num_requests=10, multi_turn=True, think_time_s=3.0, min_tokens=2)
    wl = load_workload("sharegpt", opts, np.random.default_rng(0))
    s1 = [r for r in wl.requests if r.session_id == "s1"]
    # turn t's prompt = every earlier message + turn t's human message: 4, 4+4+4, 12+2+4 tokens
    assert [(r.turn, r.prompt_tokens, r.output_tokens) for r in s1] == [(0, 4, 4), (1, 12, 2), (2, 18, 4)]
    assert s1[1].prompt == "aa bb cc dd\nee ff gg hh\nii jj kk ll"
    assert s1[0].think_s == 0.0 and s1[1].think_s > 0 and s1[2].think_s > 0
    # the next turn's token ids start with this turn's prompt and reply ids
    ids = token_ids_fallback(s1[1].prompt) + token_ids_fallback(s1[1].reply)
    assert token_ids_fallback(s1[2].prompt)[:len(ids)] == ids
    again = load_workload("sharegpt", opts, np.random.default_rng(0))
    assert again.requests == wl.requests
    # -n cuts the last session at the turn count
    cut = load_workload("sharegpt", WorkloadOptions(path=_file(tmp_path), num_requests=2, multi_turn=True,
                                                    min_tokens=2), np.random.default_rng(0))
    assert len(cut.requests) == 2


def test_multi_turn_needs_a_file_and_a_sane_think_time(tmp_path, monkeypatch) -> None:
    with pytest.raises(AstroUserError, match="--think-time"):
        load_workload("sharegpt", WorkloadOptions(path=_file(tmp_path), multi_turn=True, think_time_s=-1),
                      np.random.default_rng(0))


def test_shared_prefix_requests_share_their_system_prompt() -> None:
    wl = load_workload("shared-prefix", WorkloadOptions(num_requests=40), np.random.default_rng(1))
    assert len(wl.requests) == 40
    groups: dict[str, list] = {}
    for r in wl.requests:
        groups.setdefault(r.source_id, []).append(r)
        assert 1024 + 32 <= r.prompt_tokens <= 1024 + 256 and 16 <= r.output_tokens <= 256
    a, b = next(g for g in groups.values() if len(g) >= 2)[:2]
    ia, ib = token_ids_fallback(a.prompt), token_ids_fallback(b.prompt)
    assert ia[:1024] == ib[:1024]  # the system prompt's 1024 tokens
    assert load_workload("shared-prefix", WorkloadOptions(num_requests=40), np.random.default_rng(1)).requests == \
        wl.requests


def test_virtual_cluster_closed_loop_turn_hits_the_previous_turn() -> None:
    # block 4. Turn 0: prompt 10 tokens (ids 1..10), reply 3 tokens (11..13); one instance.
    #   step @0: prefill 10 → 0.0110 (token 1); decodes 0.0101, 0.0101 → finish 0.0312.
    #   Blocks cached: computed 12 tokens at the end (10 + 2 decodes) → 3 full blocks.
    # Turn 1 arrives 0.0312 + 0.5 think = 0.5312 with prompt 1..13 + 14..20 (20 tokens):
    #   max hit (20 − 1) // 4 = 4 blocks, cached 3 → 12 tokens hit, prefill 8 → 0.0108.
    t0 = TimedRequest("t0", 0.0, 10, 3, token_ids=tuple(range(1, 14)), session_id="s")
    t1 = TimedRequest("t1", 0.0, 20, 1, token_ids=tuple(range(1, 21)), session_id="s", follows="t0", think_s=0.5)
    res = simulate_cluster([t0, t1], 1, make_dispatch("round_robin"), HAND, CFG, None, np.random.default_rng(0))
    r0, r1 = res.records
    assert r0.finish_s == pytest.approx(0.0312, abs=1e-12)
    assert r1.arrival_s == pytest.approx(0.5312, abs=1e-12)
    assert r1.cached_tokens == 12
    assert r1.ttft_s == pytest.approx(0.0108, abs=1e-12)
    assert (res.prefix_cache_queries_tokens, res.prefix_cache_hits_tokens) == (30, 12)


def test_cache_aware_and_session_affinity_follow_the_session() -> None:
    # two instances; turn 0 lands on either (a tie on load, broken at random: read it
    # back); turn 1 of the same session must land on the same instance under both
    # policies (cache_aware: the 12-token hit is 60 % > 50 % of the prompt).
    for name in ("cache_aware", "session_affinity"):
        t0 = TimedRequest("t0", 0.0, 10, 3, token_ids=tuple(range(1, 14)), session_id="s")
        t1 = TimedRequest("t1", 0.0, 20, 1, token_ids=tuple(range(1, 21)), session_id="s", follows="t0",
                          think_s=0.5)
        other = TimedRequest("o", 0.52, 30, 200)  # a decoy: may load t0's instance before turn 1
        res = simulate_cluster([t0, t1, other], 2, make_dispatch(name), HAND, CFG, None, np.random.default_rng(3))
        rec = {r.request_id: r for r in res.records}
        assert rec["t1"].instance == rec["t0"].instance, name
        assert rec["t1"].cached_tokens == 12, name


def test_follows_must_name_an_earlier_request() -> None:
    with pytest.raises(AstroUserError, match="follows"):
        simulate_cluster([TimedRequest("a", 0.0, 10, 1, follows="b")], 1, make_dispatch("round_robin"), HAND, CFG,
                         None, np.random.default_rng(0))


def _poisson_requests(with_ids: bool, n: int = 60) -> list[TimedRequest]:
    rng = np.random.default_rng(7)
    t = np.cumsum(rng.exponential(0.05, n))
    out = []
    for j in range(n):
        p, o = int(rng.integers(20, 200)), int(rng.integers(5, 120))
        # distinct prompts: every block's ids start with the request's own number
        ids = tuple(1_000_000 * (j + 1) + k for k in range(p)) if with_ids else None
        out.append(TimedRequest(f"r{j}", float(t[j]), p, o, int(o * 1.3) + 1, token_ids=ids))
    return out


def test_power_of_k_pin_changes_nothing_without_shared_prefixes() -> None:
    # no token ids, or ids that share no block: pin on and off make the same decisions
    # (same candidates, same draws) and the same latencies, request by request
    for with_ids in (False, True):
        runs = []
        for pin in ("true", "false"):
            res = simulate_cluster(_poisson_requests(with_ids), 3, make_dispatch("power_of_k", pin_cached=pin),
                                   HAND, CFG, None, np.random.default_rng(11))
            runs.append([(r.instance, r.first_token_s, r.finish_s) for r in res.records])
            assert res.prefix_cache_hits_tokens == 0
        assert runs[0] == runs[1], with_ids


def test_power_of_k_pin_keeps_a_session_on_its_cached_instance() -> None:
    # four idle instances, k = 2: turn 1 of the session hits 12 tokens where turn 0 ran;
    # with the pin that instance is always a candidate, and (idle, fewer tokens to
    # prefill) the look-ahead picks it, whatever the seed
    for seed in range(8):
        t0 = TimedRequest("t0", 0.0, 10, 3, 3, token_ids=tuple(range(1, 14)), session_id="s")
        t1 = TimedRequest("t1", 0.0, 20, 1, 1, token_ids=tuple(range(1, 21)), session_id="s", follows="t0",
                          think_s=0.5)
        res = simulate_cluster([t0, t1], 4, make_dispatch("power_of_k", k=2, objective="e2e", kv_reserve_frac=0,
                                                                 tie_tolerance_s=0), HAND, CFG, None,
                               np.random.default_rng(seed))
        r0, r1 = res.records
        assert r1.instance == r0.instance and r1.cached_tokens == 12, seed


def test_lookahead_on_a_mid_step_instance_keeps_the_candidates_cached_prefix() -> None:
    # One instance, block 4. Turn 0 (prompt ids 1..10, reply 3) finishes at 0.0312 with 3
    # full blocks cached (as above). A decoy (30 tokens, no ids: never hits) arrives at
    # 0.52 on the idle instance: its prefill step runs 0.52 → 0.533 (10 ms + 30 × 0.1 ms).
    # Turn 1 (20 tokens, ids 1..20) arrives at 0.5312, mid-step: the look-ahead starts at
    # the step's end 0.533. Next step: the decoy's decode (1) + turn 1's prefill of
    # 20 − 12 cached = 8 tokens → 0.0109 s; TTFT = 0.533 + 0.0109 − 0.5312 = 0.0127 s.
    # Without the hit the step would prefill 20: 0.0121 s → 0.0139 s (what the
    # look-ahead predicted when the mid-step shift dropped `cached_tokens`).
    t0 = TimedRequest("t0", 0.0, 10, 3, 3, token_ids=tuple(range(1, 14)), session_id="s")
    t1 = TimedRequest("t1", 0.0, 20, 1, 1, token_ids=tuple(range(1, 21)), session_id="s", follows="t0",
                      think_s=0.5)
    decoy = TimedRequest("d", 0.52, 30, 50, 50)
    res = simulate_cluster([t0, decoy, t1], 1, make_dispatch("power_of_k"), HAND, CFG, None,
                           np.random.default_rng(0))
    rec = {r.request_id: r for r in res.records}
    r1 = rec["t1"]
    assert r1.arrival_s == pytest.approx(0.5312, abs=1e-12)
    assert rec["d"].first_token_s == pytest.approx(0.533, abs=1e-12)  # turn 1 did arrive mid-step
    assert r1.cached_tokens == 12
    assert r1.ttft_s == pytest.approx(0.0127, abs=1e-12)
    assert r1.predicted_ttft_s == pytest.approx(0.0127, abs=1e-12)
