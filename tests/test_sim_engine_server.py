"""The sim engine over HTTP: OpenAI client streams, /status + /metrics agreement, 4xx
errors, API key, disconnect aborts. Servers run in-process on free ports."""

from __future__ import annotations

import asyncio
import base64
import math
import time

import httpx
import pytest
from openai import AsyncOpenAI

from conftest import linear_profile
from rps_astro_cli.engine.sim_engine import SimEngine
from rps_astro_cli.engine.sim_server import create_app
from rps_astro_cli.engine.synthetic import synthetic_text
from rps_astro_cli.protocol.http_server import ServerThread
from rps_astro_cli.protocol.openai_types import ApiLimits
from rps_astro_cli.sim.profile import ExecutionProfile, OutputLengthDist, VisionCosts
from test_sim_engine_api import MP4_URL, PNG_URL

pytestmark = pytest.mark.timeout(60)

MODEL = "hand/model"
HTTP = httpx.Client(timeout=10)  # one pooled client: new clients cost ~50 ms of CPU each


def make_profile(**kw) -> ExecutionProfile:
    """step = base_s (10 ms) + 0.1 ms per token (no attention terms)."""
    base = dict(model=MODEL, gpu="none", num_gpu_blocks=512, max_model_len=1024,
                output_len=OutputLengthDist(mu=math.log(20), sigma=0.0, max_tokens=2048))
    return linear_profile(**{**base, **kw})


def serve(profile: ExecutionProfile, time_scale: float = 0.05, **app_kw) -> ServerThread:
    eng = SimEngine(profile, time_scale=time_scale, instance_id="e1")
    return ServerThread(create_app(eng, **app_kw))


def words(n: int) -> str:
    """n tokens under the fallback counter ("abcd" = 1 token)."""
    return "abcd " * n


def status(url: str) -> dict:
    return HTTP.get(url + "/status").json()


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in HTTP.get(url + "/metrics").text.splitlines():
        if line.startswith("vllm:") and "_bucket" not in line:
            name, val = line.rsplit(" ", 1)
            key = name.split("{")[0]
            out[key] = out.get(key, 0.0) + float(val)  # summed over label sets (finished_reason)
    return out


def wait_for(pred, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.01)
    raise AssertionError("condition not reached")


def consistent(url: str) -> tuple[dict, dict[str, float]]:
    """(status, metrics) read within one engine step (status identical before and after)."""

    def strip(s):
        return {k: v for k, v in s.items() if k not in ("time_s", "classes")}  # these move with time

    for _ in range(200):
        s1, m, s2 = status(url), metrics(url), status(url)
        if strip(s1) == strip(s2):
            return s1, m
    raise AssertionError("engine state never stable across a read")


# -- 64 concurrent streams ----------------------------------------------------------------
def test_64_concurrent_streams_exact_counts():
    n_req = 64

    async def one(client: AsyncOpenAI, i: int):
        out = 5 + i % 30
        extra = {"ignore_eos": True} if i % 2 == 0 else {"vllm_xargs": {"astro_output_tokens": out}}
        kw = dict(model=MODEL, max_tokens=out if i % 2 == 0 else 100, stream=True,
                  stream_options={"include_usage": True}, extra_body=extra)
        chunks, usage, text, reasons = 0, None, [], []
        if i % 4 < 2:
            stream = await client.completions.create(prompt=words(i + 1), **kw)
            expect_prompt = i + 1
            async for c in stream:
                if c.usage:
                    usage = c.usage
                for ch in c.choices:
                    if ch.text:
                        chunks += 1
                        text.append(ch.text)
                    if ch.finish_reason:
                        reasons.append(ch.finish_reason)
        else:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": words(i + 1)}], **kw)
            expect_prompt = 3 + (3 + 1) + (i + 1)  # primer + per-message + "user" + text
            async for c in stream:
                if c.usage:
                    usage = c.usage
                for ch in c.choices:
                    if ch.delta.content:
                        chunks += 1
                        text.append(ch.delta.content)
                    if ch.finish_reason:
                        reasons.append(ch.finish_reason)
        return i, out, expect_prompt, chunks, usage, "".join(text), reasons

    async def main(url):
        client = AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(n_req)))
        finally:
            await client.close()

    with serve(make_profile(max_num_seqs=48)) as srv:
        results = asyncio.run(main(srv.url))
        st = status(srv.url)
        m = metrics(srv.url)
    for i, out, expect_prompt, chunks, usage, text, reasons in results:
        assert chunks == out, i
        assert text == synthetic_text(out)
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
            (expect_prompt, out, expect_prompt + out), i
        assert reasons == ["length" if i % 2 == 0 else "stop"], i
    total_out = sum(r[1] for r in results)
    total_prompt = sum(r[2] for r in results)
    assert (st["running"], st["waiting"], st["kv_blocks_free"]) == ([], [], 512)
    assert m["vllm:generation_tokens_total"] == total_out
    assert m["vllm:prompt_tokens_total"] == total_prompt
    assert m["vllm:request_success_total"] == n_req
    assert m["vllm:time_to_first_token_seconds_count"] == n_req
    assert m["vllm:e2e_request_latency_seconds_count"] == n_req


# -- /status and /metrics under a known load ----------------------------------------------
def test_status_and_metrics_agree_under_load_and_disconnect_aborts():
    # max_num_seqs 4; six 32-token prompts that never finish within the test. Steps take
    # 0.4 s (base) so reads land inside one step. Eventually 4 run and 2 wait.
    prof = make_profile(base_s=0.4, max_num_seqs=4, num_gpu_blocks=64, max_model_len=1024)

    async def stream_forever(url: str, i: int, started: asyncio.Event):
        async with httpx.AsyncClient(timeout=30) as c:
            # distinct first tokens: no shared prefix, so no block is shared by two requests
            body = {"prompt": f"{i} " + words(31), "max_tokens": 900, "ignore_eos": True, "stream": True,
                    "vllm_xargs": {"astro_predicted_output_tokens": 100 + i, "astro_class": "pebbles"}}
            async with c.stream("POST", url + "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for _ in r.aiter_lines():
                    started.set()

    async def main(url):
        started = asyncio.Event()
        tasks = [asyncio.create_task(stream_forever(url, 0, started))]
        await asyncio.to_thread(wait_for, lambda: len(status(url)["running"]) == 1)
        tasks += [asyncio.create_task(stream_forever(url, i, started)) for i in range(1, 6)]
        st = await asyncio.to_thread(
            wait_for, lambda: (lambda s: s if (len(s["running"]), len(s["waiting"])) == (4, 2) else None)(
                status(url)))
        s, m = await asyncio.to_thread(consistent, url)
        for t in tasks:  # client disconnects
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        return st, s, m

    with serve(prof, time_scale=1.0) as srv:
        st, s, m = asyncio.run(main(srv.url))
        assert (len(s["running"]), len(s["waiting"])) == (4, 2)
        used = sum(r["kv_blocks"] for r in s["running"])
        assert used == 64 - s["kv_blocks_free"]
        assert m["vllm:num_requests_running"] == 4
        assert m["vllm:num_requests_waiting"] == 2
        assert m["vllm:kv_cache_usage_perc"] == pytest.approx(used / 64)
        assert m["vllm:num_preemptions_total"] == s["num_preemptions_total"] == 0
        r0 = s["running"][0]
        assert (r0["prompt_tokens"], r0["predicted_output_tokens"], r0["req_class"]) == (32, 100, "pebbles")
        assert s["limits"]["max_num_seqs"] == 4 and s["instance_id"] == "e1"
        assert s["time_s"] >= r0["arrival_s"]
        assert [w["num_computed_tokens"] for w in s["waiting"]] == [0, 0]
        # disconnects aborted every request and freed every block
        after = wait_for(lambda: (lambda x: x if not x["running"] and not x["waiting"] else None)(
            status(srv.url)))
        assert after["kv_blocks_free"] == 64
        assert srv.server.config.app.state.engine.counters.requests_aborted_total == 6
        m2 = metrics(srv.url)
        assert (m2["vllm:num_requests_running"], m2["vllm:kv_cache_usage_perc"]) == (0, 0)


def test_preemption_counter_over_http():
    # 8 blocks; A and B: 48-token prompts, 40 output tokens (6 blocks each at the end), so
    # once B runs beside A the pool runs dry and B (last running) is preempted once. B must
    # arrive before A's 33rd token (its 6th block): time scale 10 makes that window ~3 s of
    # wall time, so a loaded 2-core machine still sends B in time (at 1.0 it was 0.3 s: flaky).
    prof = make_profile(num_gpu_blocks=8, max_model_len=128)

    async def one(url, first: str):
        async with httpx.AsyncClient(timeout=120) as c:  # distinct prompts: no prefix-cache hit
            r = await c.post(url + "/v1/completions",
                             json={"prompt": f"{first} " + words(47), "max_tokens": 40, "ignore_eos": True})
            return r.json()["usage"]

    async def main(url):
        a = asyncio.create_task(one(url, "a"))
        await asyncio.to_thread(wait_for, lambda: len(status(url)["running"]) == 1)
        b = asyncio.create_task(one(url, "b"))
        return await asyncio.gather(a, b)

    with serve(prof, time_scale=10.0) as srv:
        usages = asyncio.run(main(srv.url))
        s, m = consistent(srv.url)
    assert [u["completion_tokens"] for u in usages] == [40, 40]
    assert s["num_preemptions_total"] == 1
    assert m["vllm:num_preemptions_total"] == 1
    assert s["kv_blocks_free"] == 8


def test_prefix_cache_counters_over_http():
    # block 16. The same 40-token prompt twice, one after the other: the first queries 40
    # tokens and hits none; the second hits its 2 full cached blocks (at most
    # (40 − 1) // 16 = 2), 32 tokens. A different prompt then hits nothing.
    with serve(make_profile(), time_scale=0.01) as srv:
        for prompt in (words(40), words(40), "x " + words(39)):
            r = HTTP.post(srv.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True})
            assert r.status_code == 200
        m = metrics(srv.url)
    assert m["vllm:prefix_cache_queries_total"] == 120
    assert m["vllm:prefix_cache_hits_total"] == 32


def test_non_streaming_disconnect_aborts():
    with serve(make_profile(), time_scale=1.0) as srv:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/completions", timeout=0.3,
                       json={"prompt": words(40), "max_tokens": 900, "ignore_eos": True})
        after = wait_for(lambda: (lambda x: x if not x["running"] and not x["waiting"] else None)(
            status(srv.url)))
        assert after["kv_blocks_free"] == 512
        assert srv.server.config.app.state.engine.counters.requests_aborted_total == 1
        # the engine still serves
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# -- bad input → 4xx ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def text_srv():
    with serve(make_profile(max_model_len=256), time_scale=0.01,
               limits=ApiLimits(max_body_bytes=4096)) as srv:
        yield srv


BAD_PNG = "data:image/png;base64," + base64.b64encode(b"not an image at all").decode()


@pytest.mark.parametrize("path,body,status_code,param", [
    ("/v1/completions", b"{not json", 400, "body"),
    ("/v1/chat/completions", b"", 400, "body"),
    ("/v1/completions", b'{"max_tokens": 3}', 400, "prompt"),
    ("/v1/chat/completions", b'{"model": "hand/model"}', 400, "messages"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": -5}', 400, "max_tokens"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}',
     400, "max_completion_tokens"),
    ("/v1/completions", ('{"prompt": "' + words(300) + '"}').encode(), 400, "prompt"),
    ("/v1/completions", ('{"prompt": "' + words(200) + '", "max_tokens": 100}').encode(), 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "hi", "model": "other/model"}', 404, "model"),
    ("/v1/chat/completions", ('{"messages": [{"role": "user", "content": [{"type": "image_url", '
                              '"image_url": {"url": "' + PNG_URL + '"}}]}]}').encode(), 400, "messages"),
    ("/v1/completions", ('{"prompt": "' + "x" * 5000 + '"}').encode(), 413, "body"),
    ("/v1/completions", b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": 0}', 400, "top_p"),
    ("/v1/completions", b'{"prompt": "hi", "n": 0}', 400, "n"),
    ("/v1/completions", b'{"prompt": "hi", "n": 2, "temperature": 0}', 400, "n"),
    ("/v1/completions", b'{"prompt": "hi", "stop": 7}', 400, "stop"),
    ("/v1/completions", b'{"prompt": "hi", "seed": "abc"}', 400, "seed"),
])
def test_bad_input_status(text_srv, path, body, status_code, param):
    r = httpx.post(text_srv.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status_code, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"]


def test_unknown_route_and_wrong_method_are_openai_errors(text_srv):
    r = httpx.post(text_srv.url + "/v1/nope", json={})
    assert r.status_code == 404
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 404 and "/v1/nope" in err["message"]
    r = httpx.get(text_srv.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == 405 and "POST" in r.json()["error"]["message"]
    assert "detail" not in r.json()


def test_valid_sampling_fields_are_accepted(text_srv):
    r = httpx.post(text_srv.url + "/v1/completions", json={
        "prompt": "hi", "max_tokens": 2, "temperature": 0.7, "top_p": 1, "n": 1, "stop": ["\n"], "seed": 3,
        "presence_penalty": -2, "frequency_penalty": 0.5, "top_k": -1, "logprobs": 0, "user": "u"})
    assert r.status_code == 200, r.text


def test_chunked_body_over_limit_is_413(text_srv):
    def gen():
        for _ in range(10):
            yield b"x" * 1000

    r = httpx.post(text_srv.url + "/v1/completions", content=gen())
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"


def test_engine_survives_bad_inputs(text_srv):
    for body in (b"\xff\xfe", b"null", b'{"prompt": {"a": 1}}', b'{"messages": "hi"}'):
        httpx.post(text_srv.url + "/v1/completions", content=body)
        httpx.post(text_srv.url + "/v1/chat/completions", content=body)
    r = httpx.post(text_srv.url + "/v1/completions", json={"prompt": "hello world", "max_tokens": 3})
    assert r.status_code == 200
    assert r.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(text_srv.url + "/health").status_code == 200
    models = httpx.get(text_srv.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


# -- multimodal over HTTP ----------------------------------------------------------------------
def test_images_and_video_usage_and_unreadable_image():
    vis = VisionCosts(tokens_per_image=100, tokens_per_frame=10, preprocess_s_per_image=0.02,
                      preprocess_s_per_frame=0.001, encoder_s_per_image=0.03, encoder_s_per_frame=0.002)
    with serve(make_profile(vision=vis), time_scale=0.05) as srv:
        content = [{"type": "text", "text": "hello world"},
                   {"type": "image_url", "image_url": {"url": PNG_URL}},
                   {"type": "video_url", "video_url": {"url": MP4_URL, "num_frames": 4}}]
        r = httpx.post(srv.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": content}], "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
        # text 3 + 3 + 1 + 4 = 11; image 100; 4 frames × 10 = 40
        assert r.json()["usage"] == {"prompt_tokens": 151, "completion_tokens": 3, "total_tokens": 154}
        assert r.json()["choices"][0]["message"]["content"] == synthetic_text(3)
        content[1]["image_url"]["url"] = BAD_PNG
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "messages[0].content[1].image_url.url"
        content[1]["image_url"]["url"] = "http://10.0.0.1/x.png"
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}]})
        assert r.status_code == 400 and "disabled" in r.json()["error"]["message"]


# -- API key ---------------------------------------------------------------------------------
def test_api_key_on_v1_routes():
    with serve(make_profile(), api_key="sekret") as srv:
        assert httpx.get(srv.url + "/v1/models").status_code == 401
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                       headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["param"] == "authorization"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1},
                       headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200


# -- server faults ---------------------------------------------------------------------------
def test_step_fault_is_500_with_request_id_and_engine_keeps_serving():
    srv = serve(make_profile(), time_scale=0.01)
    eng = srv.server.config.app.state.engine
    real_step = eng.inst.step
    calls = {"n": 0}

    def flaky_step(now_s):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ZeroDivisionError("boom")
        return real_step(now_s)

    eng.inst.step = flaky_step
    with srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 500
        err = r.json()["error"]
        assert err["type"] == "server_error" and "request id" in err["message"]
        assert "Traceback" not in r.text and "boom" not in r.text
        st = status(srv.url)
        assert (st["running"], st["waiting"], st["kv_blocks_free"]) == ([], [], 512)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_status_prefix_since_answers_the_cached_block_hashes():
    # block 16, fallback ids. A 40-token prompt (2 full blocks) then a different
    # 40-token one: a fresh reader (prefix_since=0) gets the whole set, then only the
    # change; the hashes are the chained hashes of the prompts' fallback token ids.
    from rps_astro_cli.sim.prefix_cache import PrefixMirror, block_hashes
    from rps_astro_cli.tokens import token_ids_fallback

    p1, p2 = words(40), "x " + words(39)
    h1, h2 = (block_hashes(token_ids_fallback(p), 16) for p in (p1, p2))
    assert len(h1) == len(h2) == 2
    mirror = PrefixMirror()
    with serve(make_profile(), time_scale=0.01) as srv:
        assert "prefix_cache" not in status(srv.url)
        assert HTTP.post(srv.url + "/v1/completions", json={"prompt": p1, "max_tokens": 2}).status_code == 200
        d = HTTP.get(srv.url + "/status", params={"prefix_since": 0}).json()["prefix_cache"]
        assert d == {"seq": 2, "reset": True, "stored": list(h1), "removed": []}
        mirror.apply(d)
        assert HTTP.post(srv.url + "/v1/completions", json={"prompt": p2, "max_tokens": 2}).status_code == 200
        d = HTTP.get(srv.url + "/status", params={"prefix_since": mirror.seq}).json()["prefix_cache"]
        assert d == {"seq": 4, "reset": False, "stored": list(h2), "removed": []}
        mirror.apply(d)
        # a 50-token prompt extending p1: its first 3 blocks' hashes, 2 cached
        h3 = block_hashes(token_ids_fallback(p1 + words(10)), 16)
        assert mirror.hit_blocks(h3, (50 - 1) // 16) == 2
        r = HTTP.get(srv.url + "/status", params={"prefix_since": "x"})
        assert r.status_code in (400, 422)


def test_openai_client_models_version_and_explicit_refusals(text_srv):
    """The official `openai` client: `/v1/models/{id}`, `/version`, and the fields the sim
    cannot produce refused with a 400 naming them (never silently ignored); tools with
    the default tool_choice "auto" refused with vLLM's own message (the sim is a vLLM
    without a tool parser). Logprobs and echo are honoured: tests/test_openai_surface.py."""
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=text_srv.url + "/v1", api_key="none", max_retries=0, timeout=10)
    mid = c.models.list().data[0].id
    assert c.models.retrieve(mid).id == mid
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")
    v = httpx.get(text_srv.url + "/version", timeout=5).json()
    assert v["engine"] == "astro-sim" and v["version"]
    msg = [{"role": "user", "content": "hi"}]
    for kw, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                      ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, None),
                      ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                        "tool_choice": "required"}, "tool_choice")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=mid, messages=msg, max_tokens=2, **kw)
        assert e.value.status_code == 400 and e.value.body["param"] == param, (kw, e.value.body)
    # what it does serve: text response_format, seed, a plain stream
    r = c.chat.completions.create(model=mid, messages=msg, max_tokens=3, seed=1, response_format={"type": "text"})
    assert r.choices[0].message.content and r.usage.completion_tokens >= 1


def test_reset_prefix_cache_route():
    # block 16: a 40-token prompt leaves 2 cached blocks and the second send hits 32
    # tokens; after POST /reset_prefix_cache the same prompt hits nothing. While a long
    # request holds blocks the reset is refused with a 409 that says why.
    with serve(make_profile(), time_scale=0.01) as srv:
        body = {"prompt": words(40), "max_tokens": 2, "ignore_eos": True}
        for _ in range(2):
            assert HTTP.post(srv.url + "/v1/completions", json=body).status_code == 200
        assert metrics(srv.url)["vllm:prefix_cache_hits_total"] == 32
        r = HTTP.post(srv.url + "/reset_prefix_cache")
        assert r.status_code == 200 and r.json() == {"reset": True}
        assert HTTP.get(srv.url + "/status", params={"prefix_since": 0}).json()["prefix_cache"]["stored"] == []
        assert HTTP.post(srv.url + "/v1/completions", json=body).status_code == 200
        assert metrics(srv.url)["vllm:prefix_cache_hits_total"] == 32  # no new hit
    with serve(make_profile(), time_scale=1.0) as srv:
        with HTTP.stream("POST", srv.url + "/v1/completions",
                         json={"prompt": words(40), "max_tokens": 500, "ignore_eos": True, "stream": True}) as s:
            lines = s.iter_lines()  # kept: a dropped line iterator closes the stream (the engine aborts)
            next(lines)  # it runs (holds its blocks)
            r = HTTP.post(srv.url + "/reset_prefix_cache")
            assert r.status_code == 409 and "still hold KV blocks" in r.json()["error"]["message"], r.text


def test_openai_client_stop_strings_end_the_output_as_vllm_does(text_srv):
    """`stop`: the cycle's text is " the of and to in a is that ..." (token i = WORDS[i % 16]);
    stop " and" is completed by token 2, so 3 tokens are generated (usage counts them),
    the text is cut where the stop string begins (" the of"), finish_reason "stop"; with
    include_stop_str_in_output the stop string stays. Streamed deltas add up to the same
    text. A stop string the words never form leaves the output at its length."""
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=text_srv.url + "/v1", api_key="none", max_retries=0, timeout=10)
    msg = [{"role": "user", "content": "hi"}]
    r = c.chat.completions.create(model=MODEL, messages=msg, max_tokens=10, stop=[" and"])
    assert r.choices[0].message.content == " the of"
    assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("stop", 3)
    # a stop string is a substring match: "of a" is formed by " of" + the "a" of " and" (token 2)
    r = c.completions.create(model=MODEL, prompt="hi", max_tokens=10, stop="of a",
                             extra_body={"include_stop_str_in_output": True})
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == (" the of a", "stop", 3)
    r = c.completions.create(model=MODEL, prompt="hi", max_tokens=10, stop=["x", "\n"])  # no word holds them
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == \
        (synthetic_text(10), "length", 10)
    # the first of several stops to be completed wins, whatever their order in the list
    r = c.completions.create(model=MODEL, prompt="hi", max_tokens=10, stop=["is", "in a"],
                             extra_body={"include_stop_str_in_output": True})
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == \
        (" the of and to in a", "stop", 6)
    # stop spanning two tokens: " to in" ends in token 4; the stream never shows it
    parts, reasons = [], []
    for ch in c.chat.completions.create(model=MODEL, messages=msg, max_tokens=10, stop=" to in", stream=True,
                                        stream_options={"include_usage": True}):
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            reasons.append(ch.choices[0].finish_reason)
        else:
            assert ch.usage.completion_tokens == 5
    assert "".join(parts) == " the of and" and reasons[-1] == "stop"
    # min_tokens: " the" (token 0) is skipped; the next " the" is token 16
    r = c.completions.create(model=MODEL, prompt="hi", max_tokens=40, stop=" the", extra_body={"min_tokens": 2})
    assert (r.choices[0].text, r.usage.completion_tokens) == (synthetic_text(16), 17)


def test_openai_client_seed_repeats_the_output_and_n_gives_n_choices(text_srv):
    """`seed`: the same seed gives the same text and (drawn) length, another seed another
    text; `n`: n choices (index 0..n-1), usage counts the prompt once and every choice's
    tokens; n > 1 with temperature 0 is refused with vLLM's message."""
    openai = pytest.importorskip("openai")
    c = openai.OpenAI(base_url=text_srv.url + "/v1", api_key="none", max_retries=0, timeout=10)
    msg = [{"role": "user", "content": "hi"}]
    a, b, d = (c.chat.completions.create(model=MODEL, messages=msg, max_tokens=30, seed=s) for s in (7, 7, 8))
    assert a.choices[0].message.content == b.choices[0].message.content != d.choices[0].message.content
    assert a.usage.completion_tokens == b.usage.completion_tokens
    words = a.choices[0].message.content.split(" ")[1:]
    assert len(words) == a.usage.completion_tokens and words != synthetic_text(len(words)).split(" ")[1:]
    r = c.chat.completions.create(model=MODEL, messages=msg, max_tokens=4, n=3, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert all(ch.message.content == synthetic_text(4) and ch.finish_reason == "length" for ch in r.choices)
    one = c.chat.completions.create(model=MODEL, messages=msg, max_tokens=4, extra_body={"ignore_eos": True})
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (one.usage.prompt_tokens, 12)
    texts: dict[int, str] = {}
    usage = None
    for ch in c.completions.create(model=MODEL, prompt="hi", max_tokens=5, n=2, seed=3, stream=True,
                                   stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = ch.usage or usage
    assert sorted(texts) == [0, 1] and texts[0] != texts[1] and usage.completion_tokens == 10
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=msg, max_tokens=4, n=2, temperature=0)
    assert e.value.body["param"] == "n" and "greedy sampling" in e.value.body["message"]


def test_tokenize_and_detokenize_have_vllms_shapes(text_srv):
    """/tokenize {prompt} → {count, max_model_len, tokens, token_strs}; the chat form
    counts what `usage.prompt_tokens` counts; /detokenize {tokens} → {prompt}; an id the
    tokenizer never made is a 400 naming `tokens`."""
    url = text_srv.url
    r = HTTP.post(url + "/tokenize", json={"prompt": "abcdefgh ij", "return_token_strs": True}).json()
    assert r["count"] == 3 == len(r["tokens"]) and r["max_model_len"] == 256
    assert r["token_strs"] == ["abcd", "efgh", "ij"]
    assert HTTP.post(url + "/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "abcdefgh ij"}
    msg = [{"role": "user", "content": "abcd abcd"}]
    t = HTTP.post(url + "/tokenize", json={"model": MODEL, "messages": msg}).json()
    u = HTTP.post(url + "/v1/chat/completions", json={"messages": msg, "max_tokens": 1}).json()["usage"]
    assert t["count"] == len(t["tokens"]) == u["prompt_tokens"] == 3 + 1 + 2 + 3
    bad = HTTP.post(url + "/detokenize", json={"tokens": [12345]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert HTTP.post(url + "/tokenize", json={"model": "other", "prompt": "x"}).status_code == 404
    assert HTTP.post(url + "/tokenize", json={"prompt": 3}).json()["error"]["param"] == "prompt"


def test_vllm_request_histograms_hand_computed():
    """One 40-token prompt, 5 tokens under ignore_eos, alone on the linear profile (step =
    10 ms + 0.1 ms per token, time scale 1): prefill step 14 ms, then 4 decode steps of
    10.1 ms. vLLM's families: ITL 4 × 10.1 ms (all in the ≤ 25 ms bucket, none ≤ 10 ms),
    prefill time 14 ms, decode time 40.4 ms, inference time 54.4 ms, time per output token
    10.1 ms, prompt 40 / generation 5 / max_tokens 5 tokens, one success with
    finished_reason "length"; every family labelled model_name and engine."""
    from prometheus_client.parser import text_string_to_metric_families

    with serve(make_profile(), time_scale=1.0) as srv:
        r = HTTP.post(srv.url + "/v1/completions", json={"prompt": words(40), "max_tokens": 5, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == 5
        text = HTTP.get(srv.url + "/metrics").text
    samples = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name.startswith("vllm:"):
                assert smp.labels.get("model_name") == MODEL and smp.labels.get("engine") == "0", smp
            key = smp.name + "".join(f"|{k}={v}" for k, v in sorted(smp.labels.items())
                                     if k not in ("model_name", "engine"))
            samples[key] = smp.value
    h = "vllm:inter_token_latency_seconds"
    assert (samples[h + "_count"], samples[h + "_sum"]) == (4, pytest.approx(0.0404, abs=1e-9))
    assert (samples[h + "_bucket|le=0.01"], samples[h + "_bucket|le=0.025"]) == (0, 4)
    for name, want in (("request_prefill_time_seconds", 0.014), ("request_decode_time_seconds", 0.0404),
                       ("request_inference_time_seconds", 0.0544),
                       ("request_time_per_output_token_seconds", 0.0101),
                       ("request_prompt_tokens", 40), ("request_generation_tokens", 5),
                       ("request_params_max_tokens", 5)):
        assert samples[f"vllm:{name}_count"] == 1, name
        assert samples[f"vllm:{name}_sum"] == pytest.approx(want, abs=1e-9), name
    # submit → the loop's next step (wall): woken by the submit, not by the 1 s poll of an
    # unschedulable loop (before: < 0.05 s, which a loaded host's scheduling lag can pass)
    assert 0 <= samples["vllm:request_queue_time_seconds_sum"] < 0.5
    assert samples["vllm:request_success_total|finished_reason=length"] == 1
    assert samples["vllm:request_success_total|finished_reason=stop"] == 0
