"""Record the request list `vllm bench serve` draws from a ShareGPT file (run it with a
vLLM install, e.g. `/tmp/.astro-vllm-venv/bin/python scripts/record_vllm_sampling.py`).

It calls vLLM's own dataset code (`vllm.benchmarks.datasets.get_samples`, what
`vllm bench serve --dataset-name sharegpt` runs) and writes, per drawn request, only
vLLM's request id, the ShareGPT entry's `id`, the position of the entry in the file, the
prompt length and the expected output length — never conversation text (the data's
terms: /work/shared/data/PROVENANCE.md). It also records the send plans of vLLM's
`get_request` for a few (seed, n, rate, burstiness). `tests/test_vllm_sampling.py` checks
astro's `--sampling vllm` against the file this writes.

    python scripts/record_vllm_sampling.py --dataset-path ../shared/data/sharegpt/sharegpt_v3_sample500.json \
        --tokenizer /tmp/.astro-vllm-venv/tiny-llama --out tests/data/vllm_sharegpt_sampling.json
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path


def vllm_send_plan(seed: int, n: int, rate: float, burstiness: float) -> list[float]:
    """The send times `vllm.benchmarks.serve.get_request` plans, read off a fake clock:
    `vllm bench serve` seeds numpy's global generator with --seed before it (serve.py
    main), and the generator sleeps until each planned time."""
    import asyncio

    import numpy as np
    from vllm.benchmarks import serve

    now = [0.0]

    async def fake_sleep(dt: float) -> None:
        now[0] += dt

    async def collect() -> list[float]:
        got = []
        async for _req, _rate in serve.get_request(list(range(n)), rate, burstiness):
            got.append(now[0])
        return got

    real_sleep, real_time = serve.asyncio.sleep, serve.time.time
    serve.asyncio.sleep, serve.time.time = fake_sleep, lambda: now[0]
    try:
        np.random.seed(seed)
        return asyncio.run(collect())
    finally:
        serve.asyncio.sleep, serve.time.time = real_sleep, real_time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset-path", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="0:100,3:600,7:40", help="seed:num_prompts,...")
    a = ap.parse_args()

    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.tokenizers import get_tokenizer
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    tok = get_tokenizer(a.tokenizer)
    import vllm.benchmarks.datasets.datasets as vds

    loaded: list = []
    real_load = vds.json.load

    def capture(fh, *args, **kw):  # the entries vLLM reads, so each sample maps to its entry by object identity
        data = real_load(fh, *args, **kw)
        loaded.append(data)
        return data

    cases = []
    for case in a.cases.split(","):
        seed, n = (int(x) for x in case.split(":"))
        p = FlexibleArgumentParser()
        add_cli_args(p)
        args = p.parse_args(["--dataset-name", "sharegpt", "--dataset-path", a.dataset_path,
                             "--num-prompts", str(n), "--seed", str(seed), "--tokenizer", a.tokenizer])
        vds.json.load = capture
        try:
            reqs = get_samples(args, tok)
        finally:
            vds.json.load = real_load
        where = {id(e["conversations"][0]["value"]): (str(e.get("id", pos)), pos)
                 for pos, e in enumerate(loaded[-1]) if len(e.get("conversations") or []) >= 2}
        rows = []
        for r in reqs:
            eid, pos = where[id(r.prompt)]  # the very string vLLM took from that entry
            rows.append([int(r.request_id.rsplit("-", 1)[1]), eid, pos, r.prompt_len, r.expected_output_len])
        cases.append({"seed": seed, "num_prompts": n,
                      "columns": ["request_index", "entry_id", "entry_index", "prompt_len", "expected_output_len"],
                      "requests": rows})
    plans = [{"seed": seed, "num_prompts": n, "request_rate": rate, "burstiness": b,
              "send_at_s": [round(x, 9) for x in vllm_send_plan(seed, n, rate, b)]}
             for seed, n, rate, b in ((0, 100, 4.0, 1.0), (5, 30, 2.5, 0.5), (0, 10, 4.0, float("inf")))]
    out = {"what": "vllm bench serve's ShareGPT request list (ids and lengths only)",
           "vllm_version": importlib.import_module("vllm").__version__, "dataset": Path(a.dataset_path).name,
           "tokenizer": "tiny-llama (scripts/make_tiny_llama.py; tests/data/tiny_llama_tokenizer.json)",
           "cases": cases,
           "arrival_plans": plans}
    Path(a.out).write_text("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in out.items()) + "\n}\n")
    print("wrote", a.out, [len(c["requests"]) for c in cases])


if __name__ == "__main__":
    main()
