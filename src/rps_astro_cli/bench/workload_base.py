"""Bench workload types and the loader registry (`BenchRequest`, `Workload`,
`WorkloadOptions`, `WORKLOADS`, `load_workload`) plus the helpers the loaders share.
The loaders live in `workloads_chat` and `workloads_traces`; `workloads` imports them all
(import `rps_astro_cli.bench.workloads`, not this module, to get a full registry)."""


from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.bench.media import MediaItem
from rps_astro_cli.data_paths import data_dir, data_dir_problem
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
    session_id / turn: the conversation and 0-based turn of a multi-turn replay ("" / 0
        otherwise); turn ≥ 1 is sent `think_s` seconds after turn − 1's reply.
    reply: the reference reply's text when a later turn's prompt contains it (multi-turn),
        so the virtual cluster knows the reply's token ids; "" otherwise.
    """

    request_id: str
    prompt: str
    prompt_tokens: int
    output_tokens: int
    modality: str = "text"
    media: tuple[MediaItem, ...] = ()
    arrival_s: float | None = None
    source_id: str = ""
    session_id: str = ""
    turn: int = 0
    think_s: float = 0.0
    reply: str = ""

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
    multi_turn: sharegpt replays whole conversations turn by turn (prompt = the history).
    think_time_s: mean of the exponential think time before a next turn (s).
    sampling: "astro" (astro's draw) or "vllm" (`vllm bench serve`'s draw for the same file
        and seed: `bench.workloads_vllm`); `counter` then counts as vLLM does (special
        tokens included, `tokens.load_counter_with_special`).
    seed: the workload seed (vLLM's draw seeds Python's `random.Random` with it).
    input_len / output_len: the `random` workload's fixed prompt / reply length, and the
        `custom` workload's reply length for rows without one (tokens).
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
    multi_turn: bool = False
    think_time_s: float = 2.0
    sampling: str = "astro"
    seed: int = 0
    input_len: int = 1024
    output_len: int = 128


Loader = Callable[[WorkloadOptions, np.random.Generator], Workload]
WORKLOADS: Registry[Loader] = Registry("workload")


def load_workload(name: str, opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """Load workload `name` (see the module table). A set but mistyped `$ASTRO_DATA_DIR`
    (`data_paths.data_dir_problem`) is the workload's first warning.

    Raises:
        AstroUserError: unknown name (lists the valid ones), missing file, wrong format or
            columns, or no request left after filtering.
    """
    if opts.num_requests < 1:
        raise AstroUserError(f"must be ≥ 1, got {opts.num_requests}", field="--num-requests")
    if opts.max_frames < 1:
        raise AstroUserError(f"must be ≥ 1, got {opts.max_frames}", field="--max-frames")
    wl = WORKLOADS.get(name)(opts, rng)
    problem = data_dir_problem()
    if problem:  # first: it explains the fallback warnings that follow
        wl.warnings.insert(0, problem)
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
    if path.suffix == ".jsonl":
        data = []
        for n, line in enumerate(text.split("\n"), 1):  # not splitlines: U+2028 in strings; n: the file's line
            if not line.strip():
                continue
            try:
                data.append(json.loads(line))
            except json.JSONDecodeError as exc:  # its lineno is 1: each line is parsed alone
                raise AstroUserError(f"{path}: line {n} is not valid JSON: {exc.msg} (column {exc.colno})",
                                     field="--path", fix=f"fix or drop line {n}") from None
    else:
        try:
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
