"""In-instance scheduling policies (pure Python; no vllm import) shared by the sim engine,
the Predictor's look-ahead and the vLLM scheduler plugin.

Each module registers its policies by decorator when imported; the built-in modules are
imported loudly: one that fails raises `PluginImportError` naming it (never a silent
"unknown instance policy")."""

from rps_astro_cli.policies.base import INSTANCE_POLICIES, InstancePolicy, make_policy
from rps_astro_cli.registry import import_plugins

__all__ = ["INSTANCE_POLICIES", "InstancePolicy", "make_policy"]

BUILTIN_MODULES = (
    "rps_astro_cli.policies.fcfs",  # fcfs
    "rps_astro_cli.policies.rps",  # static_class, naive_class, naive_aging, rps, edf
)
import_plugins("instance policy", BUILTIN_MODULES)
