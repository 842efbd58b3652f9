"""Factories shared by the test files (import them: `from conftest import linear_profile`).

Hand-computable execution profiles, request builders, profile files on disk, a
Prometheus text reader and a loader for the scripts under benchmarks/ and scripts/.
Each factory takes overrides, so a test states only the numbers
its hand computation depends on.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

from rps_astro_cli.sim.profile import ExecutionProfile, VisionCosts
from rps_astro_cli.sim.request import SimRequest


def linear_profile(**over) -> ExecutionProfile:
    """step_s = 10 ms + 0.1 ms per scheduled token: `token_s` rises linearly from 0 s at
    0 tokens to 0.1 s at 1000; no per-sequence or attention terms. Every other field is
    `ExecutionProfile`'s default unless overridden."""
    kw = dict(profile_id="hand", model="hand", gpu="paper", tp=1, base_s=0.010, per_seq_s=0.0,
              token_knots=(0, 1000), token_s=(0.0, 0.1), decode_attn_s_per_ctx_token=0.0,
              prefill_attn_s_per_token_pair=0.0)
    kw.update(over)
    return ExecutionProfile(**kw)


def hand_profile(**over) -> ExecutionProfile:
    """The multimodal hand profile of the RPS tests. step_s = 0.01 + 0.0001 · tokens
    (per_seq 0, no attention terms): linear_s knots (1 → 0.0001 s, 1000 → 0.1 s) give
    slope 0.0999/999 = 0.0001 s per token.
    Vision: 729 tokens / image, 196 / frame; encoder 0.2 s / image, 0.05 s / frame."""
    kw = dict(
        profile_id="hand", model="hand-mllm", gpu="none", tp=1,
        base_s=0.01, per_seq_s=0.0, token_knots=(1, 1000), token_s=(0.0001, 0.1),
        decode_attn_s_per_ctx_token=0.0, prefill_attn_s_per_token_pair=0.0,
        block_size=16, num_gpu_blocks=1000, max_num_seqs=8, max_num_batched_tokens=512,
        max_model_len=16000,
        vision=VisionCosts(tokens_per_image=729, tokens_per_frame=196, preprocess_s_per_image=0.01,
                           preprocess_s_per_frame=0.005, encoder_s_per_image=0.2, encoder_s_per_frame=0.05),
    )
    kw.update(over)
    return ExecutionProfile(**kw)


def req(rid: str, arrival_s: float, modality: str = "text", prompt: int = 100, out: int = 10,
        cls: str | None = None, **kw) -> SimRequest:
    """A `SimRequest` of `prompt` prompt tokens and `out` output tokens (RPS tests)."""
    return SimRequest(request_id=rid, arrival_s=arrival_s, prompt_tokens=prompt, target_output_tokens=out,
                      modality=modality, req_class=cls, **kw)


def write_profile(folder: Path, profile: ExecutionProfile, name: str = "hand.json") -> str:
    """`profile` as a JSON file in `folder` (what `--profile PATH` takes); its path."""
    p = Path(folder) / name
    p.write_text(json.dumps(profile.to_dict()))
    return str(p)


def prom_sum(text: str, name: str, **labels) -> float:
    """Sum of a Prometheus sample `name` over the series whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(?:\{{(.*)\}})? (\S+)$", line)
        if not m:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


REPO = Path(__file__).resolve().parents[1]


def load_script(relpath: str, name: str) -> ModuleType:
    """A script of the repository that is not a package module (`benchmarks/x.py`,
    `scripts/y.py`) imported as module `name` (registered in sys.modules, so its
    dataclasses and pickling work), with its folder first on sys.path while it loads, as
    `python relpath` has it (a benchmark imports its sibling scripts by name)."""
    path = REPO / relpath
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, relpath
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(path.parent))
    return mod


def scheduler_flag_kwargs(**over) -> dict:
    """The arguments of `cli.serve._scheduler_settings` as `astro serve scheduler` passes
    them with its flags' defaults and one engine; `over` overrides any flag by its
    parameter name (a shared one goes into `flags`, a `DispatchFlags`)."""
    import dataclasses

    from rps_astro_cli.cli.serve import DispatchFlags

    shared = {f.name for f in dataclasses.fields(DispatchFlags)}
    kw = dict(decisions_kept=10, max_body_bytes=1 << 20, api_key=None)
    kw.update({n: v for n, v in over.items() if n not in shared})
    flags = {"engine": ["http://127.0.0.1:1"], **{n: v for n, v in over.items() if n in shared}}
    return {"flags": DispatchFlags(**flags), **kw}
