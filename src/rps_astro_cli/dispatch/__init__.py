"""Dispatch policies (global scheduler): one interface, one registry, shared by the live
scheduler service and the virtual-time cluster simulation."""

from rps_astro_cli.dispatch.base import DISPATCH_POLICIES, DispatchDecision, DispatchPolicy, InstanceLoad, make_dispatch

__all__ = ["DISPATCH_POLICIES", "DispatchDecision", "DispatchPolicy", "InstanceLoad", "make_dispatch"]

from rps_astro_cli.dispatch import simple as _simple  # noqa: E402,F401

try:  # load-aware and prediction-guided policies
    from rps_astro_cli.dispatch import guided as _guided  # noqa: F401
except ImportError:  # pragma: no cover
    pass
