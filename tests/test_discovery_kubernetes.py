"""Kubernetes discovery (`rps_astro_cli.discovery`) against a real HTTP server on
127.0.0.1 that speaks the API server's list + watch protocol: an EndpointSliceList for a
list, a chunked stream of JSON lines for `watch=1`, BOOKMARK, ERROR 410 and HTTP 410.

The objects have the shape the API server returns for a Deployment behind the headless
Service of deploy/kubernetes/base/engine.yaml (discovery.k8s.io/v1 EndpointSlice: metadata
with the kubernetes.io/service-name label and resourceVersion, addressType, endpoints with
addresses / conditions {ready, serving, terminating} / targetRef {kind: Pod, name, uid} /
nodeName, and the Service's named ports http 8000 and predictor 8100). The walk: two pods
added (not ready) → ready → one terminating → removed, then a bookmark, a 410 ERROR event,
an HTTP 410 and a slice deletion; after each step the instance set, the events and the
dispatch picks are checked.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pytest

from rps_astro_cli.discovery import DiscoveredInstance, InstanceSet
from rps_astro_cli.discovery.kubernetes import (
    EndpointSliceWatcher,
    KubeApi,
    WatchSettings,
    endpoint_urls,
    slice_instances,
)
from rps_astro_cli.dispatch import make_dispatch
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.types import InstanceLoad

NS = "astro"
SERVICE = "astro-engine"
SLICE = "astro-engine-7xk2p"
PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NS}/endpointslices"
END = object()  # ends a watch stream (the server's timeoutSeconds elapsed)

PODS = {  # pod name → (pod IP, pod UID, node)
    "astro-engine-5d8f9c7b6-abcde": ("10.244.1.7", "3f1c6c3e-1b7a-4d53-9c39-2f5b8a0c1a01", "gpu-node-1"),
    "astro-engine-5d8f9c7b6-fghij": ("10.244.2.9", "8e0a4b1d-77c2-4b0e-a3d4-9d6e5f4c3b02", "gpu-node-2"),
    "astro-engine-5d8f9c7b6-klmno": ("10.244.3.4", "c2d9e8f7-0a1b-4c3d-8e9f-1a2b3c4d5e03", "gpu-node-3"),
}
A, B, C = list(PODS)


def endpoint(pod: str, ready: bool, serving: bool, terminating: bool) -> dict:
    ip, uid, node = PODS[pod]
    return {"addresses": [ip], "conditions": {"ready": ready, "serving": serving, "terminating": terminating},
            "nodeName": node, "targetRef": {"kind": "Pod", "namespace": NS, "name": pod, "uid": uid}}


def endpoint_slice(rv: str, endpoints: list[dict] | None, name: str = SLICE) -> dict:
    return {
        "kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
        "metadata": {"name": name, "generateName": f"{SERVICE}-", "namespace": NS,
                     "uid": "0b6e4a2c-5d1f-4e8a-9b3c-7f2d1e0a9c10", "resourceVersion": rv, "generation": 3,
                     "labels": {"app.kubernetes.io/name": "astro", "app.kubernetes.io/component": "engine",
                                "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                                "kubernetes.io/service-name": SERVICE, "service.kubernetes.io/headless": ""},
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": SERVICE,
                                          "uid": "5a4b3c2d-1e0f-4a9b-8c7d-6e5f4a3b2c1d", "controller": True,
                                          "blockOwnerDeletion": True}]},
        "addressType": "IPv4",
        "endpoints": endpoints,  # null when the Service selects no pod
        "ports": [{"name": "http", "protocol": "TCP", "port": 8000, "appProtocol": "http"},
                  {"name": "predictor", "protocol": "TCP", "port": 8100, "appProtocol": "http"}],
    }


def slice_list(rv: str, items: list[dict]) -> dict:
    return {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
            "metadata": {"resourceVersion": rv}, "items": items}


def gone_status() -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "too old resource version: 1200 (1350)", "reason": "Expired", "code": 410}


class FakeApiServer:
    """The API server's EndpointSlice list and watch, scripted by the test.

    lists: answers for list requests, in order. watches: one entry per watch request:
    a queue.Queue of events (END closes the stream) or an (HTTP status, body) pair.
    requests: (query dict, Authorization header) of every request, in order.
    """

    def __init__(self) -> None:
        self.lists: queue.Queue = queue.Queue()
        self.watches: queue.Queue = queue.Queue()
        self.requests: list[tuple[dict[str, str], str | None]] = []
        srv = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _json(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                srv.requests.append((q, self.headers.get("Authorization")))
                if url.path != PATH:
                    self._json(404, {"kind": "Status", "code": 404, "message": "not found"})
                    return
                if q.get("watch") != "1":
                    self._json(200, srv.lists.get(timeout=10))
                    return
                script = srv.watches.get(timeout=10)
                if isinstance(script, tuple):
                    self._json(*script)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while True:
                    ev = script.get(timeout=20)
                    if ev is END:
                        self.wfile.write(b"0\r\n\r\n")
                        self.wfile.flush()
                        return
                    line = json.dumps(ev).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeApiServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def watch_stream(self) -> queue.Queue:
        q: queue.Queue = queue.Queue()
        self.watches.put(q)
        return q


async def until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


def picks(iset: InstanceSet, n: int, rng: np.random.Generator) -> set[str]:
    """Names chosen by n power-of-2 decisions over the dispatchable instances (no Predictor
    answers: the load fallback), as the scheduler dispatches."""
    insts = iset.dispatchable()
    policy = make_dispatch("power_of_k", k=2)
    loads = [InstanceLoad(i, True, outstanding_requests=0) for i in range(len(insts))]
    out = set()
    for _ in range(n):
        cands = policy.candidates(loads, rng)
        out.add(insts[policy.choose(loads, cands, {}, rng).choice].name)
    return out


def test_watch_add_ready_terminate_delete(tmp_path):
    token = tmp_path / "token"
    token.write_text("token-1\n")
    events: list[tuple[str, str]] = []
    iset = InstanceSet(lambda ev: events.append((ev.kind, ev.instance.name)))
    rng = np.random.default_rng(7)

    async def walk(srv: FakeApiServer) -> None:
        api = KubeApi(srv.url, NS, token_path=str(token))
        w = EndpointSliceWatcher(api, WatchSettings(service=SERVICE, backoff_initial_s=0.01), iset)
        # the Service selects no ready pod yet: one slice with endpoints null
        srv.lists.put(slice_list("1200", [endpoint_slice("1190", None)]))
        s1 = srv.watch_stream()
        w.start()
        assert await w.wait_synced(10)
        assert len(iset) == 0 and iset.dispatchable() == () and events == []

        # add: two pods scheduled, containers starting (not ready)
        s1.put({"type": "ADDED", "object": endpoint_slice("1201", [endpoint(A, False, False, False),
                                                                   endpoint(B, False, False, False)])})
        await until(lambda: len(iset) == 2)
        assert iset.phases() == {A: "not_ready", B: "not_ready"}
        assert iset.dispatchable() == ()
        assert events == [("added", A), ("added", B)]
        a = iset.get(PODS[A][1])
        assert (a.engine_url, a.predictor_url, a.node_name) == ("http://10.244.1.7:8000", "http://10.244.1.7:8100",
                                                              "gpu-node-1")

        # ready: both pass their readiness probes
        events.clear()
        s1.put({"type": "MODIFIED", "object": endpoint_slice("1202", [endpoint(A, True, True, False),
                                                                      endpoint(B, True, True, False)])})
        await until(lambda: len(iset.dispatchable()) == 2)
        assert events == [("ready", A), ("ready", B)]
        assert picks(iset, 200, rng) == {A, B}

        # terminating: A's pod is deleted (scale-down); it still serves its in-flight requests
        events.clear()
        s1.put({"type": "MODIFIED", "object": endpoint_slice("1203", [endpoint(A, False, True, True),
                                                                      endpoint(B, True, True, False)])})
        await until(lambda: iset.phases()[A] == "terminating")
        assert events == [("terminating", A)]
        assert [i.name for i in iset.dispatchable()] == [B]
        assert picks(iset, 500, rng) == {B}  # no new request lands on the terminating pod

        # remove: A's pod is gone from the slice
        events.clear()
        s1.put({"type": "MODIFIED", "object": endpoint_slice("1204", [endpoint(B, True, True, False)])})
        await until(lambda: len(iset) == 1)
        assert events == [("removed", A)]
        assert iset.phases() == {B: "ready"}

        # a bookmark moves the resourceVersion; the stream ends (timeoutSeconds) and the
        # watch resumes from the bookmark's version, with the rotated token
        events.clear()
        token.write_text("token-2\n")
        s1.put({"type": "BOOKMARK", "object": {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                                               "metadata": {"resourceVersion": "1250"}}})
        s2 = srv.watch_stream()
        s1.put(END)
        await until(lambda: w.stats.watches == 2 and len(srv.requests) == 3)
        q, auth = srv.requests[2]
        assert (q["watch"], q["resourceVersion"], q["allowWatchBookmarks"]) == ("1", "1250", "true")
        assert auth == "Bearer token-2"
        assert events == []  # a bookmark changes no instance

        # 410 Gone as an ERROR event: re-list. Meanwhile C appeared; B is unchanged, so the
        # re-list reports only C (no spurious removed/added for B)
        srv.lists.put(slice_list("1400", [endpoint_slice("1390", [endpoint(B, True, True, False),
                                                                 endpoint(C, True, True, False)])]))
        srv.watches.put((410, gone_status()))  # the next watch from 1400 is too old as well
        srv.lists.put(slice_list("1500", [endpoint_slice("1390", [endpoint(B, True, True, False),
                                                                 endpoint(C, True, True, False)])]))
        s3 = srv.watch_stream()
        s2.put({"type": "ERROR", "object": gone_status()})
        watch_rvs = lambda: [q["resourceVersion"] for q, _ in srv.requests if q.get("watch") == "1"]  # noqa: E731
        await until(lambda: w.stats.lists == 3 and len(watch_rvs()) == 4)
        assert w.stats.relists_gone == 2
        assert events == [("added", C), ("ready", C)]
        assert iset.phases() == {B: "ready", C: "ready"}
        assert picks(iset, 200, rng) == {B, C}
        assert watch_rvs() == ["1200", "1250", "1400", "1500"]

        # the slice itself is deleted (Service deleted): every instance goes
        events.clear()
        s3.put({"type": "DELETED", "object": endpoint_slice("1501", [endpoint(B, True, True, False),
                                                                     endpoint(C, True, True, False)])})
        await until(lambda: len(iset) == 0)
        assert sorted(events) == [("removed", B), ("removed", C)]
        assert iset.dispatchable() == ()
        for q, auth in srv.requests:  # every request: this Service's slices, with a token
            assert q["labelSelector"] == f"kubernetes.io/service-name={SERVICE}"
            assert auth in ("Bearer token-1", "Bearer token-2")
        assert w.stats.errors == 0
        s3.put(END)
        srv.watch_stream()  # the resumed watch, left open until stop()
        await w.stop()

    with FakeApiServer() as srv:
        asyncio.run(walk(srv))


def test_watch_retries_after_forbidden_and_keeps_state():
    """A 403 (RBAC missing) on the watch is counted, named in last_error, and retried with
    backoff; the instances listed before stay as they were."""
    iset = InstanceSet()

    async def walk(srv: FakeApiServer) -> None:
        w = EndpointSliceWatcher(KubeApi(srv.url, NS, token="t"),
                                 WatchSettings(service=SERVICE, backoff_initial_s=0.01), iset)
        srv.lists.put(slice_list("10", [endpoint_slice("9", [endpoint(A, True, True, False)])]))
        srv.watches.put((403, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Forbidden",
                               "code": 403, "message": 'endpointslices.discovery.k8s.io is forbidden: User '
                               '"system:serviceaccount:astro:default" cannot watch resource "endpointslices"'}))
        s = srv.watch_stream()
        w.start()
        await until(lambda: w.stats.errors == 1 and w.stats.watches == 2)
        assert "HTTP 403" in w.stats.last_error and "rbac.yaml" in w.stats.last_error
        assert [i.name for i in iset.dispatchable()] == [A]
        assert w.stats.lists == 1  # a 403 is not a reason to re-list
        s.put(END)
        srv.watch_stream()
        await w.stop()

    with FakeApiServer() as srv:
        asyncio.run(walk(srv))


def test_endpoint_urls_and_conditions():
    ports = [{"name": "http", "port": 8000}, {"name": "predictor", "port": 8100}]
    assert endpoint_urls({"addresses": ["10.0.0.5"]}, ports) == ("http://10.0.0.5:8000", "http://10.0.0.5:8100")
    assert endpoint_urls({"addresses": ["fd00::1"]}, ports) == ("http://[fd00::1]:8000", "http://[fd00::1]:8100")
    assert endpoint_urls({"addresses": ["10.0.0.5"]}, [{"name": "http", "port": 8000}]) == ("http://10.0.0.5:8000",
                                                                                             None)
    assert endpoint_urls({"addresses": ["10.0.0.5"]}, [{"name": "metrics", "port": 9100}]) is None
    assert endpoint_urls({"addresses": []}, ports) is None
    # nil conditions: ready = true, terminating = false (EndpointConditions API docs)
    obj = {"ports": ports, "endpoints": [
        {"addresses": ["10.0.0.5"]},
        {"addresses": ["10.0.0.6"], "conditions": {"ready": False, "serving": True, "terminating": True}},
        {"addresses": ["10.0.0.7"], "conditions": {"ready": False}},
    ]}
    got = [(i.name, i.phase, i.dispatchable) for i in slice_instances(obj)]
    assert got == [("10.0.0.5", "ready", True), ("10.0.0.6", "terminating", False), ("10.0.0.7", "not_ready", False)]


def test_instance_in_two_slices_is_merged_conservatively():
    """While the controller moves an endpoint between slices it is listed twice: it is
    dispatchable only if every copy is ready and none terminating."""
    events = []
    iset = InstanceSet(lambda ev: events.append((ev.kind, ev.instance.name)))
    ready = DiscoveredInstance("u1", "pod-1", "http://10.0.0.1:8000", "http://10.0.0.1:8100", True, False)
    stale = DiscoveredInstance("u1", "pod-1", "http://10.0.0.1:8000", "http://10.0.0.1:8100", False, True)
    iset.set_source("slice-a", [ready])
    assert events == [("added", "pod-1"), ("ready", "pod-1")]
    iset.set_source("slice-b", [stale])
    assert iset.phases() == {"pod-1": "terminating"} and iset.dispatchable() == ()
    iset.drop_source("slice-b")
    assert iset.phases() == {"pod-1": "ready"}
    assert events[2:] == [("terminating", "pod-1"), ("ready", "pod-1")]
    # same pod, new address (recreated with the same UID is impossible, but a port change
    # is not): removed, then added again
    moved = DiscoveredInstance("u1", "pod-1", "http://10.0.0.1:8001", "http://10.0.0.1:8100", True, False)
    events.clear()
    iset.set_source("slice-a", [moved])
    assert events == [("removed", "pod-1"), ("added", "pod-1"), ("ready", "pod-1")]


def test_listener_error_does_not_stop_updates():
    seen = []

    def broken(ev):
        raise RuntimeError("consumer bug")

    iset = InstanceSet(broken)
    iset.subscribe(lambda ev: seen.append(ev.kind))
    iset.set_source("s", [DiscoveredInstance("k", "n", "http://10.0.0.1:8000", None, True, False)])
    assert seen == ["added", "ready"] and len(iset.dispatchable()) == 1


def test_in_cluster_config(tmp_path):
    (tmp_path / "token").write_text("abc\n")
    (tmp_path / "namespace").write_text("astro\n")
    api = KubeApi.in_cluster(sa_dir=tmp_path, environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1",
                                                       "KUBERNETES_SERVICE_PORT": "443"})
    assert (api.base_url, api.namespace, api.ca_path) == ("https://10.96.0.1:443", "astro", None)
    assert api.headers()["Authorization"] == "Bearer abc"
    with pytest.raises(AstroUserError, match="KUBERNETES_SERVICE_HOST"):
        KubeApi.in_cluster(sa_dir=tmp_path, environ={})
    with pytest.raises(AstroUserError, match="service-account token"):
        KubeApi.in_cluster(sa_dir=tmp_path / "missing", environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1"})
