"""The look-ahead loop's clock and counters (`LoopState`)."""

from __future__ import annotations

import math

from .instance_view import InstanceView
from .request import LReq


class LoopState:
    """Where one look-ahead is: its clock, what it has counted, the queue arrivals still
    to come, and the candidate whose finish ends it."""

    def __init__(self, cand: LReq, t0: float, pending: list[tuple[float, LReq]]) -> None:
        #: the request being placed
        self.cand = cand
        #: the snapshot time (seconds)
        self.t0 = t0
        #: the clock (seconds)
        self.t = t0
        #: engine steps simulated (a jump counts its steps)
        self.steps = 0
        #: loop iterations run (jumps and individually simulated steps)
        self.events = 0
        #: future queue arrivals in order, (time s, request), the candidate among them
        self.pending = pending
        #: index of the next pending arrival
        self.pending_i = 0
        #: time of the next pending arrival (s; +inf when none is left)
        self.arrival = pending[0][0] if pending else math.inf
        #: True when every pending arrival has joined the queue
        self.added = not pending

    def arrive(self, view: InstanceView, t: float) -> None:
        """Queue every pending arrival due by `t`, in order (`arrival` / `added` then
        describe what is left)."""
        p, i = self.pending, self.pending_i
        while i < len(p) and t >= p[i][0]:
            view.enqueue(p[i][1])
            i += 1
        self.pending_i = i
        if i < len(p):
            self.arrival, self.added = p[i][0], False
        else:
            self.arrival, self.added = math.inf, True

    @property
    def done(self) -> bool:
        """True once the candidate has finished."""
        return self.cand.finish_s is not None

    @property
    def ttft_s(self) -> float:
        """The candidate's TTFT, seconds from `t0` (once done)."""
        assert self.cand.first_token_s is not None
        return self.cand.first_token_s - self.t0

    @property
    def e2e_s(self) -> float:
        """The candidate's E2E, seconds from `t0` (once done)."""
        assert self.cand.finish_s is not None
        return self.cand.finish_s - self.t0
