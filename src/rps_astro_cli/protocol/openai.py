"""OpenAI-compatible request parsing and validation, shared by the sim engine and the
scheduler service (pure functions: no I/O except optional DNS for remote media).

Endpoints: `POST /v1/completions` and `POST /v1/chat/completions`. Accepted fields
(the sampling fields are type/range-checked, as OpenAI/vLLM do, then ignored: the sim
engine's output length does not depend on them; see `check_sampling_fields`):

- `model` (optional; when given it must be the served model, else 404),
- `prompt` (completions): a string, a list of token ids, or a one-element list of either;
- `messages` (chat): `[{"role", "content"}]`, content a string or a list of parts
  `{"type": "text", "text"}`, `{"type": "image_url", "image_url": {"url"}}`,
  `{"type": "video_url", "video_url": {"url", "num_frames"?}}`,
- `max_tokens` / `max_completion_tokens` (int ≥ 1; default max_model_len − prompt, as
  vLLM), `ignore_eos`, `stream`, `stream_options.include_usage`,
- `n` (1 to `MAX_N`; n > 1 with temperature 0 is refused as vLLM refuses it: "n must be
  1 when using greedy sampling"), `stop` (strings), `seed`, `min_tokens`,
  `include_stop_str_in_output` (carried in `ParsedRequest`; the sim engine honours them:
  `engine.synthetic`),
- `logprobs` / `top_logprobs` (chat) and `logprobs` (completions), `echo`: checked with
  vLLM's rules and messages (`protocol.vllm_rules.refuse_unsimulated`) and carried in
  `ParsedRequest`; the sim engine answers them in vLLM's shapes with synthetic values
  (`engine.synthetic`); `tools` / `tool_choice` / `response_format`: vLLM's rules, then
  honoured or refused explicitly (`protocol.vllm_rules.refuse_unsimulated`),
- `vllm_xargs` (the extra-args dict a real vLLM accepts and hands to its scheduler):
  `astro_output_tokens` (true output length the bench sends; the engine stops there,
  capped by max_tokens), `astro_predicted_output_tokens` (the tagger's predicted length,
  shown in `/status`), `astro_class` ("sand" / "pebbles" / "rocks").

Prompt token counting (the same in engine, Predictor and bench):
- completions: `tokens.count_tokens_fallback(prompt)` (or the token-id list's length);
- chat: `chat_prompt_tokens`: per message `CHAT_TOKENS_PER_MESSAGE` (3) +
  count(role) + count(each text part), plus `CHAT_TOKENS_REPLY_PRIMER` (3) for the
  assistant reply header (the OpenAI cookbook's accounting for chat formats);
- media (chat only): images × `vision.tokens_per_image` + frames ×
  `vision.tokens_per_frame` from the profile (`VisionCosts`); a video part's frame count
  is `video_url.num_frames` or `DEFAULT_NUM_FRAMES` (32, LLaVA-OneVision's default
  frame sampling).

Media URLs (ARCHITECTURE.md §7) are checked by `protocol.media.check_media_url` (`data:`
URLs decoded and checked, remote `http(s)` URLs only with `ApiLimits.allow_remote_media`
and to public addresses, `file://` and bare paths refused); their cost on a profile is
`protocol.media.vision_charge`.

Bodies (`decode_json_body`): at most `max_body_bytes`, nested at most `MAX_JSON_DEPTH`,
no integer of more than 4300 digits and no lone UTF-16 surrogate (`loads_json_body`); a
token-id `prompt` holds ids in [0, vocabulary size) (`parse_completion_request`).

Every user mistake raises `ApiError` (HTTP status, message, type, param naming the field);
`ApiError.to_dict()` is the body `{"error": {"message", "type", "param", "code"}}`. The
value types (`ApiError`, `ApiLimits`, `ParsedRequest`) live in `protocol/openai_types.py`.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from typing import Any

from rps_astro_cli.protocol.media import check_media_url
from rps_astro_cli.protocol.openai_types import ApiError, ApiLimits, ParsedRequest, _vllm_error, bad
from rps_astro_cli.tokens import FALLBACK_VOCAB_SIZE, TokenIds, count_tokens_fallback, fallback_tokens_at_least

CHAT_TOKENS_PER_MESSAGE = 3
CHAT_TOKENS_REPLY_PRIMER = 3
DEFAULT_NUM_FRAMES = 32
REQ_CLASSES = ("sand", "pebbles", "rocks")
_ROLES = ("system", "user", "assistant", "tool", "developer", "function")
MAX_N = 16384  # vLLM's default VLLM_MAX_N_SEQUENCES: the most choices one request may ask for
GREEDY_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy sampling


# -- body ------------------------------------------------------------------------------
MAX_JSON_DEPTH = 64  # arrays/objects nested deeper are refused (OpenAI bodies need < 10)
_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')  # a string (skipped whole) or a bracket


def json_depth(raw: bytes) -> int:
    """How deeply arrays/objects nest in the JSON text `raw` (brackets inside strings do
    not count), or, when `raw` holds at most MAX_JSON_DEPTH brackets, their count (an
    upper bound that needs no scan: the common case costs two `bytes.count`)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return raw.count(b"[") + raw.count(b"{")  # an upper bound: no scan needed
    depth = best = 0
    for m in _JSON_TOKENS.finditer(raw):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            best = max(best, depth)
        elif c in (b"]", b"}"):
            depth -= 1
    return best


def check_json_depth(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """None when `raw` nests at most `max_depth` deep, else the one-line problem."""
    if json_depth(raw) > max_depth:
        return f"body: JSON nested more than {max_depth} levels deep; flatten the request"
    return None


# a `\uD800`–`\uDFFF` escape, or the UTF-8-style bytes of a surrogate (which `json.loads`
# of bytes decodes with "surrogatepass"): only then can the decoded body hold a lone surrogate
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE_BYTES = re.compile(rb"\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _may_hold_surrogates(raw: bytes) -> bool:
    """False when `json.loads(raw)` cannot hold a lone surrogate; True when it may (then
    `lone_surrogate_at` walks the result). Single-byte `in` tests (memchr) first: a body
    with no backslash has no escape to scan for (~0.2 µs per 2.5 KB), else the regex
    (~0.5 ns a byte)."""
    return ((b"\\" in raw and _SURROGATE_ESCAPE.search(raw) is not None)
            or (b"\xed" in raw and _SURROGATE_BYTES.search(raw) is not None)
            or b"\x00" in raw[:4] or raw[:2] in (b"\xff\xfe", b"\xfe\xff"))  # UTF-16/32 (json's detect_encoding)


def lone_surrogate_at(v: Any, path: str = "body") -> str | None:
    """The path (`messages[0].content`, `body` for the top level) of the first string,
    value or key, in decoded JSON `v` that holds a lone UTF-16 surrogate (`"\\ud800"`:
    JSON allows the escape, but it is no Unicode character, so it cannot be encoded as
    UTF-8, tokenized or echoed); None when there is none."""
    if isinstance(v, str):
        return path if _SURROGATE.search(v) else None
    if isinstance(v, list):
        for i, x in enumerate(v):
            if (at := lone_surrogate_at(x, f"{path}[{i}]")) is not None:
                return at
    elif isinstance(v, dict):
        for k, x in v.items():
            sub = k if path == "body" else f"{path}.{k}"
            if _SURROGATE.search(k):
                return path  # a key: the object holding it
            if (at := lone_surrogate_at(x, sub)) is not None:
                return at
    return None


def loads_json_body(raw: bytes) -> Any:
    """`json.loads(raw)` of a request body, refusing what Python's parser accepts but the
    rest of the server cannot use: an integer of more than `sys.get_int_max_str_digits()`
    digits (4300; Python refuses to convert it, and no field takes such a number) and a
    string holding a lone UTF-16 surrogate (`lone_surrogate_at`). Nesting is not checked
    here (`check_json_depth`).

    Raises:
        ApiError: 400 naming `body` (malformed JSON, an over-long number) or the field
            holding the lone surrogate.
    """
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"body: malformed JSON ({exc})", param="body") from None
    except ValueError:  # Python's int-string conversion limit (JSONDecodeError is caught above)
        raise ApiError(400, f"body: a number has more than {sys.get_int_max_str_digits()} digits; no field takes "
                       "such a number", param="body") from None
    except RecursionError:  # pragma: no cover - the callers' depth check comes first
        raise ApiError(400, f"body: JSON nested too deeply (limit {MAX_JSON_DEPTH})", param="body") from None
    if _may_hold_surrogates(raw) and (at := lone_surrogate_at(body)) is not None:
        raise ApiError(400, f"{at}: holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its pair), "
                       "which is not valid Unicode; send valid UTF-8 text", param=at)
    return body


def decode_json_body(raw: bytes, max_body_bytes: int | None = None) -> dict[str, Any]:
    """Parse a request body into a JSON object.

    Raises:
        ApiError: 413 over `max_body_bytes`; 400 not JSON, nested deeper than
            `MAX_JSON_DEPTH`, not an object, an over-long number or a lone surrogate
            (`loads_json_body`).
    """
    if max_body_bytes is not None and len(raw) > max_body_bytes:
        raise ApiError(413, f"request body is {len(raw)} bytes, over the limit of {max_body_bytes}",
                       param="body")
    if (why := check_json_depth(raw)) is not None:
        raise ApiError(400, why, param="body")
    body = loads_json_body(raw)
    if not isinstance(body, dict):
        raise ApiError(400, "body: must be a JSON object", param="body")
    return body


# -- scalar fields ---------------------------------------------------------------------
def _int_field(v: Any, param: str, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise bad(f"must be an integer, got {v!r}", param)
    if v < lo:
        raise bad(f"must be ≥ {lo}, got {v}", param)
    return v


def _bool_field(body: dict[str, Any], key: str, param: str | None = None) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"must be true or false, got {v!r}", param or key)
    return v


def _number_field(body: dict[str, Any], key: str, lo: float | None = None, hi: float | None = None,
                  lo_open: bool = False) -> None:
    v = body.get(key)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v in (float("inf"), float("-inf")):
        raise bad(f"must be a number, got {v!r}", key)
    if lo is not None and (v <= lo if lo_open else v < lo):
        rng = f"in ({lo}, {hi}]" if lo_open and hi is not None else f"{'>' if lo_open else '≥'} {lo}"
        if hi is not None and not lo_open:
            rng = f"in [{lo}, {hi}]"
        raise bad(f"must be {rng}, got {v}", key)
    if hi is not None and v > hi:
        rng = f"in ({lo}, {hi}]" if lo_open else (f"in [{lo}, {hi}]" if lo is not None else f"≤ {hi}")
        raise bad(f"must be {rng}, got {v}", key)


def check_sampling_fields(body: dict[str, Any]) -> None:
    """Type/range checks of the common OpenAI (and vLLM) sampling fields, so a client
    mistake is a 400 naming the field rather than silently ignored. `null` = absent.

    temperature: number ≥ 0; top_p: number in (0, 1]; min_p: number in [0, 1];
    presence_penalty / frequency_penalty: number in [-2, 2] (OpenAI API reference);
    repetition_penalty: number > 0 (vLLM SamplingParams); top_k: integer ≥ -1 (-1 = off,
    vLLM); seed: integer; stop: string or list of strings; logit_bias: object;
    logprobs: true/false (chat) or integer ≥ -1 (completions); top_logprobs: integer ≥ -1
    (below -1: vLLM's message; -1, the whole vocabulary, is refused by the engine as over
    vLLM's `--max-logprobs`);
    best_of: integer ≥ 1; min_tokens: integer ≥ 0; echo: true/false; user: string.
    (`n` is checked in `_common`.)

    Raises:
        ApiError: 400 naming the field.
    """
    _number_field(body, "temperature", 0.0)
    _number_field(body, "top_p", 0.0, 1.0, lo_open=True)
    _number_field(body, "min_p", 0.0, 1.0)
    _number_field(body, "presence_penalty", -2.0, 2.0)
    _number_field(body, "frequency_penalty", -2.0, 2.0)
    _number_field(body, "repetition_penalty", 0.0, lo_open=True)
    for key, lo in (("top_k", -1), ("best_of", 1), ("min_tokens", 0)):
        if body.get(key) is not None:
            _int_field(body[key], key, lo)
    for key in ("top_logprobs", "logprobs"):  # -1 (the whole vocabulary) allowed here, as vLLM's validators do
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v < -1:
            raise _vllm_error(f"`{key}` must be a positive value or -1.", key)
    if body.get("top_logprobs") is not None:
        _int_field(body["top_logprobs"], "top_logprobs", -1)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad(f"must be an integer, got {seed!r}", "seed")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str):
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise bad(f"must be a string or a list of strings, got {stop!r}", "stop")
    lb = body.get("logit_bias")
    if lb is not None and not isinstance(lb, dict):
        raise bad(f"must be an object mapping token ids to biases, got {lb!r}", "logit_bias")
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool):
        _int_field(lp, "logprobs", -1)
    _bool_field(body, "echo")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad(f"must be a string, got {user!r}", "user")


def _logprobs_asked(body: dict[str, Any], endpoint: str) -> int | None:
    """Top log-probabilities per token a validated body asks for (None: none)."""
    if endpoint == "chat":
        if body.get("logprobs") is not True:
            return None
        top = body.get("top_logprobs")
        return 0 if top is None else int(top)
    lp = body.get("logprobs")
    return None if lp is None or lp is False else int(lp)


def _common(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    check_sampling_fields(body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("must be a string", "model")
    max_tokens = None
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is not None:
            max_tokens = _int_field(body[key], key, 1)
            break
    n = 1 if body.get("n") is None else _int_field(body["n"], "n", 1)
    if n > MAX_N:
        raise bad(f"must be at most {MAX_N}, got {n}", "n")
    temp = body.get("temperature")
    if n > 1 and isinstance(temp, (int, float)) and temp < GREEDY_EPS:  # vLLM's SamplingParams rule
        raise bad(f"n must be 1 when using greedy sampling, got {n}", "n")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    stream = _bool_field(body, "stream")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise bad("must be an object", "stream_options")
        include_usage = _bool_field(so, "include_usage", "stream_options.include_usage")
    xargs = body.get("vllm_xargs") or {}
    if not isinstance(xargs, dict):
        raise bad("must be an object", "vllm_xargs")
    out = xargs.get("astro_output_tokens")
    out = None if out is None else _int_field(out, "vllm_xargs.astro_output_tokens", 1)
    pred = xargs.get("astro_predicted_output_tokens")
    pred = None if pred is None else _int_field(pred, "vllm_xargs.astro_predicted_output_tokens", 1)
    cls = xargs.get("astro_class")
    if cls is not None and cls not in REQ_CLASSES:
        raise bad(f"must be one of {', '.join(REQ_CLASSES)}, got {cls!r}", "vllm_xargs.astro_class")
    return dict(model=model, max_tokens=max_tokens, ignore_eos=_bool_field(body, "ignore_eos"),
                stream=stream, include_usage=include_usage, output_tokens=out,
                predicted_output_tokens=pred, req_class=cls, n=n, stop=tuple(x for x in stops if x),
                seed=body.get("seed"), min_tokens=int(body.get("min_tokens") or 0),
                include_stop_str_in_output=_bool_field(body, "include_stop_str_in_output"),
                logprobs=_logprobs_asked(body, endpoint), echo=_bool_field(body, "echo"))


# -- completions -----------------------------------------------------------------------
def parse_completion_request(body: dict[str, Any],
                             counter: Callable[[str], int] = count_tokens_fallback,
                             vocab_size: int = FALLBACK_VOCAB_SIZE) -> ParsedRequest:
    """Validate a `/v1/completions` body. A token-id prompt's ids must lie in
    [0, `vocab_size`) (vLLM refuses the others: "Token id ... is out of vocabulary");
    `vocab_size` is the engine's tokenizer's, by default the fallback tokenizer's (its ids
    are CRC-32s, `tokens.FALLBACK_VOCAB_SIZE` = 2**32), the bound where the tokenizer is
    not known (scheduler, tagger).

    Raises:
        ApiError: 400 naming the field (missing/empty/batched prompt, a token id out of
            vocabulary, bad max_tokens, ...).
    """
    if "prompt" not in body or body["prompt"] is None:
        raise bad("is required", "prompt")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        n = counter(p)
    elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        n = len(p)
        if p and (min(p) < 0 or max(p) >= vocab_size):
            t = next(t for t in p if t < 0 or t >= vocab_size)
            raise bad(f"token id {t} is out of vocabulary (token ids are 0 to {vocab_size - 1})", "prompt")
    elif isinstance(p, list):
        raise bad("batched prompts are not supported; send one prompt per request", "prompt")
    else:
        raise bad("must be a string or a list of token ids", "prompt")
    if n <= 0:
        raise bad("is empty", "prompt")
    return ParsedRequest(endpoint="completions", text_tokens=n, **_common(body, "completions"))


def prompt_token_ids(body: dict[str, Any], endpoint: str, token_ids: TokenIds) -> tuple[int, ...]:
    """Token ids of an already validated body's prompt text, for prefix caching: a
    completions prompt's ids (or its token-id list as given); a chat prompt's role and
    text ids per message, up to the first media part (media tokens have no ids here).
    The chat formatting tokens are not included, so the ids are a stable function of the
    text that never outnumber the prompt's counted tokens."""
    if endpoint == "completions":
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return tuple(token_ids(p))
        return tuple(t for t in p if isinstance(t, int)) if isinstance(p, list) else ()
    out: list[int] = []
    for m in body.get("messages") or ():
        if not isinstance(m, dict):
            break
        out += token_ids(str(m.get("role", "")))
        content = m.get("content")
        if isinstance(content, str):
            out += token_ids(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    return tuple(out)
                out += token_ids(str(part.get("text", "")))
    return tuple(out)


def prompt_tokens_at_least(body: dict[str, Any], endpoint: str,
                           text_at_least: Callable[[str], int] = fallback_tokens_at_least) -> int:
    """A lower bound of the prompt tokens the parser would count for a decoded body that
    is not yet validated, computed without tokenizing: a token-id prompt's length (its
    count); a text prompt's `text_at_least` (a lower bound of the counter's count of a
    text: `tokens.fallback_tokens_at_least` for the fallback counter); a chat prompt's
    sum of `text_at_least` over its messages' string contents and text parts (the
    formatting tokens and roles only add to the count). A part the parser would refuse
    (not a string, not a text part) counts 0, so a body is refused as too long on this
    bound only where its prompt certainly is (before its other fields are checked).
    Lets a server refuse a prompt far past its context before it counts (tokenizes)
    it: ~1 ms per MB of text instead of ~40 ms."""
    if endpoint == "completions":
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            return text_at_least(p)
        if isinstance(p, list) and all(type(t) is int for t in p):
            return len(p)
        return 0
    n = 0
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            n += text_at_least(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                    n += text_at_least(part["text"])
    return n


# -- chat ------------------------------------------------------------------------------
def chat_prompt_tokens(messages: Any, counter: Callable[[str], int] = count_tokens_fallback,
                       limits: ApiLimits = ApiLimits()) -> tuple[int, int, int]:
    """Count a chat prompt: (text tokens incl. formatting, images, video frames).

    Formatting (see module docstring): per message CHAT_TOKENS_PER_MESSAGE + count(role)
    + count(text parts); plus CHAT_TOKENS_REPLY_PRIMER once.

    Raises:
        ApiError: 400 naming the field (`messages[i].content[j]...`).
    """
    if not isinstance(messages, list) or not messages:
        raise bad("must be a non-empty list of messages", "messages")
    text = CHAT_TOKENS_REPLY_PRIMER
    images = frames = items = 0
    for i, m in enumerate(messages):
        mp = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad("must be an object with role and content", mp)
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"must be one of {', '.join(_ROLES)}, got {role!r}", f"{mp}.role")
        text += CHAT_TOKENS_PER_MESSAGE + counter(role)
        content = m.get("content")
        if content is None:
            continue
        if isinstance(content, str):
            text += counter(content)
            continue
        if not isinstance(content, list):
            raise bad("must be a string or a list of content parts", f"{mp}.content")
        for j, part in enumerate(content):
            pp = f"{mp}.content[{j}]"
            if not isinstance(part, dict):
                raise bad("must be an object with a type", pp)
            kind = part.get("type")
            if kind == "text":
                t = part.get("text")
                if not isinstance(t, str):
                    raise bad("must be a string", f"{pp}.text")
                text += counter(t)
            elif kind in ("image_url", "video_url"):
                items += 1
                if items > limits.max_media_items:
                    raise bad(f"more than {limits.max_media_items} media items in one request", pp)
                spec = part.get(kind)
                if isinstance(spec, str):
                    spec = {"url": spec}
                if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
                    raise bad("must be an object with a url", f"{pp}.{kind}")
                check_media_url(spec["url"], "image" if kind == "image_url" else "video",
                                f"{pp}.{kind}.url", limits)
                if kind == "image_url":
                    images += 1
                else:
                    nf = spec.get("num_frames")
                    nf = DEFAULT_NUM_FRAMES if nf is None else _int_field(nf, f"{pp}.video_url.num_frames", 1)
                    if nf > limits.max_num_frames:
                        raise bad(f"at most {limits.max_num_frames} frames, got {nf}",
                                  f"{pp}.video_url.num_frames")
                    frames += nf
            else:
                raise bad(f"unsupported content part type {kind!r} (use text, image_url or video_url)",
                          f"{pp}.type")
    return text, images, frames


def parse_chat_request(body: dict[str, Any], counter: Callable[[str], int] = count_tokens_fallback,
                       limits: ApiLimits = ApiLimits()) -> ParsedRequest:
    """Validate a `/v1/chat/completions` body (media URLs checked, not priced: see
    `protocol.media.vision_charge`).

    Raises:
        ApiError: 400 naming the field.
    """
    if body.get("messages") is None:
        raise bad("is required", "messages")
    text, images, frames = chat_prompt_tokens(body["messages"], counter, limits)
    return ParsedRequest(endpoint="chat", text_tokens=text, num_images=images, num_frames=frames,
                         **_common(body, "chat"))


def resolve_max_tokens(req: ParsedRequest, prompt_tokens: int, max_model_len: int) -> int:
    """The output bound vLLM applies: the client's max_tokens, else max_model_len − prompt.

    Raises:
        ApiError: 400 (param prompt/messages) when the prompt alone reaches max_model_len;
            400 (param max_tokens) when prompt + max_tokens exceeds it.
    """
    if prompt_tokens >= max_model_len:
        raise bad(f"the prompt is {prompt_tokens} tokens; this model's maximum context length is "
                  f"{max_model_len} tokens (prompt + output); shorten it", req.prompt_param)
    if req.max_tokens is None:
        return max_model_len - prompt_tokens
    if prompt_tokens + req.max_tokens > max_model_len:
        raise bad(f"this model's maximum context length is {max_model_len} tokens; you requested "
                  f"{prompt_tokens + req.max_tokens} ({prompt_tokens} in the prompt, {req.max_tokens} "
                  "in the completion); lower max_tokens", "max_tokens")
    return req.max_tokens
