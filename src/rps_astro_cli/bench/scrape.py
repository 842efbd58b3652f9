"""Reading the services' Prometheus `/metrics` and the scheduler's `/decisions` for the
bench report: engine preemptions, dispatch overhead, predictor error and CPU.

Live-run figures are differences between a scrape before and one after the run, so
other traffic on the same cluster during the run would be counted too (said in the
report).
"""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np

from rps_astro_cli.bench.metrics import percentile


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample name → value summed over label sets (e.g. `vllm:num_preemptions_total`,
    `astro:scheduler_overhead_seconds_sum`), read with prometheus_client's text parser
    (a core dependency). Text the parser rejects (a non-Prometheus `/metrics`) gives the
    samples read before the bad line."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    try:
        for fam in text_string_to_metric_families(text):
            for smp in fam.samples:
                out[smp.name] = out.get(smp.name, 0.0) + float(smp.value)
    except (ValueError, TypeError, IndexError):
        pass
    return out


async def scrape(client: httpx.AsyncClient, url: str | None) -> dict[str, float] | None:
    """`parse_prometheus` of `GET url/metrics`, or None when unreachable."""
    if not url:
        return None
    try:
        r = await client.get(url.rstrip("/") + "/metrics")
        if r.status_code != 200:
            return None
        return parse_prometheus(r.text)
    except httpx.HTTPError:
        return None


def delta(before: dict[str, float] | None, after: dict[str, float] | None, name: str) -> float | None:
    """after[name] − before[name] (None if either is missing)."""
    if before is None or after is None or name not in after:
        return None
    return after[name] - before.get(name, 0.0)


async def fetch_decisions(client: httpx.AsyncClient, scheduler_url: str | None, n: int) -> list[dict[str, Any]]:
    """The scheduler's last `n` decisions (`GET /decisions?n=`), or [] when unavailable."""
    if not scheduler_url:
        return []
    try:
        r = await client.get(scheduler_url.rstrip("/") + "/decisions", params={"n": n})
        data = r.json()
    except (httpx.HTTPError, ValueError):
        return []
    if isinstance(data, dict):
        data = data.get("decisions") or data.get("data") or []
    return [d for d in data if isinstance(d, dict)] if isinstance(data, list) else []


def decisions_summary(decisions: list[dict[str, Any]], time_scale: float = 1.0) -> dict[str, Any]:
    """Dispatch overhead and predictor error from scheduler decisions.

    overhead_ms: p50/p99/mean of `overhead_us` / 1000 (scheduler time per request, engine
    excluded). decide_ms: the same of `decide_us` (policy decision incl. predict RPCs).
    predictor_e2e: MAE (s) and MAPE of the chosen instance's predicted `e2e_s` (engine
    seconds) against the scheduler-observed `observed_e2e_s` (forward → end of stream,
    wall seconds) ÷ `time_scale` (the sim engines' wall s per engine s), over decisions
    that ended "ok" — the pairs the scheduler's `astro:prediction_*` metrics count — and
    were not made early (`early_dispatch`: predicted before the tag, their look-aheads
    stopped at the first token, so their e2e is their TTFT); predictor_ttft likewise,
    early ones included. (Before the
    ÷ time_scale, a cluster at time scale 1.5 read ~33 % E2E error from the clocks alone.)
    """
    def stats(vals: list[float]) -> dict[str, float | None]:
        return {"count": len(vals), "mean": float(np.mean(vals)) if vals else None,
                "p50": percentile(vals, 50), "p99": percentile(vals, 99)}

    over = [d["overhead_us"] / 1000 for d in decisions if isinstance(d.get("overhead_us"), (int, float))]
    dec = [d["decide_us"] / 1000 for d in decisions if isinstance(d.get("decide_us"), (int, float))]
    out: dict[str, Any] = {"num_decisions": len(decisions), "overhead_ms": stats(over), "decide_ms": stats(dec)}
    for key, obs in (("e2e_s", "observed_e2e_s"), ("ttft_s", "observed_ttft_s")):
        pairs = []
        for d in decisions:
            if key == "e2e_s" and d.get("early_dispatch"):
                continue  # predicted before the tag, up to the first token: no E2E prediction
            pred = (d.get("predictions") or {}).get(str(d.get("choice")))
            if (isinstance(pred, dict) and isinstance(pred.get(key), (int, float))
                    and isinstance(d.get(obs), (int, float)) and d.get("outcome", "ok") == "ok"):
                pairs.append((float(pred[key]), float(d[obs]) / time_scale))
        err = [abs(p - a) for p, a in pairs]
        rel = [abs(p - a) / a for p, a in pairs if a > 0]
        out[f"predictor_{key[:-2]}"] = {"count": len(pairs), "mae_s": float(np.mean(err)) if err else None,
                                       "mape": float(np.mean(rel)) if rel else None}
    preds = [d.get("candidates") for d in decisions if isinstance(d.get("candidates"), list)]
    out["mean_candidates"] = float(np.mean([len(c) for c in preds])) if preds else None
    return out
