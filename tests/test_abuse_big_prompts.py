"""Issue 29, finding 3 (continued): a prompt certainly too long is refused on a lower bound
of its tokens taken without tokenizing it (`tokens.fallback_tokens_at_least`,
`protocol.openai.prompt_tokens_at_least`), by the scheduler before any tag RPC and by the
sim engine before it counts the prompt. Before, 30 concurrent ~1 MB refused prompts still
delayed a 1-token request by up to 0.93–1.70 s: the scheduler sent every one to the tagger
(which tokenized it) and tokenized it itself before refusing it."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from contextlib import ExitStack
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import linear_profile
from rps_astro_cli.engine import sim_server
from rps_astro_cli.engine.sim_engine import SimEngine
from rps_astro_cli.protocol import openai as oa
from rps_astro_cli.protocol.http_server import OFF_LOOP_BYTES, ServerThread
from rps_astro_cli.services.scheduler import InstanceEndpoint, SchedulerSettings, create_app
from rps_astro_cli.tokens import (
    FALLBACK_TOKEN_MAX_CHARS,
    count_tokens_fallback,
    fallback_space_chars,
    fallback_tokens_at_least,
)

MODEL = "hand/model"
MAX_LEN = 4096  # the engines' context here; the front door refuses 2 × this


# -- the bound -------------------------------------------------------------------------
def test_space_chars_are_exactly_the_characters_str_isspace_is_true_of():
    every = [chr(c) for c in range(sys.maxunicode + 1)]
    assert fallback_space_chars() == tuple(c for c in every if c.isspace())
    # CPython's Unicode database: tab..CR, the 4 information separators, space, NEL,
    # NBSP, ogham space, U+2000..U+200A, line/paragraph separators, NNBSP, MMSP, ideographic
    assert len(fallback_space_chars()) == 29 and "\u3000" in fallback_space_chars()
    assert FALLBACK_TOKEN_MAX_CHARS == 4


@pytest.mark.parametrize("text, bound, true_count", [
    ("", 0, 0),
    (" \t\n\r\x0b\x0c\x1c\u3000\xa0\x85", 0, 0),  # whitespace only: no token at all
    ("word " * 5, 5, 5),  # 20 non-space characters / 4
    ("abcd" * 1000, 1000, 1000),  # the worst case: one 4000-letter word = 1000 longest tokens
    ("abcd " * 1000, 1000, 1000),  # 4-letter words: the bound is the count
    ("aaaaa", 2, 2),  # ceil(5 / 4)
    ("a b c", 1, 3),  # 3 one-letter words: ceil(3 / 4) = 1 ≤ 3
    ("!?", 1, 2),  # symbols are one token each
    ("日本語日本", 2, 2),  # CJK letters are \w: one 5-character word (15 UTF-8 bytes)
    ("é" * 9, 3, 3),  # 9 two-byte letters: ceil(9 / 4) characters, not bytes
    ("😀😀 😀", 1, 3),  # 4-byte symbols: 3 characters / 4 → 1 ≤ 3
    ("\u3000x\u3000y\u2028", 1, 2),  # non-ASCII whitespace is not counted
    ("e\u0301" * 4, 2, 8),  # combining accent: a symbol (not \w): 8 characters → 2 ≤ 8
])
def test_the_bound_by_hand(text, bound, true_count):
    assert count_tokens_fallback(text) == true_count
    assert fallback_tokens_at_least(text) == bound <= true_count


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(), max_size=200))
def test_the_bound_never_exceeds_the_fallback_count(text):
    assert fallback_tokens_at_least(text) <= count_tokens_fallback(text)


def test_the_bound_on_adversarial_strings():
    """Random strings over the characters that change the count most: every whitespace
    character, word characters (ASCII, Latin, CJK, digits, underscore), symbols and
    combining marks, astral characters, lone surrogates; the bound is never above the
    count and is exact on runs of 4-character words."""
    rng = random.Random(7)
    alphabet = list(fallback_space_chars()) + list("aZ9_éß日本") + list("!.,-\u0301\u200b") + ["😀", "\ud800"]
    for _ in range(2000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 64)))
        assert fallback_tokens_at_least(text) <= count_tokens_fallback(text), repr(text)
    for word in ("abcd", "ßßßß", "日本語本", "a_9Z"):
        for sep in fallback_space_chars():
            text = sep.join([word] * 50)
            assert fallback_tokens_at_least(text) == count_tokens_fallback(text) == 50


def _best_s(fn, arg, tries: int) -> float:
    best = float("inf")
    for _ in range(tries):
        t0 = time.perf_counter()
        fn(arg)
        best = min(best, time.perf_counter() - t0)
    return best


def test_the_bound_is_cheap_on_a_megabyte():
    for prompt in ("word " * 200_000, "wörd " * 200_000):  # ASCII (str.translate), Latin-1 (str.count)
        assert fallback_tokens_at_least(prompt) == 200_000 == count_tokens_fallback(prompt)
        # ~0.7 ms (ASCII) / ~4 ms against ~43 ms to tokenize it: at least 5× cheaper, best of a few
        assert 5 * _best_s(fallback_tokens_at_least, prompt, 5) < _best_s(count_tokens_fallback, prompt, 3)


def test_the_prompt_bound_of_a_body():
    at_least = oa.prompt_tokens_at_least
    assert at_least({"prompt": "word " * 10}, "completions") == 10
    assert at_least({"prompt": ["word " * 10]}, "completions") == 10
    assert at_least({"prompt": list(range(5000))}, "completions") == 5000  # token ids: their count
    assert at_least({"prompt": [list(range(7))]}, "completions") == 7
    assert at_least({"prompt": ["a" * 400, "b" * 400]}, "completions") == 0  # batched: the parser's to refuse
    assert at_least({"prompt": [1, True, 3]}, "completions") == 0  # not token ids
    assert at_least({"prompt": 12}, "completions") == 0
    assert at_least({}, "completions") == 0
    chat = {"messages": [
        {"role": "system", "content": "abcd" * 3},  # 3
        {"role": "user", "content": [{"type": "text", "text": "abcd" * 2},  # 2
                                     {"type": "image_url", "image_url": {"url": "x" * 400}},
                                     {"type": "text", "text": 5}]},
        "not a message",
        {"role": "user", "content": None}]}
    assert at_least(chat, "chat") == 5
    # the parser's count adds the formatting: 3 + (3 + 1) per message + the roles' and texts'
    assert at_least({"messages": [{"role": "user", "content": "abcd"}]}, "chat") == 1
    assert oa.parse_chat_request({"messages": [{"role": "user", "content": "abcd"}]}).text_tokens == 8
    assert at_least({"messages": "abcd" * 100}, "chat") == 0
    assert at_least({"messages": [{"role": "user", "content": "abcd"}]}, "chat", lambda t: 0) == 0


# -- the servers -----------------------------------------------------------------------
def _engine_app() -> FastAPI:
    prof = linear_profile(model=MODEL, gpu="none", num_gpu_blocks=4096, max_model_len=MAX_LEN)
    return sim_server.create_app(SimEngine(prof, time_scale=0.01, instance_id="engine-0", seed=0))


def _counting_tagger(calls: list[int]) -> FastAPI:
    """A tagger that records each /tag body's size and answers 7 output tokens."""
    app = FastAPI()

    @app.get("/health")
    async def _health():
        return {"status": "ok"}

    @app.post("/tag")
    async def _tag(request: Request):
        calls.append(len(await request.body()))
        return {"predicted_output_tokens": 7, "prompt_tokens": 2, "text_tokens": 2}

    return app

def _door(stack: ExitStack, calls: list[int], **settings: Any) -> tuple[ServerThread, Any]:
    """A scheduler (llumnix) in front of one sim engine and `_counting_tagger(calls)`, once
    it knows the engine's context length: (its server, its front door)."""
    eng = stack.enter_context(ServerThread(_engine_app()))
    tag = stack.enter_context(ServerThread(_counting_tagger(calls)))
    eps = (InstanceEndpoint("engine-0", eng.url, None),)
    app = create_app(SchedulerSettings(instances=eps, policy="llumnix", status_interval_s=0.05, tagger_url=tag.url,
                                       **settings))
    sch = stack.enter_context(ServerThread(app))
    door = app.state.scheduler.front_door
    deadline = time.monotonic() + 10
    while door.context_limit() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return sch, door



def _chat(content: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1}


@pytest.fixture()
def parses(monkeypatch) -> list[int]:
    """The prompt lengths (characters) the scheduler's and the engine's parser counted."""
    seen: list[int] = []
    real = oa.parse_chat_request

    def spy(body, *a, **kw):
        seen.append(len(body["messages"][0]["content"]))
        return real(body, *a, **kw)

    monkeypatch.setattr(oa, "parse_chat_request", spy)
    monkeypatch.setattr(sim_server, "parse_chat_request", spy)
    return seen


def test_a_megabyte_prompt_is_refused_with_no_tag_rpc_and_no_tokenizing(parses):
    """The scheduler knows the engines' context (a load-aware policy polls /status): a
    ~1 MB prompt (200,000 tokens) is refused with the context refusal's 400 before its tag
    RPC and before it is counted; a normal prompt is still tagged (its RPC sent before the
    parse, as before), and so is a legitimate big body (over OFF_LOOP_BYTES: tagged once
    its JSON passed the cheap check). The tag is awaited here (`late_tag` off: the order
    of the tag RPC and the parse is what this test checks); with late tags see
    `test_a_late_tagged_small_body_refused_on_its_count_sends_no_tag_rpc`."""
    calls: list[int] = []
    with ExitStack() as stack:
        sch, door = _door(stack, calls, tag_deadline_s=5.0, late_tag=False)
        assert door.context_limit() == MAX_LEN
        with httpx.Client(base_url=sch.url, timeout=30) as c:
            big = "word " * 200_000
            r = c.post("/v1/chat/completions", json=_chat(big))
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == "messages", r.text
            assert "at least 200000 tokens" in err["message"] and f"{MAX_LEN} tokens" in err["message"]
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": big, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
            assert "at least 200000 tokens" in r.json()["error"]["message"]
            # token ids: their count is the bound (40,000 of them: an 80 KB body, refused unparsed)
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 40_000, "max_tokens": 1})
            assert r.status_code == 400 and "at least 40000 tokens" in r.json()["error"]["message"]
            time.sleep(0.2)
            assert calls == [] and len(big) not in parses  # no /tag RPC, never counted
            r = c.post("/v1/chat/completions", json={**_chat("hi"), "max_tokens": 50})
            assert r.status_code == 200, r.text
            assert len(calls) == 1 and c.get("/decisions").json()[-1]["predicted_output_tokens"] == 7  # the tag's
            # a legitimate big body: 70,000 characters, 2 tokens of text
            legit = "a" + " " * 70_000 + "b"
            r = c.post("/v1/chat/completions", json=_chat(legit))
            assert len(r.request.content) > OFF_LOOP_BYTES
            assert r.status_code == 200, r.text
            assert len(calls) == 2 and calls[1] == len(r.request.content)
            # under the bound but over 2 × 4096 by the count (14,000 one-letter words): not
            # refused by the bound, refused on the count as before (its tag RPC goes out in
            # parallel with the count, so whether the tagger sees it first is a race: not checked)
            spread = "a    " * 14_000
            r = c.post("/v1/chat/completions", json=_chat(spread))
            assert r.status_code == 400 and "the prompt is 14007 tokens" in r.json()["error"]["message"]
            assert "at least" not in r.json()["error"]["message"]
            # a small body's tag RPC still goes out before the parse, as before: 2 × 4096
            # token ids (a 25 KB body) are refused on their count, after the RPC was sent
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1] * (2 * MAX_LEN), "max_tokens": 1})
            assert r.status_code == 400 and "at least 8192 tokens" in r.json()["error"]["message"]
            deadline = time.monotonic() + 5
            while len(calls) < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(calls) == 4


def test_a_late_tagged_small_body_refused_on_its_count_sends_no_tag_rpc():
    """With late tags (llumnix reads no reply length; an fcfs engine), a small body's tag
    RPC goes out only once it is forwarded: 2 × 4096 token ids refused on their count cost
    the tagger nothing, and a valid request is still tagged (after its forward)."""
    calls: list[int] = []
    with ExitStack() as stack:
        sch, door = _door(stack, calls, tag_deadline_s=5.0)
        assert door.late_tag_ok()
        with httpx.Client(base_url=sch.url, timeout=30) as c:
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1] * (2 * MAX_LEN), "max_tokens": 1})
            assert r.status_code == 400 and "at least 8192 tokens" in r.json()["error"]["message"]
            r = c.post("/v1/chat/completions", json={**_chat("hi"), "max_tokens": 50})
            assert r.status_code == 200, r.text
            deadline = time.monotonic() + 5
            while not calls and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)
            assert len(calls) == 1  # the valid request's tag only
            d = c.get("/decisions").json()[-1]
            assert d["late_tag"] and d["tag_wait_us"] == 0


def test_the_engine_refuses_a_megabyte_prompt_before_counting_it(parses):
    with ServerThread(_engine_app()) as eng, httpx.Client(base_url=eng.url, timeout=30) as c:
        big = "word " * 200_000
        r = c.post("/v1/chat/completions", json=_chat(big))
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages", r.text
        assert "at least 200000 tokens" in err["message"] and f"{MAX_LEN} tokens" in err["message"]
        assert parses == []  # refused before the parser counted it
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": [5] * MAX_LEN, "max_tokens": 1})
        assert r.status_code == 400 and "at least 4096 tokens" in r.json()["error"]["message"]
        # just under the context: counted and served (the bound changes nothing it accepts)
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "word " * (MAX_LEN - 10), "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == MAX_LEN - 10
        r = c.post("/v1/chat/completions", json=_chat("hi"))
        assert r.status_code == 200 and parses == [2]


def test_an_engine_with_another_tokenizer_has_no_text_bound():
    """An engine counting with a tokenizer whose longest token is unknown keeps counting
    every prompt (only a token-id prompt's length bounds it cheaply)."""
    prof = linear_profile(model=MODEL, gpu="none", num_gpu_blocks=4096, max_model_len=MAX_LEN)
    app = sim_server.create_app(SimEngine(prof, time_scale=0.01, instance_id="engine-0", seed=0),
                                counter=lambda text: len(text.split()))
    with ServerThread(app) as eng, httpx.Client(base_url=eng.url, timeout=30) as c:
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "word " * 5000, "max_tokens": 1})
        assert r.status_code == 400 and "the prompt is 5000 tokens" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": [5] * 5000, "max_tokens": 1})
        assert r.status_code == 400 and "at least 5000 tokens" in r.json()["error"]["message"]


def test_thirty_refused_megabyte_prompts_never_reach_the_tagger():
    """The issue's load on one scheduler: 30 concurrent ~1 MB prompts, all refused, none
    sent to the tagger."""
    calls: list[int] = []
    with ExitStack() as stack:
        sch, _ = _door(stack, calls)

        async def burst() -> list[int]:
            async with httpx.AsyncClient(base_url=sch.url, timeout=60) as c:
                rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=_chat("word " * 200_000))
                                            for _ in range(30)))
            return [r.status_code for r in rs]

        assert asyncio.run(burst()) == [400] * 30
        assert calls == []
