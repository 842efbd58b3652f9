"""The Grafana dashboard (`deploy/grafana/astro-fleet.json`, issue 34 item 8) queries only
metrics a running fleet exports: a 2-instance sim cluster (`astro serve`), a few requests
through the scheduler, then every /metrics (scheduler, engines, Predictors, tagger) is
scraped and each metric name that a panel's PromQL references must be one of them
(a histogram's `_bucket` / `_sum` / `_count` and a counter's `_total` resolve to the family
named on its `# TYPE` line, so a labelled histogram with no observation yet still counts).
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import prom_sum

pytestmark = pytest.mark.slow

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "astro-fleet.json"

# PromQL words that are not metric names (functions, aggregations, keywords)
PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "topk", "bottomk", "quantile", "stddev", "stdvar", "group",
    "rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "clamp_min", "clamp_max",
    "abs", "label_replace", "label_join", "vector", "scalar", "time", "absent", "avg_over_time",
    "max_over_time", "min_over_time", "sum_over_time", "by", "without", "on", "ignoring", "group_left",
    "group_right", "and", "or", "unless", "bool", "offset",
}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: label matchers `{...}`, ranges `[...]`, the
    label lists of `by (...)` / `without (...)` / `on (...)`, strings and numbers dropped;
    every identifier left that is not a PromQL word is a metric name."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    words = re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", e)
    return {w for w in words if w not in PROMQL_WORDS}


def test_metric_names_parser() -> None:
    e = ('histogram_quantile(0.99, sum by (le, stage) (rate(astro:dispatch_stage_seconds_bucket'
         '{namespace=~"$namespace",metric="ttft"}[$__rate_interval]))) / sum(rate(vllm:x_total[5m]))')
    assert metric_names(e) == {"astro:dispatch_stage_seconds_bucket", "vllm:x_total"}


def exported(text: str) -> set[str]:
    """Names a scrape exports: every sample's name and every `# TYPE` family."""
    out = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            out.add(line.split()[2])
        elif line and not line.startswith("#"):
            out.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return out


def resolves(name: str, names: set[str]) -> bool:
    if name in names:
        return True
    for suffix in ("_bucket", "_sum", "_count", "_total", "_created"):
        if name.endswith(suffix) and name[: -len(suffix)] in names:
            return True
    return False


def panels(dash: dict) -> list[dict]:
    out = []
    for p in dash["panels"]:
        out.append(p)
        out.extend(p.get("panels") or [])
    return out


def test_dashboard_shape() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] == "astro-fleet"
    names = [v["name"] for v in dash["templating"]["list"]]
    assert "datasource" in names  # the Prometheus datasource is a template variable
    queries = [p for p in panels(dash) if p["type"] != "row"]
    assert queries and all(p["datasource"]["uid"] == "${datasource}" for p in queries)
    ids = [p["id"] for p in panels(dash)]
    assert len(ids) == len(set(ids))
    for p in queries:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert metric_names(t["expr"]), (p["title"], t["expr"])
    titles = " ".join(p["title"] for p in panels(dash))
    for want in ("Decisions by policy", "Stage time", "MAE", "MAPE", "KV-cache", "Preemptions", "TTFT", "ITL",
                 "E2E", "Front-door overhead", "waiting"):
        assert want in titles, want


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    d = tmp_path_factory.mktemp("fleet")
    cj = d / "cluster.json"
    out = open(d / "serve.out", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "rps_astro_cli.cli.main", "serve", "--instances", "2", "--time-scale", "0.05",
         "--run-dir", str(d / "run"), "--cluster-json", str(cj), "--predictors", "sidecars"],
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while not cj.exists():
            assert proc.poll() is None, (d / "serve.out").read_text()
            assert time.monotonic() < deadline, "cluster did not start"
            time.sleep(0.2)
        yield json.loads(cj.read_text())
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
        out.close()


def test_every_dashboard_metric_is_exported(fleet) -> None:
    info = fleet
    sched = info["scheduler"]["url"]
    for i in range(4):
        r = httpx.post(sched + "/v1/completions", json={"model": info["model"], "prompt": f"tell me {i}",
                                                        "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
    token = Path(info["internal_token_file"]).read_text().strip()
    hdr = {"x-astro-internal-token": token}
    texts = {"scheduler": httpx.get(sched + "/metrics", timeout=10).text,
             "tagger": httpx.get(info["tagger"]["url"] + "/metrics", headers=hdr, timeout=10).text}
    for n, inst in enumerate(info["instances"]):
        texts[f"engine-{n}"] = httpx.get(inst["engine_url"] + "/metrics", headers=hdr, timeout=10).text
        texts[f"predictor-{n}"] = httpx.get(inst["predictor_url"] + "/metrics", headers=hdr, timeout=10).text
    names: set[str] = set()
    for t in texts.values():
        names |= exported(t)
    # the fleet served them: the decisions and the engines' latency histograms hold samples
    assert prom_sum(texts["scheduler"], "astro:dispatch_decisions_total") == 4
    assert sum(prom_sum(texts[f"engine-{n}"], "vllm:time_to_first_token_seconds_count") for n in range(2)) == 4
    dash = json.loads(DASHBOARD.read_text())
    missing = {}
    for p in panels(dash):
        for t in p.get("targets") or []:
            for m in metric_names(t["expr"]):
                if not resolves(m, names):
                    missing.setdefault(p["title"], set()).add(m)
    assert not missing, missing
    for v in dash["templating"]["list"]:  # a query variable's metric too
        q = v.get("query")
        if isinstance(q, dict):
            for m in re.findall(r"label_values\(([A-Za-z_:][A-Za-z0-9_:]*)", q["query"]):
                assert resolves(m, names), m
