"""Assembling an `ExecutionProfile` from the fitted terms (`assemble`), and what a
profile predicts for one request alone (`isolated_ttft_s`)."""

from __future__ import annotations

from typing import Any

from rps_astro_cli.profiling.attention import AttentionFit, attention_sources
from rps_astro_cli.profiling.fitting import HOLDOUT_FRAC
from rps_astro_cli.profiling.hardware import GpuSpec, ModelShape, lm_head_s
from rps_astro_cli.profiling.linear_layers import LinearFit
from rps_astro_cli.sim.profile import ExecutionProfile, OutputLengthDist, VisionCosts

CPU_BASE_S = 0.003
CPU_PER_SEQ_S = 0.00005
CPU_SOURCE = (
    "ASSUMED, not in the CSVs (Vidur's compute CSVs time GPU kernels only): vLLM's CPU work per "
    "engine step (scheduling, input preparation, sampling, output processing) = 3 ms per step + "
    "0.05 ms per scheduled request. Basis: 'a few ms' per step is the order reported for vLLM "
    "(Srivatsa et al., WukLab 2024, mlsys.wuklab.io/posts/scheduling_overhead: scheduling overhead "
    "can exceed half of vLLM's inference time for small models; vLLM V1's redesign targets this), "
    "and Vidur models the same costs as cpu_overhead ops linear in batch size. Not validated here."
)


def assemble(
    *, profile_id: str, model: ModelShape, gpu: GpuSpec, tp: int, lin: LinearFit, att: AttentionFit,
    dec_scale: float, pre_scale: float, att_note: str, limits: dict[str, int],
    blocks_txt: str, output_len: OutputLengthDist | None, out_src: dict[str, Any] | None,
    vision: VisionCosts | None = None, vision_src: dict[str, Any] | None = None,
    extra_sources: dict[str, Any] | None = None, extra_fit: dict[str, Any] | None = None,
) -> ExecutionProfile:
    L = model.num_layers
    lm = lm_head_s(model, gpu, tp)
    base = CPU_BASE_S + lm + att.a_ms * L / 1000.0
    per_seq = CPU_PER_SEQ_S + max(att.p_ms, 0.0) * L / 1000.0
    dec = max(att.d_ms, 0.0) * dec_scale * L / 1000.0
    pre = max(att.q_ms, 0.0) * pre_scale * L / 1000.0
    sources: dict[str, Any] = {
        "token_knots/token_s": lin.sources,
        "base_s": {
            "formula": "cpu_base + lm_head + decode-attention intercept a × layers",
            "cpu_base_s": CPU_BASE_S, "cpu_source": CPU_SOURCE,
            "lm_head_s": lm,
            "lm_head_source": f"roofline (not in the CSVs): vocab {model.vocab} × hidden {model.hidden} "
            f"× 2 B / TP{tp} / "
            f"{gpu.bandwidth_bps / 1e9:.0f} GB/s ({gpu.name} datasheet)",
            "attn_intercept_s": att.a_ms * L / 1000.0,
        },
        "per_seq_s": {
            "formula": "cpu_per_seq + decode-attention per-request term p × layers",
            "cpu_per_seq_s": CPU_PER_SEQ_S, "attn_per_seq_s": max(att.p_ms, 0.0) * L / 1000.0,
        },
        **attention_sources(att, L, dec_scale, pre_scale, att_note),
        "num_gpu_blocks": blocks_txt,
        "model_shape": model.__dict__,
        "gpu": gpu.__dict__,
    }
    if out_src:
        sources["output_len"] = out_src
    if vision_src:
        sources["vision"] = vision_src
    if extra_sources:
        sources.update(extra_sources)
    fit: dict[str, Any] = {
        "holdout": f"seeded numpy Generator, {int(HOLDOUT_FRAC * 100)}% of rows per CSV held out",
        **lin.error,
        "attention": {
            **att.error,
            "measured_on": att.file + (" (this profile's own data)" if not att_note else
                                       " — transferred to this profile, transfer not validated: " + att_note),
        },
    }
    if extra_fit:
        fit.update(extra_fit)
    return ExecutionProfile(
        profile_id=profile_id, model=model.name, gpu=gpu.name, tp=tp,
        base_s=base, per_seq_s=per_seq,
        token_knots=tuple(lin.knots), token_s=tuple(v / 1000.0 for v in lin.values_ms),
        decode_attn_s_per_ctx_token=dec, prefill_attn_s_per_token_pair=pre,
        vision=vision, output_len=output_len or OutputLengthDist(),
        sources=sources, fit=fit, **limits,
    )


ASTROLABE_LIMITS = {"block_size": 16, "max_num_seqs": 48, "max_num_batched_tokens": 512, "max_model_len": 4096}


def isolated_ttft_s(p: ExecutionProfile, text_tokens: int, images: int = 0, frames: int = 0) -> float:
    """TTFT (s) of one request alone on an idle instance under this profile: CPU
    preprocessing + chunked prefill of text + vision tokens (chunks of
    max_num_batched_tokens, each step = shape_s + prefill attention; the vision encoder
    time is charged to the first chunk's step)."""
    v = p.vision
    vis_tokens = (images * v.tokens_per_image + frames * v.tokens_per_frame) if v else 0
    pre = (images * v.preprocess_s_per_image + frames * v.preprocess_s_per_frame) if v else 0.0
    enc = (images * v.encoder_s_per_image + frames * v.encoder_s_per_frame) if v else 0.0
    total = text_tokens + vis_tokens
    t, done = pre, 0
    while done < total:
        c = min(p.max_num_batched_tokens, total - done)
        t += p.shape_s(1, c) + p.prefill_attn_s_per_token_pair * (c * done + c * (c + 1) / 2)
        if done == 0:
            t += enc
        done += c
    return t
