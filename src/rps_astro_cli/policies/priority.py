"""The RPS-Serve priority regulator (paper §3.6, ARCHITECTURE.md §3).

For a request of class c that has waited w seconds:

    P_c(w)     = S_c + (1 − exp(−β_c · w^α_c))
    score_c(w) = −log P_c(w)          (lower score runs first; P = 0 → score = +inf)

Defaults (paper §4.1, "Configuration"): S = 0.1 / 0.05 / 0, α = 3.5 / 2.5 / 1.1,
β = 0.05 / 0.003 / 0.00075 for sand / pebbles / rocks. With them sand reaches
P ≈ 1 after ~3 s, pebbles after ~15 s, rocks only after minutes (the paper's Figure 9a).
The extracted paper text garbles the formula; this reading is the one ARCHITECTURE.md §3
fixes. A fresh rock (w = 0, S = 0) has P = 0, i.e. score +inf: it ranks behind every
other class until it has waited (then FCFS among equals by arrival).

`crossover_wait_s` solves P_heavy(w) = P_light(0) in closed form, i.e. how long a heavy
request must wait before it overtakes a fresh light one (no starvation).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.rps.classes import CLASS_RANK, CLASSES

DEFAULT_STATIC = (0.1, 0.05, 0.0)
DEFAULT_ALPHA = (3.5, 2.5, 1.1)
DEFAULT_BETA = (0.05, 0.003, 0.00075)


def _per_class(value: Sequence[float] | Mapping[str, float], name: str) -> tuple[float, float, float]:
    if isinstance(value, Mapping):
        missing = [c for c in CLASSES if c not in value]
        extra = [k for k in value if k not in CLASS_RANK]
        if missing or extra:
            raise AstroUserError(
                f"needs exactly the keys {', '.join(CLASSES)} (missing {missing}, unknown {extra})",
                field=name,
            )
        vals = [value[c] for c in CLASSES]
    else:
        vals = list(value)
        if len(vals) != 3:
            raise AstroUserError(
                f"needs 3 values (sand, pebbles, rocks), got {len(vals)}", field=name
            )
    try:
        out = tuple(float(v) for v in vals)
    except (TypeError, ValueError):
        raise AstroUserError(f"values must be numbers, got {vals!r}", field=name) from None
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class ClassParams:
    """Regulator parameters of one class: static priority S (≥ 0), exponent α (> 0),
    rate β (> 0, in s^−α)."""

    static: float
    alpha: float
    beta: float


class PriorityRegulator:
    """Per-class aging priority `P_c(w)` and score `−log P_c(w)` (see module docstring).

    Args:
        static_priority, alpha, beta: 3 values (sand, pebbles, rocks) or a mapping
            keyed by class name.

    Raises:
        AstroUserError: wrong count/keys, S < 0, α ≤ 0 or β ≤ 0.
    """

    __slots__ = ("params",)

    def __init__(
        self,
        static_priority: Sequence[float] | Mapping[str, float] = DEFAULT_STATIC,
        alpha: Sequence[float] | Mapping[str, float] = DEFAULT_ALPHA,
        beta: Sequence[float] | Mapping[str, float] = DEFAULT_BETA,
    ):
        s = _per_class(static_priority, "static_priority")
        a = _per_class(alpha, "alpha")
        b = _per_class(beta, "beta")
        for c, si, ai, bi in zip(CLASSES, s, a, b):
            if si < 0:
                raise AstroUserError(f"{c}: must be ≥ 0, got {si}", field="static_priority")
            if ai <= 0:
                raise AstroUserError(f"{c}: must be > 0, got {ai}", field="alpha")
            if bi <= 0:
                raise AstroUserError(f"{c}: must be > 0, got {bi}", field="beta")
        self.params: dict[str, ClassParams] = {
            c: ClassParams(si, ai, bi) for c, si, ai, bi in zip(CLASSES, s, a, b)
        }

    def priority(self, req_class: str, wait_s: float) -> float:
        """P_c(w) for a request of `req_class` that has waited `wait_s` seconds
        (negative waits count as 0). In [S_c, S_c + 1)."""
        p = self.params[req_class]
        w = wait_s if wait_s > 0.0 else 0.0
        return p.static + 1.0 - math.exp(-p.beta * w**p.alpha)

    def score(self, req_class: str, wait_s: float) -> float:
        """−log P_c(w); +inf when P = 0 (a fresh request of a class with S = 0)."""
        pr = self.priority(req_class, wait_s)
        return -math.log(pr) if pr > 0.0 else math.inf

    def crossover_wait_s(self, heavy: str, light: str, light_wait_s: float = 0.0) -> float:
        """Waiting time w (s) at which `heavy` reaches the priority of a `light`
        request that has waited `light_wait_s`: solves
        S_h + 1 − exp(−β_h w^α_h) = P_l, i.e. w = (−ln(1 + S_h − P_l) / β_h)^(1/α_h).
        0 if the heavy class already starts at or above it; +inf if never reached."""
        target = self.priority(light, light_wait_s)
        h = self.params[heavy]
        rest = 1.0 + h.static - target
        if rest >= 1.0:
            return 0.0
        if rest <= 0.0:
            return math.inf
        return float((-math.log(rest) / h.beta) ** (1.0 / h.alpha))

    def describe(self) -> dict[str, list[float]]:
        """Parameters as lists (sand, pebbles, rocks), for `/status` and reports."""
        return {
            "static_priority": [self.params[c].static for c in CLASSES],
            "alpha": [self.params[c].alpha for c in CLASSES],
            "beta": [self.params[c].beta for c in CLASSES],
        }
