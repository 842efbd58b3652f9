"""`--sampling vllm` and `--ttft-definition vllm` against what vLLM 0.32 itself does.

The recorded list (tests/data/vllm_sharegpt_sampling.json, ids and lengths only) was
written by scripts/record_vllm_sampling.py calling vLLM's own dataset code and its
`get_request` send plan, with the tiny Llama tokenizer (tests/data/tiny_llama_tokenizer.json,
built by scripts/make_tiny_llama.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from rps_astro_cli.bench.client import StreamTimer, _finish
from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.data_paths import data_dir

DATA = Path(__file__).parent / "data"
REC = json.loads((DATA / "vllm_sharegpt_sampling.json").read_text())


@pytest.mark.skipif(data_dir() is None or not (data_dir() / "sharegpt/sharegpt_v3_sample500.json").is_file(),
                    reason="needs ../shared/data/sharegpt/sharegpt_v3_sample500.json")
@pytest.mark.parametrize("case", REC["cases"], ids=lambda c: f"seed{c['seed']}-n{c['num_prompts']}")
def test_sharegpt_vllm_sampling_reproduces_vllm_bench_serve_request_list(case):
    pytest.importorskip("tokenizers")
    from rps_astro_cli.bench.workload_base import WorkloadOptions
    from rps_astro_cli.bench.workloads import load_workload
    from rps_astro_cli.tokens import load_counter_with_special

    opts = WorkloadOptions(path=data_dir() / "sharegpt/sharegpt_v3_sample500.json", num_requests=case["num_prompts"],
                           sampling="vllm", seed=case["seed"],
                           counter=load_counter_with_special(DATA / "tiny_llama_tokenizer.json"))
    wl = load_workload("sharegpt", opts, np.random.default_rng(case["seed"]))
    got = [(int(r.request_id.rsplit("-", 1)[1]), r.source_id, r.prompt_tokens, r.output_tokens) for r in wl.requests]
    want = [(i, eid, p, o) for i, eid, _pos, p, o in case["requests"]]
    assert got == want


@pytest.mark.parametrize("plan", REC["arrival_plans"], ids=lambda p: f"seed{p['seed']}-b{p['burstiness']}")
def test_vllm_arrival_plan_matches_vllm_get_request(plan):
    from rps_astro_cli.bench.workloads_vllm import vllm_arrival_times

    got = vllm_arrival_times(plan["num_prompts"], plan["request_rate"], float(plan["burstiness"]), plan["seed"])
    assert np.allclose(got, plan["send_at_s"], rtol=0, atol=1e-6)
    assert got[-1] == pytest.approx(plan["num_prompts"] / plan["request_rate"])  # vLLM rescales to n / rate


def _stream(timer: StreamTimer) -> None:
    """A chat stream: role-only delta at t=1, text at 2, an empty delta at 3, text + finish
    at 4, the usage-only chunk at 5, then [DONE]."""
    ev = [(1.0, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}),
          (2.0, {"choices": [{"delta": {"content": "Hi"}}]}),
          (3.0, {"choices": [{"delta": {"content": ""}}]}),
          (4.0, {"choices": [{"delta": {"content": " there"}, "finish_reason": "stop"}]}),
          (5.0, {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}})]
    for t, obj in ev:
        timer.feed(f"data: {json.dumps(obj)}\n\n".encode(), t)
    timer.feed(b"data: [DONE]\n\n", 5.5)
    timer.close(5.5)


@pytest.mark.parametrize("definition, ttft, itl, e2e", [
    ("astro", 2.0, [2.0], 4.0),            # text chunks only: 2 and 4
    ("vllm", 1.0, [1.0, 1.0, 1.0], 4.0),   # every chunk with choices: 1, 2, 3, 4; not the usage chunk
])
def test_ttft_definitions_on_a_hand_stream(definition, ttft, itl, e2e):
    timer = StreamTimer(chat=True)
    _stream(timer)
    rec = RequestRecord("r", sent_s=0.0)
    _finish(rec, timer, 5.5, len, definition)
    assert rec.success and rec.output_tokens == 2
    assert rec.ttft_s == ttft and rec.itl_s == itl and rec.e2e_s == e2e
    assert rec.tpot_s == pytest.approx((e2e - ttft) / 1)  # (E2E − TTFT) / (n − 1), both definitions


def test_bad_sampling_and_definition_name_the_flag():
    from rps_astro_cli.bench.config import BenchConfig
    from rps_astro_cli.errors import AstroUserError

    with pytest.raises(AstroUserError, match="--ttft-definition: unknown definition 'first'"):
        BenchConfig.flat(virtual=True, ttft_definition="first")
    with pytest.raises(AstroUserError, match="--sampling: unknown sampling 'sglang'"):
        BenchConfig.flat(virtual=True, sampling="sglang")
