"""The one way to build an in-instance policy: `build_instance_policy(name, params,
profile)`. Every path that runs an instance policy calls it — the sim engine (`astro
serve`), the vLLM scheduler plugin (`engine.vllm_bridge.policy_from_env`), the virtual
cluster (`astro bench --virtual`, `astro simulate`) and the Predictor rebuilding its
engine's policy — so one name on one profile means the same policy everywhere: `rps` /
`static_class` on a profile with a shipped classifier (`artifacts/rps/<profile_id>/`) get
that classifier, `edf` takes its isolated-E2E deadlines from that profile.

Before this module each path called `make_policy(name, **params)` itself and only the sim
engine added the profile's defaults, so `rps` on the LLaVA profile classified with the
smart classifier under `astro serve` and by modality elsewhere, and `edf` on the virtual
paths took deadlines from the default Llama profile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.policies.rps import profile_policy_params
from rps_astro_cli.sim.policy import InstancePolicy, make_policy


def resolve_profile(profile: Any, field: str = "profile") -> Any:
    """An `ExecutionProfile` from a profile object, an id / JSON path, or None (→ None).

    Raises:
        AstroUserError: an unknown profile id or unreadable file (names `field`).
    """
    from rps_astro_cli.sim.profile import ExecutionProfile, load_profile

    if profile is None or profile == "" or isinstance(profile, ExecutionProfile):
        return profile or None
    try:
        return load_profile(profile)
    except AstroUserError as exc:
        raise AstroUserError(str(exc), field=field) from None


def build_instance_policy(name: str, params: Mapping[str, Any] | None, profile: Any,
                          fields: Mapping[str, str] | None = None) -> InstancePolicy:
    """Instance policy `name` for an engine running `profile`.

    Args:
        name: a registered instance policy (`astro policies`).
        params: its declared parameters (strings from flags or typed values); they win
            over the profile's defaults.
        profile: the engine's `ExecutionProfile`, its id / JSON path, or None (no
            profile-tied defaults: the policy's own, e.g. `edf` on the shipped default
            profile, `rps` with naive classes).
        fields: parameter name → the flag / field it came from (for errors).

    Raises:
        AstroUserError: unknown policy, undeclared or bad parameter, unknown profile.
    """
    prof = resolve_profile(profile)
    defaults = profile_policy_params(name, prof) if prof is not None else {}
    return make_policy(name, fields=fields, **{**defaults, **dict(params or {})})


__all__ = ["build_instance_policy", "resolve_profile"]
