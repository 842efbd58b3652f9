"""One instance of the virtual cluster (`cluster.virtual`): its engine and the state the
cluster keeps about it, in one record (the entity; `cluster.virtual._Run` holds the
events that change it)."""

from __future__ import annotations

from rps_astro_cli.sim.calibration import StepCalibrator
from rps_astro_cli.sim.instance import InstanceSim
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.types import InstanceConfig


class VirtualInstance:
    """An instance of the virtual cluster.

    index: its place in the fleet. sim: its engine (scheduler + KV cache + step clock).
    config: its batching limits. calibrator: its Predictor's `StepCalibrator` (with
    `calibration`; it holds the model in force), else None. predictor_latency: the step
    model its Predictor assumes (None: the engine's own). frontend: when each front-end
    preprocessing slot is next free (virtual s; None: unlimited slots).
    busy_until: its current step's end (virtual s). stepping: a step is in flight (or
    due at once). pending_finished: the requests the current step finishes.
    arriving: dispatched there, still preprocessing. outstanding: sent there, not
    finished. dispatched: sent there in all.
    """

    __slots__ = ("index", "sim", "config", "calibrator", "predictor_latency", "frontend", "busy_until", "stepping",
                 "pending_finished", "arriving", "outstanding", "dispatched")

    def __init__(self, index: int, sim: InstanceSim, config: InstanceConfig, calibrator: StepCalibrator | None,
                 predictor_latency: LatencyModel | None, frontend: list[float] | None):
        self.index, self.sim, self.config = index, sim, config
        self.calibrator, self.predictor_latency, self.frontend = calibrator, predictor_latency, frontend
        self.busy_until = 0.0
        self.stepping = False
        self.pending_finished: list[SimRequest] = []
        self.arriving: list[SimRequest] = []
        self.outstanding = 0
        self.dispatched = 0
