"""Execution-time profiles: how long one engine step takes for a given batch shape.

Model (per (model, GPU, TP); coefficients fitted from Vidur-schema GPU profiling CSVs,
see each profile file's `sources` and `fit` fields):

    step_s = base_s + per_seq_s * batch_size + linear_s(num_tokens)            # memoized
             + decode_attn_s_per_ctx_token * (context tokens read by decodes)
             + prefill_attn_s_per_token_pair * (attention pairs of prefill chunks)
             + encoder_s of multimodal requests whose first prefill chunk is in the step

`linear_s(num_tokens)` is a piecewise-linear table over token counts (the GEMM-bound
linear layers: QKV/out projections, MLP, norms; all-reduce for TP>1), extrapolated
linearly past the last knot. The first three terms depend only on (batch size, token
count) and are memoized by that pair, as the Astrolabe paper's predictor does (§4).

A prefill chunk of `c` new tokens after `k` already-computed tokens contributes
`c*k + c*(c+1)/2` attention pairs (each new token attends to all earlier ones and
itself).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rps_astro_cli.data_paths import ARTIFACTS_DIR
from rps_astro_cli.errors import AstroUserError

PROFILES_DIR = ARTIFACTS_DIR / "profiles"
DEFAULT_PROFILE_ID = "llama-2-7b-a30"


@dataclass(frozen=True)
class VisionCosts:
    """Per-item costs of multimodal inputs (LLaVA-style models).

    tokens_per_image: vision tokens one image adds to the prompt (tokens).
    tokens_per_frame: vision tokens one video frame adds (tokens).
    preprocess_s_per_image / preprocess_s_per_frame: CPU preprocessing before the request
        reaches the scheduler (seconds).
    encoder_s_per_image / encoder_s_per_frame: vision-encoder GPU time, added to the step
        holding the request's first prefill chunk (seconds).
    image_tokens_rule: how an image's size becomes vision tokens — "fixed" (every image
        `tokens_per_image`, the size ignored) or "anyres" (LLaVA-OneVision's AnyRes-max
        rule, `anyres_tokens`; model-specific, so it lives here, not in the workload).
    anyres_*: that rule's constants (LLaVA-OneVision-7B: 384-px SigLIP crops of 27 × 27
        patches, grids up to 6 × 6 crops, features pooled down to ≤ 9 crops' worth).
    tokens_per_video: tokens a video adds besides its frames (LLaVA-OneVision: 1 newline).
    """

    tokens_per_image: int
    tokens_per_frame: int
    preprocess_s_per_image: float
    preprocess_s_per_frame: float
    encoder_s_per_image: float
    encoder_s_per_frame: float
    image_tokens_rule: str = "fixed"
    anyres_crop_px: int = 384
    anyres_patches_per_side: int = 27
    anyres_max_grid: int = 6
    anyres_max_crops: int = 9
    tokens_per_video: int = 0

    def __post_init__(self) -> None:
        if self.image_tokens_rule not in ("fixed", "anyres"):
            raise AstroUserError(f"unknown image_tokens_rule {self.image_tokens_rule!r}",
                                 field="vision.image_tokens_rule", fix="use fixed or anyres")

    def to_dict(self) -> dict[str, Any]:
        """The profile JSON's "vision" object; the size-rule fields only when they differ
        from the defaults (a fixed-rule profile's file keeps its six fields)."""
        d = dict(self.__dict__)
        for name in ("image_tokens_rule", "anyres_crop_px", "anyres_patches_per_side", "anyres_max_grid",
                     "anyres_max_crops", "tokens_per_video"):
            if d[name] == VisionCosts.__dataclass_fields__[name].default and self.image_tokens_rule == "fixed":
                del d[name]
        return d

    def image_tokens(self, width_px: int = 0, height_px: int = 0) -> int:
        """Vision tokens of one image of `width_px` × `height_px` (0 × 0 = size unknown:
        `tokens_per_image`)."""
        if self.image_tokens_rule == "fixed" or width_px <= 0 or height_px <= 0:
            return self.tokens_per_image
        return anyres_tokens(width_px, height_px, self.anyres_crop_px, self.anyres_patches_per_side,
                             self.anyres_max_grid, self.anyres_max_crops)

    def video_tokens(self, num_frames: int) -> int:
        """Vision tokens of one video sampled at `num_frames` frames."""
        return num_frames * self.tokens_per_frame + (self.tokens_per_video if num_frames > 0 else 0)


def anyres_tokens(width_px: int, height_px: int, crop_px: int = 384, patches: int = 27, max_grid: int = 6,
                  max_crops: int = 9) -> int:
    """LLaVA-OneVision's AnyRes-max image tokens (the rule of its image processor; facts
    from the LLaVA-OneVision paper §3 and the Hugging Face processor's feature count):

    1. the grid (rows × cols of `crop_px` crops, 1…`max_grid` each) whose scaled-down
       image keeps the most pixels (ties: the least padding) is chosen;
    2. the grid's feature map (rows·patches × cols·patches) is cropped to the image's
       aspect ratio (padding removed);
    3. if that exceeds `max_crops` crops' worth of patches by more than 10 %, both sides
       are divided by the ratio (pooling);
    4. tokens = that map + one newline token per row + one base crop (patches²).

    640 × 480 (the most common COCO size) → 2,929 tokens.
    """
    best: tuple[int, int] | None = None
    best_eff, best_waste = -1, 0
    for rows in range(1, max_grid + 1):
        for cols in range(1, max_grid + 1):
            h, w = rows * crop_px, cols * crop_px
            scale = min(w / width_px, h / height_px)
            eff = min(int(width_px * scale) * int(height_px * scale), width_px * height_px)
            waste = w * h - eff
            if eff > best_eff or (eff == best_eff and waste < best_waste):
                best, best_eff, best_waste = (rows, cols), eff, waste
    assert best is not None
    cur_h, cur_w = best[0] * patches, best[1] * patches
    if width_px / height_px > cur_w / cur_h:
        new_h = int(round(height_px * (cur_w / width_px), 7))
        cur_h -= 2 * ((cur_h - new_h) // 2)
    else:
        new_w = int(round(width_px * (cur_h / height_px), 7))
        cur_w -= 2 * ((cur_w - new_w) // 2)
    feats, newlines = cur_h * cur_w, cur_h
    ratio = math.sqrt(cur_h * cur_w / (max_crops * patches * patches))
    if ratio > 1.1:
        feats = int(cur_h // ratio) * int(cur_w // ratio)
        newlines = int(cur_h // ratio)
    return feats + newlines + patches * patches


@dataclass(frozen=True)
class OutputLengthDist:
    """Output-length distribution used when the engine is not told a request's length:
    lognormal(mu, sigma) of tokens, clipped to [1, max_tokens]."""

    mu: float = 5.3
    sigma: float = 1.0
    max_tokens: int = 2048


@dataclass(frozen=True)
class ExecutionProfile:
    """Step-latency coefficients and default instance limits for one (model, GPU, TP).

    All times are seconds. Loaded from `artifacts/profiles/<profile_id>.json`.
    """

    profile_id: str
    model: str
    gpu: str
    tp: int
    base_s: float
    per_seq_s: float
    token_knots: tuple[int, ...]
    token_s: tuple[float, ...]
    decode_attn_s_per_ctx_token: float
    prefill_attn_s_per_token_pair: float
    block_size: int = 16
    num_gpu_blocks: int = 1056
    max_num_seqs: int = 48
    max_num_batched_tokens: int = 512
    max_model_len: int = 4096
    vision: VisionCosts | None = None
    output_len: OutputLengthDist = field(default_factory=OutputLengthDist)
    sources: dict[str, Any] = field(default_factory=dict, compare=False)
    fit: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if len(self.token_knots) != len(self.token_s) or len(self.token_knots) < 2:
            raise AstroUserError(
                "token_knots and token_s must have the same length ≥ 2",
                field=f"profile {self.profile_id}: token_knots",
            )
        if list(self.token_knots) != sorted(set(self.token_knots)):
            raise AstroUserError(
                "token_knots must be strictly increasing",
                field=f"profile {self.profile_id}: token_knots",
            )

    # -- latency -----------------------------------------------------------------
    def linear_s(self, num_tokens: int) -> float:
        """Linear-layer time for `num_tokens` tokens in one step (seconds)."""
        knots, vals = self.token_knots, self.token_s
        if num_tokens <= knots[0]:
            return vals[0]
        i = bisect.bisect_left(knots, num_tokens)
        if i >= len(knots):
            i = len(knots) - 1
        x0, x1 = knots[i - 1], knots[i]
        y0, y1 = vals[i - 1], vals[i]
        return y0 + (y1 - y0) * (num_tokens - x0) / (x1 - x0)

    def shape_s(self, batch_size: int, num_tokens: int) -> float:
        """The (batch size, token count) part of a step's latency (seconds); use
        `LatencyModel.shape_s` for the memoized version."""
        return self.base_s + self.per_seq_s * batch_size + self.linear_s(num_tokens)

    # -- io ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExecutionProfile:
        """Build from the JSON schema written by the profile fitter.

        Raises:
            AstroUserError: a required field is missing or has the wrong type.
        """
        pid = d.get("profile_id", "?")
        try:
            vision = VisionCosts(**d["vision"]) if d.get("vision") else None
            out = OutputLengthDist(**d["output_len"]) if d.get("output_len") else OutputLengthDist()
            lim = d.get("limits", {})
            c = d["coefficients"]
            return cls(
                profile_id=d["profile_id"],
                model=d["model"],
                gpu=d["gpu"],
                tp=int(d.get("tp", 1)),
                base_s=float(c["base_s"]),
                per_seq_s=float(c["per_seq_s"]),
                token_knots=tuple(int(x) for x in c["token_knots"]),
                token_s=tuple(float(x) for x in c["token_s"]),
                decode_attn_s_per_ctx_token=float(c["decode_attn_s_per_ctx_token"]),
                prefill_attn_s_per_token_pair=float(c["prefill_attn_s_per_token_pair"]),
                block_size=int(lim.get("block_size", 16)),
                num_gpu_blocks=int(lim.get("num_gpu_blocks", 1056)),
                max_num_seqs=int(lim.get("max_num_seqs", 48)),
                max_num_batched_tokens=int(lim.get("max_num_batched_tokens", 512)),
                max_model_len=int(lim.get("max_model_len", 4096)),
                vision=vision,
                output_len=out,
                sources=d.get("sources", {}),
                fit=d.get("fit", {}),
            )
        except KeyError as exc:
            raise AstroUserError(
                f"profile {pid} lacks field {exc.args[0]!r}", field="profile",
                fix="regenerate it with `astro profiles fit`",
            ) from None
        except (TypeError, ValueError) as exc:
            if isinstance(exc, AstroUserError):
                raise
            raise AstroUserError(f"profile {pid} is malformed: {exc}", field="profile") from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON schema `from_dict` reads."""
        d: dict[str, Any] = {
            "profile_id": self.profile_id,
            "model": self.model,
            "gpu": self.gpu,
            "tp": self.tp,
            "coefficients": {
                "base_s": self.base_s,
                "per_seq_s": self.per_seq_s,
                "token_knots": list(self.token_knots),
                "token_s": list(self.token_s),
                "decode_attn_s_per_ctx_token": self.decode_attn_s_per_ctx_token,
                "prefill_attn_s_per_token_pair": self.prefill_attn_s_per_token_pair,
            },
            "limits": {
                "block_size": self.block_size,
                "num_gpu_blocks": self.num_gpu_blocks,
                "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "max_model_len": self.max_model_len,
            },
            "output_len": self.output_len.__dict__,
            "sources": self.sources,
            "fit": self.fit,
        }
        if self.vision:
            d["vision"] = self.vision.to_dict()
        return d


def _factor_tag(x: float) -> str:
    """A factor in a profile id without dots (a dot would make the id read as a file path)."""
    return f"{x:g}".replace(".", "p").replace("-", "m")


def scaled_profile(base: ExecutionProfile, *, prefill: float = 1.0, decode: float = 1.0, per_seq: float = 1.0,
                   shape: float = 1.0, bend: float = 0.0, profile_id: str | None = None) -> ExecutionProfile:
    """A copy of `base` for hardware it was not fitted on ("hardware astro never
    profiled", issue 31): each term of the step model scaled on its own, and the
    linear-layer curve bent rather than only scaled —

        prefill_attn_s_per_token_pair × prefill
        decode_attn_s_per_ctx_token   × decode
        per_seq_s                     × per_seq
        base_s                        × shape
        token_s[i] × shape × (1 + bend · log2(knot_i) / log2(last knot))

    (bend > 0: big steps slower relative to small ones; the first knot, 1 token, keeps
    `shape`, the last gets shape × (1 + bend)). Limits, vision costs and the output-length
    distribution stay the base's. The copy's `profile_id` is `profile_id`, else
    BASE-scaled-pf…-dc…-ps…-sh…-bd… (the factors, "." written "p"); its `fit` holds only
    `scaled_from` (the base id and the factors: the base's held-out errors are not this
    profile's), its `sources` the base's plus a `scaled` note.

    Raises:
        AstroUserError: a factor that is not finite and > 0, or bend ≤ -1 (a knot's time
            would not be positive); field named by the factor.
    """
    for name, v in (("prefill", prefill), ("decode", decode), ("per_seq", per_seq), ("shape", shape)):
        if not (math.isfinite(v) and v > 0):
            raise AstroUserError(f"must be a finite number > 0, got {v}", field=name,
                                 fix="pass a factor such as 1.3 for 30 % slower, or 0.7")
    if not (math.isfinite(bend) and bend > -1):
        raise AstroUserError(f"must be a finite number > -1, got {bend}", field="bend",
                             fix="pass e.g. 0.2 for the largest steps 20 % slower than small ones, or 0 for none")
    last = math.log2(max(base.token_knots[-1], 1))
    token_s = tuple(v * shape * (1.0 + (bend * math.log2(max(k, 1)) / last if last > 0 else 0.0))
                    for k, v in zip(base.token_knots, base.token_s))
    factors = {"prefill": prefill, "decode": decode, "per_seq": per_seq, "shape": shape, "bend": bend}
    pid = profile_id or (f"{base.profile_id}-scaled-pf{_factor_tag(prefill)}-dc{_factor_tag(decode)}"
                         f"-ps{_factor_tag(per_seq)}-sh{_factor_tag(shape)}-bd{_factor_tag(bend)}")
    note = (f"scaled copy of {base.profile_id} (astro profiles scale): prefill attention x{prefill:g}, decode "
            f"attention x{decode:g}, per-sequence x{per_seq:g}, base and linear curve x{shape:g}, linear curve "
            f"bent by (1 + {bend:g} log2(tokens)/log2({base.token_knots[-1]})); not measured on any hardware")
    return replace(
        base, profile_id=pid, base_s=base.base_s * shape, per_seq_s=base.per_seq_s * per_seq, token_s=token_s,
        decode_attn_s_per_ctx_token=base.decode_attn_s_per_ctx_token * decode,
        prefill_attn_s_per_token_pair=base.prefill_attn_s_per_token_pair * prefill,
        sources={**base.sources, "scaled": note},
        fit={"scaled_from": {"profile_id": base.profile_id, **factors}})


def list_profiles() -> list[str]:
    """Profile ids shipped in `artifacts/profiles/`."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def profile_path(name_or_path: str | Path) -> Path:
    """The file a profile reference names: a path with a suffix as given, else the
    shipped `artifacts/profiles/<id>.json` (which may not exist)."""
    path = Path(name_or_path)
    return path if path.suffix else PROFILES_DIR / f"{name_or_path}.json"


def load_profile(name_or_path: str | Path | None = None) -> ExecutionProfile:
    """Load a profile by id (from `artifacts/profiles/`) or by JSON file path.

    Raises:
        AstroUserError: no such profile, or the file is not valid JSON / schema.
    """
    name = str(name_or_path or DEFAULT_PROFILE_ID)
    path = profile_path(name)
    if not path.is_file():
        raise AstroUserError(
            f"no profile {name!r}", field="profile",
            fix=f"use a JSON file path or one of: {', '.join(list_profiles()) or '(none shipped)'}",
        )
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AstroUserError(f"{path} is not valid JSON: {exc}", field="profile") from None
    return ExecutionProfile.from_dict(d)
