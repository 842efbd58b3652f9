"""chat-gbm's tag time with the fallback token counter before and after it became one
`findall` (tokens.py), interleaved in one process: the ratio is what a busy machine can
still measure.

The counter runs on every earlier turn of a chat's history (chat-gbm's history cues), so
its cost shows in the tagger's chat latency. Each repeat times the same chats
(`tagger_latency.sample_chats`) once with the old counter (walk `\\w+|[^\\w\\s]` matches and
add ceil(len/4)) and once with the shipped one, order rotated; the table gives the wall p50
of each and their ratio.

    .venv/bin/python benchmarks/archive/tagger_counter_ab.py --chats 200 --repeats 6
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import time
from pathlib import Path
from types import ModuleType

import numpy as np

import rps_astro_cli.tokens as tokens
from rps_astro_cli.length import load_length_model


def _sibling(name: str) -> ModuleType:
    """The benchmark script `benchmarks/<name>.py` as module `name` (benchmarks/ is no package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


tagger_latency = _sibling("tagger_latency")

_WORDS = re.compile(r"\w+|[^\w\s]", re.UNICODE)


def old_count(text: str) -> int:
    """The counter before: one match object per word, ceil(len/4) tokens each."""
    n = 0
    for m in _WORDS.finditer(text):
        n += (len(m.group()) + 3) // 4
    return n


def use(counter) -> None:
    """Make every loaded astro module that imported the counter call `counter`."""
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "") or ""
        if name.startswith("rps_astro_cli") and getattr(mod, "count_tokens_fallback", None) in (old_count, NEW):
            mod.count_tokens_fallback = counter


NEW = tokens.count_tokens_fallback


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chats", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--json", type=Path, default=None, help="write every repeat's p50s and the ratio here")
    args = ap.parse_args()
    model = load_length_model("chat-gbm")
    chats, what = tagger_latency.sample_chats(args.chats, np.random.default_rng(0))
    assert all(old_count(m.get("content") or "") == NEW(m.get("content") or "") for c in chats for m in c
               if isinstance(m.get("content"), str))
    for c in chats[:30]:
        model.predict_chats([c])
    p50 = {"old": [], "new": []}
    for rep in range(args.repeats):
        for arm in ("old", "new") if rep % 2 == 0 else ("new", "old"):
            use(old_count if arm == "old" else NEW)
            wall = []
            for c in chats:
                t0 = time.perf_counter()
                model.predict_chats([c])
                wall.append(time.perf_counter() - t0)
            p50[arm].append(float(np.median(wall)) * 1e3)
    use(NEW)
    ratios = [n / o for n, o in zip(p50["new"], p50["old"])]
    print(f"{what}; {args.repeats} repeats, order rotated")
    print("| repeat | old p50 ms | new p50 ms | new / old |\n| --- | ---: | ---: | ---: |")
    for i, (o, n, r) in enumerate(zip(p50["old"], p50["new"], ratios)):
        print(f"| {i} | {o:.3f} | {n:.3f} | {r:.3f} |")
    print(f"median ratio new / old: {float(np.median(ratios)):.3f}")
    if args.json:
        out = {"chats": what, "repeats": args.repeats, "p50_ms": p50, "ratios": ratios,
               "median_ratio_new_over_old": float(np.median(ratios))}
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
