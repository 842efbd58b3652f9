"""The objective `astro fit --select ttft` scores RPS-Serve classifiers on: a replay of the
workload profile's own requests through one virtual instance of the recipe's engine.

Why: k-means (the paper's clustering, §3.4) is scored on the spread of its features, not
on latency. On the RPS-Serve testbed footprint (`astro profile --workload mix-mh`: AnyRes
images of 1.7–3.7k tokens, videos of 8–32 frames, 1.6–6.3k tokens) images and videos
overlap in prefill time and KV tokens while texts spread over two decades, so k-means
splits the texts and files every image with the videos as rocks — and mean TTFT under
`rps` is then far worse than with the modality classes (BENCHMARKS.md, issue 15). The
deployment is judged on TTFT, so the fit is scored on it.

`replay_scorer(records, profile, ...)` → score(classifier): for each replay seed, draw
`num_requests` profile rows (without replacement while they last), send them as a Poisson
stream at `rate_rps` to one instance (the profile's limits: pass the recipe's), run FCFS
once and `rps` (with the recipe's regulator parameters) with the candidate classifier, and
score = mean over seeds of 100 × (mean TTFT under rps / mean TTFT under FCFS − 1): the
acceptance's "overall TTFT change". TTFT counts from the request's send, as `astro bench`'s
client TTFT. The seeds are the fit's own (default 101–103), not the benchmark's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.rps.records import ProfileRecord

DEFAULT_SELECT_SEEDS = (101, 102, 103)


def _replay(rows: Sequence[ProfileRecord], times: np.ndarray, profile: Any, chunked_prefill: bool,
            preprocess_slots: int | None, policy: str, params: Mapping[str, Any], seed: int) -> float:
    """Mean TTFT (s, from the send) of `rows` sent at `times` to one instance."""
    from rps_astro_cli.cluster.virtual import simulate_cluster
    from rps_astro_cli.cluster.workload import TimedRequest
    from rps_astro_cli.dispatch import make_dispatch
    from rps_astro_cli.policies.build import build_instance_policy
    from rps_astro_cli.types import InstanceConfig

    reqs = [TimedRequest(f"r{i}", float(t), r.prompt_tokens, max(1, r.output_tokens), None, r.modality,
                         r.vision_tokens, r.encoder_s if math.isfinite(r.encoder_s) else 0.0,
                         r.preprocess_s if math.isfinite(r.preprocess_s) else 0.0)
            for i, (r, t) in enumerate(zip(rows, times))]
    icfg = InstanceConfig.from_profile(profile, chunked_prefill=chunked_prefill)
    res = simulate_cluster(reqs, 1, make_dispatch("round_robin"), profile, icfg,
                           lambda: build_instance_policy(policy, params, profile), np.random.default_rng(seed),
                           preprocess_slots=preprocess_slots)
    ttft = [r.first_token_s - r.arrival_s for r in res.records if r.first_token_s is not None]
    return float(np.mean(ttft)) if ttft else math.inf


def replay_scorer(
    records: Sequence[ProfileRecord],
    profile: Any,
    *,
    rate_rps: float,
    chunked_prefill: bool = True,
    preprocess_slots: int | None = None,
    policy_params: Mapping[str, Any] | None = None,
    seeds: Sequence[int] = DEFAULT_SELECT_SEEDS,
    num_requests: int = 200,
) -> tuple[Callable[[Any], float], str]:
    """(score, description) — see the module docstring. `profile`: an `ExecutionProfile`
    with the engine's limits. `policy_params`: `rps`'s parameters besides the classifier.

    Raises:
        AstroUserError: a rate ≤ 0, no seeds, num_requests < 1, or no usable rows.
    """
    if not rate_rps > 0 or not math.isfinite(rate_rps):
        raise AstroUserError(f"must be a finite rate > 0, got {rate_rps}", field="--request-rate")
    if not seeds:
        raise AstroUserError("needs at least one seed", field="--select-seeds")
    if num_requests < 1:
        raise AstroUserError(f"must be ≥ 1, got {num_requests}", field="--select-requests")
    rows = [r for r in records if r.prompt_tokens > 0 and r.output_tokens > 0]
    if not rows:
        raise AstroUserError("the profile has no usable rows", field="profile")
    params = {k: v for k, v in (policy_params or {}).items() if k != "classifier"}
    draws = []
    for s in seeds:
        rng = np.random.default_rng([s, 15])
        idx = rng.permutation(len(rows))[:num_requests] if num_requests <= len(rows) \
            else rng.integers(0, len(rows), num_requests)
        times = np.cumsum(rng.exponential(1.0 / rate_rps, len(idx)))
        sel = [rows[int(i)] for i in idx]
        fcfs = _replay(sel, times, profile, chunked_prefill, preprocess_slots, "fcfs", {}, s)
        draws.append((s, sel, times, fcfs))

    def score(classifier: Any) -> float:
        p = {**params, "classifier": classifier if classifier is not None else "naive"}
        ch = [100.0 * (_replay(sel, t, profile, chunked_prefill, preprocess_slots, "rps", p, s) / f - 1.0)
              for s, sel, t, f in draws]
        return float(np.mean(ch))

    desc = (f"mean over replay seeds {','.join(map(str, seeds))} of the change (%) of mean TTFT under rps vs "
            f"fcfs: {num_requests} profile rows per seed, Poisson {rate_rps:g} req/s, one instance of "
            f"{profile.profile_id} ({profile.num_gpu_blocks} KV blocks, {profile.max_num_batched_tokens}-token "
            f"budget, chunked prefill {'on' if chunked_prefill else 'off'}, preprocess slots "
            f"{preprocess_slots or 'unbounded'})")
    return score, desc


__all__ = ["DEFAULT_SELECT_SEEDS", "replay_scorer"]
