"""Length-tagger latency: per-request prediction time of response-length models on CPU.

Goal (issues 6 and 13): the shipped default model answers one request in ≤ 2 ms at p50 on
CPU (the Astrolabe paper's RoBERTa-base tagger: ~4.8 ms per request on its hardware).

Two request kinds, each timed one call per request (batch 1):
- prompts: the first human turns of `sharegpt/sharegpt_v3_prompts500.json` in
  $ASTRO_DATA_DIR through `model.predict([prompt])` (a completions request, or a chat's
  first turn); made-up prompts of similar lengths when the file is absent;
- chats: OpenAI `messages` lists built from `sharegpt/sharegpt_v3_sample500.json`, one per
  human turn with every earlier turn before it, through `model.predict_chats([messages])`
  (what the tagger calls for a chat body; history-reading models read the earlier turns).

The machine is shared, so arms are interleaved: each repeat times every model on the same
requests in a rotated order; the table gives the median over repeats of each percentile, the
ratio of each model's p50 to the first model's in the same repeats, and the process CPU
time per call (what a call costs when it need not wait for a core). `--check` reads wall p50.

    .venv/bin/python benchmarks/tagger_latency.py                         # the default model
    .venv/bin/python benchmarks/tagger_latency.py --model chat-gbm --model classic --repeats 3
    .venv/bin/python benchmarks/tagger_latency.py --check                 # exit 1 if default p50 > 2 ms
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import numpy as np

from rps_astro_cli.data_paths import data_dir
from rps_astro_cli.length import DEFAULT_MODEL, load_length_model
from rps_astro_cli.length.prompts import text_from_content

TARGET_P50_MS = 2.0
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant"}


def sample_prompts(n: int, rng: np.random.Generator) -> tuple[list[str], str]:
    d = data_dir()
    path = d / "sharegpt" / "sharegpt_v3_prompts500.json" if d else None
    if path and path.is_file():
        recs = json.loads(path.read_text(encoding="utf-8"))
        prompts = []
        for r in recs:
            turns = r.get("conversations") or []
            human = [t for t in turns if t.get("from") in ("human", "user")]
            if human:
                prompts.append(text_from_content(human[0].get("value"))[0])
        return prompts[:n], f"{path.name} ({len(prompts[:n])} real first turns)"
    words = ["explain", "the", "code", "write", "a", "story", "about", "data", "why", "how", "list", "ideas"]
    lengths = rng.lognormal(mean=3.2, sigma=1.2, size=n).astype(int) + 1
    return [" ".join(rng.choice(words, size=k)) for k in lengths], f"{n} synthetic prompts"


def sample_chats(n: int, rng: np.random.Generator) -> tuple[list[list[dict[str, Any]]], str]:
    """Up to n chats (messages lists ending in a user turn), drawn with `rng` from every
    human turn of the ShareGPT sample; none when the file is absent."""
    d = data_dir()
    path = d / "sharegpt" / "sharegpt_v3_sample500.json" if d else None
    if not (path and path.is_file()):
        return [], "no ShareGPT sample: chats not timed"
    chats = []
    for rec in json.loads(path.read_text(encoding="utf-8")):
        msgs = [{"role": _ROLES.get(str(t.get("from", "")).lower(), "user"),
                 "content": text_from_content(t.get("value"))[0]} for t in rec.get("conversations") or []]
        chats += [msgs[: i + 1] for i, m in enumerate(msgs) if m["role"] == "user" and m["content"].strip()]
    pick = rng.permutation(len(chats))[:n]
    picked = [chats[i] for i in sorted(pick)]
    depth = np.mean([len(c) - 1 for c in picked]) if picked else 0.0
    return picked, f"{path.name} ({len(picked)} chats, {depth:.1f} earlier turns on average)"


def time_calls(fn, items: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """(wall ms, process CPU ms) of one call per item. On a shared machine the CPU time is
    what the call costs; wall time adds waiting for a core."""
    wall = np.empty(len(items))
    cpu = np.empty(len(items))
    for i, item in enumerate(items):
        c0, t0 = time.process_time(), time.perf_counter()
        fn([item])
        wall[i] = (time.perf_counter() - t0) * 1e3
        cpu[i] = (time.process_time() - c0) * 1e3
    return wall, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help=f"artifact name or folder (repeatable; default {DEFAULT_MODEL})")
    ap.add_argument("--calls", type=int, default=300, help="requests of each kind timed per repeat")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats (median reported)")
    ap.add_argument("--check", action="store_true", help=f"exit 1 when the default model's p50 > {TARGET_P50_MS} ms")
    ap.add_argument("--json", nargs="?", const="-", default=None,
                    help="print one JSON object; with PATH: write it there and print the table")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prompts, src_p = sample_prompts(args.calls, rng)
    chats, src_c = sample_chats(args.calls, rng)
    names = args.model or [DEFAULT_MODEL]
    models = {name: load_length_model(name) for name in names}
    for m in models.values():  # warm-up
        m.predict(prompts[:4])
        if chats:
            m.predict_chats(chats[:4])
    kinds = {"prompts": prompts, **({"chats": chats} if chats else {})}
    per: dict[str, dict[str, list[np.ndarray]]] = {n: {k: [] for k in kinds} for n in names}
    per_cpu: dict[str, dict[str, list[np.ndarray]]] = {n: {k: [] for k in kinds} for n in names}
    for r in range(args.repeats):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            m = models[name]
            for kind, items in kinds.items():
                fn = m.predict if kind == "prompts" else m.predict_chats
                wall, cpu = time_calls(fn, items)
                per[name][kind].append(wall)
                per_cpu[name][kind].append(cpu)
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name in names:
        results[name] = {}
        for kind in kinds:
            runs = per[name][kind]
            p50s = [float(np.percentile(t, 50)) for t in runs]
            ref = [float(np.percentile(t, 50)) for t in per[names[0]][kind]]
            results[name][kind] = {
                "p50_ms": float(np.median(p50s)), "p50_min_ms": min(p50s), "p50_max_ms": max(p50s),
                "p90_ms": float(np.median([np.percentile(t, 90) for t in runs])),
                "p99_ms": float(np.median([np.percentile(t, 99) for t in runs])),
                "p50_ratio_to_first": float(np.median(np.array(p50s) / np.array(ref))),
                "cpu_p50_ms": float(np.median([np.percentile(t, 50) for t in per_cpu[name][kind]])),
                "cpu_p99_ms": float(np.median([np.percentile(t, 99) for t in per_cpu[name][kind]])),
                "calls": len(runs[0]), "repeats": len(runs),
            }
    env = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "loadavg_1m": os.getloadavg()[0], "prompts": src_p, "chats": src_c}
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            json.dump({"env": env, "results": results}, f, indent=1)
    if args.json == "-":
        print(json.dumps({"env": env, "results": results}))
    else:
        print(f"prompts: {src_p}; chats: {src_c}; {env['cpus']} CPUs, load average {env['loadavg_1m']:.1f}")
        print(f"{'model':<22}{'kind':<9}{'p50 ms':>9}{'[min–max]':>16}{'p90 ms':>9}{'p99 ms':>9}{'p50 / first':>13}"
              f"{'CPU p50':>9}{'CPU p99':>9}")
        for name, by_kind in results.items():
            for kind, r in by_kind.items():
                spread = "[{:.2f}–{:.2f}]".format(r["p50_min_ms"], r["p50_max_ms"])
                print(f"{name:<22}{kind:<9}{r['p50_ms']:>9.3f}{spread:>16}"
                      f"{r['p90_ms']:>9.3f}{r['p99_ms']:>9.3f}{r['p50_ratio_to_first']:>13.2f}"
                      f"{r['cpu_p50_ms']:>9.3f}{r['cpu_p99_ms']:>9.3f}")
    ok = True
    if DEFAULT_MODEL in results:
        worst = max(r["p50_ms"] for r in results[DEFAULT_MODEL].values())
        ok = worst <= TARGET_P50_MS
        print(f"{DEFAULT_MODEL} (default) worst p50 {worst:.3f} ms vs target {TARGET_P50_MS} ms: ratio "
              f"{worst / TARGET_P50_MS:.2f} ({'meets' if ok else 'MISSES'} the goal)",
              file=sys.stderr if args.json == "-" else sys.stdout)
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
