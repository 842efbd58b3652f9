"""Length-tagger latency: per-request `predict` time of response-length models on CPU.

Goal (issue 6): the shipped `classic` model answers one prompt in ≤ 2 ms at p50 on CPU
(the Astrolabe paper's RoBERTa-base tagger: ~4.8 ms per request on its hardware).

Prompts: the first human turns of `sharegpt/sharegpt_v3_prompts500.json` in
$ASTRO_DATA_DIR (real tagger input); made-up prompts of similar lengths when absent.

    .venv/bin/python benchmarks/tagger_latency.py                     # classic
    .venv/bin/python benchmarks/tagger_latency.py --model classic --model runs/length/minilm
    .venv/bin/python benchmarks/tagger_latency.py --check             # exit 1 if classic p50 > 2 ms
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from rps_astro_cli.data_paths import data_dir
from rps_astro_cli.length import load_length_model
from rps_astro_cli.length.prompts import text_from_content

TARGET_P50_MS = 2.0


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


def measure(model, prompts: list[str], batch: int) -> dict[str, float]:
    model.predict(prompts[:batch])  # warm-up
    single = []
    for p in prompts:
        t0 = time.perf_counter()
        model.predict([p])
        single.append((time.perf_counter() - t0) * 1e3)
    batched = []
    for s in range(0, len(prompts) - batch + 1, batch):
        t0 = time.perf_counter()
        model.predict(prompts[s : s + batch])
        batched.append((time.perf_counter() - t0) * 1e3 / batch)
    return {
        "p50_ms": float(np.percentile(single, 50)), "p90_ms": float(np.percentile(single, 90)),
        "p99_ms": float(np.percentile(single, 99)), "mean_ms": float(np.mean(single)),
        "batched_p50_ms_per_req": float(np.percentile(batched, 50)) if batched else float("nan"),
        "calls": len(single),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", help="artifact name or folder (repeatable; default classic)")
    ap.add_argument("--calls", type=int, default=500, help="prompts timed one by one")
    ap.add_argument("--batch", type=int, default=32, help="batch size of the batched measurement")
    ap.add_argument("--check", action="store_true", help=f"exit 1 when classic p50 > {TARGET_P50_MS} ms")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    prompts, src = sample_prompts(args.calls, np.random.default_rng(0))
    results = {}
    for name in args.model or ["classic"]:
        results[name] = measure(load_length_model(name), prompts, args.batch)
    env = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "loadavg_1m": os.getloadavg()[0], "prompts": src}
    if args.json:
        print(json.dumps({"env": env, "results": results}))
    else:
        print(f"prompts: {src}; {env['cpus']} CPUs, load average {env['loadavg_1m']:.1f}")
        print(f"{'model':<24}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}{f'b={args.batch} ms/req':>14}")
        for name, r in results.items():
            print(f"{name:<24}{r['p50_ms']:>9.3f}{r['p90_ms']:>9.3f}{r['p99_ms']:>9.3f}{r['mean_ms']:>9.3f}"
                  f"{r['batched_p50_ms_per_req']:>14.3f}")
    ok = True
    if "classic" in results:
        p50 = results["classic"]["p50_ms"]
        ok = p50 <= TARGET_P50_MS
        print(f"classic p50 {p50:.3f} ms vs target {TARGET_P50_MS} ms: ratio {p50 / TARGET_P50_MS:.2f} "
              f"({'meets' if ok else 'MISSES'} the goal)", file=sys.stderr if args.json else sys.stdout)
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
