"""`astro serve epp`: astro's dispatch as a Gateway API Inference Extension endpoint picker.

A GIE gateway (Envoy, or any proxy speaking Envoy's external processing protocol) sends
every request of an InferencePool through one `envoy.service.ext_proc.v3.ExternalProcessor`
`Process` stream to its endpoint picker (EPP) and routes the request to the endpoint the
EPP names. This module is that EPP, speaking the GIE endpoint-picker protocol
(`docs/proposals/004-endpoint-picker-protocol` of kubernetes-sigs/gateway-api-inference-extension,
v1.0.0), with astro's own dispatch deciding:

- The instances: the scheduler's (`SchedulerSettings`: a static `--engine/--predictor`
  list, or the watched EndpointSlices of the engines' Service with `--discover kubernetes`),
  held by a `services.scheduler.Scheduler` whose parts this module drives: its
  `Instances` (dispatchable / circuit breaker), health loop, `TagClient`, front door's
  parser (`FrontDoor.parse`, `prompt_blocks`) and `Dispatcher.choose` (tagger → the
  candidates' Predictors → the policy's pick). Nothing of the dispatch is re-implemented
  here; the EPP only replaces the HTTP front door and the forwarding (the gateway forwards).
- Per stream (= one HTTP request):
  1. request headers: remembered (`:path` tells chat from completions). With
     `end_of_stream` (a request without body, e.g. `GET /v1/models`) an endpoint is
     picked at once, uniformly among the dispatchable healthy instances (no body: nothing
     for the tagger or the Predictors; GIE's reference EPP does the same).
  2. request body chunks: buffered up to `max_body_bytes` (past it: 413) until
     `end_of_stream`; then parsed with the engine's own parser (bad JSON / a bad field →
     400 naming the field, an unknown model → 404), tagged, dispatched. The body goes on
     with `vllm_xargs.astro_predicted_output_tokens` set (as the scheduler forwards it), so
     `Content-Length` is set to the new length.
  3. the answer: header `x-gateway-destination-endpoint: IP:PORT` (the engine's address
     as the instance list has it) and the same value in the response's dynamic metadata
     `{"envoy.lb": {"x-gateway-destination-endpoint": "IP:PORT"}}` (both names
     configurable, never two different values), `clear_route_cache` set. In Envoy's
     `FULL_DUPLEX_STREAMED` request body mode (GIE's) the headers response goes after the
     whole body has arrived, followed by one body response carrying the whole new body
     (`streamed_response`, `end_of_stream`); in `BUFFERED` mode the headers are answered
     at once (continue) and the body response carries the header mutation and the new
     body. The mode is read from the first message's `protocol_config` (Envoy ≥ 1.33
     sends it), else `EppSettings.default_body_mode`.
  4. response headers / body / trailers: passed through unchanged (body chunks echoed
     in full-duplex mode); the instance's outstanding count and pending entry (the
     pending-request accounting the Predictors get) are released at the response's end
     or when the stream closes, whichever comes first.
- Access: with an API key (`--api-key` / `$ASTRO_API_KEY`) the request headers must carry
  `Authorization: Bearer KEY` (or `x-api-key`), else 401 before any body is read. The
  engines answer only requests carrying the cluster's internal token
  (`protocol.internal_auth`); the gateway, not astro, forwards the request here, so the
  EPP adds `x-astro-internal-token` to it. Every header it sets replaces a client's own
  (`OVERWRITE_IF_EXISTS_OR_ADD`), so a client cannot pick its endpoint or pass a token.
- Errors are `ImmediateResponse`s with an OpenAI-shaped JSON body, as the GIE protocol
  says: 503 when no endpoint is ready (or none of the gateway's subset hint
  `envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset` is), 400 bad body,
  404 unknown model, 413 body too large, 500 for anything unexpected (logged, never a
  traceback on the stream).
- Health: the gRPC health service (`grpc.health.v1`) answers `liveness` (SERVING while
  the process runs), `readiness` and `envoy.service.ext_proc.v3.ExternalProcessor`
  (SERVING while some dispatchable instance's engine answers its health check, like the
  scheduler's `/ready`; NOT_SERVING while draining), refreshed every `health_interval_s`.
  No leader election: every EPP replica serves (astro's dispatch is stateless).

The gRPC runtime and Envoy's generated protobufs come from the optional `epp` extra
(`grpcio`, `grpcio-health-checking`, `xds-protos`); this module imports them at import
time, so import it only behind that extra (the CLI says how to install it).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.protocol import openai as oa
from rps_astro_cli.protocol.internal_auth import token_headers
from rps_astro_cli.protocol.openai_types import ApiError
from rps_astro_cli.services.http_common import HTTPUserError, error_body
from rps_astro_cli.services.scheduler import Scheduler, SchedulerSettings
from rps_astro_cli.services.scheduler.instances import InstanceState, Pending

log = logging.getLogger("astro.epp")

DESTINATION_HEADER = "x-gateway-destination-endpoint"  # GIE's header and metadata key
METADATA_NAMESPACE = "envoy.lb"  # GIE's default dynamic-metadata namespace
SUBSET_NAMESPACE = "envoy.lb.subset_hint"  # filter metadata the gateway may send
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_Mode = processing_mode_pb2.ProcessingMode
BODY_MODES = {"full_duplex_streamed": _Mode.FULL_DUPLEX_STREAMED, "buffered": _Mode.BUFFERED}


@dataclass(frozen=True)
class EppSettings:
    """`astro serve epp` configuration (times in seconds)."""

    # the instances and the dispatch: policy, tagger, deadlines, discovery (the scheduler's own settings)
    scheduler: SchedulerSettings
    # header carrying the picked endpoint (IP:PORT) to the gateway
    destination_header: str = DESTINATION_HEADER
    # dynamic-metadata namespace wrapping the same key and value ("" = unwrapped)
    metadata_namespace: str = METADATA_NAMESPACE
    # Envoy's request/response body mode when its first message has no protocol_config:
    # full_duplex_streamed (GIE's) | buffered
    default_body_mode: str = "full_duplex_streamed"
    # SIGTERM: how long open streams get before the server stops
    drain_s: float = 4.0
    # Prometheus /metrics on this port (None: not served)
    metrics_port: int | None = None


def endpoint_address(engine_url: str) -> str:
    """An engine URL's `IP:PORT` (the form GIE's header carries; IPv6 in brackets)."""
    u = urlsplit(engine_url)
    host = u.hostname or ""
    port = u.port or (443 if u.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _header_value(h: base_pb2.HeaderValue) -> str:
    return h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value


def _set_headers(pairs: dict[str, str]) -> pb.HeaderMutation:
    """Headers set on the request, replacing any the client sent under those names (so a
    client's own `x-gateway-destination-endpoint` cannot ride along)."""
    overwrite = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
    return pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=overwrite)
        for k, v in pairs.items()])


def immediate(status: int, message: str, param: str | None = None, type_: str | None = None,
              headers: dict[str, str] | None = None) -> pb.ProcessingResponse:
    """An `ImmediateResponse` with an OpenAI-shaped JSON error body (and `headers`, e.g.
    `Retry-After`)."""
    err = error_body(message, param, type_ or ("invalid_request_error" if status < 500 else "server_error"), status)
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status),
        headers=_set_headers({"content-type": "application/json", **(headers or {})}),
        body=json.dumps(err).encode(), details=f"astro-epp: {message}"[:200]))


@dataclass
class _Stream:
    """One `Process` stream's state: one HTTP request through the gateway."""

    request_mode: int  # Envoy's request body mode (ProcessingMode.BodySendMode)
    response_mode: int  # Envoy's response body mode
    headers: dict[str, str] = field(default_factory=dict)  # request headers, lower-case names
    body: bytearray = field(default_factory=bytearray)  # request body so far
    configured: bool = False  # protocol_config read (first message only)
    instance: InstanceState | None = None  # the instance picked (its outstanding count held)
    pending: Pending | None = None  # its pending entry (the request as its Predictor is told)
    done: bool = False  # an ImmediateResponse ended the stream
    subset: frozenset[str] | None = None  # the gateway's subset hint (IP:PORT), None: the whole pool


class EndpointPicker(pb_grpc.ExternalProcessorServicer):
    """The ext_proc servicer over one `Scheduler`'s parts (see the module docstring)."""

    def __init__(self, settings: EppSettings):
        if settings.default_body_mode not in BODY_MODES:
            raise ValueError(f"default_body_mode {settings.default_body_mode!r}: use one of {sorted(BODY_MODES)}")
        self.s = settings
        self.sched = Scheduler(settings.scheduler)
        self.instances = self.sched.instances
        self.door = self.sched.front_door
        self.health = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        self.draining = False
        self._default_mode = BODY_MODES[settings.default_body_mode]

    # -- readiness ---------------------------------------------------------------------------
    def ready_instances(self) -> int:
        """Dispatchable instances whose engine answers its health check."""
        return sum(st.healthy and st.dispatchable for st in self.instances)

    async def set_health(self) -> None:
        ok = self.ready_instances() > 0 and not self.draining
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("readiness", EXT_PROC_SERVICE):
            await _maybe_await(self.health.set(name, status))
        await _maybe_await(self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING))
        await _maybe_await(self.health.set("", health_pb2.HealthCheckResponse.SERVING))

    async def health_loop(self) -> None:
        while True:
            await self.set_health()
            await asyncio.sleep(self.s.scheduler.health_interval_s)

    # -- the stream --------------------------------------------------------------------------
    async def Process(self, request_iterator: AsyncIterator[pb.ProcessingRequest],  # noqa: N802 (gRPC name)
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        ctx = _Stream(self._default_mode, self._default_mode)
        try:
            async for req in request_iterator:
                try:
                    out = await self._on(req, ctx)
                except Exception:  # never a traceback on the gateway's stream: a 500, logged here
                    log.exception("ext_proc message failed")
                    self._release(ctx)
                    out = [immediate(500, "the endpoint picker failed on this request (see its log)")]
                    ctx.done = True
                for resp in out:
                    yield resp
                if ctx.done:
                    return
        finally:
            self._release(ctx)

    async def _on(self, req: pb.ProcessingRequest, ctx: _Stream) -> list[pb.ProcessingResponse]:
        if not ctx.configured:
            ctx.configured = True
            if req.HasField("protocol_config"):
                ctx.request_mode = req.protocol_config.request_body_mode
                ctx.response_mode = req.protocol_config.response_body_mode
        if req.HasField("metadata_context"):
            self._read_subset(req, ctx)
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            ctx.headers = {h.key.lower(): _header_value(h) for h in req.request_headers.headers.headers}
            if not self._key_ok(ctx.headers):
                ctx.done = True
                self.sched.m.requests.labels("epp", "client_error").inc()
                return [immediate(401, "missing or wrong API key: send Authorization: Bearer KEY", "authorization",
                                  "authentication_error")]
            if req.request_headers.end_of_stream or ctx.request_mode == _Mode.NONE:
                return self._pick_without_body(req, ctx)
            if ctx.request_mode not in (_Mode.FULL_DUPLEX_STREAMED, _Mode.BUFFERED):
                ctx.done = True  # STREAMED / BUFFERED_PARTIAL / GRPC: Envoy would wait on per-chunk answers
                mode = _Mode.BodySendMode.Name(ctx.request_mode)
                log.error("gateway sends request bodies in mode %s; configure FULL_DUPLEX_STREAMED or BUFFERED", mode)
                return [immediate(500, f"the gateway's ext_proc request_body_mode {mode} is not supported by the "
                                  "endpoint picker; configure FULL_DUPLEX_STREAMED (GIE's) or BUFFERED")]
            if ctx.request_mode == _Mode.FULL_DUPLEX_STREAMED:
                return []  # answered once the whole body is here
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        if kind == "request_body":
            if ctx.instance is not None:  # already picked (a body after a headers-only pick): pass it on
                return [self._body_passthrough(req.request_body, ctx.request_mode, request=True)]
            ctx.body += req.request_body.body
            limit = self.s.scheduler.max_body_bytes
            if len(ctx.body) > limit:
                ctx.done = True
                return [immediate(413, f"request body is over the limit of {limit} bytes", "body",
                                  "request_too_large")]
            if not req.request_body.end_of_stream:
                return []
            return await self._pick(req, ctx)
        if kind == "request_trailers":
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            if ctx.pending is not None:
                ctx.pending.accepted_s = time.monotonic()  # the engine holds it from here on
            if req.response_headers.end_of_stream:
                self._release(ctx)
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
        if kind == "response_body":
            out = self._body_passthrough(req.response_body, ctx.response_mode, request=False)
            if req.response_body.end_of_stream:
                self._release(ctx)
            return [out]
        if kind == "response_trailers":
            self._release(ctx)
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    @staticmethod
    def _body_passthrough(body: pb.HttpBody, mode: int, request: bool) -> pb.ProcessingResponse:
        if mode == _Mode.FULL_DUPLEX_STREAMED:
            common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                body=body.body, end_of_stream=body.end_of_stream)))
        else:
            common = pb.CommonResponse()
        br = pb.BodyResponse(response=common)
        return pb.ProcessingResponse(request_body=br) if request else pb.ProcessingResponse(response_body=br)

    # -- picking -----------------------------------------------------------------------------
    def _key_ok(self, headers: dict[str, str]) -> bool:
        """The client's API key (`Authorization: Bearer KEY` or `x-api-key`), when one is set."""
        key = self.s.scheduler.api_key
        if not key:
            return True
        auth = headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
        return hmac.compare_digest(given.encode(), key.encode())

    def _route_headers(self, addr: str, content_length: int | None = None) -> pb.HeaderMutation:
        """The picked endpoint's header, the new body's length, and the cluster's internal
        token (the engines answer only requests carrying it; the scheduler sends it on its
        forwards, here the gateway forwards, so the EPP adds it)."""
        pairs = {self.s.destination_header: addr}
        if content_length is not None:
            pairs["content-length"] = str(content_length)
        pairs.update(token_headers(self.s.scheduler.internal_token))
        return _set_headers(pairs)

    @staticmethod
    def _read_subset(req: pb.ProcessingRequest, ctx: _Stream) -> None:
        """Remember the gateway's subset hint (GIE: filter metadata `envoy.lb.subset_hint`,
        key `x-gateway-destination-endpoint-subset`: a list of IP:PORT, or one
        comma-separated string) from whichever message of the stream carries it."""
        md = req.metadata_context.filter_metadata
        if SUBSET_NAMESPACE not in md or SUBSET_KEY not in md[SUBSET_NAMESPACE].fields:
            return
        v = md[SUBSET_NAMESPACE].fields[SUBSET_KEY]
        items = v.list_value.values if v.HasField("list_value") else [v]
        ctx.subset = frozenset(a.strip() for x in items if x.string_value for a in x.string_value.split(",")
                               if a.strip())

    def _excluded(self, ctx: _Stream) -> tuple[frozenset[int], bool]:
        """Instance indices outside the stream's subset hint, and whether it had one."""
        if ctx.subset is None:
            return frozenset(), False
        return frozenset(st.index for st in self.instances
                         if endpoint_address(st.ep.engine_url) not in ctx.subset), True

    def _no_endpoint(self, hinted: bool) -> pb.ProcessingResponse:
        why = ("no ready endpoint in the gateway's subset hint" if hinted
               else "no ready endpoint in the pool" if not len(self.instances) or not self.instances.dispatchable()
               else "no endpoint of the pool can take the request (every engine is failing its health check)")
        self.sched.m.requests.labels("epp", "no_instance").inc()
        return immediate(503, f"{why}; retry later", None, "engine_unavailable")

    def _pick_without_body(self, req: pb.ProcessingRequest, ctx: _Stream) -> list[pb.ProcessingResponse]:
        excluded, hinted = self._excluded(ctx)
        pool = [st for st in self.instances.dispatchable() if st.index not in excluded]
        ok = [st for st in pool if st.healthy] or pool
        if not ok:
            ctx.done = True
            return [self._no_endpoint(hinted)]
        st = ok[int(self.sched.dispatcher.rng.integers(len(ok)))]
        self._hold(ctx, st, None)
        self.sched.m.requests.labels("epp", "ok").inc()
        addr = endpoint_address(st.ep.engine_url)
        return [pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                header_mutation=self._route_headers(addr), clear_route_cache=True)),
            dynamic_metadata=self._metadata(addr))]

    async def _pick(self, req: pb.ProcessingRequest, ctx: _Stream) -> list[pb.ProcessingResponse]:
        raw = bytes(ctx.body)
        path = ctx.headers.get(":path", "").split("?", 1)[0]
        endpoint = ("chat" if path.endswith("/chat/completions") else "completions" if path.endswith("/completions")
                    else None)
        excluded, hinted = self._excluded(ctx)
        try:
            if endpoint is None:  # another path: tell the two request shapes by their fields
                try:
                    probe = oa.decode_json_body(raw)
                except ApiError:
                    self.sched.m.requests.labels("epp", "client_error").inc()
                    raise
                endpoint = "chat" if "messages" in probe else "completions"
            # the front door's own path from a body to a decision (early dispatch included)
            r = await self.door.route(raw, endpoint, "epp", excluded, ctx.headers)
        except (ApiError, HTTPUserError) as exc:
            ctx.done = True
            if isinstance(exc, ApiError):
                return [immediate(exc.status_code, exc.message, exc.param, exc.err_type)]
            return [immediate(exc.status, exc.message, exc.param, exc.type)]
        s = self.s.scheduler
        cand = r.cand
        dec = await self.door.first_decision(r, excluded)
        if dec is not None and dec.refused is not None:  # admission: as the front door's 429
            ctx.done = True
            msg, extra = self.door.refused("epp", dec, r.slo)
            return [immediate(429, msg, "x-slo-ttft-ms", "slo_unmeetable", extra)]
        st = self.instances.get(dec.choice) if dec is not None else None
        if st is None:  # none, or dropped by discovery while the predictions were out
            ctx.done = True
            return [self._no_endpoint(hinted)]
        self._hold(ctx, st, cand if s.count_pending else None)
        payload = r.payload
        addr = endpoint_address(st.ep.engine_url)
        self.sched.m.requests.labels("epp", "ok").inc()
        if log.isEnabledFor(logging.DEBUG):
            log.debug("picked %s (%s) for %s: %s", st.ep.name, addr, endpoint, dec.to_dict())  # type: ignore[union-attr]
        headers = self._route_headers(addr, len(payload))
        md = self._metadata(addr)
        if ctx.request_mode == _Mode.FULL_DUPLEX_STREAMED:
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                        header_mutation=headers, clear_route_cache=True)), dynamic_metadata=md),
                    pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                        body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                            body=payload, end_of_stream=True)))))]
        return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                    header_mutation=headers, body_mutation=pb.BodyMutation(body=payload), clear_route_cache=True)),
                dynamic_metadata=md)]

    def _metadata(self, addr: str) -> struct_pb2.Struct:
        md = struct_pb2.Struct()
        if self.s.metadata_namespace:
            md.update({self.s.metadata_namespace: {self.s.destination_header: addr}})
        else:
            md.update({self.s.destination_header: addr})
        return md

    def _hold(self, ctx: _Stream, st: InstanceState, cand) -> None:
        ctx.instance = st
        ctx.pending = self.instances.acquire(st, cand)

    def _release(self, ctx: _Stream) -> None:
        """End the stream's hold on its instance (once): outstanding count down; the
        pending entry stays until it ages out, as the scheduler's does, unless the
        request never reached the engine (no response seen)."""
        st, ctx.instance = ctx.instance, None
        if st is not None:
            entry = ctx.pending if ctx.pending is not None and ctx.pending.accepted_s is None else None
            self.instances.release(st, entry)


async def _maybe_await(x) -> None:
    if asyncio.iscoroutine(x):
        await x


class EppServer:
    """The gRPC server (ext_proc + health) over an `EndpointPicker`, on the running loop."""

    def __init__(self, settings: EppSettings):
        self.s = settings
        self.picker = EndpointPicker(settings)
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._health_task: asyncio.Task | None = None

    async def start(self, host: str, port: int) -> int:
        await self.picker.sched.start()
        self.server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(self.picker, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.picker.health, self.server)
        bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self.server.add_insecure_port(bind)
        except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
            raise AstroUserError(f"cannot listen on {bind} (in use, or not an address of this host): {exc}",
                                 field="--port") from None
        await self.picker.set_health()
        await self.server.start()
        self._health_task = asyncio.ensure_future(self.picker.health_loop())
        return self.port

    async def stop(self, grace_s: float = 0.0) -> None:
        self.picker.draining = True
        if self._health_task is not None:
            self._health_task.cancel()
        await self.picker.set_health()
        if self.server is not None:
            await self.server.stop(grace_s)
        await self.picker.sched.close()


class EppThread:
    """An `EppServer` on 127.0.0.1:<free port> in a background thread with its own event
    loop (tests); `address` is `127.0.0.1:PORT`. A context manager; every wait bounded."""

    def __init__(self, settings: EppSettings, host: str = "127.0.0.1", timeout_s: float = 20.0):
        self.settings = settings
        self.host = host
        self.timeout_s = timeout_s
        self.address = ""
        self.server: EppServer | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stopped: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="astro-epp")

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stopped = asyncio.Event()
        try:
            self.server = EppServer(self.settings)
            port = await self.server.start(self.host, 0)
            self.address = f"{self.host}:{port}"
        except BaseException as exc:  # reported to the starting thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        await self._stopped.wait()
        await self.server.stop(0.5)

    def __enter__(self) -> EppThread:
        self._thread.start()
        if not self._ready.wait(self.timeout_s):
            raise RuntimeError("the EPP did not start in time")
        if self._error is not None:
            raise RuntimeError(f"the EPP did not start: {self._error}") from self._error
        return self

    def __exit__(self, *exc) -> None:
        if self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        self._thread.join(timeout=10)

    def call(self, coro_fn, timeout_s: float = 10.0):
        """Run `coro_fn(server)` on the EPP's loop and return its result (tests: inspect state)."""
        fut = asyncio.run_coroutine_threadsafe(coro_fn(self.server), self._loop)
        return fut.result(timeout_s)


def run_epp(settings: EppSettings, host: str, port: int, log_level: str = "warning",
            ready_file: str | None = None) -> None:
    """Serve the EPP until SIGINT/SIGTERM (blocking): prints `ready: HOST:PORT` once
    listening (and writes it to `ready_file`); SIGTERM turns readiness NOT_SERVING and
    gives open streams `drain_s`."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")

    async def main() -> None:
        srv = EppServer(settings)
        bound = await srv.start(host, port)
        if settings.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(settings.metrics_port, addr=host, registry=srv.picker.sched.m.registry)
        addr = f"{host}:{bound}"
        print(f"ready: {addr}", flush=True)
        if ready_file:
            with open(ready_file, "w") as f:
                f.write(addr + "\n")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.warning("draining (%.1f s)", settings.drain_s)
        await srv.stop(settings.drain_s)

    asyncio.run(main())
