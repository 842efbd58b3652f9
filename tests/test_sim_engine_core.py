"""The sim engine's async core (SimEngine) without HTTP: lengths, clock, abort, media."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from conftest import linear_profile
from rps_astro_cli.engine.sim_engine import FINISHED, SimEngine
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.protocol.media import VisionCharge
from rps_astro_cli.protocol.openai_types import ApiError, ParsedRequest
from rps_astro_cli.sim.profile import ExecutionProfile, OutputLengthDist, VisionCosts
from rps_astro_cli.types import InstanceStatus


def make_profile(**kw) -> ExecutionProfile:
    """step = 10 ms + 0.1 ms per token (no attention terms)."""
    base = dict(model="hand/model", gpu="none", num_gpu_blocks=256, max_model_len=1024,
                output_len=OutputLengthDist(mu=math.log(20), sigma=0.0, max_tokens=2048))
    return linear_profile(**{**base, **kw})


def req(prompt: int, **kw) -> ParsedRequest:
    return ParsedRequest(endpoint="completions", model=None, text_tokens=prompt, **kw)


async def drain(er) -> list[int]:
    got = []
    while True:
        item = await er.queue.get()
        if item == FINISHED:
            return got
        got.append(item)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_output_length_rules():
    async def main():
        eng = SimEngine(make_profile(), seed=1, time_scale=0.01)
        await eng.start()
        try:
            a = eng.submit(req(10, max_tokens=7, ignore_eos=True))       # ignore_eos → max_tokens
            b = eng.submit(req(10, max_tokens=50, output_tokens=12))     # client's true length
            c = eng.submit(req(10, max_tokens=5, output_tokens=12))      # capped by max_tokens
            d = eng.submit(req(10))                                      # lognormal(ln 20, 0) = 20
            e = eng.submit(req(10, max_tokens=8))                        # draw 20 capped at 8
            outs = [await drain(x) for x in (a, b, c, d, e)]
        finally:
            await eng.close()
        return [x.output_tokens for x in (a, b, c, d, e)], [x.finish_reason for x in (a, b, c, d, e)], outs

    lens, reasons, outs = run(main())
    assert lens == [7, 12, 5, 20, 8]
    assert reasons == ["length", "stop", "length", "stop", "length"]
    for n, got in zip(lens, outs):
        assert got[-1] == n and got == sorted(set(got))  # increasing counts ending at n


def test_seeded_draws_repeat():
    prof = make_profile(output_len=OutputLengthDist(mu=4.0, sigma=1.0, max_tokens=300))

    def draws(seed):
        eng = SimEngine(prof, seed=seed)
        return [eng.target_output_tokens(req(5), 500)[0] for _ in range(20)]

    assert draws(3) == draws(3)
    assert draws(3) != draws(4)
    assert all(1 <= n <= 300 for n in draws(5))


def test_step_times_chain_and_time_scale():
    # One request, prompt 100, 5 output tokens (ignore_eos). Engine seconds:
    # prefill step 0.010 + 0.0001*100 = 0.020; 4 decode steps of 0.0101 each.
    # first token = start + 0.020; finish = start + 0.020 + 4*0.0101 = start + 0.0604.
    scale = 2.0  # slow motion: 0.0604 engine s = 0.1208 wall s

    async def main():
        eng = SimEngine(make_profile(), time_scale=scale, max_lag_s=10.0)
        await eng.start()
        try:
            t0 = time.monotonic()
            er = eng.submit(req(100, max_tokens=5, ignore_eos=True))
            await drain(er)
            wall = time.monotonic() - t0
        finally:
            await eng.close()
        return er.sim, wall

    sim, wall = run(main())
    start = sim.first_scheduled_s
    assert sim.first_token_s - start == pytest.approx(0.020, abs=1e-12)
    # steps are chained on their scheduled ends: no sleep overshoot accumulates
    assert sim.finish_s - start == pytest.approx(0.0604, abs=1e-12)
    # the idle loop woke on the submit (its wake event), not on a poll: a missed wake
    # waits for ever (idle) or 1 wall s (the unschedulable branch's timeout, 0.5 engine
    # s here); 0.25 engine s = 0.5 wall s leaves room for a loaded host (before: 0.05)
    assert start - sim.arrival_s < 0.25
    assert wall >= 0.0604 * scale * 0.98  # it waited the scaled time


def test_preemption_by_hand():
    # 8 blocks of 16 tokens. A and B: prompt 48 (3 blocks), 40 output tokens (88 tokens = 6
    # blocks each at the end). Step 1 admits both (6 blocks, 2 free); step 2 gives each its
    # 4th block (0 free); when A's 65th token needs a 5th block, the FCFS victim is B (the
    # last running): 1 preemption. B cannot come back (needs 4 blocks, 3 free) until A
    # finishes, then runs alone. Total: 1 preemption; both get exactly 40 tokens.
    async def main():
        eng = SimEngine(make_profile(num_gpu_blocks=8, max_model_len=128), time_scale=0.001)
        await eng.start()
        try:
            ra = eng.submit(req(48, max_tokens=40, ignore_eos=True))
            rb = eng.submit(req(48, max_tokens=40, ignore_eos=True))
            outs = await asyncio.gather(drain(ra), drain(rb))
        finally:
            await eng.close()
        return eng, ra, rb, outs

    eng, ra, rb, outs = run(main())
    assert eng.inst.num_preemptions_total == 1
    assert (ra.sim.num_preemptions, rb.sim.num_preemptions) == (0, 1)
    assert [o[-1] for o in outs] == [40, 40]
    assert rb.sim.first_token_s < ra.sim.finish_s < rb.sim.finish_s
    assert eng.inst.free_blocks == 8
    assert eng.counters.generation_tokens_total == 80
    assert eng.counters.prompt_tokens_total == 96


def test_abort_frees_blocks():
    async def main():
        eng = SimEngine(make_profile(), time_scale=1.0)
        await eng.start()
        try:
            er = eng.submit(req(40, max_tokens=500, ignore_eos=True))
            await er.queue.get()  # first token: prefilled, holding ceil(41/16)=3 blocks soon
            held = eng.inst.num_blocks_used
            eng.abort(er)
            after = (eng.inst.num_blocks_used, eng.num_running, eng.num_waiting)
        finally:
            await eng.close()
        return held, after, eng.counters.requests_aborted_total

    held, after, aborted = run(main())
    assert held in (3, 4)  # 40 prompt tokens = 3 blocks (4 once the 49th token is computed)
    assert after == (0, 0, 0)
    assert aborted == 1


def test_multimodal_preprocess_and_encoder():
    # Image: 100 vision tokens, preprocess 0.2 s before queueing, encoder 0.3 s charged to
    # the first prefill step: that step = 0.010 + 0.0001*(20 + 100) + 0.3 = 0.322 s.
    vis = VisionCosts(tokens_per_image=100, tokens_per_frame=10, preprocess_s_per_image=0.2,
                      preprocess_s_per_frame=0.05, encoder_s_per_image=0.3, encoder_s_per_frame=0.02)

    async def main():
        eng = SimEngine(make_profile(vision=vis), time_scale=0.05, max_lag_s=10.0)
        await eng.start()
        try:
            er = eng.submit(req(20, max_tokens=2, ignore_eos=True, num_images=1),
                            VisionCharge(vision_tokens=100, preprocess_s=0.2, encoder_s=0.3))
            in_queue_early = eng.num_waiting + eng.num_running
            st_early = eng.status()
            await drain(er)
            st_late = eng.status()
        finally:
            await eng.close()
        return er, in_queue_early, st_early, st_late

    er, early, st_early, st_late = run(main())
    s = er.sim
    assert early == 0  # still preprocessing: not yet in the waiting queue
    # ... but /status shows it arriving, ready when its 0.2 s of preprocessing end
    assert [a.request_id for a in st_early.arriving] == [s.request_id]
    assert st_early.arriving[0].ready_s == pytest.approx(s.arrival_s + 0.2, abs=1e-12)
    assert st_early.arriving[0].prompt_tokens == 120 and st_early.waiting == ()
    assert st_late.arriving == ()
    assert InstanceStatus.from_dict(st_early.to_dict()) == st_early
    assert (s.prompt_tokens, s.vision_tokens, s.modality) == (120, 100, "image")
    assert s.first_scheduled_s - s.arrival_s >= 0.2 * 0.98
    assert s.first_token_s - s.first_scheduled_s == pytest.approx(0.322, abs=1e-9)
    assert s.finish_s - s.first_token_s == pytest.approx(0.010 + 0.0001, abs=1e-9)


def test_context_limit_and_bad_options():
    eng = SimEngine(make_profile(max_model_len=256))
    with pytest.raises(ApiError) as ei:
        eng.submit(req(200, max_tokens=100))
    assert ei.value.param == "max_tokens"
    with pytest.raises(AstroUserError):
        SimEngine(make_profile(), time_scale=0)
    with pytest.raises(AstroUserError):
        SimEngine(make_profile(), policy="nope")


def test_status_entry_with_an_unknown_field_names_list_index_and_fields():
    d = {"time_s": 1.0, "kv_blocks_free": 10,
         "limits": {"block_size": 16, "num_gpu_blocks": 100, "max_num_seqs": 4,
                    "max_num_batched_tokens": 64, "max_model_len": 512},
         "waiting": [{"request_id": "w", "arrival_s": 0.0, "prompt_tokens": 5}],
         "arriving": [{"request_id": "a", "arrival_s": 0.0, "prompt_tokens": 5, "ready": 2.0}]}
    with pytest.raises(AstroUserError) as ei:
        InstanceStatus.from_dict(d)
    msg = str(ei.value)
    assert ei.value.field == "status" and "arriving[0]" in msg and "'ready'" in msg and "ready_s" in msg
    d["arriving"][0]["ready_s"] = d["arriving"][0].pop("ready")
    assert InstanceStatus.from_dict(d).arriving[0].ready_s == 2.0
