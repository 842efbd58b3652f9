"""A prompt's token ids as the engine tokenizes them, for prefix-aware dispatch.

A policy that reads prefix hits (`Dispatcher.needs_prefix`) compares each request's
prompt block hashes (`sim.prefix_cache.block_hashes` of its token ids) with the blocks
each engine reports cached (`/status?prefix_since=N`). The two agree only when both hash the same ids:

- the sim engine hashes `protocol.openai.prompt_token_ids` with the fallback tokenizer
  (role and text ids per message; no chat formatting tokens): `engine/sim_server.py`
  passes exactly those to `SimEngine.submit`;
- the vLLM plugin reports the blocks vLLM cached, renamed into astro's chained hash of
  **vLLM's** token ids (`engine.vllm_bridge.PrefixIndex`): the model's tokenizer, chat
  template applied.

So on a vLLM fleet the scheduler asks an engine's `POST /tokenize` (vLLM's OpenAI
server route) for a text prompt's ids. Its body mirrors the request so the ids are
the ones a chat / completions request of that body is prefilled with (vLLM 0.32's
`TokenizeChatRequest` / `TokenizeCompletionRequest`, whose defaults equal the chat /
completions requests': chat `add_generation_prompt` true, `continue_final_message`
false, `add_special_tokens` false; completions `add_special_tokens` true); the body's
own values, `chat_template`, `chat_template_kwargs` and `tools` are passed through, and
`reasoning_effort` becomes the template's `enable_thinking` as the chat request does.
Only the fields vLLM's tokenize request declares are sent (vLLM logs unknown ones).

Where the ids come from (`SchedulerSettings.prefix_tokenizer`):
- `fallback`: always the fallback ids (today's; no RPC).
- `engine`: always `/tokenize` of a healthy, dispatchable engine.
- `auto` (default): `/tokenize` only when some engine is known not to be an astro sim
  engine: the health loop asks each engine's `GET /version` once (the sim engine
  answers `"engine": "astro-sim"`; vLLM answers without that key; a 404 is "not
  astro-sim" too; a failed call is asked again at the next check). Until an engine has
  answered it counts as a sim engine. A sim fleet therefore keeps the fallback ids —
  the ones its prefix cache uses (its own /tokenize would give chat formatting tokens
  as id 0, which its cache never sees) — with no RPC per request, as before.

No RPC either for a token-id completions prompt (its ids are given), a prompt with
image / video parts (vLLM keys such blocks by their media too: no text-only id list
names them), or a policy that reads no prefix hits. No prompt text is kept: the ids
are hashed into blocks and dropped.

The RPC starts once the body has been validated (nothing reaches an engine for a bad
body), while the tag RPC is in flight, and has a deadline (`tokenize_deadline_s`,
counted from its start). A late or failed answer falls back to the fallback ids,
counted in `astro:tokenize_rpcs_total{outcome}` (ok | timeout | error) and as a
decision without its signal in `astro:dispatch_fallbacks_total{policy,reason}` (reason
"tokenize timeout" | "tokenize error" | "tokenize no engine": every engine that could
answer is out of rotation). A late RPC is left to finish in the background (its
keep-alive connection is kept), as a late tag is.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from rps_astro_cli.protocol import openai as oa
from rps_astro_cli.protocol.http_server import off_loop
from rps_astro_cli.protocol.openai_types import ParsedRequest
from rps_astro_cli.services.rpc import RpcError
from rps_astro_cli.services.scheduler.clients import Clients, swallow
from rps_astro_cli.services.scheduler.instances import Instances
from rps_astro_cli.services.scheduler.metrics import SchedulerMetrics
from rps_astro_cli.services.scheduler.settings import SchedulerSettings
from rps_astro_cli.tokens import token_ids_fallback

ASTRO_SIM = "astro-sim"  # `InstanceState.engine_kind` of an engine whose /version says so
OTHER_ENGINE = "other"  # one whose /version answered without it (vLLM), or has no /version


def engine_kind_of_version(status: int, body: bytes) -> str | None:
    """An engine's kind from its `GET /version` answer: `ASTRO_SIM` when the body says
    `"engine": "astro-sim"`, `OTHER_ENGINE` for any other 200 or a 404 (no such route:
    not astro's sim engine), None (unknown: ask again) otherwise."""
    if status == 404:
        return OTHER_ENGINE
    if status != 200:
        return None
    try:
        d = json.loads(body)
    except ValueError:
        return OTHER_ENGINE
    return ASTRO_SIM if isinstance(d, dict) and d.get("engine") == ASTRO_SIM else OTHER_ENGINE


def tokenize_body(body: dict[str, Any], endpoint: str) -> dict[str, Any] | None:
    """The vLLM `/tokenize` body whose ids equal those a validated chat / completions
    request `body` is prefilled with (module docstring); None when the prompt needs no
    RPC: a completions prompt of token ids."""
    out: dict[str, Any] = {}
    if body.get("model") is not None:
        out["model"] = body["model"]
    if endpoint == "completions":
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if not isinstance(p, str):
            return None
        out["prompt"] = p
        out["add_special_tokens"] = bool(body.get("add_special_tokens", True))
        return out
    out["messages"] = body.get("messages")
    for key, default in (("add_generation_prompt", True), ("continue_final_message", False),
                         ("add_special_tokens", False)):
        out[key] = bool(body.get(key, default))
    for key in ("chat_template", "tools"):
        if body.get(key) is not None:
            out[key] = body[key]
    kwargs = body.get("chat_template_kwargs")
    effort = body.get("reasoning_effort")
    if effort is not None and not (isinstance(kwargs, dict) and "enable_thinking" in kwargs):
        kwargs = {**(kwargs if isinstance(kwargs, dict) else {}), "enable_thinking": effort != "none"}
    if kwargs is not None:
        out["chat_template_kwargs"] = kwargs
    return out


def ids_of_reply(body: bytes) -> tuple[int, ...]:
    """The `tokens` of a `/tokenize` answer; raises ValueError when it has none."""
    d = json.loads(body)
    toks = d.get("tokens") if isinstance(d, dict) else None
    if not isinstance(toks, list) or not toks or not all(type(t) is int and t >= 0 for t in toks):
        raise ValueError("/tokenize answered no list of token ids")
    return tuple(toks)


class Tokenize:
    """One started `/tokenize` RPC (`PromptIds.start`): the task and when it began."""

    __slots__ = ("task", "started_s")

    def __init__(self, task: asyncio.Future[tuple[int, bytes]], started_s: float):
        self.task = task
        self.started_s = started_s  # time.perf_counter()


class PromptIds:
    """`start` the engine tokenization of a request's prompt (or not: see module
    docstring), then `finish` it into the ids the prefix hashes are taken of."""

    def __init__(self, settings: SchedulerSettings, instances: Instances, clients: Clients,
                 metrics: SchedulerMetrics, policy_name: str):
        self.s = settings
        self.mode = settings.prefix_tokenizer
        self.instances = instances
        self.clients = clients
        self.m = metrics
        self.policy_name = policy_name
        self._next = 0  # round robin over the engines that may answer

    @property
    def probes_version(self) -> bool:
        """Whether the health loop must learn each engine's kind (`auto`)."""
        return self.mode == "auto"

    def _engine_url(self) -> str | None:
        """A healthy, dispatchable engine to ask (round robin), "" when one could answer
        but none is in rotation, None when no engine's ids are wanted (`fallback`, or
        `auto` with no engine known not to be a sim engine)."""
        if self.mode == "fallback":
            return None
        sts = [st for st in self.instances if self.mode == "engine" or st.engine_kind == OTHER_ENGINE]
        if not sts:
            return None
        ok = [st for st in sts if st.healthy and st.dispatchable]
        if not ok:
            return ""
        self._next += 1
        return ok[self._next % len(ok)].ep.engine_url

    def start(self, body: dict[str, Any], endpoint: str, parsed: ParsedRequest) -> Tokenize | None:
        """Send the `/tokenize` RPC for a validated `body` now, or None when its ids are
        the fallback's (or given): see module docstring."""
        if self.mode == "fallback" or parsed.modality != "text":
            return None
        url = self._engine_url()
        if url is None:
            return None
        tb = tokenize_body(body, endpoint)
        if tb is None:
            return None
        if not url:
            self.m.fallbacks.labels(self.policy_name, "tokenize no engine").inc()
            return None
        payload = json.dumps(tb).encode()
        return Tokenize(asyncio.ensure_future(self.clients.post_json(url, "/tokenize", payload)),
                        time.perf_counter())

    async def finish(self, tok: Tokenize | None, body: dict[str, Any], endpoint: str, heavy: bool = False
                     ) -> tuple[tuple[int, ...], bool]:
        """(the prompt's token ids, whether they are the engine's): the engine's answer
        if it came within `tokenize_deadline_s` of the RPC's start, else (and without
        an RPC) `protocol.openai.prompt_token_ids` with the fallback tokenizer (`heavy`:
        a big body, tokenized off the event loop)."""
        if tok is not None:
            outcome = "timeout"
            left = self.s.tokenize_deadline_s - (time.perf_counter() - tok.started_s)
            done = tok.task.done()
            if not done and left > 0:
                done = bool((await asyncio.wait({tok.task}, timeout=left))[0])
            if done:
                try:
                    status, raw = tok.task.result()
                    if status != 200:
                        raise ValueError(f"/tokenize answered HTTP {status}")
                    ids = ids_of_reply(raw)
                except (TimeoutError, RpcError, ValueError, KeyError, TypeError):
                    outcome = "error"
                else:
                    self.m.tokenize_rpcs.labels("ok").inc()
                    return ids, True
            else:
                tok.task.add_done_callback(swallow)
            self.m.tokenize_rpcs.labels(outcome).inc()
            self.m.fallbacks.labels(self.policy_name, f"tokenize {outcome}").inc()
        if heavy:
            return await off_loop(oa.prompt_token_ids, body, endpoint, token_ids_fallback), False
        return oa.prompt_token_ids(body, endpoint, token_ids_fallback), False

    def abandon(self, tok: Tokenize | None) -> None:
        """Leave a started RPC to finish in the background (the request went away)."""
        if tok is not None:
            tok.task.add_done_callback(swallow)
