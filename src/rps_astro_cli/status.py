"""Moved: the status types live in `rps_astro_cli.types` (the request vocabulary and its
JSON codec); a snapshot of a simulated instance is `rps_astro_cli.sim.snapshot`.

This module only re-exports the types so that code still importing
`rps_astro_cli.status` keeps working while the engine and layers work in flight moves
over; import from `rps_astro_cli.types` in new code. It imports nothing from `sim/`.
"""

from rps_astro_cli.types import InstanceStatus, RequestStatus

__all__ = ["InstanceStatus", "RequestStatus"]
