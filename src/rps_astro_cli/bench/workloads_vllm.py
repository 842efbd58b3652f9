"""`vllm bench serve`'s own draws, reproduced (`--sampling vllm`), and the two workloads
a vLLM user expects: `custom` (a JSONL of prompts) and `random` (fixed ISL/OSL).

vLLM 0.32 `vllm.benchmarks.datasets`, read for the rules (not copied):

- ShareGPT (`ShareGPTDataset`): keep the entries that have a `conversations` list of
  ≥ 2 turns; shuffle them with Python's `random` seeded with `--seed`; walk them in that
  order: prompt = turn 0's `value`, reply = turn 1's, whatever their roles; lengths are
  `len(tokenizer(text).input_ids)` (special tokens included); keep the pair when
  `is_valid_sequence` holds (prompt ≥ 4, reply ≥ 4, prompt ≤ 1024, prompt + reply
  ≤ 2048 tokens: astro's --min-tokens / --max-prompt-tokens / --max-total-tokens, whose
  defaults are those numbers); request ids count the kept pairs, 0, 1, ...
- Too few pairs (`maybe_oversample_requests`): Python's `random` re-seeded with the seed,
  then one `random.choice` over the kept pairs per missing request, ids continuing.
- Custom (`CustomDataset`): a JSONL of `{"prompt": ..., "output_tokens": ...}` rows,
  shuffled the same way, every row kept, oversampled the same way. vLLM applies the
  tokenizer's chat template before counting; astro counts the bare prompt (said in the
  workload's notes).
- Arrivals (`serve.get_request`): `numpy.random.seed(seed)`; per request a gap of
  1/rate (burstiness ∞), else `gamma(shape=b, scale=1/(rate·b))`; cumulated from the
  first (so the first request waits one gap) and rescaled so the last is at n / rate.

Python's `random.Random(seed)` and numpy's legacy `RandomState(seed)` are used here (and
only here) because they are the generators vLLM draws from: the same seed gives the same
order only with the same generator.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.bench.workload_base import (
    WORKLOADS,
    BenchRequest,
    Workload,
    WorkloadOptions,
    _read_json_records,
    synthetic_prompt,
)
from rps_astro_cli.errors import AstroUserError

VLLM_SAMPLED_WORKLOADS = ("sharegpt", "custom", "random")


def vllm_valid(p: int, o: int, opts: WorkloadOptions, skip_output_check: bool = False) -> bool:
    """vLLM's `is_valid_sequence` with astro's limits (defaults 4 / 1024 / 2048)."""
    return not (p < opts.min_tokens or (not skip_output_check and o < opts.min_tokens)
                or p > opts.max_prompt_tokens or p + o > opts.max_total_tokens)


def oversample(reqs: list[BenchRequest], n: int, seed: int, prefix: str) -> list[BenchRequest]:
    """vLLM's `maybe_oversample_requests`: append `random.choice` picks (Python's
    generator re-seeded with `seed`) until there are `n`; ids continue the count."""
    if len(reqs) >= n or not reqs:
        return reqs
    pick = random.Random(seed)
    have = len(reqs)
    extra = []
    for i in range(n - have):
        r = pick.choice(reqs)
        extra.append(BenchRequest(f"{prefix}-{have + i}", r.prompt, r.prompt_tokens, r.output_tokens,
                                  source_id=r.source_id))
    return reqs + extra


def sharegpt_vllm(recs: list[dict[str, Any]], opts: WorkloadOptions, source: str) -> Workload:
    """ShareGPT drawn as `vllm bench serve --dataset-name sharegpt` draws it (module
    docstring); ids `sharegpt-<vLLM's request index>`."""
    skipped: Counter = Counter()
    data = []
    for i, e in enumerate(recs):
        conv = e.get("conversations")
        if isinstance(conv, list) and len(conv) >= 2:
            data.append((i, e))
        else:
            skipped["fewer_than_2_turns"] += 1
    random.Random(opts.seed).shuffle(data)
    out: list[BenchRequest] = []
    for i, e in data:
        if len(out) >= opts.num_requests:
            break
        conv = e["conversations"]
        prompt, reply = (conv[0].get("value") or "", conv[1].get("value") or "") \
            if isinstance(conv[0], dict) and isinstance(conv[1], dict) else ("", "")
        p, o = opts.counter(str(prompt)), opts.counter(str(reply))
        if not vllm_valid(p, o, opts):
            skipped["vllm_length_filter"] += 1
            continue
        out.append(BenchRequest(f"sharegpt-{len(out)}", str(prompt), p, o, source_id=str(e.get("id", i))))
    warnings = []
    if len(out) < opts.num_requests:
        warnings.append(f"sharegpt: only {len(out)} pairs pass vLLM's filter for {opts.num_requests} requests; "
                        "oversampled as vLLM does (seeded random.choice)")
    return Workload("sharegpt", oversample(out, opts.num_requests, opts.seed, "sharegpt"),
                    source + "; sampled as vllm bench serve", dict(skipped), {}, warnings)


def _read_jsonl_prompts(path: Path) -> list[dict[str, Any]]:
    rows = _read_json_records(path) if path.suffix == ".jsonl" else None
    if rows is None:
        raise AstroUserError(f"{path}: the custom workload reads JSONL (one JSON object a line)", field="--path",
                             fix='give a .jsonl file of {"prompt": "...", "output_tokens": 128} rows')
    return rows


@WORKLOADS.register("custom")
def load_custom(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """A JSONL file of `{"prompt": str, "output_tokens": int}` rows (vLLM's custom
    format; `output_len` is accepted for `output_tokens`, and a row without either gets
    `--output-len`). astro sampling: rows shuffled with `rng`; vllm sampling: as vLLM
    (module docstring). Rows whose prompt is not a non-empty string, or whose reply
    length is not a positive integer, are skipped and counted."""
    if opts.path is None:
        raise AstroUserError("the custom workload needs a file", field="--path",
                             fix='pass --path FILE.jsonl with {"prompt": "...", "output_tokens": 128} rows')
    path = Path(opts.path).expanduser()
    if not path.is_file():
        raise AstroUserError(f"no such file: {path}", field="--path", fix="give a JSONL file")
    rows = _read_jsonl_prompts(path)
    skipped: Counter = Counter()
    notes: Counter = Counter()
    items: list[tuple[int, str, int]] = []
    for i, row in enumerate(rows):
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            skipped["no_prompt"] += 1
            continue
        o = row.get("output_tokens", row.get("output_len"))
        if o is None:
            o = opts.output_len
            notes["output_len_from_flag"] += 1
        if isinstance(o, bool) or not isinstance(o, int) or o < 1:
            skipped["bad_output_tokens"] += 1
            continue
        items.append((i, prompt, o))
    if not items:
        raise AstroUserError(f"{path}: no usable row ({dict(skipped) or 'empty file'})", field="--path",
                             fix='each line: {"prompt": "non-empty text", "output_tokens": positive integer}')
    if opts.sampling == "vllm":
        random.Random(opts.seed).shuffle(items)
        notes["vllm_chat_template_not_applied"] = 1
    else:
        items = [items[j] for j in rng.permutation(len(items))]
    out = [BenchRequest(f"custom-{k}", prompt, opts.counter(prompt), o, source_id=str(i))
           for k, (i, prompt, o) in enumerate(items[:opts.num_requests])]
    warnings = []
    if len(out) < opts.num_requests:
        warnings.append(f"custom: {len(out)} rows for {opts.num_requests} requests; oversampled "
                        + ("as vLLM does" if opts.sampling == "vllm" else "in order"))
        if opts.sampling == "vllm":
            out = oversample(out, opts.num_requests, opts.seed, "custom")
        else:
            out = [out[k % len(out)] if k < len(out) else
                   BenchRequest(f"custom-{k}", out[k % len(out)].prompt, out[k % len(out)].prompt_tokens,
                                out[k % len(out)].output_tokens, source_id=out[k % len(out)].source_id)
                   for k in range(opts.num_requests)]
    return Workload("custom", out, f"--path {path}" + ("; sampled as vllm bench serve" if opts.sampling == "vllm"
                                                         else ""), dict(skipped), dict(notes), warnings)


@WORKLOADS.register("random")
def load_random(opts: WorkloadOptions, rng: np.random.Generator) -> Workload:
    """Fixed ISL/OSL: every request has an `--input-len`-token prompt (synthetic text,
    exact under the fallback counter; with `--tokenizer` its count under that tokenizer is
    recorded) and an `--output-len`-token reference reply. vllm sampling: the prompt
    length is `--input-len` minus the special tokens the tokenizer adds (as vLLM's
    `RandomDataset` with range ratio 0); the prompt text is astro's, not vLLM's decoded
    token ids."""
    if opts.input_len < 1 or opts.output_len < 1:
        flag = "--input-len" if opts.input_len < 1 else "--output-len"
        raise AstroUserError("must be ≥ 1", field=flag, fix="give a positive token count")
    n_in = opts.input_len
    if opts.sampling == "vllm":
        n_in = max(1, n_in - opts.counter(""))  # a tokenizer that adds BOS counts 1 for ""
    out = []
    for i in range(opts.num_requests):
        text = synthetic_prompt(n_in, seed=int(rng.integers(0, 2**31)))
        out.append(BenchRequest(f"random-{i}", text, opts.counter(text), opts.output_len, source_id=str(i)))
    return Workload("random", out, f"synthetic fixed lengths: input {n_in}, output {opts.output_len} tokens")


def vllm_arrival_times(n: int, rate_rps: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times (s from the start) as `vllm bench serve` plans them (module docstring):
    the first request one gap after the start, the last at n / rate."""
    if n <= 0:
        return np.zeros(0)
    if math.isinf(rate_rps):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate_rps)
    else:
        rs = np.random.RandomState(seed)
        theta = 1.0 / (rate_rps * burstiness)
        gaps = np.array([rs.gamma(shape=burstiness, scale=theta) for _ in range(n)])
    t = np.cumsum(gaps)
    if t[-1] != 0:
        t = t * ((n / rate_rps) / t[-1])
    return t

