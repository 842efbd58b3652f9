"""The shared token of a cluster's internal services (engines, Predictors, the tagger).

The scheduler's front door has its own client key (`--api-key`); the services behind it
answer only callers that carry the cluster's internal token:

- where it comes from: `$ASTRO_INTERNAL_TOKEN`, or the file named by
  `$ASTRO_INTERNAL_TOKEN_FILE` (one line; a mounted Kubernetes Secret), never a
  command-line flag (argv is readable by every user of the machine via `ps`).
  `astro serve` makes one per cluster (`new_token`) and hands it to its children in
  their environment;
- what callers send: `x-astro-internal-token: <token>` (the scheduler, the Predictor,
  `astro bench`), or `Authorization: Bearer <token>` (what Prometheus scrape configs
  can send from a Secret);
- what is checked: every HTTP route except `OPEN_PATHS` (`/health` liveness and `/ready`
  readiness: Kubernetes httpGet probes cannot read a Secret, and both say only
  whether the process serves, never request data); a missing or wrong token is a 401 in
  OpenAI's error shape naming the header and the fix.

`guard(app, token)` wraps any ASGI app (FastAPI, the services' `FastRoutes`, the sim
engine); no token → the app unchanged (a standalone engine on a laptop stays open).
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import os
import secrets
from collections.abc import Mapping
from typing import Any

from rps_astro_cli.errors import AstroUserError

TOKEN_ENV = "ASTRO_INTERNAL_TOKEN"
TOKEN_FILE_ENV = "ASTRO_INTERNAL_TOKEN_FILE"
TOKEN_HEADER = "x-astro-internal-token"
OPEN_PATHS = frozenset({"/health", "/ready"})


def internal_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The internal token from `$ASTRO_INTERNAL_TOKEN`, else the first line of
    `$ASTRO_INTERNAL_TOKEN_FILE`; None when neither is set.

    Raises:
        AstroUserError: the token file cannot be read or is empty.
    """
    env = os.environ if environ is None else environ
    tok = env.get(TOKEN_ENV, "").strip()
    if tok:
        return tok
    path = env.get(TOKEN_FILE_ENV, "").strip()
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            tok = fh.readline().strip()
    except OSError as exc:
        raise AstroUserError(f"${TOKEN_FILE_ENV} {path}: cannot read the internal token ({exc.strerror})",
                             field=TOKEN_FILE_ENV, fix="point it at a readable file holding the token") from None
    if not tok:
        raise AstroUserError(f"${TOKEN_FILE_ENV} {path} is empty", field=TOKEN_FILE_ENV,
                             fix="write the cluster's token on its first line")
    return tok


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def token_headers(token: str | None) -> dict[str, str]:
    """The header a caller sends (empty without a token)."""
    return {TOKEN_HEADER: token} if token else {}


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and `localhost`; False for 0.0.0.0, :: and real addresses."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def exposure_warning(host: str, role: str, keyed: bool, key_name: str) -> str | None:
    """A warning line when `role` binds a non-loopback `host` without a key, else None."""
    if keyed or is_loopback(host):
        return None
    return (f"warning: the {role} listens on {host} without {key_name}: anyone who can reach that address "
            f"can use it; set {key_name} (or bind 127.0.0.1)")


def unauthorized() -> tuple[bytes, list[tuple[bytes, bytes]]]:
    body = json.dumps({"error": {
        "message": f"missing or wrong internal token: send header {TOKEN_HEADER} (or Authorization: Bearer) "
                   f"with the cluster's token; callers read it from ${TOKEN_ENV} or ${TOKEN_FILE_ENV} "
                   "(`astro serve` sets it for its children and writes it to <run dir>/internal-token)",
        "type": "authentication_error", "param": TOKEN_HEADER, "code": 401}}).encode()
    """The 401's JSON body and headers (shared with the vLLM middleware)."""
    return body, [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                  (b"www-authenticate", b"Bearer")]


class InternalAuth:
    """ASGI wrapper: HTTP requests outside `OPEN_PATHS` need the token (module docstring).
    Lifespan and everything else pass through; `state` is the wrapped app's."""

    def __init__(self, app: Any, token: str):
        self.app = app
        self.state = getattr(app, "state", None)
        self._token = token.encode()
        self._bearer = b"bearer " + self._token

    def allowed(self, headers: list[tuple[bytes, bytes]]) -> bool:
        ok = False
        for name, value in headers:
            if name == b"x-astro-internal-token":
                ok |= hmac.compare_digest(value, self._token)
            elif name == b"authorization":
                v = value[:7].lower() + value[7:]
                ok |= hmac.compare_digest(v, self._bearer)
        return ok

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope.get("path") not in OPEN_PATHS and not self.allowed(scope["headers"]):
            body, headers = unauthorized()
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def guard(app: Any, token: str | None) -> Any:
    """`app` behind the internal-token check, or `app` itself when `token` is None."""
    return InternalAuth(app, token) if token else app


__all__ = ["OPEN_PATHS", "TOKEN_ENV", "TOKEN_FILE_ENV", "TOKEN_HEADER", "InternalAuth", "exposure_warning",
           "guard", "internal_token", "is_loopback", "new_token", "token_headers", "unauthorized"]
