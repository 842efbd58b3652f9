"""The front door: one OpenAI request from arrival to the response handed back.

1. Read the body (bounded: 413 over `max_body_bytes`) and start the tag RPC on the raw
   body at once; validate the body with the engine's own parser
   (`protocol/openai.py`) while the tagger works. Bad input → 4xx naming the field,
   and nothing reaches an engine; an unknown `model` → 404. A prompt far past every
   engine's context is refused (400) on a lower bound of its tokens taken without
   tokenizing (`protocol.openai.prompt_tokens_at_least`), before it is counted; a big
   body (over `OFF_LOOP_BYTES`) is decoded and bounded on the worker thread first and
   its tag RPC sent only after that check, so the tagger never tokenizes a prompt
   certainly too long.
2. Describe the request as a `CandidateRequest` (the tag's lengths and media costs; the
   client's true length under `oracle_lengths`; capped by `max_tokens`) and let the
   `Dispatcher` choose an instance. For a policy that reads prefix-cache hits
   (cache_aware, power_of_k's pin, or any prediction-guided policy's look-ahead once
   an engine's `/status` reports a prefix cache: `Dispatcher.prefix_wanted`), the
   prompt's block hashes are computed here, once per request
   (`sim.prefix_cache.block_hashes` of the instances' block size), from the token ids
   the engines cache by (`prompt_ids.py`, setting `prefix_tokenizer`): on a sim fleet
   the fallback tokenizer's (`protocol.openai.prompt_token_ids`, no RPC, as the sim
   engine hashes); on a vLLM fleet an engine's `POST /tokenize` answer (the model's
   tokenizer and chat template), sent once the body is valid, while the tag RPC is in
   flight, with a deadline (`tokenize_deadline_s`) after which the fallback ids are
   hashed (counted). A token-id prompt's ids are its own (no RPC). With the engine's
   ids the candidate's prompt length is their count (`in_engine_tokens`): the unit
   of the engine's `/status` and of its hits.
   Early dispatch (`early_dispatch`, on by default): when the decision reads no reply
   length (objective ttft, or a policy that asks no Predictor) a text request's decision
   starts right after parsing, while the tagger works — its TTFT on an instance does not
   depend on its own reply length, and the parser counts prompt tokens as the tagger
   does. The forward still waits for the tag (the engine's `/status` and the pending list
   carry the tag's length); the decision's look-aheads stop at the candidate's first
   token (`first_token_only`: the same TTFT for a fraction of the work on a busy
   instance), so its `e2e_s` predictions equal its TTFT ones
   (`DecisionRecord.early_dispatch`). When the prompt's ids come from `/tokenize`, the
   early decision starts once they are in (or at the deadline): fallback ids never match
   a vLLM engine's cache, so deciding before they arrive would leave a prefix-aware
   policy blind on the one signal it exists for; the wait is bounded by
   `tokenize_deadline_s` (20 ms, under the tag's 50 ms) and overlaps the tag RPC. Without
   early dispatch the ids are awaited after the tag, so the RPC costs no wait unless it
   is slower than the tagger.
3. Forward the body with `vllm_xargs.astro_predicted_output_tokens` set to the length the
   dispatch used (so the engine's `/status` shows it) and relay the response
   (`relay.py`). Late tag (`late_tag`, on by default): when nothing reads that length
   before the tag lands — the early decision's look-aheads all run here (or it asks no
   Predictor) and every engine's in-instance policy is fcfs — the decision is made at
   once (not as a task), the body goes as the client sent it, with an `x-request-id`, and
   the tag's length follows: onto the request's pending entry and, by that id, onto its
   rows of the engine's later `/status` polls (`instances.late_lengths_onto`), as if the
   body had carried it; its tag RPC goes out right after the forward, not before parsing
   as others' do (a text body: one naming no image or video part), so nothing of the tag
   is on its path. A request whose instance fails before anything was sent to the client
   is retried once on another instance (the failed one's breaker opens).

Every request ends in a response or an error the client sees, and in one
`DecisionRecord` (`GET /decisions`). A client that disconnects before the response is
handed over (while dispatching, waiting for a non-streaming response or a stream's first
chunk) cancels the forward: the engine connection is closed, so the engine aborts the
request (outcome `client_disconnected`); a relayed stream does the same
(`relay.stream_response`).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rps_astro_cli.dispatch.admission import (
    NO_ROOM,
    QUEUE_FULL,
    REFUSED_TTFT,
    RequestSlo,
    RouterQueue,
    parse_request_slo,
    remaining_slo,
)
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.protocol import openai as oa
from rps_astro_cli.protocol.http_server import OFF_LOOP_BYTES, off_loop
from rps_astro_cli.protocol.limits import check_request_cost
from rps_astro_cli.protocol.openai_types import ApiError, ApiLimits, ParsedRequest, bad
from rps_astro_cli.protocol.service_wire import TagResult
from rps_astro_cli.services.http_common import HTTPUserError, check_api_key, error_response, read_body
from rps_astro_cli.services.rpc import Response as RawResponse
from rps_astro_cli.services.rpc import RpcError
from rps_astro_cli.services.scheduler.clients import Clients
from rps_astro_cli.services.scheduler.dispatcher import Dispatcher
from rps_astro_cli.services.scheduler.instances import Instances, InstanceState, Pending
from rps_astro_cli.services.scheduler.metrics import SchedulerMetrics
from rps_astro_cli.services.scheduler.prompt_ids import PromptIds, Tokenize
from rps_astro_cli.services.scheduler.relay import (
    ClientWatch,
    RelayResponse,
    relay_headers,
    stream_response,
)
from rps_astro_cli.services.scheduler.settings import SchedulerSettings
from rps_astro_cli.services.scheduler.tagging import TagClient
from rps_astro_cli.sim.prefix_cache import block_hashes
from rps_astro_cli.tokens import fallback_space_chars
from rps_astro_cli.types import CandidateRequest, DecisionRecord, DispatchDecision

# the front door refuses a prompt this many times longer than every engine's context (by
# the parser's fallback count, or first by a lower bound of it taken without tokenizing:
# no tokenizer counts half as many tokens), before hashing, predicting or forwarding it
# (and a big body before its tag RPC); an engine refuses the ones nearer its limit itself
DOOR_CONTEXT_FACTOR = 2
# a whole (non-streamed) response up to this size is read before it is relayed (so a 5xx
# can be retried elsewhere); a bigger one is relayed as it arrives, never held whole
_BUFFERED_BYTES = 1 << 20
ENGINE_5XX_BREAKER = 3  # consecutive 5xx answers that take an instance out of rotation
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# a prompt's prefix for the dispatch: (block hashes, block size, the engine's prompt
# token count when the ids are the engine's, else None: the candidate's count caps hits)
PromptBlocks = tuple[tuple[int, ...], int, int | None]


def candidate_of(tag: TagResult | None, parsed: ParsedRequest, default_output_tokens: int,
                 oracle_lengths: bool) -> CandidateRequest:
    """The request as the dispatch sees it: the tag's lengths and media costs (without a
    tag: the parser's text tokens and `default_output_tokens`), the client's true length
    instead when `oracle_lengths` and it sent one, capped by `max_tokens`."""
    if tag is not None:
        cand = CandidateRequest(tag.prompt_tokens, tag.predicted_output_tokens, tag.modality, tag.vision_tokens,
                                tag.encoder_s, tag.preprocess_s)
    else:
        cand = CandidateRequest(max(1, parsed.text_tokens), default_output_tokens, parsed.modality)
    out_tokens = cand.predicted_output_tokens
    if oracle_lengths and parsed.output_tokens is not None:
        out_tokens = parsed.output_tokens
    if parsed.max_tokens is not None:
        out_tokens = max(1, min(out_tokens, parsed.max_tokens))
    if out_tokens != cand.predicted_output_tokens or parsed.req_class:
        cand = CandidateRequest(cand.prompt_tokens, out_tokens, cand.modality, cand.vision_tokens, cand.encoder_s,
                                cand.preprocess_s, parsed.req_class or None)
    return cand


def in_engine_tokens(cand: CandidateRequest, blocks: PromptBlocks) -> CandidateRequest:
    """`cand` with its prompt length in the engine's tokens when the prefix ids are the
    engine's (`/tokenize`): the unit of the engine's `/status` (its queue's and batch's
    prompt lengths) and of the hit in `cached_tokens`, so the Predictor's prefill, the
    KV headroom gate and the pending list count in one unit. Unchanged otherwise (the
    tagger's fallback count, the sim engine's own unit)."""
    n = blocks[2]
    return cand if n is None or n == cand.prompt_tokens else replace(cand, prompt_tokens=n)


class LateTag:
    """The tag of a request forwarded before it landed (`SchedulerSettings.late_tag`):
    its `x-request-id`, the tag (an RPC in flight; None until the forward is out, when
    the RPC starts — or the in-process tagger runs, and it stays None), and where the
    tag's length goes once it lands — the request's pending entry and decision record,
    and its instance's `late_lengths` (put on the engine's `/status` rows of it)."""

    __slots__ = ("request_id", "task", "tokens", "st", "entry", "rec")

    def __init__(self, request_id: str, task: asyncio.Future[tuple[int, bytes]] | None):
        self.request_id = request_id
        self.task = task
        self.tokens: int | None = None  # the tag's length for the request (None: not landed, or failed)
        self.st: InstanceState | None = None
        self.entry: Pending | None = None
        self.rec: DecisionRecord | None = None

    def place(self, st: InstanceState, entry: Pending | None, rec: DecisionRecord) -> None:
        """The request is forwarded to `st` (a retry moves it)."""
        if self.st is not None and self.st is not st:
            self.st.late_lengths.pop(self.request_id, None)
        self.st, self.entry, self.rec = st, entry, rec
        self._apply()

    def land(self, tokens: int | None) -> None:
        """The tag's length (None: the tag failed; the default stays)."""
        self.tokens = tokens
        self._apply()

    def _apply(self) -> None:
        if self.tokens is None or self.st is None:
            return
        if self.entry is not None:
            self.entry.predicted_output_tokens = self.tokens
        if self.rec is not None:
            self.rec.predicted_output_tokens = self.tokens
        self.st.remember_length(self.request_id, self.tokens)


@dataclass
class Route:
    """A request on its way to a decision (`FrontDoor.route`): its body (with the tag's
    predicted length in `vllm_xargs`) and parsed form, the candidate the dispatch sees,
    its prompt blocks, the body to forward (`payload`), the time spent waiting for the
    tag (µs), and the decision started before the tag arrived (`early`; None: none)."""

    body: dict[str, Any]
    parsed: ParsedRequest
    cand: CandidateRequest
    blocks: PromptBlocks
    payload: bytes
    tag_wait_us: float
    early: asyncio.Future[DispatchDecision | None] | None = None
    slo: RequestSlo | None = None  # its SLO (headers x-slo-*, body priority, recipe classes)
    # when its route began on the engines' clock (`FrontDoor.engine_now_s`), the clock of
    # its SLO's targets: they are engine seconds, as the predictions are
    received_s: float = 0.0
    late: LateTag | None = None  # forwarded before its tag (`SchedulerSettings.late_tag`)

    @property
    def first_token_only(self) -> bool:
        """Whether its later decisions (a retry, the router queue's) read the TTFT only:
        forwarded before its tag, its candidate carries the default length, not one."""
        return self.late is not None

    def cancel(self) -> None:
        """Drop the early decision (the request went away)."""
        if self.early is not None:
            self.early.cancel()


class FrontDoor:
    """`handle` one `/v1/chat/completions` or `/v1/completions` request (see module
    docstring). `decisions` holds the last `decisions_kept` records."""

    def __init__(self, settings: SchedulerSettings, instances: Instances, clients: Clients, tags: TagClient,
                 dispatcher: Dispatcher, metrics: SchedulerMetrics, models: set[str],
                 prompt_ids: PromptIds | None = None):
        self.s = settings
        self.instances = instances
        self.clients = clients
        self.tags = tags
        self.dispatcher = dispatcher
        self.m = metrics
        self.models = models
        self.prompt_ids = prompt_ids or PromptIds(settings, instances, clients, metrics, dispatcher.policy_name)
        fallback_space_chars()  # derived once (~40 ms) here, not in the first big request's decode
        self.decisions: collections.deque[DecisionRecord] = collections.deque(maxlen=settings.decisions_kept)
        self.cost = settings.cost_limits
        self._n = 0
        adm = dispatcher.admission
        # admission mode "queue": requests in time but without room anywhere now, decided
        # again every `queue_retry_s` in the queue's order by one task (`_drain_queue`)
        self.router_queue = RouterQueue(adm.queue_max) if adm.mode == "queue" else None
        self._queue_task: asyncio.Task[None] | None = None

    def context_limit(self) -> int | None:
        """The largest context length (`max_model_len`, tokens) any instance reports in its
        `/status`; None until every instance has reported one (or when the policy polls
        no status)."""
        lens = [st.status.limits.max_model_len for st in self.instances if st.status is not None]
        return max(lens) if lens and len(lens) == len(self.instances) else None

    def check_model(self, parsed: ParsedRequest) -> None:
        """404 when the request names a model no engine serves."""
        if parsed.model is not None and self.models and parsed.model not in self.models:
            raise HTTPUserError(404, f"model {parsed.model!r} is not served here; use one of: "
                                f"{', '.join(sorted(self.models))}", "model", "NotFoundError")

    def parse(self, raw: bytes, endpoint: str, limit: int | None = None) -> tuple[dict[str, Any], ParsedRequest]:
        """The body as JSON and as the engine's parser reads it (`endpoint` chat |
        completions): `decode`, then `validate`; raises `ApiError` (400 / 413, naming the
        field) or `HTTPUserError` (404: a model no engine serves). `limit`: the
        engines' context length (`context_limit`), for `decode`'s cheap refusal."""
        body = self.decode(raw, endpoint, limit)
        return body, self.validate(body, endpoint)

    def decode(self, raw: bytes, endpoint: str, limit: int | None = None) -> dict[str, Any]:
        """The body as JSON, refused (400 naming `prompt` | `messages`) when a lower
        bound of its prompt's tokens taken without tokenizing it
        (`protocol.openai.prompt_tokens_at_least`: ~1 ms per MB of text) already
        reaches `DOOR_CONTEXT_FACTOR` × `limit` (None: no refusal); raises `ApiError`."""
        body = oa.decode_json_body(raw)
        if limit is not None and (n := oa.prompt_tokens_at_least(body, endpoint)) >= DOOR_CONTEXT_FACTOR * limit:
            raise bad(f"the prompt is at least {n} tokens; the engines' maximum context length is {limit} tokens "
                      "(prompt + output); shorten it", "prompt" if endpoint == "completions" else "messages")
        return body

    def validate(self, body: dict[str, Any], endpoint: str) -> ParsedRequest:
        """The decoded body as the engine's parser reads it (its prompt counted); raises
        `ApiError` or `HTTPUserError` (404: a model no engine serves)."""
        if endpoint == "chat":
            parsed = oa.parse_chat_request(body, limits=ApiLimits(max_body_bytes=self.s.max_body_bytes))
        else:
            parsed = oa.parse_completion_request(body)
        self.check_model(parsed)
        # the engine checks again once it knows max_tokens (the context length is its own)
        check_request_cost(parsed, parsed.text_tokens, parsed.max_tokens, self.cost)
        return parsed

    def start_prompt_ids(self, body: dict[str, Any], endpoint: str, parsed: ParsedRequest,
                         wanted: bool | None = None) -> Tokenize | None:
        """Send the `/tokenize` RPC of a validated body's prompt when a policy that reads
        prefix hits (`Dispatcher.needs_prefix`) wants the engine's ids of it
        (`prompt_ids.PromptIds.start`); None otherwise (no RPC). `wanted`: the request's
        `Dispatcher.prefix_wanted()`, asked once by the caller so both halves agree (None:
        ask now)."""
        if not (self.dispatcher.prefix_wanted() if wanted is None else wanted):
            return None
        return self.prompt_ids.start(body, endpoint, parsed)

    async def prompt_blocks(self, body: dict[str, Any], endpoint: str, tok: Tokenize | None = None,
                            wanted: bool | None = None, heavy: bool = False) -> PromptBlocks:
        """The prompt's block hashes, their block size (the instances' KV block size) and
        the engine's token count of the prompt (None: fallback ids) for a policy that
        reads prefix hits; `((), 16, None)` otherwise. Waits for `tok`'s answer up to its
        deadline; without `tok` it does not suspend. `wanted` as in `start_prompt_ids`;
        `heavy`: a big body, whose ids and hashes are computed off the event loop."""
        if not (self.dispatcher.prefix_wanted() if wanted is None else wanted):
            return (), 16, None
        bs = next((st.block_size for st in self.instances if st.block_size), 16)
        ids, from_engine = await self.prompt_ids.finish(tok, body, endpoint, heavy)
        hashes = await off_loop(block_hashes, ids, bs) if heavy else block_hashes(ids, bs)
        return hashes, bs, len(ids) if from_engine else None

    async def route(self, raw: bytes, endpoint: str, label: str, excluded: frozenset[int] = frozenset(),
                    headers: Mapping[str, str] | None = None, late_ok: bool = False) -> Route:
        """The one path from a request body to a decision, shared by the HTTP front door
        (`handle`) and the endpoint picker (`services.epp`): start the tag RPC, parse
        (off the event loop for a big body), refuse a prompt far past every engine's
        context, hash the prompt's blocks (asking an engine's `/tokenize` when the ids
        must be the engine's), start the decision early when it does not need the tag
        (text, objective ttft: `Route.early`), then take the tag and make the candidate
        and the body to forward. `excluded`: instances the decision must not pick.
        `headers`: the request's (lower-case names): its SLO (`x-slo-ttft-ms`,
        `x-slo-tpot-ms`, `x-slo-class`; with the body's `priority`,
        `dispatch.admission.parse_request_slo`), carried to the decision. `late_ok`: the
        caller forwards the body itself and may do so before the tag lands (`late_tag`):
        then an early-decided route returns without waiting for the tag, its body as the
        client sent it and `Route.late` set (the front door's `handle`; not the endpoint
        picker, whose gateway forwards the body with the tag's length in it).

        Raises:
            ApiError, HTTPUserError: the client's mistake (counted under `label`).
        """
        received_s = self.engine_now_s()
        heavy = len(raw) > OFF_LOOP_BYTES  # parsed, counted and hashed off the event loop
        # a small body's tag RPC goes out at once, in parallel with parsing; a big one's
        # only once its JSON is decoded and it has passed the cheap context refusal
        # (`decode`): a prompt certainly too long is refused with no tag RPC, so the
        # tagger never tokenizes it. A legitimate big prompt is therefore tagged after
        # its decode (still in parallel with its validation and counting). A text
        # request this front door will forward before its tag lands (`late_tag_ok`; a
        # body naming no image or video part) is tagged once the forward is out
        # (`_forward`): nothing waits for that tag, so its RPC stays off the request's path
        late = late_ok and self.s.early_dispatch and not self.dispatcher.reads_length and self.late_tag_ok()
        deferred = late and not heavy and b"image_url" not in raw and b"video_url" not in raw
        tag_task = None if heavy or deferred else self.tags.start(raw)
        if tag_task is not None:
            await asyncio.sleep(0)  # let the tag RPC go out before we parse
        limit = self.context_limit()
        try:
            if heavy:
                body = await off_loop(self.decode, raw, endpoint, limit)
                tag_task = self.tags.start(raw)
                if tag_task is not None:
                    await asyncio.sleep(0)  # let the tag RPC go out before we count
                parsed = await off_loop(self.validate, body, endpoint)
            else:
                body, parsed = self.parse(raw, endpoint, limit)
            if limit is not None and parsed.text_tokens >= DOOR_CONTEXT_FACTOR * limit:
                raise bad(f"the prompt is {parsed.text_tokens} tokens; the engines' maximum context length is "
                             f"{limit} tokens (prompt + output); shorten it", parsed.prompt_param)
            try:
                slo = parse_request_slo(headers or {}, body.get("priority"), self.s.slo_classes, parsed.model)
            except AstroUserError as exc:
                raise bad(str(exc), exc.field) from None
        except (ApiError, HTTPUserError):
            self.tags.abandon(tag_task)
            self.m.requests.labels(label, "client_error").inc()
            raise
        # asked once: a /status poll between the two halves could flip it (an RPC started
        # and never finished, or hashes wanted with no ids asked for)
        wanted = self.dispatcher.prefix_wanted()
        tok = self.start_prompt_ids(body, endpoint, parsed, wanted)
        early_ok = self.s.early_dispatch and not self.dispatcher.reads_length and parsed.modality == "text"
        blocks: PromptBlocks | None = None
        if tok is None or early_ok:  # an early decision waits for the engine's ids (module docstring)
            try:
                blocks = await self.prompt_blocks(body, endpoint, tok, wanted, heavy)
            except BaseException:
                self.tags.abandon(tag_task)
                self.prompt_ids.abandon(tok)
                raise
        early = None
        if early_ok:
            # a text request's TTFT on an instance does not depend on its own reply length,
            # and its prompt tokens are the parser's (the tagger counts the same way): the
            # Predictors can be asked while the tagger works (see module docstring)
            assert blocks is not None
            early_cand = in_engine_tokens(
                candidate_of(None, parsed, self.s.default_output_tokens, self.s.oracle_lengths), blocks)
            if late:  # forwarded without waiting for the tag: decided here
                early = asyncio.get_running_loop().create_future()
                try:
                    early.set_result(await self.dispatcher.choose(early_cand, excluded, *blocks, slo=slo,
                                                                  first_token_only=True))
                except Exception as exc:  # noqa: BLE001 - raised where the decision is awaited, as a task's is
                    early.set_exception(exc)
                r = Route(body, parsed, early_cand, blocks, raw, 0.0, early, slo, received_s,
                          LateTag(f"astro-{os.urandom(8).hex()}", tag_task))
                if tag_task is not None:  # its length lands whenever the RPC answers
                    self.tags.later(tag_task, raw, functools.partial(self._tag_landed, r))
                return r
            early = asyncio.ensure_future(self.dispatcher.choose(early_cand, excluded, *blocks, slo=slo,
                                                                 first_token_only=True))
            await asyncio.sleep(0)  # let the predict RPCs go out before an in-process tag runs
        elif tok is not None:
            await asyncio.sleep(0)  # let the /tokenize RPC go out before an in-process tag runs
        if deferred:  # not forwarded before its tag after all (its parts are media): tag it now
            tag_task = self.tags.start(raw)
        t_tag = time.perf_counter()
        try:
            tag = await self.tags.finish(tag_task, raw)
            if blocks is None:  # the /tokenize RPC ran while the tagger worked
                blocks = await self.prompt_blocks(body, endpoint, tok, wanted, heavy)
        except BaseException:
            if early is not None:
                early.cancel()
            self.prompt_ids.abandon(tok)
            raise
        tag_wait_us = (time.perf_counter() - t_tag) * 1e6
        self.m.stage.labels(self.dispatcher.policy_name, "tag").observe(tag_wait_us / 1e6)
        if tag is None:
            self.m.fallbacks.labels(self.dispatcher.policy_name, "no tag").inc()
        cand = in_engine_tokens(candidate_of(tag, parsed, self.s.default_output_tokens, self.s.oracle_lengths),
                                blocks)
        xargs = dict(body.get("vllm_xargs") or {})
        xargs["astro_predicted_output_tokens"] = cand.predicted_output_tokens
        body["vllm_xargs"] = xargs
        return Route(body, parsed, cand, blocks, json.dumps(body).encode(), tag_wait_us, early, slo, received_s)

    def late_tag_ok(self) -> bool:
        """Whether nothing reads a request's predicted length before its tag lands
        (`SchedulerSettings.late_tag`): every look-ahead runs here (no sidecar reads an
        engine's `/status` itself), or the policy asks no Predictor at all, and every
        instance's engine names fcfs on its `/status`, the in-instance policy that does not
        read lengths (`InstanceState.engine_policy`: from the status polls, or asked once
        when the policy polls none; unknown → wait for tags)."""
        asks = self.dispatcher.asks_predictors
        if not (self.s.late_tag and (self.s.predict_in_process or not asks)):
            return False
        for st in self.instances:
            if (asks and st.ep.predictor_url) or st.engine_policy != "fcfs":
                return False
        return True

    def _tag_landed(self, r: Route, tag: TagResult | None) -> None:
        """A late tag landed: its length (capped as the candidate's would be) goes where
        `LateTag` puts it."""
        assert r.late is not None
        if tag is None:
            self.m.fallbacks.labels(self.dispatcher.policy_name, "no tag").inc()
            r.late.land(None)
            return
        cand = candidate_of(tag, r.parsed, self.s.default_output_tokens, self.s.oracle_lengths)
        r.late.land(cand.predicted_output_tokens)

    def engine_now_s(self) -> float:
        """Now on the engines' clock: wall seconds ÷ `time_scale` (a sim fleet slowed by
        `time_scale` spends that many wall seconds per engine second). SLO targets and
        predictions are engine seconds, so a target's remainder is measured on this clock."""
        return time.perf_counter() / self.s.time_scale

    async def first_decision(self, r: Route, excluded: frozenset[int] = frozenset()) -> DispatchDecision | None:
        """The route's decision: the early one when it was started, else one made now. In
        admission mode "queue", a request in time but without room anywhere waits in the
        router queue for the decision that admits or finally refuses it (`_drain_queue`)."""
        dec = await r.early if r.early is not None else await self.dispatcher.choose(r.cand, excluded, *r.blocks,
                                                                                       slo=r.slo)
        if dec is None or dec.refused != NO_ROOM or self.router_queue is None or r.slo is None:
            return dec
        assert r.slo.ttft_s is not None
        fut: asyncio.Future[DispatchDecision | None] = asyncio.get_running_loop().create_future()
        self._hold((r, excluded, fut), dec)
        if self._queue_task is None or self._queue_task.done():
            self._queue_task = asyncio.ensure_future(self._drain_queue())
        return await fut

    def _hold(self, item: tuple[Route, frozenset[int], asyncio.Future[DispatchDecision | None]],
              dec: DispatchDecision) -> None:
        """Put a (route, excluded, future) in the router queue; when the full queue sheds
        one (it, or a less important one), that one's future gets `dec` as a refusal."""
        r = item[0]
        assert self.router_queue is not None and r.slo is not None and r.slo.ttft_s is not None
        shed = self.router_queue.offer(item, r.slo.priority, r.received_s + r.slo.ttft_s)
        if shed is not None:
            shed[2].set_result(replace(dec, refused=QUEUE_FULL, admission=QUEUE_FULL, retry_after_s=1,
                                       reason=f"refused: {QUEUE_FULL}"))

    async def _drain_queue(self) -> None:
        """Every `queue_retry_s` while the router queue holds requests: decide each again
        in the queue's order against what is left of its TTFT target; admitted ones go
        on, ones out of time are refused, the rest wait for the next turn."""
        assert self.router_queue is not None
        while len(self.router_queue):
            await asyncio.sleep(self.dispatcher.admission.queue_retry_s * self.s.time_scale)
            for item in self.router_queue.take_all():
                r: Route = item[0]
                excluded: frozenset[int] = item[1]
                fut: asyncio.Future[DispatchDecision | None] = item[2]
                if fut.done():  # the client left
                    continue
                assert r.slo is not None and r.slo.ttft_s is not None
                slo = remaining_slo(r.slo, r.received_s, self.engine_now_s())
                try:
                    dec = None if slo is None else await self.dispatcher.choose(
                        r.cand, excluded, *r.blocks, slo=slo, first_token_only=r.first_token_only)
                except Exception as exc:  # noqa: BLE001 - one request's failure is its own
                    if not fut.done():
                        fut.set_exception(exc)
                    continue
                if fut.done():
                    continue
                if slo is None:
                    fut.set_result(DispatchDecision(self.dispatcher.policy_name, (), -1,
                                                    f"refused: {REFUSED_TTFT} (deadline passed in the router queue)",
                                                    {}, refused=REFUSED_TTFT, admission=REFUSED_TTFT, retry_after_s=1))
                elif dec is not None and dec.refused == NO_ROOM:
                    self._hold(item, dec)
                else:
                    fut.set_result(dec)
                    await asyncio.sleep(0)  # its handler takes the instance before the next decision

    async def handle(self, request: Request, endpoint: str) -> Response | RelayResponse:
        t0, received_unix_s = time.perf_counter(), time.time()
        check_api_key(request, self.s.api_key)
        raw = await read_body(request, self.s.max_body_bytes)
        try:
            r = await self.route(raw, endpoint, endpoint, headers=request.headers, late_ok=True)
        except ApiError as exc:
            return JSONResponse(exc.to_dict(), status_code=exc.status_code)
        self._n += 1
        rec = DecisionRecord(self._n, endpoint, r.cand.prompt_tokens, r.cand.predicted_output_tokens, r.tag_wait_us,
                             received_unix_s=received_unix_s, late_tag=r.late is not None)
        watch = ClientWatch(request.receive)  # the client leaving cancels the forward, here
        try:
            return await self._forward(endpoint, r, rec, t0)
        except asyncio.CancelledError:
            r.cancel()
            if not watch.stop():  # not the client's leaving
                raise
        finally:
            watch.stop()
        # the client left: the forward's engine connection was closed (the engine aborts)
        self.m.requests.labels(endpoint, "client_disconnected").inc()
        rec.outcome = "client_disconnected"
        self.decisions.append(rec)
        return Response(status_code=499)

    async def _forward(self, endpoint: str, r: Route, rec: DecisionRecord, t0: float) -> Response | RelayResponse:
        path = _PATHS[endpoint]
        payload, stream, cand, blocks = r.payload, r.parsed.stream, r.cand, r.blocks
        excluded: frozenset[int] = frozenset()
        last_err = "no instance available"
        first_5xx: tuple[bytes, int, dict[str, str]] | None = None
        first_5xx_why = ""
        overhead = 0.0
        for attempt in range(2):
            if attempt == 0:
                dec = await self.first_decision(r)
                rec.early_dispatch = r.early is not None  # chosen while the tagger worked
            else:
                dec = await self.dispatcher.choose(cand, excluded, *blocks, slo=r.slo,
                                                   first_token_only=r.first_token_only)
            if dec is None:
                break
            if dec.refused is not None:
                rec.decision = dec
                self._finish(rec, overhead + time.perf_counter() - t0, "refused")
                return self.refusal(endpoint, dec, r.slo)
            st = self.instances.get(dec.choice)
            if st is None:  # dropped by discovery while the predictions were out
                excluded = excluded | {dec.choice}
                continue
            late = r.late
            entry = self.instances.acquire(st, cand if self.s.count_pending else None,
                                           request_id=None if late is None else late.request_id)
            rec.decision = dec
            rec.instance = st.ep.name
            pool = self.clients.pool(st.ep.engine_url)
            headers = {"content-type": "application/json"}
            if late is not None:
                headers["x-request-id"] = late.request_id
                late.place(st, entry, rec)
                if attempt == 0 and late.task is None:  # tagged once the forward is out (`route`)
                    # scheduled now, run at the forward's first wait: after its bytes are written
                    late.task = self.tags.start(r.payload)
                    self.tags.later(late.task, r.payload, functools.partial(self._tag_landed, r))
            t_send = time.perf_counter()
            overhead += t_send - t0
            resp = None
            try:
                async with asyncio.timeout(self.s.upstream_timeout_s):  # inline: no task, written at once
                    resp = await pool.request("POST", path, payload, headers)
                if entry is not None:
                    entry.accepted_s = time.monotonic()  # the engine holds it from here on
                cap = self.cost.max_response_bytes
                length = resp.headers.get("content-length", "")
                if resp.status == 200 and length.isdigit() and int(length) > cap:
                    await resp.aclose()  # the engine's request is dropped, unread
                    self.instances.release(st, entry)
                    self._finish(rec, overhead, "response_too_large")
                    self.m.requests.labels(endpoint, "response_too_large").inc()
                    return error_response(502, f"the engine's response of {length} bytes is over this server's "
                                          f"limit of {cap} bytes (ASTRO_MAX_RESPONSE_BYTES); ask for fewer "
                                          "tokens, choices or logprobs", None, "response_too_large")
                if resp.status == 200 and (stream or not length.isdigit() or int(length) > _BUFFERED_BYTES):
                    # relayed as it arrives (a stream; or a whole response too big to hold):
                    # its first read awaited here, the rest by the relay (`relay.RelayResponse`)
                    first = await resp.read_some()
                    t1 = time.perf_counter()
                    if stream:
                        rec.observed_ttft_s = t1 - t_send
                    overhead += time.perf_counter() - t1
                    on_end = functools.partial(self._end_stream, endpoint, overhead)
                    return stream_response(self.instances, st, resp, first, rec, t_send, on_end, entry,
                                           sse=stream, max_bytes=cap)
                data = await resp.read(_BUFFERED_BYTES)
            except (TimeoutError, RpcError) as exc:
                if resp is not None:
                    await resp.aclose()
                self.instances.release(st, entry)
                self.instances.mark_failed(st, f"{type(exc).__name__}: {exc}")
                last_err = f"instance {st.ep.name} failed: {type(exc).__name__}"
                excluded = excluded | {st.index}
                if attempt == 0:
                    self.m.retries.inc()
                    rec.retries = 1
                t0 = time.perf_counter()
                continue
            except BaseException:
                if resp is not None:
                    await resp.aclose()
                self.instances.release(st, entry)
                raise
            t1 = time.perf_counter()
            self.instances.release(st, entry)  # ended: no status will show it again
            if resp.status == 401:  # the engine refused the scheduler, not the client: say so, as a 502
                data, status = _refused(st.ep.name, data), 502
            else:
                status = resp.status
            if status >= 500 and attempt == 0:
                # the engine failed the request before the client saw a byte: try another
                # instance once; a run of them opens its breaker (a healthy /health does
                # not make an engine that fails every request worth sending to)
                st.engine_5xx += 1
                why = f"HTTP {resp.status}: {_error_text(data)}"
                if st.engine_5xx >= ENGINE_5XX_BREAKER:
                    self.instances.mark_failed(st, f"{st.engine_5xx} consecutive 5xx answers, last {why}")
                last_err = f"instance {st.ep.name} answered {why}"
                excluded = excluded | {st.index}
                self.m.retries.inc()
                rec.retries = 1
                first_5xx = (data, status, _relay_headers(resp, st.ep.name, status))
                first_5xx_why = f"instance {st.ep.name} is unavailable (HTTP {status})"
                t0 = time.perf_counter()
                continue
            if status < 500:
                st.engine_5xx = 0
            rec.observed_e2e_s = t1 - t_send
            outcome = "ok" if status < 400 else "client_error" if status < 500 else "engine_error"
            self.m.requests.labels(endpoint, outcome).inc()
            out = Response(data, status_code=status, headers=_relay_headers(resp, st.ep.name, status))
            overhead += time.perf_counter() - t1
            self._finish(rec, overhead, outcome)
            return out
        if first_5xx is not None:  # no other instance to retry on: the engine's own error
            self.m.requests.labels(endpoint, "engine_error").inc()
            self._finish(rec, overhead, "engine_error")
            if first_5xx[1] == 503:  # unavailable (e.g. draining): in the scheduler's words, not the engine's
                return error_response(503, f"no engine could take the request ({first_5xx_why}); retry later",
                                      None, "engine_unavailable")
            return Response(first_5xx[0], status_code=first_5xx[1], headers=first_5xx[2])
        self.m.requests.labels(endpoint, "no_instance").inc()
        rec.outcome = "no_instance"
        self.decisions.append(rec)
        return error_response(503, f"no engine could take the request ({last_err}); retry later",
                              None, "engine_unavailable")

    def refused(self, label: str, dec: DispatchDecision, slo: RequestSlo | None) -> tuple[str, dict[str, str]]:
        """Count a refusal at admission (`astro:admission_refused_total` by reason, and
        the requests counter's outcome "refused" under `label`); its message and headers
        (`Retry-After`, whole seconds)."""
        reason = dec.refused or "refused"
        self.m.refused.labels(self.dispatcher.policy_name, reason,
                              (slo.slo_class if slo is not None else None) or "").inc()
        self.m.requests.labels(label, "refused").inc()
        target = f"{slo.ttft_ms:g} ms" if slo is not None and slo.ttft_ms is not None else "its"
        if reason == QUEUE_FULL:
            msg = (f"the router queue is full of requests at least as important and urgent as this one "
                   f"(TTFT SLO {target}); retry after {dec.retry_after_s} s")
        else:
            msg = (f"no instance is predicted to meet this request's TTFT SLO ({target}); retry after "
                   f"{dec.retry_after_s} s or relax x-slo-ttft-ms")
        return msg, {"Retry-After": str(max(1, dec.retry_after_s))}

    def refusal(self, endpoint: str, dec: DispatchDecision, slo: RequestSlo | None) -> Response:
        """HTTP 429 in the OpenAI error shape, type `slo_unmeetable`, with `Retry-After`."""
        msg, headers = self.refused(endpoint, dec, slo)
        resp = error_response(429, msg, "x-slo-ttft-ms", "slo_unmeetable")
        resp.headers.update(headers)
        return resp

    def _end_stream(self, endpoint: str, overhead_s: float, rec: DecisionRecord, outcome: str) -> None:
        """The end of a relayed stream (`relay.stream_response`'s `on_end`)."""
        self.m.requests.labels(endpoint, outcome).inc()
        self._finish(rec, overhead_s, outcome)

    def _finish(self, rec: DecisionRecord, overhead_s: float, outcome: str) -> None:
        rec.overhead_us = overhead_s * 1e6
        rec.outcome = outcome
        self.m.overhead.observe(overhead_s)
        self.decisions.append(rec)
        dec = rec.decision
        if outcome == "ok" and dec is not None and rec.instance and dec.choice in dec.predictions:
            ttft_s, e2e_s = dec.predictions[dec.choice]
            ts = self.s.time_scale  # the engines' seconds, as the predictions are
            served = (None if rec.observed_ttft_s is None else rec.observed_ttft_s / ts,
                      None if rec.observed_e2e_s is None else rec.observed_e2e_s / ts)
            # an early decision's look-aheads stopped at the first token: no E2E prediction
            self.m.record_outcome(rec.instance, {"ttft": ttft_s, "e2e": None if rec.early_dispatch else e2e_s},
                                  {"ttft": served[0], "e2e": served[1]})
            outcomes = self.dispatcher.outcomes
            if outcomes is not None:  # what the instance's Predictor said, before correction
                raw = dec.uncorrected.get(dec.choice, (ttft_s, e2e_s))
                outcomes.observe(rec.instance, (raw[0], None if rec.early_dispatch else raw[1]), served)


def _error_text(data: bytes) -> str:
    """An engine error body's message (OpenAI shape), or its first 120 bytes."""
    try:
        err = json.loads(data).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        if msg:
            return str(msg)[:120]
    except (ValueError, AttributeError):
        pass
    return data[:120].decode("utf-8", "replace")


def _refused(instance: str, data: bytes) -> bytes:
    """The client's 502 body for an engine that answered the scheduler 401 (a missing or
    wrong internal token, or an engine started with its own --api-key)."""
    return json.dumps({"error": {
        "message": f"engine {instance} refused the scheduler (HTTP 401: {_error_text(data)}); the scheduler needs "
                   "the cluster's internal token ($ASTRO_INTERNAL_TOKEN or $ASTRO_INTERNAL_TOKEN_FILE)",
        "type": "engine_unavailable", "param": None, "code": 502}}).encode()


def _relay_headers(resp: RawResponse, instance: str, status: int) -> dict[str, str]:
    """`relay_headers`, minus the engine's content-length and auth challenge when the body
    was replaced (a refused request's 502)."""
    h = relay_headers(resp, instance)
    if status != resp.status:
        h = {k: v for k, v in h.items() if k.lower() not in ("content-length", "www-authenticate")}
    return h
