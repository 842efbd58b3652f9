"""Dispatch policies (global scheduler): one pipeline (filters → sampler → scorers →
picker, `base.py` / `stages.py`), one registry, shared by the live scheduler service and
the virtual-time cluster simulation.

A policy module registers its policies by decorator when imported; the built-in modules
are listed here and imported loudly: a module that fails to import raises
`PluginImportError` naming it (never a silent "unknown dispatch policy").
"""

from rps_astro_cli.dispatch.base import (
    DISPATCH_POLICIES,
    DispatchPolicy,
    alias_param,
    decide,
    decide_async,
    dispatch_params,
    make_dispatch,
    prefix_hits_wanted,
)
from rps_astro_cli.dispatch.stages import PREDICTIONS, PREFIX_HITS, STATUS
from rps_astro_cli.registry import import_plugins

__all__ = [
    "DISPATCH_POLICIES",
    "PREDICTIONS",
    "PREFIX_HITS",
    "STATUS",
    "DispatchPolicy",
    "alias_param",
    "decide",
    "decide_async",
    "dispatch_params",
    "make_dispatch",
    "prefix_hits_wanted",
]

BUILTIN_MODULES = (
    "rps_astro_cli.dispatch.simple",  # round_robin, random
    "rps_astro_cli.dispatch.guided",  # least_requests, llumnix, power_of_k
    "rps_astro_cli.dispatch.least_kv",  # least_kv
    "rps_astro_cli.dispatch.prefix",  # cache_aware, session_affinity
)
import_plugins("dispatch policy", BUILTIN_MODULES)
