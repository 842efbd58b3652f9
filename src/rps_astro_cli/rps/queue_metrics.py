"""The queue manager's per-class metrics (RPS-Serve §3.5): for each of sand / pebbles /
rocks, over the waiting requests at `now_s`:

    queue_len         = number of waiting requests of the class
    mean_wait_s       = mean of (now_s − arrival_s) over them (0 when none; s)
    prefill_backlog_s = Σ estimated prefill latency of their uncomputed prompt
                        = Σ prefill_s(prompt, vision, modality) × (1 − computed / prompt)  (s)

A pure function of the waiting list, so the sim engine can put it in `/status`
(`classes`) and in Prometheus (suggested gauges, one label `class`:
`astro:class_queue_length`, `astro:class_mean_wait_seconds`,
`astro:class_prefill_backlog_seconds` — see `PROMETHEUS_GAUGES`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from rps_astro_cli.rps.classes import CLASS_RANK, CLASSES, naive_class
from rps_astro_cli.sim.request import SimRequest

PROMETHEUS_GAUGES: dict[str, tuple[str, str]] = {
    "queue_len": ("astro:class_queue_length", "Waiting requests per RPS class."),
    "mean_wait_s": ("astro:class_mean_wait_seconds", "Mean waiting time of queued requests per RPS class (s)."),
    "prefill_backlog_s": (
        "astro:class_prefill_backlog_seconds",
        "Estimated prefill latency of queued requests per RPS class (s).",
    ),
}
"""metric key → (Prometheus gauge name, help text)."""


class PrefillEstimator(Protocol):
    def prefill_s(self, prompt_tokens: int, vision_tokens: int, modality: str) -> float: ...


def request_class(req: SimRequest) -> str:
    """`req.req_class` when valid, else the naive class of its modality."""
    c = req.req_class
    return c if c in CLASS_RANK else naive_class(req.modality)


def class_queue_metrics(
    waiting: Iterable[SimRequest],
    now_s: float,
    estimator: PrefillEstimator | None = None,
    classify: Callable[[SimRequest], str] | None = None,
) -> dict[str, dict[str, float]]:
    """Per-class queue metrics (see module docstring); every class is always present.

    Args:
        waiting: the waiting requests (any order).
        now_s: current time on the requests' clock (s).
        estimator: anything with `prefill_s(prompt_tokens, vision_tokens, modality)`,
            e.g. `ProfileImpactEstimator(profile)` or a fitted `ImpactEstimator`;
            None → backlog reported as 0.
        classify: request → class (e.g. a class-aware policy's `classify`); default
            `request_class` (the label, else by modality).

    Returns:
        {class: {"queue_len": int, "mean_wait_s": float, "prefill_backlog_s": float}}
    """
    cls_of = classify or request_class
    n = dict.fromkeys(CLASSES, 0)
    wait = dict.fromkeys(CLASSES, 0.0)
    backlog = dict.fromkeys(CLASSES, 0.0)
    for r in waiting:
        c = cls_of(r)
        n[c] += 1
        w = now_s - r.arrival_s
        wait[c] += w if w > 0 else 0.0
        if estimator is not None and r.prompt_tokens > 0:
            left = 1.0 - min(r.num_computed_tokens, r.prompt_tokens) / r.prompt_tokens
            backlog[c] += estimator.prefill_s(r.prompt_tokens, r.vision_tokens, r.modality) * left
    return {
        c: {
            "queue_len": n[c],
            "mean_wait_s": wait[c] / n[c] if n[c] else 0.0,
            "prefill_backlog_s": backlog[c],
        }
        for c in CLASSES
    }
