"""Service parts without a cluster: recipes, the baseline length model, the tagger and
the Predictor (against a fake engine `/status` with a hand-made profile)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from conftest import linear_profile, write_profile
from rps_astro_cli.data_paths import RECIPES_DIR
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.length.bin_median import BASELINE_PATH, BinMedianLengthModel, evaluate, fit
from rps_astro_cli.protocol.http_server import ServerThread
from rps_astro_cli.protocol.service_wire import TagResult
from rps_astro_cli.services import predictor as pred_mod
from rps_astro_cli.services.config import ClusterConfig, load_recipe, parse_config, with_overrides
from rps_astro_cli.services.tagger import Tagger, TaggerSettings
from rps_astro_cli.services.tagger import create_app as tagger_app
from rps_astro_cli.sim.profile import ExecutionProfile
from rps_astro_cli.types import InstanceConfig, InstanceStatus, RequestStatus


# -- recipes -------------------------------------------------------------------------
def test_recipe_defaults_and_policy_params():
    cfg = parse_config({"instances": 3, "scheduler": {"k": "all", "objective": "ttft"}})
    assert cfg.instances == 3 and cfg.host == "127.0.0.1"
    assert cfg.scheduler.policy_params() == {"k": "all", "objective": "ttft"}
    assert parse_config({"scheduler": {"policy": "llumnix"}}).scheduler.policy_params() == {"variant": "astrolabe"}


@pytest.mark.parametrize("data, field", [
    ({"scheduler": {"k": 0}}, "scheduler.k"),
    ({"scheduler": {"k": "some"}}, "scheduler.k"),
    ({"scheduler": {"polcy": "random"}}, "scheduler.polcy"),
    ({"scheduler": {"policy": "nope"}}, "scheduler.policy"),
    ({"instances": 0}, "instances"),
    ({"engine": {"time_scale": 0}}, "engine.time_scale"),
    ({"predictor": {"enabled": False}}, "predictor.enabled"),
])
def test_recipe_errors_name_the_field(data, field):
    with pytest.raises(AstroUserError) as ei:
        parse_config(data)
    assert ei.value.field == field
    assert field in str(ei.value)


def test_shipped_recipe_loads_and_overrides_apply():
    cfg = load_recipe(RECIPES_DIR / "astrolabe-llama2-7b-a30.yaml")
    assert cfg.instances == 12
    assert cfg.engine.profile == "llama-2-7b-a30" and cfg.engine.max_num_seqs == 48
    assert cfg.engine.num_gpu_blocks == 1056 and cfg.engine.max_num_batched_tokens == 512
    assert cfg.scheduler.policy == "power_of_k" and cfg.scheduler.k == 2
    out = with_overrides(cfg, {"instances": 4, "scheduler.k": "all", "engine.time_scale": None})
    assert out.instances == 4 and out.scheduler.k == "all" and out.engine.time_scale == cfg.engine.time_scale
    with pytest.raises(AstroUserError, match="--recipe"):
        load_recipe("no-such-recipe")


def test_recipe_k_above_instances_names_both_values():
    with pytest.raises(AstroUserError) as ei:
        parse_config({"instances": 2, "scheduler": {"k": 5}}, "r.yaml")
    assert ei.value.field == "scheduler.k"
    assert "scheduler.k 5 is more than instances 2" in str(ei.value)
    assert parse_config({"instances": 2, "scheduler": {"k": 2}}).scheduler.k == 2
    assert parse_config({"instances": 2, "scheduler": {"k": "all"}}).scheduler.k == "all"
    assert parse_config({"instances": 64, "scheduler": {"k": "auto"}}).scheduler.k == "auto"
    # the default k ('auto': every instance's Predictor up to 8, else the 8 least loaded)
    # fits any cluster size
    one = parse_config({"instances": 1})
    assert one.scheduler.k == "auto"
    assert with_overrides(one, {"instances": 3}).scheduler.k == "auto"


def test_recipe_yaml_errors_are_one_line_with_position(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("instances: 2\nscheduler: x: y\n")
    with pytest.raises(AstroUserError) as ei:
        load_recipe(bad)
    msg = str(ei.value)
    assert "\n" not in msg and str(bad) in msg and "line 2, column 13" in msg
    assert "unicode string" not in msg
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here\n\n")
    with pytest.raises(AstroUserError, match="is empty") as ei:
        load_recipe(empty)
    assert ei.value.field == "--recipe" and str(empty) in str(ei.value)


def test_default_config_is_valid():
    assert ClusterConfig().scheduler.k == "auto" and ClusterConfig().scheduler.objective == "ttft"


# -- baseline length model -------------------------------------------------------------
def test_bin_median_predicts_by_bin():
    m = BinMedianLengthModel(edges_tokens=(10, 100), median_output_tokens=(50, 200, 400), max_output_tokens=300)
    assert [m.predict_tokens(p) for p in (1, 10, 11, 100, 101, 10_000)] == [50, 50, 200, 200, 300, 300]


def test_fit_and_evaluate_by_hand():
    pairs = [(1, 10), (2, 20), (3, 30), (10, 100), (11, 110), (12, 120)]
    m = fit(pairs, n_bins=2)
    # median prompt of [1,2,3,10,11,12] = 6.5 → edge 6; bin 0 replies 10,20,30 → 20; bin 1 → 110
    assert m.edges_tokens == (6,) and m.median_output_tokens == (20, 110)
    ev = evaluate(m, pairs)
    assert ev["mae_tokens"] == pytest.approx((10 + 0 + 10 + 10 + 0 + 10) / 6)


def test_shipped_baseline_artifact_loads_with_metrics():
    d = json.loads(Path(BASELINE_PATH).read_text())
    assert d["kind"] == "bin_median" and d["metrics"]["held_out"]["n"] > 0
    m = BinMedianLengthModel.load()
    assert m.predict_tokens(5) == d["median_output_tokens"][0]


def test_corrupt_length_model_is_named(tmp_path):
    p = tmp_path / "model.json"
    p.write_text('{"kind": "bin_median", "edges_tokens": [1]}')
    with pytest.raises(AstroUserError, match="length_model"):
        BinMedianLengthModel.load(p)


# -- tagger ----------------------------------------------------------------------------
@pytest.fixture()
def hand_model(tmp_path) -> str:
    p = tmp_path / "model.json"
    p.write_text(json.dumps({"kind": "bin_median", "edges_tokens": [10], "median_output_tokens": [77, 500]}))
    return str(p)


def test_tagger_counts_and_predicts(hand_model):
    t = Tagger(TaggerSettings(length_model=hand_model))
    # chat: primer 3 + per message 3 + "user" 1 + "hello world" (2 + 2) = 11 tokens → bin 1
    out = t.tag({"messages": [{"role": "user", "content": "hello world"}]})
    assert out["prompt_tokens"] == 11 and out["predicted_output_tokens"] == 500
    assert out["modality"] == "text" and out["vision_tokens"] == 0
    # completions: "hi" = 1 token → bin 0
    assert t.tag({"prompt": "hi"})["predicted_output_tokens"] == 77


class RecordingLengthModel:
    """A stand-in LengthModel: records which method the tagger called and with what."""

    def __init__(self):
        self.calls: list[tuple[str, list]] = []

    def predict_chats(self, chats):
        self.calls.append(("predict_chats", list(chats)))
        return [123]

    def predict(self, prompts):
        self.calls.append(("predict", list(prompts)))
        return [45]


def test_tagger_predicts_chats_with_predict_chats_and_prompts_with_predict(monkeypatch):
    import rps_astro_cli.length as length_pkg

    fake = RecordingLengthModel()
    monkeypatch.setattr(length_pkg, "load_length_model", lambda spec: fake)
    t = Tagger(TaggerSettings(length_model="fake-model"))
    messages = [{"role": "user", "content": "first question"}, {"role": "assistant", "content": "an answer"},
                {"role": "user", "content": "follow-up"}]
    out = t.tag({"messages": messages})
    # the whole conversation goes to predict_chats (the model adds its trained context turns)
    assert fake.calls == [("predict_chats", [messages])] and out["predicted_output_tokens"] == 123
    fake.calls.clear()
    assert t.tag({"prompt": "a completion prompt"})["predicted_output_tokens"] == 45
    assert fake.calls == [("predict", ["a completion prompt"])]


def test_tagger_returns_quantiles_from_the_models_calibration(monkeypatch, hand_model):
    import math

    import rps_astro_cli.length as length_pkg
    from rps_astro_cli.length.dist import LogSpreadCalibration

    fake = RecordingLengthModel()
    # one bin: q10 = point / 2, q50 = point, q90 = 2 × point
    fake.calibration = LogSpreadCalibration((0.1, 0.5, 0.9), (), ((math.log(0.5), 0.0, math.log(2.0)),), (0.5,))
    monkeypatch.setattr(length_pkg, "load_length_model", lambda spec: fake)
    with TestClient(tagger_app(TaggerSettings(length_model="fake-model"))) as c:
        out = c.post("/tag", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert out["predicted_output_tokens"] == 123
    assert (out["p10_output_tokens"], out["p50_output_tokens"], out["p90_output_tokens"]) == (61.5, 123.0, 246.0)
    assert TagResult.from_dict(out).quantiles == {"p10": 61.5, "p50": 123.0, "p90": 246.0}
    # a model without a calibration (the bin-median baseline): no quantile keys
    plain = Tagger(TaggerSettings(length_model=hand_model)).tag({"prompt": "hi"})
    assert "p50_output_tokens" not in plain and TagResult.from_dict(plain).quantiles is None


def test_tagger_default_falls_back_to_baseline(monkeypatch):
    import rps_astro_cli.length as length_pkg
    from rps_astro_cli.length.resolve import resolve_length_model

    def missing():
        raise AstroUserError("no artifact", field="length_model")

    monkeypatch.setattr(length_pkg, "default_length_model", missing)
    name, predict = resolve_length_model(None)
    base = BinMedianLengthModel.load()
    assert name == "baseline" and predict("anything", 5) == base.predict_tokens(5)
    assert resolve_length_model("baseline")[0] == "baseline"


def test_tagger_http_errors_name_field(hand_model):
    with TestClient(tagger_app(TaggerSettings(length_model=hand_model, max_body_bytes=200))) as c:
        r = c.post("/tag", content=b"{nope")
        assert r.status_code == 400 and r.json()["error"]["param"] == "body"
        r = c.post("/tag", json={"messages": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = c.post("/tag", json={"prompt": "x" * 500})
        assert r.status_code == 413
        r = c.post("/tag", json={"prompt": "hello"})
        assert r.status_code == 200 and r.json()["predicted_output_tokens"] == 77
        assert "astro:tagger_requests_total" in c.get("/metrics").text
        r = c.get("/nope")
        assert r.status_code == 404 and r.json()["error"]["code"] == 404 and "/nope" in r.json()["error"]["message"]
        r = c.get("/tag")
        assert r.status_code == 405 and r.json()["error"]["type"] and "detail" not in r.json()


# -- predictor -------------------------------------------------------------------------
def hand_profile() -> ExecutionProfile:
    """step = 10 ms + 0.1 ms per token (no attention terms)."""
    return linear_profile(model="hand/model", gpu="none", num_gpu_blocks=64, max_model_len=1024)


LIMITS = InstanceConfig(block_size=16, num_gpu_blocks=64, max_num_seqs=4, max_num_batched_tokens=512,
                        max_model_len=1024)
# One running request (100-token prompt computed, 1 of 3 predicted tokens generated).
STATUS = InstanceStatus("e0", 5.0, LIMITS, 57, running=(RequestStatus("r1", 4.0, 100, 100, 1, 3, kv_blocks=7),),
                        profile_id="hand")


class FakeEngine:
    """A `/status` endpoint that counts its fetches."""

    def __init__(self, snapshot: InstanceStatus):
        self.fetches = 0
        self.app = FastAPI()

        @self.app.get("/status")
        def status():
            self.fetches += 1
            return snapshot.to_dict()


@pytest.fixture()
def profile_path(tmp_path) -> str:
    return write_profile(tmp_path, hand_profile())


def test_predictor_by_hand(profile_path):
    """Candidate 100-token prompt, 3 output tokens, beside r1:
    step 1: r1 decode + candidate prefill 100 → 101 tokens → 10 + 10.1 ms = 20.1 ms (TTFT);
    step 2: two decodes → 10.2 ms (r1 ends at its predicted 3); step 3: one decode → 10.1 ms.
    E2E = 20.1 + 10.2 + 10.1 = 40.4 ms."""
    p = pred_mod.Predictor(pred_mod.PredictorSettings("http://unused", profile=profile_path))
    q = pred_mod.parse_predict({"prompt_tokens": 100, "predicted_output_tokens": 3})
    est = p.predict(STATUS, q.candidate)
    assert q.objective == "e2e"
    assert est.ttft_s == pytest.approx(0.0201) and est.e2e_s == pytest.approx(0.0404)


@pytest.mark.parametrize("body, field", [
    ({"predicted_output_tokens": 3}, "prompt_tokens"),
    ({"prompt_tokens": 0, "predicted_output_tokens": 3}, "prompt_tokens"),
    ({"prompt_tokens": 5, "predicted_output_tokens": "3"}, "predicted_output_tokens"),
    ({"prompt_tokens": 5, "predicted_output_tokens": 3, "modality": "audio"}, "modality"),
    ({"prompt_tokens": 5, "predicted_output_tokens": 3, "objective": "cost"}, "objective"),
    ({"prompt_tokens": 5, "predicted_output_tokens": 3, "encoder_s": -1}, "encoder_s"),
    ({"prompt_tokens": 5, "predicted_output_tokens": 3, "first_token_only": "yes"}, "first_token_only"),
])
def test_predict_bad_candidate_names_field(body, field):
    with pytest.raises(pred_mod.HTTPUserError) as ei:
        pred_mod.parse_predict(body)
    assert ei.value.param == field and ei.value.status == 400


def test_predictor_service_caches_status_and_exports_metrics(profile_path):
    fake = FakeEngine(STATUS)
    with ServerThread(fake.app) as eng:
        settings = pred_mod.PredictorSettings(eng.url, status_cache_s=30.0, profile=profile_path)
        app = pred_mod.create_app(settings)
        with TestClient(app) as c:
            body = {"prompt_tokens": 100, "predicted_output_tokens": 3, "objective": "ttft"}
            r1 = c.post("/predict", json=body).json()
            r2 = c.post("/predict", json=body).json()
            assert fake.fetches == 1  # second answer came from the 30 s cache
            assert r1["ttft_s"] == pytest.approx(0.0201) and r1["e2e_s"] == pytest.approx(0.0404)
            assert r1["objective_s"] == r1["ttft_s"] and r1["instance_id"] == "e0"
            assert r2["snapshot_age_s"] >= r1["snapshot_age_s"] >= 0
            app.state.predictor._status_at -= 31.0  # age the cached status past its 30 s
            c.post("/predict", json=body)
            assert fake.fetches == 2  # cache expired
            r = c.post("/predict", json={"prompt_tokens": 1000, "predicted_output_tokens": 100})
            assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
            m = c.get("/metrics").text
            assert 'astro:predictor_requests_total{outcome="ok"} 3.0' in m
            assert "astro:predictor_cpu_seconds_total" in m and "astro:predictor_predict_seconds_count 3.0" in m
            assert "process_cpu_seconds_total" in m
            # told the caller reads the TTFT only, the look-ahead stops at step 1 (above)
            r = c.post("/predict", json={**body, "first_token_only": True}).json()
            assert r["ttft_s"] == pytest.approx(0.0201) and r["e2e_s"] == pytest.approx(0.0201)


def test_predictor_uses_stale_status_while_refreshing(profile_path):
    fake = FakeEngine(STATUS)
    with ServerThread(fake.app) as eng:
        settings = pred_mod.PredictorSettings(eng.url, status_cache_s=30.0, status_max_age_s=100.0,
                                              profile=profile_path)
        app = pred_mod.create_app(settings)
        with TestClient(app) as c:
            body = {"prompt_tokens": 100, "predicted_output_tokens": 3}
            c.post("/predict", json=body)
            app.state.predictor._status_at -= 40.0  # stale (> 30 s) but under the 100 s bound
            r = c.post("/predict", json=body).json()
            assert r["snapshot_age_s"] >= 40.0  # answered from the stale status, without waiting
            # ... while one background fetch refreshes it (the engine counts the fetch
            # before the predictor has stored its answer: poll the answer, not the count)
            deadline = time.monotonic() + 30  # a deadline, not an expectation (loaded hosts)
            while c.post("/predict", json=body).json()["snapshot_age_s"] >= 5.0:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert fake.fetches == 2


def test_predictor_engine_down_is_503(profile_path):
    from rps_astro_cli.services.http_common import free_port

    settings = pred_mod.PredictorSettings(f"http://127.0.0.1:{free_port()}", profile=profile_path)
    with TestClient(pred_mod.create_app(settings)) as c:
        r = c.post("/predict", json={"prompt_tokens": 10, "predicted_output_tokens": 3})
        assert r.status_code == 503 and "engine status unavailable" in r.json()["error"]["message"]
        assert "Traceback" not in r.text
        r = c.post("/v1/predict", json={})
        assert r.status_code == 404 and r.json()["error"]["code"] == 404 and "detail" not in r.json()


# -- CLI -------------------------------------------------------------------------------
def test_serve_cli_errors_are_one_line_and_name_the_field(tmp_path):
    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app

    runner = CliRunner()
    r = runner.invoke(app, ["serve", "--k", "0", "--run-dir", str(tmp_path / "r")])
    assert r.exit_code == 2 and "--k 0" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["serve", "--recipe", str(tmp_path / "missing.yaml")])
    assert r.exit_code == 2 and "--recipe" in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("instances: 2\nscheduler:\n  polcy: random\n")
    r = runner.invoke(app, ["serve", "--recipe", str(bad)])
    assert r.exit_code == 2 and "scheduler.polcy" in r.output
    r = runner.invoke(app, ["serve", "--instances", "2", "--k", "5", "--run-dir", str(tmp_path / "r")])
    assert r.exit_code == 2 and "--k 5 is more than --instances 2" in r.output
    r = runner.invoke(app, ["serve", "--instances", "0", "--run-dir", str(tmp_path / "r")])
    assert r.exit_code == 2 and "--instances 0" in r.output and "pass --instances ≥ 1" in r.output
    assert "flags:" not in r.output
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    r = runner.invoke(app, ["serve", "--recipe", str(empty), "--run-dir", str(tmp_path / "r")])
    assert r.exit_code == 2 and "is empty" in r.output and len(r.output.strip().splitlines()) == 1
    badyaml = tmp_path / "badyaml.yaml"
    badyaml.write_text("instances: [2\n")
    r = runner.invoke(app, ["serve", "--recipe", str(badyaml), "--run-dir", str(tmp_path / "r")])
    assert r.exit_code == 2 and "invalid YAML at line" in r.output and len(r.output.strip().splitlines()) == 1
    r = runner.invoke(app, ["serve", "scheduler", "--engine", "http://a", "--policy", "random", "--k", "3"])
    assert r.exit_code == 2 and "--k 3" in r.output
    r = runner.invoke(app, ["serve", "scheduler", "--engine", "http://a", "--predictor", "http://p1",
                            "--predictor", "http://p2"])
    assert r.exit_code == 2 and "--predictor" in r.output
    r = runner.invoke(app, ["serve", "scheduler", "--engine", "http://a", "--policy", "power_of_k"])
    assert r.exit_code == 2 and "--predictor" in r.output and "power_of_k" in r.output
    r = runner.invoke(app, ["serve", "predictor", "--engine-url", "http://a", "--status-cache-ms", "-1"])
    assert r.exit_code == 2 and "--status-cache-ms" in r.output
    for role in ("predictor", "tagger", "scheduler"):
        assert runner.invoke(app, ["serve", role, "--help"]).exit_code == 0
    assert "--instances" in runner.invoke(app, ["serve", "--help"]).output


def test_prefix_caching_can_be_turned_off_on_every_engine_path(tmp_path):
    """`engine.enable_prefix_caching: false` → `astro serve engine --no-enable-prefix-caching`
    → a sim engine without a prefix cache, and vLLM's own flag for the vllm backend."""
    from rps_astro_cli.engine.backends import EngineOptions, build_sim_engine
    from rps_astro_cli.engine.vllm_backend import vllm_args_from_options
    from rps_astro_cli.services.cluster import ClusterSupervisor

    cfg = parse_config({"instances": 1, "engine": {"enable_prefix_caching": False}})
    assert "--no-enable-prefix-caching" in ClusterSupervisor(cfg, tmp_path)._engine_argv(0)
    default = ClusterSupervisor(parse_config({"instances": 1}), tmp_path)._engine_argv(0)
    assert "--no-enable-prefix-caching" not in default
    off = build_sim_engine(EngineOptions(profile="llama-2-7b-a30", enable_prefix_caching=False))
    on = build_sim_engine(EngineOptions(profile="llama-2-7b-a30"))
    assert off.inst.cache is None and not off.config.enable_prefix_caching and on.inst.cache is not None
    _, args = vllm_args_from_options(EngineOptions(profile="llama-2-7b-a30", enable_prefix_caching=False),
                                     ["--model", "m"])
    assert "--no-enable-prefix-caching" in args
