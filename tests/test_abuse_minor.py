"""Minor findings of the abuse review, one test (or two) per finding, each failing on the
code before its fix:

1. a lone surrogate (`"\\ud800"`) or a 5,000-digit integer in a body → 400 naming the
   field or `body` (was a 500 with a traceback) on the engine, scheduler, tagger, Predictor;
2. a client that drops during the body read → one log line (was an ERROR traceback);
3. no `/openapi.json` on any service (it answered without the key);
4. `--api-key` on a command line → a one-line warning pointing to ASTRO_API_KEY;
5. cluster.json names the restarted child's pid (kept the dead one's);
6. the restart budget counts restarts within a window (was over the cluster's life);
7. `astro serve` refuses to overwrite a live cluster's cluster.json;
8. a busy scheduler `--port` is one line naming the port and the fix (was the child's
   whole command line);
9. token ids outside the vocabulary in a completions `prompt` → 400 naming `prompt`.

Servers run in-process on loopback threads; supervisor tests use fake children (`sh`
one-liners), never a whole cluster."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from conftest import write_profile
from rps_astro_cli.engine import sim_server
from rps_astro_cli.engine.sim_engine import SimEngine
from rps_astro_cli.protocol.openai import decode_json_body, parse_completion_request
from rps_astro_cli.protocol.openai_types import ApiError
from rps_astro_cli.services import cluster as cluster_mod
from rps_astro_cli.services import predictor as pred_mod
from rps_astro_cli.services import tagger as tag_mod
from rps_astro_cli.services.cluster import Child, ClusterError, ClusterSupervisor
from rps_astro_cli.services.config import ClusterConfig
from rps_astro_cli.services.http_common import HTTPUserError, parse_json_object
from rps_astro_cli.tokens import count_tokens_fallback, token_ids_fallback
from test_services_scheduler import MODEL, engine_app, hand_profile, scheduler, start

DATA = Path(__file__).parent / "data"
JSON = {"content-type": "application/json"}
LONE = b"a\\ud800b"  # the JSON text of a string holding a lone high surrogate
BIG = b"1" + b"0" * 5000  # Python refuses int() of more than 4300 digits


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """name → (base URL, chat path, completions path) of each OpenAI-shaped server, plus
    the Predictor's URL under "predictor"."""
    d = tmp_path_factory.mktemp("minor")
    lm = d / "len.json"
    lm.write_text(json.dumps({"kind": "bin_median", "edges_tokens": [], "median_output_tokens": [40]}))
    with ExitStack() as st:
        eng = start(st, engine_app(0, time_scale=0.01))
        tag = start(st, tag_mod.create_app(tag_mod.TaggerSettings(length_model=str(lm))))
        sched = scheduler(st, [eng.url], policy="round_robin", length_model=str(lm), served_models=(MODEL,))
        pred = start(st, pred_mod.create_app(pred_mod.PredictorSettings(eng.url, profile=write_profile(
            d, hand_profile()))))
        yield {"engine": (eng.url, "/v1/chat/completions", "/v1/completions"),
               "scheduler": (sched.url, "/v1/chat/completions", "/v1/completions"),
               "tagger": (tag.url, "/tag", "/tag"),
               "predictor": (pred.url, "/predict", "/predict")}


def _err(r: httpx.Response) -> dict:
    assert set(r.json()) == {"error"}, r.text
    err = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    return err


# -- 1. lone surrogates and over-long integers -------------------------------------------
@pytest.mark.parametrize("name", ["engine", "scheduler", "tagger"])
def test_lone_surrogate_and_huge_integer_are_400_naming_the_field(servers, name):
    url, chat_path, cmpl_path = servers[name]
    cases = [
        (chat_path, b'{"model": "hand/model", "messages": [{"role": "user", "content": "' + LONE + b'"}], '
                    b'"max_tokens": 4}', "messages[0].content"),
        (cmpl_path, b'{"model": "hand/model", "prompt": "' + LONE + b'", "max_tokens": 4}', "prompt"),
        (cmpl_path, b'{"model": "hand/model", "prompt": "hi", "stop": ["\\udc00"], "max_tokens": 4}', "stop[0]"),
        (cmpl_path, b'{"model": "hand/model", "prompt": "hi", "max_tokens": ' + BIG + b"}", "body"),
        (cmpl_path, b'{"model": "hand/model", "prompt": "hi", "vllm_xargs": {"x": -' + BIG + b"}}", "body"),
    ]
    with httpx.Client(timeout=10) as c:
        for path, raw, param in cases:
            r = c.post(url + path, content=raw, headers=JSON)
            assert r.status_code == 400, (param, r.status_code, r.text[:300])
            err = _err(r)
            assert err["param"] == param and err["code"] == 400 and err["type"] == "invalid_request_error", err
            assert param in err["message"], err
            assert "surrogate" in err["message"] or "4300 digits" in err["message"], err
        # a surrogate pair written as escapes is one valid character (😀): served
        ok = c.post(url + cmpl_path, content=b'{"model": "hand/model", "prompt": "hi \\ud83d\\ude00", '
                    b'"max_tokens": 2}', headers=JSON)
        assert ok.status_code == 200, ok.text


def test_predictor_body_with_a_lone_surrogate_or_huge_integer_is_400(servers):
    url, path, _ = servers["predictor"]
    for raw, param in ((b'{"candidate": {"x": "' + LONE + b'"}}', "candidate.x"),
                       (b'{"candidate": ' + BIG + b"}", "body")):
        r = httpx.post(url + path, content=raw, headers=JSON, timeout=10)
        assert r.status_code == 400 and _err(r)["param"] == param, r.text[:300]


def test_the_parsers_and_the_fallback_tokenizer_on_lone_surrogates():
    for parse, exc_type in ((decode_json_body, ApiError), (parse_json_object, HTTPUserError)):
        with pytest.raises(exc_type) as ei:
            parse(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "' + LONE + b'"}]}]}')
        assert ei.value.param == "messages[0].content[0].text"
        with pytest.raises(exc_type) as ei:  # a key, and the raw UTF-8-style bytes of a surrogate
            parse(b'{"vllm_xargs": {"\xed\xa0\x80": 1}}')
        assert ei.value.param == "vllm_xargs"
        with pytest.raises(exc_type) as ei:
            parse(b'{"n": ' + BIG + b"}")
        assert ei.value.param == "body"
        assert parse(b'{"prompt": "\\\\ud800 is text here"}') == {"prompt": "\\ud800 is text here"}
    # a counter never fails on such text (it can come from data files): one symbol
    text = "a\ud800b"
    assert count_tokens_fallback(text) == 3 == len(token_ids_fallback(text))
    assert token_ids_fallback("ab cd") == token_ids_fallback("ab cd\ud800")[:2]


# -- 2. a client that drops during the body ---------------------------------------------
def _drop_mid_body(url: str, path: str) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  "Content-Length: 1000\r\n\r\n".encode() + b'{"prompt": ')
        time.sleep(0.1)


@pytest.mark.parametrize("name", ["engine", "scheduler", "tagger", "predictor"])
def test_a_client_dropping_mid_body_is_one_log_line(servers, name, caplog):
    url, _, path = servers[name]
    uvicorn_log = logging.getLogger("uvicorn.error")  # does not propagate to the root logger
    uvicorn_log.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO):
            _drop_mid_body(url, path)
            deadline = time.monotonic() + 5
            while not any("disconnect" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
                time.sleep(0.02)
            time.sleep(0.2)  # whatever else the drop logs
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    # no traceback, no ERROR (a loaded host's unrelated warnings, e.g. a slow health check, may come)
    assert not [r.getMessage() for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    recs = [r for r in caplog.records if "disconnect" in r.getMessage()]
    assert len(recs) == 1, [r.getMessage() for r in recs]
    msg = recs[0].getMessage()
    assert recs[0].levelno == logging.WARNING and "\n" not in msg
    assert "client disconnected" in msg and path in msg, msg
    with httpx.Client(timeout=10) as c:  # and the server goes on
        assert c.get(url + "/health").status_code == 200


# -- 3. no OpenAPI document -------------------------------------------------------------
@pytest.mark.parametrize("name", ["engine", "scheduler", "tagger", "predictor"])
def test_no_openapi_document(servers, name):
    url = servers[name][0]
    with httpx.Client(timeout=10) as c:
        for path in ("/openapi.json", "/docs", "/redoc"):
            r = c.get(url + path)
            assert r.status_code == 404, (path, r.status_code)


# -- 4. --api-key on a command line -----------------------------------------------------
@pytest.mark.parametrize("command,rest", [
    (["serve", "predictor"], ["--engine-url", "http://127.0.0.1:9", "--status-cache-ms", "-1"]),
    (["serve", "engine"], ["--backend", "no-such-backend"]),
    (["serve"], ["--instances", "0"]),  # the whole cluster
])
def test_api_key_from_the_command_line_warns_once_on_stderr(command, rest):
    from rps_astro_cli.cli.main import app

    warning = "--api-key on the command line is visible"
    argv = [*command, *rest]  # each a user error found after the options are parsed
    flag = CliRunner().invoke(app, [*command, "--api-key", "sekret", *rest], env={"ASTRO_API_KEY": ""})
    assert flag.exit_code == 2, flag.output
    lines = [ln for ln in flag.stderr.splitlines() if warning in ln]
    assert len(lines) == 1 and "ASTRO_API_KEY" in lines[0], flag.stderr
    assert "sekret" not in flag.stderr
    env = CliRunner().invoke(app, argv, env={"ASTRO_API_KEY": "sekret"})
    assert env.exit_code == 2 and warning not in env.stderr, env.stderr


# -- supervisor fakes -------------------------------------------------------------------
def _fake(sup: ClusterSupervisor, name: str, script: str) -> Child:
    """A child whose every launch runs `sh -c script` (no astro process)."""
    c = sup._child(name, "engine", [])
    c.url = "http://127.0.0.1:9"

    def launch() -> None:
        c.proc = subprocess.Popen(["sh", "-c", script], stdin=subprocess.DEVNULL)

    c.launch = launch  # type: ignore[method-assign]
    return c


def _supervisor(tmp_path: Path, **kw) -> ClusterSupervisor:
    cfg = ClusterConfig(instances=1, **kw.pop("cfg", {}))
    return ClusterSupervisor(cfg, tmp_path / "run", tmp_path / "cluster.json", report=kw.pop("report", print), **kw)


# -- 5. cluster.json after a restart ----------------------------------------------------
def test_cluster_json_names_the_restarted_childs_pid(tmp_path):
    sup = _supervisor(tmp_path)
    c = _fake(sup, "engine-0", "exec sleep 30")
    sup.engines = [c]
    try:
        c.launch()
        sup.run_dir.mkdir(parents=True)
        sup.created_unix_s = time.time()
        for p in (tmp_path / "cluster.json", sup.run_dir / "cluster.json"):
            p.write_text(json.dumps(sup.describe()))
        dead = c.pid
        assert json.loads((tmp_path / "cluster.json").read_text())["instances"][0]["engine_pid"] == dead
        os.kill(dead, signal.SIGKILL)
        c.proc.wait(10)
        sup.poll_once()
        assert c.pid is not None and c.pid != dead
        for p in (tmp_path / "cluster.json", sup.run_dir / "cluster.json"):
            info = json.loads(p.read_text())
            assert info["instances"][0]["engine_pid"] == c.pid, p
    finally:
        sup.stop(grace_s=2)


# -- 6. the restart budget's window -----------------------------------------------------
def test_restart_budget_counts_restarts_within_the_window(tmp_path):
    now = [0.0]
    lines: list[str] = []
    sup = _supervisor(tmp_path, cfg={"restart_crashed": 3}, report=lines.append)
    sup.restart_window_s, sup.clock = 60.0, lambda: now[0]  # the default window; a fake clock
    c = _fake(sup, "engine-0", "exit 3")
    sup.engines = [c]

    def crash_at(t: float) -> bool:
        """The child crashes at engine time t; whether it was restarted."""
        assert c.proc is not None
        c.proc.wait(10)
        now[0] = t
        sup.poll_once()
        return c.proc is not None

    c.launch()
    assert [crash_at(t) for t in (0.0, 10.0, 20.0)] == [True, True, True]
    # at 70 s the restart at 0 s is older than the window: forgiven, so restarted (was: budget spent)
    assert crash_at(70.0)
    assert crash_at(75.0)  # restarts at 20, 70, 75 s: three within 60 s
    assert not crash_at(76.0)  # 20, 70, 75 are within 60 s of 76: budget spent
    assert c.restarts == 5
    assert "(3/3 in 60 s)" in lines[-2] and "not restarting (restart budget 3 in 60 s spent)" in lines[-1], lines


# -- 7. a live cluster's cluster.json ---------------------------------------------------
@pytest.fixture()
def no_launch(monkeypatch):
    """Any real child launch fails the test at once (the refusals come before them)."""
    def boom(self):
        raise RuntimeError(f"{self.name} was launched")

    monkeypatch.setattr(cluster_mod.Child, "launch", boom)


def test_refuses_to_overwrite_a_live_clusters_json(tmp_path, no_launch):
    # a live process whose command line names rps_astro_cli, as every child of astro serve does
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "rps_astro_cli"])
    other = subprocess.Popen(["sleep", "60"])  # alive, but not astro's: a reused pid
    dead = subprocess.Popen(["true"])
    dead.wait(10)
    try:
        cj = tmp_path / "cluster.json"
        stale = {"scheduler": {"pid": dead.pid}, "tagger": {"pid": other.pid},
                 "instances": [{"engine_pid": dead.pid, "predictor_pid": None}]}
        cj.write_text(json.dumps({**stale, "instances": [{"engine_pid": live.pid, "predictor_pid": None}]}))
        sup = _supervisor(tmp_path)
        with pytest.raises(ClusterError) as ei:
            sup.start()
        msg = str(ei.value)
        assert "\n" not in msg and str(cj) in msg and str(live.pid) in msg and "--cluster-json" in msg, msg
        assert json.loads(cj.read_text())["instances"][0]["engine_pid"] == live.pid  # untouched
        from rps_astro_cli.cli.main import app

        res = CliRunner().invoke(app, ["serve", "--cluster-json", str(cj), "--run-dir", str(tmp_path / "r")])
        assert res.exit_code == 1
        err = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(err) == 1 and err[0].startswith("error:") and str(cj) in res.stderr, res.stderr
        assert cluster_mod.live_cluster_pid(cj) == live.pid
        cj.write_text(json.dumps(stale))  # dead pids, or a live one that is not astro's: no live cluster
        assert cluster_mod.live_cluster_pid(cj) is None
    finally:
        for p in (live, other):
            p.kill()
            p.wait(10)


# -- 8. a busy scheduler port -----------------------------------------------------------
def test_busy_scheduler_port_is_one_line_naming_the_port(tmp_path, no_launch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        sup = _supervisor(tmp_path, cfg={"scheduler": {"port": port}})
        with pytest.raises(ClusterError) as ei:
            sup.start()
        msg = str(ei.value)
        assert "\n" not in msg and f"port {port}" in msg and "--port" in msg and "0 = any free port" in msg, msg
        assert "rps_astro_cli.cli.main" not in msg
        from rps_astro_cli.cli.main import app

        res = CliRunner().invoke(app, ["serve", "--port", str(port), "--cluster-json", str(tmp_path / "c.json"),
                                       "--run-dir", str(tmp_path / "r")])
        assert res.exit_code == 1
        err = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(err) == 1 and f"port {port}" in err[0], res.stderr


def test_a_child_that_cannot_bind_is_one_line_without_its_command_line(tmp_path):
    """The race the pre-check cannot close: the port is taken between check and launch."""
    sup = _supervisor(tmp_path)
    sup.run_dir.mkdir(parents=True)
    c = _fake(sup, "scheduler", "exit 2")
    c.log_path.write_text("\n--- start 10:00:00: /usr/bin/python -m rps_astro_cli.cli.main serve scheduler "
                          "--engine http://127.0.0.1:1 --port 8000\n"
                          "error: --port: cannot listen on 127.0.0.1:8000: Address already in use (pick a free "
                          "port or 0 for any)\n")
    c.launch()
    with pytest.raises(ClusterError) as ei:
        sup._wait_ready([c], 10)
    msg = str(ei.value)
    assert "\n" not in msg and "127.0.0.1:8000" in msg and "Address already in use" in msg, msg
    assert "rps_astro_cli.cli.main" not in msg


# -- 9. token ids outside the vocabulary ------------------------------------------------
def test_token_ids_outside_the_vocabulary_are_refused():
    for ids in ([-1], [5, -3], [2**62], [2**32]):
        with pytest.raises(ApiError) as ei:
            parse_completion_request({"prompt": ids})
        assert ei.value.status_code == 400 and ei.value.param == "prompt", ids
        assert "out of vocabulary" in ei.value.message
    # the fallback tokenizer's ids are CRC-32s: all of [0, 2**32) are its ids
    assert parse_completion_request({"prompt": [0, 2**31, 2**32 - 1]}).text_tokens == 3
    assert parse_completion_request({"prompt": [[99]]}, vocab_size=100).text_tokens == 1
    with pytest.raises(ApiError):
        parse_completion_request({"prompt": [[100]]}, vocab_size=100)


@pytest.mark.parametrize("name", ["engine", "scheduler", "tagger"])
def test_servers_refuse_out_of_vocabulary_prompt_ids(servers, name):
    url, _, path = servers[name]
    with httpx.Client(timeout=10) as c:
        for ids in ([-1, 5], [2**62]):
            r = c.post(url + path, json={"model": MODEL, "prompt": ids, "max_tokens": 2})
            assert r.status_code == 400 and _err(r)["param"] == "prompt", r.text
        assert c.post(url + path, json={"model": MODEL, "prompt": [7, 2**32 - 1], "max_tokens": 2}).status_code == 200


def test_engine_with_a_tokenizer_refuses_ids_past_its_vocabulary():
    pytest.importorskip("tokenizers")
    from rps_astro_cli.tokens import load_codec, load_counter

    tok = DATA / "tiny_llama_tokenizer.json"
    codec = load_codec(tok)
    assert codec.vocab_size == 618  # the entries of its tokenizer.json's vocab
    app = sim_server.create_app(SimEngine(hand_profile(), time_scale=0.01, instance_id="e", seed=0),
                                counter=load_counter(tok), codec=codec)
    with ExitStack() as st:
        eng = start(st, app)
        with httpx.Client(timeout=10) as c:
            r = c.post(eng.url + "/v1/completions", json={"model": MODEL, "prompt": [1, 618], "max_tokens": 2})
            assert r.status_code == 400 and _err(r)["param"] == "prompt" and "617" in _err(r)["message"], r.text
            ok = c.post(eng.url + "/v1/completions", json={"model": MODEL, "prompt": [1, 617], "max_tokens": 2})
            assert ok.status_code == 200, ok.text
