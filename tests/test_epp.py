"""`astro serve epp`: the Gateway API Inference Extension endpoint picker, tested with a
real gRPC client speaking Envoy's ext_proc protocol (the generated protobufs and stubs
of `xds-protos`, the `epp` extra), the way a GIE gateway drives it: one `Process` stream
per HTTP request, request headers, then the body in chunks, then the response's headers
and body.

The fleet: two real sim engines and their Predictors on 127.0.0.1. Which instance astro's
dispatch must pick is known independently: the one that is not running long streams
(more running requests → larger batches → slower steps for a new request, in the
Predictor's look-ahead as on the engine).

Without the extra these tests skip; CI installs it (.ci/run) and sets ASTRO_REQUIRE_EPP=1,
under which a missing extra fails instead.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack

import httpx
import pytest

if os.environ.get("ASTRO_REQUIRE_EPP") != "1":
    pytest.importorskip("grpc")
    pytest.importorskip("grpc_health.v1.health_pb2")
    pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

import grpc  # noqa: E402
from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc  # noqa: E402
from google.protobuf import json_format, struct_pb2  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from conftest import write_profile  # noqa: E402
from rps_astro_cli.discovery.kubernetes import KubeApi, WatchSettings  # noqa: E402
from rps_astro_cli.services import predictor as pred_mod  # noqa: E402
from rps_astro_cli.services.epp import EppSettings, EppThread, endpoint_address  # noqa: E402
from rps_astro_cli.services.scheduler import InstanceEndpoint, SchedulerSettings  # noqa: E402
from rps_astro_cli.services.scheduler.settings import DiscoverySettings  # noqa: E402
from test_discovery_kubernetes import END, NS, SERVICE, FakeApiServer, slice_list  # noqa: E402
from test_services_scheduler import MODEL, engine_app, hand_profile, start  # noqa: E402

Mode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = Mode.FULL_DUPLEX_STREAMED
DEST = "x-gateway-destination-endpoint"
RPC_S = 15.0  # deadline of one whole Process stream (every wait on it is bounded by this)


@pytest.fixture()
def length_model(tmp_path) -> str:
    """Every prompt → 40 predicted output tokens."""
    p = tmp_path / "len.json"
    p.write_text(json.dumps({"kind": "bin_median", "edges_tokens": [], "median_output_tokens": [40]}))
    return str(p)


# -- an ext_proc client, as the gateway speaks it ---------------------------------------------
class ExtProcStream:
    """One `Process` stream: `send` messages one by one, `recv` the EPP's answers (each
    wait bounded by the stream's deadline)."""

    def __init__(self, channel: grpc.Channel):
        self._q: queue.Queue = queue.Queue()
        self._responses = pb_grpc.ExternalProcessorStub(channel).Process(iter(self._q.get, None), timeout=RPC_S)

    def send(self, msg: pb.ProcessingRequest) -> None:
        self._q.put(msg)

    def recv(self) -> pb.ProcessingResponse:
        return next(self._responses)

    def close(self) -> list[pb.ProcessingResponse]:
        """End the request side; the answers still to come."""
        self._q.put(None)
        return list(self._responses)


def header_map(pairs: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()])


def request_headers(path: str = "/v1/chat/completions", method: str = "POST", eos: bool = False,
                    mode: int | None = FULL_DUPLEX, subset: list[str] | None = None,
                    extra: dict[str, str] | None = None) -> pb.ProcessingRequest:
    req = pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=header_map({":method": method, ":path": path, ":authority": "gateway", "content-type":
                            "application/json", **(extra or {})}), end_of_stream=eos))
    if mode is not None:  # Envoy sends its body modes in the first message of a stream
        req.protocol_config.CopyFrom(pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return req


def request_body(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def chat_body(content: str = "hello world", max_tokens: int = 100, **kw) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, **kw}).encode()


def set_headers(mutation: pb.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def picked(resp: pb.ProcessingResponse) -> tuple[str, str]:
    """(destination header, envoy.lb metadata value) of a headers or body response."""
    common = getattr(resp, resp.WhichOneof("response")).response
    md = json_format.MessageToDict(resp.dynamic_metadata)
    return set_headers(common.header_mutation)[DEST], md["envoy.lb"][DEST]


def immediate_error(resp: pb.ProcessingResponse) -> tuple[int, dict]:
    assert resp.WhichOneof("response") == "immediate_response", resp
    ir = resp.immediate_response
    return ir.status.code, json.loads(ir.body)["error"]


def dispatch(channel: grpc.Channel, body: bytes, chunks: int = 2, extra: dict[str, str] | None = None
             ) -> tuple[str, dict, dict]:
    """One full-duplex request through the EPP: headers, the body in `chunks` pieces; then
    the engine's response (headers, one body chunk) echoed back. Returns (picked
    endpoint, the headers set, the body the gateway forwards)."""
    s = ExtProcStream(channel)
    s.send(request_headers(extra=extra))
    step = -(-len(body) // chunks)
    for i in range(0, len(body), step):
        s.send(request_body(body[i:i + step], eos=i + step >= len(body)))
    hdr = s.recv()  # full duplex: the headers answer comes once the whole body is in
    assert hdr.WhichOneof("response") == "request_headers", hdr
    assert hdr.request_headers.response.clear_route_cache
    header, meta = picked(hdr)
    assert header == meta  # the protocol: never two different values
    got = s.recv()
    assert got.WhichOneof("response") == "request_body"
    sr = got.request_body.response.body_mutation.streamed_response
    assert sr.end_of_stream
    sent = set_headers(hdr.request_headers.response.header_mutation)
    overwrite = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD  # a client's own values are replaced
    assert all(h.append_action == overwrite for h in hdr.request_headers.response.header_mutation.set_headers)
    assert int(sent["content-length"]) == len(sr.body)
    s.send(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=header_map({":status": "200"}))))
    assert s.recv().WhichOneof("response") == "response_headers"
    s.send(pb.ProcessingRequest(response_body=pb.HttpBody(body=b'{"ok": 1}', end_of_stream=True)))
    echo = s.recv().response_body.response.body_mutation.streamed_response
    assert (echo.body, echo.end_of_stream) == (b'{"ok": 1}', True)
    assert s.close() == []
    return header, sent, json.loads(sr.body)


def load(url: str, n: int, max_tokens: int, stop: threading.Event) -> list[threading.Thread]:
    """`n` long streaming requests straight to the engine at `url`, each read until done
    or until `stop` (closing the connection aborts it on the engine)."""
    def one() -> None:
        body = {"model": MODEL, "prompt": "load " * 50, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True}
        with httpx.Client(timeout=30) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
            for _ in r.iter_bytes():
                if stop.is_set():
                    return
    ts = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in ts:
        t.start()
    return ts


def running(url: str) -> int:
    st = httpx.get(f"{url}/status", timeout=5).json()
    return len(st["running"])


def wait_for(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def fleet(st: ExitStack, tmp_path) -> tuple[list, list]:
    profile = write_profile(tmp_path, hand_profile())
    engs = [start(st, engine_app(i, time_scale=1.0)) for i in range(2)]
    preds = [start(st, pred_mod.create_app(pred_mod.PredictorSettings(e.url, profile=profile))) for e in engs]
    return engs, preds


def epp_settings(engs, preds, length_model, **kw) -> EppSettings:
    eps = tuple(InstanceEndpoint(f"engine-{i}", e.url, p.url if p else None)
                for i, (e, p) in enumerate(zip(engs, preds)))
    sched = SchedulerSettings(instances=eps, policy="power_of_k", policy_params={"k": 2, "objective": "e2e"},
                              length_model=length_model, predict_deadline_s=2.0, health_interval_s=0.05, **kw)
    return EppSettings(sched)


# -- the tests ---------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_epp_picks_the_instance_astros_dispatch_picks(length_model, tmp_path):
    with ExitStack() as st:
        engs, preds = fleet(st, tmp_path)
        addr = [endpoint_address(e.url) for e in engs]
        srv = st.enter_context(EppThread(epp_settings(engs, preds, length_model)))
        channel = st.enter_context(grpc.insecure_channel(srv.address))
        stop = threading.Event()
        st.callback(stop.set)
        wait_for(lambda: srv.call(_ready_count) == 2)

        # engine-0 runs 3 long streams, engine-1 nothing: the dispatch must pick engine-1
        load(engs[0].url, 3, 800, stop)
        wait_for(lambda: _engine_running(engs[0].url) == 3)
        # the picker's own view (its /status poll) must show them too, else both look idle
        wait_for(lambda: srv.call(_running_seen) == [3, 0])
        dest, headers, fwd = dispatch(channel, chat_body())
        assert dest == addr[1]
        assert fwd["vllm_xargs"]["astro_predicted_output_tokens"] == 40  # the tagger's length, sent on
        assert fwd["messages"][0]["content"] == "hello world"
        # now engine-1 runs 6 (more than engine-0's 3): the dispatch must pick engine-0
        load(engs[1].url, 6, 800, stop)
        wait_for(lambda: _engine_running(engs[1].url) == 6)
        wait_for(lambda: srv.call(_running_seen) == [3, 6])
        dest, _, _ = dispatch(channel, chat_body("another one"), chunks=3)
        assert dest == addr[0]
        # each stream released its instance at the response's end (the load went straight to the engines)
        wait_for(lambda: srv.call(_outstanding) == [0, 0], 30)
        assert srv.call(_dispatched) == [1, 1]

        # Envoy's BUFFERED body mode: headers answered at once, the pick rides on the body answer
        s = ExtProcStream(channel)
        s.send(request_headers(mode=Mode.BUFFERED))
        first = s.recv()
        assert first.WhichOneof("response") == "request_headers"
        assert not first.request_headers.response.header_mutation.set_headers
        s.send(request_body(chat_body(), eos=True))
        got = s.recv()
        assert got.WhichOneof("response") == "request_body"
        header, meta = picked(got)
        assert header == meta == addr[0]
        body = json.loads(got.request_body.response.body_mutation.body)
        assert body["vllm_xargs"]["astro_predicted_output_tokens"] == 40
        assert s.close() == []

        # a request without a body (GET /v1/models): picked on the headers, among the pool
        s = ExtProcStream(channel)
        s.send(request_headers("/v1/models", "GET", eos=True))
        got = s.recv()
        header, meta = picked(got)
        assert header == meta and header in addr
        assert s.close() == []

        # the gateway's subset hint: only its endpoints may be picked (engine-1, though loaded)
        s = ExtProcStream(channel)
        s.send(request_headers(subset=[addr[1]]))
        s.send(request_body(chat_body(), eos=True))
        header, _ = picked(s.recv())
        assert header == addr[1]
        s.close()
        # a hint naming no endpoint of the pool: 503
        s = ExtProcStream(channel)
        s.send(request_headers(subset=["10.9.9.9:8000"]))
        s.send(request_body(chat_body(), eos=True))
        status, err = immediate_error(s.recv())
        assert status == 503 and "subset" in err["message"]
        assert s.close() == []

        # health: liveness, readiness and the ext_proc service all SERVING
        hc = health_pb2_grpc.HealthStub(channel)
        for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            assert hc.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == 1
        stop.set()


@pytest.mark.timeout(60)
def test_bad_bodies_get_an_immediate_response_naming_the_field(length_model, tmp_path):
    with ExitStack() as st:
        engs, preds = fleet(st, tmp_path)
        settings = epp_settings(engs, preds, length_model, max_body_bytes=4000, served_models=(MODEL,),
                                api_key="sekret", internal_token="cluster-token")
        srv = st.enter_context(EppThread(settings))
        channel = st.enter_context(grpc.insecure_channel(srv.address))
        auth = {"authorization": "Bearer sekret"}
        for headers in ({}, {"authorization": "Bearer wrong"}):  # the API key is checked on the headers
            s = ExtProcStream(channel)
            s.send(request_headers(extra=headers))
            got, err = immediate_error(s.recv())
            assert (got, err["param"]) == (401, "authorization")
            assert s.close() == []
        cases = [
            (b"{not json", "/v1/chat/completions", 400, "body"),
            (json.dumps({"model": MODEL}).encode(), "/v1/chat/completions", 400, "messages"),
            (json.dumps({"model": MODEL, "max_tokens": 3}).encode(), "/v1/completions", 400, "prompt"),
            (chat_body(max_tokens=0), "/v1/chat/completions", 400, "max_tokens"),
            (chat_body(model="other/model"), "/v1/chat/completions", 404, "model"),
            (chat_body("x" * 5000), "/v1/chat/completions", 413, "body"),
        ]
        for data, path, status, param in cases:
            s = ExtProcStream(channel)
            s.send(request_headers(path, extra=auth))
            s.send(request_body(data[:10], eos=False))
            s.send(request_body(data[10:], eos=True))
            got, err = immediate_error(s.recv())
            assert (got, err["param"]) == (status, param), (data[:40], err)
            assert err["message"]
            assert s.close() == []  # the EPP ended the stream after its ImmediateResponse
        # a body mode the EPP cannot serve (Envoy's STREAMED waits on per-chunk answers): a clear 500
        s = ExtProcStream(channel)
        s.send(request_headers(mode=Mode.STREAMED, extra=auth))
        got, err = immediate_error(s.recv())
        assert got == 500 and "STREAMED" in err["message"] and "FULL_DUPLEX_STREAMED" in err["message"]
        assert s.close() == []
        # nothing was counted on any instance
        assert srv.call(_dispatched) == [0, 0]
        # a good request still works on the same server; a client's own destination header
        # is replaced, and the engines' internal token is added (the gateway forwards)
        dest, sent, _ = dispatch(channel, chat_body(), extra={**auth, DEST: "10.6.6.6:1"})
        assert dest in {endpoint_address(e.url) for e in engs}
        assert sent["x-astro-internal-token"] == "cluster-token"


@pytest.mark.timeout(90)
def test_discovered_pool_only_ready_endpoints_are_picked(length_model, tmp_path):
    """The pool from Kubernetes discovery (the fake API server's EndpointSlices, one per
    pod, pointing at two real sim engines + Predictors): the picked endpoint is the pod's
    address and `http` port from its slice; the idle pod wins while both are ready; once
    it turns terminating every pick goes to the loaded one; once both are gone, 503."""
    from test_scheduler_discovery import A, B, pod_slice

    with ExitStack() as st:
        engs, preds = fleet(st, tmp_path)
        url = {A: (engs[0].url, preds[0].url), B: (engs[1].url, preds[1].url)}
        api = st.enter_context(FakeApiServer())
        api.lists.put(slice_list("100", [pod_slice("90", A, *url[A], ready=True),
                                         pod_slice("91", B, *url[B], ready=True)]))
        watch = api.watch_stream()
        st.callback(watch.put, END)
        disc = DiscoverySettings(KubeApi(api.url, NS, token="t"),
                                 WatchSettings(service=SERVICE, backoff_initial_s=0.01), sync_timeout_s=10)
        sched = SchedulerSettings(instances=(), discovery=disc, policy="power_of_k",
                                  policy_params={"k": 2, "objective": "e2e"}, length_model=length_model,
                                  predict_deadline_s=2.0, health_interval_s=0.05)
        srv = st.enter_context(EppThread(EppSettings(sched)))
        channel = st.enter_context(grpc.insecure_channel(srv.address))
        stop = threading.Event()
        st.callback(stop.set)
        wait_for(lambda: srv.call(_ready_count) == 2)
        addr = {pod: "127.0.0.1:" + url[pod][0].rsplit(":", 1)[1] for pod in (A, B)}
        load(engs[0].url, 3, 800, stop)  # pod A busy
        wait_for(lambda: _engine_running(engs[0].url) == 3)
        # the picker's own view (its /status poll) must show them too, else both look idle
        wait_for(lambda: srv.call(_running_by_url) == {engs[0].url: 3, engs[1].url: 0})
        assert dispatch(channel, chat_body())[0] == addr[B]
        watch.put({"type": "MODIFIED", "object": pod_slice("101", B, *url[B], ready=False, terminating=True)})
        wait_for(lambda: srv.call(_ready_count) == 1)
        assert [dispatch(channel, chat_body())[0] for _ in range(3)] == [addr[A]] * 3
        for rv, pod in (("102", A), ("103", B)):
            watch.put({"type": "MODIFIED", "object": pod_slice(rv, pod, *url[pod], ready=False, present=False)})
        wait_for(lambda: srv.call(_ready_count) == 0)
        s = ExtProcStream(channel)
        s.send(request_headers())
        s.send(request_body(chat_body(), eos=True))
        status, err = immediate_error(s.recv())
        assert status == 503, err
        assert s.close() == []
        stop.set()


@pytest.mark.timeout(60)
def test_empty_pool_is_503_and_not_ready(length_model):
    """Discovery (the fake API server) lists no endpoint of the engines' Service."""
    with ExitStack() as st:
        api = st.enter_context(FakeApiServer())
        api.lists.put(slice_list("100", []))
        watch = api.watch_stream()
        st.callback(watch.put, END)
        disc = DiscoverySettings(KubeApi(api.url, NS, token="t"), WatchSettings(service=SERVICE), sync_timeout_s=10)
        sched = SchedulerSettings(instances=(), discovery=disc, length_model=length_model, health_interval_s=0.05)
        srv = st.enter_context(EppThread(EppSettings(sched)))
        channel = st.enter_context(grpc.insecure_channel(srv.address))
        for headers_only in (False, True):
            s = ExtProcStream(channel)
            if headers_only:
                s.send(request_headers("/v1/models", "GET", eos=True))
            else:
                s.send(request_headers())
                s.send(request_body(chat_body(), eos=True))
            status, err = immediate_error(s.recv())
            assert status == 503 and "no ready endpoint" in err["message"], err
            assert s.close() == []
        hc = health_pb2_grpc.HealthStub(channel)
        check = {name: hc.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status
                 for name in ("liveness", "readiness")}
        assert check == {"liveness": health_pb2.HealthCheckResponse.SERVING,
                         "readiness": health_pb2.HealthCheckResponse.NOT_SERVING}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_astro_serve_epp_subprocess(tmp_path, length_model):
    """The CLI: `astro serve epp` listens, answers ext_proc and health, exits 0 on SIGTERM."""
    ready = tmp_path / "ready"
    cmd = [sys.executable, "-m", "rps_astro_cli.cli.main", "serve", "epp", "--engine", "http://127.0.0.1:9",
           "--policy", "round_robin", "--length-model", length_model, "--port", "0", "--ready-file", str(ready)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists() or not ready.read_text().strip():
            assert proc.poll() is None, proc.communicate(timeout=5)
            assert time.monotonic() < deadline, "astro serve epp did not listen in time"
            time.sleep(0.1)
        address = ready.read_text().strip()
        with grpc.insecure_channel(address) as channel:
            hc = health_pb2_grpc.HealthStub(channel)
            assert hc.Check(health_pb2.HealthCheckRequest(service="liveness"), timeout=5).status == 1
            s = ExtProcStream(channel)
            s.send(request_headers())
            s.send(request_body(b"[1, 2", eos=True))
            status, err = immediate_error(s.recv())
            assert (status, err["param"]) == (400, "body")
            s.close()
        proc.send_signal(signal.SIGTERM)
        out, errtext = proc.communicate(timeout=20)
        assert proc.returncode == 0, errtext
        assert f"ready: {address}" in out
        assert "Traceback" not in errtext
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)


def test_cli_flag_errors_are_one_line():
    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app

    runner = CliRunner()
    for args, flag in ((["serve", "epp"], "--engine"),
                       (["serve", "epp", "--engine", "http://127.0.0.1:9", "--body-mode", "nope"], "--body-mode"),
                       (["serve", "epp", "--discover", "kubernetes", "--engine", "http://x:1"], "--discover")):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, r.output
        text = (r.stderr if hasattr(r, "stderr") else r.output).strip()
        assert text.startswith("error:") and flag in text and "\n" not in text, text


async def _ready_count(server) -> int:
    return server.picker.ready_instances()


async def _running_seen(server) -> list[int | None]:
    """Each instance's running count as the picker's latest engine /status showed it."""
    return [st.load_row[2] if st.load_row else None for st in server.picker.instances]  # STATUS_ROW: num_running


async def _running_by_url(server) -> dict[str, int | None]:
    """`_running_seen` keyed by engine URL (a discovered pool's order is the watch's)."""
    return {st.ep.engine_url: st.load_row[2] if st.load_row else None for st in server.picker.instances}


async def _outstanding(server) -> list[int]:
    return [st.outstanding for st in server.picker.instances]


async def _dispatched(server) -> list[int]:
    return [st.dispatched for st in server.picker.instances]


def _engine_running(url: str) -> int:
    return running(url)


def test_manifest_epp_args_give_discovery_settings(monkeypatch):
    """The exact arguments of the EPP container in deploy/kubernetes/overlays/gie/epp.yaml
    parse into EPP settings over discovery (in-cluster credentials and the server stubbed),
    on the port the InferencePool's endpointPickerRef names."""
    from pathlib import Path

    import yaml
    from typer.testing import CliRunner

    import rps_astro_cli.services.epp as epp_mod
    from rps_astro_cli.cli.main import app

    gie = Path(__file__).parents[1] / "deploy/kubernetes/overlays/gie"
    dep = next(d for d in yaml.safe_load_all((gie / "epp.yaml").read_text()) if d and d["kind"] == "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    pool = next(d for d in yaml.safe_load_all((gie / "inferencepool.yaml").read_text())
                if d and d["kind"] == "InferencePool")
    got: list = []
    monkeypatch.setattr(KubeApi, "in_cluster",
                        classmethod(lambda cls, namespace=None: KubeApi("https://10.96.0.1:443", namespace or "astro",
                                                                        token="t")))
    monkeypatch.setattr(epp_mod, "run_epp", lambda settings, host, port, *a, **kw: got.append((settings, port)))
    monkeypatch.setenv("ASTRO_API_KEY", "k")
    monkeypatch.setenv("ASTRO_INTERNAL_TOKEN", "tok")
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    s, port = got[-1]
    assert port == pool["spec"]["endpointPickerRef"]["port"]["number"] == 9002
    assert s.scheduler.instances == () and s.scheduler.discovery.watch.service == "astro-engine"
    assert s.scheduler.policy == "power_of_k" and s.scheduler.policy_params["k"] == 2
    assert (s.scheduler.api_key, s.scheduler.internal_token) == ("k", "tok")
    assert (s.destination_header, s.metadata_namespace, s.metrics_port) == (DEST, "envoy.lb", 9090)


@pytest.mark.timeout(60)
def test_epp_dispatches_early_through_the_front_doors_path(length_model):
    """The endpoint picker shares the front door's path from a body to a decision
    (`FrontDoor.route`): under objective ttft a text request's Predictor RPCs go out while
    the (slow) tagger works, and the forwarded body still carries the tag's length; under
    objective e2e the Predictors are asked only after the tag."""
    from test_services_scheduler import slow_tagger_and_timed_predictor

    times, tagger, predictor = slow_tagger_and_timed_predictor()
    with ExitStack() as st:
        eng = start(st, engine_app(0))
        tag_srv, pred_srv = start(st, tagger), start(st, predictor)
        for objective, early_expected in (("ttft", True), ("e2e", False)):
            sched = SchedulerSettings(instances=(InstanceEndpoint("engine-0", eng.url, pred_srv.url),),
                                      policy="power_of_k", policy_params={"k": "all", "objective": objective},
                                      tagger_url=tag_srv.url, tag_deadline_s=2.0, predict_deadline_s=2.0,
                                      health_interval_s=0.05)
            srv = st.enter_context(EppThread(EppSettings(sched)))
            channel = st.enter_context(grpc.insecure_channel(srv.address))
            wait_for(lambda srv=srv: srv.call(_ready_count) == 1)
            for v in times.values():
                v.clear()
            dest, _, fwd = dispatch(channel, chat_body(max_tokens=50))
            assert dest == endpoint_address(eng.url)
            assert fwd["vllm_xargs"]["astro_predicted_output_tokens"] == 7  # the tag's length, early or not
            assert len(times["predict"]) == 1 and len(times["tag_out"]) == 1, times
            assert (times["predict"][0] < times["tag_out"][0]) is early_expected, (objective, times)
