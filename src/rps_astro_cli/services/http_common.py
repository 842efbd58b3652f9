"""HTTP plumbing shared by the predictor, tagger and scheduler services (ARCHITECTURE.md §7).

- Errors: a user mistake is a 4xx whose JSON body names the field
  (`{"error": {"message", "type", "param", "code"}}`, OpenAI's shape); a server fault is
  a 5xx carrying a request id, logged with its traceback; no response carries a traceback.
- Optional API key: `Authorization: Bearer <key>` (or `x-api-key`) checked when set.
- Bounded bodies: `read_json_body` refuses bodies over `max_body_bytes` with 413.
- Loopback by default; `run_app` serves on 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import logging
import secrets
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger("astro.services")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB


class HTTPUserError(Exception):
    """A request the client must fix: becomes `status` with a JSON body naming `param`."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_


def error_body(message: str, param: str | None = None, type_: str = "invalid_request_error",
               code: int | None = None, request_id: str | None = None) -> dict[str, Any]:
    """OpenAI-style error JSON."""
    err: dict[str, Any] = {"message": message, "type": type_, "param": param, "code": code}
    if request_id:
        err["request_id"] = request_id
    return {"error": err}


def error_response(status: int, message: str, param: str | None = None,
                   type_: str = "invalid_request_error", request_id: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, param, type_, status, request_id), status_code=status)


def install_error_handlers(app: FastAPI) -> None:
    """`HTTPUserError` → its 4xx; an unknown route / wrong method → 404 / 405 in the same
    OpenAI shape (not FastAPI's `{"detail"}`); anything unexpected → 500 with a request id
    (logged)."""

    @app.exception_handler(HTTPUserError)
    async def _user(_: Request, exc: HTTPUserError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.type)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return http_error_response(request, exc)

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception) -> JSONResponse:
        rid = secrets.token_hex(6)
        log.error("request %s %s failed (id %s)", request.method, request.url.path, rid, exc_info=exc)
        return error_response(500, f"internal error (request id {rid})", None, "server_error", rid)


def http_error_response(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's routing/HTTP errors (404, 405, ...) as OpenAI-style JSON, keeping their
    headers (e.g. `Allow` on a 405)."""
    from rps_astro_cli.protocol.openai_types import http_error_body

    headers = dict(exc.headers or {})
    allow = {k.lower(): v for k, v in headers.items()}.get("allow")
    body = http_error_body(exc.status_code, request.method, request.url.path, exc.detail, allow)
    return JSONResponse(body, status_code=exc.status_code, headers=headers or None)


class FastRoutes:
    """ASGI front for a FastAPI app: the hot `routes` ({(method, path): async handler
    (Request) → Response}) are called directly, skipping FastAPI's middleware and
    dependency layers (~0.1–0.15 ms of CPU per request on the dev machine); everything else
    (lifespan, /metrics, /health, ...) goes to `app`. Errors keep the same shapes:
    `HTTPUserError` → its 4xx; anything else → 500 with a request id, logged. `state` is
    the app's state."""

    def __init__(self, app: FastAPI, routes: dict[tuple[str, str], Any]):
        self.app = app
        self.state = app.state
        self.routes = routes

    async def __call__(self, scope, receive, send) -> None:
        handler = self.routes.get((scope.get("method", ""), scope.get("path", ""))) if scope["type"] == "http" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            resp = await handler(request)
        except HTTPUserError as exc:
            resp = error_response(exc.status, exc.message, exc.param, exc.type)
        except Exception as exc:  # a server fault: 500 with a request id, never a traceback
            rid = secrets.token_hex(6)
            log.error("request %s %s failed (id %s)", scope.get("method"), scope.get("path"), rid, exc_info=exc)
            resp = error_response(500, f"internal error (request id {rid})", None, "server_error", rid)
        await resp(scope, receive, send)


def check_api_key(request: Request, api_key: str | None) -> None:
    """Raise 401 unless `api_key` is unset or the request carries it."""
    if not api_key:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
    if not secrets.compare_digest(given.encode(), api_key.encode()):
        raise HTTPUserError(401, "missing or wrong API key", "authorization", "authentication_error")


async def read_json_body(request: Request, max_body_bytes: int) -> tuple[bytes, dict[str, Any]]:
    """The raw body and its parsed JSON object.

    Raises:
        HTTPUserError: 413 over `max_body_bytes`; 400 not JSON / not an object.
    """
    raw = await read_body(request, max_body_bytes)
    return raw, parse_json_object(raw)


async def read_body(request: Request, max_body_bytes: int) -> bytes:
    """The raw body, refusing (413) more than `max_body_bytes` before reading it all. A
    client that disconnects mid-body is logged as one line and answered 499 (nobody reads it)."""
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > max_body_bytes:
        raise HTTPUserError(413, f"request body of {cl} bytes exceeds the limit of {max_body_bytes} bytes",
                            "body", "request_too_large")
    chunks = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise HTTPUserError(413, f"request body exceeds the limit of {max_body_bytes} bytes",
                                    "body", "request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # the client went away mid-body: one line, not a traceback
        log.warning("client disconnected during the body of %s %s (%d bytes received)", request.method,
                    request.url.path, size)
        raise HTTPUserError(499, "client disconnected before sending the whole body", "body") from None
    return b"".join(chunks)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Parse `raw` as a JSON object. Raises HTTPUserError(400) naming the problem (the
    field holding a lone surrogate, or `body`: `protocol.openai.loads_json_body`)."""
    from rps_astro_cli.protocol.openai import check_json_depth, loads_json_body
    from rps_astro_cli.protocol.openai_types import ApiError

    if (why := check_json_depth(raw)) is not None:
        raise HTTPUserError(400, why, "body")
    try:
        body = loads_json_body(raw)
    except ApiError as exc:
        raise HTTPUserError(exc.status_code, exc.message, exc.param) from None
    if not isinstance(body, dict):
        raise HTTPUserError(400, "request body must be a JSON object", "body")
    return body


def metrics_response(registry) -> Response:
    """Prometheus text exposition of `registry`."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def add_health_and_metrics(app: FastAPI, registry, fields: dict[str, Any],
                           problem: Callable[[], str | None] | None = None,
                           ready: Callable[[], Awaitable[str | None]] | None = None) -> None:
    """Register a service's GET /health, GET /ready and GET /metrics on `app`.

    /health is liveness: always 200 while the process serves, `{"status": "ok", **fields}`
    (e.g. its role), or `"degraded"` with `"problem"` when `problem()` names one (say,
    the Predictor's last engine `/status` fetch failed). /ready is readiness: 200
    `{"ready": true}` unless `await ready()` returns a reason, then 503 with it (no
    `ready`: ready as soon as it serves). /metrics: Prometheus text of `registry`."""
    body = {"status": "ok", **fields}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        why = problem() if problem is not None else None
        return dict(body) if why is None else {**body, "status": "degraded", "problem": why}

    @app.get("/ready")
    async def is_ready() -> JSONResponse:
        why = await ready() if ready is not None else None
        if why is None:
            return JSONResponse({"ready": True, "role": fields.get("role")})
        return JSONResponse({"ready": False, "role": fields.get("role"), "reason": why}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        return metrics_response(registry)


def new_registry() -> CollectorRegistry:
    """A fresh Prometheus registry with this process's CPU/memory collector."""
    from prometheus_client import CollectorRegistry, ProcessCollector, disable_created_metrics

    disable_created_metrics()  # no `_created` series: they double the scrape for nothing
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    return reg


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port that is free on `host` right now (asked from the OS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def bind_socket(host: str = DEFAULT_HOST, port: int = 0) -> socket.socket:
    """A listening TCP socket on (host, port) with TCP_NODELAY; port 0 asks the OS for a
    free port. The engine's binder, shared so every service avoids the ~40 ms
    delayed-ACK stall on small SSE writes.

    Raises:
        AstroUserError: the address cannot be bound (names `--port`).
    """
    from rps_astro_cli.protocol.http_server import bind_socket as _bind

    return _bind(host, port)


def warn_exposed(host: str, role: str, key: str | None) -> None:
    """Print a warning to stderr when `role` binds a non-loopback `host` with no key
    (internal token or API key) guarding it."""
    import sys

    from rps_astro_cli.protocol.internal_auth import TOKEN_ENV, exposure_warning

    name = "--api-key / $ASTRO_API_KEY" if role == "scheduler" else f"${TOKEN_ENV} (or --api-key)"
    if (msg := exposure_warning(host, role, bool(key), name)) is not None:
        print(msg, file=sys.stderr, flush=True)


def run_app(app: FastAPI | FastRoutes, host: str = DEFAULT_HOST, port: int = 0, log_level: str = "warning",
            ready_file: str | None = None, on_exit: Callable[[], None] | None = None) -> None:
    """Serve `app` with uvicorn until SIGINT/SIGTERM (blocking). Port 0 = any free port.
    Once listening, prints `ready: http://HOST:PORT` and writes that URL to `ready_file`
    (when given), as the engine does, so a supervisor can learn the port. SIGTERM drains
    (`protocol.http_server.serve_blocking`): `on_exit()` runs first, in-flight requests
    get $ASTRO_DRAIN_S (4 s) to finish, then exit 0.

    Raises:
        AstroUserError: the address cannot be bound.
    """
    from rps_astro_cli.protocol.http_server import serve_blocking

    serve_blocking(app, host, port, log_level, ready_file, use_uvloop=True, on_exit=on_exit)
