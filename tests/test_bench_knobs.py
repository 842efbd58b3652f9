"""Workload knobs: the custom JSONL workload, random fixed ISL/OSL, --max-seconds."""

from __future__ import annotations

import json

import numpy as np
import pytest

from rps_astro_cli.bench.workload_base import WorkloadOptions
from rps_astro_cli.bench.workloads import load_workload
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.tokens import count_tokens_fallback


def _jsonl(tmp_path, rows):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_custom_jsonl_takes_prompts_and_optional_lengths(tmp_path):
    p = _jsonl(tmp_path, [{"prompt": "what is a kv block", "output_tokens": 7},
                          {"prompt": "tell me about chunked prefill"},           # → --output-len
                          {"prompt": "", "output_tokens": 3},                     # skipped: no prompt
                          {"prompt": "bad length", "output_tokens": "many"},      # skipped: bad length
                          {"prompt": "vllm's other name", "output_len": 11}])
    wl = load_workload("custom", WorkloadOptions(path=p, num_requests=3, output_len=5), np.random.default_rng(0))
    got = sorted((r.prompt, r.prompt_tokens, r.output_tokens) for r in wl.requests)
    # fallback counts: a word ceil(len/4) tokens, a symbol 1: what is a kv block = 1+1+1+1+2;
    # tell me about chunked prefill = 1+1+2+2+2; vllm ' s other name = 1+1+1+2+1
    assert got == sorted([("what is a kv block", 6, 7), ("tell me about chunked prefill", 8, 5),
                          ("vllm's other name", 6, 11)])
    assert wl.skipped == {"no_prompt": 1, "bad_output_tokens": 1} and wl.notes == {"output_len_from_flag": 1}
    # vLLM's order: Python's random.Random(seed).shuffle of the usable rows
    import random

    rows = [("what is a kv block", 7), ("tell me about chunked prefill", 5), ("vllm's other name", 11)]
    random.Random(4).shuffle(rows)
    wl = load_workload("custom", WorkloadOptions(path=p, num_requests=3, output_len=5, sampling="vllm", seed=4),
                       np.random.default_rng(0))
    assert [(r.prompt, r.output_tokens) for r in wl.requests] == rows


def test_custom_needs_a_jsonl_file(tmp_path):
    with pytest.raises(AstroUserError, match="--path: the custom workload needs a file"):
        load_workload("custom", WorkloadOptions(), np.random.default_rng(0))
    with pytest.raises(AstroUserError, match="--path: .*no usable row"):
        load_workload("custom", WorkloadOptions(path=_jsonl(tmp_path, [{"text": "x"}])), np.random.default_rng(0))


def test_random_has_fixed_isl_osl():
    wl = load_workload("random", WorkloadOptions(num_requests=4, input_len=37, output_len=9),
                       np.random.default_rng(1))
    assert [(r.prompt_tokens, r.output_tokens) for r in wl.requests] == [(37, 9)] * 4
    assert all(count_tokens_fallback(r.prompt) == 37 for r in wl.requests)
    assert len({r.prompt for r in wl.requests}) == 4  # distinct prompts (no accidental prefix cache hits)


def test_max_seconds_sends_only_requests_planned_before_it(tmp_path):
    from rps_astro_cli.bench.config import BenchConfig
    from rps_astro_cli.bench.runner import run_bench

    trace = tmp_path / "lt.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "100,3\n" * 10)
    cfg = BenchConfig.flat(virtual=True, instances=1, workload="length-trace", path=str(trace), num_requests=10,
                           arrival="constant", request_rate=2.0, max_seconds=2.0, policies=["round_robin"],
                           oracle_lengths=True)
    res = run_bench(cfg)
    # constant 2 req/s: planned at 0, 0.5, ..., 4.5 s; those at ≤ 2 s are 0, 0.5, 1, 1.5, 2
    assert res.runs[0].metrics["overall"].num_requests == 5
    assert res.runs[0].extras["not_sent_after_max_seconds"] == 5
    with pytest.raises(AstroUserError, match="--max-seconds"):
        BenchConfig.flat(virtual=True, max_seconds=0.0)
    with pytest.raises(AstroUserError, match="--warmup: the virtual cluster starts cold"):
        BenchConfig.flat(virtual=True, warmup=2)


def test_prometheus_text_is_summed_over_label_sets():
    from rps_astro_cli.bench.scrape import parse_prometheus

    text = ("# HELP vllm:num_preemptions_total Preemptions.\n# TYPE vllm:num_preemptions_total counter\n"
            'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0\n'
            'vllm:num_preemptions_total{engine="1",model_name="m"} 4.0\n'
            "# TYPE astro:overhead_seconds histogram\n"
            'astro:overhead_seconds_bucket{le="0.1"} 2.0\nastro:overhead_seconds_bucket{le="+Inf"} 5.0\n'
            "astro:overhead_seconds_sum 0.75\nastro:overhead_seconds_count 5.0\n")
    got = parse_prometheus(text)
    assert got["vllm:num_preemptions_total"] == 7.0
    assert got["astro:overhead_seconds_sum"] == 0.75 and got["astro:overhead_seconds_count"] == 5.0
    assert parse_prometheus("<html>not metrics</html>") == {}
