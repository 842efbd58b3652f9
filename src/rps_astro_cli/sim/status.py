"""The instance status snapshot: what an engine's `GET /status` returns and what the
Predictor simulates forward from. Same schema for the sim engine and the vLLM plugin.

JSON shape (all times in seconds on the engine's clock; `time_s` is "now" there, so a
request's waiting time is `time_s - arrival_s`):

    {"instance_id": str, "time_s": float, "policy": {"name": str, ...},
     "profile_id": str,
     "limits": {"block_size", "num_gpu_blocks", "max_num_seqs",
                "max_num_batched_tokens", "max_model_len", "chunked_prefill"},
     "kv_blocks_free": int, "kv_blocks_total": int,
     "num_preemptions_total": int,
     "running": [RequestStatus...],   # in running (batch) order
     "waiting": [RequestStatus...],   # in queue order (front first)
     "arriving": [RequestStatus...],  # still in multimodal preprocessing; each has
                                      # ready_s, when it joins the queue (optional)
     "classes": {class: {"queue_len", "mean_wait_s", "prefill_backlog_s"}}  # optional
    }
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.sim.instance import InstanceConfig, InstanceSim
from rps_astro_cli.sim.request import SimRequest


@dataclass(frozen=True, slots=True)
class RequestStatus:
    """One request as seen in a snapshot.

    request_id: engine's id. arrival_s: arrival on the engine clock (s).
    prompt_tokens: prompt incl. vision tokens. computed_tokens: KV-computed tokens.
    generated_tokens: output tokens so far. predicted_output_tokens: tagger's length if
    known (else None → Predictor uses its default). modality: text/image/video.
    vision_tokens: tokens from media. encoder_s: remaining encoder charge (s).
    req_class: sand/pebbles/rocks or None. kv_blocks: blocks held.
    ready_s: for a request still in preprocessing (`InstanceStatus.arriving`), when it
    joins the waiting queue (engine clock, s); None for queued and running requests.
    """

    request_id: str
    arrival_s: float
    prompt_tokens: int
    computed_tokens: int = 0
    generated_tokens: int = 0
    predicted_output_tokens: int | None = None
    modality: str = "text"
    vision_tokens: int = 0
    encoder_s: float = 0.0
    req_class: str | None = None
    kv_blocks: int = 0
    deadline_s: float | None = None
    ready_s: float | None = None

    @classmethod
    def from_sim(cls, r: SimRequest) -> RequestStatus:
        return cls(
            request_id=r.request_id,
            arrival_s=r.arrival_s,
            prompt_tokens=r.prompt_tokens,
            computed_tokens=r.num_computed_tokens,
            generated_tokens=r.num_generated_tokens,
            predicted_output_tokens=r.predicted_output_tokens,
            modality=r.modality,
            vision_tokens=r.vision_tokens,
            encoder_s=r.encoder_s,
            req_class=r.req_class,
            kv_blocks=r.kv_blocks,
            deadline_s=r.deadline_s,
        )


@dataclass(frozen=True)
class InstanceStatus:
    """A point-in-time snapshot of one instance (see module docstring)."""

    instance_id: str
    time_s: float
    limits: InstanceConfig
    kv_blocks_free: int
    running: tuple[RequestStatus, ...] = ()
    waiting: tuple[RequestStatus, ...] = ()
    policy: dict[str, Any] = field(default_factory=lambda: {"name": "fcfs"})
    profile_id: str = ""
    num_preemptions_total: int = 0
    classes: dict[str, Any] = field(default_factory=dict)
    arriving: tuple[RequestStatus, ...] = ()

    @property
    def kv_blocks_total(self) -> int:
        return self.limits.num_gpu_blocks

    def to_dict(self) -> dict[str, Any]:
        return {
            "instance_id": self.instance_id,
            "time_s": self.time_s,
            "policy": self.policy,
            "profile_id": self.profile_id,
            "limits": asdict(self.limits),
            "kv_blocks_free": self.kv_blocks_free,
            "kv_blocks_total": self.kv_blocks_total,
            "num_preemptions_total": self.num_preemptions_total,
            "running": [asdict(r) for r in self.running],
            "waiting": [asdict(r) for r in self.waiting],
            "arriving": [asdict(r) for r in self.arriving],
            "classes": self.classes,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InstanceStatus:
        """Parse a `/status` body.

        Raises:
            AstroUserError: a required field is missing or malformed.
        """
        try:
            lim = dict(d["limits"])
            lim.pop("prefill_budget", None)
            return cls(
                instance_id=str(d.get("instance_id", "")),
                time_s=float(d["time_s"]),
                limits=InstanceConfig(**lim),
                kv_blocks_free=int(d["kv_blocks_free"]),
                running=_requests(d, "running"),
                waiting=_requests(d, "waiting"),
                policy=d.get("policy") or {"name": "fcfs"},
                profile_id=d.get("profile_id", ""),
                num_preemptions_total=int(d.get("num_preemptions_total", 0)),
                classes=d.get("classes") or {},
                arriving=_requests(d, "arriving"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, AstroUserError):
                raise
            raise AstroUserError(f"malformed status snapshot: {exc!r}", field="status") from None


def _requests(d: dict[str, Any], key: str) -> tuple[RequestStatus, ...]:
    """The `key` list of a `/status` body as `RequestStatus`es.

    Raises:
        AstroUserError: an entry is not an object with RequestStatus's fields (the
            message names the list and the entry's index).
    """
    out = []
    for i, r in enumerate(d.get(key) or ()):
        try:
            out.append(RequestStatus(**r))
        except TypeError as exc:
            names = ", ".join(RequestStatus.__dataclass_fields__)
            raise AstroUserError(f"{key}[{i}]: {exc}", field="status",
                                 fix=f"each entry takes the fields {names}") from None
    return tuple(out)


def snapshot(instance_id: str, now_s: float, inst: InstanceSim, profile_id: str = "") -> InstanceStatus:
    """Snapshot an `InstanceSim` (`inst`) at `now_s`."""
    return InstanceStatus(
        instance_id=instance_id,
        time_s=now_s,
        limits=inst.config,
        kv_blocks_free=inst.free_blocks,
        running=tuple(RequestStatus.from_sim(r) for r in inst.running),
        waiting=tuple(RequestStatus.from_sim(r) for r in inst.waiting),
        policy=inst.policy.describe(),
        profile_id=profile_id,
        num_preemptions_total=inst.num_preemptions_total,
    )
