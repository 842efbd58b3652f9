"""Service-level objectives: absolute per-metric thresholds named like vLLM's
(`--slo ttft:10 --slo e2el:60`, seconds; a `ms` suffix is accepted: `ttft:500ms`) and
RPS-Serve's relative SLO (`--slo-scale 5`: E2E ≤ 5 × the request's isolated E2E, i.e. its
E2E alone on an idle instance, §4.1 of the RPS-Serve paper).

Metric names: `ttft`, `tpot`, `e2el` (end-to-end latency), `nlat` (normalized latency,
s/token). A request meets the SLO when it succeeded and every defined metric is within
its threshold; a metric that is undefined for the request (TTFT with no output token,
TPOT with < 2 tokens) is not checked. Failed requests always miss.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.errors import AstroUserError

SLO_METRICS = ("ttft", "tpot", "e2el", "nlat")


@dataclass(frozen=True)
class SloSpec:
    """The SLO of a run.

    thresholds_s: metric → threshold (seconds; s/token for nlat).
    e2e_scale: relative SLO factor (E2E ≤ scale × isolated E2E), or None.
    """

    thresholds_s: tuple[tuple[str, float], ...] = ()
    e2e_scale: float | None = None

    @property
    def empty(self) -> bool:
        return not self.thresholds_s and self.e2e_scale is None

    def describe(self) -> str:
        parts = [f"{m} ≤ {v:g} s" for m, v in self.thresholds_s]
        if self.e2e_scale is not None:
            parts.append(f"e2el ≤ {self.e2e_scale:g} × isolated E2E")
        return ", ".join(parts) or "none"

    def to_dict(self) -> dict:
        return {"thresholds_s": dict(self.thresholds_s), "e2e_scale": self.e2e_scale}


def parse_slo(items: list[str] | None, scale: float | None = None) -> SloSpec:
    """Parse `--slo metric:value[ms|s]` items and `--slo-scale`.

    Raises:
        AstroUserError: unknown metric, malformed item, value ≤ 0, duplicate metric.
    """
    out: dict[str, float] = {}
    for item in items or []:
        m = re.fullmatch(r"\s*([a-z][a-z0-9_]*)\s*[:=]\s*([0-9.eE+-]+)\s*(ms|s)?\s*", item)
        if not m:
            raise AstroUserError(f"cannot parse {item!r}", field="--slo", fix="write metric:seconds, e.g. ttft:10")
        name, num, unit = m.groups()
        if name not in SLO_METRICS:
            raise AstroUserError(f"unknown metric {name!r}", field="--slo",
                                 fix=f"choose one of: {', '.join(SLO_METRICS)}")
        try:
            v = float(num)
        except ValueError:
            raise AstroUserError(f"cannot parse the value of {item!r}", field="--slo") from None
        if not v > 0 or math.isinf(v):
            raise AstroUserError(f"threshold must be > 0 and finite, got {num}", field="--slo")
        if name in out:
            raise AstroUserError(f"{name} given twice", field="--slo")
        out[name] = v / 1000.0 if unit == "ms" else v
    if scale is not None and (not scale > 0 or math.isinf(scale)):
        raise AstroUserError(f"must be > 0 and finite, got {scale}", field="--slo-scale")
    return SloSpec(tuple(out.items()), scale)


@functools.lru_cache(maxsize=100_000)
def _isolated(profile_key: int, prompt_tokens: int, output_tokens: int, encoder_s: float) -> float:
    profile = _PROFILES[profile_key]
    from rps_astro_cli.policies import make_policy
    from rps_astro_cli.sim.instance import InstanceConfig, InstanceSim
    from rps_astro_cli.sim.latency import LatencyModel
    from rps_astro_cli.sim.request import SimRequest

    cfg = InstanceConfig.from_profile(profile)
    p = min(prompt_tokens, cfg.max_model_len - 1)
    o = max(1, min(output_tokens, cfg.max_model_len - p))
    sim = InstanceSim(cfg, LatencyModel(profile), make_policy("fcfs"))
    req = SimRequest("isolated", 0.0, p, o, encoder_s=encoder_s)
    sim.add(req)
    t = 0.0
    while req.finish_s is None:
        res = sim.step(t)
        if not res.scheduled:  # pragma: no cover - a lone request always fits
            raise RuntimeError("isolated run made no progress")
        t += res.duration_s
    return req.finish_s


_PROFILES: dict[int, object] = {}


def isolated_e2e_s(profile, prompt_tokens: int, output_tokens: int, encoder_s: float = 0.0) -> float:
    """E2E (s) of one request alone on an idle instance of `profile` (an
    `ExecutionProfile`), simulated with the shared instance model; memoized."""
    key = id(profile)
    _PROFILES[key] = profile
    return _isolated(key, int(prompt_tokens), int(output_tokens), float(encoder_s))


def isolated_for(records: list[RequestRecord], profile, prompt_of: dict[str, int] | None = None) -> None:
    """Set `isolated_e2e_s` of each successful record from `profile` (for `--slo-scale`)."""
    for r in records:
        p = (prompt_of or {}).get(r.request_id, r.prompt_tokens)
        n = r.output_tokens if r.success else r.expected_output_tokens
        if p >= 1 and n >= 1:
            r.isolated_e2e_s = isolated_e2e_s(profile, p, n)
