"""What one request may cost a server, and the limits on how clients reach it.

Two families, both with safe defaults an operator can change through the environment
(every process `astro serve` starts inherits it: scheduler, engines, Predictors, tagger):

- **Request cost** (`CostLimits`): one authenticated request could otherwise ask for
  `n: 16384` choices with echo and 20 log-probabilities per token and make a response of
  gigabytes (issue 29: `n: 512` gave 570 MB). Checked where a request is parsed (the
  scheduler before dispatch, the sim engine once it knows `max_tokens`); a request over
  a limit is a 400 naming the field and the limit. `max_response_bytes` is the relay's
  last line: a response that grows past it is cut.
- **Connection limits** (`HttpLimits`): header size and count (431), time to read the
  headers and the body (408), and connections held at once per server (503), enforced by
  `protocol.http_server`'s HTTP protocol before any route (and before the API key is
  checked): an unauthenticated client cannot make a server hold more than
  `max_header_bytes` per connection, nor hold a connection it does not use.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.protocol.openai_types import ApiError, ParsedRequest

ENV_PREFIX = "ASTRO_"


@dataclass(frozen=True)
class CostLimits:
    """Bounds on what one completion request may ask a server to produce.

    max_n: choices per request (`n`); vLLM allows 16384, OpenAI 128.
    max_generated_tokens: n × max_tokens, the output tokens one request may ask for
        (tokens).
    max_logprob_entries: log-probability entries in one response: (top log-probabilities
        + 1) × the tokens that carry them (n × (max_tokens + the echoed prompt)) (entries).
    max_response_bytes: bytes the scheduler relays for one response before it cuts it
        (bytes).
    """

    max_n: int = 128
    max_generated_tokens: int = 262_144
    max_logprob_entries: int = 1_048_576
    max_response_bytes: int = 256 * 1024 * 1024

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CostLimits:
        """The defaults, each overridden by `ASTRO_<FIELD>` (e.g. `ASTRO_MAX_N=16`).

        Raises:
            AstroUserError: a variable that is not a whole number ≥ 1 (names it).
        """
        return cls(**_ints_from_env(cls, os.environ if env is None else env))


@dataclass(frozen=True)
class HttpLimits:
    """Bounds on how a client may use a connection, before any route runs.

    max_header_bytes: request line + headers of one request (bytes; more → 431).
    max_headers: header fields in one request (more → 431).
    header_timeout_s: time from a request's first byte (or the connection's start) to its
        last header (s; longer → 408, connection closed).
    body_timeout_s: time from the last header to the last body byte (s; longer → 408).
    max_connections: connections one server holds at once (more → 503 and closed).
    """

    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 4096

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> HttpLimits:
        """The defaults, each overridden by `ASTRO_HTTP_<FIELD>` (e.g.
        `ASTRO_HTTP_HEADER_TIMEOUT_S=30`).

        Raises:
            AstroUserError: a variable that is not a number > 0 (names it).
        """
        return cls(**_ints_from_env(cls, os.environ if env is None else env, prefix=ENV_PREFIX + "HTTP_"))


def env_name(field: str, prefix: str = ENV_PREFIX) -> str:
    return prefix + field.upper()


def _ints_from_env(cls: type, env: Mapping[str, str], prefix: str = ENV_PREFIX) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    for f in fields(cls):
        name = env_name(f.name, prefix)
        raw = env.get(name)
        if raw is None or raw.strip() == "":
            continue
        is_int = f.type in ("int", int)
        try:
            v: float | int = int(raw) if is_int else float(raw)
        except ValueError:
            v = -1
        if not (math.isfinite(v) and v > 0 and (not is_int or v >= 1)):
            kind = "a whole number >= 1" if is_int else "a number of seconds > 0"
            raise AstroUserError(f"{name}={raw!r} is not {kind}", field=name,
                                 fix=f"unset it for the default ({getattr(cls(), f.name)})")
        out[f.name] = v
    return out


def check_request_cost(req: ParsedRequest, prompt_tokens: int, max_tokens: int | None,
                       limits: CostLimits) -> None:
    """Refuse a parsed request whose response would be over `limits`: its `n` choices of up
    to `max_tokens` output tokens each (None: not known yet — the scheduler may not know
    the context length; the engine checks again with it), and its log-probabilities per
    token over those tokens and, with `echo`, over the `prompt_tokens` prompt.

    Raises:
        ApiError: 400 naming the field, the limit and the variable that sets it.
    """
    n, lp, echo = req.n, req.logprobs, req.echo
    if n > limits.max_n:
        raise ApiError(400, f"n: {n} choices is over this server's limit of {limits.max_n} per request "
                       f"({env_name('max_n')}); ask for fewer or send several requests", "n")
    if max_tokens is not None and n * max_tokens > limits.max_generated_tokens:
        raise ApiError(400, f"max_tokens: n × max_tokens = {n} × {max_tokens} = {n * max_tokens} output tokens "
                       f"is over this server's limit of {limits.max_generated_tokens} per request "
                       f"({env_name('max_generated_tokens')}); lower max_tokens or n", "max_tokens")
    if lp is None:
        return
    per_choice = (max_tokens or 0) + (prompt_tokens if echo else 0)
    entries = (max(lp, 0) + 1) * n * per_choice
    if entries > limits.max_logprob_entries:
        what = "max_tokens + the echoed prompt" if echo else "max_tokens"
        raise ApiError(400, f"logprobs: {max(lp, 0) + 1} log-probabilities × {n * per_choice} tokens "
                       f"(n × ({what})) = {entries} entries is over this server's limit of "
                       f"{limits.max_logprob_entries} per response ({env_name('max_logprob_entries')}); "
                       f"lower logprobs, n or max_tokens{', or drop echo' if echo else ''}", "logprobs")
