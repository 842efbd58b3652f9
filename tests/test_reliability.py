"""Reliability (issue 11): nothing hides, nothing is wasted, bad input never hangs.

Servers run on loopback threads (`ServerThread`); every HTTP call has a short timeout and
every wait loop a deadline."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from conftest import write_profile
from rps_astro_cli.protocol.http_server import ServerThread
from rps_astro_cli.services import predictor as pred_mod
from rps_astro_cli.services import tagger as tag_mod
from rps_astro_cli.services.http_common import free_port
from test_services_scheduler import MODEL, chat, engine_app, hand_profile, scheduler, start

UNANSWERED = "fallback: a predictor did not answer; lowest load"


@pytest.fixture()
def length_model(tmp_path) -> str:
    """Every prompt → 40 predicted output tokens."""
    p = tmp_path / "len.json"
    p.write_text(json.dumps({"kind": "bin_median", "edges_tokens": [], "median_output_tokens": [40]}))
    return str(p)


@pytest.fixture()
def profile_path(tmp_path) -> str:
    return write_profile(tmp_path, hand_profile())


def wait_for(fn, timeout_s: float = 10.0, what: str = "condition"):
    """Poll `fn()` until truthy (returned), failing after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = fn()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_dead_predictor_does_not_starve_its_engine_and_health_says_so(length_model, profile_path):
    with ExitStack() as st:
        engs = [start(st, engine_app(i)) for i in range(2)]
        live = start(st, pred_mod.create_app(pred_mod.PredictorSettings(engs[0].url, profile=profile_path)))
        dead = f"http://127.0.0.1:{free_port()}"
        s = scheduler(st, [e.url for e in engs], [live.url, dead], policy="power_of_k", policy_params={"k": "all"},
                      length_model=length_model, predict_deadline_s=0.5, recheck_interval_s=0.05)
        with httpx.Client(base_url=s.url, timeout=10) as c:
            seen = [c.post("/v1/chat/completions", json=chat()).headers["x-astro-instance"] for _ in range(12)]
            assert seen.count("engine-1") >= 2, seen  # before: 0 of 12 (never predicted → never picked)
            decs = c.get("/decisions").json()
            assert all(d["reason"] == UNANSWERED for d in decs)
            h = c.get("/health")
            assert h.status_code == 200
            body = h.json()
            assert body["status"] == "degraded" and body["healthy_instances"] == 2
            assert list(body["problems"]) == ["engine-1"]
            assert "predictor" in body["problems"]["engine-1"][0]
            inst = {i["name"]: i for i in c.get("/instances").json()}
            assert inst["engine-1"]["predictor_error"] and inst["engine-0"]["predictor_error"] is None
            assert c.get("/ready").status_code == 200


def test_scheduler_ready_is_503_without_engines_and_health_stays_live(length_model):
    with ExitStack() as st:
        s = scheduler(st, [f"http://127.0.0.1:{free_port()}"], policy="round_robin", length_model=length_model,
                      served_models=(MODEL,))
        h = httpx.get(s.url + "/health", timeout=5)
        assert h.status_code == 200 and h.json()["status"] == "unavailable"  # liveness: the process serves
        assert "engine" in h.json()["problems"]["engine-0"][0]
        r = httpx.get(s.url + "/ready", timeout=5)
        assert r.status_code == 503 and r.json()["ready"] is False and "engine" in r.json()["reason"]


def test_one_of_two_engines_dead_is_degraded(length_model):
    with ExitStack() as st:
        eng = start(st, engine_app(0))
        s = scheduler(st, [eng.url, f"http://127.0.0.1:{free_port()}"], policy="round_robin",
                      length_model=length_model)
        body = httpx.get(s.url + "/health", timeout=5).json()
        assert body["status"] == "degraded" and body["healthy_instances"] == 1  # before: "ok"
        assert list(body["problems"]) == ["engine-1"] and body["problems"]["engine-1"][0].startswith("engine:")
        assert httpx.get(s.url + "/ready", timeout=5).status_code == 200


def test_predictor_health_and_ready_follow_its_engine(profile_path):
    with ExitStack() as st:
        eng = ServerThread(engine_app(0)).start()
        try:
            p = start(st, pred_mod.create_app(pred_mod.PredictorSettings(eng.url, profile=profile_path,
                                                                         status_timeout_s=0.5)))
            assert httpx.get(p.url + "/ready", timeout=5).status_code == 200
            assert httpx.get(p.url + "/health", timeout=5).json()["status"] == "ok"
            assert httpx.get(eng.url + "/ready", timeout=5).json() == {"ready": True, "instance_id": "engine-0"}
        finally:
            eng.stop()
        time.sleep(0.3)  # past status_max_age_s: the cached status no longer counts
        r = httpx.get(p.url + "/ready", timeout=5)
        assert r.status_code == 503 and "/status" in r.json()["reason"]
        h = httpx.get(p.url + "/health", timeout=5)
        assert h.status_code == 200 and h.json()["status"] == "degraded" and "/status" in h.json()["problem"]


def test_tagger_ready(length_model):
    with ExitStack() as st:
        t = start(st, tag_mod.create_app(tag_mod.TaggerSettings(length_model=length_model)))
        r = httpx.get(t.url + "/ready", timeout=5)
        assert r.status_code == 200 and r.json() == {"ready": True, "role": "tagger"}


def test_kubernetes_readiness_probes_use_ready():
    """Every astro container's readinessProbe asks /ready (liveness stays /health); the
    vLLM overlay keeps vLLM's own /health for its engine container."""
    from pathlib import Path

    import yaml

    base = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "base"
    seen = 0
    for f in ("engine.yaml", "scheduler.yaml", "tagger.yaml"):
        for doc in yaml.safe_load_all((base / f).read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for ctr in spec.get("containers", []) + spec.get("initContainers", []):
                if "readinessProbe" in ctr:
                    assert ctr["readinessProbe"]["httpGet"]["path"] == "/ready", (f, ctr["name"])
                    seen += 1
    assert seen == 4  # engine, predictor, scheduler, tagger


# -- nothing wasted ---------------------------------------------------------------------
def engine_busy(url: str) -> int:
    st = httpx.get(url + "/status", timeout=5).json()
    return len(st["running"]) + len(st["waiting"])


def test_non_streaming_client_disconnect_aborts_at_the_engine(length_model):
    from conftest import prom_sum as metric

    with ExitStack() as st:
        eng = start(st, engine_app(0, time_scale=1.0))  # 900 tokens x >= 10 ms per step: >= 9 s of work
        s = scheduler(st, [eng.url], policy="round_robin", length_model=length_model)
        body = {"model": MODEL, "prompt": "x", "max_tokens": 900, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
        # before: still generating for nobody for ~9 s; now aborted once the client left:
        # the engine counts it ended by abort, not by length (a count, so the wait can be
        # generous on a loaded host; before: idle within 5 s, which told the two apart by
        # time only)
        wait_for(lambda: engine_busy(eng.url) == 0, 30.0, "the engine to drop the abandoned request")
        em = httpx.get(eng.url + "/metrics", timeout=5).text
        assert metric(em, "vllm:request_success_total", finished_reason="abort") == 1
        assert metric(em, "vllm:request_success_total", finished_reason="length") == 0
        wait_for(lambda: metric(httpx.get(s.url + "/metrics", timeout=5).text, "astro:scheduler_requests_total",
                                outcome="client_disconnected") == 1, 30.0, "the disconnect to be counted")
        inst = httpx.get(s.url + "/instances", timeout=5).json()
        assert inst[0]["outstanding_requests"] == 0 and inst[0]["healthy"] is True


TINY_PROFILE = {
    "profile_id": "tiny", "model": "tiny/model", "gpu": "none", "tp": 1,
    "coefficients": {"base_s": 0.01, "per_seq_s": 0.0, "token_knots": [0, 1000], "token_s": [0.0, 0.1],
                     "decode_attn_s_per_ctx_token": 0.0, "prefill_attn_s_per_token_pair": 0.0},
    "limits": {"block_size": 16, "num_gpu_blocks": 128, "max_num_seqs": 8,
               "max_num_batched_tokens": 256, "max_model_len": 512},
}


def _serve_engine(tmp_path, drain_s: float):
    import os
    import subprocess
    import sys

    pfile = tmp_path / "tiny.json"
    pfile.write_text(json.dumps(TINY_PROFILE))
    ready = tmp_path / "ready.txt"
    env = dict(os.environ, ASTRO_DRAIN_S=str(drain_s))
    proc = subprocess.Popen(
        [sys.executable, "-m", "rps_astro_cli.cli.main", "serve", "engine", "--profile", str(pfile),
         "--port", "0", "--time-scale", "1.0", "--ready-file", str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_for(lambda: proc.poll() is not None or (ready.exists() and ready.read_text().strip()), 120.0,
                 "the engine to listen")
        assert proc.poll() is None, proc.stdout.read()
    except BaseException:
        proc.kill()
        proc.communicate()
        raise
    return proc, ready.read_text().strip()


def _sigterm_while_running(proc, url: str, max_tokens: int) -> tuple[httpx.Response, int, str]:
    """Send one non-streaming request, SIGTERM the engine once it runs; the response, the
    exit code and the engine's output."""
    import signal
    import subprocess
    import threading

    got: dict = {}

    def send() -> None:
        try:
            got["r"] = httpx.post(url + "/v1/completions", timeout=120,
                                  json={"model": "tiny/model", "prompt": "x", "max_tokens": max_tokens,
                                        "ignore_eos": True})
        except httpx.HTTPError as exc:
            got["r"] = exc

    t = threading.Thread(target=send, daemon=True)
    try:
        t.start()
        wait_for(lambda: engine_busy(url) == 1, 60.0, "the request to run")
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        try:
            out, _ = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            out += "\n[killed: no exit within 120 s of SIGTERM]"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return got.get("r"), proc.returncode, out


@pytest.mark.slow
def test_sigterm_drains_the_engine_and_exits_0(tmp_path):
    # ~3 s of work (300 steps of >= 10 ms): the test's poll sees it running, and SIGTERM
    # lands, well before it ends even on a loaded host (before: 0.6 s, which a loaded host
    # could finish between two polls); the drain bound is far above it
    proc, url = _serve_engine(tmp_path, drain_s=60.0)
    r, code, out = _sigterm_while_running(proc, url, max_tokens=300)
    assert isinstance(r, httpx.Response) and r.status_code == 200, (r, out)
    assert r.json()["usage"]["completion_tokens"] == 300  # finished, not cut
    assert code == 0, out  # before: killed by the re-raised SIGTERM (-15)
    assert "Traceback" not in out and "CancelledError" not in out


@pytest.mark.slow
def test_sigterm_drain_bound_ends_the_rest_cleanly(tmp_path):
    proc, url = _serve_engine(tmp_path, drain_s=0.5)
    r, code, out = _sigterm_while_running(proc, url, max_tokens=400)  # ~4 s of work: past the bound
    assert isinstance(r, httpx.Response) and r.status_code == 503, (r, out)
    assert "drain period" in r.json()["error"]["message"]
    assert code == 0, out
    assert "Traceback" not in out and "CancelledError" not in out


# -- bad input never tracebacks or hangs -------------------------------------------------
BURST_HEAD = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def _burst(tmp_path, rows: str):
    p = tmp_path / "b.csv"
    p.write_text(BURST_HEAD + rows)
    return p


@pytest.mark.parametrize("ts", ["nan", "inf", "-3"])
def test_trace_with_a_bad_timestamp_is_a_one_line_error(tmp_path, ts):
    import numpy as np

    from rps_astro_cli.bench.workload_base import WorkloadOptions
    from rps_astro_cli.bench.workloads import load_workload
    from rps_astro_cli.errors import AstroUserError

    p = _burst(tmp_path, f"0,ChatGPT,10,5,15,x\n{ts},ChatGPT,10,5,15,x\n")
    with pytest.raises(AstroUserError) as ei:
        load_workload("burstgpt", WorkloadOptions(path=str(p), num_requests=2), np.random.default_rng(0))
    # the file's line (header = line 1), not the 0-based data-row index ("row 1" before)
    assert ei.value.field == "Timestamp" and ": line 3:" in str(ei.value) and "\n" not in str(ei.value)


@pytest.mark.timeout(60)
def test_virtual_bench_on_a_nan_trace_exits_2_without_hanging(tmp_path):
    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app

    p = _burst(tmp_path, "0,ChatGPT,10,5,15,x\nnan,ChatGPT,10,5,15,x\n")
    res = CliRunner().invoke(app, ["bench", "--no-report", "-n", "2", "--workload", "burstgpt", "--path", str(p),
                                   "--virtual", "--arrival", "trace"])
    assert res.exit_code == 2, res.output  # before: hung forever
    assert "Timestamp" in res.output and "Traceback" not in res.output


def test_trace_nan_tokens_are_skipped_and_unsorted_timestamps_are_said(tmp_path):
    import numpy as np

    from rps_astro_cli.bench.workload_base import WorkloadOptions
    from rps_astro_cli.bench.workloads import load_workload

    p = _burst(tmp_path, "10,ChatGPT,nan,5,15,x\n10,ChatGPT,10,inf,15,x\n12,ChatGPT,10,5,15,x\n"
                         "11,ChatGPT,20,6,26,x\n")
    wl = load_workload("burstgpt", WorkloadOptions(path=str(p), num_requests=2), np.random.default_rng(0))
    assert wl.skipped["malformed"] == 2  # before: ValueError / OverflowError tracebacks
    assert [(r.prompt_tokens, r.arrival_s) for r in wl.requests] == [(20, 0.0), (10, 1.0)]
    assert any("not in file order" in w for w in wl.warnings)


def test_time_scale_inf_says_what_to_pass():
    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app

    res = CliRunner().invoke(app, ["bench", "--no-report", "-n", "3", "--virtual", "--time-scale", "inf"])
    assert res.exit_code == 2 and "--time-scale" in res.output and "0.01" in res.output, res.output


def test_deeply_nested_json_is_400_at_engine_and_scheduler(length_model):
    deep = b'{"model": "hand/model", "prompt": "x", "max_tokens": 2, "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with ExitStack() as st:
        eng = start(st, engine_app(0))
        s = scheduler(st, [eng.url], policy="round_robin", length_model=length_model, max_body_bytes=1 << 20)
        p = start(st, pred_mod.create_app(pred_mod.PredictorSettings(eng.url)))
        for url, path in ((eng.url, "/v1/completions"), (s.url, "/v1/completions"), (p.url, "/predict")):
            with httpx.Client(base_url=url, timeout=10) as c:
                r = c.post(path, content=deep, headers={"content-type": "application/json"})
                assert r.status_code == 400, (url, r.status_code, r.text[:200])  # before: 500
                assert "nested" in r.json()["error"]["message"] and r.json()["error"]["param"] == "body"
                if path != "/predict":  # the keep-alive connection still serves
                    ok = c.post(path, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
                    assert ok.status_code == 200, ok.text
        # brackets inside strings are not nesting
        from rps_astro_cli.protocol.openai import decode_json_body

        assert decode_json_body(json.dumps({"prompt": "[" * 500}).encode()) == {"prompt": "[" * 500}


def test_jsonl_splits_only_on_newline(tmp_path):
    """U+2028 LINE SEPARATOR inside a prompt (real LMSYS-Chat exports) stays in its line."""
    from rps_astro_cli.bench.workload_base import _read_json_records
    from rps_astro_cli.length.data import load_length_data

    recs = [{"prompt": "first\u2028second", "response_tokens": 7}, {"prompt": "b\u2029c\x85d", "response_tokens": 3}]
    p = tmp_path / "pairs.jsonl"
    p.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in recs) + "\n", encoding="utf-8")
    ds = load_length_data(p)  # before: "line 1 is not JSON"
    assert [(s.prompt, s.response_tokens) for s in ds.samples] == [("first\u2028second", 7), ("b\u2029c\x85d", 3)]
    assert _read_json_records(p) == recs


def test_length_data_reads_openai_messages_and_lmsys_conversations(tmp_path):
    from rps_astro_cli.errors import AstroUserError
    from rps_astro_cli.length.data import load_length_data

    def words(n: int) -> str:
        return " ".join(["word"] * n)

    def count(text: str) -> int:
        return len(text.split())

    openai = [{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"},
                            {"role": "assistant", "content": words(5)}, {"role": "user", "content": "more"},
                            {"role": "assistant", "content": [{"type": "text", "text": words(2)}]}]}]
    lmsys = [{"conversation_id": "c1", "conversation": [{"role": "user", "content": "q"},
                                                         {"role": "assistant", "content": words(9)}]}]
    for name, recs, want in (("openai.jsonl", openai, [("hi there", 5), ("more", 2)]),
                             ("lmsys.json", lmsys, [("q", 9)])):
        p = tmp_path / name
        text = json.dumps(recs) if name.endswith(".json") else "\n".join(json.dumps(r) for r in recs)
        p.write_text(text)
        ds = load_length_data(p, counter=count)
        assert [(s.prompt, s.response_tokens) for s in ds.samples] == want, name
    assert load_length_data(tmp_path / "lmsys.json", counter=count).samples[0].conversation_id == "c1"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"turns": []}) + "\n")
    with pytest.raises(AstroUserError) as ei:
        load_length_data(bad, counter=count)
    assert "messages" in str(ei.value) and "conversation" in str(ei.value)


# -- exit codes a CI pipeline can rely on ------------------------------------------------
def _timer(events: list[str]):
    from rps_astro_cli.bench.client import StreamTimer

    t = StreamTimer(chat=False)
    t.feed("".join(f"data: {e}\n\n" for e in events).encode(), 1.0)
    t.close(1.0)
    return t


def test_zero_token_stream_fails_and_a_cut_output_is_flagged():
    from rps_astro_cli.bench.client import _finish
    from rps_astro_cli.bench.records import RequestRecord
    from rps_astro_cli.tokens import count_tokens_fallback

    empty = _timer(['{"choices":[{"text":"","finish_reason":"stop"}]}',
                    '{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":0}}', "[DONE]"])
    rec = RequestRecord("a", max_tokens=10)
    _finish(rec, empty, 1.0, count_tokens_fallback)
    assert rec.success is False and rec.error == "stream ended with zero output tokens"  # before: ok
    cut = _timer(['{"choices":[{"text":" a b c","finish_reason":"length"}]}',
                  '{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3}}', "[DONE]"])
    rec = RequestRecord("b", max_tokens=10)
    _finish(rec, cut, 1.0, count_tokens_fallback)
    assert rec.success and rec.finish_reason == "length" and rec.truncated and rec.to_dict()["truncated"]
    full = RequestRecord("c", success=True, output_tokens=10, finish_reason="length", max_tokens=10)
    assert not full.truncated  # ended by length exactly at max_tokens: as asked


def _bench_cfg(tmp_path, **kw):
    from rps_astro_cli.bench.config import BenchConfig

    return BenchConfig.flat(virtual=True, profile=write_profile(tmp_path, hand_profile()), instances=2,
                            workload="synthetic", num_requests=6, policies=["round_robin"], oracle_lengths=True,
                            request_rate=50.0, max_total_tokens=1000, out_dir=str(tmp_path / "rep"), **kw)


def _patch_virtual(monkeypatch, mutate=None, interrupt_after: int | None = None):
    from rps_astro_cli.bench import virtual

    orig = virtual.VirtualTarget.run

    def run(self, requests, times, on_done):
        seen = []

        def cb(r):
            seen.append(r)
            on_done(r)
            if interrupt_after is not None and len(seen) == interrupt_after:
                raise KeyboardInterrupt

        records, extras = orig(self, requests, times, cb)
        if mutate:
            mutate(records)
        return records, extras

    monkeypatch.setattr(virtual.VirtualTarget, "run", run)


def test_partly_failed_or_cut_bench_exits_3_and_says_which(tmp_path, monkeypatch):
    from rps_astro_cli.bench.runner import run_bench

    def mutate(records):
        records[0].success, records[0].error = False, "HTTP 500: boom"
        records[1].finish_reason, records[1].max_tokens = "length", records[1].output_tokens + 5

    _patch_virtual(monkeypatch, mutate)
    res = run_bench(_bench_cfg(tmp_path))
    assert res.exit_code == 3, res.exit_reasons  # before: 0 (only "all failed" was non-zero)
    assert any("1 of 6 requests failed" in r and "HTTP 500: boom" in r for r in res.exit_reasons)
    assert any("1 of 6 outputs were cut short" in r for r in res.exit_reasons)
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["exit_code"] == 3


def test_ctrl_c_writes_a_partial_report_and_exits_130(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app

    _patch_virtual(monkeypatch, interrupt_after=2)
    out = tmp_path / "rep"
    res = CliRunner().invoke(app, ["bench", "--virtual", "--profile", write_profile(tmp_path, hand_profile()),
                                   "--instances", "2", "--workload", "synthetic", "-n", "6", "--policies",
                                   "round_robin", "--oracle-lengths", "--request-rate", "50",
                                   "--max-total-tokens", "1000", "--out", str(out)])
    assert res.exit_code == 130, res.output  # before: KeyboardInterrupt, nothing written
    rep = json.loads((out / "report.json").read_text())
    assert rep["exit_code"] == 130 and "interrupted" in rep["exit_reasons"][0]
    assert len(rep["runs"]) == 1 and rep["runs"][0]["label"].endswith("(interrupted)")
    assert rep["runs"][0]["metrics"]["overall"]["num_requests"] == 2
    assert len((out / "requests.jsonl").read_text().strip().split("\n")) == 2


def test_engine_and_send_lag_become_report_warnings():
    from rps_astro_cli.bench.records import RequestRecord
    from rps_astro_cli.bench.runner import BenchResult, RunResult, _lag_extras, _lag_warnings

    recs = [RequestRecord(str(i), scheduled_s=float(i), sent_s=float(i) + (0.2 if i == 9 else 0.0))
            for i in range(10)]
    extras = {"engine_steps": 1000.0, "engine_steps_late": 80.0, "engine_lag_s_max": 0.3}
    _lag_extras(recs, extras)
    assert extras["send_lag_s_max"] == pytest.approx(0.2) and extras["send_lag_s_p99"] == pytest.approx(0.2)
    res = BenchResult(None, {}, {}, [])  # type: ignore[arg-type]
    _lag_warnings(res, RunResult("r", None, None, 1.0, "poisson", {}, recs, extras))
    assert len(res.warnings) == 2
    assert "send lag P99 200 ms" in res.warnings[0] and "8.0% of 1000 steps late" in res.warnings[1]
    quiet = {"engine_steps": 1000.0, "engine_steps_late": 10.0, "engine_lag_s_max": 0.3}
    _lag_extras(recs[:9], quiet)
    res2 = BenchResult(None, {}, {}, [])  # type: ignore[arg-type]
    _lag_warnings(res2, RunResult("r", None, None, 1.0, "poisson", {}, recs[:9], quiet))
    assert res2.warnings == []


@pytest.mark.parametrize("bad", ["inf", "nan", "0"])
def test_serve_engine_time_scale_must_be_finite_and_says_what_to_pass(bad):
    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app

    res = CliRunner().invoke(app, ["serve", "engine", "--time-scale", bad, "--port", "0"])
    assert res.exit_code == 2, res.output  # before: "time_scale: must be > 0, got inf"
    assert "--time-scale" in res.output and "finite" in res.output and "0.01" in res.output
    assert "Traceback" not in res.output


def held_engine(inner_url: str, reached, release) -> FastAPI:
    """A pass-through to the engine at `inner_url` that holds every `POST /v1/completions`
    until `release` (a threading.Event) is set; `reached` is set when one arrives."""
    import asyncio

    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def relay(path: str, request: Request) -> Response:
        body = await request.body()
        if request.method == "POST" and path == "v1/completions":
            reached.set()
            while not release.is_set():
                await asyncio.sleep(0.01)
        async with httpx.AsyncClient(timeout=60) as c:
            r = await c.request(request.method, f"{inner_url}/{path}", params=request.query_params, content=body,
                                headers={k: v for k, v in request.headers.items() if k.lower() != "host"})
        return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    return app


@pytest.mark.slow
def test_sigterm_drains_the_scheduler_and_exits_0(tmp_path, length_model):
    """SIGTERM on `astro serve scheduler` with a request in flight: it is relayed to the
    end, then the process exits 0 without a traceback.

    The request is held at the engine until the scheduler has logged its drain with it
    in flight, then let go (before: a 0.6 s request that a loaded host could finish
    before the test saw it at the engine, or before SIGTERM landed)."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    with ExitStack() as st:
        reached, release = threading.Event(), threading.Event()
        inner = start(st, engine_app(0))
        eng = start(st, held_engine(inner.url, reached, release))
        ready = tmp_path / "ready.txt"
        log_path = tmp_path / "scheduler.log"
        log = st.enter_context(open(log_path, "w"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "rps_astro_cli.cli.main", "serve", "scheduler", "--engine", eng.url,
             "--policy", "round_robin", "--length-model", length_model, "--port", "0", "--ready-file", str(ready)],
            stdout=log, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, ASTRO_DRAIN_S="60"))
        got: dict = {}
        try:
            wait_for(lambda: proc.poll() is not None or (ready.exists() and ready.read_text().strip()), 120.0,
                     "the scheduler to listen")
            assert proc.poll() is None, log_path.read_text()
            url = ready.read_text().strip()

            def send() -> None:
                try:
                    got["r"] = httpx.post(url + "/v1/completions", timeout=120,
                                          json={"model": MODEL, "prompt": "x", "max_tokens": 60, "ignore_eos": True})
                except httpx.HTTPError as exc:
                    got["r"] = exc

            t = threading.Thread(target=send, daemon=True)
            t.start()
            # the first request loads the in-process tagger's model: seconds on a loaded 2-core box
            assert reached.wait(120.0), "the request did not reach the engine"
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: "draining: 1 request(s) in flight" in log_path.read_text() or proc.poll() is not None,
                     60.0, "the scheduler to start draining")
            release.set()
            t.join(120)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        finally:
            release.set()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out = log_path.read_text()
        r = got.get("r")
        assert "draining: 1 request(s) in flight" in out, out
        assert isinstance(r, httpx.Response) and r.status_code == 200, (r, out)
        assert r.json()["usage"]["completion_tokens"] == 60
        assert proc.returncode == 0, out
        assert "Traceback" not in out
