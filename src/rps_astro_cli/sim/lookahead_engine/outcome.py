"""What one look-ahead step did (`StepOutcome`)."""

from __future__ import annotations

from enum import Enum


class StepOutcome(Enum):
    """The result of one step of the general loop (`fast_step`, `preemption`,
    `InstanceView.careful_step`); a step that ran leaves its duration in
    `InstanceView.step_s`."""

    #: a step ran (its seconds: `InstanceView.step_s`)
    RAN = "ran"
    #: nothing could be scheduled (the instance waits for an arrival)
    IDLE = "idle"
    #: the step only preempted: nothing ran, no time passed
    PREEMPTED_ONLY = "preempted only"
    #: the fast path does not cover this step: `InstanceView.careful_step` runs it
    UNSUPPORTED = "unsupported"
