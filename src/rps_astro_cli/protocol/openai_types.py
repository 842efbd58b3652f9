"""The OpenAI-compatible API's value types, shared by the request parser
(`protocol/openai.py`), its media and vLLM-rule checks (`protocol/media.py`,
`protocol/vllm_rules.py`), the engines and the services:

- `ApiError`: a request the server refuses; `ApiError.to_dict()` is the body
  `{"error": {"message", "type", "param", "code"}}`. `bad` builds the usual 400 naming
  the field; `_vllm_error` a 400 with vLLM's own message and type; `http_error_body` the
  body of a routing error (unknown route, wrong method).
- `ApiLimits`: the safe-default bounds on requests (ARCHITECTURE.md §7).
- `ParsedRequest`: a validated completion request (what `protocol/openai.py` parses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class ApiError(Exception):
    """A request the server refuses, as an OpenAI-style error.

    status_code: HTTP status (400 bad field, 401 key, 404 model, 413 body too large).
    message: what is wrong and how to fix it. err_type: OpenAI error type.
    param: the offending field (dotted path, e.g. `messages[0].content[1].image_url.url`).
    """

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 err_type: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.err_type = err_type or _default_type(status_code)

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type,
                          "param": self.param, "code": self.status_code}}


def _default_type(status: int) -> str:
    return {401: "authentication_error", 404: "NotFoundError",
            413: "request_too_large"}.get(status, "invalid_request_error" if status < 500 else "server_error")


def bad(message: str, param: str | None) -> ApiError:
    """A 400 naming `param`."""
    return ApiError(400, f"{param}: {message}" if param and param not in message else message, param)


def _vllm_error(message: str, param: str | None) -> ApiError:
    """A 400 with vLLM's own message and error type (its `VLLMValidationError` →
    `{"error": {"message", "type": "BadRequestError", "param", "code": 400}}`)."""
    return ApiError(400, message, param, "BadRequestError")


@dataclass(frozen=True)
class ApiLimits:
    """Safe-default bounds on requests (ARCHITECTURE.md §7).

    max_body_bytes: largest request body (bytes; larger → 413).
    max_media_items: most image/video parts in one request.
    max_num_frames: most frames one video part may ask for.
    allow_remote_media: accept http(s) media URLs (public addresses only).
    """

    max_body_bytes: int = 16 * 1024 * 1024
    max_media_items: int = 16
    max_num_frames: int = 256
    allow_remote_media: bool = False


@dataclass(frozen=True)
class ParsedRequest:
    """A validated completion request (before the context-length check).

    endpoint: "completions" or "chat". model: requested model name or None.
    text_tokens: prompt tokens from text (incl. chat formatting) (tokens).
    num_images / num_frames: media items (images; video frames summed over videos).
    max_tokens: the client's bound on output tokens, or None.
    ignore_eos / stream / include_usage: the OpenAI/vLLM flags.
    output_tokens: `vllm_xargs.astro_output_tokens` (true length) or None.
    predicted_output_tokens: `vllm_xargs.astro_predicted_output_tokens` or None.
    req_class: `vllm_xargs.astro_class` or None.
    """

    endpoint: str
    model: str | None
    text_tokens: int
    num_images: int = 0
    num_frames: int = 0
    max_tokens: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    output_tokens: int | None = None
    predicted_output_tokens: int | None = None
    req_class: str | None = None
    n: int = 1  # choices asked for (vLLM: n sequences from one prompt)
    stop: tuple[str, ...] = ()  # stop strings (`stop`, a string or a list)
    seed: int | None = None  # the client's `seed`
    min_tokens: int = 0  # tokens before stop strings are checked (vLLM's `min_tokens`)
    include_stop_str_in_output: bool = False  # keep the stop string in the text (vLLM extension)
    # top log-probabilities per token asked for (chat `top_logprobs` under `logprobs: true`,
    # completions `logprobs`); None: no logprobs in the response
    logprobs: int | None = None
    echo: bool = False  # `echo`: completions: the prompt before the text; chat: vLLM's meaning (sim_responses)

    @property
    def prompt_param(self) -> str:
        return "prompt" if self.endpoint == "completions" else "messages"

    @property
    def modality(self) -> str:
        return "video" if self.num_frames else "image" if self.num_images else "text"


def http_error_body(status_code: int, method: str, path: str, detail: Any = None,
                    allow: str | None = None) -> dict[str, Any]:
    """The OpenAI-style body for a routing error (instead of FastAPI's `{"detail": ...}`):
    404 no such route, 405 wrong method (`allow`: the methods the route takes), any other
    HTTP exception with its detail as the message."""
    if status_code == 404:
        msg = f"no route {method} {path} (check the URL: e.g. POST /v1/chat/completions, POST /v1/completions)"
    elif status_code == 405:
        msg = f"method {method} is not allowed on {path}" + (f"; use {allow}" if allow else "")
    else:
        msg = str(detail) if detail else f"HTTP {status_code}"
    return {"error": {"message": msg, "type": _default_type(status_code) if status_code != 404 else "NotFoundError",
                      "param": None, "code": status_code}}
