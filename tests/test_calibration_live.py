"""Online calibration live (issue 31): a sim engine running a profile 1.6× slower in every
term than the one its Predictor is given reports its steps (`/status?steps_since=`); the
Predictor refits from them (`calibration: online`) or only tracks its error (`off`), says
so on its `/status`, `/metrics` and in every `/predict` reply, and the scheduler compares
an untrusted Predictor's instance by load, naming it in the decision record."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import replace

import httpx
import pytest

from conftest import prom_sum, write_profile
from rps_astro_cli.engine import sim_server
from rps_astro_cli.engine.sim_engine import SimEngine
from rps_astro_cli.protocol.http_server import ServerThread
from rps_astro_cli.services import predictor as pred_mod
from rps_astro_cli.services.scheduler import InstanceEndpoint, SchedulerSettings, create_app
from rps_astro_cli.sim.profile import load_profile

NOMINAL = load_profile("llama-2-7b-a30")
SLOW = replace(NOMINAL, profile_id="a30-slow", base_s=1.6 * NOMINAL.base_s, per_seq_s=1.6 * NOMINAL.per_seq_s,
               token_s=tuple(1.6 * v for v in NOMINAL.token_s),
               decode_attn_s_per_ctx_token=1.6 * NOMINAL.decode_attn_s_per_ctx_token,
               prefill_attn_s_per_token_pair=1.6 * NOMINAL.prefill_attn_s_per_token_pair)


def _traffic(url: str, n: int = 24) -> None:
    """`n` concurrent completions of 40 tokens each straight to the engine."""
    def one(i: int) -> int:
        body = {"model": NOMINAL.model, "prompt": "tell me " * (20 + 7 * i), "max_tokens": 40, "ignore_eos": True}
        return httpx.post(url + "/v1/completions", json=body, timeout=60).status_code

    with ThreadPoolExecutor(8) as ex:
        assert set(ex.map(one, range(n))) == {200}


def _predict(url: str) -> dict:
    r = httpx.post(url + "/predict", json={"prompt_tokens": 100, "predicted_output_tokens": 20}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("mode", ["online", "off"])
def test_predictor_calibrates_from_its_engines_steps(tmp_path, mode):
    nominal_path = write_profile(tmp_path, NOMINAL, "nominal.json")
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(sim_server.create_app(SimEngine(SLOW, time_scale=0.02))))
        steps = httpx.get(eng.url + "/status?steps_since=0").json()["steps"]
        assert steps == {"seq": 0, "rows": []}
        pred = st.enter_context(ServerThread(pred_mod.create_app(pred_mod.PredictorSettings(
            eng.url, profile=nominal_path, calibration=mode, status_cache_s=0.0))))
        first = _predict(pred.url)
        assert first["trusted"] is True and first["model_ape"] is None  # no step seen yet: the profile's word
        _traffic(eng.url)
        logged = httpx.get(eng.url + "/status?steps_since=0").json()["steps"]
        assert logged["seq"] >= 40 and len(logged["rows"]) == logged["seq"]
        b, t, ctx, pairs, enc, dur = logged["rows"][-1]
        # an engine step's duration is its profile's step time for that shape
        from rps_astro_cli.sim.latency import LatencyModel

        assert dur == pytest.approx(LatencyModel(SLOW).step_s(b, t, ctx, pairs, enc), rel=1e-9)
        reply = _predict(pred.url)
        state = httpx.get(pred.url + "/status").json()
        assert state["calibration"] == mode and state["state"]["samples"] == logged["seq"]
        metrics = httpx.get(pred.url + "/metrics").text
        assert prom_sum(metrics, "astro:predictor_calibration_samples") == logged["seq"]
        if mode == "online":
            assert state["state"]["refits"] >= 1 and state["state"]["trusted"]
            assert reply["trusted"] is True
            # the fitted profile is the engine's, not the one the Predictor was given
            fitted = state["profile"]["coefficients"]
            assert fitted["decode_attn_s_per_ctx_token"] == pytest.approx(SLOW.decode_attn_s_per_ctx_token, rel=0.15)
            assert state["profile"]["fit"]["calibrated_from"] == NOMINAL.profile_id
            (tmp_path / "exported.json").write_text(json.dumps(state["profile"]))
            assert load_profile(str(tmp_path / "exported.json")).profile_id == NOMINAL.profile_id
        else:
            # every step took 1.6× the model's time: error 1 − 1/1.6 = 37.5 %, not trusted
            assert state["state"]["refits"] == 0 and not state["state"]["trusted"]
            assert state["state"]["recent_ape"] == pytest.approx(0.375, rel=1e-6)
            assert reply["trusted"] is False and reply["model_ape"] == pytest.approx(0.375, rel=1e-6)
            assert prom_sum(metrics, "astro:predictor_calibration_trusted") == 0


def test_scheduler_leans_on_load_for_an_untrusted_predictor(tmp_path):
    nominal_path = write_profile(tmp_path, NOMINAL, "nominal.json")
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(sim_server.create_app(SimEngine(SLOW, time_scale=0.02))))
        pred = st.enter_context(ServerThread(pred_mod.create_app(pred_mod.PredictorSettings(
            eng.url, profile=nominal_path, calibration="off", status_cache_s=0.0))))
        _traffic(eng.url, 12)
        _predict(pred.url)  # the Predictor learns its error from the steps so far
        sched = st.enter_context(ServerThread(create_app(SchedulerSettings(
            instances=(InstanceEndpoint("engine-0", eng.url, pred.url),), policy="power_of_k",
            served_models=(NOMINAL.model,), predict_deadline_s=2.0, status_interval_s=0.05))))
        body = {"model": NOMINAL.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert httpx.post(sched.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
        d = httpx.get(sched.url + "/decisions").json()[-1]
        assert d["untrusted"] == [0] and d["predictions"] == {}
        assert d["reason"].startswith("fallback: no predictor answered")
        m = httpx.get(sched.url + "/metrics").text
        assert prom_sum(m, "astro:predict_rpcs_total", outcome="untrusted") == 1


def test_a_bad_calibration_mode_is_one_line_naming_the_flag():
    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app

    r = CliRunner().invoke(app, ["serve", "predictor", "--engine-url", "http://127.0.0.1:9",
                                 "--calibration", "sometimes"], env={"COLUMNS": "200"})
    assert r.exit_code == 2 and "--calibration" in r.output and "online or off" in r.output, r.output
    assert "Traceback" not in r.output


def test_scheduler_corrects_predictions_by_what_requests_took(tmp_path):
    """The engine runs twice as slow as the scheduler is told (its --time-scale 0.1, the
    scheduler's 0.05), so every request takes ≥ 2× the Predictor's E2E in the scheduler's
    engine seconds: after `min_samples` (16) ended requests the scheduler's outcome
    correction (`dispatch.outcome`) applies, and the decision record keeps the Predictor's
    own estimate beside the corrected one; with calibration off it never does."""
    true_path = write_profile(tmp_path, NOMINAL, "nominal.json")
    for on in (True, False):
        with ExitStack() as st:
            eng = st.enter_context(ServerThread(sim_server.create_app(SimEngine(NOMINAL, time_scale=0.1))))
            pred = st.enter_context(ServerThread(pred_mod.create_app(pred_mod.PredictorSettings(
                eng.url, profile=true_path, calibration="online", status_cache_s=0.0))))
            sched = st.enter_context(ServerThread(create_app(SchedulerSettings(
                instances=(InstanceEndpoint("engine-0", eng.url, pred.url),), policy="power_of_k",
                served_models=(NOMINAL.model,), predict_deadline_s=2.0, status_interval_s=0.05, time_scale=0.05,
                early_dispatch=False, calibration="online" if on else "off"))))
            for i in range(24):
                body = {"model": NOMINAL.model, "prompt": "tell me " * (10 + 9 * i), "max_tokens": 10 + 5 * (i % 8),
                        "ignore_eos": True}
                assert httpx.post(sched.url + "/v1/completions", json=body, timeout=30).status_code == 200
            d = httpx.get(sched.url + "/decisions").json()[-1]
            inst = httpx.get(sched.url + "/instances").json()[0]
            if not on:
                assert "uncorrected" not in d and inst["outcome_correction"] is None
                continue
            e2e = inst["outcome_correction"]["e2e"]
            assert e2e["samples"] == 24 and e2e["applied"] is True
            assert e2e["offset_s"] + e2e["scale"] * 0.1 > 0.15  # a 0.1 s prediction served as ≥ 1.5× it
            raw, used = d["uncorrected"]["0"]["e2e_s"], d["predictions"]["0"]["e2e_s"]
            assert used > 1.5 * raw
            assert d["observed_e2e_s"] / 0.05 > 1.5 * raw  # what it was corrected towards


def test_in_process_predictor_calibrates_from_the_status_poll(tmp_path):
    """`predict_in_process`: no sidecar fetches `/status?steps_since=`, so the scheduler's
    own status poll asks for the steps and feeds them to its in-process Predictor, which
    refits toward the engine it was not given (every term 1.6×): its shape scale moves
    from 1 to about 1.6."""
    nominal_path = write_profile(tmp_path, NOMINAL, "nominal.json")
    with ExitStack() as st:
        eng = st.enter_context(ServerThread(sim_server.create_app(SimEngine(SLOW, time_scale=0.02))))
        sched = st.enter_context(ServerThread(create_app(SchedulerSettings(
            instances=(InstanceEndpoint("engine-0", eng.url, None, nominal_path),), policy="power_of_k",
            served_models=(NOMINAL.model,), predict_deadline_s=2.0, status_interval_s=0.05,
            predict_in_process=True))))
        body = {"model": NOMINAL.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        assert httpx.post(sched.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200
        _traffic(eng.url, 24)
        deadline = time.monotonic() + 10
        while True:  # the next polls carry the steps
            cal = httpx.get(sched.url + "/instances").json()[0]["calibration"]
            if cal and cal["refits"] > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert cal is not None and cal["samples"] > 32 and cal["refits"] > 0
        assert cal["scales"]["shape"] == pytest.approx(1.6, rel=0.15)
