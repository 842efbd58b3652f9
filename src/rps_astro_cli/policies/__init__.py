"""The richer in-instance scheduling policies (pure Python; no vllm import), above the
sim core: `priority` (static class priority, EDF) and `rps` (RPS-Serve). The interface,
its registry and FCFS live in `rps_astro_cli.sim.policy` / `sim.fcfs`; importing this
package registers every built-in policy, so `make_policy(name)` from here knows them all."""

from rps_astro_cli.policies import rps as _rps  # noqa: F401  (registers the RPS-Serve family)
from rps_astro_cli.sim.policy import INSTANCE_POLICIES, InstancePolicy, make_policy

__all__ = ["INSTANCE_POLICIES", "InstancePolicy", "make_policy"]
