"""What each front door adds to an idle request's TTFT (issue 32's table): sequential
streaming chat requests, one in flight, short held-back ShareGPT prompts, `max_tokens` 8,
keep-alive clients, the arms interleaved round by round.

    ASTRO_DATA_DIR=… .venv/bin/python benchmarks/front_door_idle.py [--rounds 120] \\
        [--engine-cpus 0 --front-cpus 1] [--json out.json]

One sim fleet (4 × llama-2-7b-a30 engines at time scale 1, the peer harness's
`Fleet`: tagger service, no internal token) and every front door on it at once: `direct`
(straight to an engine, the engines in turn), astro's default (`astro serve scheduler`
as the peer harness's `astro/power_of_k-local` arm starts it: in-process look-aheads, the
tagger service), vllm-router `power_of_two` and sglang-router `cache_aware` (skipped,
with a line, when a peer is not installed: `pip install -e '.[peers]'`). Each round
sends the round's prompt once through every arm, one after another, the order rotated
each round, so the machine's load falls on every arm alike. TTFT is the client's: from
the request's send to the first chunk whose delta carries content.

Prints, per arm, the median, mean and P99 TTFT and what it adds over `direct`: the
difference of the medians, and the median and P99 of the per-round differences (each
round's arm TTFT − the same round's direct TTFT). The prompts: the length tagger's test
split of the ShareGPT sample (`dispatch_predicted.held_out_pool`, first human turns),
those of 8–64 tokens, drawn with the seed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from dispatch_predicted import _default_data, held_out_pool
from peer_routers import (
    ARMS,
    Fleet,
    HarnessError,
    Pinning,
    Router,
    arm_of,
    client_opts,
    decision_costs,
    fleet_config,
    parse_cpus,
    peer_binary,
    pin_tree,
)

ROUTER_ARMS = ("astro/power_of_k-local", "vllm-router/power_of_two", "sglang-router/cache_aware")


def short_prompts(n: int, seed: int, lo: int = 8, hi: int = 64) -> list[str]:
    """`n` held-back ShareGPT prompts of `lo`–`hi` tokens, drawn (with replacement) by `seed`."""
    pool = held_out_pool(_default_data(), pairs="first")
    keep = [t for t, p in zip(pool.prompts, pool.prompt_tokens) if lo <= p <= hi]
    if not keep:
        raise SystemExit(f"no held-back prompt of {lo}-{hi} tokens in {pool.info['data']}")
    rng = np.random.default_rng([seed, 32])
    return [keep[i] for i in rng.integers(len(keep), size=n)]


async def ttft_s(client: httpx.AsyncClient, url: str, model: str | None, prompt: str) -> float:
    """One streamed chat request's TTFT at the client (s): send → first content delta."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "stream": True}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    t1 = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise HarnessError(f"{url}: HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():  # read to the end: the connection is reused
            if t1 is not None or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                t1 = time.perf_counter()
    if t1 is None:
        raise HarnessError(f"{url}: the stream ended without content")
    return t1 - t0


async def rounds(targets: dict[str, list[str]], prompts: list[str], model: str | None) -> dict[str, list[float]]:
    """Every prompt through every arm (`targets`: arm → its URL(s), used in turn), one
    request at a time, the arms' order rotated each round; → arm → TTFTs (s), by round."""
    names = list(targets)
    out: dict[str, list[float]] = {a: [] for a in names}
    limits = httpx.Limits(max_keepalive_connections=8, keepalive_expiry=60)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        for a in names:  # one request each first: connections open, every path warm
            urls = targets[a]
            for u in urls:
                await ttft_s(client, u, model, prompts[0])
        for i, prompt in enumerate(prompts):
            for a in names[i % len(names):] + names[:i % len(names)]:
                urls = targets[a]
                out[a].append(await ttft_s(client, urls[i % len(urls)], model, prompt))
    return out


def summary(ttfts: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Per arm: median / mean / P99 TTFT (ms) and what it adds over `direct` (ms)."""
    direct = np.asarray(ttfts["direct"]) * 1e3
    rows = []
    for a, v in ttfts.items():
        x = np.asarray(v) * 1e3
        d = x - direct
        rows.append({"arm": a, "n": len(x), "ttft_median_ms": float(np.median(x)), "ttft_mean_ms": float(x.mean()),
                     "ttft_p99_ms": float(np.percentile(x, 99)),
                     "added_median_ms": float(np.median(x) - np.median(direct)),
                     "added_paired_median_ms": float(np.median(d)), "added_paired_p99_ms": float(np.percentile(d, 99))})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| front door | median TTFT (ms) | mean | P99 | added over direct, medians (ms) | "
             "added per round, median / P99 (ms) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        added = "—" if r["arm"] == "direct" else f"{r['added_median_ms']:+.2f}"
        paired = ("—" if r["arm"] == "direct"
                  else f"{r['added_paired_median_ms']:+.2f} / {r['added_paired_p99_ms']:+.2f}")
        lines.append(f"| `{r['arm']}` | {r['ttft_median_ms']:.2f} | {r['ttft_mean_ms']:.2f} | {r['ttft_p99_ms']:.2f} "
                     f"| {added} | {paired} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=120, help="prompts, each sent once through every arm (≥ 100)")
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default=",".join(ROUTER_ARMS), help="front doors beside `direct` (peer harness names)")
    ap.add_argument("--engine-cpus", default=None, help="pin the sim engines to these CPUs (with --front-cpus)")
    ap.add_argument("--front-cpus", default=None, help="pin everything else to these CPUs")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be ≥ 1")
    if (a.engine_cpus is None) != (a.front_cpus is None):
        ap.error("give both --engine-cpus and --front-cpus, or neither")
    arms = []
    for name in (s.strip() for s in a.arms.split(",") if s.strip()):
        if name.partition("@")[0] not in ARMS:
            ap.error(f"unknown arm {name!r}; one of: {', '.join(ARMS)} (NAME@SRC: an astro arm from another build)")
        try:
            arm = arm_of(name)
        except HarnessError as e:
            ap.error(str(e))
        if arm.router != "astro" and peer_binary(arm.router) is None:
            print(f"skipped {name}: {arm.router} is not installed (pip install -e '.[peers]')", file=sys.stderr)
            continue
        arms.append(arm)
    pinning = None
    if a.engine_cpus is not None:
        pinning = Pinning(parse_cpus(a.engine_cpus), parse_cpus(a.front_cpus))
        pin_tree(os.getpid(), pinning.front)
    prompts = short_prompts(a.rounds, a.seed)
    with tempfile.TemporaryDirectory(prefix="astro-idle-") as d:
        fleet = Fleet(fleet_config(a.instances, None, None, 1.0, False), Path(d), pinning)
        routers: list[Router] = []
        try:
            info = fleet.start()
            model = info.get("model")
            targets: dict[str, list[str]] = {"direct": fleet.engine_urls()}
            for arm in arms:
                r = Router(arm, info, Path(d) / f"{arm.name.replace('/', '_')}.log", a.seed)
                routers.append(r)
                r.wait_ready(lambda u, arm=arm: client_opts(arm, u, model, 30.0))
                if pinning is not None:
                    pin_tree(r.proc.pid, pinning.front)
                targets[arm.name] = [r.url or ""]
            t0 = time.perf_counter()
            ttfts = asyncio.run(rounds(targets, prompts, model))
            wall_s = time.perf_counter() - t0
            # astro's own account of its share (its /decisions): the front door's overhead,
            # the decision and the wait for the tag, P50 / P99
            costs = {r.arm.name: decision_costs(r.url or "") for r in routers if r.arm.router == "astro"}
        finally:
            for r in routers:
                r.stop()
            fleet.stop()
    rows = summary(ttfts)
    print(f"{a.rounds} rounds × {len(targets)} arms in {wall_s:.0f} s ({a.instances} sim engines, "
          f"{'pinned ' + a.engine_cpus + ' / ' + a.front_cpus if pinning else 'not pinned'})")
    print(markdown(rows))
    for name, c in costs.items():
        if c:
            print(f"{name} by its /decisions (ms, P50 / P99): overhead {c['all_overhead_ms_p50']:.2f} / "
                  f"{c['all_overhead_ms_p99']:.2f}, decision {c['all_decide_ms_p50']:.2f} / "
                  f"{c['all_decide_ms_p99']:.2f}, "
                  f"tag wait {c['all_tag_wait_ms_p50']:.2f} / {c['all_tag_wait_ms_p99']:.2f}")
    if a.json:
        a.json.write_text(json.dumps({"rounds": a.rounds, "instances": a.instances, "seed": a.seed,
                                      "pinning": pinning.describe() if pinning else None, "wall_s": wall_s,
                                      "summary": rows, "astro_costs": costs, "ttft_s": ttfts},
                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
