"""Hand-computed acceptance tests of the instance model (issue 2 §2).

Every case uses a hand-made profile whose step latency is
    step_s = 10 ms + 0.1 ms × (tokens computed in the step)
(base_s = 0.01, linear table (0 → 0 s, 1000 → 0.1 s), every other coefficient 0), so each
number below can be worked out on paper; the derivations are in the comments.
"""

from __future__ import annotations

import pytest

from conftest import linear_profile
from rps_astro_cli.sim.fcfs import FCFSPolicy
from rps_astro_cli.sim.instance import InstanceSim
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.types import InstanceConfig

PROFILE = linear_profile()
LAT = LatencyModel(PROFILE)


def step_s(tokens: int) -> float:
    return 0.01 + 0.0001 * tokens


def make(cfg: InstanceConfig) -> InstanceSim:
    return InstanceSim(cfg, LAT, FCFSPolicy())


def req(rid: str, prompt: int, out: int, arrival: float = 0.0, **kw) -> SimRequest:
    return SimRequest(request_id=rid, arrival_s=arrival, prompt_tokens=prompt, target_output_tokens=out, **kw)


def run_all(sim: InstanceSim, t: float = 0.0) -> list:
    """Step until idle; returns [(start_s, StepResult)]."""
    out = []
    while sim.has_work:
        res = sim.step(t)
        assert res.scheduled, "instance stalled"
        out.append((t, res))
        t += res.duration_s
    return out


def ids(res) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in res.scheduled]


BIG = InstanceConfig(block_size=16, num_gpu_blocks=1000, max_num_seqs=48, max_num_batched_tokens=512,
                     max_model_len=4096)


def test_three_requests_ttft_e2e_chunked() -> None:
    # A(100 prompt, 3 out), B(200, 2), C(300, 1), all queued at t=0; budget 512.
    # step 1 @0      : A 100 + B 200 + C 212 (budget exhausted) = 512 tok -> 0.01+0.0512 = 0.0612
    #                  A, B sample their 1st token at 0.0612; C is 212/300 computed.
    # step 2 @0.0612 : A 1 + B 1 (decodes) + C 88 (rest of its prompt) = 90 tok -> 0.0190, ends 0.0802
    #                  B reaches 2 tokens (done), C samples its only token (done).
    # step 3 @0.0802 : A 1 -> 0.0101, ends 0.0903; A done.
    sim = make(BIG)
    a, b, c = req("A", 100, 3), req("B", 200, 2), req("C", 300, 1)
    for r in (a, b, c):
        sim.add(r)
    steps = run_all(sim)
    assert [ids(res) for _, res in steps] == [
        [("A", 100), ("B", 200), ("C", 212)],
        [("A", 1), ("B", 1), ("C", 88)],
        [("A", 1)],
    ]
    assert a.first_token_s == pytest.approx(0.0612, abs=1e-12)
    assert a.finish_s == pytest.approx(0.0903, abs=1e-12)
    assert b.first_token_s == pytest.approx(0.0612, abs=1e-12)
    assert b.finish_s == pytest.approx(0.0802, abs=1e-12)
    assert c.first_token_s == pytest.approx(0.0802, abs=1e-12)
    assert c.finish_s == pytest.approx(0.0802, abs=1e-12)
    assert sim.free_blocks == BIG.num_gpu_blocks  # everything freed


def test_1200_token_prompt_chunks_512_512_176_with_decode_riding_along() -> None:
    # The token budget is shared (vLLM V1): each running decode takes 1 token of it first.
    # With one decode riding along, a budget of 513 leaves exactly 512 for the chunk.
    cfg = InstanceConfig(block_size=16, num_gpu_blocks=1000, max_num_seqs=48, max_num_batched_tokens=513,
                         max_model_len=4096)
    sim = make(cfg)
    d = req("D", 16, 10)
    sim.add(d)
    r1 = sim.step(0.0)  # D prefills 16 tokens: 0.01 + 0.0016 = 0.0116
    assert ids(r1) == [("D", 16)] and r1.duration_s == pytest.approx(0.0116, abs=1e-12)
    t = r1.duration_s
    e = req("E", 1200, 2, arrival=t)
    sim.add(e)
    # step 2 @0.0116: D 1 + E 512 = 513 tok -> 0.0613, ends 0.0729
    # step 3 @0.0729: D 1 + E 512 -> 0.0613, ends 0.1342
    # step 4 @0.1342: D 1 + E 176 = 177 tok -> 0.0277, ends 0.1619; E's 1st token
    # step 5 @0.1619: D 1 + E 1 -> 0.0102, ends 0.1721; E done (2 tokens)
    expect = [[("D", 1), ("E", 512)], [("D", 1), ("E", 512)], [("D", 1), ("E", 176)], [("D", 1), ("E", 1)]]
    blocks = [32, 64, 75, 76]  # ceil(512/16), ceil(1024/16), ceil(1200/16), ceil(1201/16)
    for want, want_blocks in zip(expect, blocks):
        res = sim.step(t)
        assert ids(res) == want
        assert e.kv_blocks == want_blocks or e.finish_s is not None
        t += res.duration_s
    assert e.first_token_s - e.arrival_s == pytest.approx(0.1619 - 0.0116, abs=1e-12)  # TTFT 0.1503
    assert e.finish_s - e.arrival_s == pytest.approx(0.1721 - 0.0116, abs=1e-12)  # E2E 0.1605
    assert d.num_generated_tokens == 5  # 1 after its prefill + 4 decodes that rode along


def test_default_budget_512_leaves_511_for_the_chunk() -> None:
    # Same as above with the Astrolabe budget 512: chunks are 511 / 511 / 178.
    sim = make(BIG)
    d = req("D", 16, 10)
    sim.add(d)
    t = sim.step(0.0).duration_s
    sim.add(req("E", 1200, 2, arrival=t))
    chunks = []
    for _ in range(3):
        res = sim.step(t)
        chunks.append(ids(res))
        t += res.duration_s
    assert chunks == [[("D", 1), ("E", 511)], [("D", 1), ("E", 511)], [("D", 1), ("E", 178)]]


def test_kv_exhaustion_preempts_fcfs_victim_and_readmits_it() -> None:
    # 6 blocks of 16 tokens. A, B, C: 32-token prompts (2 blocks each) -> pool full after step 1.
    cfg = InstanceConfig(block_size=16, num_gpu_blocks=6, max_num_seqs=48, max_num_batched_tokens=512,
                         max_model_len=96)
    sim = make(cfg)
    a, b, c = req("A", 32, 10), req("B", 32, 10), req("C", 32, 3)
    for r in (a, b, c):
        sim.add(r)
    r1 = sim.step(0.0)  # 96 tokens -> 0.0196; all three sample token 1
    assert ids(r1) == [("A", 32), ("B", 32), ("C", 32)] and sim.free_blocks == 0
    t = r1.duration_s
    # step 2: A's decode needs a 3rd block (33 tokens), none free -> FCFS victim = last
    # running = C: its 2 blocks freed, computed reset, put at the front of waiting.
    # A and B then each take one of them; no admission in a step that preempted.
    r2 = sim.step(t)
    assert [r.request_id for r in r2.preempted] == ["C"]
    assert ids(r2) == [("A", 1), ("B", 1)]
    assert sim.waiting == [c] and c.kv_blocks == 0 and c.num_computed_tokens == 0
    assert c.num_generated_tokens == 1 and c.num_preemptions == 1
    assert sim.num_preemptions_total == 1 and sim.free_blocks == 0
    assert r2.duration_s == pytest.approx(0.0102, abs=1e-12)
    t += r2.duration_s
    # steps 3..10: A and B decode (C needs 3 blocks, 0 free); both finish at step 10:
    # end = 0.0196 + 9 × 0.0102 = 0.1114. Step 11 readmits C: recompute 32 + 1 = 33
    # tokens -> 0.0133, ends 0.1247, token 2; step 12: decode 0.0101, ends 0.1348, done.
    steps = run_all(sim, t)
    assert len(steps) == 10
    assert ids(steps[-2][1]) == [("C", 33)]
    assert a.finish_s == pytest.approx(0.1114, abs=1e-12) and b.finish_s == pytest.approx(0.1114, abs=1e-12)
    assert c.first_token_s == pytest.approx(0.0196, abs=1e-12)  # before the preemption
    assert c.finish_s == pytest.approx(0.1348, abs=1e-12)
    assert sim.num_preemptions_total == 1 and sim.free_blocks == 6


def test_preempted_request_itself_is_victim_when_last() -> None:
    # 5 blocks; A, B 32-token prompts (2 blocks each, 1 free). Step 2: A takes the free
    # block; B (last running) needs one, none free -> B preempts itself and stops.
    cfg = InstanceConfig(block_size=16, num_gpu_blocks=5, max_num_seqs=48, max_num_batched_tokens=512,
                         max_model_len=64)
    sim = make(cfg)
    a, b = req("A", 32, 20), req("B", 32, 20)
    sim.add(a)
    sim.add(b)
    sim.step(0.0)
    r2 = sim.step(0.0164)
    assert ids(r2) == [("A", 1)] and r2.preempted == [b] and sim.free_blocks == 2


def test_prioritized_prefill_pauses_decodes() -> None:
    # D (16 prompt, 4 out) decoding; E (300 prompt, 2 out) arrives after D's prefill.
    # prioritized: step 2 is prefill-only (E 300 tok -> 0.0400, D paused), then decodes:
    #   E TTFT 0.0400, E2E 0.0400 + 0.0102 = 0.0502; D ends at 0.0116+0.04+0.0102+2×0.0101 = 0.0820
    # chunked:     step 2 is D 1 + E 300 (0.0401), then decodes:
    #   E TTFT 0.0401, E2E 0.0503; D ends at 0.0116 + 0.0401 + 0.0102 + 0.0101 = 0.0720
    out = {}
    for chunked in (False, True):
        cfg = InstanceConfig(block_size=16, num_gpu_blocks=1000, max_num_seqs=48, max_num_batched_tokens=512,
                             max_model_len=4096, chunked_prefill=chunked)
        sim = make(cfg)
        d = req("D", 16, 4)
        sim.add(d)
        t = sim.step(0.0).duration_s
        e = req("E", 300, 2, arrival=t)
        sim.add(e)
        steps = run_all(sim, t)
        out[chunked] = (ids(steps[0][1]), e.first_token_s - e.arrival_s, e.finish_s - e.arrival_s, d.finish_s)
    assert out[False][0] == [("E", 300)]
    assert out[True][0] == [("D", 1), ("E", 300)]
    assert out[False][1:] == pytest.approx((0.0400, 0.0502, 0.0820), abs=1e-12)
    assert out[True][1:] == pytest.approx((0.0401, 0.0503, 0.0720), abs=1e-12)


def test_prioritized_prefill_three_requests() -> None:
    # Same 3 requests as the chunked case; whole prompts in one prefill batch:
    # step 1: 600 tok -> 0.07 (C done: 1 token); step 2: A, B decode 0.0102 -> 0.0802 (B done);
    # step 3: A 0.0101 -> 0.0903. C's TTFT is 0.07 here vs 0.0802 chunked; A's and B's
    # TTFT 0.07 vs 0.0612.
    cfg = InstanceConfig(block_size=16, num_gpu_blocks=1000, max_num_seqs=48, max_num_batched_tokens=512,
                         max_model_len=4096, chunked_prefill=False)
    sim = make(cfg)
    a, b, c = req("A", 100, 3), req("B", 200, 2), req("C", 300, 1)
    for r in (a, b, c):
        sim.add(r)
    run_all(sim)
    assert [a.first_token_s, b.first_token_s, c.first_token_s] == pytest.approx([0.07] * 3, abs=1e-12)
    assert [a.finish_s, b.finish_s, c.finish_s] == pytest.approx([0.0903, 0.0802, 0.07], abs=1e-12)


def test_max_num_seqs_limits_admission() -> None:
    # max 2 sequences: C waits until A (1 token) finishes after step 1.
    cfg = InstanceConfig(block_size=16, num_gpu_blocks=1000, max_num_seqs=2, max_num_batched_tokens=512,
                         max_model_len=4096)
    sim = make(cfg)
    a, b, c = req("A", 10, 1), req("B", 10, 3), req("C", 10, 1)
    for r in (a, b, c):
        sim.add(r)
    steps = run_all(sim)
    assert [ids(res) for _, res in steps] == [[("A", 10), ("B", 10)], [("B", 1), ("C", 10)], [("B", 1)]]


def test_encoder_time_charged_to_first_chunk() -> None:
    # An image request: 600 prompt tokens (incl. vision), encoder 0.2 s, budget 512:
    # step 1: 512 tok + encoder -> 0.0612 + 0.2 = 0.2612; step 2: 88 tok -> 0.0188 (no encoder).
    sim = make(BIG)
    r = req("I", 600, 1, modality="image", vision_tokens=576, encoder_s=0.2)
    sim.add(r)
    d1 = sim.step(0.0).duration_s
    d2 = sim.step(d1).duration_s
    assert d1 == pytest.approx(0.2612, abs=1e-12) and d2 == pytest.approx(0.0188, abs=1e-12)
    assert r.finish_s == pytest.approx(0.28, abs=1e-12)
