"""Engine instances from the Kubernetes API: a list + watch of the EndpointSlices of the
engines' (headless) Service, over plain HTTP (httpx; no Kubernetes client library).

    iset = InstanceSet()
    watcher = EndpointSliceWatcher(KubeApi.in_cluster(), WatchSettings(service="astro-engine"), iset)
    watcher.start()                      # an asyncio task on the running loop
    await watcher.wait_synced(10.0)      # the first list is in `iset`
    iset.dispatchable()                  # ready, not terminating → may get new requests
    ...
    await watcher.stop()

Protocol (the API server's, https://kubernetes.io/docs/reference/using-api/api-concepts/):
1. list: `GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices
   ?labelSelector=kubernetes.io/service-name=SERVICE&limit=500` (following `continue`),
   → an EndpointSliceList whose `metadata.resourceVersion` is where the watch starts;
   the whole `InstanceSet` is reset to it (only real differences produce events).
2. watch: the same path with `watch=1&resourceVersion=RV&allowWatchBookmarks=true
   &timeoutSeconds=T`: a chunked stream of JSON lines `{"type", "object"}`:
   ADDED / MODIFIED (an EndpointSlice: its instances replace that slice's), DELETED (the
   slice's instances go), BOOKMARK (only a newer resourceVersion), ERROR (a `Status`).
   Every event moves RV forward. When the server ends the stream (T elapsed) the watch
   resumes from RV.
3. "410 Gone" — an ERROR event with `code: 410` or an HTTP 410 answer: RV is older than
   the server keeps; list again (step 1).
4. Any other failure (connection, 5xx, 401/403 when RBAC is missing): logged with the
   cause, counted, retried with exponential backoff; the instance set keeps its last
   known state meanwhile (a known-ready engine stays dispatchable; the scheduler's own
   health checks still take a dead one out).

Mapping an endpoint to an instance (`endpoint_instance`): the slice's port named
`engine_port_name` ("http") gives the engine URL, `predictor_port_name` ("predictor") the
Predictor URL, at the endpoint's first address (IPv6 in brackets). Readiness per the API's
EndpointConditions: `ready` nil = true, `terminating` nil = false; an endpoint that is
terminating or not ready gets no new requests (`DiscoveredInstance.dispatchable`).

In-cluster credentials (`KubeApi.in_cluster`): `KUBERNETES_SERVICE_HOST/PORT`, the
service-account token (re-read before every request: bound tokens rotate), its CA
bundle and namespace under /var/run/secrets/kubernetes.io/serviceaccount/. RBAC needed:
get/list/watch on endpointslices in that namespace (deploy/kubernetes/base/rbac.yaml).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rps_astro_cli.discovery.instances import DiscoveredInstance, InstanceSet
from rps_astro_cli.errors import AstroUserError

log = logging.getLogger("astro.discovery.kubernetes")

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"  # set by the EndpointSlice controller


# -- mapping --------------------------------------------------------------------------------
def endpoint_urls(endpoint: dict[str, Any], ports: list[dict[str, Any]], engine_port_name: str = "http",
                  predictor_port_name: str | None = "predictor",
                  scheme: str = "http") -> tuple[str, str | None] | None:
    """(engine URL, Predictor URL or None) of one EndpointSlice endpoint, or None when the
    slice has no port named `engine_port_name` or the endpoint no address.

    endpoint: one item of the slice's `endpoints`; ports: the slice's `ports` (they apply
    to every endpoint of the slice).
    """
    by_name = {p.get("name") or "": p.get("port") for p in ports or ()}
    eport = by_name.get(engine_port_name)
    addrs = endpoint.get("addresses") or ()
    if eport is None or not addrs:
        return None
    host = addrs[0]
    if ":" in host:  # IPv6
        host = f"[{host}]"
    pport = by_name.get(predictor_port_name) if predictor_port_name else None
    return f"{scheme}://{host}:{eport}", (f"{scheme}://{host}:{pport}" if pport is not None else None)


def endpoint_instance(endpoint: dict[str, Any], ports: list[dict[str, Any]], engine_port_name: str = "http",
                      predictor_port_name: str | None = "predictor") -> DiscoveredInstance | None:
    """The `DiscoveredInstance` of one EndpointSlice endpoint (None when it has no
    engine URL; see `endpoint_urls`). Key: the pod's UID (targetRef.uid), else its
    name, else the address; name: the pod's name, else the address."""
    urls = endpoint_urls(endpoint, ports, engine_port_name, predictor_port_name)
    if urls is None:
        return None
    cond = endpoint.get("conditions") or {}
    ref = endpoint.get("targetRef") or {}
    addr = endpoint["addresses"][0]
    name = ref.get("name") or addr
    ready = cond.get("ready")
    terminating = cond.get("terminating")
    return DiscoveredInstance(
        key=ref.get("uid") or name, name=name, engine_url=urls[0], predictor_url=urls[1],
        ready=True if ready is None else bool(ready), terminating=bool(terminating),
        node_name=endpoint.get("nodeName"))


def slice_instances(obj: dict[str, Any], engine_port_name: str = "http",
                    predictor_port_name: str | None = "predictor") -> list[DiscoveredInstance]:
    """Every instance of one EndpointSlice object (endpoints without an engine port or
    address are skipped; an FQDN slice is read like an IP one)."""
    ports = obj.get("ports") or []
    out = []
    for ep in obj.get("endpoints") or ():
        inst = endpoint_instance(ep, ports, engine_port_name, predictor_port_name)
        if inst is not None:
            out.append(inst)
    return out


# -- API access -----------------------------------------------------------------------------
@dataclass(frozen=True)
class KubeApi:
    """How to reach the Kubernetes API server."""

    base_url: str  # e.g. https://10.96.0.1:443 (no trailing slash)
    namespace: str  # where the engines' Service lives
    token_path: str | None = None  # bearer-token file, re-read per request (service accounts)
    token: str | None = None  # a fixed bearer token (used when token_path is None)
    ca_path: str | None = None  # CA bundle that signs the API server's certificate

    @classmethod
    def in_cluster(cls, namespace: str | None = None, sa_dir: Path = SERVICE_ACCOUNT_DIR,
                   environ: dict[str, str] | None = None) -> KubeApi:
        """The API as a pod sees it (module docstring). `namespace` None = the pod's own.

        Raises:
            AstroUserError: not inside a pod (no KUBERNETES_SERVICE_HOST, or no
                service-account token mounted).
        """
        env = os.environ if environ is None else environ
        host = env.get("KUBERNETES_SERVICE_HOST")
        port = env.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise AstroUserError("KUBERNETES_SERVICE_HOST is not set: not running inside a Kubernetes pod",
                                 field="--discover", fix="run the scheduler in the cluster, or give --engine URLs")
        token = sa_dir / "token"
        if not token.is_file():
            raise AstroUserError(f"no service-account token at {token}", field="--discover",
                                 fix="set automountServiceAccountToken: true on the scheduler's pod")
        if namespace is None:
            ns_file = sa_dir / "namespace"
            namespace = ns_file.read_text().strip() if ns_file.is_file() else "default"
        if ":" in host:
            host = f"[{host}]"
        ca = sa_dir / "ca.crt"
        return cls(f"https://{host}:{port}", namespace, token_path=str(token),
                   ca_path=str(ca) if ca.is_file() else None)

    def headers(self) -> dict[str, str]:
        """Request headers with the current bearer token."""
        h = {"Accept": "application/json"}
        tok = Path(self.token_path).read_text().strip() if self.token_path else self.token
        if tok:
            h["Authorization"] = f"Bearer {tok}"
        return h

    def client(self, timeout_s: float) -> httpx.AsyncClient:
        """An httpx client for this API server (CA-verified when `ca_path` is set)."""
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=self.ca_path) if self.ca_path else True
        return httpx.AsyncClient(base_url=self.base_url, verify=verify, timeout=httpx.Timeout(timeout_s))


@dataclass(frozen=True)
class WatchSettings:
    """What to watch and how patiently."""

    service: str  # the engines' Service (its slices carry kubernetes.io/service-name=<service>)
    engine_port_name: str = "http"  # the Service port that is the engine's OpenAI API
    predictor_port_name: str | None = "predictor"  # the Service port of the Predictor (None: none)
    watch_timeout_s: int = 300  # timeoutSeconds of one watch request; then it resumes from RV
    request_timeout_s: float = 10.0  # connect / list / idle-read bound (a watch read: + watch_timeout_s)
    backoff_initial_s: float = 0.2  # first retry delay after a failure; doubles per failure
    backoff_max_s: float = 10.0  # longest retry delay
    page_size: int = 500  # list page size (limit=...)


@dataclass
class WatchStats:
    """Counters of one watcher (for logs, /health and tests)."""

    lists: int = 0  # completed full lists
    watches: int = 0  # watch requests opened
    events: int = 0  # watch events applied (ADDED/MODIFIED/DELETED/BOOKMARK)
    relists_gone: int = 0  # re-lists caused by 410 Gone (event or HTTP status)
    errors: int = 0  # failed requests / broken streams (then backoff)
    last_error: str | None = None  # the latest failure, one line
    resource_version: str | None = None  # where the next watch starts
    requests: list[str] = field(default_factory=list)  # last request paths (debugging aid, ≤ 20)


class _Gone(Exception):
    """The resourceVersion is too old: list again."""


class EndpointSliceWatcher:
    """Keeps an `InstanceSet` equal to the EndpointSlices of one Service (module docstring)."""

    def __init__(self, api: KubeApi, settings: WatchSettings, instances: InstanceSet,
                 client: httpx.AsyncClient | None = None):
        self.api = api
        self.s = settings
        self.instances = instances
        self.stats = WatchStats()
        self._client = client
        self._own_client = client is None
        self._task: asyncio.Task | None = None
        self._synced = asyncio.Event()
        self._path = f"/apis/discovery.k8s.io/v1/namespaces/{api.namespace}/endpointslices"
        self._selector = f"{SERVICE_NAME_LABEL}={settings.service}"

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> asyncio.Task:
        """Run the list/watch loop as a task on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="k8s-endpointslice-watch")
        return self._task

    async def wait_synced(self, timeout_s: float) -> bool:
        """Wait until the first list has been applied; False after `timeout_s`."""
        try:
            await asyncio.wait_for(self._synced.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        """Cancel the loop and close the client it made."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._own_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    # -- the loop ------------------------------------------------------------------------
    async def run(self) -> None:
        """List, then watch from the list's resourceVersion, forever (module docstring)."""
        if self._client is None:
            self._client = self.api.client(self.s.request_timeout_s)
        delay = self.s.backoff_initial_s
        need_list = True
        while True:
            try:
                if need_list:
                    await self.list_once()
                    need_list = False
                await self.watch_once()
                delay = self.s.backoff_initial_s  # a stream that ended normally: resume at once
            except _Gone:
                self.stats.relists_gone += 1
                need_list = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # connection, HTTP status, bad JSON: back off, retry
                self.stats.errors += 1
                self.stats.last_error = f"{type(exc).__name__}: {exc}"
                log.warning("EndpointSlice %s of service %s/%s failed (%s); retry in %.1f s",
                            "list" if need_list else "watch", self.api.namespace, self.s.service,
                            self.stats.last_error, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.s.backoff_max_s)

    def _note(self, path: str) -> None:
        self.stats.requests.append(path)
        del self.stats.requests[:-20]

    async def list_once(self) -> str:
        """One full list (all pages); resets the instance set; returns its resourceVersion."""
        assert self._client is not None
        slices: dict[str, list[DiscoveredInstance]] = {}
        cont: str | None = None
        rv = ""
        while True:
            params = {"labelSelector": self._selector, "limit": str(self.s.page_size)}
            if cont:
                params["continue"] = cont
            self._note(self._path + "?list")
            r = await self._client.get(self._path, params=params, headers=self.api.headers())
            if r.status_code == 410:  # the continue token expired mid-list
                raise _Gone()
            _raise_for_status(r, "list")
            body = r.json()
            for obj in body.get("items") or ():
                slices[obj["metadata"]["name"]] = self._instances_of(obj)
            meta = body.get("metadata") or {}
            rv = meta.get("resourceVersion") or rv
            cont = meta.get("continue")
            if not cont:
                break
        self.instances.reset(slices)
        self.stats.lists += 1
        self.stats.resource_version = rv
        self._synced.set()
        return rv

    async def watch_once(self) -> None:
        """One watch request from the current resourceVersion, applied event by event
        until the server ends the stream. Raises `_Gone` on 410."""
        assert self._client is not None
        params = {"labelSelector": self._selector, "watch": "1", "allowWatchBookmarks": "true",
                  "timeoutSeconds": str(self.s.watch_timeout_s),
                  "resourceVersion": self.stats.resource_version or ""}
        timeout = httpx.Timeout(self.s.request_timeout_s, read=self.s.watch_timeout_s + self.s.request_timeout_s)
        self.stats.watches += 1
        self._note(self._path + "?watch")
        async with self._client.stream("GET", self._path, params=params, headers=self.api.headers(),
                                       timeout=timeout) as r:
            if r.status_code == 410:
                raise _Gone()
            if r.status_code >= 400:
                await r.aread()
            _raise_for_status(r, "watch")
            async for line in r.aiter_lines():
                if line.strip():
                    self._apply(json.loads(line))

    def _apply(self, ev: dict[str, Any]) -> None:
        kind = ev.get("type")
        obj = ev.get("object") or {}
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone()
            raise RuntimeError(f"watch ERROR event: {obj.get('code')} {obj.get('reason')}: {obj.get('message')}")
        meta = obj.get("metadata") or {}
        rv = meta.get("resourceVersion")
        if kind in ("ADDED", "MODIFIED"):
            self.instances.set_source(meta["name"], self._instances_of(obj))
        elif kind == "DELETED":
            self.instances.drop_source(meta["name"])
        elif kind != "BOOKMARK":
            raise RuntimeError(f"unknown watch event type {kind!r}")
        if rv:
            self.stats.resource_version = rv
        self.stats.events += 1

    def _instances_of(self, obj: dict[str, Any]) -> list[DiscoveredInstance]:
        return slice_instances(obj, self.s.engine_port_name, self.s.predictor_port_name)


def _raise_for_status(r: httpx.Response, what: str) -> None:
    if r.status_code < 400:
        return
    try:
        msg = r.json().get("message", "")
    except ValueError:
        msg = r.text[:200]
    hint = ""
    if r.status_code in (401, 403):
        hint = (" (the scheduler's service account needs get/list/watch on endpointslices: "
                "deploy/kubernetes/base/rbac.yaml)")
    raise RuntimeError(f"EndpointSlice {what}: HTTP {r.status_code} {msg}{hint}")


__all__ = ["EndpointSliceWatcher", "KubeApi", "WatchSettings", "WatchStats", "endpoint_instance",
           "endpoint_urls", "slice_instances"]
