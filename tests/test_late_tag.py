"""A request forwarded before its tag lands (`SchedulerSettings.late_tag`): the tag's wait
leaves the critical path, and the tag's length still reaches the Predictors — on the
pending entry and on the engine's `/status` rows of the request."""

from __future__ import annotations

import asyncio
import time
from contextlib import ExitStack

import httpx
from fastapi import FastAPI

from conftest import write_profile
from rps_astro_cli.engine import sim_server
from rps_astro_cli.engine.sim_engine import SimEngine
from rps_astro_cli.services.scheduler import InstanceEndpoint, SchedulerSettings, create_app
from rps_astro_cli.services.scheduler.instances import late_lengths_onto
from rps_astro_cli.types import InstanceConfig, InstanceStatus, RequestStatus
from test_services_scheduler import MODEL, chat, engine_app, hand_profile, start

TAG_TOKENS = 7  # the slow tagger's answer
TAG_DELAY_S = 0.7  # far above a 2-token reply (~30 ms); under the tag RPC's 1 s bound (RPC_BOUND_S)


def _row(rid: str, predicted: int | None) -> RequestStatus:
    return RequestStatus(rid, 0.0, 100, 100, 3, predicted)


def test_late_lengths_fill_only_rows_without_a_length():
    rid = "astro-0123456789abcdef"
    status = InstanceStatus("e0", 1.0, InstanceConfig(),
                            kv_blocks_free=10, running=(_row(f"chatcmpl-{rid}", None), _row("chatcmpl-x", None)),
                            waiting=(_row(f"cmpl-{rid}-1", 55),))
    wire = status.to_dict()
    late_lengths_onto(wire, {rid: 9})
    out = InstanceStatus.from_dict(wire)
    assert out.running[0].predicted_output_tokens == 9  # the engine's id contains the header's
    assert out.running[1].predicted_output_tokens is None  # not one of ours
    assert out.waiting[0].predicted_output_tokens == 55  # the engine has a length: kept
    wire = status.to_dict()
    late_lengths_onto(wire, {"astro-ffffffffffffffff": 3})
    assert InstanceStatus.from_dict(wire) == status  # nothing to fill


def slow_tagger() -> FastAPI:
    """A tagger answering TAG_TOKENS after TAG_DELAY_S."""
    app = FastAPI()

    @app.post("/tag")
    async def _tag():
        await asyncio.sleep(TAG_DELAY_S)
        return {"predicted_output_tokens": TAG_TOKENS, "prompt_tokens": 4, "text_tokens": 4}

    return app


def test_forwarded_before_the_tag_and_its_length_follows(tmp_path):
    """In-process look-aheads, fcfs engines, a tagger slower than the whole reply: the
    response ends before the tag answers (the forward did not wait for it), the engine's
    id carries the scheduler's `x-request-id`, and once the tag lands the decision record
    and the scheduler's copy of the engine's `/status` show the tag's length. With
    `late_tag` off the response waits for the tag."""
    tagger = slow_tagger()
    profile = write_profile(tmp_path, hand_profile())
    with ExitStack() as stack:
        eng = start(stack, engine_app(0, time_scale=1.0))
        tag = start(stack, tagger)
        for late in (True, False):
            with ExitStack() as inner:
                recs = _two_requests(inner, eng.url, tag.url, profile, late)
            # the tag's length, capped by max_tokens (2, then 400), late or not
            assert [d["predicted_output_tokens"] for d in recs] == [2, TAG_TOKENS]
            for d in recs:
                assert d.get("late_tag", False) is late
                assert (d["tag_wait_us"] == 0) is late


def _two_requests(stack: ExitStack, engine_url: str, tagger_url: str, profile: str, late: bool) -> list[dict]:
    app = create_app(SchedulerSettings(
        instances=(InstanceEndpoint("engine-0", engine_url, None),), policy="power_of_k", served_models=(MODEL,),
        profile=profile,
        tagger_url=tagger_url, tag_deadline_s=2.0, predict_in_process=True, late_tag=late, status_interval_s=0.02))
    s = start(stack, app)
    sched = app.state.scheduler
    with httpx.Client(base_url=s.url, timeout=10) as c:
        deadline = time.monotonic() + 5
        while sched.instances[0].status is None and time.monotonic() < deadline:  # the first /status poll
            time.sleep(0.01)
        # a short reply: it ends before the tag answers only when the forward did not wait
        t0 = time.monotonic()
        r = c.post("/v1/chat/completions", json=chat(max_tokens=2))
        took_s = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["id"].startswith("chatcmpl-astro-") is late  # the engine took our x-request-id
        assert (took_s < TAG_DELAY_S) is late, took_s
        # a long one, still running when its tag lands: a later poll shows the tag's length
        long = chat(max_tokens=400, stream=True, vllm_xargs={"astro_output_tokens": 400})
        with c.stream("POST", "/v1/chat/completions", json=long) as resp:
            lines = resp.iter_lines()  # kept: a dropped iterator closes the stream
            next(lines)  # its first token: it runs on the engine
            rows: list[RequestStatus] = []
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                rows = list(sched.instances[0].status.running)
                if rows and rows[0].predicted_output_tokens == TAG_TOKENS:
                    break
                time.sleep(0.02)
            assert rows and rows[0].predicted_output_tokens == TAG_TOKENS, rows
        time.sleep(0.1)  # the cut stream's record
        return c.get("/decisions").json()[-2:]


def test_a_late_tag_rpc_goes_out_after_the_forward(tmp_path):
    """A text request forwarded before its tag sends the tag RPC only once the forward is
    written (nothing waits for it, so it costs the request nothing); with `late_tag` off
    the RPC goes out first, before parsing, and the forward waits for it."""
    profile = write_profile(tmp_path, hand_profile())
    with ExitStack() as stack:
        eng = start(stack, engine_app(0, time_scale=1.0))
        tag = start(stack, slow_tagger())
        for late in (True, False):
            with ExitStack() as inner:
                app = create_app(SchedulerSettings(
                    instances=(InstanceEndpoint("engine-0", eng.url, None),), policy="power_of_k",
                    served_models=(MODEL,), profile=profile, tagger_url=tag.url, tag_deadline_s=2.0,
                    predict_in_process=True, late_tag=late, status_interval_s=0.02))
                s = start(inner, app)
                sched = app.state.scheduler
                order: list[str] = []
                clients = sched.clients
                post_json, pool = clients.post_json, clients.pool(eng.url)
                request = pool.request

                async def tag_rpc(*a, _order=order, _post=post_json, **k):  # the tag RPC task's first step
                    _order.append("tag")
                    return await _post(*a, **k)

                async def engine_rpc(method, *a, _order=order, _request=request, **k):  # writes the forward
                    if method == "POST":
                        _order.append("forward")
                    return await _request(method, *a, **k)

                clients.post_json, pool.request = tag_rpc, engine_rpc
                with httpx.Client(base_url=s.url, timeout=10) as c:
                    deadline = time.monotonic() + 5
                    while sched.instances[0].status is None and time.monotonic() < deadline:
                        time.sleep(0.01)
                    r = c.post("/v1/chat/completions", json=chat(max_tokens=2))
                    assert r.status_code == 200, r.text
                    time.sleep(TAG_DELAY_S + 0.2)  # the late tag lands
                    assert c.get("/decisions").json()[-1]["predicted_output_tokens"] == 2  # capped by max_tokens
                assert order == (["forward", "tag"] if late else ["tag", "forward"])


def test_in_process_tagging_leaves_the_event_loop_free(tmp_path, monkeypatch):
    """With no tagger service the scheduler tags in-process, on its worker thread: while
    one request's tag takes 0.6 s, another call is answered at once — whether the forward
    waits for that tag or not (`late_tag`). On the event loop it would wait the 0.6 s."""
    import json
    import threading

    from rps_astro_cli.services.tagger import Tagger

    real = Tagger.tag_result

    def slow(self, body):
        time.sleep(0.6)  # work that holds no lock the event loop needs
        return real(self, body)

    monkeypatch.setattr(Tagger, "tag_result", slow)
    length_model = tmp_path / "len.json"
    length_model.write_text(json.dumps({"kind": "bin_median", "edges_tokens": [], "median_output_tokens": [40]}))
    profile = write_profile(tmp_path, hand_profile())
    with ExitStack() as stack:
        eng = start(stack, engine_app(0, time_scale=1.0))
        for late in (True, False):
            with ExitStack() as inner:
                app = create_app(SchedulerSettings(
                    instances=(InstanceEndpoint("engine-0", eng.url, None),), policy="power_of_k",
                    served_models=(MODEL,), profile=profile, length_model=str(length_model), tag_deadline_s=2.0,
                    predict_in_process=True, late_tag=late, status_interval_s=0.02))
                s = start(inner, app)
                with httpx.Client(base_url=s.url, timeout=10) as c:
                    deadline = time.monotonic() + 5
                    while app.state.scheduler.instances[0].status is None and time.monotonic() < deadline:
                        time.sleep(0.01)
                    codes: list[int] = []
                    def post(url: str = s.url, out: list[int] = codes) -> None:
                        out.append(httpx.post(url + "/v1/chat/completions", json=chat(max_tokens=2),
                                              timeout=10).status_code)

                    t = threading.Thread(target=post)
                    t.start()
                    time.sleep(0.15)  # the chat request's tag is running now
                    t0 = time.monotonic()
                    assert c.get("/v1/models").status_code == 200
                    took_s = time.monotonic() - t0
                    t.join()
                assert codes == [200]
                assert took_s < 0.3, (late, took_s)


def test_a_length_blind_policy_forwards_before_the_tag(tmp_path):
    """A policy that reads no predicted length (llumnix: engine status, no Predictor)
    forwards a text request before its tag lands, even with Predictor sidecars listed
    (it never asks them) and without in-process look-aheads; the tag's length still lands
    on its record. round_robin polls no engine `/status`: it asks each engine's once, and
    forwards early where every engine names fcfs; beside an engine whose in-instance
    policy reads lengths (rps) it waits for the tag. power_of_k with objective e2e reads
    the candidate's own length: it waits too."""
    with ExitStack() as stack:
        eng = start(stack, engine_app(0, time_scale=1.0))
        rps = start(stack, sim_server.create_app(SimEngine(hand_profile(), policy="rps", time_scale=1.0,
                                                           instance_id="engine-0")))
        tag = start(stack, slow_tagger())
        cases = (("llumnix", {}, eng, True), ("round_robin", {}, eng, True), ("round_robin", {}, rps, False),
                 ("power_of_k", {"objective": "e2e"}, eng, False))
        for policy, params, engine, late in cases:
            with ExitStack() as inner:
                app = create_app(SchedulerSettings(
                    instances=(InstanceEndpoint("engine-0", engine.url, "http://127.0.0.1:9"),), policy=policy,
                    policy_params=params, served_models=(MODEL,), tagger_url=tag.url, tag_deadline_s=2.0,
                    predict_deadline_s=0.05, status_interval_s=0.02))
                s = start(inner, app)
                sched = app.state.scheduler
                with httpx.Client(base_url=s.url, timeout=10) as c:
                    deadline = time.monotonic() + 5
                    while sched.instances[0].engine_policy is None and time.monotonic() < deadline:
                        time.sleep(0.01)  # learned from a status poll, or asked once
                    t0 = time.monotonic()
                    r = c.post("/v1/chat/completions", json=chat(max_tokens=2))
                    took_s = time.monotonic() - t0
                    assert r.status_code == 200, r.text
                    assert (took_s < TAG_DELAY_S) is late, (policy, took_s)
                    time.sleep(TAG_DELAY_S + 0.2)  # a late tag lands
                    d = c.get("/decisions").json()[-1]
                    assert c.get("/instances").json()[0]["engine_policy"] == ("rps" if engine is rps else "fcfs")
                assert d.get("late_tag", False) is late, (policy, engine.url)
                assert (d["tag_wait_us"] == 0) is late, policy
                assert d["predicted_output_tokens"] == 2  # the tag's 7, capped by max_tokens, late or not
