"""Small factories shared by the RPS tests (hand-made profile, requests)."""

from __future__ import annotations

from rps_astro_cli.sim.profile import ExecutionProfile, VisionCosts
from rps_astro_cli.sim.request import SimRequest


def hand_profile(**over) -> ExecutionProfile:
    """step_s = 0.01 + 0.0001 · tokens (per_seq 0, no attention terms): linear_s knots
    (1 → 0.0001 s, 1000 → 0.1 s) give slope 0.0999/999 = 0.0001 s per token.
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
    return SimRequest(request_id=rid, arrival_s=arrival_s, prompt_tokens=prompt, target_output_tokens=out,
                      modality=modality, req_class=cls, **kw)
