"""The scheduler front door in one process: real sim engines and Predictors on loopback
threads, plus small fakes for slow/dead predictors and engines that die."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import ExitStack

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from conftest import linear_profile, write_profile
from conftest import prom_sum as metric
from rps_astro_cli.engine import sim_server
from rps_astro_cli.engine.sim_engine import SimEngine
from rps_astro_cli.protocol.http_server import ServerThread
from rps_astro_cli.services import predictor as pred_mod
from rps_astro_cli.services.http_common import free_port
from rps_astro_cli.services.scheduler import InstanceEndpoint, SchedulerSettings, create_app
from rps_astro_cli.sim.profile import ExecutionProfile

MODEL = "hand/model"


def hand_profile() -> ExecutionProfile:
    """step = 10 ms + 0.1 ms per token (no attention terms)."""
    return linear_profile(model=MODEL, gpu="none", num_gpu_blocks=256, max_model_len=1024)


@pytest.fixture()
def length_model(tmp_path) -> str:
    """Every prompt → 40 predicted output tokens."""
    p = tmp_path / "len.json"
    p.write_text(json.dumps({"kind": "bin_median", "edges_tokens": [], "median_output_tokens": [40]}))
    return str(p)


@pytest.fixture()
def profile_path(tmp_path) -> str:
    return write_profile(tmp_path, hand_profile())


def engine_app(i: int, time_scale: float = 0.05) -> FastAPI:
    return sim_server.create_app(SimEngine(hand_profile(), time_scale=time_scale, instance_id=f"engine-{i}", seed=i))


def start(stack: ExitStack, app: FastAPI, port: int = 0) -> ServerThread:
    return stack.enter_context(ServerThread(app, port=port))


def scheduler(stack: ExitStack, engines: list[str], predictors: list[str | None] | None = None, **kw) -> ServerThread:
    preds = predictors or [None] * len(engines)
    eps = tuple(InstanceEndpoint(f"engine-{i}", u, preds[i]) for i, u in enumerate(engines))
    return start(stack, create_app(SchedulerSettings(instances=eps, **kw)))


def chat(content: str = "hello world", **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}


def test_front_door_bad_input_is_4xx_and_never_reaches_an_engine(length_model):
    with ExitStack() as st:
        engs = [start(st, engine_app(i)) for i in range(2)]
        s = scheduler(st, [e.url for e in engs], policy="round_robin", length_model=length_model,
                      max_body_bytes=2000, api_key="sekret")
        h = {"authorization": "Bearer sekret"}
        with httpx.Client(base_url=s.url, headers=h, timeout=10) as c:
            cases = [
                (c.post("/v1/chat/completions", content=b"{not json"), 400, "body"),
                (c.post("/v1/chat/completions", json={"model": MODEL}), 400, "messages"),
                (c.post("/v1/completions", json={"model": MODEL, "max_tokens": 3}), 400, "prompt"),
                (c.post("/v1/chat/completions", json=chat(max_tokens=0)), 400, "max_tokens"),
                (c.post("/v1/chat/completions", json=chat(temperature="hot")), 400, "temperature"),
                (c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "top_p": 1.5}), 400, "top_p"),
                (c.post("/v1/chat/completions", json=chat(stop=[1, 2])), 400, "stop"),
                (c.post("/v1/nope", json=chat()), 404, None),
                (c.get("/v1/chat/completions"), 405, None),
                (c.post("/v1/chat/completions", json=chat(messages=[{"role": "wizard", "content": "x"}])), 400,
                 "messages[0].role"),
                (c.post("/v1/chat/completions", json={**chat(), "model": "gpt-9"}), 404, "model"),
                (c.post("/v1/chat/completions", json=chat("word " * 1000)), 413, "body"),
                (httpx.post(s.url + "/v1/chat/completions", json=chat()), 401, "authorization"),
                (httpx.get(s.url + "/decisions"), 401, "authorization"),
            ]
            for r, status, param in cases:
                assert r.status_code == status, r.text
                err = r.json()["error"]
                assert err["param"] == param and err["message"] and err["code"] == status
                assert status != 400 or param in err["message"]
                assert "Traceback" not in r.text and "detail" not in r.json()
            m = c.get("/metrics").text
            assert metric(m, "astro:instance_dispatched_total") == 0
            for e in engs:
                assert metric(httpx.get(e.url + "/metrics").text, "vllm:prompt_tokens_total") == 0
            ok = c.post("/v1/chat/completions", json=chat())
            assert ok.status_code == 200 and ok.headers["x-astro-instance"] in ("engine-0", "engine-1")
            assert ok.json()["usage"]["completion_tokens"] == 4
            models = c.get("/v1/models").json()
            assert [m["id"] for m in models["data"]] == [MODEL]
            one = c.get(f"/v1/models/{MODEL}")  # OpenAI's retrieve (the model id holds a slash)
            assert one.status_code == 200 and one.json()["id"] == MODEL
            missing = c.get("/v1/models/no-such-model")
            assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
            assert MODEL in missing.json()["error"]["message"]


def test_power_of_k_queries_exactly_k_predictors(length_model, profile_path):
    with ExitStack() as st:
        engs = [start(st, engine_app(i)) for i in range(4)]
        preds = [start(st, pred_mod.create_app(pred_mod.PredictorSettings(e.url, profile=profile_path)))
                 for e in engs]
        urls, purls = [e.url for e in engs], [p.url for p in preds]
        po2 = {"objective": "e2e", "kv_reserve_frac": 0.0, "tie_tolerance_s": 0.0}  # the paper's Po2 rule
        s2 = scheduler(st, urls, purls, policy="power_of_k", policy_params={"k": 2, **po2}, length_model=length_model,
                       predict_deadline_s=2.0)
        sall = scheduler(st, urls, purls, policy="power_of_k", policy_params={"k": "all", **po2},
                         length_model=length_model, predict_deadline_s=2.0)
        n = 6
        for s, k in ((s2, 2), (sall, 4)):
            with httpx.Client(base_url=s.url, timeout=10) as c:
                windows = []  # each request's (before send, after reply) wall clock
                for _ in range(n):
                    t_send = time.time()
                    assert c.post("/v1/chat/completions", json=chat()).status_code == 200
                    windows.append((t_send, time.time()))
                m = c.get("/metrics").text
                assert metric(m, "astro:predict_rpcs_total", policy="power_of_k") == n * k
                assert metric(m, "astro:predict_rpcs_total", outcome="ok") == n * k
                assert metric(m, "astro:dispatch_decisions_total", reason="lowest e2e") == n
                decs = c.get("/decisions").json()
                assert len(decs) == n and all(len(d["candidates"]) == k for d in decs)
                assert all(len(d["predictions"]) == k for d in decs)
                assert all(d["predicted_output_tokens"] == 4 for d in decs)  # 40 capped by max_tokens 4
                # each decision says when its request reached the front door: inside its own window
                assert [lo <= d["received_unix_s"] <= hi for (lo, hi), d in zip(windows, decs)] == [True] * n


def test_dead_and_slow_predictors_are_skipped_within_the_deadline(length_model, profile_path):
    import threading

    slow = FastAPI()
    release = threading.Event()  # the slow Predictor answers only once the test is over

    @slow.post("/predict")
    async def _slow():
        while not release.is_set():
            await asyncio.sleep(0.01)
        return {"ttft_s": 0.0, "e2e_s": 0.0}

    deadline_s = 1.0  # the live Predictor answers well within it, even on a loaded host
    with ExitStack() as st:
        engs = [start(st, engine_app(i)) for i in range(3)]
        live = start(st, pred_mod.create_app(pred_mod.PredictorSettings(engs[2].url, profile=profile_path)))
        slow_srv = start(st, slow)
        st.callback(release.set)
        dead = f"http://127.0.0.1:{free_port()}"
        s = scheduler(st, [e.url for e in engs], [dead, slow_srv.url, live.url], policy="power_of_k",
                      policy_params={"k": "all"}, length_model=length_model, predict_deadline_s=deadline_s,
                      predictor_breaker_failures=100)
        with httpx.Client(base_url=s.url, timeout=30) as c:
            c.post("/v1/chat/completions", json=chat())  # warm: connections, profile load
            m0 = c.get("/metrics").text
            for _ in range(3):
                r = c.post("/v1/chat/completions", json=chat())
                assert r.status_code == 200
            assert not release.is_set()  # answered while the slow Predictor never did: not waited for
            decs = c.get("/decisions").json()[1:]
            # the unanswered candidates compete with engine-2 on load (not starved)
            unanswered = "fallback: a predictor did not answer; lowest load"
            assert all(d["reason"] == unanswered and list(d["predictions"]) == ["2"] for d in decs), [
                (d["reason"], list(d["predictions"]), d["decide_us"]) for d in decs]
            # the decision waited for the deadline, not for the slow one (before: < 0.5 s
            # against a 1 s Predictor, which a loaded host could stretch past)
            assert all(0.9 * deadline_s * 1e6 <= d["decide_us"] < 20 * deadline_s * 1e6 for d in decs), decs
            m = c.get("/metrics").text
            for outcome in ("ok", "timeout", "error"):
                got = metric(m, "astro:predict_rpcs_total", outcome=outcome)
                assert got - metric(m0, "astro:predict_rpcs_total", outcome=outcome) == 3
        # every predictor dead → least outstanding requests
        s2 = scheduler(st, [e.url for e in engs], [dead, dead, dead], policy="power_of_k",
                       length_model=length_model, predict_deadline_s=0.05)
        with httpx.Client(base_url=s2.url, timeout=10) as c:
            assert c.post("/v1/chat/completions", json=chat()).status_code == 200
            d = c.get("/decisions").json()[-1]
            assert d["reason"].startswith("fallback: no predictor answered")


def test_engine_failure_retry_exclusion_and_readmission(length_model):
    with ExitStack() as st:
        e0 = ServerThread(engine_app(0)).start()
        port0 = int(e0.url.rsplit(":", 1)[1])
        e1 = start(st, engine_app(1))
        s = scheduler(st, [e0.url, e1.url], policy="round_robin", length_model=length_model,
                      health_interval_s=30.0, recheck_interval_s=0.05)
        with httpx.Client(base_url=s.url, timeout=10) as c:
            assert c.post("/v1/completions", json={"prompt": "a b", "max_tokens": 2}).headers[
                "x-astro-instance"] == "engine-0"
            e0.stop()  # engine-0 dies; round robin sends the next request there first... after engine-1
            seen = []
            for _ in range(3):
                with c.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
                    body = r.read().decode()
                    assert r.status_code == 200 and body.rstrip().endswith("data: [DONE]")
                    seen.append(r.headers["x-astro-instance"])
            assert seen.count("engine-1") == 3  # the one aimed at engine-0 was retried on engine-1
            decs = c.get("/decisions").json()
            assert sum(d["retries"] for d in decs) == 1
            inst = {i["name"]: i for i in c.get("/instances").json()}
            assert inst["engine-0"]["healthy"] is False and inst["engine-0"]["outstanding_requests"] == 0
            m = c.get("/metrics").text
            assert metric(m, "astro:scheduler_retries_total") == 1
            assert metric(m, "astro:instance_healthy", instance="engine-0") == 0
            # restart engine-0 on the same port: the health check readmits it
            start(st, engine_app(0), port=port0)
            deadline = time.monotonic() + 10
            while not {i["name"]: i for i in c.get("/instances").json()}["engine-0"]["healthy"]:
                assert time.monotonic() < deadline, "engine-0 not readmitted"
                time.sleep(0.05)
            names = {c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}).headers["x-astro-instance"]
                     for _ in range(2)}
            assert names == {"engine-0", "engine-1"}


def test_all_engines_down_is_a_clear_503(length_model):
    with ExitStack() as st:
        s = scheduler(st, [f"http://127.0.0.1:{free_port()}"], policy="round_robin", length_model=length_model,
                      served_models=(MODEL,))
        r = httpx.post(s.url + "/v1/chat/completions", json=chat(), timeout=10)
        assert r.status_code == 503 and r.json()["error"]["type"] == "engine_unavailable"


def dying_engine(contents: tuple[str, ...]) -> FastAPI:
    """A fake engine whose stream sends one delta event per item of `contents`, then fails
    (its connection is cut without the body's end)."""
    app = FastAPI()

    @app.get("/health")
    async def _health():
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def _chat():
        async def gen():
            for c in contents:
                yield b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": c}}]}).encode() + b"\n\n"
            await asyncio.sleep(0.05)
            raise RuntimeError("engine died")

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


def test_midstream_failure_ends_with_an_error_event(length_model):
    with ExitStack() as st:
        b = start(st, dying_engine((" a", " b")))
        s = scheduler(st, [b.url], policy="round_robin", length_model=length_model, served_models=(MODEL,))
        with httpx.Client(base_url=s.url, timeout=10) as c:
            with c.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
                events = [ln[6:] for ln in r.read().decode().splitlines() if ln.startswith("data: ")]
            assert events[-1] == "[DONE]"
            err = json.loads(events[-2])["error"]
            assert err["type"] == "engine_failure" and "mid-stream" in err["message"]
            assert [json.loads(e)["choices"][0]["delta"]["content"] for e in events[:2]] == [" a", " b"]
            assert metric(c.get("/metrics").text, "astro:scheduler_requests_total", outcome="midstream_error") == 1


def test_under_another_asgi_server_streams_are_relayed_read_by_read(length_model):
    """Under an ASGI server other than astro's (here Starlette's TestClient: no
    `ClientBody` in the scope) a stream is relayed by awaiting each engine read and
    sending it through ASGI: every event arrives, then [DONE]; an engine that fails
    mid-stream still ends it with the engine_failure event."""
    from fastapi.testclient import TestClient

    def events(text: str) -> list[str]:
        return [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]

    with ExitStack() as st:
        eng = start(st, engine_app(0))
        bad = start(st, dying_engine((" a",)))
        for url, failing in ((eng.url, False), (bad.url, True)):
            app = create_app(SchedulerSettings(instances=(InstanceEndpoint("engine-0", url, None),),
                                               policy="round_robin", served_models=(MODEL,)))
            with TestClient(app) as c:
                r = c.post("/v1/chat/completions", json=chat(max_tokens=5, stream=True))
                ev = events(r.text)
                assert r.status_code == 200 and ev[-1] == "[DONE]"
                if failing:
                    assert json.loads(ev[-2])["error"]["type"] == "engine_failure"
                    assert json.loads(ev[0])["choices"][0]["delta"]["content"] == " a"
                else:
                    deltas = [json.loads(e)["choices"][0]["delta"] for e in ev[:-1] if json.loads(e)["choices"]]
                    assert sum(1 for d in deltas if d.get("content")) == 5
                    assert c.get("/decisions").json()[-1]["outcome"] == "ok"


def test_engine_sees_predicted_length_and_llumnix_reads_status(length_model):
    with ExitStack() as st:
        engs = [start(st, engine_app(i, time_scale=1.0)) for i in range(2)]
        # the tag awaited (late_tag off): the body the engine gets carries the tag's length
        # (with late tags, the default for a length-blind policy on fcfs engines, the
        # length follows on the scheduler's copy of /status instead: test_late_tag.py)
        s = scheduler(st, [e.url for e in engs], policy="llumnix", length_model=length_model,
                      status_interval_s=0.05, late_tag=False)
        with httpx.Client(base_url=s.url, timeout=20) as c:
            with c.stream("POST", "/v1/chat/completions", json=chat(max_tokens=300, stream=True)) as r:
                it = r.iter_lines()
                next(it)
                name = r.headers["x-astro-instance"]
                eng = engs[int(name[-1])]
                running = httpx.get(eng.url + "/status").json()["running"]
                assert [q["predicted_output_tokens"] for q in running] == [40]
            deadline = time.monotonic() + 5  # the record lands when the aborted stream is torn down
            while not (decs := c.get("/decisions").json()):
                assert time.monotonic() < deadline
                time.sleep(0.02)
            d = decs[-1]
            assert d["policy"] == "llumnix" and d["reason"] == "lowest load"
            assert d["outcome"] == "client_disconnected"
            # the client left mid-stream: the scheduler released the instance and the engine aborted
            assert all(i["outstanding_requests"] == 0 for i in c.get("/instances").json())
            while httpx.get(eng.url + "/status").json()["running"]:
                assert time.monotonic() < deadline + 5, "engine kept generating for a gone client"
                time.sleep(0.02)


def test_external_tagger_and_its_deadline(length_model):
    import threading

    from rps_astro_cli.services.tagger import TaggerSettings
    from rps_astro_cli.services.tagger import create_app as tagger_app

    slow = FastAPI()
    release = threading.Event()  # the slow tagger answers only once the test is over

    @slow.post("/tag")
    async def _slow_tag():
        while not release.is_set():
            await asyncio.sleep(0.01)
        return {"predicted_output_tokens": 7, "prompt_tokens": 5}

    with ExitStack() as st:
        eng = start(st, engine_app(0))
        tagger = start(st, tagger_app(TaggerSettings(length_model=length_model)))
        slow_srv = start(st, slow)
        st.callback(release.set)
        body = chat(max_tokens=300)
        # a deadline the live tagger meets on a loaded host too (it loads its model first);
        # the request waits for its tag (late_tag off: round_robin on fcfs engines would
        # forward first, tests/test_late_tag.py)
        s = scheduler(st, [eng.url], policy="round_robin", tagger_url=tagger.url, tag_deadline_s=10.0,
                      late_tag=False)
        with httpx.Client(base_url=s.url, timeout=10) as c:
            assert c.post("/v1/chat/completions", json=body).status_code == 200
            assert c.get("/decisions").json()[-1]["predicted_output_tokens"] == 40  # the tagger's model
            assert metric(c.get("/metrics").text, "astro:tag_rpcs_total", outcome="ok") == 1
        s2 = scheduler(st, [eng.url], policy="round_robin", tagger_url=slow_srv.url, tag_deadline_s=0.05,
                       default_output_tokens=256, late_tag=False)
        with httpx.Client(base_url=s2.url, timeout=30) as c:
            assert c.post("/v1/chat/completions", json=body).status_code == 200
            assert not release.is_set()  # answered while the tagger never did: not waited for
            assert c.get("/decisions").json()[-1]["predicted_output_tokens"] == 256  # the default
            assert metric(c.get("/metrics").text, "astro:tag_rpcs_total", outcome="timeout") == 1


def test_predictor_breaker_skips_a_hung_predictor(length_model, profile_path):
    hung = FastAPI()

    @hung.post("/predict")
    async def _hung():
        await asyncio.sleep(3.0)
        return {"ttft_s": 0.0, "e2e_s": 0.0}

    # the deadline leaves the live Predictor room on a loaded 2-core host (at 50 ms it
    # missed some under load, so the timeout count was off); the hung one never answers in it
    with ExitStack() as st:
        engs = [start(st, engine_app(i)) for i in range(2)]
        live = start(st, pred_mod.create_app(pred_mod.PredictorSettings(engs[1].url, profile=profile_path)))
        h = start(st, hung)
        s = scheduler(st, [e.url for e in engs], [h.url, live.url], policy="power_of_k", policy_params={"k": "all"},
                      length_model=length_model, predict_deadline_s=0.3, predictor_breaker_failures=2,
                      predictor_breaker_s=30.0)
        with httpx.Client(base_url=s.url, timeout=10) as c:
            for _ in range(4):
                assert c.post("/v1/chat/completions", json=chat()).status_code == 200
            m = c.get("/metrics").text
            # two misses in a row open the breaker: the next two requests do not ask it
            assert metric(m, "astro:predict_rpcs_total", outcome="timeout") == 2
            assert metric(m, "astro:predict_rpcs_total", outcome="skipped") == 2
            assert metric(m, "astro:predict_rpcs_total") == 8  # still k = N = 2 per request


def test_oracle_lengths_use_the_true_length(length_model):
    with ExitStack() as st:
        eng = start(st, engine_app(0))
        s = scheduler(st, [eng.url], policy="round_robin", length_model=length_model, oracle_lengths=True)
        with httpx.Client(base_url=s.url, timeout=10) as c:
            body = chat(max_tokens=300, vllm_xargs={"astro_output_tokens": 123})
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 123
            assert c.get("/decisions").json()[-1]["predicted_output_tokens"] == 123  # not the tagger's 40
            c.post("/v1/chat/completions", json=chat(max_tokens=300))
            assert c.get("/decisions").json()[-1]["predicted_output_tokens"] == 40  # no true length: tagger


def _wait_cached(c: httpx.Client, name: str, blocks: int, timeout_s: float = 10.0) -> None:
    """Until the scheduler's mirror of `name`'s prefix cache holds ≥ `blocks` hashes."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = {i["name"]: i["prefix_cached_blocks"] for i in c.get("/instances").json()}
        if got[name] >= blocks:
            return
        assert time.monotonic() < deadline, f"scheduler never saw {blocks} cached blocks on {name}: {got}"
        time.sleep(0.02)


def _wait_idle(engine_url: str, timeout_s: float = 10.0) -> None:
    """Until the engine's /status shows nothing running or waiting."""
    deadline = time.monotonic() + timeout_s
    while True:
        d = httpx.get(engine_url + "/status").json()
        if not d["running"] and not d["waiting"]:
            return
        assert time.monotonic() < deadline, f"{engine_url} never idle: {d}"
        time.sleep(0.02)


def test_prefix_hits_live_power_of_k_pin_and_cache_aware(length_model, profile_path):
    # block 16, fallback token ids ("abcd" = 1 token; a chat prompt's ids are its role's,
    # "user" = 1, then its text's). A: 1 + 60 ids → 3 full blocks cached on the instance
    # X that served it. B extends A's text to 100 words: its hit on X is 3 blocks = 48
    # tokens. power_of_k with k = 1 samples exactly X for B (the cache pin), and X's
    # Predictor, told cached_tokens = 48, predicts one idle step of prompt − 48 tokens:
    # TTFT = 10 ms + 0.1 ms × (prompt − 48). cache_aware then sends C (B + 20 words:
    # 6 cached blocks of B's, 96 tokens, > half its prompt) to X as well.
    text = "abcd " * 60
    with ExitStack() as st:
        engs = [start(st, engine_app(i, time_scale=0.05)) for i in range(2)]
        preds = [start(st, pred_mod.create_app(pred_mod.PredictorSettings(e.url, profile=profile_path)))
                 for e in engs]
        urls = [e.url for e in engs]
        pok = scheduler(st, urls, [p.url for p in preds], policy="power_of_k", policy_params={"k": 1},
                        length_model=length_model, predict_deadline_s=5.0, status_interval_s=0.05,
                        count_pending=False)  # A has ended: no pending copy of it in B's look-ahead
        ca = scheduler(st, urls, policy="cache_aware", length_model=length_model, status_interval_s=0.05)
        with httpx.Client(base_url=pok.url, timeout=20) as c:
            r = c.post("/v1/chat/completions", json=chat(text, max_tokens=2))
            assert r.status_code == 200
            x = r.headers["x-astro-instance"]
            _wait_cached(c, x, 3)
            r = c.post("/v1/chat/completions", json=chat(text + "abcd " * 40, max_tokens=2))
            assert r.status_code == 200 and r.headers["x-astro-instance"] == x
            rec = d = c.get("/decisions").json()[-1]
            xi = int(x[-1])
            assert d["candidates"] == [xi]
            ttft = d["predictions"][str(xi)]["ttft_s"]
            assert ttft == pytest.approx(0.010 + 0.0001 * (rec["prompt_tokens"] - 48), abs=1e-9)
        with httpx.Client(base_url=ca.url, timeout=20) as c:
            _wait_cached(c, x, 6)
            r = c.post("/v1/chat/completions", json=chat(text + "abcd " * 60, max_tokens=2))
            assert r.status_code == 200 and r.headers["x-astro-instance"] == x
            assert c.get("/decisions").json()[-1]["reason"].startswith("cache-aware")
        m = httpx.get(engs[xi].url + "/metrics").text
        # B hit 48 tokens, C 96 (its prompt, 1 + 120 ids, caps the hit at 7 blocks; 6 cached)
        assert metric(m, "vllm:prefix_cache_hits_total") == 48 + 96
        # power_of_k's defaults (k = all: no pin) still tell each Predictor the hit on its
        # instance. D = A's text + 80 words (1 + 140 ids, hit capped at 8 blocks; C left 7
        # cached on X → 112 tokens): X's Predictor predicts 10 ms + 0.1 ms × (prompt − 112),
        # the other's (no hit) 10 ms + 0.1 ms × prompt, so D goes to X
        full = scheduler(st, urls, [p.url for p in preds], policy="power_of_k", length_model=length_model,
                         policy_params={"tie_tolerance_s": 0.0}, predict_deadline_s=5.0, status_interval_s=0.05)
        with httpx.Client(base_url=full.url, timeout=20) as c:
            _wait_cached(c, x, 7)
            for e in engs:  # both idle, so each prediction is one prefill step from now
                _wait_idle(e.url)
            # and each Predictor's held status too: one up to status_max_age_s (0.25 s) old is
            # used as is while it refreshes, and may still show C's last step (+5.9 ms seen)
            time.sleep(0.3)
            r = c.post("/v1/chat/completions", json=chat(text + "abcd " * 80, max_tokens=2))
            assert r.status_code == 200 and r.headers["x-astro-instance"] == x
            d = c.get("/decisions").json()[-1]
            assert sorted(d["candidates"]) == [0, 1]
            n = d["prompt_tokens"]
            # abs 0.5 ms: a live engine's clock sits between its idle ticks (the hit is 11.2 ms)
            assert d["predictions"][str(xi)]["ttft_s"] == pytest.approx(0.010 + 0.0001 * (n - 112), abs=5e-4)
            assert d["predictions"][str(1 - xi)]["ttft_s"] == pytest.approx(0.010 + 0.0001 * n, abs=5e-4)
        m = httpx.get(engs[xi].url + "/metrics").text
        assert metric(m, "vllm:prefix_cache_hits_total") == 48 + 96 + 112


def test_default_power_of_k_hashes_no_prompt_when_no_engine_caches(length_model, profile_path):
    # engines with prefix caching off answer /status without `prefix_cache`: no hit can
    # exist, so the front door neither hashes prompts nor (on a vLLM fleet) asks /tokenize;
    # the Predictors then predict the whole prompt's prefill (no cached_tokens)
    with ExitStack() as st:
        engs = [start(st, sim_server.create_app(SimEngine(hand_profile(), time_scale=0.05, instance_id=f"engine-{i}",
                                                          seed=i, enable_prefix_caching=False)))
                for i in range(2)]
        preds = [start(st, pred_mod.create_app(pred_mod.PredictorSettings(e.url, profile=profile_path)))
                 for e in engs]
        eps = tuple(InstanceEndpoint(f"engine-{i}", e.url, p.url) for i, (e, p) in enumerate(zip(engs, preds)))
        app = create_app(SchedulerSettings(instances=eps, policy="power_of_k", length_model=length_model,
                                           predict_deadline_s=5.0, status_interval_s=0.05))
        s = start(st, app)
        with httpx.Client(base_url=s.url, timeout=20) as c:
            text = "abcd " * 60
            for _ in range(2):
                assert c.post("/v1/chat/completions", json=chat(text, max_tokens=2)).status_code == 200
            d = c.get("/decisions").json()[-1]
            assert all(i["prefix_cached_blocks"] == 0 for i in c.get("/instances").json())
        disp = app.state.scheduler.dispatcher
        assert disp.needs_prefix and not disp.prefix_wanted()
        n = d["prompt_tokens"]
        assert all(p["ttft_s"] == pytest.approx(0.010 + 0.0001 * n, abs=5e-4) for p in d["predictions"].values())


def slow_tagger_and_timed_predictor() -> tuple[dict[str, list[float]], FastAPI, FastAPI]:
    """A tagger that answers 7 tokens after 0.3 s and a Predictor that answers at once,
    each stamping `times` ("tag_in", "tag_out", "predict": time.monotonic()); the
    Predictor also notes each body's `first_token_only` (1.0 true, 0.0 false or absent)."""
    times: dict[str, list[float]] = {"tag_in": [], "tag_out": [], "predict": [], "first_token_only": []}
    tagger = FastAPI()

    @tagger.post("/tag")
    async def _tag():
        times["tag_in"].append(time.monotonic())
        await asyncio.sleep(0.3)
        times["tag_out"].append(time.monotonic())
        return {"predicted_output_tokens": 7, "prompt_tokens": 2, "text_tokens": 2}

    predictor = FastAPI()

    @predictor.post("/predict")
    async def _predict(request: Request):
        times["predict"].append(time.monotonic())
        times["first_token_only"].append(float((await request.json()).get("first_token_only", False)))
        return {"ttft_s": 0.01, "e2e_s": 0.1}

    return times, tagger, predictor


def test_early_dispatch_asks_predictors_while_the_tagger_works(length_model):
    """Objective ttft, a text request: the Predictor RPCs go out before the (slow) tag
    returns, told that the decision reads the TTFT only (`first_token_only`: their
    look-ahead may stop at the first token); the forward still carries the tag's length.
    Objective e2e, or early dispatch off: the Predictors are asked only after the tag,
    for the whole reply."""
    times, tagger, predictor = slow_tagger_and_timed_predictor()
    with ExitStack() as st:
        eng = start(st, engine_app(0))
        tag_srv, pred_srv = start(st, tagger), start(st, predictor)
        cases = (({"k": "all"}, True, True), ({"k": "all"}, False, False),
                 ({"k": "all", "objective": "e2e"}, True, False))
        for params, early_on, early_expected in cases:
            s = scheduler(st, [eng.url], [pred_srv.url], policy="power_of_k", policy_params=params,
                          tagger_url=tag_srv.url, tag_deadline_s=2.0, predict_deadline_s=2.0,
                          early_dispatch=early_on)
            for v in times.values():
                v.clear()
            with httpx.Client(base_url=s.url, timeout=10) as c:
                assert c.post("/v1/chat/completions", json=chat(max_tokens=50)).status_code == 200
                d = c.get("/decisions").json()[-1]
            assert len(times["predict"]) == 1 and len(times["tag_out"]) == 1, times
            asked_before_tag = times["predict"][0] < times["tag_out"][0]
            assert asked_before_tag is early_expected, (params, early_on, times)
            assert times["first_token_only"] == [float(early_expected)]
            assert d.get("early_dispatch", False) is early_expected
            assert d["predicted_output_tokens"] == 7  # the tag's length, early or not


def test_status_policy_polls_engines_fast_but_services_at_the_health_period(length_model):
    """power_of_k reads /status every status_interval_s; the Predictors' and the tagger's
    /health are asked every health_interval_s — except a Predictor a health check found
    failing, which is re-checked every status tick (fast readmission)."""
    calls = {"pred-ok": 0, "pred-bad": 0, "tagger": 0}

    def service(name: str, status: int) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def _health():
            calls[name] += 1
            from fastapi.responses import JSONResponse
            return JSONResponse({"status": "ok" if status == 200 else "degraded"}, status_code=status)

        return app

    with ExitStack() as st:
        engs = [start(st, engine_app(i)) for i in range(2)]
        ok, bad, tag = (start(st, service("pred-ok", 200)), start(st, service("pred-bad", 503)),
                        start(st, service("tagger", 200)))
        s = scheduler(st, [e.url for e in engs], [ok.url, bad.url], policy="power_of_k", tagger_url=tag.url,
                      status_interval_s=0.05, health_interval_s=1.0, recheck_interval_s=0.05)
        with httpx.Client(base_url=s.url, timeout=10) as c:
            assert c.get("/health").status_code in (200, 503)
            for v in calls:
                calls[v] = 0
            # a window of at least 2 s and 20 re-checks of the failing one (every status
            # tick), measured: a loaded host runs fewer ticks per second (before: a fixed
            # 2 s window that had to hold >= 10 ticks)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 2.0 or calls["pred-bad"] < 20:
                assert time.monotonic() - t0 < 60, calls
                time.sleep(0.05)
            got, window_s = dict(calls), time.monotonic() - t0
            inst = c.get("/instances").json()
        # at a 1 s health period: one check per started second of the window (+1 at its
        # edge) each; at the 50 ms status period it would be ~20 per second
        assert 1 <= got["pred-ok"] <= window_s + 1 and 1 <= got["tagger"] <= window_s + 1, (got, window_s)
        # the failing one: every status tick, many per health period (asked at the health
        # period it would be checked as often as the others)
        assert got["pred-bad"] >= 2 * got["pred-ok"] + 2, (got, window_s)
        states = inst if isinstance(inst, list) else inst.get("instances", inst)
        assert any("health check" in str(x.get("predictor_error")) for x in states), states


def test_in_process_predictions_equal_the_sidecars(length_model, profile_path):
    """`predict_in_process`: an instance without a Predictor URL is predicted by the
    scheduler itself with the sidecar's look-ahead — the same estimate a sidecar gives on
    the same engine state (here: idle engines, so the state cannot move between the two)."""
    with ExitStack() as st:
        engs = [start(st, engine_app(i)) for i in range(2)]
        side = [start(st, pred_mod.create_app(pred_mod.PredictorSettings(e.url, profile=profile_path)))
                for e in engs]
        urls = [e.url for e in engs]
        params = {"k": "all", "objective": "ttft"}
        s_side = scheduler(st, urls, [p.url for p in side], policy="power_of_k", policy_params=params,
                           length_model=length_model, profile=profile_path, predict_deadline_s=2.0)
        s_local = scheduler(st, urls, None, policy="power_of_k", policy_params=params, length_model=length_model,
                            profile=profile_path, predict_deadline_s=2.0, predict_in_process=True)
        s_none = scheduler(st, urls, None, policy="power_of_k", policy_params=params, length_model=length_model,
                           profile=profile_path, predict_deadline_s=2.0)
        got = {}
        for name, s in (("side", s_side), ("local", s_local), ("none", s_none)):
            with httpx.Client(base_url=s.url, timeout=10) as c:
                body = chat("one two three four five six seven eight", max_tokens=20, stream=False)
                assert c.post("/v1/chat/completions", json=body).status_code == 200
                time.sleep(0.3)  # the engines drain: the next decision sees them idle
                assert c.post("/v1/chat/completions", json=body).status_code == 200
                got[name] = c.get("/decisions").json()[-1]
                m = c.get("/metrics").text
                got[name]["rpcs"] = {o: metric(m, "astro:predict_rpcs_total", outcome=o) for o in ("ok", "in_process")}
        assert got["side"]["rpcs"] == {"ok": 4, "in_process": 0}
        assert got["local"]["rpcs"] == {"ok": 0, "in_process": 4}
        for i in ("0", "1"):
            a, b = got["side"]["predictions"][i], got["local"]["predictions"][i]
            assert a["ttft_s"] == pytest.approx(b["ttft_s"], rel=1e-9)
            assert a["e2e_s"] == pytest.approx(b["e2e_s"], rel=1e-9)
        # an idle 2-engine fleet: the prefill of 8 + chat-template tokens is the TTFT (> 10 ms step floor)
        assert got["local"]["predictions"]["0"]["ttft_s"] >= 0.01
        assert got["none"]["reason"].startswith("fallback")  # no sidecar and not in-process: unscored


def test_router_metrics_match_the_decisions_the_report_reads(length_model, profile_path):
    """The prediction-error metrics count the same (predicted, observed) pairs as
    `GET /decisions`: Δsum / Δcount of `astro:prediction_abs_error_seconds` and
    `astro:prediction_rel_error` equal `bench.scrape.decisions_summary`'s MAE and MAPE;
    every decision times its stages (tag, filter, sample, predict, score, pick); with no
    Predictor answering, each decision is a fallback counted by its reason."""
    from rps_astro_cli.bench.scrape import decisions_summary

    with ExitStack() as st:
        engs = [start(st, engine_app(i, time_scale=1.0)) for i in range(2)]
        preds = [start(st, pred_mod.create_app(pred_mod.PredictorSettings(e.url, profile=profile_path)))
                 for e in engs]
        # early dispatch off: its decisions' e2e assume the default reply length and are
        # left out of the E2E error (checked below), so this run has E2E pairs to compare
        s = scheduler(st, [e.url for e in engs], [p.url for p in preds], policy="power_of_k",
                      policy_params={"k": "all"}, length_model=length_model, predict_deadline_s=2.0,
                      early_dispatch=False)
        early = scheduler(st, [e.url for e in engs], [p.url for p in preds], policy="power_of_k",
                          policy_params={"k": "all"}, length_model=length_model, predict_deadline_s=2.0)
        n = 5
        with httpx.Client(base_url=early.url, timeout=10) as c:
            for i in range(2):
                body = chat(f"hello world {i}", ignore_eos=True, stream=True)
                assert c.post("/v1/chat/completions", json=body).status_code == 200
            m_early = c.get("/metrics").text
            summ_early = decisions_summary(c.get("/decisions").json())
        assert summ_early["predictor_e2e"]["count"] == 0 == metric(
            m_early, "astro:prediction_abs_error_seconds_count", metric="e2e")
        assert summ_early["predictor_ttft"]["count"] == 2 == metric(
            m_early, "astro:prediction_abs_error_seconds_count", metric="ttft")
        with httpx.Client(base_url=s.url, timeout=10) as c:
            for i in range(n):
                body = chat(f"hello world {i}", ignore_eos=True, stream=i % 2 == 1)
                assert c.post("/v1/chat/completions", json=body).status_code == 200
            m = c.get("/metrics").text
            decs = c.get("/decisions").json()
    summ = decisions_summary(decs)
    # TTFT is observed on streamed answers only (2 of the 5)
    for metric_name, key, want in (("e2e", "predictor_e2e", n), ("ttft", "predictor_ttft", n // 2)):
        cnt = metric(m, "astro:prediction_abs_error_seconds_count", metric=metric_name)
        assert cnt == summ[key]["count"] == want, metric_name
        assert metric(m, "astro:prediction_abs_error_seconds_sum", metric=metric_name) / cnt == \
            pytest.approx(summ[key]["mae_s"], rel=1e-9)
        if summ[key]["mape"] is not None:
            assert metric(m, "astro:prediction_rel_error_sum", metric=metric_name) / cnt == \
                pytest.approx(summ[key]["mape"], rel=1e-9)
    for stage in ("tag", "filter", "sample", "predict", "score", "pick"):
        assert metric(m, "astro:dispatch_stage_seconds_count", stage=stage) == n, stage
    assert metric(m, "astro:dispatch_fallbacks_total") == 0
    with ExitStack() as st:  # Predictors that are not there: every decision falls back
        engs = [start(st, engine_app(i)) for i in range(2)]
        dead = [f"http://127.0.0.1:{free_port()}" for _ in engs]
        s = scheduler(st, [e.url for e in engs], dead, policy="power_of_k", policy_params={"k": "all"},
                      length_model=length_model, predict_deadline_s=0.5, predictor_breaker_failures=100)
        with httpx.Client(base_url=s.url, timeout=10) as c:
            for _ in range(3):
                assert c.post("/v1/chat/completions", json=chat()).status_code == 200
            m = c.get("/metrics").text
    assert metric(m, "astro:dispatch_fallbacks_total", reason="no predictor answered") == 3
    assert metric(m, "astro:prediction_abs_error_seconds_count") == 0  # no prediction, no error


def test_decisions_summary_compares_in_engine_seconds():
    """Hand-computed: predicted E2E 2.0 engine s, observed 3.0 wall s at time scale 1.5 →
    2.0 engine s: error 0; predicted 1.0 vs 3.0 wall s (2.0 engine s): 1.0 s, 50 %. A
    failed request's pair is not counted."""
    from rps_astro_cli.bench.scrape import decisions_summary

    decs = [{"choice": 0, "predictions": {"0": {"ttft_s": 0.1, "e2e_s": 2.0}}, "observed_e2e_s": 3.0,
             "observed_ttft_s": 0.15, "outcome": "ok"},
            {"choice": 1, "predictions": {"1": {"ttft_s": 0.1, "e2e_s": 1.0}}, "observed_e2e_s": 3.0,
             "observed_ttft_s": 0.3, "outcome": "ok"},
            {"choice": 0, "predictions": {"0": {"ttft_s": 0.1, "e2e_s": 9.0}}, "observed_e2e_s": 0.2,
             "outcome": "midstream_error"}]
    s = decisions_summary(decs, time_scale=1.5)
    assert s["predictor_e2e"] == {"count": 2, "mae_s": pytest.approx(0.5), "mape": pytest.approx(0.25)}
    assert s["predictor_ttft"]["count"] == 2 and s["predictor_ttft"]["mae_s"] == pytest.approx(0.05)


class _StatusResp:
    status = 200

    def __init__(self, body: bytes):
        self.body = body

    async def read(self) -> bytes:
        return self.body


class _StatusClients:
    """The scheduler's `Clients` as far as the health loop's /status poll uses them:
    engine URL → the `InstanceStatus` its `GET /status` answers."""

    def __init__(self, by_url):
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


@pytest.mark.parametrize("policy", ["power_of_k", "llumnix"])
def test_live_status_poll_stores_each_instances_status_row(policy):
    """One health-loop /status poll stores `dispatch.loads.status_fields_of` per instance (by
    hand: e0 30 free of 100 blocks, 1 running; e1 18 free, 2 running; no waiting queue)."""
    import rps_astro_cli.types as t
    from rps_astro_cli.services.scheduler.app import Scheduler

    cfg = t.InstanceConfig(block_size=16, num_gpu_blocks=100, max_num_seqs=48, max_model_len=1024)
    e0 = t.InstanceStatus("e0", 0.0, cfg, 30, running=(
        t.RequestStatus("a", 0.0, 96, num_computed_tokens=100, generated_tokens=4, kv_blocks=7),))
    e1 = t.InstanceStatus("e1", 0.0, cfg, 18, running=(
        t.RequestStatus("b", 0.0, 60, num_computed_tokens=80, generated_tokens=20, kv_blocks=5),
        t.RequestStatus("c", 0.0, 30, num_computed_tokens=70, generated_tokens=40, kv_blocks=5)))
    statuses = {"http://e0": e0, "http://e1": e1}
    sched = Scheduler(SchedulerSettings(
        instances=tuple(InstanceEndpoint(f"e{i}", url, None) for i, url in enumerate(statuses)),
        policy=policy, length_model="baseline", served_models=("m",)))
    assert sched.health.needs_status
    sched.health.clients = _StatusClients(statuses)  # type: ignore[assignment]
    states = [sched.instances[0], sched.instances[1]]
    asyncio.run(sched.health.check_all(with_services=False))
    assert all(st.healthy for st in states)
    from rps_astro_cli.dispatch.loads import STATUS_ROW

    assert [dict(zip(STATUS_ROW, st.load_row)) for st in states] == [
        {"kv_blocks_free": 30, "kv_blocks_total": 100, "num_running": 1, "num_waiting": 0,
         "waiting_blocks_needed": 0, "kv_block_size": 16, "max_num_seqs": 48, "pending_blocks_needed": None,
         "pending_requests": None},
        {"kv_blocks_free": 18, "kv_blocks_total": 100, "num_running": 2, "num_waiting": 0,
         "waiting_blocks_needed": 0, "kv_block_size": 16, "max_num_seqs": 48, "pending_blocks_needed": None,
         "pending_requests": None}]
