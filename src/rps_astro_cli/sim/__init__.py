"""The one instance simulator core, the bottom layer: the instance-policy interface and
its registry (`policy`) with FCFS (`fcfs`), execution-time profiles (`profile`), the
vLLM-V1-faithful step model (`instance`), the status snapshot (`status`), the fast jump
look-ahead used by the Predictor (`lookahead`, `jump`) and helpers shared by the sim engine
and the virtual-time cluster simulation. Nothing here imports a package above it."""

from rps_astro_cli.sim import fcfs as _fcfs  # noqa: F401  (registers "fcfs")
