"""Bench workloads: a registry of dataset loaders, each driven by one seeded
`numpy.random.Generator`, all returning the same `Workload` of `BenchRequest`s.

| name | input | what a request is |
| --- | --- | --- |
| `sharegpt` | ShareGPT JSON `[{id, conversations:[{from, value}]}]` | first human turn → prompt, the gpt turn after it → reference reply |
| `llava-instruct` | LLaVA-Instruct JSON `{id, image, conversations}` + image folder | first human turn with `<image>` removed, one image |
| `llava-video` | LLaVA-Video JSON `{id, video, conversations, data_source}` + video folder | first human turn, one video of `--max-frames` frames |
| `burstgpt` | BurstGPT CSV v1 (6 columns) or v3 (8 columns), read by column name | `Request tokens` / `Response tokens`, `Timestamp` |
| `azure` | Azure LLM inference trace CSV `TIMESTAMP,ContextTokens,GeneratedTokens` | lengths + timestamps |
| `length-trace` | Astrolabe length CSV `num_prefill_tokens,num_decode_tokens,...` | lengths only |
| `synthetic` | none | ShareGPT-like lengths (see `SYNTHETIC_STATS`) |
| `mix-to` / `mix-ml` / `mix-mh` | ShareGPT + LLaVA-Instruct + LLaVA-Video | RPS-Serve's TO / ML / MH mixes (see `MIXES`) |

Data resolution (stated in every report as `Workload.source`): `--path` if given, else
the data folder (`$ASTRO_DATA_DIR`, else `../shared/data` beside the checkout; see
`data_paths.data_dir`), else the Hugging Face hub through `datasets` when it is installed
and online (ShareGPT only), else the synthetic generator (with a warning).

Token counts use `rps_astro_cli.tokens` (the counter the engine and Predictor use).
Lengths-only datasets get a synthetic prompt text with exactly the trace's token count
under the fallback counter (`synthetic_prompt`).
"""

from __future__ import annotations

import csv
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.bench.media import MediaItem, duration_bucket_s, set_sample_images
from rps_astro_cli.data_paths import data_dir
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.registry import Registry
from rps_astro_cli.tokens import TokenCounter, count_tokens_fallback

MODALITY_CLASS = {"text": "sand", "image": "pebbles", "video": "rocks"}
"""Class used for per-class metrics when the engine does not report one (by modality,
RPS-Serve's "naive" mapping: text → sand, image → pebbles, video → rocks)."""


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload.

    request_id: stable id within the workload ("<workload>-<n>").
    prompt: the user text ("" for lengths-only traces; `prompt_text()` synthesizes one).
    prompt_tokens: tokens of the prompt text (tokens; vision tokens not included).
    output_tokens: the reference reply's length (tokens) — the true length sent to sim
        engines and used by the virtual cluster.
    modality: "text", "image" or "video".
    media: images/videos attached.
    arrival_s: the trace's timestamp relative to its first kept row (s), or None.
    source_id: the dataset record's id / row number.
    """

    request_id: str
    prompt: str
    prompt_tokens: int
    output_tokens: int
    modality: str = "text"
    media: tuple[MediaItem, ...] = ()
    arrival_s: float | None = None
    source_id: str = ""

    @property
    def num_images(self) -> int:
        return sum(1 for m in self.media if m.kind == "image")

    @property
    def num_frames(self) -> int:
        return sum(m.num_frames for m in self.media if m.kind == "video")

    def prompt_text(self) -> str:
        """The prompt to send: the dataset's text, or a synthetic one of `prompt_tokens`."""
        return self.prompt or synthetic_prompt(self.prompt_tokens, seed=hash(self.request_id) & 0xFFFF)


@dataclass
class Workload:
    """A loaded workload.

    name: registry name. requests: in workload order (arrival order for traces).
    source: where the data came from, in words (path, data folder, hub, synthetic).
    skipped: reason → number of records skipped (never silently dropped).
    notes: reason → number of records kept but adjusted (e.g. a leading gpt turn).
    warnings: loud messages for the user (stand-in media, synthetic fallback...).
    has_timestamps: requests carry `arrival_s` (trace replay possible).
    """

    name: str
    requests: list[BenchRequest]
    source: str
    skipped: dict[str, int] = field(default_factory=dict)
    notes: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    has_timestamps: bool = False

    def describe(self) -> dict[str, Any]:
        mods = Counter(r.modality for r in self.requests)
        return {"name": self.name, "source": self.source, "num_requests": len(self.requests),
                "modalities": dict(mods), "skipped": dict(self.skipped), "notes": dict(self.notes),
                "warnings": list(self.warnings), "has_timestamps": self.has_timestamps}


@dataclass(frozen=True)
class WorkloadOptions:
    """Loader options (CLI flags).

    path: dataset file (`--path`); None → resolution order in the module docstring.
    num_requests: requests to produce (≥ 1); traces keep their first rows in file order,
        datasets are shuffled with the seed first (as vLLM does).
    min_tokens / max_prompt_tokens / max_total_tokens: vLLM's ShareGPT length filter
        (4 / 1024 / 2048 by default); `max_total_tokens` also caps every loader.
    image_dir / video_dir: media folders (None → `<data>/llava/images`, `<data>/llava_video`).
    max_frames: frames sampled per video (32, LLaVA-OneVision's default).
    counter: token counter (tokens.load_counter).
    """

    path: Path | None = None
    num_requests: int = 200
    min_tokens: int = 4
    max_prompt_tokens: int = 1024
    max_total_tokens: int = 2048
    image_dir: Path | None = None
    video_dir: Path | None = None
    max_frames: int = 32
    counter: TokenCounter = count_tokens_fallback


Loader = Callable[[WorkloadOptions, np.random.Generator], Workload]
WORKLOADS: Registry[Loader] = Registry("workload")


def load_workload(name: str, opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """Load workload `name` (see the module table).

    Raises:
        AstroUserError: unknown name (lists the valid ones), missing file, wrong format or
            columns, or no request left after filtering.
    """
    if opts.num_requests < 1:
        raise AstroUserError(f"must be ≥ 1, got {opts.num_requests}", field="--num-requests")
    if opts.max_frames < 1:
        raise AstroUserError(f"must be ≥ 1, got {opts.max_frames}", field="--max-frames")
    wl = WORKLOADS.get(name)(opts, rng)
    if not wl.requests:
        reasons = ", ".join(f"{k}={v}" for k, v in wl.skipped.items()) or "empty input"
        raise AstroUserError(f"workload {name} has no usable request ({reasons})", field="--workload",
                             fix="check --path and the length limits")
    return wl


# -- helpers ---------------------------------------------------------------------------------

_WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be",
          "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "but",
          "have", "an", "had", "they", "you", "were", "one", "all", "we", "can", "her", "has")


def synthetic_prompt(num_tokens: int, seed: int = 0) -> str:
    """Filler text of exactly `num_tokens` tokens under `tokens.count_tokens_fallback`
    (every word has ≤ 4 characters, so costs 1 token). num_tokens ≥ 0."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(_WORDS), size=max(0, num_tokens))
    return " ".join(_WORDS[i] for i in idx)


def _resolve(opts: WorkloadOptions, candidates: Iterable[str], what: str) -> tuple[Path | None, str]:
    """(path, source description): `--path`, else the first candidate in the data folder."""
    if opts.path is not None:
        p = Path(opts.path).expanduser()
        if not p.is_file():
            raise AstroUserError(f"no such file: {p}", field="--path", fix=f"give a {what} file")
        return p, f"--path {p}"
    d = data_dir()
    if d is not None:
        for c in candidates:
            if (d / c).is_file():
                import os

                how = "$ASTRO_DATA_DIR" if os.environ.get("ASTRO_DATA_DIR") else "../shared/data beside the checkout"
                return d / c, f"data folder {d} ({how}): {c}"
    return None, ""


def _read_json_records(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise AstroUserError(f"{path} is not UTF-8 text: {exc}", field="--path") from None
    try:
        if path.suffix == ".jsonl":
            data = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise AstroUserError(f"{path} is not valid JSON: {exc}", field="--path") from None
    if not isinstance(data, list):
        raise AstroUserError(f"{path}: expected a JSON list of records", field="--path")
    return [d for d in data if isinstance(d, dict)]


def _first_pair(conv: list[Any]) -> tuple[str, str, int] | str:
    """(prompt, reply, index of the human turn) of the first human turn followed by a gpt
    turn, or a skip reason."""
    if not conv:
        return "empty"
    if len(conv) < 2:
        return "single_turn"
    for i, turn in enumerate(conv[:-1]):
        if not isinstance(turn, dict) or not isinstance(conv[i + 1], dict):
            return "malformed"
        if turn.get("from") in ("human", "user") and conv[i + 1].get("from") in ("gpt", "chatgpt", "assistant"):
            p, r = turn.get("value"), conv[i + 1].get("value")
            if not isinstance(p, str) or not isinstance(r, str) or not p.strip() or not r.strip():
                return "empty_turn"
            return p, r, i
    return "no_human_gpt_pair"


def _length_ok(p: int, o: int, opts: WorkloadOptions, vllm_filter: bool, skipped: Counter) -> bool:
    """vLLM's `is_valid_sequence` (min 4 tokens each side, prompt ≤ 1024, total ≤ 2048) when
    `vllm_filter`, else only `p ≥ 1, o ≥ 1, p + o ≤ max_total_tokens`."""
    if vllm_filter:
        if p < opts.min_tokens:
            skipped["prompt_too_short"] += 1
            return False
        if o < opts.min_tokens:
            skipped["output_too_short"] += 1
            return False
        if p > opts.max_prompt_tokens:
            skipped["prompt_too_long"] += 1
            return False
    if p < 1:
        skipped["zero_prompt_tokens"] += 1
        return False
    if o < 1:
        skipped["zero_output_tokens"] += 1
        return False
    if p + o > opts.max_total_tokens:
        skipped["total_too_long"] += 1
        return False
    return True


def _take(pool: list[BenchRequest], n: int, warnings: list[str], what: str) -> list[BenchRequest]:
    if len(pool) >= n or not pool:
        return pool[:n]
    warnings.append(f"{what}: only {len(pool)} usable records for {n} requests; records are reused "
                    f"in order (ids stay unique)")
    return [replace(pool[i % len(pool)], request_id=f"{pool[i % len(pool)].request_id}#{i // len(pool)}")
            if i >= len(pool) else pool[i] for i in range(n)]


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
    """
    path, source = _resolve(opts, SHAREGPT_FILES, "ShareGPT JSON")
    if path is None:
        recs = _sharegpt_from_hub()
        if recs is None:
            wl = load_synthetic(opts, rng)
            wl.name = "sharegpt"
            wl.warnings.insert(0, "no ShareGPT file found (no --path, no data folder, no hub): "
                                  "using SYNTHETIC ShareGPT-like lengths instead")
            return wl
        source = "Hugging Face hub (datasets): anon8231489123/ShareGPT_Vicuna_unfiltered"
    else:
        recs = _read_json_records(path)
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
    for i in rng.permutation(len(recs)):
        if len(pool) >= opts.num_requests:
            break
        e = recs[i]
        got = _first_pair(e.get("conversations") or [])
        if isinstance(got, str):
            skipped[got] += 1
            continue
        prompt = re.sub(r"\s*<image>\s*", " ", got[0]).strip()
        p, o = opts.counter(prompt), opts.counter(got[1])
        if not _length_ok(p, o, opts, False, skipped):
            continue
        img = e.get("image")
        f = img_dir / img if (img_ok and isinstance(img, str) and img_dir) else None
        if f is not None and not f.is_file():
            f = None
        if f is None:
            notes["image_stand_in"] += 1
        media = (MediaItem("image", f, stand_in=f is None, seed=int(i)),)
        pool.append(BenchRequest(f"llava-{len(pool)}", prompt, p, o, "image", media, source_id=str(e.get("id", i))))
    if img_ok and notes["image_stand_in"]:
        _use_sample_jpegs()
        warnings.append(f"{notes['image_stand_in']} image file(s) missing from {img_dir}: STAND-IN images used")
    return Workload("llava-instruct", _take(pool, opts.num_requests, warnings, "llava-instruct"), source,
                    dict(skipped), dict(notes), warnings)


LLAVA_SYNTHETIC_STATS = {"prompt_log_mu": 2.584, "prompt_log_sigma": 0.178,
                         "output_log_mu": 3.059, "output_log_sigma": 0.503}
"""Lognormal fits (mean and std of ln tokens, fallback counter) to the first (question,
answer) pair of the 100 LLaVA-Instruct-150K records in `../shared/data/llava/`
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
    return Workload("llava-instruct", out, "synthetic LLaVA-Instruct-like lengths (see LLAVA_SYNTHETIC_STATS)",
                    {}, {"image_stand_in": len(out)},
                    [f"no LLaVA-Instruct file found (no --path, no data folder): SYNTHETIC image requests with "
                     f"STAND-IN images ({what})"])


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
    for i in rng.permutation(len(recs)):
        if len(pool) >= opts.num_requests:
            break
        e = recs[i]
        got = _first_pair(e.get("conversations") or [])
        if isinstance(got, str):
            skipped[got] += 1
            continue
        prompt = re.sub(r"\s*<video>\s*|\s*<image>\s*", " ", got[0]).strip()
        p, o = opts.counter(prompt), opts.counter(got[1])
        if not _length_ok(p, o, opts, False, skipped):
            continue
        vid = e.get("video")
        f = vdir / vid if (v_ok and isinstance(vid, str) and vdir) else None
        if f is not None and not f.is_file():
            f = None
        if f is None:
            notes["video_stand_in"] += 1
        dur = duration_bucket_s(f"{e.get('data_source', '')} {vid or ''}")
        media = (MediaItem("video", f, stand_in=f is None, num_frames=opts.max_frames, duration_s=dur),)
        pool.append(BenchRequest(f"video-{len(pool)}", prompt, p, o, "video", media, source_id=str(e.get("id", i))))
    if v_ok and notes["video_stand_in"]:
        warnings.append(f"{notes['video_stand_in']} video file(s) missing from {vdir}: STAND-IN videos used")
    return Workload("llava-video", _take(pool, opts.num_requests, warnings, "llava-video"), source,
                    dict(skipped), dict(notes), warnings)


# -- CSV traces ------------------------------------------------------------------------------

def _read_csv(path: Path, required: tuple[str, ...], what: str) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        cols = [c.strip() for c in (reader.fieldnames or [])]
        missing = [c for c in required if c not in cols]
        if missing:
            raise AstroUserError(f"{path} lacks column(s) {', '.join(missing)} (has: {', '.join(cols) or 'none'})",
                                 field="--path", fix=f"give a {what} CSV with a header row")
        return [{(k or "").strip(): (v or "").strip() for k, v in row.items()} for row in reader]


def _int(v: str) -> int | None:
    try:
        f = float(v)
    except ValueError:
        return None
    return int(f) if f == int(f) else None


def _trace(name: str, rows: Iterable[tuple[str, int | None, int | None, float | None]],
           opts: WorkloadOptions, source: str, skipped: Counter, prompt_first: bool = False) -> Workload:
    """Build a lengths(+timestamps) workload from (row id, prompt, output, timestamp) rows, in
    file order; the first `num_requests` valid rows are kept, timestamps made relative."""
    out: list[BenchRequest] = []
    t0: float | None = None
    for rid, p, o, ts in rows:
        if len(out) >= opts.num_requests:
            break
        if p is None or o is None:
            skipped["malformed"] += 1
            continue
        if not _length_ok(p, o, opts, False, skipped):
            continue
        if ts is not None and t0 is None:
            t0 = ts
        arr = None if ts is None or t0 is None else ts - t0
        out.append(BenchRequest(f"{name}-{len(out)}", "", p, o, arrival_s=arr, source_id=rid))
    has_ts = bool(out) and all(r.arrival_s is not None for r in out)
    if has_ts and any(b.arrival_s < a.arrival_s for a, b in zip(out, out[1:])):  # type: ignore[operator]
        out.sort(key=lambda r: r.arrival_s)  # type: ignore[arg-type,return-value]
    warnings: list[str] = []
    if len(out) < opts.num_requests:
        warnings.append(f"{name}: only {len(out)} usable rows for {opts.num_requests} requests "
                        f"(a trace is not repeated)")
    return Workload(name, out, source, dict(skipped), {}, warnings, has_ts)


BURSTGPT_FILES = ("burstgpt/BurstGPT_1.csv", "BurstGPT_1.csv", "burstgpt/BurstGPT_1_first400.csv")


@WORKLOADS.register("burstgpt")
def load_burstgpt(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """BurstGPT v1 (`Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`)
    or v3 (two more columns, `Session ID` and `Elapsed time`), read by column name.
    Failed requests (`Response tokens` = 0, BurstGPT's failure marker) are skipped and
    counted as `failed_in_trace`; unparsable rows as `malformed`. Timestamps are seconds.
    Cite: Wang et al., BurstGPT, KDD'25 (CC-BY-4.0)."""
    path, source = _resolve(opts, BURSTGPT_FILES, "BurstGPT")
    if path is None:
        raise AstroUserError("no BurstGPT CSV found", field="--path", fix="pass --path BurstGPT_1.csv")
    rows = _read_csv(path, ("Timestamp", "Request tokens", "Response tokens"), "BurstGPT")
    skipped: Counter = Counter()
    version = "v3" if rows and "Session ID" in rows[0] else "v1"

    def gen() -> Iterable[tuple[str, int | None, int | None, float | None]]:
        for i, r in enumerate(rows):
            o = _int(r["Response tokens"])
            if o == 0:
                skipped["failed_in_trace"] += 1
                continue
            try:
                ts: float | None = float(r["Timestamp"])
            except ValueError:
                ts = None
            p = _int(r["Request tokens"])
            yield str(i), p, (o if ts is not None else None), ts

    wl = _trace("burstgpt", gen(), opts, f"{source} (BurstGPT {version})", skipped)
    return wl


AZURE_FILES = ("traces/AzureLLMInferenceTrace_conv_2023.csv", "AzureLLMInferenceTrace_conv.csv",
               "traces/AzureLLMInferenceTrace_code_2023.csv")


def _azure_ts(s: str) -> float | None:
    m = re.match(r"(\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d)(?:\.(\d+))?", s)
    if not m:
        return None
    base = datetime.fromisoformat(m.group(1).replace("T", " ")).timestamp()
    frac = m.group(2) or "0"
    return base + int(frac) / 10 ** len(frac)


@WORKLOADS.register("azure")
def load_azure(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`,
    Azure/AzurePublicDataset, CC-BY-4.0): prompt = ContextTokens, reply = GeneratedTokens,
    timestamps with sub-second digits."""
    path, source = _resolve(opts, AZURE_FILES, "Azure trace")
    if path is None:
        raise AstroUserError("no Azure trace CSV found", field="--path", fix="pass --path AzureLLMInferenceTrace_conv.csv")
    rows = _read_csv(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), "Azure LLM trace")
    skipped: Counter = Counter()
    gen = ((str(i), _int(r["ContextTokens"]), _int(r["GeneratedTokens"]), _azure_ts(r["TIMESTAMP"]))
           for i, r in enumerate(rows))
    return _trace("azure", gen, opts, source, skipped)


LENGTH_TRACE_FILES = ("traces/astrolabe_sharegpt_val_10k_llama2.csv",)


@WORKLOADS.register("length-trace")
def load_length_trace(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """Astrolabe-style length trace (`num_prefill_tokens,num_decode_tokens,...`, e.g.
    AKafakA/Astrolabe `sharegpt_val_10k_llama2.csv`): lengths only, file order."""
    path, source = _resolve(opts, LENGTH_TRACE_FILES, "length-trace")
    if path is None:
        raise AstroUserError("no length trace found", field="--path",
                             fix="pass --path astrolabe_sharegpt_val_10k_llama2.csv")
    rows = _read_csv(path, ("num_prefill_tokens", "num_decode_tokens"), "length trace")
    skipped: Counter = Counter()
    gen = ((str(i), _int(r["num_prefill_tokens"]), _int(r["num_decode_tokens"]), None) for i, r in enumerate(rows))
    return _trace("length-trace", gen, opts, source, skipped)


# -- synthetic -------------------------------------------------------------------------------

SYNTHETIC_STATS = {
    "prompt_log_mu": 3.961, "prompt_log_sigma": 1.670, "prompt_max": 3973,
    "output_log_mu": 5.389, "output_log_sigma": 1.067, "output_max": 1734,
}
"""Lognormal fits (mean and std of ln tokens) to the 10,000 ShareGPT requests of the
Astrolabe paper's length trace (AKafakA/Astrolabe @ 2e5fad6f,
data/trace_data/sharegpt/sharegpt_val_10k_llama2.csv, Llama-2 tokenizer): prompts mean
245.8 / median 35 / max 3973 tokens; outputs mean 325.6 / median 286 / max 1734 tokens;
prompt and output log-lengths are nearly uncorrelated (r = 0.10), so they are drawn
independently."""


@WORKLOADS.register("synthetic")
def load_synthetic(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """ShareGPT-like lengths drawn from `SYNTHETIC_STATS` (lognormal, clipped to [1, max]);
    pairs over `max_total_tokens` are redrawn (bounded: 20 × num_requests draws)."""
    s = SYNTHETIC_STATS
    out: list[BenchRequest] = []
    skipped: Counter = Counter()
    for _ in range(20 * opts.num_requests):
        if len(out) >= opts.num_requests:
            break
        p = int(np.clip(round(rng.lognormal(s["prompt_log_mu"], s["prompt_log_sigma"])), 1, s["prompt_max"]))
        o = int(np.clip(round(rng.lognormal(s["output_log_mu"], s["output_log_sigma"])), 1, s["output_max"]))
        if _length_ok(p, o, opts, False, skipped):
            out.append(BenchRequest(f"synthetic-{len(out)}", "", p, o))
    return Workload("synthetic", out, "synthetic ShareGPT-like lengths (lognormal fit to the Astrolabe "
                    "ShareGPT trace; see SYNTHETIC_STATS)", dict(skipped))


# -- RPS-Serve mixes -------------------------------------------------------------------------

MIXES = {"mix-to": (1.0, 0.0, 0.0), "mix-ml": (0.80, 0.15, 0.05), "mix-mh": (0.40, 0.40, 0.20)}
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
            parts.append(load_llava_instruct(replace(opts, path=None, num_requests=n_img), rng))
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


def _video_for_mix(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """LLaVA-Video records when a file is found, else stand-in video requests that reuse
    LLaVA-Instruct's real prompts and reply lengths with a stand-in 0–30 s video."""
    path, _ = _resolve(opts, LLAVA_VIDEO_FILES, "LLaVA-Video JSON")
    if path is not None:
        return load_llava_video(opts, rng)
    base = load_llava_instruct(opts, rng)
    reqs = [replace(r, request_id=f"video-{k}", modality="video",
                    media=(MediaItem("video", None, True, opts.max_frames, 15.0),)) for k, r in enumerate(base.requests)]
    return Workload("llava-video", reqs, f"STAND-IN videos on LLaVA-Instruct prompts ({base.source})",
                    base.skipped, {"video_stand_in": len(reqs)},
                    ["NO LLaVA-Video records found: video requests are LLaVA-Instruct prompts with STAND-IN "
                     f"MJPEG videos ({opts.max_frames} frames, 0–30 s bucket)"])


for _name in MIXES:
    WORKLOADS.register(_name)(_mix(_name))
