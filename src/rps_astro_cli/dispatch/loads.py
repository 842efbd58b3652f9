"""What a policy's stages read, built in one place: `loads_for` turns one request
(`DispatchRequest`) and the instances as the caller sees them (`InstanceView`s) into the
`InstanceLoad`s the stages read, filling exactly the policy's `inputs` (`stages.STATUS`,
`PREFIX_HITS`; `PREDICTIONS` are asked for by `decide` itself).

The callers are views over their own state — the live scheduler's `InstanceState`
(`services/scheduler/instances.py`, also the endpoint picker's) and the virtual
cluster's instance views (`cluster/views.py`) — so a new per-instance input is a field
of `InstanceLoad` (`types.py`), its place in `status_fields_of` / `STATUS_ROW` when it
comes from the engine's state, and the stage that reads it (CONTRIBUTING.md, "Add a dispatch input").
"""

from __future__ import annotations

from collections.abc import Collection, Sequence, Sized
from dataclasses import dataclass
from typing import Protocol

from rps_astro_cli.dispatch.base import prefix_hits_wanted
from rps_astro_cli.dispatch.stages import PREFIX_HITS, STATUS
from rps_astro_cli.types import InstanceConfig, InstanceLoad


@dataclass(frozen=True)
class DispatchRequest:
    """A request as the instances' loads see it.

    prompt_tokens: its prompt, in the unit of the instances' status and of their cached
        prefixes (tokens; a live request hashed with an engine's token ids counts those).
    block_hashes: its prompt's full KV blocks' chained hashes (`sim.prefix_cache`), ()
        when not hashed (no policy input needs them, or no prompt ids).
    block_size: tokens per hashed block.
    session_id: the conversation it belongs to (None: none).
    """

    prompt_tokens: int
    block_hashes: tuple[int, ...] = ()
    block_size: int = 16
    session_id: str | None = None


class InstanceView(Protocol):
    """One instance as a dispatch sees it (the live scheduler's state of it, or the
    virtual cluster's)."""

    @property
    def index(self) -> int:
        """Its id in the caller's instance table (what `excluded` holds)."""

    @property
    def healthy(self) -> bool:
        """Passes its health checks (circuit breaker closed)."""

    @property
    def outstanding(self) -> int:
        """Requests sent there that have not ended."""

    @property
    def caches_prefixes(self) -> bool:
        """It reports a prefix cache (so a request may hit there)."""

    def status_row(self) -> StatusRow | None:
        """`status_fields_of` its latest state, then what the caller knows beyond it
        (the live scheduler's requests sent since: their prompt blocks and count, else
        None, None); None when its state is unknown."""

    def prefix_hit_tokens(self, req: DispatchRequest) -> int | None:
        """Tokens of `req`'s prompt cached there (None: unknown)."""

    def served_session(self, session_id: str | None) -> bool:
        """It served the previous turn of `session_id`."""


class _Waiting(Protocol):
    """A waiting request as `status_fields_of` reads it (read-only: an engine's frozen
    `RequestStatus` and the simulator's mutable requests both fit)."""

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def kv_blocks(self) -> int: ...


# a status row: the `InstanceLoad` fields an instance's state gives, in this order, then
# the blocks and count of requests sent there that its state does not show yet (a plain
# tuple: the virtual cluster builds one per instance per dispatch)
STATUS_ROW = ("kv_blocks_free", "kv_blocks_total", "num_running", "num_waiting", "waiting_blocks_needed",
              "kv_block_size", "max_num_seqs", "pending_blocks_needed", "pending_requests")
StatusRow = tuple[int, int, int, int, int, int, int, "int | None", "int | None"]


class InstanceState(Protocol):
    """An instance's state as `status_fields_of` reads it: an engine's `/status`
    (`types.InstanceStatus`) and a simulated instance (`sim.instance.InstanceSim`) both
    have these names."""

    @property
    def limits(self) -> InstanceConfig: ...

    @property
    def kv_blocks_free(self) -> int: ...

    @property
    def kv_blocks_total(self) -> int: ...

    @property
    def running(self) -> Sized: ...

    @property
    def waiting(self) -> Collection[_Waiting]: ...


def status_fields_of(state: InstanceState) -> StatusRow:
    """The `InstanceLoad` fields an instance's state gives (an engine's `/status`, or a
    simulated instance), in `STATUS_ROW` order: free / total KV blocks, running and
    waiting counts, the blocks the waiting queue still needs for its prompts
    (Σ max(0, ceil(prompt_tokens / block_size) − blocks held)), the block size and the
    batch limit; then None, None (no requests known beyond the state)."""
    limits = state.limits
    bs = limits.block_size
    waiting = state.waiting
    need = 0
    for r in waiting:  # the hot loop of a status-based decision under load: one pass, no counter
        nb = -(-r.prompt_tokens // bs) - r.kv_blocks
        if nb > 0:
            need += nb
    return (state.kv_blocks_free, state.kv_blocks_total, len(state.running), len(waiting), need, bs,
            limits.max_num_seqs, None, None)


def loads_for(views: Sequence[InstanceView], req: DispatchRequest, inputs: frozenset[str],
              excluded: frozenset[int] = frozenset()) -> list[InstanceLoad]:
    """The loads a policy with `inputs` reads for `req`, one per view at its position in
    `views`: health (unhealthy when `excluded` holds its index), outstanding requests, the
    request's prompt length and session, and, when the inputs need them, the status
    fields (`STATUS`) and the request's cached prefix there (`dispatch.prefix_hits_wanted`:
    `PREFIX_HITS`, or predictions once some instance caches prefixes)."""
    status = STATUS in inputs
    hits = bool(req.block_hashes) and (PREFIX_HITS in inputs
                                      or prefix_hits_wanted(inputs, any(v.caches_prefixes for v in views)))
    prompt, sid = req.prompt_tokens, req.session_id
    out = []
    for j, v in enumerate(views):
        healthy = v.healthy and (not excluded or v.index not in excluded)
        hit = v.prefix_hit_tokens(req) if hits else None
        served = sid is not None and v.served_session(sid)
        row = v.status_row() if status else None
        if row is not None:
            out.append(InstanceLoad(j, healthy, v.outstanding, row[0], row[1], row[2], row[3], row[4], hit, prompt,
                                    served, row[5], row[7], row[8], row[6]))
        else:
            out.append(InstanceLoad(j, healthy, v.outstanding, prefix_hit_tokens=hit, request_prompt_tokens=prompt,
                                    served_session=served))
    return out
