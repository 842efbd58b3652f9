"""The bodies of astro's own service wires, and the one JSON codec both ends of each use
(the encoder and the decoder of each body live side by side here, so the two ends cannot
drift apart):

- scheduler → Predictor `POST /predict`: `PredictRequest.to_dict` / `.from_dict`
  (a `types.CandidateRequest` plus the objective and the `PendingRequest`s); the answer
  `PredictReply.to_dict` / `.from_dict`, whose `estimate()` is the `types.LatencyEstimate`
  the dispatch policy sees.
- tagger `POST /tag` → scheduler: `TagResult.to_dict` / `.from_dict`.

The engine's `/status` body and the scheduler's `/decisions` records are `types.py`'s
(the simulator and the dispatch policies read them too). Decoders raise `AstroUserError`
naming the offending field (or, for an answer, KeyError / TypeError / ValueError);
services turn it into a 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.types import MODALITIES, OBJECTIVES, CandidateRequest, LatencyEstimate


@dataclass(frozen=True, slots=True)
class PendingRequest:
    """A request the scheduler has sent to an instance that its engine's `/status` may not
    show yet (issue 13 §2, "dispatched but not yet visible"). Ages are seconds before the
    `/predict` call, on the scheduler's clock, so both ends only compare durations.

    JSON: {"prompt_tokens": int ≥ 1, "predicted_output_tokens": int ≥ 1, "sent_age_s": s ≥ 0,
    "accepted_age_s": s ≥ 0 | null}.
    """

    # prompt length, vision tokens included (tokens, ≥ 1)
    prompt_tokens: int
    # the tagger's (or the oracle's) output length (tokens, ≥ 1)
    predicted_output_tokens: int
    # seconds since the scheduler forwarded it to the engine
    sent_age_s: float
    # seconds since the engine answered the forward (it holds the request since then);
    # None while that answer has not come
    accepted_age_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "predicted_output_tokens": self.predicted_output_tokens,
                "sent_age_s": self.sent_age_s, "accepted_age_s": self.accepted_age_s}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "pending") -> PendingRequest:
        """Parse one entry of a `/predict` body's "pending" list.

        Raises:
            AstroUserError: a field is missing or malformed (`field` names the list).
        """
        if not isinstance(d, Mapping):
            raise AstroUserError(f"{where}: each entry must be an object", field="pending")
        acc = d.get("accepted_age_s")
        if acc is not None and (isinstance(acc, bool) or not isinstance(acc, (int, float)) or acc < 0):
            raise AstroUserError(f"{where}: accepted_age_s must be a number ≥ 0 or null, got {acc!r}",
                                 field="pending")
        try:
            return cls(_int(d, "prompt_tokens", None, 1), _int(d, "predicted_output_tokens", None, 1),
                       _seconds(d, "sent_age_s"), None if acc is None else float(acc))
        except AstroUserError as exc:
            raise AstroUserError(f"{where}: {exc}", field="pending") from None


@dataclass(frozen=True, slots=True)
class PredictRequest:
    """A `POST /predict` body: the candidate's fields at the top level plus `objective`.

    JSON: {"prompt_tokens": int ≥ 1, "predicted_output_tokens": int ≥ 1, "modality":
    "text"|"image"|"video" = "text", "vision_tokens": int ≥ 0 = 0, "encoder_s": s ≥ 0 = 0,
    "preprocess_s": s ≥ 0 = 0, "req_class": str|null (omitted when null), "deadline_s":
    s|null (omitted when null), "objective": "e2e"|"ttft" = "e2e", "first_token_only":
    bool = false (omitted when false), "pending": [PendingRequest...] (omitted when empty)}.
    """

    # the request being placed
    candidate: CandidateRequest
    # which of its predicted latencies the caller ranks by: "e2e" or "ttft"
    objective: str = "e2e"
    # requests the scheduler sent to this instance that its /status may not show yet
    pending: tuple[PendingRequest, ...] = ()
    # the look-ahead may stop at the candidate's first token (`lookahead.predict`): the
    # caller reads only its TTFT, and the reply's e2e_s then equals its ttft_s
    first_token_only: bool = False

    def to_dict(self) -> dict[str, Any]:
        c = self.candidate
        d: dict[str, Any] = {
            "prompt_tokens": c.prompt_tokens,
            "predicted_output_tokens": c.predicted_output_tokens,
            "modality": c.modality,
            "vision_tokens": c.vision_tokens,
            "encoder_s": c.encoder_s,
            "preprocess_s": c.preprocess_s,
        }
        if c.req_class is not None:
            d["req_class"] = c.req_class
        if c.deadline_s is not None:
            d["deadline_s"] = c.deadline_s
        if c.cached_tokens:
            d["cached_tokens"] = c.cached_tokens
        d["objective"] = self.objective
        if self.first_token_only:
            d["first_token_only"] = True
        if self.pending:
            d["pending"] = [p.to_dict() for p in self.pending]
        return d

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> PredictRequest:
        """Parse and validate a `/predict` body.

        Raises:
            AstroUserError: a field is missing or malformed (`field` names it).
        """
        modality = body.get("modality", "text")
        if modality not in MODALITIES:
            raise AstroUserError(f"modality must be one of {', '.join(MODALITIES)}, got {modality!r}",
                                 field="modality")
        objective = body.get("objective", "e2e")
        if objective not in OBJECTIVES:
            raise AstroUserError(f"objective must be 'e2e' or 'ttft', got {objective!r}", field="objective")
        req_class = body.get("req_class")
        if req_class is not None and not isinstance(req_class, str):
            raise AstroUserError("req_class must be a string or null", field="req_class")
        deadline_s = body.get("deadline_s")
        if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))):
            raise AstroUserError(f"deadline_s must be a number or null, got {deadline_s!r}", field="deadline_s")
        cand = CandidateRequest(
            prompt_tokens=_int(body, "prompt_tokens", None, 1),
            predicted_output_tokens=_int(body, "predicted_output_tokens", None, 1),
            modality=modality,
            vision_tokens=_int(body, "vision_tokens", 0, 0),
            encoder_s=_seconds(body, "encoder_s"),
            preprocess_s=_seconds(body, "preprocess_s"),
            req_class=req_class,
            deadline_s=None if deadline_s is None else float(deadline_s),
            cached_tokens=_int(body, "cached_tokens", 0, 0),
        )
        raw = body.get("pending") or ()
        if not isinstance(raw, (list, tuple)):
            raise AstroUserError("pending must be a list of objects", field="pending")
        pending = tuple(PendingRequest.from_dict(p, f"pending[{i}]") for i, p in enumerate(raw))
        first_token_only = body.get("first_token_only", False)
        if not isinstance(first_token_only, bool):
            raise AstroUserError(f"first_token_only must be true or false, got {first_token_only!r}",
                                 field="first_token_only")
        return cls(cand, objective, pending, first_token_only)


def _int(body: Mapping[str, Any], name: str, default: int | None, minimum: int) -> int:
    v = body.get(name, default)
    if v is None:
        raise AstroUserError(f"missing field {name!r}", field=name)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise AstroUserError(f"{name} must be an integer ≥ {minimum}, got {v!r}", field=name)
    return v


def _seconds(body: Mapping[str, Any], name: str) -> float:
    v = body.get(name, 0.0)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
        raise AstroUserError(f"{name} must be a number ≥ 0, got {v!r}", field=name)
    return float(v)


@dataclass(frozen=True, slots=True)
class PredictReply:
    """A `POST /predict` answer.

    JSON: {"ttft_s", "e2e_s", "objective_s", "snapshot_age_s", "lookahead_us",
    "instance_id", "trusted", "model_ape"}.
    """

    # predicted TTFT from the snapshot time (s)
    ttft_s: float
    # predicted E2E from the snapshot time (s)
    e2e_s: float
    # the requested objective's value (s)
    objective_s: float
    # how old the engine status the prediction used was (s)
    snapshot_age_s: float
    # look-ahead compute time (µs)
    lookahead_us: float
    # the instance the Predictor predicts for
    instance_id: str
    # the Predictor's step model is trusted (`sim.calibration`: its recent error is under
    # the bound); False: the dispatch compares this instance by load instead
    trusted: bool = True
    # the model's recent median step error (fraction; None: not measured)
    model_ape: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ttft_s": self.ttft_s,
            "e2e_s": self.e2e_s,
            "objective_s": self.objective_s,
            "snapshot_age_s": self.snapshot_age_s,
            "lookahead_us": self.lookahead_us,
            "instance_id": self.instance_id,
            "trusted": self.trusted,
            "model_ape": self.model_ape,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PredictReply:
        """Parse a `/predict` answer.

        Raises:
            KeyError / TypeError / ValueError: `ttft_s` or `e2e_s` missing or not a number.
        """
        ttft, e2e = float(d["ttft_s"]), float(d["e2e_s"])
        ape = d.get("model_ape")
        return cls(ttft, e2e, float(d.get("objective_s", e2e)), float(d.get("snapshot_age_s", 0.0)),
                   float(d.get("lookahead_us", 0.0)), str(d.get("instance_id", "")),
                   d.get("trusted", True) is not False, None if ape is None else float(ape))

    def estimate(self) -> LatencyEstimate:
        """The TTFT/E2E as a `LatencyEstimate` (step counts are not on the wire: 0)."""
        return LatencyEstimate(self.ttft_s, self.e2e_s, 0, 0)


@dataclass(frozen=True, slots=True)
class TagResult:
    """The tagger's answer for one OpenAI request body.

    JSON: the field names below, in this order.
    """

    # the length model's predicted output length (tokens, ≥ 1)
    predicted_output_tokens: int
    # text tokens + vision tokens (tokens)
    prompt_tokens: int
    # prompt text tokens (tokens)
    text_tokens: int = 0
    # prompt tokens that come from media (tokens)
    vision_tokens: int = 0
    # "text" / "image" / "video"
    modality: str = "text"
    # images in the request (count)
    num_images: int = 0
    # video frames in the request (count)
    num_frames: int = 0
    # vision-encoder time on the profile (s)
    encoder_s: float = 0.0
    # CPU preprocessing time on the profile (s)
    preprocess_s: float = 0.0
    # which length model predicted
    length_model: str = ""
    # time the tagger spent (µs)
    tag_us: float = 0.0
    # the predicted length's 10th / 50th / 90th percentiles (tokens) when the length model
    # has a distribution calibration (`length.dist`), else None (omitted on the wire)
    p10_output_tokens: float | None = None
    p50_output_tokens: float | None = None
    p90_output_tokens: float | None = None

    @property
    def quantiles(self) -> dict[str, float] | None:
        """{"p10", "p50", "p90"} (tokens) when the tagger gave them, else None."""
        if self.p10_output_tokens is None or self.p50_output_tokens is None or self.p90_output_tokens is None:
            return None
        return {"p10": self.p10_output_tokens, "p50": self.p50_output_tokens, "p90": self.p90_output_tokens}

    def to_dict(self) -> dict[str, Any]:
        d = self._base_dict()
        for k in ("p10_output_tokens", "p50_output_tokens", "p90_output_tokens"):
            v = getattr(self, k)
            if v is not None:
                d[k] = v
        return d

    def _base_dict(self) -> dict[str, Any]:
        return {
            "predicted_output_tokens": self.predicted_output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "text_tokens": self.text_tokens,
            "vision_tokens": self.vision_tokens,
            "modality": self.modality,
            "num_images": self.num_images,
            "num_frames": self.num_frames,
            "encoder_s": self.encoder_s,
            "preprocess_s": self.preprocess_s,
            "length_model": self.length_model,
            "tag_us": self.tag_us,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TagResult:
        """Parse a `/tag` answer (only `predicted_output_tokens` and `prompt_tokens` are
        required).

        Raises:
            KeyError / TypeError / ValueError: a required field missing or malformed.
        """
        return cls(
            predicted_output_tokens=int(d["predicted_output_tokens"]),
            prompt_tokens=int(d["prompt_tokens"]),
            text_tokens=int(d.get("text_tokens", 0)),
            vision_tokens=int(d.get("vision_tokens", 0)),
            modality=str(d.get("modality", "text")),
            num_images=int(d.get("num_images", 0)),
            num_frames=int(d.get("num_frames", 0)),
            encoder_s=float(d.get("encoder_s", 0.0)),
            preprocess_s=float(d.get("preprocess_s", 0.0)),
            length_model=str(d.get("length_model", "")),
            tag_us=float(d.get("tag_us", 0.0)),
            p10_output_tokens=_opt_float(d, "p10_output_tokens"),
            p50_output_tokens=_opt_float(d, "p50_output_tokens"),
            p90_output_tokens=_opt_float(d, "p90_output_tokens"),
        )


def _opt_float(d: Mapping[str, Any], key: str) -> float | None:
    v = d.get(key)
    return None if v is None else float(v)


__all__ = ["PendingRequest", "PredictReply", "PredictRequest", "TagResult"]
