"""Per-request SLO classes in astro bench (issue 33): parsing and seeded assignment,
goodput / attainment / refused worked out by hand, and a virtual run whose tight class
is refused (not failed) with exit code 0."""

from __future__ import annotations

import json

import pytest

from rps_astro_cli.bench.config import BenchConfig
from rps_astro_cli.bench.metrics import all_metrics
from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.bench.slo import assign_slo_classes, parse_slo_classes
from rps_astro_cli.dispatch.admission import RequestSlo
from rps_astro_cli.errors import AstroUserError

SPECS = ["interactive:ttft_ms=1000,tpot_ms=100,share=0.7,priority=0", "batch:ttft_ms=30000,share=0.3,priority=1"]


def test_parse_and_assign() -> None:
    cls = parse_slo_classes(SPECS)
    assert [(c.name, c.share) for c in cls] == [("interactive", 0.7), ("batch", 0.3)]
    assert cls[0].slo == RequestSlo(1000.0, 100.0, 0, "interactive")
    ids = [f"r{i}" for i in range(2000)]
    a, b = assign_slo_classes(ids, cls, 5), assign_slo_classes(ids, cls, 5)
    assert {k: v.name for k, v in a.items()} == {k: v.name for k, v in b.items()}  # seeded
    n_int = sum(v.name == "interactive" for v in a.values())
    assert len(a) == 2000 and 1340 <= n_int <= 1460  # 0.7 × 2000 ± 4.4 σ (σ = 20.5)
    half = assign_slo_classes(ids, parse_slo_classes(["x:ttft_ms=5,share=0.5"]), 0)
    assert 900 <= len(half) <= 1100  # the other half carry no SLO
    for bad in (["x:ttft_ms=1,share=0.8", "y:ttft_ms=1,share=0.3"], ["x:ttft_ms=1,share=0"], ["x:ttft=1"],
                ["x:ttft_ms=1", "x:ttft_ms=2"], ["overall:ttft_ms=1"], ["x:ttft_ms=-1"]):
        with pytest.raises(AstroUserError) as e:
            parse_slo_classes(bad)
        assert e.value.field == "--slo-class"


def _rec(rid: str, cls: str | None, sent: float, first: float | None, finish: float | None, out: int,
         refused: bool = False) -> RequestRecord:
    ttft, tpot = {"i": (1.0, 0.1), "b": (30.0, None), None: (None, None)}[cls]
    ok = finish is not None
    return RequestRecord(rid, sent_s=sent, first_token_s=first, finish_s=finish, output_tokens=out, success=ok,
                         slo_class={"i": "interactive", "b": "batch", None: None}[cls], slo_ttft_s=ttft,
                         slo_tpot_s=tpot, refused=refused, error=None if ok or refused else "boom")


def test_goodput_attainment_refused_by_hand() -> None:
    recs = [
        _rec("a", "i", 0.0, 0.5, 1.4, 10),   # TTFT 0.5 ≤ 1, TPOT 0.9/9 = 0.1 ≤ 0.1: good
        _rec("b", "i", 1.0, 2.5, 3.0, 2),    # TTFT 1.5 > 1: miss
        _rec("c", "i", 2.0, 2.2, 4.2, 5),    # TPOT 2.0/4 = 0.5 > 0.1: miss
        _rec("d", "i", 3.0, None, None, 0, refused=True),  # refused: miss, not failed
        _rec("e", "b", 4.0, 20.0, 25.0, 3),  # TTFT 16 ≤ 30: good
        _rec("f", None, 5.0, 6.0, 10.0, 3),  # no class: outside attainment
        _rec("g", "b", 6.0, None, None, 0),  # failed: miss, counted in errors
    ]
    m = all_metrics(recs)
    # T = max finish (25) − min send (0) = 25 s
    o = m["overall"]
    assert o.duration_s == 25.0 and o.refused == 1 and o.num_failed == 1 and o.errors == {"boom": 1}
    assert o.slo_attainment == pytest.approx(2 / 6) and o.goodput_rps == pytest.approx(2 / 25)
    i, b = m["interactive"], m["batch"]
    assert i.num_requests == 4 and i.refused == 1 and i.slo_attainment == pytest.approx(1 / 4)
    assert i.goodput_rps == pytest.approx(1 / 25)
    assert b.slo_attainment == pytest.approx(1 / 2) and b.refused == 0
    assert all_metrics([_rec("f", None, 0.0, 1.0, 2.0, 3)])["overall"].goodput_rps is None  # no class, no figure


def test_virtual_bench_refuses_the_unmeetable_class(tmp_path) -> None:
    from rps_astro_cli.bench.runner import run_bench

    out = tmp_path / "rep"
    # "now" must be < 1 µs of TTFT: no instance can meet it; "later" (60 s) always can
    cfg = BenchConfig.flat(virtual=True, instances=2, workload="random", num_requests=40, input_len=64,
                           output_len=8, request_rate=5.0, policies=["power_of_k"], oracle_lengths=True,
                           slo_classes=["now:ttft_ms=0.001,share=0.5", "later:ttft_ms=60000,share=0.5,priority=1"],
                           out_dir=str(out))
    res = run_bench(cfg)
    assert res.exit_code == 0, res.exit_reasons
    m = res.runs[0].metrics
    n_now = m["now"].num_requests
    assert n_now > 0 and m["now"].refused == n_now and m["now"].slo_attainment == 0.0
    assert m["later"].refused == 0 and m["later"].slo_attainment == 1.0
    assert m["overall"].refused == n_now and m["overall"].num_failed == 0
    rep = json.loads((out / "report.json").read_text())
    overall = rep["runs"][0]["metrics"]["overall"]
    assert overall["refused"] == n_now and overall["goodput_rps"] > 0 and "slo_attainment" in overall
    assert rep["runs"][0]["metrics"]["now"]["refused"] == n_now
    # admission off: the same requests are dispatched (and miss their 1 µs SLO)
    res = run_bench(BenchConfig.flat(**{**cfg.to_dict(), "out_dir": None, "admission": "off"}))
    assert res.runs[0].metrics["now"].refused == 0 and res.runs[0].metrics["now"].slo_attainment == 0.0


def test_live_client_sends_the_class_and_counts_429_as_refused() -> None:
    from rps_astro_cli.bench.client import ClientOptions, _http_error, _prepare
    from rps_astro_cli.bench.workload_base import BenchRequest

    cls = {c.name: c for c in parse_slo_classes(SPECS)}
    opts = ClientOptions(base_url="http://x", slo_of={"r1": cls["interactive"], "r2": cls["batch"]})
    _, body, headers, rec, _ = _prepare(BenchRequest("r1", "hi", 1, 4), opts, 0.0)
    assert headers["x-slo-class"] == "interactive" and headers["x-slo-ttft-ms"] == "1000"
    assert headers["x-slo-tpot-ms"] == "100" and json.loads(body)["priority"] == 0
    assert (rec.slo_class, rec.slo_ttft_s, rec.slo_tpot_s) == ("interactive", 1.0, 0.1)
    _, body, headers, rec2, _ = _prepare(BenchRequest("r2", "hi", 1, 4), opts, 0.0)
    assert "x-slo-tpot-ms" not in headers and json.loads(body)["priority"] == 1
    _, body, headers, rec3, _ = _prepare(BenchRequest("r3", "hi", 1, 4), opts, 0.0)
    assert "x-slo-class" not in headers and "priority" not in json.loads(body) and rec3.slo_class is None
    err = b'{"error": {"message": "no instance", "code": 429}}'
    assert _http_error(rec, 429, err, 1.0).refused
    assert not _http_error(rec2, 503, err, 1.0).refused
    # the scheduler reads a class it does not define as a label when the targets come with it
    from rps_astro_cli.dispatch.admission import parse_request_slo

    assert parse_request_slo(headers={"x-slo-class": "interactive", "x-slo-ttft-ms": "1000"}) == \
        RequestSlo(1000.0, None, 0, "interactive")
