"""Model and GPU facts a profile is built from (`ModelShape`, `GpuSpec`) and what
follows from them alone: KV blocks per GPU, the LM head's roofline."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """Architecture facts a profile needs (from each model's Hugging Face config.json).

    num_layers: decoder layers; hidden: model width; n_q_heads / n_kv_heads / head_dim:
    attention heads; vocab: LM-head rows; params: total parameters (weights bytes =
    2 × params in FP16).
    """

    name: str
    num_layers: int
    hidden: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    params: float

    def kv_bytes_per_token_per_layer(self, tp: int = 1) -> float:
        """FP16 K and V bytes one token adds per layer on one GPU: 2 × kv_heads/tp ×
        head_dim × 2 bytes (= 2 × hidden × 2 for multi-head attention)."""
        return 2.0 * (self.n_kv_heads / tp) * self.head_dim * 2.0

    def kv_bytes_per_token(self, tp: int = 1) -> float:
        """FP16 KV bytes per token over all layers on one GPU."""
        return self.num_layers * self.kv_bytes_per_token_per_layer(tp)

    def q_width(self, tp: int = 1) -> float:
        """Query width per GPU (n_q_heads/tp × head_dim): prefill attention FLOPs per
        token pair per layer are 4 × this."""
        return self.n_q_heads / tp * self.head_dim


LLAMA2_7B = ModelShape("meta-llama/Llama-2-7b-hf", 32, 4096, 32, 32, 128, 32000, 6.74e9)
LLAMA2_70B = ModelShape("meta-llama/Llama-2-70b-hf", 80, 8192, 64, 8, 128, 32000, 68.98e9)
QWEN2_7B = ModelShape("Qwen/Qwen2-7B", 28, 3584, 28, 4, 128, 152064, 7.62e9)
# LLaVA-OneVision-7B = SigLIP-400M vision tower + projector + Qwen2-7B; 8.03e9 params total.
LLAVA_OV_7B = ModelShape("llava-hf/llava-onevision-qwen2-7b-ov-hf", 28, 3584, 28, 4, 128, 152064, 8.03e9)


@dataclass(frozen=True)
class GpuSpec:
    """GPU facts from NVIDIA datasheets: memory (GiB, rounded), peak HBM bandwidth
    (bytes/s) and dense FP16 tensor-core peak (FLOP/s; also Vidur's device SKU configs)."""

    name: str
    memory_gib: float
    bandwidth_bps: float
    fp16_flops: float


A30 = GpuSpec("A30-24GB", 24.0, 933e9, 165e12)
A100_80 = GpuSpec("A100-80GB", 80.0, 2039e9, 312e12)
A100_40 = GpuSpec("A100-40GB", 40.0, 1555e9, 312e12)


def num_gpu_blocks(gpu: GpuSpec, model: ModelShape, tp: int = 1, block_size: int = 16,
                   utilization: float = 0.9, extra_weights: float = 0.0) -> tuple[int, str]:
    """KV blocks per GPU from memory left after FP16 weights (vLLM's
    gpu_memory_utilization rule, ignoring activation memory):
    floor((util × memory − 2·params/tp) / (kv_bytes_per_token(tp) × block_size)).

    Returns (blocks, formula text)."""
    mem = utilization * gpu.memory_gib * GIB
    weights = 2.0 * (model.params + extra_weights) / tp
    per_block = model.kv_bytes_per_token(tp) * block_size
    blocks = int((mem - weights) // per_block)
    txt = (f"floor(({utilization} × {gpu.memory_gib} GiB − 2 B × {model.params + extra_weights:.4g} params / TP{tp}) "
           f"/ ({model.kv_bytes_per_token(tp):.0f} KV bytes/token × {block_size})) = {blocks}")
    return blocks, txt


def lm_head_s(model: ModelShape, gpu: GpuSpec, tp: int = 1) -> float:
    """Roofline of the (unprofiled) LM head per step: its FP16 weights read once,
    vocab × hidden × 2 bytes / tp / bandwidth (seconds)."""
    return model.vocab * model.hidden * 2.0 / tp / gpu.bandwidth_bps
