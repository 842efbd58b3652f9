"""The scheduler's prompt token ids for prefix hashes from an engine's `POST /tokenize`
(`services/scheduler/prompt_ids.py`, setting `prefix_tokenizer`).

A fake vLLM-like engine answers `/tokenize` with ids chosen here (`KNOWN`, 13 ids), so
the hashes the scheduler must compute are `block_hashes(KNOWN, 4)` (3 full blocks of 4)
with the engine's count 13, not the fallback tokenizer's ids of the same text (which
differ: the fallback ids of "user" and the ten words). A timeout falls back to those
fallback ids and is counted; a token-id prompt, `fallback`, a sim engine under `auto`
and a prompt with an image part send no RPC. The real-vLLM check is
`tests/test_vllm_prefix.py`.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import ExitStack

import httpx
import pytest
from fastapi import FastAPI, Request

from conftest import prom_sum as metric
from conftest import scheduler_flag_kwargs
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.protocol import openai as oa
from rps_astro_cli.protocol.http_server import ServerThread
from rps_astro_cli.services.scheduler import InstanceEndpoint, SchedulerSettings, create_app
from rps_astro_cli.services.scheduler.app import Scheduler
from rps_astro_cli.services.scheduler.prompt_ids import ASTRO_SIM, OTHER_ENGINE, engine_kind_of_version, tokenize_body
from rps_astro_cli.sim.prefix_cache import block_hashes
from rps_astro_cli.tokens import token_ids_fallback
from rps_astro_cli.types import InstanceConfig, InstanceStatus

MODEL = "fake/model"
BS = 4
KNOWN = [1, *range(500, 512)]  # the fake engine's ids of any prompt: 13 → 3 full blocks of 4
PNG_1PX = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6"
           "kgAAAABJRU5ErkJggg==")
TEXT = "one two three four five six seven eight nine ten"


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": TEXT}], "max_tokens": 2, **kw}


def fake_engine(version: dict, cached: list[int], delay_s: float = 0.0) -> tuple[FastAPI, list[dict]]:
    """A vLLM-like engine: /version answers `version`, /status?prefix_since reports
    `cached` block hashes, /tokenize answers KNOWN after `delay_s` (its bodies are
    recorded in the returned list), completions answer at once."""
    app = FastAPI()
    calls: list[dict] = []
    limits = InstanceConfig(block_size=BS, num_gpu_blocks=1024, max_num_seqs=8, max_num_batched_tokens=512,
                            max_model_len=2048)

    @app.get("/health")
    async def _health():
        return {"status": "ok"}

    @app.get("/version")
    async def _version():
        return version

    @app.get("/v1/models")
    async def _models():
        return {"object": "list", "data": [{"id": MODEL}]}

    @app.get("/status")
    async def _status(prefix_since: int | None = None):
        d = InstanceStatus("fake", 0.0, limits, kv_blocks_free=1024).to_dict()
        if prefix_since is not None:
            d["prefix_cache"] = {"seq": 1, "reset": True, "stored": cached, "removed": []}
        return d

    @app.post("/tokenize")
    async def _tokenize(request: Request):
        calls.append(json.loads(await request.body()))
        await asyncio.sleep(delay_s)
        return {"count": len(KNOWN), "max_model_len": 2048, "tokens": KNOWN}

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    async def _complete():
        return {"id": "x", "object": "chat.completion", "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}],
                "usage": {"prompt_tokens": 13, "completion_tokens": 2, "total_tokens": 15}}

    return app, calls


VLLM = {"version": "0.32.0"}
SIM = {"version": "0.1", "engine": "astro-sim"}


def settings(urls: list[str], **kw) -> SchedulerSettings:
    eps = tuple(InstanceEndpoint(f"engine-{i}", u) for i, u in enumerate(urls))
    return SchedulerSettings(instances=eps, policy="cache_aware", status_interval_s=0.05, **kw)


async def blocks_of(s: SchedulerSettings, body: dict, endpoint: str = "chat"):
    """The scheduler's (hashes, block size, engine count) of `body`, after one health check
    (its /status and /version), and its metrics text."""
    from prometheus_client import generate_latest

    sched = Scheduler(s)
    await sched.health.check_all()
    door = sched.front_door
    raw = json.dumps(body).encode()
    b, parsed = door.parse(raw, endpoint)
    got = await door.prompt_blocks(b, endpoint, door.start_prompt_ids(b, endpoint, parsed))
    await asyncio.sleep(0)
    await sched.clients.close()
    return got, generate_latest(sched.m.registry).decode()


def fallback_hashes(body: dict, endpoint: str = "chat") -> tuple[int, ...]:
    return block_hashes(oa.prompt_token_ids(body, endpoint, token_ids_fallback), BS)


def test_engine_ids_are_hashed_and_the_rpc_body_mirrors_the_chat_request():
    fb = fallback_hashes(chat_body())
    assert len(fb) == 3 and fb != block_hashes(KNOWN, BS)  # the fallback's 12 ids are other ids
    with ExitStack() as st:
        app, calls = fake_engine(VLLM, [])
        e = st.enter_context(ServerThread(app))
        for mode in ("auto", "engine"):
            got, m = asyncio.run(blocks_of(settings([e.url], prefix_tokenizer=mode), chat_body()))
            assert got == (block_hashes(KNOWN, BS), BS, 13)
            assert metric(m, "astro:tokenize_rpcs_total", outcome="ok") == 1
        # vLLM 0.32's TokenizeChatRequest defaults equal the chat request's; the body's own pass through
        assert calls[0] == {"model": MODEL, "messages": chat_body()["messages"], "add_generation_prompt": True,
                            "continue_final_message": False, "add_special_tokens": False}
        asyncio.run(blocks_of(settings([e.url]), chat_body(add_generation_prompt=False, continue_final_message=True,
                                                             chat_template_kwargs={"x": 1}, reasoning_effort="none")))
        assert calls[2] == {"model": MODEL, "messages": chat_body()["messages"], "add_generation_prompt": False,
                            "continue_final_message": True, "add_special_tokens": False,
                            "chat_template_kwargs": {"x": 1, "enable_thinking": False}}
        got, _ = asyncio.run(blocks_of(settings([e.url]), {"model": MODEL, "prompt": [TEXT], "max_tokens": 2},
                                       "completions"))
        assert got == (block_hashes(KNOWN, BS), BS, 13)
        assert calls[3] == {"model": MODEL, "prompt": TEXT, "add_special_tokens": True}


def test_timeout_falls_back_to_the_fallback_ids_and_is_counted():
    with ExitStack() as st:
        app, calls = fake_engine(VLLM, [], delay_s=0.5)
        e = st.enter_context(ServerThread(app))
        got, m = asyncio.run(blocks_of(settings([e.url], tokenize_deadline_s=0.02), chat_body()))
        assert len(calls) == 1  # it was asked, too late
        assert got == (fallback_hashes(chat_body()), BS, None)
        assert metric(m, "astro:tokenize_rpcs_total", outcome="timeout") == 1
        assert metric(m, "astro:dispatch_fallbacks_total", policy="cache_aware", reason="tokenize timeout") == 1


def test_no_rpc_for_token_ids_fallback_setting_sim_engines_and_media():
    ids = list(range(100, 110))  # 10 ids: 2 full blocks
    image = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": TEXT}, {"type": "image_url", "image_url": {"url": PNG_1PX}}]}]}
    with ExitStack() as st:
        app, calls = fake_engine(VLLM, [])
        vllm = st.enter_context(ServerThread(app))
        sim_app, sim_calls = fake_engine(SIM, [])
        sim = st.enter_context(ServerThread(sim_app))
        got, m = asyncio.run(blocks_of(settings([vllm.url]), {"model": MODEL, "prompt": ids, "max_tokens": 2},
                                       "completions"))
        assert got == (block_hashes(ids, BS), BS, None)
        got, _ = asyncio.run(blocks_of(settings([vllm.url], prefix_tokenizer="fallback"), chat_body()))
        assert got == (fallback_hashes(chat_body()), BS, None)
        got, _ = asyncio.run(blocks_of(settings([sim.url]), chat_body()))  # auto, an astro sim engine
        assert got == (fallback_hashes(chat_body()), BS, None)
        assert not calls and not sim_calls
        assert metric(m, "astro:tokenize_rpcs_total") == 0
        got, _ = asyncio.run(blocks_of(settings([vllm.url]), image))
        assert got == (fallback_hashes(image), BS, None) and not calls


def test_engine_kind_from_version_and_settings_name_the_field():
    assert engine_kind_of_version(200, b'{"version": "0.1", "engine": "astro-sim"}') == ASTRO_SIM
    assert engine_kind_of_version(200, b'{"version": "0.32.0"}') == OTHER_ENGINE
    assert engine_kind_of_version(404, b"") == OTHER_ENGINE
    assert engine_kind_of_version(503, b"") is None
    assert tokenize_body({"prompt": [[1, 2, 3]]}, "completions") is None
    with pytest.raises(AstroUserError) as exc:
        SchedulerSettings(instances=(), prefix_tokenizer="vllm")
    assert exc.value.field == "prefix_tokenizer" and "auto, engine, fallback" in str(exc.value.fix)
    from rps_astro_cli.services.config import parse_config

    with pytest.raises(AstroUserError) as exc:
        parse_config({"scheduler": {"prefix_tokenizer": "vllm"}})
    assert exc.value.field == "scheduler.prefix_tokenizer"
    with pytest.raises(AstroUserError) as exc:
        parse_config({"scheduler": {"tokenize_deadline_ms": 0}})
    assert exc.value.field == "scheduler.tokenize_deadline_ms"


def test_cli_flag_is_checked_and_reaches_the_settings():
    from rps_astro_cli.cli.serve import _scheduler_settings

    def kw(**over):
        return scheduler_flag_kwargs(policy="cache_aware", **over)

    s = _scheduler_settings(**kw(prefix_tokenizer="engine", tokenize_deadline_ms=30.0))
    assert (s.prefix_tokenizer, s.tokenize_deadline_s) == ("engine", 0.03)
    assert _scheduler_settings(**kw()).prefix_tokenizer == "auto"
    with pytest.raises(AstroUserError) as exc:
        _scheduler_settings(**kw(prefix_tokenizer="hf"))
    assert exc.value.field == "--prefix-tokenizer"


def test_cache_aware_routes_by_the_engines_ids_live():
    # engine-1 reports KNOWN's first 2 blocks cached: the hit is 8 of the engine's 13
    # prompt tokens (> cache_threshold 0.5), so every request goes there; engine-0 has
    # nothing. With the fallback ids nothing would hit and the ties would split at random.
    with ExitStack() as st:
        a0, _ = fake_engine(VLLM, [])
        a1, calls = fake_engine(VLLM, list(block_hashes(KNOWN, BS)[:2]))
        urls = [st.enter_context(ServerThread(a)).url for a in (a0, a1)]
        s = st.enter_context(ServerThread(create_app(settings(urls, tokenize_deadline_s=1.0))))
        with httpx.Client(base_url=s.url, timeout=10) as c:
            for _ in range(8):
                r = c.post("/v1/chat/completions", json=chat_body())
                assert r.status_code == 200 and r.headers["x-astro-instance"] == "engine-1"
            assert metric(c.get("/metrics").text, "astro:tokenize_rpcs_total", outcome="ok") == 8


def test_early_dispatch_waits_for_the_engines_ids():
    # power_of_k, k = 1, objective ttft: the early decision's one candidate is the
    # instance pinned by the longest cached prefix. /tokenize answers after 100 ms (under
    # the 1 s deadline): the early decision waits for it, so engine-1 (KNOWN's 2 blocks)
    # is the candidate every time (2^-6 by chance: on fallback ids nothing is cached and
    # k = 1 draws at random). (No Predictors here: the pick is the fallback's.)
    with ExitStack() as st:
        a0, _ = fake_engine(VLLM, [], delay_s=0.1)
        a1, _ = fake_engine(VLLM, list(block_hashes(KNOWN, BS)[:2]), delay_s=0.1)
        urls = [st.enter_context(ServerThread(a)).url for a in (a0, a1)]
        s = SchedulerSettings(instances=tuple(InstanceEndpoint(f"engine-{i}", u) for i, u in enumerate(urls)),
                              policy="power_of_k", policy_params={"k": 1}, status_interval_s=0.05,
                              tokenize_deadline_s=1.0)
        srv = st.enter_context(ServerThread(create_app(s)))
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            for _ in range(6):
                assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200
            recs = c.get("/decisions").json()
            assert len(recs) == 6 and all(d["early_dispatch"] and d["candidates"] == [1] for d in recs)


def test_predictors_see_the_prompt_in_engine_tokens():
    # power_of_k's defaults (k = all) on a vLLM-like fleet: the prompt's ids come from
    # /tokenize (KNOWN, 13 ids); engine-1 holds KNOWN's first 2 blocks (8 tokens). Each
    # Predictor must get the prompt as the engine counts it (13, the unit of its /status
    # and of the hit), with the hit on its own instance: 8 on engine-1, none on engine-0.
    # Before: the tagger's fallback count of TEXT (not 13) beside a hit in vLLM tokens.
    bodies: dict[int, list[dict]] = {0: [], 1: []}

    def predictor(i: int) -> FastAPI:
        app = FastAPI()

        @app.post("/predict")
        async def _predict(body: dict):
            bodies[i].append(body)
            return {"ttft_s": 0.1 + 0.01 * i, "e2e_s": 0.2}
        return app

    fallback_n = len(oa.prompt_token_ids(chat_body(), "chat", token_ids_fallback))
    assert fallback_n != len(KNOWN)  # else the test could not tell the two counts apart
    with ExitStack() as st:
        a0, _ = fake_engine(VLLM, [])
        a1, calls = fake_engine(VLLM, list(block_hashes(KNOWN, BS)[:2]))
        urls = [st.enter_context(ServerThread(a)).url for a in (a0, a1)]
        purls = [st.enter_context(ServerThread(predictor(i))).url for i in range(2)]
        eps = tuple(InstanceEndpoint(f"engine-{i}", u, p) for i, (u, p) in enumerate(zip(urls, purls)))
        s = st.enter_context(ServerThread(create_app(SchedulerSettings(
            instances=eps, policy="power_of_k", status_interval_s=0.05, tokenize_deadline_s=1.0,
            predict_deadline_s=2.0, length_model="baseline", served_models=(MODEL,)))))
        with httpx.Client(base_url=s.url, timeout=10) as c:
            t_end = time.monotonic() + 10.0  # until the scheduler mirrors both engines' caches
            while not all(i["prefix_cached_blocks"] == n for i, n in zip(c.get("/instances").json(), (0, 2))):
                assert time.monotonic() < t_end, c.get("/instances").json()
                time.sleep(0.02)
            r = c.post("/v1/chat/completions", json=chat_body())
            assert r.status_code == 200
            assert c.get("/decisions").json()[-1]["prompt_tokens"] == len(KNOWN)
    assert len(calls) >= 1
    (b0,), (b1,) = bodies[0][-1:], bodies[1][-1:]
    assert b0["prompt_tokens"] == b1["prompt_tokens"] == len(KNOWN)
    assert "cached_tokens" not in b0 and b1["cached_tokens"] == 8
