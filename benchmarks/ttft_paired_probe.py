"""Paired TTFT probe: `vllm bench serve`'s own request function beside astro's bench client,
one request at a time, alternating, on the same prompts, so machine load hits both alike.

Each pair sends the same prompt twice (order alternates per pair): once through vLLM's
`async_request_openai_chat_completions` (aiohttp, the body `vllm bench serve` sends:
list-form content, `max_completion_tokens`, `x-request-id`) and once through astro's
`send_request_lean` (HostPool, string content, `max_tokens`), both with `ignore_eos`. It
prints, per target, the median and mean of each tool's TTFT (its own clock: vLLM's
`perf_counter()` before `session.post`, astro's `sent_s`; vLLM's definition, the first
chunk with a non-empty `choices`) and the median of the paired differences.

Run with the interpreter that has vllm (vLLM 0.32), astro's `src` on the path:

    PYTHONPATH=src /tmp/.astro-vllm-venv/bin/python benchmarks/ttft_paired_probe.py \\
        --cluster /tmp/fleet/cluster.json --pairs 40

Targets: the scheduler's front door, and (with --direct) engine 0 itself with the internal
token, which takes the front door out of the path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

PROMPT_WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as")


def prompt(i: int, words: int) -> str:
    return " ".join(PROMPT_WORDS[(i * 7 + j) % len(PROMPT_WORDS)] for j in range(words))


async def main_async(a) -> None:
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_chat_completions

    from rps_astro_cli.bench.client import ClientOptions, send_request_lean
    from rps_astro_cli.bench.workload_base import BenchRequest
    from rps_astro_cli.services.rpc import HostPool

    cj = json.loads(Path(a.cluster).read_text())
    model = cj.get("model") or "meta-llama/Llama-2-7b-hf"
    targets = [("front door", cj["scheduler"]["url"], {})]
    if a.direct:
        tok = Path(cj["internal_token_file"]).read_text().strip()
        targets.append(("engine 0 direct", cj["instances"][0]["engine_url"], {"x-astro-internal-token": tok}))
    conn = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=300, use_dns_cache=True,
                                keepalive_timeout=60, enable_cleanup_closed=True, force_close=False, ssl=False)
    rows: dict[str, dict] = {}
    async with aiohttp.ClientSession(connector=conn, trust_env=True,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        for name, url, headers in targets:
            pool = HostPool(url, headers=headers)
            opts = ClientOptions(base_url=url, model=model, send_true_lengths=False, ignore_eos=True,
                                 ttft_definition="vllm")
            loop_clock = time.perf_counter
            res: dict[str, list[float]] = {"vllm": [], "astro": []}
            for i in range(a.pairs + 1):  # pair 0 warms both connections up and is dropped
                text = prompt(i, a.prompt_words)
                order = ("vllm", "astro") if i % 2 == 0 else ("astro", "vllm")
                for tool in order:
                    if tool == "vllm":
                        inp = RequestFuncInput(prompt=text, api_url=url + "/v1/chat/completions", prompt_len=0,
                                               output_len=a.max_tokens, model=model, ignore_eos=True,
                                               extra_headers=headers or None, request_id=f"probe-{i}")
                        out = await async_request_openai_chat_completions(inp, session)
                        assert out.success, out.error
                        ttft = out.ttft
                    else:
                        req = BenchRequest(f"probe-{i}", text, 0, a.max_tokens)
                        rec = await send_request_lean(pool, req, opts, loop_clock, loop_clock())
                        assert rec.error is None, rec.error
                        ttft = rec.ttft_s
                    if i:
                        res[tool].append(ttft)
                    await asyncio.sleep(a.gap_s)
            diffs = [v - s for v, s in zip(res["vllm"], res["astro"])]
            print(f"{name}: {a.pairs} pairs, TTFT ms median / mean — vllm request func "
                  f"{statistics.median(res['vllm']) * 1e3:.2f} / {statistics.mean(res['vllm']) * 1e3:.2f}, "
                  f"astro client {statistics.median(res['astro']) * 1e3:.2f} / "
                  f"{statistics.mean(res['astro']) * 1e3:.2f}; vllm − astro per pair median "
                  f"{statistics.median(diffs) * 1e3:.2f} ms", flush=True)
            rows[name] = {"pairs": a.pairs, "vllm_ttft_ms": [x * 1e3 for x in res["vllm"]],
                          "astro_ttft_ms": [x * 1e3 for x in res["astro"]],
                          "vllm_minus_astro_median_ms": statistics.median(diffs) * 1e3}
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--prompt-words", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--gap-s", type=float, default=0.05, help="pause between requests (s)")
    ap.add_argument("--direct", action="store_true", help="also probe engine 0 directly")
    ap.add_argument("--json", type=Path, default=None, help="write every pair's TTFTs here")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
