"""Conversation workloads: ShareGPT, LLaVA-Instruct (+ images), LLaVA-Video (+ videos) and
RPS-Serve's TO / ML / MH mixes of them (registry and data resolution: `workloads`)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.bench.media import MediaItem, duration_bucket_s, set_sample_images
from rps_astro_cli.bench.workload_base import (
    WORKLOADS,
    BenchRequest,
    Loader,
    Workload,
    WorkloadOptions,
    _first_pair,
    _length_ok,
    _read_json_records,
    _resolve,
    _take,
)
from rps_astro_cli.bench.workloads_traces import load_synthetic
from rps_astro_cli.data_paths import data_dir
from rps_astro_cli.errors import AstroUserError

# -- ShareGPT --------------------------------------------------------------------------------

SHAREGPT_FILES = ("ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt/ShareGPT_V3_unfiltered_cleaned_split.json",
                  "sharegpt/sharegpt_v3_sample500.json")


@WORKLOADS.register("sharegpt")
def load_sharegpt(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """ShareGPT conversations, vLLM-compatible.

    Per entry: the first human turn followed by a gpt turn is the (prompt, reference reply)
    pair. vLLM uses turns 0 and 1 whatever their roles; we take the first human→gpt pair,
    so an entry that starts with a gpt turn (a third of ShareGPT V3) is kept and counted
    in `notes["leading_gpt_turn"]`. Skipped and counted: `empty`, `single_turn`,
    `no_human_gpt_pair`, `empty_turn`, and vLLM's length filter (`_length_ok`). Pairs are
    shuffled with `rng` before the length filter, which runs until `num_requests` pass.

    With `opts.multi_turn`: `sharegpt_sessions` (whole conversations, turn by turn).
    """
    path, source = _resolve(opts, SHAREGPT_FILES, "ShareGPT JSON")
    if opts.multi_turn and path is None:
        raise AstroUserError("--multi-turn needs ShareGPT conversations and none was found", field="--multi-turn",
                             fix="pass --path FILE (a ShareGPT JSON) or set ASTRO_DATA_DIR")
    if path is None:
        recs = _sharegpt_from_hub()
        if recs is None:
            wl = load_synthetic(opts, rng)
            wl.name = "sharegpt"
            wl.warnings.insert(0, "no ShareGPT file found (no --path, no data folder, no hub): using SYNTHETIC "
                                  "ShareGPT-like lengths instead — lognormal fits to the Astrolabe paper's "
                                  "10,000-request ShareGPT length trace (Llama-2 tokenizer), no real prompts. "
                                  "Fix: pass --path FILE (a ShareGPT JSON) or set ASTRO_DATA_DIR=<folder with "
                                  "sharegpt/sharegpt_v3_sample500.json or ShareGPT_V3_unfiltered_cleaned_split.json>")
            return wl
        source = "Hugging Face hub (datasets): anon8231489123/ShareGPT_Vicuna_unfiltered"
    else:
        recs = _read_json_records(path)
    if opts.multi_turn:
        return sharegpt_sessions(recs, opts, rng, source)
    if opts.sampling == "vllm":
        from rps_astro_cli.bench.workloads_vllm import sharegpt_vllm

        return sharegpt_vllm(recs, opts, source)
    skipped: Counter = Counter()
    notes: Counter = Counter()
    pairs: list[tuple[str, str, str]] = []
    for i, entry in enumerate(recs):
        got = _first_pair(entry.get("conversations") or [])
        if isinstance(got, str):
            skipped[got] += 1
            continue
        if got[2] > 0:
            notes["leading_gpt_turn"] += 1
        pairs.append((got[0], got[1], str(entry.get("id", i))))
    order = rng.permutation(len(pairs))
    out: list[BenchRequest] = []
    for j in order:
        if len(out) >= opts.num_requests:
            break
        prompt, reply, sid = pairs[j]
        p, o = opts.counter(prompt), opts.counter(reply)
        if _length_ok(p, o, opts, True, skipped):
            out.append(BenchRequest(f"sharegpt-{len(out)}", prompt, p, o, source_id=sid))
    warnings: list[str] = []
    return Workload("sharegpt", _take(out, opts.num_requests, warnings, "sharegpt"), source,
                    dict(skipped), dict(notes), warnings)


_HUMAN = ("human", "user")
_GPT = ("gpt", "chatgpt", "assistant", "bard", "bing")


def _turn_pairs(conv: list[Any]) -> list[tuple[str, str]] | str:
    """The conversation's consecutive (human, gpt) turns from its first human turn on,
    stopping at the first turn that breaks the alternation; or a skip reason."""
    if not conv:
        return "empty"
    i = 0
    while i < len(conv) and isinstance(conv[i], dict) and conv[i].get("from") not in _HUMAN:
        i += 1
    out: list[tuple[str, str]] = []
    while i + 1 < len(conv):
        h, g = conv[i], conv[i + 1]
        if not (isinstance(h, dict) and isinstance(g, dict) and h.get("from") in _HUMAN and g.get("from") in _GPT):
            break
        p, r = h.get("value"), g.get("value")
        if not isinstance(p, str) or not isinstance(r, str) or not p.strip() or not r.strip():
            break
        out.append((p, r))
        i += 2
    return out or "no_human_gpt_pair"


def sharegpt_sessions(recs: list[dict[str, Any]], opts: WorkloadOptions, rng: np.random.Generator,
                      source: str) -> Workload:
    """ShareGPT conversations replayed turn by turn (`-w sharegpt --multi-turn`).

    Conversations are shuffled with `rng`; each becomes a session of its consecutive
    (human, gpt) turns (leading gpt turns dropped, counted in `notes`). Turn t's prompt is
    the whole history: every earlier human and gpt message and turn t's human message,
    joined by newlines (so its token ids start with the previous turn's prompt and reply);
    its reference reply is turn t's gpt message. A session ends at its first turn whose
    prompt + reply exceeds `max_total_tokens` (the rest counted as `turn_too_long`) or
    whose prompt or reply has fewer than `min_tokens`. Turn ≥ 1 waits an exponential think
    time of mean `think_time_s` (drawn from `rng`) after the previous reply. Sessions are
    taken whole until `num_requests` turns are reached (the last one is cut there).
    """
    if opts.think_time_s < 0:
        raise AstroUserError(f"must be ≥ 0, got {opts.think_time_s}", field="--think-time")
    skipped: Counter = Counter()
    notes: Counter = Counter()
    out: list[BenchRequest] = []
    for j in rng.permutation(len(recs)):
        if len(out) >= opts.num_requests:
            break
        entry = recs[int(j)]
        conv = entry.get("conversations") or []
        got = _turn_pairs(conv)
        if isinstance(got, str):
            skipped[got] += 1
            continue
        if isinstance(conv[0], dict) and conv[0].get("from") not in _HUMAN:
            notes["leading_gpt_turn"] += 1
        sid = str(entry.get("id", int(j)))
        history = ""
        turns = 0
        for t, (human, reply) in enumerate(got):
            prompt = f"{history}\n{human}" if history else human
            p, o = opts.counter(prompt), opts.counter(reply)
            if p < opts.min_tokens or o < opts.min_tokens:
                skipped["turn_too_short"] += len(got) - t
                break
            if p + o > opts.max_total_tokens:
                skipped["turn_too_long"] += len(got) - t
                break
            if len(out) >= opts.num_requests:
                break
            think = float(rng.exponential(opts.think_time_s)) if t > 0 and opts.think_time_s > 0 else 0.0
            out.append(BenchRequest(f"sharegpt-{sid}-t{t}", prompt, p, o, source_id=sid, session_id=sid,
                                    turn=t, think_s=think, reply=reply))
            history = f"{prompt}\n{reply}"
            turns += 1
        if turns:
            notes["sessions"] += 1
    return Workload("sharegpt", out, source + " (multi-turn sessions)", dict(skipped), dict(notes), [])


def _sharegpt_from_hub() -> list[dict[str, Any]] | None:
    """ShareGPT records from the hub via `datasets`, or None when not installed/offline."""
    try:
        import datasets  # optional extra "hub"
    except ImportError:
        return None
    try:  # pragma: no cover - needs network
        ds = datasets.load_dataset("anon8231489123/ShareGPT_Vicuna_unfiltered",
                                   data_files="ShareGPT_V3_unfiltered_cleaned_split.json", split="train")
        return [dict(r) for r in ds]
    except Exception:  # pragma: no cover - offline
        return None


# -- LLaVA -----------------------------------------------------------------------------------

LLAVA_FILES = ("llava/llava_instruct_150k.json", "llava_instruct_150k.json", "llava/llava_instruct_150k_subset100.json")
LLAVA_VIDEO_FILES = ("llava_video/llava_video_178k.json", "llava/llava_video_178k.json")


def _media_dir(given: Path | None, default_rel: str) -> tuple[Path | None, bool]:
    """(folder, exists)."""
    if given is not None:
        p = Path(given).expanduser()
        return p, p.is_dir()
    d = data_dir()
    if d is None:
        return None, False
    p = d / default_rel
    return p, p.is_dir()


def _use_sample_jpegs() -> int:
    d = data_dir()
    jpgs = sorted((d / "llava").glob("*.jpg")) if d is not None and (d / "llava").is_dir() else []
    set_sample_images(jpgs)
    return len(jpgs)


def _media_pairs(recs: list, opts: WorkloadOptions, rng: np.random.Generator, tag_re: str, kind: str,
                 media_dir: Path | None, media_ok: bool, skipped: Counter, notes: Counter):
    """The LLaVA-style records a media workload takes, in random order, at most
    `opts.num_requests`: yields (record index, record, prompt with the `tag_re` media
    tags removed, prompt tokens, output tokens, media file or None) for each record whose
    first (question, answer) pair passes `_length_ok`. The media file is
    `media_dir / record[kind]` when that folder is usable and the file exists; each
    None counts in `notes[f"{kind}_stand_in"]`. Records left out count in `skipped`."""
    taken = 0
    for i in rng.permutation(len(recs)):
        if taken >= opts.num_requests:
            break
        e = recs[i]
        got = _first_pair(e.get("conversations") or [])
        if isinstance(got, str):
            skipped[got] += 1
            continue
        prompt = re.sub(tag_re, " ", got[0]).strip()
        p, o = opts.counter(prompt), opts.counter(got[1])
        if not _length_ok(p, o, opts, False, skipped):
            continue
        name = e.get(kind)
        f = media_dir / name if (media_ok and isinstance(name, str) and media_dir) else None
        if f is not None and not f.is_file():
            f = None
        if f is None:
            notes[f"{kind}_stand_in"] += 1
        taken += 1
        yield int(i), e, prompt, p, o, f


@WORKLOADS.register("llava-instruct")
def load_llava_instruct(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """LLaVA-Instruct-150K records with their images (`--image-dir`, default
    `<data>/llava/images`). The `<image>` tag is removed from the prompt wherever it sits.
    Absent folder or file → a stand-in image (`media` module), a loud warning, and
    `notes["image_stand_in"]`; the image is never dropped. No records at all → synthetic
    image requests (`LLAVA_SYNTHETIC_STATS`), said loudly."""
    path, source = _resolve(opts, LLAVA_FILES, "LLaVA-Instruct JSON")
    if path is None:
        return _synthetic_llava(opts, rng)
    img_dir, img_ok = _media_dir(opts.image_dir, "llava/images")
    warnings: list[str] = []
    if not img_ok:
        n = _use_sample_jpegs()
        what = f"{n} real sample JPEG(s) from the data folder" if n else "generated 640×480 JPEGs"
        warnings.append(f"IMAGE FOLDER ABSENT ({img_dir or 'none given'}): every image request gets a "
                        f"STAND-IN image ({what}); pass --image-dir with the COCO train2017 images")
    skipped: Counter = Counter()
    notes: Counter = Counter()
    pool = []
    recs = _read_json_records(path)
    for i, e, prompt, p, o, f in _media_pairs(recs, opts, rng, r"\s*<image>\s*", "image", img_dir, img_ok,
                                              skipped, notes):
        media = (MediaItem("image", f, stand_in=f is None, seed=i),)
        pool.append(BenchRequest(f"llava-{len(pool)}", prompt, p, o, "image", media, source_id=str(e.get("id", i))))
    if img_ok and notes["image_stand_in"]:
        _use_sample_jpegs()
        warnings.append(f"{notes['image_stand_in']} image file(s) missing from {img_dir}: STAND-IN images used")
    return Workload("llava-instruct", _take(pool, opts.num_requests, warnings, "llava-instruct"), source,
                    dict(skipped), dict(notes), warnings)


LLAVA_SYNTHETIC_STATS = {"prompt_log_mu": 2.584, "prompt_log_sigma": 0.178,
                         "output_log_mu": 3.059, "output_log_sigma": 0.503}
"""Lognormal fits (mean and std of ln tokens, fallback counter) to the first (question,
answer) pair of the 100 LLaVA-Instruct-150K records in the data folder's `llava/`
(hiyouga/LLaMA-Factory @ 175b56bc data/llava_instruct_100.json): questions 9–23 tokens
(median 13), answers 8–63 tokens (median 19.5)."""


def _synthetic_llava(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """Image requests with lengths from `LLAVA_SYNTHETIC_STATS` and stand-in images, for
    machines without LLaVA-Instruct records (said loudly)."""
    s = LLAVA_SYNTHETIC_STATS
    n_img = _use_sample_jpegs()
    out = []
    for k in range(opts.num_requests):
        p = max(1, int(round(rng.lognormal(s["prompt_log_mu"], s["prompt_log_sigma"]))))
        o = max(1, int(round(rng.lognormal(s["output_log_mu"], s["output_log_sigma"]))))
        out.append(BenchRequest(f"llava-{k}", "", p, o, "image", (MediaItem("image", None, True, seed=k),)))
    what = f"{n_img} real sample JPEG(s)" if n_img else "generated 640×480 JPEGs"
    return Workload("llava-instruct", out, "synthetic LLaVA-Instruct-like lengths (lognormal fits to 100 "
                    "LLaVA-Instruct-150K records)", {}, {"image_stand_in": len(out)},
                    [f"no LLaVA-Instruct file found (no --path, no data folder): SYNTHETIC image requests with "
                     f"STAND-IN images ({what}) and lengths fitted to 100 LLaVA-Instruct-150K records. Fix: pass "
                     f"--path FILE or set ASTRO_DATA_DIR=<folder with llava/llava_instruct_150k.json>"])


@WORKLOADS.register("llava-video")
def load_llava_video(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """LLaVA-Video-178K records `{id, video, conversations, data_source}` with their videos
    (`--video-dir`, default `<data>/llava_video`); each request asks for `--max-frames`
    frames. Absent folder/file → a stand-in MJPEG video of the record's duration bucket
    (`media.duration_bucket_s`), a loud warning and `notes["video_stand_in"]`."""
    path, source = _resolve(opts, LLAVA_VIDEO_FILES, "LLaVA-Video JSON")
    if path is None:
        raise AstroUserError("no LLaVA-Video file found", field="--path",
                             fix="pass --path with LLaVA-Video-178K records (JSON list)")
    vdir, v_ok = _media_dir(opts.video_dir, "llava_video")
    warnings: list[str] = []
    if not v_ok:
        warnings.append(f"VIDEO FOLDER ABSENT ({vdir or 'none given'}): every video request gets a STAND-IN "
                        f"MJPEG video of its duration bucket with {opts.max_frames} frames; pass --video-dir")
    skipped: Counter = Counter()
    notes: Counter = Counter()
    pool = []
    recs = _read_json_records(path)
    for i, e, prompt, p, o, f in _media_pairs(recs, opts, rng, r"\s*<video>\s*|\s*<image>\s*", "video", vdir,
                                              v_ok, skipped, notes):
        vid = e.get("video")
        dur = duration_bucket_s(f"{e.get('data_source', '')} {vid or ''}")
        media = (MediaItem("video", f, stand_in=f is None, num_frames=opts.max_frames, duration_s=dur),)
        pool.append(BenchRequest(f"video-{len(pool)}", prompt, p, o, "video", media, source_id=str(e.get("id", i))))
    if v_ok and notes["video_stand_in"]:
        warnings.append(f"{notes['video_stand_in']} video file(s) missing from {vdir}: STAND-IN videos used")
    return Workload("llava-video", _take(pool, opts.num_requests, warnings, "llava-video"), source,
                    dict(skipped), dict(notes), warnings)


# -- RPS-Serve mixes -------------------------------------------------------------------------

MIXES = {"mix-to": (1.0, 0.0, 0.0), "mix-ml": (0.80, 0.15, 0.05), "mix-mh": (0.40, 0.40, 0.20),
         # sensitivity mixes (issue 15; ours): MH's media share shrinking toward ML, the MH
         # readings the paper's words allow ("a significantly higher share" of media)
         "mix-50-30-20": (0.50, 0.30, 0.20), "mix-60-30-10": (0.60, 0.30, 0.10),
         "mix-70-20-10": (0.70, 0.20, 0.10)}
"""(text, image, video) shares of the RPS-Serve workload mixes. The paper gives no numbers:
TO is text only, ML "introduces a small fraction of image and video requests", MH "a
significantly higher share". Our choices: ML = 80/15/5 keeps text dominant, as production
multimodal traffic is (ServeGen, Xiang et al. 2025: most requests to multimodal models
carry no image); MH = 40/40/20 makes media the majority while videos, the heaviest
(rocks), stay the smallest share. Counts are exact (rounded, remainder to text) and the
order is a seeded shuffle."""


def _mix(name: str) -> Loader:
    def load(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
        t, i, v = MIXES[name]
        n = opts.num_requests
        n_img, n_vid = round(n * i), round(n * v)
        n_txt = n - n_img - n_vid
        parts: list[Workload] = []
        text_opts = replace(opts, path=None, num_requests=max(n_txt, 1))
        if n_txt:
            parts.append(load_sharegpt(text_opts, rng))
        if n_img:
            parts.append(_images_for_mix(replace(opts, path=None, num_requests=n_img), rng))
        if n_vid:
            parts.append(_video_for_mix(replace(opts, path=None, num_requests=n_vid), rng))
        reqs = [r for w in parts for r in w.requests]
        reqs = [reqs[j] for j in rng.permutation(len(reqs))]
        reqs = [replace(r, request_id=f"{name}-{k}-{r.modality}") for k, r in enumerate(reqs)]
        skipped: Counter = Counter()
        notes: Counter = Counter()
        for w in parts:
            skipped.update({f"{w.name}:{k}": c for k, c in w.skipped.items()})
            notes.update({f"{w.name}:{k}": c for k, c in w.notes.items()})
        src = "; ".join(f"{w.name} ← {w.source}" for w in parts)
        warns = [x for w in parts for x in w.warnings]
        return Workload(name, reqs, f"{name} text/image/video = {t:.0%}/{i:.0%}/{v:.0%}: {src}",
                        dict(skipped), dict(notes), warns)

    load.__doc__ = f"RPS-Serve mix {name} (see MIXES)."
    return load


# -- the mixes' media footprint (the RPS-Serve authors' harness: github.com/muse-research-lab/rps-serve, llmperf/) --

COMPLEX_REASONING_FILES = ("llava/complex_reasoning_77k.json", "complex_reasoning_77k.json")
LLAVA_BENCH_QA = "llava/llava_bench_coco_gpt4_qa_30x3.jsonl"

COCO_IMAGE_SIZES = {(640, 480): 0.40, (640, 427): 0.24, (480, 640): 0.10, (427, 640): 0.06, (500, 375): 0.09,
                    (375, 500): 0.03, (640, 640): 0.03, (640, 360): 0.05}
"""(width, height) px → share, drawn for an image whose file is absent (COCO train2017
images are not here, PROVENANCE.md). The sizes are common COCO sizes (longer side ≤ 640 px);
the shares are OURS, chosen so that LLaVA-OneVision's AnyRes rule gives what the authors'
isolated records show (testbed note, Request footprint): 1,728 (500×375) … 3,699 (640×640)
tokens, mode 2,929 (640×480), mean 2,701 here vs ≈ 2,705 recorded."""

VIDEO_DURATION_BUCKETS_S = ((1.0, 30.0), (30.0, 60.0), (60.0, 120.0), (120.0, 180.0))
"""LLaVA-Video-178K caption split's duration buckets (0–30 s, 30–60 s, 1–2 min, 2–3 min;
the authors drew equal shares of each; testbed note). 0–30 s starts at 1 s, the frame rule's
lower end."""

VIDEO_CAPTION_TOKENS = {"mean": 700.0, "min": 153, "max": 2726, "log_sigma": 0.6}
"""Caption reply lengths (tokens) of the authors' isolated LLaVA-Video records (testbed
note: 153–2,726, mean ≈ 700). Only min / mean / max are recorded: drawn lognormal with
σ = 0.6 (OURS) and mean 700, redrawn outside [min, max] (truncated mean ≈ 695)."""


def frames_for_duration(duration_s: float, max_frames: int = 32, min_frames: int = 8) -> int:
    """Frames the authors' harness samples from a video: 8…32 scaled linearly with the
    duration over 1–180 s (testbed note), at most `max_frames` (`--max-frames`)."""
    d = min(max(duration_s, 1.0), 180.0)
    return max(1, min(max_frames, int(round(min_frames + (32 - min_frames) * (d - 1.0) / 179.0))))


def _complex_reasoning_lengths(opts: WorkloadOptions) -> tuple[list[int], str]:
    """Reply lengths (tokens, `opts.counter`) of LLaVA-Instruct's complex-reasoning split:
    the first answers of `complex_reasoning_77k.json` when found in the data folder, else the
    30 "complex" GPT-4 answers of LLaVA-Bench (COCO) (the same question type and generator,
    on COCO images; the data folder's `llava/`). ([], reason) when neither is here."""
    d = data_dir()
    if d is not None:
        for rel in COMPLEX_REASONING_FILES:
            if (d / rel).is_file():
                out = []
                for e in _read_json_records(d / rel):
                    got = _first_pair(e.get("conversations") or [])
                    if not isinstance(got, str):
                        out.append(max(1, opts.counter(got[1])))
                return out, f"complex_reasoning_77k replies ({d / rel})"
        qa = d / LLAVA_BENCH_QA
        if qa.is_file():
            import json

            rows = [json.loads(x) for x in qa.read_text().splitlines() if x.strip()]
            out = [max(1, opts.counter(r["output"])) for r in rows if r.get("type") == "complex"]
            if out:
                return out, f"{len(out)} LLaVA-Bench (COCO) complex-reasoning GPT-4 answers ({qa})"
    return [], "no complex-reasoning replies found"


def _image_size(path: Path | None, rng: np.random.Generator) -> tuple[int, int, bool]:
    """(width, height, drawn): the real file's size when Pillow reads it, else a draw from
    `COCO_IMAGE_SIZES`."""
    if path is not None:
        try:
            from PIL import Image

            with Image.open(path) as im:
                return int(im.width), int(im.height), False
        except Exception:  # noqa: BLE001 - unreadable or no Pillow: draw instead (counted)
            pass
    sizes = list(COCO_IMAGE_SIZES)
    w = np.array(list(COCO_IMAGE_SIZES.values()))
    k = int(rng.choice(len(sizes), p=w / w.sum()))
    return sizes[k][0], sizes[k][1], True


def _images_for_mix(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """The mixes' image requests: LLaVA-Instruct prompts and images (as `llava-instruct`),
    each image's size (its file's, else drawn from `COCO_IMAGE_SIZES`, counted in
    `notes["image_size_drawn"]`) for the profile's vision-token rule, and the reply length
    drawn from the complex-reasoning split's (`_complex_reasoning_lengths`; the authors' image
    requests, testbed note) — the record's own reply when none is here (said loudly)."""
    base = load_llava_instruct(opts, rng)
    lens, src = _complex_reasoning_lengths(opts)
    notes = Counter(base.notes)
    warnings = list(base.warnings)
    reqs = []
    for r in base.requests:
        media = []
        for m in r.media:
            w, h, drawn = _image_size(m.path, rng)
            notes["image_size_drawn"] += drawn
            media.append(replace(m, width_px=w, height_px=h))
        o = int(lens[int(rng.integers(len(lens)))]) if lens else r.output_tokens
        reqs.append(replace(r, output_tokens=o, media=tuple(media)))
    if lens:
        notes["reply_from_complex_reasoning"] += len(reqs)
    else:
        warnings.append("NO complex-reasoning replies found: image requests keep their own LLaVA-Instruct "
                        "reply lengths (shorter than the authors' ≈ 140 tokens)")
    if notes["image_size_drawn"]:
        warnings.append(f"{notes['image_size_drawn']} image size(s) DRAWN from COCO_IMAGE_SIZES (COCO images "
                        "absent); vision tokens follow the profile's rule for that size")
    return Workload("llava-instruct", reqs, f"{base.source}; image replies: {src}", base.skipped, dict(notes),
                    warnings)


def _draw_caption_tokens(rng: np.random.Generator) -> int:
    s = VIDEO_CAPTION_TOKENS
    mu = float(np.log(s["mean"]) - s["log_sigma"] ** 2 / 2)
    while True:
        x = int(round(rng.lognormal(mu, s["log_sigma"])))
        if s["min"] <= x <= s["max"]:
            return x


def _video_for_mix(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """The mixes' video requests. With LLaVA-Video records: theirs, frames by their
    duration bucket (`frames_for_duration` of the bucket's middle). Without (as here):
    LLaVA-Instruct prompts with a DRAWN video — bucket uniform over
    `VIDEO_DURATION_BUCKETS_S`, duration uniform in it, frames by `frames_for_duration`,
    caption reply from `VIDEO_CAPTION_TOKENS` — a stand-in MJPEG of that many frames for
    live runs; said loudly."""
    path, _ = _resolve(opts, LLAVA_VIDEO_FILES, "LLaVA-Video JSON")
    if path is not None:
        wl = load_llava_video(opts, rng)
        wl.requests = [replace(r, media=tuple(replace(m, num_frames=frames_for_duration(m.duration_s, opts.max_frames))
                                              for m in r.media)) for r in wl.requests]
        return wl
    base = load_llava_instruct(opts, rng)
    reqs = []
    for k, r in enumerate(base.requests):
        lo, hi = VIDEO_DURATION_BUCKETS_S[int(rng.integers(len(VIDEO_DURATION_BUCKETS_S)))]
        dur = float(rng.uniform(lo, hi))
        frames = frames_for_duration(dur, opts.max_frames)
        reqs.append(replace(r, request_id=f"video-{k}", modality="video", output_tokens=_draw_caption_tokens(rng),
                            media=(MediaItem("video", None, True, frames, round(dur, 1)),)))
    return Workload("llava-video", reqs, f"DRAWN videos on LLaVA-Instruct prompts ({base.source})",
                    base.skipped, {"video_stand_in": len(reqs), "video_drawn": len(reqs)},
                    ["NO LLaVA-Video records found: video requests are LLaVA-Instruct prompts with DRAWN videos "
                     "(duration bucket 0–30 s … 2–3 min in equal shares, 8–32 frames by duration, caption "
                     "replies lognormal with mean 700 tokens in [153, 2726]: the RPS-Serve authors' footprint, "
                     "github.com/muse-research-lab/rps-serve) and STAND-IN MJPEG videos for live runs"])


for _name in MIXES:
    WORKLOADS.register(_name)(_mix(_name))
