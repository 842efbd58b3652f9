"""Length tagger service (Astrolabe §3, ARCHITECTURE.md §2): `POST /tag`.

Request: an OpenAI `/v1/chat/completions` or `/v1/completions` body (the scheduler
forwards the client's body as is; `messages` → chat, `prompt` → completions).
Response (`rps_astro_cli.protocol.service_wire.TagResult`, the codec the scheduler reads it
with):
    {"predicted_output_tokens": int ≥ 1,   # the length model's prediction (tokens)
     "prompt_tokens": int,                 # text tokens + vision tokens (tokens)
     "text_tokens": int, "vision_tokens": int,
     "modality": "text"|"image"|"video", "num_images": int, "num_frames": int,
     "encoder_s": float, "preprocess_s": float,   # media costs on the profile (s)
     "length_model": str, "tag_us": float,
     "p10_output_tokens", "p50_output_tokens", "p90_output_tokens": float}   # only when the
        # length model has a distribution calibration (`length.dist`; chat-gbm has one):
        # quantiles of the reply length (tokens) around the point prediction

Token and media accounting reuse the engine's parser (`protocol/openai.py`) and media
pricing (`protocol/media.py`), so the tagger, the scheduler and the engine count the same
way; vision tokens come from the execution profile's `VisionCosts` (0 on text-only
profiles).

Length model: `resolve_length_model(spec)` (`length.resolve`): by default
the length package's shipped model
(`rps_astro_cli.length`; chat bodies go through `LengthModel.predict_chats([messages])`,
which builds the prompt the model was trained on (e.g. `classic` sees the previous turn
before the last user message); completions through `LengthModel.predict([prompt])`),
falling back to the documented
baseline in `artifacts/length/baseline/` (`length/bin_median.py`) when that
artifact is absent; "baseline" picks the baseline explicitly. The prediction only
informs scheduling; it never changes generation.

Metrics: `astro:tagger_tag_seconds` histogram, `astro:tagger_requests_total{outcome}`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rps_astro_cli.length.resolve import resolve_length_model
from rps_astro_cli.protocol import openai as oa
from rps_astro_cli.protocol.http_server import OFF_LOOP_BYTES, off_loop
from rps_astro_cli.protocol.media import vision_charge
from rps_astro_cli.protocol.openai_types import ApiError, ApiLimits
from rps_astro_cli.protocol.service_wire import TagResult
from rps_astro_cli.services.http_common import (
    DEFAULT_MAX_BODY_BYTES,
    FastRoutes,
    HTTPUserError,
    add_health_and_metrics,
    check_api_key,
    install_error_handlers,
    new_registry,
    read_body,
)
from rps_astro_cli.sim.profile import VisionCosts, load_profile

log = logging.getLogger("astro.tagger")

MAX_TAG_TEXT_CHARS = 20_000  # the length model sees at most this much prompt text


def prompt_text(body: dict[str, Any]) -> str:
    """The prompt's text as the length model sees it: the completions prompt, or the
    chat messages' text parts joined by newlines (truncated to MAX_TAG_TEXT_CHARS)."""
    if isinstance(body.get("prompt"), str):
        return body["prompt"][:MAX_TAG_TEXT_CHARS]
    parts: list[str] = []
    for m in body.get("messages") or []:
        c = m.get("content") if isinstance(m, dict) else None
        if isinstance(c, str):
            parts.append(c)
        elif isinstance(c, list):
            parts.extend(p.get("text", "") for p in c if isinstance(p, dict) and p.get("type") == "text")
    return "\n".join(parts)[:MAX_TAG_TEXT_CHARS]


@dataclass(frozen=True)
class TaggerSettings:
    """length_model: see `resolve_length_model`. profile: execution profile whose
    `VisionCosts` price media (None → the default profile). api_key / max_body_bytes:
    as every service."""

    length_model: str | None = None
    profile: str | None = None
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


class Tagger:
    """Parse an OpenAI body, count its prompt and media, predict its output length."""

    def __init__(self, settings: TaggerSettings = TaggerSettings()):
        self.name, self._predict = resolve_length_model(settings.length_model)
        # quantiles come from the model's distribution calibration when it has one
        self._calibration = getattr(self._predict, "calibration", None)
        prof = load_profile(settings.profile)
        self.vision: VisionCosts | None = prof.vision
        self.limits = ApiLimits(max_body_bytes=settings.max_body_bytes)

    def tag(self, body: dict[str, Any]) -> dict[str, Any]:
        """The `/tag` JSON of one request body (`tag_result(body).to_dict()`).

        Raises:
            ApiError: 400 naming the bad field.
        """
        return self.tag_result(body).to_dict()

    def tag_raw(self, raw: bytes) -> dict[str, Any]:
        """`tag` of a raw JSON body (raises `ApiError` 400 on bad JSON too)."""
        return self.tag(oa.decode_json_body(raw))

    def tag_result(self, body: dict[str, Any]) -> TagResult:
        """The tag of one request body (see module docstring).

        Raises:
            ApiError: 400 naming the bad field.
        """
        t0 = time.perf_counter()
        if "messages" in body:
            req = oa.parse_chat_request(body, limits=self.limits)
        else:
            req = oa.parse_completion_request(body)
        charge = vision_charge(req, self.vision)
        prompt_tokens = req.text_tokens + charge.vision_tokens
        messages = body["messages"] if req.endpoint == "chat" else None
        pred = self._predict(prompt_text(body), prompt_tokens, messages=messages)
        q: tuple[float | None, ...] = (None, None, None)
        if self._calibration is not None:
            dist = self._calibration.distributions([float(pred)])[0]
            q = tuple(round(dist.quantile(level), 1) for level in (0.1, 0.5, 0.9))
        return TagResult(
            predicted_output_tokens=int(pred),
            p10_output_tokens=q[0],
            p50_output_tokens=q[1],
            p90_output_tokens=q[2],
            prompt_tokens=prompt_tokens,
            text_tokens=req.text_tokens,
            vision_tokens=charge.vision_tokens,
            modality=req.modality,
            num_images=req.num_images,
            num_frames=req.num_frames,
            encoder_s=charge.encoder_s,
            preprocess_s=charge.preprocess_s,
            length_model=self.name,
            tag_us=(time.perf_counter() - t0) * 1e6,
        )


def create_app(settings: TaggerSettings) -> FastRoutes:
    """The tagger's FastAPI app (routes: /tag, /health, /ready (ready once its length model is
    loaded, i.e. as soon as it serves), /metrics)."""
    from prometheus_client import Counter, Histogram

    reg = new_registry()
    m_tag = Histogram("astro:tagger_tag_seconds", "Time per /tag (s)",
                      buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05), registry=reg)
    m_req = Counter("astro:tagger_requests", "/tag requests by outcome", ["outcome"], registry=reg)
    tagger = Tagger(settings)
    app = FastAPI(title="astro tagger", docs_url=None, redoc_url=None,
                  openapi_url=None)  # no /openapi.json: it would answer without the key
    install_error_handlers(app)
    add_health_and_metrics(app, reg, {"role": "tagger", "length_model": tagger.name})

    async def tag(request: Request):
        t0 = time.perf_counter()
        check_api_key(request, settings.api_key)
        raw = await read_body(request, settings.max_body_bytes)
        try:
            out = (await off_loop(tagger.tag_raw, raw)) if len(raw) > OFF_LOOP_BYTES else tagger.tag_raw(raw)
        except ApiError as exc:
            m_req.labels("bad_request").inc()
            raise HTTPUserError(exc.status_code, exc.message, exc.param, exc.err_type) from None
        m_req.labels("ok").inc()
        m_tag.observe(time.perf_counter() - t0)
        return JSONResponse(out)

    app.add_api_route("/tag", tag, methods=["POST"])
    return FastRoutes(app, {("POST", "/tag"): tag})


def run_tagger(settings: TaggerSettings, host: str, port: int, log_level: str = "warning",
                  ready_file: str | None = None) -> None:
    """Serve the tagger until SIGINT/SIGTERM (blocking); with an internal token in the
    environment ($ASTRO_INTERNAL_TOKEN / _FILE) only callers that send it get past /health
    and /ready."""
    from rps_astro_cli.protocol.internal_auth import guard, internal_token
    from rps_astro_cli.services.http_common import run_app, warn_exposed

    token = internal_token()
    warn_exposed(host, "tagger", token or settings.api_key)
    run_app(guard(create_app(settings), token), host, port, log_level, ready_file)
