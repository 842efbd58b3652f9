"""In-instance scheduling policies (pure Python; no vllm import) shared by the sim engine,
the Predictor's look-ahead and the vLLM scheduler plugin."""

from rps_astro_cli.policies.base import INSTANCE_POLICIES, InstancePolicy, make_policy

__all__ = ["INSTANCE_POLICIES", "InstancePolicy", "make_policy"]

# Register the built-in policies.
from rps_astro_cli.policies import fcfs as _fcfs  # noqa: E402,F401

try:  # the RPS-Serve family lands in its own module
    from rps_astro_cli.policies import rps as _rps  # noqa: F401
except ImportError:  # pragma: no cover
    pass
