"""The richer in-instance scheduling policies (pure Python; no vllm import), above the
sim core: `priority` (static class priority, EDF) and `rps` (RPS-Serve). The interface,
its registry and FCFS live in `rps_astro_cli.sim.policy` / `sim.fcfs`; importing this
package registers every built-in policy, so `make_policy(name)` from here knows them all.

The built-in modules are imported loudly: one that fails raises `PluginImportError`
naming it (never a silent "unknown instance policy")."""

from rps_astro_cli.registry import import_plugins
from rps_astro_cli.sim.policy import INSTANCE_POLICIES, make_policy

__all__ = ["INSTANCE_POLICIES", "make_policy"]

BUILTIN_MODULES = (
    "rps_astro_cli.sim.fcfs",  # fcfs
    "rps_astro_cli.policies.rps",  # static_class, naive_class, naive_aging, rps, edf
)
import_plugins("instance policy", BUILTIN_MODULES)

from rps_astro_cli.policies.build import build_instance_policy  # noqa: E402  (after the built-ins register)

__all__ += ["build_instance_policy"]
