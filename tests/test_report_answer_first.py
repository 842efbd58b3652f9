"""A capacity run's report gives its answer first: report.md and report.html open with the
SLO capacity table (the latency-vs-rate plot right below it in the HTML), probes are
listed by rate rather than in search order (8, 4, 2, 3, ...), rows that mean nothing for
the mode are left out (ITL in a virtual run), every "n/a" carries its reason, the
Predictor's error names the lengths it was given, and the rate reads as offered vs
achieved."""

from __future__ import annotations

import json
import re

import pytest

from rps_astro_cli.bench.config import BenchConfig
from rps_astro_cli.bench.metrics import all_metrics
from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.bench.report import report_dict, write_report
from rps_astro_cli.bench.report_md import markdown
from rps_astro_cli.bench.runner import BenchResult, RunResult, run_bench

# step = 10 ms + 0.1 ms per token (the hand profile of test_bench_cli / test_bench_executors)
PROFILE = {"profile_id": "hand", "model": "m", "gpu": "g", "tp": 1,
           "coefficients": {"base_s": 0.010, "per_seq_s": 0.0, "token_knots": [0, 10000], "token_s": [0.0, 1.0],
                            "decode_attn_s_per_ctx_token": 0.0, "prefill_attn_s_per_token_pair": 0.0},
           "limits": {"block_size": 16, "num_gpu_blocks": 1056, "max_num_seqs": 48,
                      "max_num_batched_tokens": 512, "max_model_len": 4096}}

BARE_NA = re.compile(r"n/a(?! \()")  # an "n/a" not followed by its reason in parentheses


@pytest.fixture(scope="module")
def capacity_run(tmp_path_factory):
    """A virtual capacity search of two policies (start 8 req/s: the search probes 8, 4, 2,
    3, ... — not in rate order) and its report folder."""
    d = tmp_path_factory.mktemp("cap")
    prof = d / "hand.json"
    prof.write_text(json.dumps(PROFILE))
    out = d / "rep"
    res = run_bench(BenchConfig.flat(virtual=True, instances=2, profile=str(prof), workload="synthetic",
                                     num_requests=40, oracle_lengths=True, policies=["round_robin", "power_of_k"],
                                     ks=["2"], capacity=True, capacity_threshold_s=0.5, capacity_start_rps=8.0,
                                     capacity_tolerance=0.05, out_dir=str(out)))
    assert res.capacity and len(res.capacity) == 2
    return res, out


def _visible(page: str) -> str:
    body = re.sub(r"data:image/png;base64,[A-Za-z0-9+/=]+", "", page)
    body = re.sub(r"<(style|script)>.*?</\1>", "", body, flags=re.S)
    return re.sub(r"<[^>]+>", "", body)


def _table_rows(md: str, heading: str) -> list[list[str]]:
    """The body rows of the first table under `## heading`, cells stripped."""
    lines = md[md.index(f"## {heading}"):].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [[c.strip() for c in ln.strip().strip("|").split(" | ")] for ln in lines[start + 2:end]]


def test_report_md_opens_with_the_capacity_table(capacity_run):
    _, out = capacity_run
    md = (out / "report.md").read_text()
    first_table = next(i for i, ln in enumerate(md.splitlines()) if ln.startswith("|"))
    before = md.splitlines()[:first_table]
    assert [ln for ln in before if ln.startswith("## ")] == ["## SLO capacity"]
    header = md.splitlines()[first_table]
    assert "capacity req/s" in header and "probes (by rate)" in header
    # then the policy comparison, then the setup and the per-probe detail
    order = [md.index(h) for h in ("## SLO capacity", "## Policy comparison at capacity", "## Setup",
                                   "## Capacity probes (by rate)", "## Summary per probe")]
    assert order == sorted(order)


def test_report_html_opens_with_the_capacity_table_and_its_plot(capacity_run):
    _, out = capacity_run
    page = (out / "report.html").read_text()
    first_table = page.index("<table>")
    assert page.index("<h2>SLO capacity</h2>") < first_table
    assert "<h2>" not in page[page.index("<h2>SLO capacity</h2>") + 5:first_table]
    assert "capacity req/s" in page[first_table:page.index("</table>", first_table)]
    # the latency-vs-rate plot comes right after the capacity table, before the comparison
    plot = page.index("<h2>Latency vs request rate</h2>")
    assert page.index("</table>", first_table) < plot < page.index("<h2>Policy comparison at capacity")
    assert "capacity goal P99 TTFT ≤ 0.5 s" in page  # the goal line is drawn and named


def test_probes_are_listed_in_ascending_rate_order(capacity_run):
    res, out = capacity_run
    searched = [p[0] for p in res.capacity[0].probes]
    assert searched != sorted(searched)  # the search order is not the rate order: the test means something
    md = (out / "report.md").read_text()
    labels = [c.label for c in res.capacity]
    # the capacity table's probe list
    for row in _table_rows(md, "SLO capacity"):
        rates = [float(p.split(":")[0]) for p in row[4].split(", ")]
        assert rates == sorted(rates) and len(rates) == len(searched)
    # the per-probe tables: policy by policy, rates ascending
    probe_rows = _table_rows(md, "Capacity probes (by rate)")
    assert [r[0] for r in probe_rows] == [lab for lab in labels for _ in range(len(probe_rows) // 2)]
    for lab in labels:
        rates = [float(r[1]) for r in probe_rows if r[0] == lab]
        assert rates == sorted(rates)
    for heading in ("Summary per probe", "Percentiles per probe", "Prediction, dispatch and failures"):
        runs = [r[0] for r in _table_rows(md, heading)]
        for lab in labels:
            rates = [float(re.search(r"poisson ([\d.]+) req/s", x).group(1)) for x in runs
                     if x.startswith(lab + " @")]
            assert rates and rates == sorted(rates), (heading, lab, rates)
    # the report.json keeps the search order (the record of what ran)
    rep = json.loads((out / "report.json").read_text())
    assert [p["rate_rps"] for p in rep["capacity"][0]["probes"]] == searched


def test_every_na_says_why(capacity_run):
    _, out = capacity_run
    md = (out / "report.md").read_text()
    assert "n/a (" in md  # round_robin asks no Predictor: its predictor error is n/a with the reason
    assert not BARE_NA.findall(md), [md[max(0, m.start() - 60):m.end() + 20] for m in BARE_NA.finditer(md)]
    visible = _visible((out / "report.html").read_text())
    assert not BARE_NA.findall(visible)
    assert "n/a (no Predictor asked: round_robin reads no predictions)" in md


def test_virtual_report_has_no_itl_row_or_column(capacity_run):
    _, out = capacity_run
    md = (out / "report.md").read_text()
    assert "| ITL |" not in md and "ITL p99" not in md
    assert "Not shown: ITL" in md  # said once, with the reason
    page = (out / "report.html").read_text()
    assert "<td>ITL</td>" not in page and "<th>ITL p99</th>" not in page


def test_predictor_error_names_its_lengths_and_the_rate_reads_offered_vs_achieved(capacity_run):
    _, out = capacity_run
    md = (out / "report.md").read_text()
    assert "predictor E2E MAPE % (oracle lengths)" in md and "Predictor error with oracle lengths" in md
    header = next(ln for ln in md[md.index("## Summary per probe"):].splitlines() if ln.startswith("|"))
    assert "| offered req/s | achieved req/s |" in header
    assert "(queue grew)" in md  # a probe above capacity: its achieved rate says why it is low
    assert "Achieved = completed requests ÷ (last finish − first send)" in md


def _live_result(predicted_e2e: bool) -> BenchResult:
    recs = [RequestRecord(f"r{i}", output_tokens=4, sent_s=i, scheduled_s=i, first_token_s=i + 0.5,
                          finish_s=i + 2.0, itl_s=[0.5, 0.5, 0.5], success=True,
                          predicted_e2e_s=3.0 if predicted_e2e else None) for i in range(5)]
    runs = [RunResult(f"power_of_k k=2 @ poisson {r:g} req/s", "power_of_k", "2", r, "poisson", all_metrics(recs),
                      recs) for r in (4.0, 2.0)]
    cfg = BenchConfig.flat(base_url="http://127.0.0.1:9")
    wl = {"name": "w", "source": "s", "num_requests": 5, "skipped": {}, "notes": {}}
    return BenchResult(cfg, wl, {"mode": "live", "base_url": "http://127.0.0.1:9"}, runs)


def test_live_sweep_keeps_itl_sorts_rates_and_labels_predicted_lengths(tmp_path):
    md = markdown(report_dict(_live_result(predicted_e2e=True)))
    assert "| ITL |" in md and "ITL p99" in md  # measured live: kept
    assert md.index("## Setup") < md.index("## Summary (seconds)")  # no capacity: setup first, as before
    summary = md[md.index("## Summary"):]
    assert summary.index("@ poisson 2 req/s") < summary.index("@ poisson 4 req/s")
    assert "predictor E2E MAPE % (predicted lengths)" in md and "Predictor error with predicted lengths" in md
    assert not BARE_NA.findall(md)
    none = markdown(report_dict(_live_result(predicted_e2e=False)))
    assert not BARE_NA.findall(none)
    assert "no dispatch decisions from the scheduler" in none  # why the live Predictor error is missing
    write_report(_live_result(predicted_e2e=False), tmp_path)
    assert not BARE_NA.findall(_visible((tmp_path / "report.html").read_text()))
