"""Hand-computed cases of the instance model's automatic prefix caching (issue 14).

Profile: step_s = 10 ms + 0.1 ms × tokens computed in the step (`conftest.linear_profile`).
Blocks of 4 tokens; token ids are small ints so every block hash can be named.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from conftest import linear_profile
from rps_astro_cli.sim.fcfs import FCFSPolicy
from rps_astro_cli.sim.instance import InstanceSim
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.prefix_cache import block_hashes
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.tokens import count_tokens_fallback, token_ids_fallback
from rps_astro_cli.types import InstanceConfig

LAT = LatencyModel(linear_profile())
BS = 4


def cfg(blocks: int, **kw) -> InstanceConfig:
    return InstanceConfig(block_size=BS, num_gpu_blocks=blocks, max_num_seqs=8, max_num_batched_tokens=64,
                          max_model_len=min(64, blocks * BS), **kw)


def make(blocks: int, **kw) -> InstanceSim:
    return InstanceSim(cfg(blocks, **kw), LAT, FCFSPolicy())


def req(rid: str, ids: list[int], prompt: int, out: int) -> SimRequest:
    """`ids`: the known sequence (prompt, then the reply's tokens if known)."""
    return SimRequest(request_id=rid, arrival_s=0.0, prompt_tokens=prompt, target_output_tokens=out,
                      block_hashes=block_hashes(ids, BS))


def run_all(sim: InstanceSim, t: float = 0.0) -> list:
    out = []
    while sim.has_work:
        res = sim.step(t)
        assert res.scheduled or res.preempted, "instance stalled"
        out.append(res)
        t += res.duration_s
    return out


def test_block_hashes_are_chained_full_blocks_only() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(a) == 2  # token 9 is a partial block: no hash
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same tokens in block 1, different parent: different hash
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4) == a


def test_second_turn_skips_exactly_its_cached_full_blocks() -> None:
    sim = make(20)
    # turn 1: prompt 1..10, reply 11, 12 (2 tokens). Step 1 prefills 10 tokens (2 full
    # blocks cached: [1-4], [5-8]); step 2 decodes token 11 (computed 11: block [9-12]
    # never full of computed tokens, the last reply token's KV is never computed).
    t1 = list(range(1, 11)) + [11, 12]
    a = req("turn1", t1, 10, 2)
    sim.add(a)
    steps = run_all(sim)
    assert [n for _, n in steps[0].scheduled] == [10] and a.finish_s is not None
    assert sim.free_blocks == 20 and sim.cache is not None and sim.cache.num_cached_free == 2
    # turn 2: whole history 1..12 + new message 13..20 = 20 tokens (5 full blocks):
    # hits [1-4], [5-8] = 8 tokens, prefills 12 → step 0.01 + 0.0012 s.
    b = req("turn2", t1 + list(range(13, 21)), 20, 2)
    sim.add(b)
    r = sim.step(1.0)
    assert [(q.request_id, n) for q, n in r.scheduled] == [("turn2", 12)]
    assert r.duration_s == pytest.approx(0.0112, abs=1e-12)
    # 2 cached free blocks taken back from the queue + 3 new = 5 held
    assert b.kv_blocks == 5 and sim.free_blocks == 15
    assert sim.prefix_cache_queries_tokens == 10 + 20 and sim.prefix_cache_hits_tokens == 8


def test_a_full_hit_still_computes_the_last_block() -> None:
    sim = make(20)
    ids = list(range(1, 9))
    sim.add(req("a", ids, 8, 1))
    run_all(sim)
    # same 8 tokens again: at most (8 - 1) // 4 = 1 block may hit → 4 tokens computed
    b = req("b", ids, 8, 1)
    sim.add(b)
    r = sim.step(1.0)
    assert [n for _, n in r.scheduled] == [4] and sim.prefix_cache_hits_tokens == 4


def test_free_cached_blocks_are_evicted_lru_tail_first() -> None:
    sim = make(4)
    A, B, C = [1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26, 27, 28]
    hA, hB, hC = block_hashes(A, BS), block_hashes(B, BS), block_hashes(C, BS)
    cache = sim.cache
    assert cache is not None
    for rid, ids in (("A", A), ("B", B)):
        sim.add(req(rid, ids, 8, 1))
        run_all(sim)
    # free queue, front first: A's blocks (A finished first, tail block first), then B's
    assert [k for k in cache.queue] == [hA[1], hA[0], hB[1], hB[0]]
    sim.add(req("C", C, 8, 1))
    run_all(sim)
    # C needed 2 blocks: the 2 least recently freed (A's) were evicted
    assert set(cache.refs) == {*hB, *hC} and cache.evictions_total == 2
    # B's 8 tokens + 4 more: hits both of B's blocks (8 tokens) and takes 1 new block from
    # the queue's front, which is now C's tail block
    d = req("D", B + [31, 32, 33, 34], 12, 2)
    sim.add(d)
    r = sim.step(1.0)
    assert [n for _, n in r.scheduled] == [4]
    assert hC[1] not in cache.refs and hC[0] in cache.refs and cache.evictions_total == 3
    assert sim.free_blocks == 1


def test_preempted_request_rehits_its_cached_prompt_blocks() -> None:
    # 6 blocks. A, B: 8-token prompts (2 cached blocks each), 6 output tokens; B's hashes
    # cover its prompt only. Step 1 prefills both (4 blocks, 2 free); step 2 each takes
    # a 3rd block (computed 9); step 6 A needs a 4th (13 tokens), none free → FCFS victim
    # B (last running): its 3 blocks are freed (1 private, 2 cached), A takes the
    # private one. A finishes at the end of step 6 (6 tokens) and frees its 4 blocks.
    sim = make(6)
    a = req("A", list(range(1, 9)), 8, 6)
    b = req("B", list(range(11, 19)), 8, 6)
    sim.add(a)
    sim.add(b)
    steps = [sim.step(float(k)) for k in range(6)]
    assert steps[5].preempted == [b] and a.finish_s is not None
    assert b.num_generated_tokens == 5 and b.num_computed_tokens == 0 and sim.free_blocks == 6
    # step 7: B re-admitted with 8 + 5 = 13 tokens; its 2 cached prompt blocks are still
    # there → recompute 13 − 8 = 5 tokens (0.0105 s) instead of 13
    r = sim.step(10.0)
    assert [(q.request_id, n) for q, n in r.scheduled] == [("B", 5)]
    assert r.duration_s == pytest.approx(0.0105, abs=1e-12)
    # the recompute samples B's 6th (last) token: it finishes and all 6 blocks are free
    assert b.finish_s == pytest.approx(10.0105, abs=1e-12) and sim.free_blocks == 6
    assert sim.prefix_cache_queries_tokens == 8 + 8 + 13 and sim.prefix_cache_hits_tokens == 8


def _trace(sim: InstanceSim, reqs: list[SimRequest]) -> list:
    for r in reqs:
        sim.add(r)
    return [(round(s.duration_s, 15), [(q.request_id, n) for q, n in s.scheduled], [q.request_id for q in s.preempted])
            for s in run_all(sim)]


def test_caching_off_or_no_hashes_is_the_uncached_model() -> None:
    rng = np.random.default_rng(3)
    shared = list(range(100, 124))  # a 24-token shared prefix
    base = []
    for i in range(12):
        p = int(rng.integers(4, 30))
        ids = shared + [int(x) for x in rng.integers(0, 10**6, p)]
        base.append((f"r{i}", ids, len(ids), int(rng.integers(1, 12))))

    def reqs(hashed: bool) -> list[SimRequest]:
        out = []
        for rid, ids, p, o in base:
            r = req(rid, ids, p, o)
            out.append(r if hashed else replace(r, block_hashes=()))
        return out

    off = _trace(make(24, enable_prefix_caching=False), reqs(True))
    assert _trace(make(24), reqs(False)) == off  # on, but no hashes: the same steps
    on = _trace(make(24), reqs(True))
    assert on != off  # the shared prefix is hit when caching is on


def test_fallback_token_ids_match_the_count_and_keep_prefixes() -> None:
    t = "Hello, wonderful world! 42"
    assert len(token_ids_fallback(t)) == count_tokens_fallback(t) == 10
    assert token_ids_fallback("first turn.") + token_ids_fallback("next one") == token_ids_fallback(
        "first turn.\nnext one")


# -- the look-ahead with the candidate's prefix-cache hit -----------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rps_astro_cli.sim.lookahead import predict, predict_stepwise  # noqa: E402
from rps_astro_cli.types import CandidateRequest, InstanceStatus  # noqa: E402
from test_lookahead import POLICIES, _same, scenarios  # noqa: E402


@pytest.mark.parametrize("policy", sorted(POLICIES))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(), data=st.data())
def test_jump_equals_stepwise_with_a_cached_candidate(policy: str, sc, data) -> None:
    lat, status, cand, kw = sc
    cand = replace(cand, cached_tokens=data.draw(st.integers(0, cand.prompt_tokens + 5)))
    _same(predict_stepwise(status, cand, lat, POLICIES[policy](), **kw),
          predict(status, cand, lat, POLICIES[policy](), **kw))


def test_a_cached_candidate_prefills_only_the_rest() -> None:
    # idle instance, linear profile: 100-token prompt, 1 output token. Uncached: one
    # 100-token step, 0.0200 s. 64 cached: 36 tokens, 0.0136 s. All 100 "cached": capped at
    # 99, so 1 token is computed, 0.0101 s.
    c = InstanceConfig(block_size=16, num_gpu_blocks=100, max_num_seqs=8, max_num_batched_tokens=512,
                       max_model_len=1024)
    st0 = InstanceStatus("i", 0.0, c, 100)
    for cached, ttft in ((0, 0.0200), (64, 0.0136), (100, 0.0101)):
        cand = CandidateRequest(100, 1, cached_tokens=cached)
        assert predict(st0, cand, LAT, FCFSPolicy()).ttft_s == pytest.approx(ttft, abs=1e-12)
        assert predict_stepwise(st0, cand, LAT, FCFSPolicy()).ttft_s == pytest.approx(ttft, abs=1e-12)


def test_lookahead_credits_a_waiting_requests_own_hit() -> None:
    # Turn 1 (prompt 1..16, 4 full blocks, reply 1 token) runs to the end: its 4 blocks
    # stay cached. Turn 2 (prompt 1..16 + 17..24 = 24 tokens) waits, not yet admitted;
    # a 10-token candidate arrives. The instance, stepped with caching: turn 2 hits its
    # 4 cached blocks (cap (24 − 1) // 4 = 5) = 16 tokens and prefills 8 tokens in the
    # candidate's step. The look-ahead crediting
    # turn 2's hit predicts exactly the stepped TTFT; without it, turn 2 prefills all
    # 24 tokens in that step, 16 × 1e-4 s later (linear profile).
    from rps_astro_cli.sim.lookahead import predict_instance

    def setup() -> InstanceSim:
        sim = make(40)
        sim.add(req("t1", list(range(1, 17)), 16, 1))
        run_all(sim)
        sim.add(req("t2", list(range(1, 25)), 24, 1))
        return sim

    cand = CandidateRequest(10, 1)
    sim = setup()
    with_hits = predict_instance(sim, 1.0, cand)
    without = predict_instance(sim, 1.0, cand, waiting_hits=False)
    assert sim.waiting[0].num_computed_tokens == 0  # the look-ahead changed nothing
    ref = setup()
    c = SimRequest("c", 1.0, 10, 1)
    ref.add(c)
    r = ref.step(1.0)
    assert [(q.request_id, n) for q, n in r.scheduled] == [("t2", 8), ("c", 10)]
    assert with_hits.ttft_s == pytest.approx(c.first_token_s - 1.0, abs=1e-12)
    assert without.ttft_s - with_hits.ttft_s == pytest.approx(16 * 1e-4, abs=1e-12)


def test_cache_events_delta_and_mirror() -> None:
    # 4 blocks of 4 tokens. A (8 tokens) caches hA[0], hA[1]; B (8 tokens) then caches
    # hB[0], hB[1]; C (12 tokens, 3 blocks) needs 3 blocks: all 4 free blocks are cached
    # ones, LRU order: A's tail-first (hA1, hA0), then B's (hB1, hB0) → C evicts hA1, hA0,
    # hB1 and, its 12-token prefill filling 3 blocks, caches all 3: events 4 stored, then
    # 3 removed + 3 stored.
    from rps_astro_cli.sim.prefix_cache import PrefixMirror

    sim = make(4)
    cache = sim.cache
    assert cache is not None
    cache.track_events(100)
    A, B, C = [1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18], list(range(21, 33))
    hA, hB, hC = block_hashes(A, BS), block_hashes(B, BS), block_hashes(C, BS)
    mirror = PrefixMirror()
    for rid, ids in (("A", A), ("B", B)):
        sim.add(req(rid, ids, 8, 1))
        run_all(sim)
    d = cache.delta(mirror.seq)  # a fresh reader: the whole set
    assert d == {"seq": 4, "reset": True, "stored": [*hA, *hB], "removed": []}
    mirror.apply(d)
    assert mirror.hit_blocks(hA, 5) == 2 and mirror.hit_blocks(hB, 1) == 1
    sim.add(req("C", C, 12, 1))
    run_all(sim)
    d = cache.delta(mirror.seq)
    assert d["seq"] == 4 + 3 + 3 and not d["reset"]
    assert sorted(d["removed"]) == sorted([hA[1], hA[0], hB[1]]) and sorted(d["stored"]) == sorted(hC)
    mirror.apply(d)
    assert mirror.hashes == set(cache.refs) == {hB[0], *hC}
    assert mirror.hit_blocks(hA, 2) == 0 and mirror.hit_blocks(hB, 2) == 1 and mirror.hit_blocks(hC, 2) == 2
    assert cache.delta(mirror.seq) == {"seq": 10, "reset": False, "stored": [], "removed": []}
    # a reader older than the events kept starts over from the whole set
    cache.track_events(1)
    sim.add(req("A2", A, 8, 1))
    run_all(sim)
    d = cache.delta(10)
    assert d["reset"] and set(d["stored"]) == set(cache.refs)


def test_snapshot_shows_a_waiting_requests_hit_and_the_lookahead_credits_it() -> None:
    # as test_lookahead_credits_a_waiting_requests_own_hit, through `/status`: turn 2
    # waits with 16 cached tokens; `predict` on the snapshot equals `predict_instance`
    # on the instance, and `predict_stepwise` on the snapshot agrees.
    from rps_astro_cli.sim.lookahead import predict_instance
    from rps_astro_cli.sim.status import snapshot
    from rps_astro_cli.types import InstanceStatus as Status

    sim = make(40)
    sim.add(req("t1", list(range(1, 17)), 16, 1))
    run_all(sim)
    sim.add(req("t2", list(range(1, 25)), 24, 1))
    snap = snapshot("e", 1.0, sim)
    assert [w.cached_tokens for w in snap.waiting] == [16]
    assert snap.waiting[0].to_dict()["cached_tokens"] == 16
    assert Status.from_dict(snap.to_dict()).waiting[0].cached_tokens == 16
    cand = CandidateRequest(10, 1)
    want = predict_instance(sim, 1.0, cand)
    got = predict(snap, cand, LAT, FCFSPolicy())
    assert got.ttft_s == pytest.approx(want.ttft_s, abs=1e-12)
    assert predict_stepwise(snap, cand, LAT, FCFSPolicy()).ttft_s == pytest.approx(want.ttft_s, abs=1e-12)
    # no hit to show for a request with no hashes
    sim.add(SimRequest("plain", 1.0, 24, 1))
    assert snapshot("e", 1.0, sim).waiting[1].cached_tokens == 0
    assert "cached_tokens" not in snapshot("e", 1.0, sim).waiting[1].to_dict()


def test_reset_forgets_every_cached_block_only_when_none_is_held() -> None:
    # 4 blocks of 4 tokens: A (8 tokens) leaves hA0, hA1 cached and free; a reset forgets
    # both (2 removal events, a mirror follows) and A again gets no hit. While B holds its
    # 2 blocks, a reset is refused and changes nothing.
    from rps_astro_cli.sim.prefix_cache import PrefixMirror

    sim = make(4)
    cache = sim.cache
    assert cache is not None
    cache.track_events(100)
    A, B = [1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16, 17, 18]
    hA = block_hashes(A, BS)
    sim.add(req("A", A, 8, 1))
    run_all(sim)
    mirror = PrefixMirror()
    mirror.apply(cache.delta(0))
    assert mirror.hit_blocks(hA, 2) == 2 and cache.num_cached_free == 2 and sim.free_blocks == 4
    assert cache.reset()
    assert cache.refs == {} and cache.num_cached_free == 0 and cache.lookup(hA, 2) == (0, 0)
    mirror.apply(cache.delta(mirror.seq))
    assert mirror.hit_blocks(hA, 2) == 0
    sim.add(req("B", B, 8, 50))
    sim.step(0.0)  # B's prefill: it holds its prompt's 2 blocks (at least) and keeps decoding
    assert sim.has_work and 4 - sim.free_blocks >= 2
    before = (dict(cache.refs), list(cache.queue.items()))
    assert not cache.reset()  # refused, nothing changed
    assert (dict(cache.refs), list(cache.queue.items())) == before
