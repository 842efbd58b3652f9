"""Access (issue 11): the cluster's internal services answer only callers with its token.

In-process servers on loopback threads (`ServerThread`), short timeouts everywhere."""

from __future__ import annotations

import json
from contextlib import ExitStack

import httpx
import pytest
from typer.testing import CliRunner

from conftest import prom_sum, write_profile
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.protocol import internal_auth as ia
from rps_astro_cli.services import predictor as pred_mod
from rps_astro_cli.services import tagger as tag_mod
from test_services_scheduler import MODEL, chat, engine_app, hand_profile, scheduler, start

TOKEN = "t0k3n-for-tests"


@pytest.fixture()
def length_model(tmp_path) -> str:
    p = tmp_path / "len.json"
    p.write_text(json.dumps({"kind": "bin_median", "edges_tokens": [], "median_output_tokens": [40]}))
    return str(p)


def test_token_comes_from_env_or_file_never_empty(tmp_path):
    assert ia.internal_token({}) is None
    assert ia.internal_token({ia.TOKEN_ENV: " abc \n"}) == "abc"
    f = tmp_path / "tok"
    f.write_text("from-file\nsecond line ignored\n")
    assert ia.internal_token({ia.TOKEN_FILE_ENV: str(f)}) == "from-file"
    assert ia.internal_token({ia.TOKEN_ENV: "env-wins", ia.TOKEN_FILE_ENV: str(f)}) == "env-wins"
    with pytest.raises(AstroUserError, match="cannot read"):
        ia.internal_token({ia.TOKEN_FILE_ENV: str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(AstroUserError, match="is empty"):
        ia.internal_token({ia.TOKEN_FILE_ENV: str(tmp_path / "empty")})
    a, b = ia.new_token(), ia.new_token()
    assert a != b and len(a) >= 40


@pytest.mark.parametrize("host,loop", [("127.0.0.1", True), ("127.0.0.5", True), ("::1", True),
                                       ("localhost", True), ("0.0.0.0", False), ("::", False),
                                       ("10.1.2.3", False), ("example.org", False)])
def test_loopback_or_not(host, loop):
    assert ia.is_loopback(host) is loop
    assert (ia.exposure_warning(host, "engine", False, "$X") is None) is loop
    assert ia.exposure_warning(host, "engine", True, "$X") is None  # keyed: no warning


def test_non_loopback_bind_without_a_key_warns(capsys):
    from rps_astro_cli.services.http_common import warn_exposed

    warn_exposed("0.0.0.0", "predictor", None)
    err = capsys.readouterr().err
    assert "predictor listens on 0.0.0.0 without" in err and ia.TOKEN_ENV in err
    warn_exposed("0.0.0.0", "predictor", "k")
    warn_exposed("127.0.0.1", "tagger", None)
    assert capsys.readouterr().err == ""


def test_internal_services_refuse_callers_without_the_token(tmp_path, length_model):
    prof = write_profile(tmp_path, hand_profile())
    with ExitStack() as st:
        eng = start(st, ia.guard(engine_app(0), TOKEN))
        pred = start(st, ia.guard(pred_mod.create_app(pred_mod.PredictorSettings(
            eng.url, profile=prof, internal_token=TOKEN)), TOKEN))
        tag = start(st, ia.guard(tag_mod.create_app(tag_mod.TaggerSettings(length_model=length_model)), TOKEN))
        with httpx.Client(timeout=10) as c:
            for url, method, path, body in [
                (eng.url, "GET", "/status", None), (eng.url, "GET", "/metrics", None),
                (eng.url, "GET", "/v1/models", None), (eng.url, "POST", "/v1/chat/completions", chat()),
                (pred.url, "POST", "/predict", {}), (pred.url, "GET", "/metrics", None),
                (tag.url, "POST", "/tag", chat()), (tag.url, "GET", "/metrics", None),
            ]:
                r = c.request(method, url + path, json=body)
                assert r.status_code == 401, (url, path, r.status_code)
                err = r.json()["error"]
                assert err["param"] == ia.TOKEN_HEADER and ia.TOKEN_ENV in err["message"]
                wrong = c.request(method, url + path, json=body, headers={ia.TOKEN_HEADER: TOKEN + "x"})
                assert wrong.status_code == 401
            for url in (eng.url, pred.url, tag.url):  # probes stay open (Kubernetes cannot send a Secret)
                assert c.get(url + "/health").status_code == 200
                assert c.get(url + "/ready").status_code == 200
            # with the token: the header, or a Bearer (what a Prometheus scrape config sends)
            assert c.get(eng.url + "/status", headers={ia.TOKEN_HEADER: TOKEN}).status_code == 200
            assert c.get(eng.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
            assert c.post(tag.url + "/tag", json=chat(), headers={ia.TOKEN_HEADER: TOKEN}).status_code == 200
        # the scheduler sends the token on every internal call: tag, predict, forward
        s = scheduler(st, [eng.url], [pred.url], policy="power_of_k", policy_params={"k": 1},
                      tagger_url=tag.url, internal_token=TOKEN, predict_deadline_s=2.0, tag_deadline_s=2.0,
                      served_models=(MODEL,))
        with httpx.Client(base_url=s.url, timeout=10) as c:
            r = c.post("/v1/chat/completions", json=chat())
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            dec = c.get("/decisions").json()[-1]
            assert not dec["reason"].startswith("fallback"), dec  # the Predictor answered through the token
            assert c.get("/health").json()["status"] == "ok"
        m = httpx.get(tag.url + "/metrics", headers={ia.TOKEN_HEADER: TOKEN}, timeout=5).text
        assert prom_sum(m, "astro:tagger_requests_total", outcome="ok") == 2  # ours above + the scheduler's


def test_scheduler_without_the_token_cannot_use_the_engine(length_model):
    with ExitStack() as st:
        eng = start(st, ia.guard(engine_app(0), TOKEN))
        s = scheduler(st, [eng.url], policy="round_robin", length_model=length_model, served_models=(MODEL,))
        r = httpx.post(s.url + "/v1/chat/completions", json=chat(), timeout=10)
        # not the client's 401 (its key is fine): the scheduler's misconfiguration, named
        msg = r.json()["error"]["message"]
        assert r.status_code == 502 and "refused the scheduler" in msg and ia.TOKEN_ENV in msg, msg


def test_bench_without_the_key_says_401_and_how_to_fix(length_model):
    from rps_astro_cli.cli.main import app

    with ExitStack() as st:
        eng = start(st, engine_app(0))
        s = scheduler(st, [eng.url], policy="round_robin", length_model=length_model, api_key="sekret",
                      served_models=(MODEL,))
        res = CliRunner().invoke(app, ["bench", "--no-report", "--base-url", s.url, "-n", "2",
                                       "--model", MODEL], env={"ASTRO_API_KEY": ""})
        assert res.exit_code != 0
        out = " ".join(res.output.split())
        assert "HTTP 401" in out and "--api-key" in out and "ASTRO_API_KEY" in out, out
        res = CliRunner().invoke(app, ["bench", "--no-report", "--base-url", s.url, "-n", "2",
                                       "--model", MODEL, "--api-key", "wrong"])
        assert res.exit_code != 0 and "not the server's" in " ".join(res.output.split())


def test_kubernetes_roles_read_the_token_from_a_secret():
    """Every astro container of the base gets $ASTRO_INTERNAL_TOKEN from the Secret
    astro-internal-token (never a literal, never a flag); the sim overlay generates it."""
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
    seen = []
    for f in ("engine.yaml", "scheduler.yaml", "tagger.yaml"):
        for doc in yaml.safe_load_all((root / "base" / f).read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for ctr in spec.get("containers", []) + spec.get("initContainers", []):
                env = {e["name"]: e for e in ctr.get("env", [])}
                ref = env[ia.TOKEN_ENV]["valueFrom"]["secretKeyRef"]
                assert ref == {"name": "astro-internal-token", "key": "token"}, (f, ctr["name"])
                assert not any("token" in str(a).lower() for a in ctr.get("args", []))
                seen.append(ctr["name"])
    assert sorted(seen) == ["engine", "predictor", "scheduler", "tagger"]
    sim = yaml.safe_load((root / "overlays" / "sim" / "kustomization.yaml").read_text())
    assert "astro-internal-token" in [g["name"] for g in sim["secretGenerator"]]


def test_supervisor_token_per_cluster_or_off(tmp_path):
    from rps_astro_cli.services.cluster import ClusterSupervisor
    from rps_astro_cli.services.config import parse_config

    on = [ClusterSupervisor(parse_config({"instances": 1}), tmp_path / f"r{i}") for i in range(2)]
    assert on[0].internal_token != on[1].internal_token  # a fresh token per cluster
    child = on[0]._child("engine-0", "engine", [])
    assert child.env[ia.TOKEN_ENV] == on[0].internal_token and on[0].internal_token not in child.argv
    assert on[0].describe()["internal_token_file"] == str(tmp_path / "r0" / "internal-token")
    off = ClusterSupervisor(parse_config({"instances": 1, "internal_token": False}), tmp_path / "off")
    assert off.internal_token is None and ia.TOKEN_ENV not in off._child("engine-0", "engine", []).env
    assert off.describe()["internal_token_file"] is None
