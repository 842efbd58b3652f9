"""Bench metrics, each defined once as a formula (mirrored in `docs/metrics.md`).

Notation, per request i (see `records.RequestRecord`): s_i send time, f_i arrival of the
first content chunk, l_i arrival of the last content chunk, n_i output tokens, c_k the
arrival times of its content chunks. C = completed (successful) requests, F = failed
ones, R = C ∪ F. T = run duration = max_i(finish_i) − min_i(s_i) over R.

- TTFT_i = f_i − s_i (defined when n_i ≥ 1; a role-only first delta or a usage-only last
  chunk carries no content and moves no timestamp).
- Harness TTFT_i = f_i − a_i, a_i the engine's arrival stamp (the start of the request's
  own input processing; virtual runs): TTFT as the RPS-Serve authors' harness counts it,
  own preprocessing + queue + first scheduling to first token, without the wait behind
  other requests' preprocessing that TTFT_i (from the client's send) includes.
- E2E_i = l_i − s_i (stream end when n_i = 0).
- TPOT_i = (E2E_i − TTFT_i) / (n_i − 1), defined only for n_i ≥ 2.
- ITL: every gap c_{k+1} − c_k, pooled over the completed requests (one chunk may carry
  several tokens; the gap is per chunk, as a streaming user sees it).
- Normalized latency_i = E2E_i / n_i (s/token), defined for n_i ≥ 1 (RPS-Serve §2.3).
- Distribution of a metric: mean, P50, P90, P99 over C where defined; percentiles use
  linear interpolation between order statistics (numpy's default); with 0 samples every
  statistic is None (reported "n/a"); with 1 sample they all equal it.
- Throughput = |C| / T (req/s); output throughput = Σ_{i∈C} n_i / T (tokens/s).
- SLO (see `slo.py`): good_i ⇔ i ∈ C and every defined metric within its threshold.
  Violation rate = 1 − |good| / |R| (failed requests count as misses). Per metric m:
  rate_m = |{i ∈ C : m_i > thr_m}| / |C|; severity_m = mean over those violators of
  (m_i − thr_m) seconds. Goodput = |good| / T (req/s; vLLM's "request goodput").
- Preemptions: Σ preemptions_i (virtual runs), or Δ `vllm:num_preemptions_total` summed
  over engines (live runs; overall only).
- Length-tagger error over requests with a prediction p_i: MAE = mean |p_i − n_i|,
  MAPE = mean |p_i − n_i| / n_i (n_i ≥ 1) — n_i the actual output tokens.
- Predictor error over requests with a prediction P_i of E2E (or TTFT): MAE = mean
  |P_i − E2E_i|, MAPE = mean |P_i − E2E_i| / E2E_i (Astrolabe §5 reports 10–15 %).
- Per-class metrics are the same formulas over the class's requests, with the run's T.
- Per-request SLO classes (`--slo-class`, issue 33): Refused = requests the scheduler
  refused at admission (HTTP 429), kept out of F (not errors). good'_i ⇔ i has a class,
  i ∈ C and TTFT_i ≤ its class's TTFT target and TPOT_i ≤ its TPOT target (where both
  are defined). SLO attainment = |good'| / |requests with a class| (refused ones miss);
  goodput_rps = |good'| / T. `metrics.<class>` is the same over one class's requests.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.bench.slo import SloSpec

CLASSES = ("sand", "pebbles", "rocks")


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0 ≤ q ≤ 100) with linear interpolation; None for no values,
    the value itself for one."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


@dataclass(frozen=True)
class Dist:
    """Summary of one metric: count, mean, P50, P90, P99 (None when count = 0)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Iterable[float | None]) -> Dist:
        v = [x for x in values if x is not None]
        if not v:
            return cls(0, None, None, None, None)
        return cls(len(v), float(np.mean(v)), percentile(v, 50), percentile(v, 90), percentile(v, 99))

    def get(self, stat: str) -> float | None:
        return getattr(self, stat)


@dataclass
class SloResult:
    """SLO outcome of a group: good requests, violation rate (failed = miss), goodput,
    and per metric {violations, rate (over completed), severity_mean_s}."""

    good: int = 0
    violation_rate: float | None = None
    goodput_rps: float | None = None
    per_metric: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class GroupMetrics:
    """All metrics of one group of requests (overall or one class)."""

    num_requests: int
    num_completed: int
    num_failed: int
    duration_s: float
    ttft_s: Dist
    tpot_s: Dist
    itl_s: Dist
    e2e_s: Dist
    normalized_s_per_token: Dist
    throughput_rps: float | None
    output_tokens_per_s: float | None
    total_output_tokens: int
    slo: SloResult | None
    preemptions: int | None
    length_mae_tokens: float | None
    length_mape: float | None
    predictor_e2e_mae_s: float | None
    predictor_e2e_mape: float | None
    predictor_ttft_mae_s: float | None
    errors: dict[str, int]
    # prompt tokens served from the prefix cache / prompt tokens looked up (0–1; virtual
    # runs, overall only; None when unknown)
    prefix_cache_hit_rate: float | None = None
    # harness TTFT (module docstring): from the engine's arrival stamp; None when no
    # request of the group has one (live runs)
    ttft_harness_s: Dist | None = None
    # the Predictor's TTFT error (issue 31): |predicted − served| / served TTFT of the
    # chosen instance, median and P90 over the requests with a prediction, and over those
    # after the first PREDICTOR_WARMUP requests (in send order); None without predictions
    predictor_ttft_ape_p50: float | None = None
    predictor_ttft_ape_p90: float | None = None
    predictor_ttft_ape_p50_after_warmup: float | None = None
    predictor_ttft_ape_p90_after_warmup: float | None = None
    # per-request SLO classes (module docstring): refused at admission; goodput and
    # attainment of the requests' own targets (None when no request has a class)
    refused: int = 0
    goodput_rps: float | None = None
    slo_attainment: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_duration_s(records: Sequence[RequestRecord]) -> float:
    """T = max finish − min send over all requests (failed included); 0 if none."""
    if not records:
        return 0.0
    start = min(r.sent_s for r in records)
    end = max((r.finish_s if r.finish_s is not None else r.sent_s) for r in records)
    return max(0.0, end - start)


def slo_thresholds(r: RequestRecord, slo: SloSpec) -> dict[str, float]:
    """metric → threshold (s) for request r (absolute ones, plus e2el from the relative SLO
    when r has an isolated E2E; the tighter one wins)."""
    th = dict(slo.thresholds_s)
    if slo.e2e_scale is not None and r.isolated_e2e_s is not None:
        rel = slo.e2e_scale * r.isolated_e2e_s
        th["e2el"] = min(th.get("e2el", math.inf), rel)
    return th


def meets_slo(r: RequestRecord, slo: SloSpec) -> bool:
    """good_i: succeeded and every defined metric within its threshold."""
    if not r.success:
        return False
    for m, thr in slo_thresholds(r, slo).items():
        v = r.value(m)
        if v is not None and v > thr:
            return False
    return True


def _slo(records: Sequence[RequestRecord], slo: SloSpec, duration_s: float) -> SloResult:
    done = [r for r in records if r.success]
    good = sum(meets_slo(r, slo) for r in records)
    res = SloResult(good=good,
                    violation_rate=(1 - good / len(records)) if records else None,
                    goodput_rps=(good / duration_s) if duration_s > 0 else None)
    metrics = {m for m, _ in slo.thresholds_s} | ({"e2el"} if slo.e2e_scale is not None else set())
    for m in sorted(metrics):
        over = []
        for r in done:
            thr = slo_thresholds(r, slo).get(m)
            v = r.value(m)
            if thr is not None and v is not None and v > thr:
                over.append(v - thr)
        res.per_metric[m] = {"violations": len(over), "rate": (len(over) / len(done)) if done else None,
                             "severity_mean_s": float(np.mean(over)) if over else None}
    return res


PREDICTOR_WARMUP = 200  # requests before the Predictor-error "after warm-up" figures start


def predictor_ttft_ape(records: Sequence[RequestRecord]) -> dict[str, float | None]:
    """`predictor_ttft_ape_p50` / `_p90` (and `_after_warmup`) of `records`: the chosen
    instance's predicted TTFT against the TTFT it served, as |p − a| / a."""
    ordered = sorted(records, key=lambda r: r.sent_s)
    ape = [(k, abs(r.predicted_ttft_s - r.ttft_s) / r.ttft_s) for k, r in enumerate(ordered)
           if r.success and r.predicted_ttft_s is not None and r.ttft_s is not None and r.ttft_s > 0]
    out: dict[str, float | None] = {}
    for suffix, vals in (("", [v for _, v in ape]), ("_after_warmup", [v for k, v in ape if k >= PREDICTOR_WARMUP])):
        out[f"predictor_ttft_ape_p50{suffix}"] = float(np.percentile(vals, 50)) if vals else None
        out[f"predictor_ttft_ape_p90{suffix}"] = float(np.percentile(vals, 90)) if vals else None
    return out


def _mae_mape(pairs: list[tuple[float, float]]) -> tuple[float | None, float | None]:
    """(mean |p − a|, mean |p − a| / a over a > 0) of (prediction, actual) pairs."""
    if not pairs:
        return None, None
    err = [abs(p - a) for p, a in pairs]
    rel = [abs(p - a) / a for p, a in pairs if a > 0]
    return float(np.mean(err)), (float(np.mean(rel)) if rel else None)


def group_metrics(records: Sequence[RequestRecord], slo: SloSpec | None = None,
                  duration_s: float | None = None, preemptions: int | None = None) -> GroupMetrics:
    """Metrics of `records` (module docstring formulas). `duration_s` defaults to
    `run_duration_s(records)`; `preemptions` overrides the per-request sum (live runs)."""
    T = run_duration_s(records) if duration_s is None else duration_s
    done = [r for r in records if r.success]
    failed = [r for r in records if not r.success and not r.refused]
    classed = [r.meets_request_slo for r in records if r.slo_class is not None]
    good_own = sum(bool(m) for m in classed)
    tokens = sum(r.output_tokens for r in done)
    if preemptions is None:
        pre = [r.preemptions for r in records if r.preemptions is not None]
        preemptions = sum(pre) if pre else None
    l_mae, l_mape = _mae_mape([(float(r.predicted_output_tokens), float(r.output_tokens))
                               for r in done if r.predicted_output_tokens is not None])
    e_mae, e_mape = _mae_mape([(r.predicted_e2e_s, r.e2e_s) for r in done
                               if r.predicted_e2e_s is not None and r.e2e_s is not None])
    t_mae, _ = _mae_mape([(r.predicted_ttft_s, r.ttft_s) for r in done
                          if r.predicted_ttft_s is not None and r.ttft_s is not None])
    errors: dict[str, int] = {}
    for r in failed:
        key = " ".join((r.error or "unknown error").split())[:160]  # the full reason, e.g. "HTTP 404: model ..."
        errors[key] = errors.get(key, 0) + 1
    return GroupMetrics(
        num_requests=len(records), num_completed=len(done), num_failed=len(failed), duration_s=T,
        ttft_s=Dist.of(r.ttft_s for r in done),
        tpot_s=Dist.of(r.tpot_s for r in done),
        itl_s=Dist.of(g for r in done for g in r.itl_s),
        e2e_s=Dist.of(r.e2e_s for r in done),
        normalized_s_per_token=Dist.of(r.normalized_s_per_token for r in done),
        throughput_rps=(len(done) / T) if T > 0 else None,
        output_tokens_per_s=(tokens / T) if T > 0 else None,
        total_output_tokens=tokens,
        slo=_slo(records, slo, T) if slo is not None and not slo.empty else None,
        preemptions=preemptions,
        length_mae_tokens=l_mae, length_mape=l_mape,
        predictor_e2e_mae_s=e_mae, predictor_e2e_mape=e_mape, predictor_ttft_mae_s=t_mae,
        errors=errors,
        ttft_harness_s=(Dist.of(r.ttft_harness_s for r in done)
                        if any(r.engine_arrival_s is not None for r in done) else None),
        **predictor_ttft_ape(records),
        refused=sum(r.refused for r in records),
        goodput_rps=(good_own / T if T > 0 else None) if classed else None,
        slo_attainment=good_own / len(classed) if classed else None,
    )


def all_metrics(records: Sequence[RequestRecord], slo: SloSpec | None = None,
                preemptions_total: int | None = None) -> dict[str, GroupMetrics]:
    """{"overall": ..., "sand"/"pebbles"/"rocks": ...} (classes present only), all over the
    run's duration T."""
    T = run_duration_s(records)
    out = {"overall": group_metrics(records, slo, T, preemptions_total)}
    for c in CLASSES:
        sub = [r for r in records if r.req_class == c]
        if sub:
            out[c] = group_metrics(sub, slo, T, None)
    for c in sorted({r.slo_class for r in records if r.slo_class is not None and r.slo_class not in out}):
        out[c] = group_metrics([r for r in records if r.slo_class == c], slo, T, None)
    return out


def top_errors(errors: dict[str, int], k: int = 3) -> str:
    """"3 × HTTP 404: model 'bogus' is not served here; 1 × ..." for the `k` most frequent
    failure reasons of `GroupMetrics.errors` (count, then text), "" when none."""
    items = sorted(errors.items(), key=lambda kv: (-kv[1], kv[0]))
    out = "; ".join(f"{n} × {text}" for text, n in items[:k])
    if len(items) > k:
        out += f"; {sum(n for _, n in items[k:])} × other reasons"
    return out


def slo_percentile_value(records: Sequence[RequestRecord], metric: str, q: float) -> float | None:
    """The q-th percentile of `metric` over all requests where a failed request counts as
    +∞ (a miss), used by the capacity search; None when there are no values."""
    vals = [math.inf if not r.success else r.value(metric) for r in records]
    vals = [v for v in vals if v is not None]
    if not vals:
        return None
    if any(math.isinf(v) for v in vals):
        s = sorted(vals)
        idx = q / 100 * (len(s) - 1)
        lo, hi = s[math.floor(idx)], s[math.ceil(idx)]
        if math.isinf(lo) or math.isinf(hi):
            return math.inf
        return lo + (hi - lo) * (idx - math.floor(idx))
    return percentile(vals, q)
