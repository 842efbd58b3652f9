"""The scheduler with Kubernetes discovery (`SchedulerSettings.discovery`, `astro serve
scheduler --discover kubernetes`): the fake API server of test_discovery_kubernetes.py
(a real 127.0.0.1 server speaking list + chunked watch) lists and watches the
EndpointSlices of two pods, whose endpoints point at two real sim engines and their
Predictors on 127.0.0.1 (one slice per pod: a slice's ports apply to all its endpoints,
and the two engines listen on different ports).

The walk: both pods listed not ready (→ known, no request goes anywhere: 503) → ready
(→ requests reach both) → the pod holding a long in-flight stream turns terminating
(→ N requests all go to the other, health checks keep passing, the stream finishes) →
its endpoint is deleted (→ the scheduler's instance set holds one instance).
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import ExitStack

import httpx
import pytest

from rps_astro_cli.discovery.kubernetes import KubeApi, WatchSettings
from rps_astro_cli.services import predictor as pred_mod
from rps_astro_cli.services.scheduler import SchedulerSettings, create_app
from rps_astro_cli.services.scheduler.settings import DiscoverySettings, seed_from_pod_name
from test_discovery_kubernetes import END, NS, PODS, SERVICE, FakeApiServer, endpoint, endpoint_slice, slice_list
from test_services_scheduler import chat, engine_app, hand_profile, start

A, B = list(PODS)[:2]


@pytest.fixture()
def length_model(tmp_path) -> str:
    p = tmp_path / "len.json"
    p.write_text(json.dumps({"kind": "bin_median", "edges_tokens": [], "median_output_tokens": [40]}))
    return str(p)


def pod_slice(rv: str, pod: str, engine_url: str, predictor_url: str, ready: bool, terminating: bool = False,
              present: bool = True) -> dict:
    """Pod `pod`'s own EndpointSlice: its endpoint at 127.0.0.1 with the ports of its
    engine and Predictor (absent when not `present`: the pod is gone)."""
    ep = endpoint(pod, ready, ready or terminating, terminating)
    ep["addresses"] = ["127.0.0.1"]
    obj = endpoint_slice(rv, [ep] if present else [], name=f"{SERVICE}-{pod[-5:]}")
    obj["ports"] = [{"name": "http", "protocol": "TCP", "port": int(engine_url.rsplit(":", 1)[1])},
                    {"name": "predictor", "protocol": "TCP", "port": int(predictor_url.rsplit(":", 1)[1])}]
    return obj


def wait_for(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_scheduler_follows_endpointslices(length_model, tmp_path):
    from conftest import write_profile

    profile_path = write_profile(tmp_path, hand_profile())
    with ExitStack() as st:
        srv = st.enter_context(FakeApiServer())
        engs = [start(st, engine_app(i, time_scale=1.0)) for i in range(2)]
        preds = [start(st, pred_mod.create_app(pred_mod.PredictorSettings(e.url, profile=profile_path)))
                 for e in engs]
        url = {A: (engs[0].url, preds[0].url), B: (engs[1].url, preds[1].url)}
        srv.lists.put(slice_list("100", [pod_slice("90", A, *url[A], ready=False),
                                         pod_slice("91", B, *url[B], ready=False)]))
        watch = srv.watch_stream()
        disc = DiscoverySettings(KubeApi(srv.url, NS, token="t"),
                                 WatchSettings(service=SERVICE, backoff_initial_s=0.01), sync_timeout_s=10.0)
        app = create_app(SchedulerSettings(instances=(), discovery=disc, policy="power_of_k",
                                           policy_params={"k": 2}, length_model=length_model,
                                           predict_deadline_s=2.0, health_interval_s=0.05))
        s = start(st, app)  # its lifespan waited for the first list
        sched = app.state.scheduler
        c = st.enter_context(httpx.Client(base_url=s.url, timeout=20))

        def instances() -> dict[str, dict]:
            return {i["name"]: i for i in c.get("/instances").json()}

        # listed, not ready: known, not dispatchable; nothing reaches an engine
        got = instances()
        assert {n: (i["phase"], i["dispatchable"]) for n, i in got.items()} == {A: ("not_ready", False),
                                                                             B: ("not_ready", False)}
        assert got[A]["engine_url"] == engs[0].url and got[B]["predictor_url"] == preds[1].url
        r = c.post("/v1/chat/completions", json=chat())
        assert r.status_code == 503 and r.json()["error"]["type"] == "engine_unavailable"
        assert c.get("/ready").status_code == 503  # readiness; /health is liveness (200, says why)
        assert c.get("/health").json()["status"] == "unavailable"

        # both ready: requests reach both
        watch.put({"type": "MODIFIED", "object": pod_slice("101", A, *url[A], ready=True)})
        watch.put({"type": "MODIFIED", "object": pod_slice("102", B, *url[B], ready=True)})
        wait_for(lambda: all(i["dispatchable"] for i in instances().values()))
        assert c.get("/health").json()["healthy_instances"] == 2
        seen = [c.post("/v1/chat/completions", json=chat()).headers["x-astro-instance"] for _ in range(20)]
        assert set(seen) == {A, B}, seen

        # a long stream in flight on one pod; that pod turns terminating
        stream_out: dict = {}
        started = threading.Event()

        long = chat(max_tokens=800, stream=True, vllm_xargs={"astro_output_tokens": 800})  # ~8 s of decode

        def long_stream() -> None:
            with httpx.Client(base_url=s.url, timeout=60) as c2:
                with c2.stream("POST", "/v1/chat/completions", json=long) as r2:
                    stream_out["instance"] = r2.headers["x-astro-instance"]
                    started.set()
                    stream_out["body"] = r2.read().decode()

        t = threading.Thread(target=long_stream, daemon=True)
        t.start()
        assert started.wait(20)
        term = stream_out["instance"]
        other = B if term == A else A
        rv = iter(range(200, 300))
        watch.put({"type": "MODIFIED", "object": pod_slice(str(next(rv)), term, *url[term], ready=False,
                                                          terminating=True)})
        wait_for(lambda: instances()[term]["phase"] == "terminating")
        before = instances()
        assert before[term]["dispatchable"] is False and before[term]["outstanding_requests"] == 1
        n = 20
        seen = [c.post("/v1/chat/completions", json=chat()).headers["x-astro-instance"] for _ in range(n)]
        assert seen == [other] * n
        time.sleep(0.3)  # ≥ 6 health intervals: the terminating pod passes its health checks...
        after = instances()
        assert after[term]["healthy"] is True and after[term]["dispatchable"] is False  # ...and stays out
        assert after[term]["dispatched"] == before[term]["dispatched"]
        assert after[other]["dispatched"] == before[other]["dispatched"] + n
        assert t.is_alive(), "the stream ended before the deletion; lengthen it"

        # the pod is deleted while its stream is in flight: kept until the stream ends, then dropped
        watch.put({"type": "MODIFIED", "object": pod_slice(str(next(rv)), term, *url[term], ready=False,
                                                          terminating=True, present=False)})
        wait_for(lambda: len(sched.discovered) == 1)
        t.join(30)
        assert not t.is_alive()
        body = stream_out["body"]
        assert body.rstrip().endswith("data: [DONE]") and "engine_failure" not in body
        wait_for(lambda: list(instances()) == [other])
        assert len(sched.instances) == 1 and sched.instances.dispatchable()[0].ep.name == other
        assert c.post("/v1/chat/completions", json=chat()).headers["x-astro-instance"] == other
        last = srv.watch_stream()  # the resumed watch, open until the scheduler stops
        watch.put(END)
        wait_for(lambda: sched.watcher.stats.watches == 2)
        s.stop()  # the lifespan stops the watcher (it cancels the open watch)
        assert sched.watcher is not None and sched.watcher._task is None
        last.put(END)  # let the fake server's handler thread end


def test_discover_flags_errors_and_seed(monkeypatch):
    """Bad flag combinations: exit 2, one line naming the flag, no traceback, no hang."""
    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    base = ["serve", "scheduler"]
    cases = [([], "--engine"),
             (["--discover", "consul", "--discover-service", "x"], "--discover"),
             (["--discover", "kubernetes", "--discover-service", "x", "--engine", "http://127.0.0.1:1"],
              "exclude each other"),
             (["--discover", "kubernetes"], "--discover-service"),
             (["--engine", "http://127.0.0.1:1", "--discover-service", "x"], "--discover-service needs --discover"),
             (["--discover", "kubernetes", "--discover-service", "astro-engine"], "KUBERNETES_SERVICE_HOST")]
    for args, text in cases:
        r = CliRunner().invoke(app, base + args)
        out = " ".join(r.output.split())
        assert r.exit_code == 2 and text in out and "Traceback" not in r.output, (args, r.output)
    # the per-replica seed: the first 8 bytes of SHA-256 of the pod name, big-endian;
    # sha256(b"a") = ca978112ca1bbdcafac231b3... (a widely published digest)
    assert seed_from_pod_name("a") == 0xCA978112CA1BBDCA
    assert seed_from_pod_name("astro-scheduler-1") != seed_from_pod_name("astro-scheduler-2")
    assert seed_from_pod_name(None) == 0


def test_manifest_scheduler_args_give_discovery_settings(monkeypatch):
    """The exact arguments of the scheduler container in deploy/kubernetes/base/scheduler.yaml
    parse into discovery settings (no static instances, the per-pod seed), with the
    in-cluster credentials and the server itself stubbed."""
    from pathlib import Path

    import yaml
    from typer.testing import CliRunner

    import rps_astro_cli.services.scheduler as sched_pkg
    from rps_astro_cli.cli.main import app

    docs = list(yaml.safe_load_all((Path(__file__).parents[1] / "deploy/kubernetes/base/scheduler.yaml").read_text()))
    dep = next(d for d in docs if d and d["kind"] == "Deployment")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:2] == ["serve", "scheduler"] and "--seed" not in args
    got: list = []
    monkeypatch.setattr(KubeApi, "in_cluster",
                        classmethod(lambda cls, namespace=None: KubeApi("https://10.96.0.1:443", namespace or "astro",
                                                                        token="t")))
    monkeypatch.setattr(sched_pkg, "run_scheduler", lambda settings, *a, **kw: got.append(settings))
    monkeypatch.setenv("HOSTNAME", "a")
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    s = got[-1]
    assert s.instances == () and s.discovery.watch.service == "astro-engine"
    assert (s.discovery.api.namespace, s.discovery.watch.engine_port_name,
            s.discovery.watch.predictor_port_name) == ("astro", "http", "predictor")
    assert s.policy == "power_of_k" and s.policy_params["k"] == 2
    assert s.seed == 0xCA978112CA1BBDCA  # from HOSTNAME=a
    r = CliRunner().invoke(app, args + ["--seed", "5", "--discover-namespace", "other"])
    assert r.exit_code == 0, r.output
    assert (got[-1].seed, got[-1].discovery.api.namespace) == (5, "other")
