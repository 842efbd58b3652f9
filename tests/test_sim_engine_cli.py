"""`astro serve engine`: backend registry pass-through, user errors, and a real served
request from a subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from rps_astro_cli.cli.main import app
from rps_astro_cli.engine.backends import ENGINE_BACKENDS, EngineOptions, get_backend

pytestmark = pytest.mark.timeout(60)
runner = CliRunner()
SEEN: list[tuple[EngineOptions, list[str]]] = []


@ENGINE_BACKENDS.register("test-fake")
def _fake_backend(opts: EngineOptions, extra: list[str]) -> None:
    SEEN.append((opts, extra))


def test_unknown_args_pass_through_to_backend():
    res = runner.invoke(app, ["serve", "engine", "--backend", "test-fake", "--port", "0",
                              "--time-scale", "0.5", "--num-gpu-blocks", "99", "--no-chunked-prefill",
                              "--gpu-memory-utilization", "0.8", "--enforce-eager"])
    assert res.exit_code == 0, res.output
    opts, extra = SEEN[-1]
    assert extra == ["--gpu-memory-utilization", "0.8", "--enforce-eager"]
    assert (opts.port, opts.time_scale, opts.num_gpu_blocks, opts.chunked_prefill, opts.host) == \
        (0, 0.5, 99, False, "127.0.0.1")


@pytest.mark.parametrize("args,needle", [
    (["--backend", "nope"], "unknown engine backend 'nope'"),
    (["--profile", "no-such-profile"], "no profile 'no-such-profile'"),
    (["--time-scale", "0"], "--time-scale"),
    (["--instance-policy", "nope"], "unknown instance policy"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--extra-flag"], "sim backend takes no extra arguments"),
    (["--tokenizer", "/no/such/tokenizer"], "tokenizer"),
])
def test_user_errors_exit_2(args, needle):
    res = runner.invoke(app, ["serve", "engine", "--port", "0", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output


def test_backend_lookup_lists_names():
    with pytest.raises(Exception) as ei:
        get_backend("zzz")
    assert "sim" in str(ei.value)


def test_serve_engine_subprocess(tmp_path: Path):
    prof = {
        "profile_id": "tiny", "model": "tiny/model", "gpu": "none", "tp": 1,
        "coefficients": {"base_s": 0.01, "per_seq_s": 0.0, "token_knots": [0, 1000], "token_s": [0.0, 0.1],
                         "decode_attn_s_per_ctx_token": 0.0, "prefill_attn_s_per_token_pair": 0.0},
        "limits": {"block_size": 16, "num_gpu_blocks": 128, "max_num_seqs": 8,
                   "max_num_batched_tokens": 256, "max_model_len": 512},
    }
    pfile = tmp_path / "tiny.json"
    pfile.write_text(json.dumps(prof))
    ready = tmp_path / "ready.txt"
    env = dict(os.environ, ASTRO_API_KEY="k1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rps_astro_cli.cli.main", "serve", "engine", "--profile", str(pfile),
         "--port", "0", "--time-scale", "0.1", "--ready-file", str(ready), "--instance-id", "cli-1",
         "--max-num-seqs", "6"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 30
        while not (ready.exists() and ready.read_text().strip()):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        url = ready.read_text().strip()
        assert url.startswith("http://127.0.0.1:")
        hdr = {"Authorization": "Bearer k1"}
        r = httpx.post(url + "/v1/completions", headers=hdr,
                       json={"model": "tiny/model", "prompt": "abcd abcd abcd", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
        st = httpx.get(url + "/status").json()
        assert (st["instance_id"], st["profile_id"], st["limits"]["max_num_seqs"]) == ("cli-1", "tiny", 6)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert f"ready: {url}" in out
    assert "Traceback" not in out
