"""The workload profiler (RPS-Serve §3.2): run a model alone, one request at a time,
over growing text lengths, image counts and video frame counts, and record per request
the preprocessing, encoder and prefill time and the tokens the model makes of each input
(`records.ProfileRecord`).

Two back ends share one plan (`plan_points`) and one record format:
- `profile_engine`: against a running OpenAI-compatible engine (the sim engine, or
  vLLM). Each request is a streaming chat completion with `max_tokens = output_tokens`
  and `ignore_eos`; TTFT is stamped at the first chunk carrying content; token counts
  come from `usage`. The sim engine adds `astro_timing` (vision tokens, KV tokens,
  encoder, prefill, wait before first schedule) to its final usage chunk; without it
  (a plain vLLM) vision tokens = prompt − the text tokens counted locally, and
  preprocess / encoder are NaN (prefill_s = TTFT then).
- `profile_virtual`: the same plan priced on an `ExecutionProfile` in closed form
  (`estimator.isolated_latency`) — exactly what the sim engine would measure, minus HTTP
  overhead; used by tests and when no engine is running.

Inputs: text from ShareGPT first human turns (`$ASTRO_DATA_DIR/sharegpt/
sharegpt_v3_prompts500.json`), concatenated and cut to each target length, or seeded
synthetic words when the file is absent; images are the real JPEGs in
`$ASTRO_DATA_DIR/llava/` as data URLs (else a generated 8×8 PNG stand-in); videos are a
stand-in MP4 header as a `video_url` data URL with `num_frames` (no LLaVA-Video files
ship here; a real vLLM needs real videos). Every stand-in is reported in `ProfileRun`.

Resumable: rows are appended to the CSV as they complete and points whose `key` is
already in the file are skipped.
"""

from __future__ import annotations

import base64
import json
import math
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.data_paths import data_dir
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.rps.records import ProfileRecord, append_profile_csv, read_profile_csv
from rps_astro_cli.tokens import count_tokens_fallback
from rps_astro_cli.types import MODALITIES

DEFAULT_TEXT_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
DEFAULT_IMAGE_COUNTS = (1, 2, 3, 4, 6, 8)
DEFAULT_FRAME_COUNTS = (4, 8, 16, 24, 32, 48, 64)
IMAGE_QUESTION_TOKENS = (8, 32, 96)
"""Question lengths (tokens) sent with images and videos, one per repeat (cycled)."""


@dataclass(frozen=True)
class ProfilePoint:
    """One request of the plan.

    key: stable id (modality, size, repeat). text_tokens: target length of the text part
    (tokens, fallback counter). n_images / n_frames: media items.
    """

    key: str
    modality: str
    text_tokens: int
    n_images: int = 0
    n_frames: int = 0


def plan_points(
    modalities: Sequence[str] = MODALITIES,
    text_tokens: Sequence[int] = DEFAULT_TEXT_TOKENS,
    image_counts: Sequence[int] = DEFAULT_IMAGE_COUNTS,
    frame_counts: Sequence[int] = DEFAULT_FRAME_COUNTS,
    repeats: int = 3,
) -> list[ProfilePoint]:
    """The profiling plan: per modality, growing sizes × `repeats`; modalities
    interleaved round-robin so a `--max-requests` cut still covers each of them.

    Raises:
        AstroUserError: unknown modality, repeats < 1, or a size < 1.
    """
    bad = [m for m in modalities if m not in MODALITIES]
    if bad:
        raise AstroUserError(f"unknown modality {bad[0]!r}", field="--modalities",
                             fix=f"use a comma list of {', '.join(MODALITIES)}")
    if repeats < 1:
        raise AstroUserError(f"must be ≥ 1, got {repeats}", field="--repeats")
    for name, seq in (("--text-tokens", text_tokens), ("--image-counts", image_counts),
                      ("--frame-counts", frame_counts)):
        if any(int(x) < 1 for x in seq):
            raise AstroUserError("sizes must be ≥ 1", field=name)
    per: dict[str, list[ProfilePoint]] = {}
    if "text" in modalities:
        per["text"] = [ProfilePoint(f"text-t{n}-r{r}", "text", int(n)) for n in text_tokens for r in range(repeats)]
    if "image" in modalities:
        per["image"] = [
            ProfilePoint(f"image-i{n}-r{r}", "image",
                         IMAGE_QUESTION_TOKENS[r % len(IMAGE_QUESTION_TOKENS)], n_images=int(n))
            for n in image_counts for r in range(repeats)
        ]
    if "video" in modalities:
        per["video"] = [
            ProfilePoint(f"video-f{n}-r{r}", "video",
                         IMAGE_QUESTION_TOKENS[r % len(IMAGE_QUESTION_TOKENS)], n_frames=int(n))
            for n in frame_counts for r in range(repeats)
        ]
    out: list[ProfilePoint] = []
    lists = [per[m] for m in MODALITIES if m in per]
    for i in range(max((len(x) for x in lists), default=0)):
        out.extend(lst[i] for lst in lists if i < len(lst))
    return out


# -- inputs ----------------------------------------------------------------------------
class TextSource:
    """Texts of a target token length (fallback counter) from ShareGPT first human
    turns, or seeded synthetic words when the file is absent."""

    def __init__(self, rng: np.random.Generator, path: Path | None = None):
        self.rng = rng
        self.source = "synthetic"
        self.words: list[str] = []
        p = path
        if p is None and data_dir() is not None:
            p = data_dir() / "sharegpt" / "sharegpt_v3_prompts500.json"
        if p is not None and p.is_file():
            try:
                entries = json.loads(p.read_text())
            except json.JSONDecodeError as exc:
                raise AstroUserError(f"{p} is not valid JSON: {exc}", field="--sharegpt") from None
            for e in entries:
                conv = e.get("conversations") or []
                turn = next((c.get("value", "") for c in conv if c.get("from") == "human"), "")
                self.words.extend(turn.split())
            if self.words:
                self.source = f"sharegpt:{p}"
        if not self.words:
            vocab = ["system", "request", "token", "model", "serve", "image", "video", "latency",
                     "schedule", "batch", "memory", "queue", "prefill", "decode", "question", "answer"]
            self.words = [vocab[i] for i in rng.integers(0, len(vocab), 20_000)]

    def text(self, num_tokens: int) -> str:
        """A text of about `num_tokens` tokens (exact under the fallback counter unless a
        single word overshoots), starting at a seeded random offset."""
        start = int(self.rng.integers(0, len(self.words)))
        out: list[str] = []
        n = 0
        i = start
        while n < num_tokens:
            w = self.words[i % len(self.words)]
            c = count_tokens_fallback(w)
            if n + c > num_tokens and out:
                break
            out.append(w)
            n += c
            i += 1
        return " ".join(out)


def _png_stand_in() -> bytes:
    """A valid 8×8 grey PNG (stand-in image)."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    raw = b"".join(b"\x00" + bytes([128] * 8) for _ in range(8))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


_MP4_STAND_IN = b"\x00\x00\x00\x18ftypmp42\x00\x00\x00\x00mp42isom" + b"\x00\x00\x00\x08free"


class MediaSource:
    """Image data URLs (real LLaVA JPEGs when present, else a PNG stand-in) and a
    stand-in video data URL."""

    def __init__(self, image_dir: Path | None = None):
        d = image_dir
        if d is None and data_dir() is not None:
            d = data_dir() / "llava"
        files = sorted(d.glob("*.jpg")) if d is not None and d.is_dir() else []
        if files:
            self.images = ["data:image/jpeg;base64," + base64.b64encode(f.read_bytes()).decode() for f in files]
            self.image_source = f"{len(files)} JPEGs from {d}"
        else:
            self.images = ["data:image/png;base64," + base64.b64encode(_png_stand_in()).decode()]
            self.image_source = "stand-in 8x8 PNG (no image folder found)"
        self.video = "data:video/mp4;base64," + base64.b64encode(_MP4_STAND_IN).decode()
        self.video_source = "stand-in MP4 header with num_frames (no LLaVA-Video files here)"


def build_messages(point: ProfilePoint, text: TextSource, media: MediaSource) -> list[dict[str, Any]]:
    """The chat messages of a profiling point (one user turn)."""
    question = text.text(point.text_tokens)
    if point.modality == "text":
        return [{"role": "user", "content": question}]
    parts: list[dict[str, Any]] = []
    for i in range(point.n_images):
        parts.append({"type": "image_url", "image_url": {"url": media.images[i % len(media.images)]}})
    if point.n_frames:
        parts.append({"type": "video_url", "video_url": {"url": media.video, "num_frames": point.n_frames}})
    parts.append({"type": "text", "text": question})
    return [{"role": "user", "content": parts}]


def _text_tokens_of(messages: list[dict[str, Any]]) -> int:
    from rps_astro_cli.protocol.openai import chat_prompt_tokens
    from rps_astro_cli.protocol.openai_types import ApiLimits

    return chat_prompt_tokens(messages, count_tokens_fallback,
                              ApiLimits(max_media_items=1024, max_num_frames=10_000))[0]


# -- runs ------------------------------------------------------------------------------
@dataclass
class ProfileRun:
    """What a profiling run did.

    done: new rows written. skipped_existing: points already in the file (resume).
    rejected: points the engine refused (4xx, e.g. over the context length), with reason.
    failed: points that failed (5xx / network), with reason. inputs: where texts and
    media came from (stand-ins named).
    """

    out_path: Path
    done: int = 0
    skipped_existing: int = 0
    rejected: list[tuple[str, str]] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)
    inputs: dict[str, str] = field(default_factory=dict)


def _existing_keys(path: Path) -> set[str]:
    if not path.exists() or path.stat().st_size == 0:
        return set()
    return {r.key for r in read_profile_csv(path)}


def _todo(points: Sequence[ProfilePoint], out: Path, max_requests: int | None, run: ProfileRun) -> list[ProfilePoint]:
    have = _existing_keys(out)
    todo = [p for p in points if p.key not in have]
    run.skipped_existing = len(points) - len(todo)
    if max_requests is not None:
        if max_requests < 1:
            raise AstroUserError(f"must be ≥ 1, got {max_requests}", field="--max-requests")
        todo = todo[:max_requests]
    return todo


def profile_virtual(
    profile,
    points: Sequence[ProfilePoint],
    out: str | Path,
    rng: np.random.Generator,
    *,
    output_tokens: int = 8,
    max_requests: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> ProfileRun:
    """Price the plan on an `ExecutionProfile` (see module docstring) and append rows.

    Points whose prompt + output exceeds the profile's max_model_len are rejected.
    """
    from rps_astro_cli.rps.estimator import isolated_latency
    from rps_astro_cli.sim.latency import LatencyModel

    outp = Path(out)
    run = ProfileRun(outp)
    todo = _todo(points, outp, max_requests, run)
    text, media = TextSource(rng), MediaSource()
    run.inputs = {"text": text.source, "images": "priced on the profile (no media sent)",
                  "videos": "priced on the profile (no media sent)", "engine": f"virtual:{profile.profile_id}"}
    lm = LatencyModel(profile)
    v = profile.vision
    for i, pt in enumerate(todo):
        if pt.modality != "text" and v is None:
            run.rejected.append((pt.key, "the profile is text-only"))
            continue
        msgs = build_messages(pt, text, media)
        text_tok = _text_tokens_of(msgs)
        vis = (pt.n_images * v.tokens_per_image + pt.n_frames * v.tokens_per_frame) if v else 0
        pre = (pt.n_images * v.preprocess_s_per_image + pt.n_frames * v.preprocess_s_per_frame) if v else 0.0
        enc = (pt.n_images * v.encoder_s_per_image + pt.n_frames * v.encoder_s_per_frame) if v else 0.0
        prompt = text_tok + vis
        if prompt + output_tokens > profile.max_model_len:
            run.rejected.append((pt.key,
                                 f"prompt {prompt} + output {output_tokens} > max_model_len {profile.max_model_len}"))
            continue
        iso = isolated_latency(lm, prompt, output_tokens, enc, pre)
        rec = ProfileRecord(
            key=pt.key, modality=pt.modality, n_images=pt.n_images, n_frames=pt.n_frames,
            prompt_tokens=prompt, vision_tokens=vis, kv_tokens=prompt, output_tokens=output_tokens,
            preprocess_s=pre, encoder_s=enc, prefill_s=iso.prefill_s - enc, ttft_s=iso.ttft_s, e2e_s=iso.e2e_s,
        )
        append_profile_csv(outp, [rec])
        run.done += 1
        if on_progress:
            on_progress(i + 1, len(todo))
    return run


@dataclass(frozen=True)
class FootprintPoint:
    """One request of a deployment's own traffic, to be profiled as it is (`profile_footprints`).

    key: stable id (e.g. `wl-<request_id>`). modality: text / image / video.
    text_tokens: tokens of the text part (the workload's counter). image_sizes: (width_px,
    height_px) of each image ((0, 0) = size unknown: the profile's `tokens_per_image`).
    n_frames: video frames sampled. output_tokens: the reply's length (tokens).
    """

    key: str
    modality: str
    text_tokens: int
    output_tokens: int
    image_sizes: tuple[tuple[int, int], ...] = ()
    n_frames: int = 0


def profile_footprints(
    profile,
    points: Sequence[FootprintPoint],
    out: str | Path,
    *,
    chunked_prefill: bool = True,
    max_requests: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> ProfileRun:
    """Price a deployment's own requests on an `ExecutionProfile` (whose limits are the
    engine's: `max_num_batched_tokens` is the prefill chunk, `max_model_len` and the KV
    cache bound what can run) and append one row per request (resumable by key).

    Each row is the request run alone to the end of its reply, as RPS-Serve's profiler runs
    its datasets (§3.2): vision tokens by the profile's own rule (`VisionCosts.image_tokens`
    per image size — AnyRes on LLaVA-OneVision — and `video_tokens` per frame count),
    encoder and preprocessing per item, prefill by `isolated_latency` with the engine's
    chunk, and **kv_tokens = prompt + reply**, the KV footprint the request reaches (the
    tokens cached when its reply ends: what the paper's Figure 2a plots). Rejected: a
    prompt + reply above max_model_len or above the whole KV cache (it could never finish).
    """
    from rps_astro_cli.rps.estimator import isolated_latency
    from rps_astro_cli.sim.latency import LatencyModel

    outp = Path(out)
    run = ProfileRun(outp)
    todo = _todo(points, outp, max_requests, run)
    run.inputs = {"requests": f"{len(points)} workload requests (their own media sizes, frames and replies)",
                  "engine": f"virtual:{profile.profile_id}",
                  "limits": f"chunk {profile.max_num_batched_tokens if chunked_prefill else 'whole prompt'}, "
                            f"max_model_len {profile.max_model_len}, KV {profile.num_gpu_blocks} blocks × "
                            f"{profile.block_size}"}
    lm = LatencyModel(profile)
    v = profile.vision
    kv_cap = profile.num_gpu_blocks * profile.block_size
    for i, pt in enumerate(todo):
        if pt.modality not in MODALITIES:
            run.rejected.append((pt.key, f"unknown modality {pt.modality!r}"))
            continue
        media = bool(pt.image_sizes) or pt.n_frames > 0
        if media and v is None:
            run.rejected.append((pt.key, "the profile is text-only"))
            continue
        if pt.output_tokens < 1 or pt.text_tokens < 0:
            run.rejected.append((pt.key, f"needs output_tokens ≥ 1 and text_tokens ≥ 0, got "
                                         f"{pt.output_tokens}, {pt.text_tokens}"))
            continue
        n_img = len(pt.image_sizes)
        vis = pre = enc = 0
        if v is not None and media:
            vis = sum(v.image_tokens(w, h) for w, h in pt.image_sizes) + (v.video_tokens(pt.n_frames)
                                                                           if pt.n_frames else 0)
            pre = n_img * v.preprocess_s_per_image + pt.n_frames * v.preprocess_s_per_frame
            enc = n_img * v.encoder_s_per_image + pt.n_frames * v.encoder_s_per_frame
        prompt = max(1, pt.text_tokens + vis)
        total = prompt + pt.output_tokens
        if total > profile.max_model_len:
            run.rejected.append((pt.key, f"prompt {prompt} + output {pt.output_tokens} > max_model_len "
                                         f"{profile.max_model_len}"))
            continue
        if total > kv_cap:
            run.rejected.append((pt.key, f"prompt {prompt} + output {pt.output_tokens} > the KV cache's "
                                         f"{kv_cap} tokens"))
            continue
        iso = isolated_latency(lm, prompt, pt.output_tokens, enc, pre,
                               chunk_tokens=None if chunked_prefill else prompt)
        rec = ProfileRecord(
            key=pt.key, modality=pt.modality, n_images=n_img, n_frames=pt.n_frames,
            prompt_tokens=prompt, vision_tokens=vis, kv_tokens=total, output_tokens=pt.output_tokens,
            preprocess_s=pre, encoder_s=enc, prefill_s=iso.prefill_s - enc, ttft_s=iso.ttft_s, e2e_s=iso.e2e_s,
        )
        append_profile_csv(outp, [rec])
        run.done += 1
        if on_progress:
            on_progress(i + 1, len(todo))
    return run


def _stream_chat(client, url: str, body: dict[str, Any]) -> tuple[float, float, dict[str, Any], dict[str, Any]]:
    """POST a streaming chat completion; (ttft_s, e2e_s, usage, astro_timing)."""
    t0 = time.perf_counter()
    ttft = math.nan
    usage: dict[str, Any] = {}
    timing: dict[str, Any] = {}
    with client.stream("POST", url, json=body) as resp:
        if resp.status_code >= 400:
            resp.read()
            try:
                msg = resp.json()["error"]["message"]
            except Exception:
                msg = resp.text[:200]
            raise _HttpError(resp.status_code, msg)
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                raise _HttpError(500, str(obj["error"].get("message")))
            for ch in obj.get("choices") or ():
                if math.isnan(ttft) and ((ch.get("delta") or {}).get("content") or ch.get("text")):
                    ttft = time.perf_counter() - t0
            if obj.get("usage"):
                usage = obj["usage"]
            if obj.get("astro_timing"):
                timing = obj["astro_timing"]
    return ttft, time.perf_counter() - t0, usage, timing


class _HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _f(d: dict[str, Any], k: str) -> float:
    v = d.get(k)
    return float(v) if isinstance(v, (int, float)) else math.nan


def profile_engine(
    engine_url: str,
    points: Sequence[ProfilePoint],
    out: str | Path,
    rng: np.random.Generator,
    *,
    model: str | None = None,
    output_tokens: int = 8,
    max_requests: int | None = None,
    timeout_s: float = 600.0,
    api_key: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> ProfileRun:
    """Profile a running engine, one request at a time (see module docstring).

    Raises:
        AstroUserError: the engine cannot be reached.
    """
    import httpx

    outp = Path(out)
    run = ProfileRun(outp)
    todo = _todo(points, outp, max_requests, run)
    text, media = TextSource(rng), MediaSource()
    run.inputs = {"text": text.source, "images": media.image_source, "videos": media.video_source,
                  "engine": engine_url}
    base = engine_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout_s, headers=headers) as client:
        try:
            client.get(f"{base}/v1/models", timeout=10.0)
        except httpx.HTTPError as exc:
            raise AstroUserError(f"cannot reach the engine at {engine_url}: {exc}", field="--engine-url",
                                 fix="start one with `astro serve engine` and pass its URL") from None
        for i, pt in enumerate(todo):
            msgs = build_messages(pt, text, media)
            body: dict[str, Any] = {"messages": msgs, "max_tokens": output_tokens, "ignore_eos": True,
                                    "stream": True, "stream_options": {"include_usage": True}}
            if model:
                body["model"] = model
            try:
                ttft, e2e, usage, timing = _stream_chat(client, f"{base}/v1/chat/completions", body)
            except _HttpError as exc:
                (run.rejected if 400 <= exc.status < 500 else run.failed).append((pt.key, f"HTTP {exc.status}: {exc}"))
                continue
            except httpx.HTTPError as exc:
                run.failed.append((pt.key, f"{type(exc).__name__}: {exc}"))
                continue
            prompt = int(usage.get("prompt_tokens") or 0)
            if prompt <= 0 or math.isnan(ttft):
                run.failed.append((pt.key, "no usage or no content in the stream"))
                continue
            if timing:
                vis = int(timing.get("vision_tokens", 0))
                kv = int(timing.get("kv_tokens", prompt))
                pre, enc, pref = _f(timing, "wait_s"), _f(timing, "encoder_s"), _f(timing, "prefill_s")
            else:
                vis = max(0, prompt - _text_tokens_of(msgs)) if pt.modality != "text" else 0
                kv, pre, enc = prompt, math.nan, math.nan
                pref = ttft
            rec = ProfileRecord(
                key=pt.key, modality=pt.modality, n_images=pt.n_images, n_frames=pt.n_frames,
                prompt_tokens=prompt, vision_tokens=vis, kv_tokens=kv,
                output_tokens=int(usage.get("completion_tokens") or output_tokens),
                preprocess_s=pre, encoder_s=enc, prefill_s=pref, ttft_s=ttft, e2e_s=e2e,
            )
            append_profile_csv(outp, [rec])
            run.done += 1
            if on_progress:
                on_progress(i + 1, len(todo))
    return run


# -- summary and plots -----------------------------------------------------------------
def summarize(records: Sequence[ProfileRecord]) -> list[dict[str, Any]]:
    """Per modality: rows, prompt tokens (min / median / max), impact (prefill incl.
    encoder) median and P90 (ms), encoder and preprocess medians (ms; NaN if unknown)."""
    out = []
    for m in MODALITIES:
        rows = [r for r in records if r.modality == m]
        if not rows:
            continue
        pt = np.array([r.prompt_tokens for r in rows])
        imp = np.array([r.impact_s for r in rows]) * 1000
        enc = np.array([r.encoder_s for r in rows]) * 1000
        pre = np.array([r.preprocess_s for r in rows]) * 1000
        out.append({
            "modality": m, "rows": len(rows),
            "prompt_tokens_min": int(pt.min()), "prompt_tokens_median": float(np.median(pt)),
            "prompt_tokens_max": int(pt.max()),
            "prefill_ms_median": float(np.median(imp)), "prefill_ms_p90": float(np.percentile(imp, 90)),
            "encoder_ms_median": float(np.median(enc)), "preprocess_ms_median": float(np.median(pre)),
        })
    return out


def write_plots(records: Sequence[ProfileRecord], out_png: str | Path) -> Path:
    """Two panels: prefill latency (incl. encoder) vs prompt tokens, and KV tokens vs
    prefill latency (the classifier's feature space), log axes, one colour per modality."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for m, colour in zip(MODALITIES, ("tab:blue", "tab:orange", "tab:red")):
        rows = [r for r in records if r.modality == m]
        if not rows:
            continue
        axes[0].scatter([r.prompt_tokens for r in rows], [r.impact_s * 1000 for r in rows], s=12, c=colour, label=m)
        axes[1].scatter([r.impact_s * 1000 for r in rows], [r.kv_tokens for r in rows], s=12, c=colour, label=m)
    axes[0].set(xscale="log", yscale="log", xlabel="prompt tokens", ylabel="prefill incl. encoder (ms)")
    axes[1].set(xscale="log", yscale="log", xlabel="prefill incl. encoder (ms)", ylabel="KV tokens")
    for ax in axes:
        ax.legend()
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    p = Path(out_png)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def iter_modalities(arg: str) -> Iterator[str]:
    """Parse a comma list of modalities (`--modalities text,image`)."""
    for m in arg.split(","):
        m = m.strip()
        if m:
            yield m
