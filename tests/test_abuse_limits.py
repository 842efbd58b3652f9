"""Issue 29, findings 1–2: what one request may cost (n, output tokens, log-probabilities,
response bytes) and what a client may make a server hold before any route runs (header
bytes and count, time to send headers and body, connections). Each test fails on the code
before the limits: the engine answered `n: 512` with echo and 20 logprobs (570 MB), and
uvicorn took an 8 MB header, 20,000 headers and an idle connection forever."""

from __future__ import annotations

import json
import socket
import time
from contextlib import ExitStack

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from conftest import linear_profile
from rps_astro_cli.engine import sim_server
from rps_astro_cli.engine.sim_engine import SimEngine
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.protocol.http_server import ServerThread
from rps_astro_cli.protocol.limits import CostLimits, HttpLimits, check_request_cost
from rps_astro_cli.protocol.openai import parse_completion_request
from rps_astro_cli.protocol.openai_types import ApiError
from rps_astro_cli.services.scheduler import InstanceEndpoint, SchedulerSettings, create_app

MODEL = "hand/model"


def _engine_app() -> FastAPI:
    prof = linear_profile(model=MODEL, gpu="none", num_gpu_blocks=4096, max_model_len=4096)
    return sim_server.create_app(SimEngine(prof, time_scale=0.01, instance_id="engine-0", seed=0))


def _parsed(**kw):
    return parse_completion_request({"model": MODEL, "prompt": "hi", **kw})


# -- request cost ----------------------------------------------------------------------
def test_cost_limits_by_hand():
    lim = CostLimits(max_n=8, max_generated_tokens=1000, max_logprob_entries=5000)
    check_request_cost(_parsed(n=8, temperature=1.0), 2, 125, lim)  # 8 × 125 = 1000: at the limit
    with pytest.raises(ApiError) as e:
        check_request_cost(_parsed(n=9, temperature=1.0), 2, 1, lim)
    assert e.value.param == "n" and "limit of 8" in e.value.message and "ASTRO_MAX_N" in e.value.message
    with pytest.raises(ApiError) as e:
        check_request_cost(_parsed(n=8, temperature=1.0), 2, 126, lim)  # 1008 > 1000
    assert e.value.param == "max_tokens" and "1008" in e.value.message
    # (5 + 1) × 2 × (100 + 300 echoed) = 4800 ≤ 5000; one more log-probability: 5600 > 5000
    check_request_cost(_parsed(n=2, temperature=1.0, logprobs=5, echo=True), 300, 100, lim)
    with pytest.raises(ApiError) as e:
        check_request_cost(_parsed(n=2, temperature=1.0, logprobs=6, echo=True), 300, 100, lim)
    assert e.value.param == "logprobs" and "5600" in e.value.message and "echo" in e.value.message
    # without echo the prompt carries no log-probabilities: 7 × 2 × 100 = 1400
    check_request_cost(_parsed(n=2, temperature=1.0, logprobs=6), 300, 100, lim)


def test_cost_limits_from_the_environment():
    lim = CostLimits.from_env({"ASTRO_MAX_N": "4", "ASTRO_MAX_RESPONSE_BYTES": "1000"})
    assert (lim.max_n, lim.max_response_bytes, lim.max_generated_tokens) == (4, 1000,
                                                                            CostLimits().max_generated_tokens)
    for bad in ("0", "-3", "many", "2.5"):
        with pytest.raises(AstroUserError, match="ASTRO_MAX_N"):
            CostLimits.from_env({"ASTRO_MAX_N": bad})
    h = HttpLimits.from_env({"ASTRO_HTTP_HEADER_TIMEOUT_S": "0.5", "ASTRO_HTTP_MAX_HEADERS": "7"})
    assert (h.header_timeout_s, h.max_headers) == (0.5, 7)
    with pytest.raises(AstroUserError, match="ASTRO_HTTP_BODY_TIMEOUT_S"):
        HttpLimits.from_env({"ASTRO_HTTP_BODY_TIMEOUT_S": "inf"})


def test_the_570_mb_request_is_refused_by_the_engine_and_the_scheduler():
    """The issue's request (n 512, echo, logprobs 20, a ~2,000-token prompt) and its n: 64
    variant (71 MB before) are 400s naming the limit; a modest one still works."""
    prompt = "word " * 1990
    big = {"model": MODEL, "prompt": prompt, "n": 512, "echo": True, "logprobs": 20, "temperature": 1.0}
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(_engine_app()))
        eps = (InstanceEndpoint("engine-0", eng.url, None),)
        sch = st.enter_context(ServerThread(create_app(SchedulerSettings(instances=eps, policy="round_robin",
                                                                         max_body_bytes=1 << 20))))
        for url in (eng.url, sch.url):
            r = httpx.post(url + "/v1/completions", json=big, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
            assert len(r.content) < 2000
        # n 64 passes the n limit; max_tokens unset = 4096 − prompt, so the engine's check
        # (it knows the context length) refuses 21 × 64 × (max_tokens + prompt) entries
        r = httpx.post(sch.url + "/v1/completions", json={**big, "n": 64}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
        assert "ASTRO_MAX_LOGPROB_ENTRIES" in r.json()["error"]["message"]
        ok = httpx.post(sch.url + "/v1/completions", timeout=30,
                        json={"model": MODEL, "prompt": "hi there", "n": 2, "temperature": 1.0, "max_tokens": 3,
                              "logprobs": 2, "echo": True})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def _big_engine(body_bytes: int) -> FastAPI:
    """A fake engine whose whole response is `body_bytes` of JSON and whose stream is 100
    events of ~`body_bytes // 100` bytes each."""
    app = FastAPI()

    @app.get("/health")
    async def _health():
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def _chat(request: Request):
        body = await request.json()
        pad = "x" * (body_bytes // 100)
        if body.get("stream"):
            async def gen():
                for _ in range(100):
                    yield f'data: {{"choices": [{{"index": 0, "delta": {{"content": "{pad}"}}}}]}}\n\n'.encode()
                yield b"data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        text = "x" * (body_bytes - 60)
        return Response(json.dumps({"choices": [{"index": 0, "message": {"content": text}}]}),
                        media_type="application/json")

    return app


def test_the_scheduler_cuts_responses_over_the_byte_limit():
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(_big_engine(200_000)))
        eps = (InstanceEndpoint("engine-0", eng.url, None),)

        def sched(cap: int) -> str:
            s = SchedulerSettings(instances=eps, policy="round_robin", served_models=(MODEL,),
                                  cost_limits=CostLimits(max_response_bytes=cap))
            return st.enter_context(ServerThread(create_app(s))).url

        small, large = sched(50_000), sched(10_000_000)
        r = httpx.post(small + "/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == 502 and r.json()["error"]["type"] == "response_too_large"
        assert "50000" in r.json()["error"]["message"]
        with httpx.stream("POST", small + "/v1/chat/completions", json={**chat, "stream": True}, timeout=30) as r:
            raw = r.read()
        events = [ln[6:] for ln in raw.decode().splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "response_too_large"
        assert len(raw) < 50_000 + 2_000 + 500  # whole events up to the cap, then the error event
        # under a high enough cap the same responses pass whole: non-streamed over 1 MiB
        # (relayed as it arrives, not read first) and streamed
        eng2 = st.enter_context(ServerThread(_big_engine(3_000_000)))
        s2 = SchedulerSettings(instances=(InstanceEndpoint("engine-0", eng2.url, None),), policy="round_robin",
                               served_models=(MODEL,), cost_limits=CostLimits(max_response_bytes=10_000_000))
        big_url = st.enter_context(ServerThread(create_app(s2))).url
        r = httpx.post(big_url + "/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"][0]["message"]["content"]) == 3_000_000 - 60
        r = httpx.post(large + "/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"][0]["message"]["content"]) == 200_000 - 60
        dec = httpx.get(big_url + "/decisions").json()
        assert dec[-1]["outcome"] == "ok" and dec[-1]["observed_e2e_s"] > 0


def test_a_client_that_stops_reading_pauses_the_engine_and_loses_nothing():
    """Flow control through the relay: a streaming client that stops reading makes the
    scheduler stop reading its engine (the engine's sends stall: the scheduler holds no
    more than socket buffers and a read), and once the client reads again every event
    arrives, in order, then [DONE]."""
    n_events, pad = 8_000, "x" * 4000  # ~32 MB in all
    sent = [0]
    app = FastAPI()

    @app.get("/health")
    async def _health():
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def _chat():
        async def gen():
            for i in range(n_events):
                ev = f'data: {{"i": {i}, "choices": [{{"index": 0, "delta": {{"content": "{pad}"}}}}]}}\n\n'
                sent[0] += 1
                yield ev.encode()
            yield b"data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                       "stream": True}).encode()
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(app))
        s = SchedulerSettings(instances=(InstanceEndpoint("engine-0", eng.url, None),), policy="round_robin",
                              served_models=(MODEL,))
        url = st.enter_context(ServerThread(create_app(s))).url
        host, port = url.removeprefix("http://").split(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # the client's window stays small
        sock.connect((host, int(port)))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%b" % (len(body), body))
        last, still_since = -1, time.monotonic()
        deadline = time.monotonic() + 30
        while time.monotonic() - still_since < 1.0 and time.monotonic() < deadline:
            time.sleep(0.1)
            if sent[0] != last:
                last, still_since = sent[0], time.monotonic()
        assert 0 < sent[0] < n_events // 2, sent[0]  # stalled, well short of the end
        sock.settimeout(30)
        raw = b""
        while not raw.endswith(b"0\r\n\r\n"):  # the response's last chunk
            more = sock.recv(1 << 20)
            assert more, "the connection closed before the response ended"
            raw += more
        sock.close()
    text = raw.split(b"\r\n\r\n", 1)[1].decode()
    events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert [json.loads(e)["i"] for e in events[:-1]] == list(range(n_events))


# -- connection limits -----------------------------------------------------------------
def _hello_app() -> FastAPI:
    app = FastAPI()

    @app.get("/hello")
    async def _hello():
        return {"hello": True}

    @app.post("/echo")
    async def _echo(request: Request):
        return Response(await request.body())

    return app


def _recv_all(sock: socket.socket, timeout_s: float = 5.0) -> bytes:
    sock.settimeout(timeout_s)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return out


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)))


@pytest.fixture()
def limited(monkeypatch):
    """A server under small connection limits (they are read from the environment when a
    server is made, as every astro process reads them)."""
    monkeypatch.setenv("ASTRO_HTTP_MAX_HEADER_BYTES", "8192")
    monkeypatch.setenv("ASTRO_HTTP_MAX_HEADERS", "20")
    monkeypatch.setenv("ASTRO_HTTP_HEADER_TIMEOUT_S", "0.5")
    monkeypatch.setenv("ASTRO_HTTP_BODY_TIMEOUT_S", "0.5")
    monkeypatch.setenv("ASTRO_HTTP_MAX_CONNECTIONS", "6")
    with ServerThread(_hello_app()) as s:
        yield s.url


def test_an_oversized_or_unfinished_header_is_refused_with_431(limited):
    s = _connect(limited)
    s.sendall(b"GET /hello HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 20_000)  # never finished
    out = _recv_all(s)
    assert out.startswith(b"HTTP/1.1 431 ") and b"ASTRO_HTTP_MAX_HEADER_BYTES" in out
    s.close()
    s = _connect(limited)
    s.sendall(b"GET /hello HTTP/1.1\r\nhost: x\r\n" + b"".join(b"x-h%d: 1\r\n" % i for i in range(30)) + b"\r\n")
    out = _recv_all(s)
    assert out.startswith(b"HTTP/1.1 431 ") and b"31 header fields" in out  # host + 30
    s.close()
    # within the limits: served, keep-alive and all
    with httpx.Client(base_url=limited) as c:
        assert c.get("/hello", headers={f"x-h{i}": "1" for i in range(10)}).json() == {"hello": True}
        assert c.get("/hello").status_code == 200


def test_slow_headers_and_bodies_time_out_with_408(limited):
    s = _connect(limited)
    t0 = time.monotonic()
    s.sendall(b"GET /hello HTTP/1.1\r\nhost: x\r\n")  # and nothing more
    out = _recv_all(s)
    assert out.startswith(b"HTTP/1.1 408 ") and b"headers" in out and 0.4 < time.monotonic() - t0 < 4
    s.close()
    s = _connect(limited)  # a connection that never sends a byte is closed too
    assert _recv_all(s).startswith(b"HTTP/1.1 408 ")
    s.close()
    s = _connect(limited)
    s.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + b"a" * 10)
    out = _recv_all(s)
    assert out.startswith(b"HTTP/1.1 408 ") and b"body" in out
    s.close()
    # a slowloris that trickles header bytes gains nothing: the deadline runs from the first byte
    s = _connect(limited)
    t0 = time.monotonic()
    s.sendall(b"GET /hello HTTP/1.1\r\n")
    closed_at = None
    for _ in range(20):
        time.sleep(0.1)
        try:
            s.sendall(b"x-a: b\r\n")
        except OSError:
            closed_at = time.monotonic() - t0
            break
    assert closed_at is not None and closed_at < 2.0
    s.close()
    assert httpx.post(limited + "/echo", content=b"abc").content == b"abc"


def test_connections_past_the_limit_are_refused_with_503(limited):
    held = [_connect(limited) for _ in range(6)]
    time.sleep(0.1)
    extra = _connect(limited)
    assert _recv_all(extra, 2.0).startswith(b"HTTP/1.1 503 ")
    for h in held:
        h.close()
    time.sleep(0.2)
    assert httpx.get(limited + "/hello").status_code == 200


def test_the_default_limits_bound_an_unauthenticated_header_flood():
    """Default limits, the scheduler app with an API key: a 20 MB unfinished header is
    cut at 64 KiB with 431 before the key is ever checked, and 20,000 headers are
    refused."""
    with ExitStack() as st:
        eps = (InstanceEndpoint("engine-0", "http://127.0.0.1:9", None),)
        s = st.enter_context(ServerThread(create_app(SchedulerSettings(instances=eps, api_key="k"))))
        sock = _connect(s.url)
        sent = 0
        try:
            while sent < 20 * 1024 * 1024:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nx-big: " if sent == 0 else b"a" * 65536)
                sent += 65536
        except OSError:
            pass
        assert sent < 20 * 1024 * 1024  # the server closed the connection before the 20 MB were sent
        assert _recv_all(sock).startswith(b"HTTP/1.1 431 ")
        sock.close()
        sock = _connect(s.url)
        head = b"GET /v1/models HTTP/1.1\r\n" + b"".join(b"h%d: v\r\n" % i for i in range(20_000)) + b"\r\n"
        try:
            sock.sendall(head)
        except OSError:
            pass
        assert _recv_all(sock).startswith(b"HTTP/1.1 431 ")
        sock.close()


# -- CPU-heavy bodies ------------------------------------------------------------------
def test_big_bodies_are_parsed_off_the_event_loop(monkeypatch):
    """A body over OFF_LOOP_BYTES is decoded, counted and tokenized on the worker thread
    (the scheduler and the tagger; the engine refuses this one before counting it:
    test_abuse_big_prompts.py), a small one on the event loop: tokenizing a 1 MB prompt
    (~40 ms) no longer stalls everyone else's requests (finding 3)."""
    from rps_astro_cli.protocol import openai as oa
    from rps_astro_cli.protocol.http_server import OFF_LOOP_BYTES
    from rps_astro_cli.services import tagger as tagger_mod

    seen: list[tuple[int, str]] = []
    real = oa.parse_chat_request

    def spy(body, *a, **kw):
        import threading

        seen.append((len(body["messages"][0]["content"]), threading.current_thread().name))
        return real(body, *a, **kw)

    monkeypatch.setattr(oa, "parse_chat_request", spy)
    import rps_astro_cli.engine.sim_server as ss
    monkeypatch.setattr(ss, "parse_chat_request", spy)
    big = "word " * (OFF_LOOP_BYTES // 5 + 100)
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(_engine_app()))
        tg = st.enter_context(ServerThread(tagger_mod.create_app(tagger_mod.TaggerSettings())))
        eps = (InstanceEndpoint("engine-0", eng.url, None),)
        sch = st.enter_context(ServerThread(create_app(SchedulerSettings(instances=eps, policy="round_robin",
                                                                         tagger_url=tg.url))))
        for content in ("hi", big):
            r = httpx.post(sch.url + "/v1/chat/completions", timeout=30,
                           json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1})
            assert r.status_code == (200 if content == "hi" else 400), r.text
    small = {name for n, name in seen if n == 2}
    heavy = {name for n, name in seen if n == len(big)}
    # the scheduler (round robin: no context known) and the tagger parsed both, the engine only
    # the small one (13,000 tokens > its 4,096: refused on the cheap bound, uncounted); the big
    # one never on a server's loop thread
    assert small and heavy and all(name.startswith("astro-heavy") for name in heavy), seen
    assert not any(name.startswith("astro-heavy") for name in small), seen


def test_the_front_door_refuses_a_prompt_far_past_every_context():
    """With the engines' /status known (a load-aware policy polls it), a prompt of at least
    DOOR_CONTEXT_FACTOR × max_model_len fallback tokens is refused by the scheduler itself:
    no engine sees it; one just over the context still reaches the engine, which refuses it."""
    from conftest import prom_sum
    from rps_astro_cli.services.scheduler.front_door import DOOR_CONTEXT_FACTOR

    with ExitStack() as st:
        eng = st.enter_context(ServerThread(_engine_app()))  # max_model_len 4096
        eps = (InstanceEndpoint("engine-0", eng.url, None),)
        app = create_app(SchedulerSettings(instances=eps, policy="llumnix", status_interval_s=0.05))
        sch = st.enter_context(ServerThread(app))
        with httpx.Client(base_url=sch.url, timeout=30) as c:
            deadline = time.monotonic() + 10
            while c.get("/health").json()["healthy_instances"] < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            door = app.state.scheduler.front_door
            while door.context_limit() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert door.context_limit() == 4096
            far = {"model": MODEL, "prompt": "word " * (DOOR_CONTEXT_FACTOR * 4096), "max_tokens": 1}
            r = c.post("/v1/completions", json=far)
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            assert "4096" in r.json()["error"]["message"]
            near = {"model": MODEL, "prompt": "word " * 4100, "max_tokens": 1}
            r = c.post("/v1/completions", json=near)
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        engine_metrics = httpx.get(eng.url + "/metrics").text
        # the engine answered the near one (its own 400) and never saw the far one
        assert prom_sum(engine_metrics, "vllm:prompt_tokens_total") == 0
        assert r.headers.get("x-astro-instance") == "engine-0"


def test_a_draining_engines_503_is_retried_elsewhere_or_said_in_the_schedulers_words():
    draining = FastAPI()

    @draining.get("/health")
    async def _health():
        return {"status": "ok"}

    @draining.post("/v1/chat/completions")
    async def _chat():
        return Response(json.dumps({"error": {"message": "engine is shutting down (draining); send the request to "
                                              "another instance", "type": "server_error", "code": 503}}),
                        status_code=503, media_type="application/json")

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with ExitStack() as st:
        d = st.enter_context(ServerThread(draining))
        eng = st.enter_context(ServerThread(_engine_app()))
        alone = SchedulerSettings(instances=(InstanceEndpoint("engine-0", d.url, None),), policy="round_robin",
                                  served_models=(MODEL,))
        r = httpx.post(st.enter_context(ServerThread(create_app(alone))).url + "/v1/chat/completions", json=chat)
        err = r.json()["error"]
        assert r.status_code == 503 and err["type"] == "engine_unavailable"
        assert "another instance" not in err["message"] and "engine-0" in err["message"]
        pair = SchedulerSettings(instances=(InstanceEndpoint("engine-0", d.url, None),
                                            InstanceEndpoint("engine-1", eng.url, None)), policy="round_robin",
                                 served_models=(MODEL,))
        url = st.enter_context(ServerThread(create_app(pair))).url
        for _ in range(2):  # whichever engine round-robin picks first, the answer is the healthy one's
            r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=30)
            assert r.status_code == 200 and r.headers["x-astro-instance"] == "engine-1"


def test_a_bad_limit_variable_stops_astro_serve_before_any_child(tmp_path):
    """`astro serve` checks $ASTRO_MAX_* / $ASTRO_HTTP_* itself: one line naming the
    variable and the fix, exit 2, no cluster.json (before, each child failed in its log)."""
    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app

    for var in ("ASTRO_MAX_N", "ASTRO_HTTP_BODY_TIMEOUT_S"):
        r = CliRunner().invoke(app, ["serve", "--instances", "1", "--cluster-json", str(tmp_path / "c.json"),
                                     "--run-dir", str(tmp_path / "run")], env={var: "abc", "COLUMNS": "200"})
        assert r.exit_code == 2 and var in r.output and "default" in r.output, r.output
        assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1, r.output
        assert not (tmp_path / "c.json").exists()
