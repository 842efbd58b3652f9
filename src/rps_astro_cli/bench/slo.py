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
from rps_astro_cli.dispatch.admission import RequestSlo
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
    from rps_astro_cli.sim.instance import InstanceSim
    from rps_astro_cli.sim.latency import LatencyModel
    from rps_astro_cli.sim.request import SimRequest
    from rps_astro_cli.types import InstanceConfig

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


# -- per-request SLO classes (issue 33) ----------------------------------------------------
@dataclass(frozen=True)
class SloClass:
    """One `--slo-class NAME:ttft_ms=..,tpot_ms=..,share=..,priority=..`."""

    name: str  # the class name, sent as x-slo-class
    slo: RequestSlo  # its targets and priority (also sent as x-slo-ttft-ms / x-slo-tpot-ms)
    share: float  # fraction of the workload's requests drawn into it (0, 1]


def parse_slo_classes(specs: list[str] | None) -> list[SloClass]:
    """The `--slo-class` entries; shares must sum to ≤ 1 (the rest carry no SLO).

    Raises:
        AstroUserError: a bad entry, a repeated name, a share outside (0, 1] or shares
            summing over 1 (names `--slo-class`).
    """
    from rps_astro_cli.dispatch.admission import parse_slo_class, parse_slo_class_spec

    out: list[SloClass] = []
    for text in specs or []:
        name, kv = parse_slo_class_spec(text, extra=("share",))
        if any(c.name == name for c in out):
            raise AstroUserError(f"class {name!r} given twice", field="--slo-class")
        if name in ("overall", "sand", "pebbles", "rocks"):
            raise AstroUserError(f"class name {name!r} is taken by the report", field="--slo-class",
                                 fix="pick another name")
        try:
            share = float(kv.pop("share", "1"))
        except ValueError:
            raise AstroUserError(f"{text!r}: share must be a number", field="--slo-class") from None
        if not 0 < share <= 1:
            raise AstroUserError(f"{text!r}: share must be in (0, 1], got {share:g}", field="--slo-class")
        try:
            slo = parse_slo_class(kv, name, where="--slo-class")
        except AstroUserError as exc:
            raise AstroUserError(str(exc), field="--slo-class") from None
        out.append(SloClass(name, slo, share))
    if sum(c.share for c in out) > 1 + 1e-9:
        raise AstroUserError("the classes' shares sum to more than 1", field="--slo-class",
                             fix="make them add up to at most 1 (the rest carry no SLO)")
    return out


def assign_slo_classes(request_ids: list[str], classes: list[SloClass], seed: int) -> dict[str, SloClass]:
    """Each request's class, drawn independently by the shares (in the order given) from
    a Generator seeded by (seed, 33) alone: the same requests get the same classes in
    every run, policy and rate of a bench. Requests past the shares' sum get none."""
    import numpy as np

    if not classes:
        return {}
    u = np.random.default_rng([seed, 33]).random(len(request_ids))
    edges = np.cumsum([c.share for c in classes])
    out: dict[str, SloClass] = {}
    for rid, x in zip(request_ids, u):
        j = int(np.searchsorted(edges, x, side="right"))
        if j < len(classes):
            out[rid] = classes[j]
    return out
