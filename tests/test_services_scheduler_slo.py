"""Per-request SLOs at the live front door (issue 33): a request no instance is predicted
to serve within its TTFT SLO is refused with HTTP 429 (OpenAI error shape, Retry-After),
counted by reason and recorded in /decisions; bad SLO values are 400s naming the header;
requests without an SLO are served as before."""

from __future__ import annotations

from contextlib import ExitStack

import httpx

from conftest import prom_sum as metric
from rps_astro_cli.dispatch.admission import RequestSlo
from rps_astro_cli.services import predictor as pred_mod
from test_services_scheduler import chat, engine_app, hand_profile, length_model, profile_path, scheduler, start

__all__ = ["hand_profile", "length_model", "profile_path"]  # fixtures used below


def _cluster(st: ExitStack, length_model: str, profile_path: str, **kw):
    engs = [start(st, engine_app(i)) for i in range(2)]
    preds = [start(st, pred_mod.create_app(pred_mod.PredictorSettings(e.url, profile=profile_path))) for e in engs]
    return scheduler(st, [e.url for e in engs], [p.url for p in preds], policy="power_of_k",
                     length_model=length_model, predict_deadline_s=2.0, **kw)


def test_unmeetable_ttft_slo_is_a_429_with_retry_after(length_model, profile_path):
    classes = {"interactive": RequestSlo(0.001, 100.0, 0, "interactive"),
               "batch": RequestSlo(60000.0, None, 1, "batch")}
    with ExitStack() as st:
        s = _cluster(st, length_model, profile_path, slo_classes=classes)
        with httpx.Client(base_url=s.url, timeout=10) as c:
            # an idle instance still needs ≥ one 10 ms step for the first token: 1 µs cannot be met
            r = c.post("/v1/chat/completions", json=chat(), headers={"x-slo-ttft-ms": "0.001"})
            assert r.status_code == 429
            err = r.json()["error"]
            assert err["type"] == "slo_unmeetable" and err["param"] == "x-slo-ttft-ms" and err["code"] == 429
            assert int(r.headers["retry-after"]) >= 1
            r = c.post("/v1/chat/completions", json=chat(), headers={"x-slo-class": "interactive"})
            assert r.status_code == 429
            # a generous SLO, a class, a body priority, and no SLO at all: served
            assert c.post("/v1/chat/completions", json=chat(), headers={"x-slo-ttft-ms": "60000"}).status_code == 200
            assert c.post("/v1/chat/completions", json=chat(), headers={"x-slo-class": "batch"}).status_code == 200
            assert c.post("/v1/chat/completions", json=chat(priority=3)).status_code == 200
            assert c.post("/v1/chat/completions", json=chat()).status_code == 200
            # bad values: 400 naming the header / field, nothing dispatched
            for headers, body, param in (({"x-slo-ttft-ms": "soon"}, chat(), "x-slo-ttft-ms"),
                                         ({"x-slo-tpot-ms": "-1"}, chat(), "x-slo-tpot-ms"),
                                         ({"x-slo-class": "gold"}, chat(), "x-slo-class"),
                                         ({}, chat(priority="high"), "priority")):
                r = c.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            m = c.get("/metrics").text
            assert metric(m, "astro:admission_refused_total", reason="slo_ttft_unmeetable") == 2
            assert metric(m, "astro:admission_refused_total", slo_class="interactive") == 1
            assert metric(m, "astro:scheduler_requests_total", outcome="refused") == 2
            decs = c.get("/decisions").json()
            refused = [d for d in decs if d.get("outcome") == "refused"]
            assert len(refused) == 2
            assert all(d["refused"] == "slo_ttft_unmeetable" and d["retry_after_s"] >= 1 for d in refused)


def test_admission_off_serves_what_reject_refuses(length_model, profile_path):
    with ExitStack() as st:
        s = _cluster(st, length_model, profile_path, admission="off")
        with httpx.Client(base_url=s.url, timeout=10) as c:
            r = c.post("/v1/chat/completions", json=chat(), headers={"x-slo-ttft-ms": "0.001"})
            assert r.status_code == 200
            assert c.get("/decisions").json()[-1]["admission"] == "no_headroom_off"
