"""An `InstanceSim`'s state in the `/status` vocabulary.

The status types themselves (`InstanceStatus`, `RequestStatus`) and their JSON codec
live in `rps_astro_cli.types`, the bottom layer (import them from there). `snapshot` and
`request_status` turn a
simulated instance (the sim engine's, or a look-ahead test's) into them.
"""

from __future__ import annotations

from dataclasses import replace

from rps_astro_cli.sim.instance import InstanceSim
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.types import InstanceStatus, RequestStatus

__all__ = ["request_status", "snapshot", "waiting_status"]


def request_status(r: SimRequest) -> RequestStatus:
    """One simulated request as `/status` shows it (no `ready_s`: the caller sets it
    for a request still in preprocessing)."""
    return RequestStatus(
        request_id=r.request_id,
        arrival_s=r.arrival_s,
        prompt_tokens=r.prompt_tokens,
        num_computed_tokens=r.num_computed_tokens,
        generated_tokens=r.num_generated_tokens,
        predicted_output_tokens=r.predicted_output_tokens,
        modality=r.modality,
        vision_tokens=r.vision_tokens,
        encoder_s=r.encoder_s,
        req_class=r.req_class,
        kv_blocks=r.kv_blocks,
        deadline_s=r.deadline_s,
    )


def waiting_status(r: SimRequest, inst: InstanceSim) -> RequestStatus:
    """A waiting request as `/status` shows it: with `cached_tokens`, its prefix-cache
    hit on `inst` now when it is not yet admitted (as `InstanceSim` would take it)."""
    st = request_status(r)
    cache = inst.cache
    if cache is not None and r.block_hashes and r.kv_blocks == 0 and r.num_computed_tokens == 0:
        bs = inst.config.block_size
        n = cache.lookup(r.block_hashes, (r.num_tokens - 1) // bs)[0]
        if n:
            return replace(st, cached_tokens=n * bs)
    return st


def snapshot(instance_id: str, now_s: float, inst: InstanceSim, profile_id: str = "") -> InstanceStatus:
    """Snapshot `inst` at `now_s` (its running and waiting requests — the waiting ones
    with their prefix-cache hits, `waiting_status` — free KV blocks, policy and
    preemption count)."""
    return InstanceStatus(
        instance_id=instance_id,
        time_s=now_s,
        limits=inst.config,
        kv_blocks_free=inst.free_blocks,
        running=tuple(request_status(r) for r in inst.running),
        waiting=tuple(waiting_status(r, inst) for r in inst.waiting),
        policy=inst.policy.describe(),
        profile_id=profile_id,
        num_preemptions_total=inst.num_preemptions_total,
    )
