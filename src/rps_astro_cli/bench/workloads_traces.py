"""Lengths(+timestamps) workloads: BurstGPT v1/v3, the Azure LLM trace, Astrolabe length
traces, and synthetic ShareGPT-like lengths (registry and data resolution: `workloads`)."""

from __future__ import annotations

import csv
import json
import math
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.bench.workload_base import (
    _WORDS,
    WORKLOADS,
    BenchRequest,
    Workload,
    WorkloadOptions,
    _length_ok,
    _resolve,
    synthetic_prompt,
)
from rps_astro_cli.errors import AstroUserError

# -- CSV traces ------------------------------------------------------------------------------

def _read_csv(path: Path, required: tuple[str, ...], what: str) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        reader = csv.DictReader(fh)
        cols = [c.strip() for c in (reader.fieldnames or [])]
        missing = [c for c in required if c not in cols]
        if missing:
            raise AstroUserError(f"{path} lacks column(s) {', '.join(missing)} (has: {', '.join(cols) or 'none'})",
                                 field="--path", fix=f"give a {what} CSV with a header row")
        out = []
        for row in reader:  # "_line": the file's 1-based line where the record ends (the header is line 1)
            d = {(k or "").strip(): (v or "").strip() for k, v in row.items()}
            d["_line"] = str(reader.line_num)
            out.append(d)
        return out


def _int(v: str) -> int | None:
    """A whole-number cell, or None (unparsable, nan, inf, fractional)."""
    try:
        f = float(v)
    except ValueError:
        return None
    if not math.isfinite(f):
        return None
    return int(f) if f == int(f) else None


def _trace(name: str, rows: Iterable[tuple[str, int | None, int | None, float | None, str]],
           opts: WorkloadOptions, source: str, skipped: Counter, prompt_first: bool = False,
           ts_field: str = "Timestamp") -> Workload:
    """Build a lengths(+timestamps) workload from (row id, prompt, output, timestamp, file
    line) rows, in
    file order; the first `num_requests` valid rows are kept, timestamps made relative
    (to the first kept row) and sorted, with a warning when they were not in order.

    Raises:
        AstroUserError: a kept row's timestamp (column `ts_field`) is nan, inf or
            negative (names the column and the file's line number).
    """
    out: list[BenchRequest] = []
    t0: float | None = None
    for rid, p, o, ts, line in rows:
        if len(out) >= opts.num_requests:
            break
        if p is None or o is None:
            skipped["malformed"] += 1
            continue
        if ts is not None and (not math.isfinite(ts) or ts < 0):
            raise AstroUserError(f"{source}: line {line}: {ts_field} is {ts}; timestamps must be finite seconds "
                                 ">= 0", field=ts_field, fix=f"fix or drop line {line} of the trace")
        if not _length_ok(p, o, opts, False, skipped):
            continue
        if ts is not None and t0 is None:
            t0 = ts
        arr = None if ts is None or t0 is None else ts - t0
        out.append(BenchRequest(f"{name}-{len(out)}", "", p, o, arrival_s=arr, source_id=rid))
    has_ts = bool(out) and all(r.arrival_s is not None for r in out)
    warnings: list[str] = []
    if has_ts and any(b.arrival_s < a.arrival_s for a, b in zip(out, out[1:])):  # type: ignore[operator]
        out.sort(key=lambda r: r.arrival_s)  # type: ignore[arg-type,return-value]
        # rebase on the earliest kept row, so the first send is at 0 and none is negative
        first = out[0].arrival_s or 0.0
        out = [replace(r, arrival_s=(r.arrival_s or 0.0) - first) for r in out]
        warnings.append(f"{name}: {ts_field} not in file order; requests sorted by it and replayed from the "
                        "earliest")
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

    def gen() -> Iterable[tuple[str, int | None, int | None, float | None, str]]:
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
            yield str(i), p, (o if ts is not None else None), ts, r["_line"]

    wl = _trace("burstgpt", gen(), opts, f"{source} (BurstGPT {version})", skipped, ts_field="Timestamp")
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
        raise AstroUserError("no Azure trace CSV found", field="--path",
                             fix="pass --path AzureLLMInferenceTrace_conv.csv")
    rows = _read_csv(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), "Azure LLM trace")
    skipped: Counter = Counter()
    gen = ((str(i), _int(r["ContextTokens"]), _int(r["GeneratedTokens"]), _azure_ts(r["TIMESTAMP"]), r["_line"])
           for i, r in enumerate(rows))
    return _trace("azure", gen, opts, source, skipped, ts_field="TIMESTAMP")


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
    gen = ((str(i), _int(r["num_prefill_tokens"]), _int(r["num_decode_tokens"]), None, r["_line"])
           for i, r in enumerate(rows))
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


@WORKLOADS.register("shared-prefix")
def load_shared_prefix(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """N system prompts × M users (`-w shared-prefix`): 8 synthetic system prompts of 1024
    tokens each; every request is one of them (uniformly at random) followed by its own
    user message of 32–256 tokens (uniform), with a 16–256-token reply (uniform). Text is
    synthetic filler (`synthetic_prompt`, seeded from `rng`), so the prompts of one system
    prompt share exactly its token ids. Requests over `max_total_tokens` are counted as
    skipped and redrawn (bounded: 20 × num_requests draws)."""
    num_prefixes, prefix_tokens = 8, 1024
    systems = [synthetic_prompt(prefix_tokens, seed=int(rng.integers(0, 2**31))) for _ in range(num_prefixes)]
    out: list[BenchRequest] = []
    skipped: Counter = Counter()
    for _ in range(20 * opts.num_requests):
        if len(out) >= opts.num_requests:
            break
        g = int(rng.integers(0, num_prefixes))
        u = int(rng.integers(32, 257))
        o = int(rng.integers(16, 257))
        text = systems[g] + "\n" + synthetic_prompt(u, seed=int(rng.integers(0, 2**31)))
        p = opts.counter(text)
        if _length_ok(p, o, opts, False, skipped):
            out.append(BenchRequest(f"shared-prefix-{len(out)}", text, p, o, source_id=f"system-{g}"))
    return Workload("shared-prefix", out, f"synthetic: {num_prefixes} system prompts of {prefix_tokens} tokens × "
                    "users with 32–256-token messages", dict(skipped))


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
    return Workload("synthetic", out, "synthetic ShareGPT-like lengths (lognormal fits to the Astrolabe "
                    "paper's 10,000-request ShareGPT length trace, Llama-2 tokenizer)", dict(skipped))


# -- Mooncake (block-hash traces) ------------------------------------------------------------

MOONCAKE_FILES = ("traces/mooncake/conversation_trace.jsonl",)
MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per `hash_ids` entry in the Mooncake trace format (kvcache-ai/Mooncake's FAST'25
release: one id per 512-token block of the prompt)."""


def mooncake_block_text(hash_id: int) -> str:
    """The fixed `MOONCAKE_BLOCK_TOKENS`-token text that stands for block `hash_id`:
    filler words (`synthetic_prompt`'s) drawn by a generator seeded from the id alone, so
    every request holding the id holds the same 512 fallback tokens (words of ≤ 4
    characters, one token each), in every process.
    A partial last block is this text's first words."""
    idx = np.random.default_rng([int(hash_id) & 0xFFFF_FFFF_FFFF_FFFF, 0x6D6F6F6E]).integers(
        0, len(_WORDS), size=MOONCAKE_BLOCK_TOKENS)
    return " ".join([_WORDS[i] for i in idx])


def mooncake_prompt_tokens(input_length: int, max_prompt_tokens: int) -> int:
    """The fitting rule: a prompt longer than `max_prompt_tokens` is cut at the last whole
    512-token block that fits (to `max_prompt_tokens` itself when not even one block
    fits), so a kept block is always whole and the shared leading blocks stay shared."""
    if input_length <= max_prompt_tokens:
        return input_length
    cut = (max_prompt_tokens // MOONCAKE_BLOCK_TOKENS) * MOONCAKE_BLOCK_TOKENS
    return cut or max_prompt_tokens


def _read_jsonl(path: Path) -> list[Any]:
    """One JSON value per non-blank line (whatever the suffix).

    Raises:
        AstroUserError: not UTF-8, or a line that is not JSON (names the line).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise AstroUserError(f"{path} is not UTF-8 text: {exc}", field="--path") from None
    out: list[Any] = []
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise AstroUserError(f"{path}: line {n} is not valid JSON: {exc.msg} (column {exc.colno})",
                                     field="--path", fix=f"fix or drop line {n}") from None
    return out


@WORKLOADS.register("mooncake")
def load_mooncake(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """Mooncake block-hash trace (JSONL rows `{"timestamp": ms, "input_length": tokens,
    "output_length": tokens, "hash_ids": [id, ...]}`, one id per 512-token block of the
    prompt; kvcache-ai/Mooncake FAST'25 traces, Apache-2.0). The first `num_requests`
    rows in file order, timestamps made relative (seconds) for `--arrival trace`.

    Prompt: block j is `mooncake_block_text(hash_ids[j])`, the last block cut to what
    `input_length` leaves, so prompts repeat their token ids exactly where the trace
    repeats its ids (a row with fewer ids than blocks gets row-private ids for the rest,
    counted as `notes["missing_hash_ids"]`). Fitting to a context: the prompt is cut at a
    block boundary to ≤ `max_prompt_tokens` (`mooncake_prompt_tokens`; `notes
    ["prompt_cut"]`) and the reply to `max_total_tokens` − prompt (`notes
    ["output_cut"]`), so every row is kept and the arrivals and the sharing stay the
    trace's. Rows that are not objects with whole-number lengths and a list of ids are
    skipped as `malformed`; `output_length` 0 as `zero_output_tokens`."""
    path, source = _resolve(opts, MOONCAKE_FILES, "Mooncake trace JSONL")
    if path is None:
        raise AstroUserError("no Mooncake trace found", field="--path",
                             fix="pass --path conversation_trace.jsonl (kvcache-ai/Mooncake FAST25-release/traces) "
                                 "or set ASTRO_DATA_DIR")
    recs = _read_jsonl(path)
    skipped: Counter = Counter()
    notes: Counter = Counter()
    blocks: dict[int, str] = {}
    out: list[BenchRequest] = []
    t0: float | None = None
    for n, r in enumerate(recs):
        if len(out) >= opts.num_requests:
            break
        if not isinstance(r, dict):
            skipped["malformed"] += 1
            continue
        ids = r.get("hash_ids")
        p_in, o_in, ts = r.get("input_length"), r.get("output_length"), r.get("timestamp")
        if (not isinstance(ids, list) or not all(isinstance(h, int) for h in ids)
                or not isinstance(p_in, int) or not isinstance(o_in, int) or isinstance(ts, bool)
                or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0 or p_in < 1):
            skipped["malformed"] += 1
            continue
        if o_in < 1:
            skipped["zero_output_tokens"] += 1
            continue
        p = mooncake_prompt_tokens(p_in, opts.max_prompt_tokens)
        if p < p_in:
            notes["prompt_cut"] += 1
        o = min(o_in, opts.max_total_tokens - p)
        if o < 1:
            skipped["total_too_long"] += 1
            continue
        if o < o_in:
            notes["output_cut"] += 1
        nblocks = -(-p // MOONCAKE_BLOCK_TOKENS)
        if len(ids) < -(-p_in // MOONCAKE_BLOCK_TOKENS):
            notes["missing_hash_ids"] += 1
        parts: list[str] = []
        for j in range(nblocks):
            h = ids[j] if j < len(ids) else -(n + 1) * 100_000 - j  # row-private: ids in the trace are ≥ 0
            text = blocks.get(h)
            if text is None:
                text = blocks[h] = mooncake_block_text(h)
            take = min(MOONCAKE_BLOCK_TOKENS, p - j * MOONCAKE_BLOCK_TOKENS)
            parts.append(text if take == MOONCAKE_BLOCK_TOKENS else " ".join(text.split(" ")[:take]))
        prompt = " ".join(parts)
        if t0 is None:
            t0 = float(ts)
        out.append(BenchRequest(f"mooncake-{len(out)}", prompt, opts.counter(prompt), o,
                                arrival_s=(float(ts) - t0) / 1000.0, source_id=str(n)))
    warnings: list[str] = []
    if out and any(b.arrival_s < a.arrival_s for a, b in zip(out, out[1:])):  # type: ignore[operator]
        out.sort(key=lambda q: q.arrival_s)  # type: ignore[arg-type,return-value]
        first = out[0].arrival_s or 0.0
        out = [replace(q, arrival_s=(q.arrival_s or 0.0) - first) for q in out]
        warnings.append("mooncake: timestamp not in file order; requests sorted by it and replayed from the earliest")
    if notes.get("prompt_cut"):
        warnings.append(f"mooncake: {notes['prompt_cut']} prompts cut at a 512-token block boundary to ≤ "
                        f"--max-prompt-tokens {opts.max_prompt_tokens} (trace mean input ~12k tokens; raise it "
                        "for a long-context profile)")
    if len(out) < opts.num_requests:
        warnings.append(f"mooncake: only {len(out)} usable rows for {opts.num_requests} requests "
                        "(a trace is not repeated)")
    return Workload("mooncake", out, f"{source} (Mooncake block-hash trace, {MOONCAKE_BLOCK_TOKENS}-token blocks)",
                    dict(skipped), dict(notes), warnings, bool(out))
