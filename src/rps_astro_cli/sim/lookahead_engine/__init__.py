"""The jump look-ahead engine behind `lookahead.predict` (Astrolabe §4 predictor;
ARCHITECTURE.md §2): an event loop over an instance snapshot that advances pure decode runs in
closed form. `sim/lookahead.py` holds the public API and the step-by-step reference.

One noun per module, bottom up:
- `request`: `LReq`, the look-ahead's request, and its builders;
- `outcome`: `StepOutcome`, what a step of the general loop did;
- `pool`: `DecodePool`, the running requests that only decode, kept in decode ticks;
- `decode_run`: `DecodeRun`, a pure decode run of the pool in closed form;
- `instance_view`: `InstanceView`, the look-ahead's copy of the instance (limits, pool,
  explicit running requests, queue, free KV blocks, how the policy is consulted);
- `loop_state`: `LoopState`, the loop's clock, counters and pending arrivals;
- `apply`, `fast_step`, `preemption`: the general loop's steps;
- `long_prefill`, `blocked_run`, `fcfs_loop`: the FCFS chunked-prefill hot path;
- `engine`: `FastLookahead`, the event loop.

The modules are plain Python and are also compiled with mypyc, as one group, when the
package is installed (setup.py; same source, 3–5x faster; `ASTRO_PURE_PYTHON=1` skips
the build and the import of a build). `sim/engine_build.py` loads the source instead of
a build that is older than any of these files, so an edit here always takes effect.
"""

from .engine import FastLookahead
from .loop_state import LoopState
from .outcome import StepOutcome
from .request import (
    CANDIDATE_ID,
    MAX_LOOKAHEAD_STEPS,
    LReq,
    expected_tokens,
    lreq_candidate,
    lreqs_from_sim,
    lreqs_from_status,
)

__all__ = ["CANDIDATE_ID", "MAX_LOOKAHEAD_STEPS", "FastLookahead", "LReq", "LoopState", "StepOutcome",
           "expected_tokens", "lreq_candidate", "lreqs_from_sim", "lreqs_from_status"]
