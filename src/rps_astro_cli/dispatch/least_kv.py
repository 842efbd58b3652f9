"""`least_kv`: send the request to the instance with the most free KV blocks.

A load baseline between `least_requests` (counts requests, blind to their size) and
`llumnix` (free blocks net of the queue's demand, per running request): it reads only
`kv_blocks_free` from the engine's latest `/status`.

Pipeline: health → all → free KV blocks → min cost (ties within `tie_blocks`, at
random); instances without a status yet are unscored, and if none has one the decision
falls back to fewest outstanding requests.
Weakness: blind to the waiting queue (a long queue of prompts not yet admitted holds no
blocks) and to how soon running requests finish; as fresh as the last status poll.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from rps_astro_cli.dispatch.base import DISPATCH_POLICIES, FEWEST_OUTSTANDING, DispatchPolicy, Fallback
from rps_astro_cli.dispatch.stages import STATUS, MinScorePicker, Scorer
from rps_astro_cli.params import Param

if TYPE_CHECKING:
    from rps_astro_cli.types import InstanceLoad, LatencyEstimate

TIE_BLOCKS = Param("tie_blocks", int, 0, "instances within this many free KV blocks of the most free are ties, "
                   "broken at random (0 = exact ties only)", ge=0)


class FreeKvScorer(Scorer):
    """Cost = −kv_blocks_free (more free blocks = lower cost); unknown status: unscored."""

    name = "free_kv"
    reads = frozenset({STATUS})
    reason = "most free KV blocks"

    def score(self, by_index: Mapping[int, InstanceLoad], candidates: Sequence[int],
              predictions: Mapping[int, LatencyEstimate]) -> dict[int, float]:
        out = {}
        for i in candidates:
            free = by_index[i].kv_blocks_free
            if free is not None:
                out[i] = float(-free)
        return out


@DISPATCH_POLICIES.register("least_kv")
class LeastKv(DispatchPolicy):
    """Most free KV blocks in the latest status; ties within `tie_blocks` broken at
    random; no status anywhere: fewest outstanding. Weakness: blind to the queue."""

    name = "least_kv"
    params = (TIE_BLOCKS,)
    scorers = ((FreeKvScorer(), 1.0),)
    fallback = Fallback(FEWEST_OUTSTANDING, "candidates", "fallback: no status; fewest outstanding")

    def __init__(self, tie_blocks: int = 0) -> None:
        self.tie_blocks = TIE_BLOCKS.check(tie_blocks)
        self.picker = MinScorePicker(tolerance=self.tie_blocks)
