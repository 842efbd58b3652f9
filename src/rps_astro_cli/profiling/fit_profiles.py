"""Fit execution-time profiles (`sim/profile.py` step model) from Vidur-schema GPU
profiling CSVs.

Inputs (origins in the data folder's `PROVENANCE.md`, `$ASTRO_DATA_DIR`; schema of microsoft/vidur's profiler):
- compute `mlp.csv`: one row per (num_tokens, num_tensor_parallel_workers) with per-layer,
  per-GPU operator times `time_stats.<op>.median` in milliseconds for the ops
  `attn_pre_proj, attn_post_proj, attn_rope, input_layernorm, post_attention_layernorm,
  mlp_up_proj, mlp_down_proj, mlp_act, add` (once per decoder layer) and `emb` (once per step);
- compute `attention.csv`: per-layer attention kernel times; decode rows (`is_prefill`
  False) have `batch_size` requests each attending `kv_cache_size` tokens; prefill rows have
  one request with a `prefill_chunk_size` chunk after `kv_cache_size` computed tokens;
- network `all_reduce.csv`: all-reduce time by message `size` in bytes.

Fitted terms (all converted to seconds in the profile):
- `linear_s(n)`: sum over the per-layer ops of a continuous piecewise-linear least-squares
  fit on fixed knots, times `num_layers`, plus `emb(n)`, plus the per-token part of the KV
  cache write (`attn_kv_cache_save`), plus for TP>1 two all-reduces per layer of
  `n * hidden * 2` bytes (Vidur's execution-time model: one after attention, one after the
  MLP). Knots without training data nearby are dropped; the summed table is made
  non-decreasing (a step never gets faster with more tokens).
- decode attention: per layer `a + p * batch + d * (batch * kv_cache_size)` by least squares
  weighted by 1/y (relative error); `d * layers` → `decode_attn_s_per_ctx_token`,
  `p * layers` → part of `per_seq_s`, `a * layers` → part of `base_s`.
- prefill attention: per layer `pa + q * pairs` with `pairs = c*k + c*(c+1)/2` (the
  profile's attention-pair count), weighted by 1/y; `q * layers` →
  `prefill_attn_s_per_token_pair`; the intercept (≈ 1 ms per prefill step for Qwen2-7B
  on A30) is reported in `sources` and not modelled.
- `base_s` / `per_seq_s` also carry an ASSUMED CPU overhead (3 ms per step, 0.05 ms per
  request; `CPU_SOURCE`) and the LM head's HBM roofline (not in the CSVs).

Only the Qwen2-7B A30 attention CSV is usable: Llama-2-7B has none here, and the Llama-2-70B
TP4 A100-40GB one implies ~17 TB/s of KV reads (`reject_70b_attention`). Other profiles
scale the Qwen2 fit by KV bytes / bandwidth (decode) and query width / FP16 peak (prefill):
`transfer_attention`, `compare_llama7b_attention`.

Held-out error: a seeded `numpy.random.Generator` per input file holds out 20% of its rows;
the fit uses the other 80% and the error (MAPE in %, MAE in ms) is measured on the held-out
rows, at model level (per-layer time × layers) and written into the profile's `fit`.

Per operator, a reading is excluded when missing, above 3× the median of its 8 nearest
token counts, or below 1/3 of the median of the last 5 accepted readings at smaller token
counts (the CSVs hold runs of bogus 0.0017–0.0019 ms readings where neighbours read
0.1–1 ms); counts are in `fit.rows_excluded_glitch_per_op`.

Run `astro profiles fit --data-dir DIR --out DIR` to regenerate
`artifacts/profiles/*.json`.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.profiling.assembly import ASTROLABE_LIMITS, assemble
from rps_astro_cli.profiling.attention import (
    compare_llama7b_attention,
    fit_attention,
    reject_70b_attention,
    transfer_attention,
)
from rps_astro_cli.profiling.fitting import read_rows
from rps_astro_cli.profiling.hardware import (
    A30,
    A100_40,
    A100_80,
    LLAMA2_7B,
    LLAMA2_70B,
    QWEN2_7B,
    num_gpu_blocks,
)
from rps_astro_cli.profiling.linear_layers import fit_linear_layers
from rps_astro_cli.profiling.llava import build_llava
from rps_astro_cli.sim.profile import ExecutionProfile, OutputLengthDist

__all__ = ["build_profiles", "fit_output_len", "sanity_report", "write_profiles"]


# -------------------------------------------------------------------- other inputs
def fit_output_len(trace_csv: Path, max_tokens: int = 2048) -> tuple[OutputLengthDist, dict[str, Any]]:
    """Lognormal output-length fit: mu, sigma = mean and std of ln(num_decode_tokens).

    Raises:
        AstroUserError: missing file or column.
    """
    rows = read_rows(trace_csv)
    try:
        d = np.array([float(r["num_decode_tokens"]) for r in rows])
    except KeyError:
        raise AstroUserError(f"{trace_csv} lacks column num_decode_tokens", field="trace") from None
    d = d[d >= 1]
    ln = np.log(d)
    dist = OutputLengthDist(mu=round(float(ln.mean()), 4), sigma=round(float(ln.std()), 4), max_tokens=max_tokens)
    src = {
        "file": Path(trace_csv).name,
        "origin": "AKafakA/Astrolabe @ 2e5fad6f : data/trace_data/sharegpt/sharegpt_val_10k_llama2.csv (MIT)",
        "columns": ["num_decode_tokens"],
        "formula": "mu = mean(ln d), sigma = std(ln d) over all rows",
        "rows": int(d.size), "observed_max": int(d.max()), "observed_median": float(np.median(d)),
    }
    return dist, src


def build_profiles(data_dir: Path, seed: int = 0) -> list[ExecutionProfile]:
    """Fit every shipped profile from `data_dir` (holding `profiles/*.csv` and
    `traces/astrolabe_sharegpt_val_10k_llama2.csv`, or those files directly).

    Raises:
        AstroUserError: a needed CSV is missing.
    """
    data_dir = Path(data_dir)
    pdir = data_dir / "profiles" if (data_dir / "profiles").is_dir() else data_dir
    tdir = data_dir / "traces" if (data_dir / "traces").is_dir() else data_dir

    def rng(name: str) -> np.random.Generator:
        # one Generator per input file, so each file's held-out rows do not depend on fit order
        return np.random.default_rng([seed, zlib.crc32(name.encode())])

    out_len, out_src = fit_output_len(tdir / "astrolabe_sharegpt_val_10k_llama2.csv")
    qwen_att = fit_attention(pdir / "astrolabe__a30__Qwen-2-7B__attention.csv", rng("qwen-a30-attention"),
                             QWEN2_7B.num_layers)
    l70_att = fit_attention(pdir / "astrolabe__a100_40gb__Llama-2-70b-hf__attention.csv", rng("llama70b-attention"),
                            LLAMA2_70B.num_layers)

    profiles: list[ExecutionProfile] = []

    # ---- Llama-2-7B on A30 (Astrolabe default) ----
    kv_ratio_l7_q = LLAMA2_7B.kv_bytes_per_token_per_layer() / QWEN2_7B.kv_bytes_per_token_per_layer()
    q_ratio_l7_q = LLAMA2_7B.q_width() / QWEN2_7B.q_width()
    lin_l7_a30 = fit_linear_layers(pdir / "astrolabe__a30__Llama-2-7b-hf__mlp.csv", tp=1, num_layers=32,
                              rng=rng("astrolabe__a30__Llama-2-7b-hf__mlp.csv"),
                                   kv_save_ms_per_token_layer=max(qwen_att.s1_ms, 0.0) * kv_ratio_l7_q)
    comp = compare_llama7b_attention(qwen_att)
    note = (f"Llama-2-7B attention CSV absent: Qwen2-7B A30 fit scaled — decode × KV bytes per token per layer "
            f"({LLAMA2_7B.kv_bytes_per_token_per_layer():.0f}/{QWEN2_7B.kv_bytes_per_token_per_layer():.0f} "
            f"= {kv_ratio_l7_q:.3g}; "
            f"Llama-2 has 32 KV heads, Qwen2 4), prefill × query width ({q_ratio_l7_q:.4g} = 4096/3584). "
            f"Alternatives in sources.llama7b_attention_alternatives.")
    profiles.append(assemble(
        profile_id="llama-2-7b-a30", model=LLAMA2_7B, gpu=A30, tp=1, lin=lin_l7_a30, att=qwen_att,
        dec_scale=kv_ratio_l7_q, pre_scale=q_ratio_l7_q, att_note=note,
        limits={**ASTROLABE_LIMITS, "num_gpu_blocks": 1056},
        blocks_txt="1056: the Astrolabe paper's setup (A30-24GB, Llama-2-7B FP16); the weights-only formula "
        + num_gpu_blocks(A30, LLAMA2_7B)[1] + " (the gap is activation/CUDA-graph memory)",
        output_len=out_len, out_src=out_src, extra_sources={"llama7b_attention_alternatives": comp},
    ))

    # ---- Llama-2-7B on A100-80GB (Vidur data) ----
    rejected = reject_70b_attention(l70_att)
    dec_s, pre_s, att_note = transfer_attention(qwen_att, LLAMA2_7B, 1, A100_80)
    lin_l7_a100 = fit_linear_layers(pdir / "vidur__a100__Llama-2-7b-hf__mlp.csv", tp=1, num_layers=32,
                              rng=rng("vidur__a100__Llama-2-7b-hf__mlp.csv"),
                                    kv_save_ms_per_token_layer=max(qwen_att.s1_ms, 0.0) * dec_s)
    blocks, btxt = num_gpu_blocks(A100_80, LLAMA2_7B)
    profiles.append(assemble(
        profile_id="llama-2-7b-a100", model=LLAMA2_7B, gpu=A100_80, tp=1, lin=lin_l7_a100, att=qwen_att,
        dec_scale=dec_s, pre_scale=pre_s, att_note=att_note,
        limits={**ASTROLABE_LIMITS, "num_gpu_blocks": blocks},
        blocks_txt=btxt + " (GPU memory assumed 80 GiB: Vidur's a100 device SKU is A100-80GB)",
        output_len=out_len, out_src=out_src, extra_sources={"rejected_attention_data": rejected},
    ))

    # ---- Qwen2-7B on A30 ----
    lin_q_a30 = fit_linear_layers(pdir / "astrolabe__a30__Qwen-2-7B__mlp.csv", tp=1, num_layers=28,
                              rng=rng("astrolabe__a30__Qwen-2-7B__mlp.csv"),
                                  kv_save_ms_per_token_layer=max(qwen_att.s1_ms, 0.0))
    blocks, btxt = num_gpu_blocks(A30, QWEN2_7B)
    profiles.append(assemble(
        profile_id="qwen2-7b-a30", model=QWEN2_7B, gpu=A30, tp=1, lin=lin_q_a30, att=qwen_att,
        dec_scale=1.0, pre_scale=1.0, att_note="",
        limits={**ASTROLABE_LIMITS, "num_gpu_blocks": blocks}, blocks_txt=btxt,
        output_len=None, out_src={"note": "default lognormal(5.3, 1.0): no Qwen2 output-length trace here"},
    ))

    # ---- Llama-2-70B TP4 on A100-40GB ----
    dec_s, pre_s, att_note = transfer_attention(qwen_att, LLAMA2_70B, 4, A100_40)
    lin_70 = fit_linear_layers(pdir / "astrolabe__a100_40gb__Llama-2-70b-hf__mlp.csv", tp=4, num_layers=80,
                              rng=rng("astrolabe__a100_40gb__Llama-2-70b-hf__mlp.csv"),
                               hidden=8192, kv_save_ms_per_token_layer=max(qwen_att.s1_ms, 0.0) * dec_s,
                               allreduce_csv=pdir / "astrolabe__network__a100_40gb_pairwise_nvlink__all_reduce.csv")
    blocks, btxt = num_gpu_blocks(A100_40, LLAMA2_70B, tp=4)
    profiles.append(assemble(
        profile_id="llama-2-70b-tp4-a100-40gb", model=LLAMA2_70B, gpu=A100_40, tp=4, lin=lin_70, att=qwen_att,
        dec_scale=dec_s, pre_scale=pre_s, att_note=att_note,
        limits={**ASTROLABE_LIMITS, "num_gpu_blocks": blocks}, blocks_txt=btxt + " (per GPU; KV heads split over TP4)",
        output_len=out_len, out_src=out_src, extra_sources={"rejected_attention_data": rejected},
    ))

    # ---- LLaVA-OneVision-7B on A100-40GB (Qwen2-7B backbone) ----
    profiles.append(build_llava(qwen_att, rejected, lin_q_a30, lin_l7_a30, lin_l7_a100))
    return profiles


def sanity_report(p: ExecutionProfile) -> dict[str, float]:
    """Step latencies (ms) used as sanity checks: decode at batch 1 with 500 context
    tokens, batch 48 with 500 each, and a 512-token prefill chunk from empty."""
    dec1 = p.shape_s(1, 1) + p.decode_attn_s_per_ctx_token * 500
    dec48 = p.shape_s(48, 48) + p.decode_attn_s_per_ctx_token * 500 * 48
    pre512 = p.shape_s(1, 512) + p.prefill_attn_s_per_token_pair * (512 * 513 / 2)
    return {"decode_b1_ctx500_ms": dec1 * 1e3, "decode_b48_ctx500_ms": dec48 * 1e3, "prefill_512_ms": pre512 * 1e3}


def write_profiles(profiles: list[ExecutionProfile], out_dir: Path) -> list[Path]:
    """Write each profile as `<out_dir>/<profile_id>.json` (ExecutionProfile.to_dict)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for p in profiles:
        path = out_dir / f"{p.profile_id}.json"
        path.write_text(json.dumps(p.to_dict(), indent=2, ensure_ascii=False, default=_json_default) + "\n",
                        encoding="utf-8")
        paths.append(path)
    return paths


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
