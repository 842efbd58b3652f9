"""Dispatched-but-not-yet-visible requests (issue 13 §2): the scheduler's pending list and
the Predictor's view of it, each on a hand-computed case."""

from __future__ import annotations

import pytest

from conftest import write_profile
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.protocol.service_wire import PendingRequest, PredictRequest
from rps_astro_cli.services import predictor as pred_mod
from rps_astro_cli.services.scheduler.instances import InstanceState, Pending, pending_wire
from rps_astro_cli.types import CandidateRequest
from test_services_units import STATUS, hand_profile  # noqa: F401  (hand-computed fixture)


def test_with_pending_adds_only_what_the_snapshot_cannot_hold():
    # snapshot taken 0.1 s ago at engine time 5.0
    pend = (PendingRequest(10, 4, sent_age_s=0.05),                      # sent after the snapshot: add
            PendingRequest(20, 5, sent_age_s=0.3, accepted_age_s=0.2),   # accepted before it: in it
            PendingRequest(30, 6, sent_age_s=0.2, accepted_age_s=0.05),  # accepted after it: add
            PendingRequest(40, 7, sent_age_s=0.16),   # unanswered, sent 0.06 s before it (> margin 0.05)
            PendingRequest(50, 8, sent_age_s=0.14))   # unanswered, sent 0.04 s before it (< margin): add
    view = pred_mod.with_pending(STATUS, pend, status_age_s=0.1, margin_s=0.05)
    assert view.running == STATUS.running and view.waiting[:len(STATUS.waiting)] == STATUS.waiting
    added = view.waiting[len(STATUS.waiting):]
    assert [(r.prompt_tokens, r.predicted_output_tokens) for r in added] == [(10, 4), (30, 6), (50, 8)]
    # arrival: sent_age − status_age before the snapshot's time, clipped at it
    assert [r.arrival_s for r in added] == pytest.approx([5.0, 4.9, 4.96])
    assert all(r.num_computed_tokens == 0 and r.kv_blocks == 0 for r in added)
    assert pred_mod.with_pending(STATUS, (), 0.1) is STATUS


def test_predictor_counts_a_pending_request_by_hand(tmp_path):
    """test_services_units.test_predictor_by_hand plus one pending request (100-token prompt,
    3 predicted tokens) queued before the candidate:
    step 1: r1 decode + pending prefill 100 + candidate prefill 100 = 201 tokens → 10 + 20.1 ms
    = 30.1 ms (TTFT); step 2: three decodes → 10.3 ms (r1 ends at 3); step 3: two decodes →
    10.2 ms. E2E = 30.1 + 10.3 + 10.2 = 50.6 ms (40.4 ms without the pending one)."""
    p = pred_mod.Predictor(pred_mod.PredictorSettings("http://unused", profile=write_profile(tmp_path, hand_profile())))
    q = pred_mod.parse_predict({"prompt_tokens": 100, "predicted_output_tokens": 3,
                                "pending": [{"prompt_tokens": 100, "predicted_output_tokens": 3, "sent_age_s": 0.01}]})
    est = p.predict(STATUS, q.candidate, pred_mod.with_pending(STATUS, q.pending, status_age_s=0.02))
    assert est.ttft_s == pytest.approx(0.0301) and est.e2e_s == pytest.approx(0.0506)
    alone = p.predict(STATUS, q.candidate)
    assert alone.e2e_s == pytest.approx(0.0404)


def test_instance_load_counts_prompt_blocks_sent_since_its_status():
    from rps_astro_cli.services.scheduler.settings import InstanceEndpoint

    st = InstanceState(0, InstanceEndpoint("engine-0", "http://unused"))
    st.load_row = (50, 100, 2, 0, 0, 16, 48, None, None)  # STATUS_ROW: 50 of 100 blocks free, 2 running, bs 16
    st.status_s = 100.0  # the status was asked for at t = 100 s
    st.pending = [Pending(33, 10, sent_s=99.0),   # sent before: the status shows it
                  Pending(33, 10, sent_s=101.0),  # ceil(33 / 16) = 3 blocks
                  Pending(16, 5, sent_s=102.0)]   # 1 block
    assert st.status_row()[7:] == (4, 2)  # pending blocks, pending requests
    st.pending = []
    assert st.status_row()[7:] == (None, None)


def test_pending_wire_ages_and_expiry():
    a = Pending(10, 4, sent_s=10.0)                 # not accepted yet
    b = Pending(20, 5, sent_s=9.5)
    b.accepted_s = 9.75                            # sent 1.0 s ago: kept (≤ keep)
    c = Pending(30, 6, sent_s=9.0)                 # sent 1.5 s ago: dropped
    book = [c, b, a]
    wire = pending_wire(book, now_s=10.5, keep_s=1.0)
    assert book == [b, a]
    assert wire == (PendingRequest(20, 5, 1.0, 0.75), PendingRequest(10, 4, 0.5, None))


def test_pending_codec_round_trip_and_bad_field():
    q = PredictRequest(CandidateRequest(5, 3), "ttft", (PendingRequest(7, 2, 0.25, None),))
    assert PredictRequest.from_dict(q.to_dict()) == q
    assert "pending" not in PredictRequest(CandidateRequest(5, 3)).to_dict()
    with pytest.raises(AstroUserError, match=r"pending\[0\].*sent_age_s"):
        PredictRequest.from_dict({"prompt_tokens": 5, "predicted_output_tokens": 3,
                                  "pending": [{"prompt_tokens": 7, "predicted_output_tokens": 2, "sent_age_s": -1}]})
    with pytest.raises(pred_mod.HTTPUserError) as ei:
        pred_mod.parse_predict({"prompt_tokens": 5, "predicted_output_tokens": 3, "pending": {"x": 1}})
    assert ei.value.param == "pending" and ei.value.status == 400


def _recording_predictor(bodies: list[dict]):
    """A Predictor that appends every /predict body to `bodies` and answers a fixed estimate."""
    from fastapi import FastAPI

    pred = FastAPI()

    @pred.post("/predict")
    async def _predict(body: dict):
        bodies.append(body)
        return {"ttft_s": 0.1, "e2e_s": 0.2}
    return pred


def _healthy_app():
    """An engine app whose /health passes; the test adds its completions route."""
    from fastapi import FastAPI

    eng = FastAPI()

    @eng.get("/health")
    async def _health():
        return {"status": "ok"}
    return eng


def test_scheduler_sends_pending_requests_to_the_predictor():
    """Two requests, the second sent 0.3 s after the engine got the first, which it holds
    until the second is answered: the second's /predict body lists the first as pending
    (sent at least 0.3 s and at most the test's own measured span ago, not accepted yet);
    with count_pending off it does not. (Before: an engine taking 1 s for each, and the
    first's age bounded by 1 s — a loaded host stretched the 0.3 s gap past it, or let
    the engine answer the first before the second was predicted.)"""
    import asyncio
    import threading
    import time
    from contextlib import ExitStack

    import httpx

    from rps_astro_cli.protocol.http_server import ServerThread
    from rps_astro_cli.services.scheduler import InstanceEndpoint, SchedulerSettings, create_app

    bodies: list[dict] = []
    pred = _recording_predictor(bodies)
    eng = _healthy_app()
    got_first, release = threading.Event(), threading.Event()

    @eng.post("/v1/chat/completions")
    async def _chat():
        if not got_first.is_set():  # the first request: held until the test lets it go
            got_first.set()
            while not release.is_set():
                await asyncio.sleep(0.01)
        return {"id": "x", "object": "chat.completion", "choices": []}

    msg = {"model": "m", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 4}
    for count in (True, False):
        bodies.clear()
        got_first.clear()
        release.clear()
        with ExitStack() as st:
            e = st.enter_context(ServerThread(eng))
            st.callback(release.set)  # never leave the engine holding a request
            p = st.enter_context(ServerThread(pred))
            s = st.enter_context(ServerThread(create_app(SchedulerSettings(
                instances=(InstanceEndpoint("e0", e.url, p.url),), policy="power_of_k", policy_params={"k": 1},
                length_model="baseline", served_models=("m",), predict_deadline_s=2.0, count_pending=count,
                pending_keep_s=3600.0))))
            first = threading.Thread(target=httpx.post, args=(s.url + "/v1/chat/completions",),
                                     kwargs={"json": msg, "timeout": 60})
            t0 = time.monotonic()
            first.start()
            assert got_first.wait(60), "the first request did not reach the engine"
            time.sleep(0.3)
            r = httpx.post(s.url + "/v1/chat/completions", json=msg, timeout=60)
            span_s = time.monotonic() - t0  # the first was sent after t0, the second predicted before now
            assert first.is_alive()  # still held: the engine has not answered it
            release.set()
            first.join(timeout=60)
            assert r.status_code == 200 and len(bodies) == 2
        assert "pending" not in bodies[0]
        if not count:
            assert "pending" not in bodies[1]
            continue
        (pend,) = bodies[1]["pending"]
        assert pend["prompt_tokens"] == bodies[0]["prompt_tokens"]
        assert pend["predicted_output_tokens"] == bodies[0]["predicted_output_tokens"]
        assert 0.3 <= pend["sent_age_s"] <= span_s and pend["accepted_age_s"] is None


def test_an_ended_request_leaves_the_pending_list():
    """A request answered before any /status could show it has left the engine: the next
    request's /predict body must not list it as pending (before: it stayed there until
    `pending_keep_s`, so a Predictor simulated a prefill the engine no longer had).
    Both ways a response ends: a JSON body and a relayed stream."""
    from contextlib import ExitStack

    import httpx
    from fastapi.responses import StreamingResponse

    from rps_astro_cli.protocol.http_server import ServerThread
    from rps_astro_cli.services.scheduler import InstanceEndpoint, SchedulerSettings, create_app

    bodies: list[dict] = []
    pred = _recording_predictor(bodies)
    eng = _healthy_app()

    @eng.post("/v1/chat/completions")
    async def _chat(body: dict):
        if body.get("stream"):
            async def events():
                yield b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return {"id": "x", "object": "chat.completion", "choices": []}

    msg = {"model": "m", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 4}
    for stream in (False, True):
        bodies.clear()
        with ExitStack() as st:
            e = st.enter_context(ServerThread(eng))
            p = st.enter_context(ServerThread(pred))
            s = st.enter_context(ServerThread(create_app(SchedulerSettings(
                instances=(InstanceEndpoint("e0", e.url, p.url),), policy="power_of_k", policy_params={"k": 1},
                length_model="baseline", served_models=("m",), predict_deadline_s=2.0, count_pending=True,
                pending_keep_s=3600.0))))
            with httpx.Client(base_url=s.url, timeout=60) as c:
                for _ in range(2):
                    r = c.post("/v1/chat/completions", json={**msg, "stream": stream})
                    assert r.status_code == 200
                    if stream:
                        assert r.text.endswith("data: [DONE]\n\n")
        assert len(bodies) == 2
        assert "pending" not in bodies[1], (stream, bodies[1])
