"""report.md wording: one class → no class row repeating "overall"; MAPE printed in percent;
readable tick labels on the log-scale latency-vs-rate plot, which is log-scaled only when
its values span a decade (its caption says which); per-instance load over time (hand-
computed step function), dispatch decisions, predictor error and per-class panels."""

from __future__ import annotations

from rps_astro_cli.bench.config import BenchConfig
from rps_astro_cli.bench.metrics import all_metrics
from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.bench.report import report_dict
from rps_astro_cli.bench.report_html import load_over_time, log_worthy, plots
from rps_astro_cli.bench.report_md import markdown, summary_rows
from rps_astro_cli.bench.runner import BenchResult, RunResult


def _rec(i: int, cls: str, rate: float = 1.0) -> RequestRecord:
    # TTFT 0.5 s, E2E 2 s; predicted 3 tokens for 4 actual → |3 − 4| / 4 = 25 % length error
    return RequestRecord(f"r{i}", req_class=cls, modality="text" if cls == "sand" else "image",
                         output_tokens=4, predicted_output_tokens=3, scheduled_s=i / rate, sent_s=i / rate,
                         first_token_s=i / rate + 0.5, finish_s=i / rate + 2.0, success=True)


def _result(classes: list[str], rates=(1.0,)) -> BenchResult:
    runs = []
    for rate in rates:
        recs = [_rec(i, c, rate) for i, c in enumerate(classes)]
        runs.append(RunResult(f"rr @ {rate:g}", "round_robin", None, rate, "poisson", all_metrics(recs), recs))
    return BenchResult(BenchConfig.flat(virtual=True), {"name": "w", "source": "s", "num_requests": len(classes),
                                                   "skipped": {}, "notes": {}}, {"mode": "virtual"}, runs)


def test_text_only_run_prints_no_sand_row_but_a_mix_does():
    rows = summary_rows(report_dict(_result(["sand", "sand"])))
    assert [r[1] for r in rows] == ["overall"]
    md = markdown(report_dict(_result(["sand", "sand"])))
    assert "| sand |" not in md
    mixed = summary_rows(report_dict(_result(["sand", "pebbles"])))
    assert [r[1] for r in mixed] == ["overall", "sand", "pebbles"]


def test_length_mape_is_printed_in_percent():
    md = markdown(report_dict(_result(["sand", "sand"])))
    assert "length MAPE %" in md
    row = next(line for line in md.splitlines() if line.startswith("| rr @ 1 | 1 |"))  # MAE 1 token
    assert "| 25.0% |" in row and "| 0.25 |" not in row


def test_latency_vs_rate_plot_has_plain_tick_labels():
    import base64

    import matplotlib
    import matplotlib.pyplot as plt

    matplotlib.use("Agg")
    captured = []
    orig = plt.Figure.savefig

    def spy(fig, *a, **k):
        fig.canvas.draw()
        for ax in fig.axes:
            if ax.get_yscale() == "log":
                captured.append([t.get_text() for t in ax.get_yticklabels(minor=False) if t.get_text()]
                                + [t.get_text() for t in ax.get_yticklabels(minor=True) if t.get_text()])
        return orig(fig, *a, **k)

    res = _result(["sand"] * 5, rates=(1.0, 2.0))
    for r in res.runs[1].records:  # the 2 req/s run 20× slower: latencies span more than a decade
        r.first_token_s, r.finish_s = r.sent_s + 10.0, r.sent_s + 40.0
    res.runs[1].metrics = all_metrics(res.runs[1].records)
    plt.Figure.savefig = spy
    try:
        figs = plots(report_dict(res), res)
    finally:
        plt.Figure.savefig = orig
    caption = dict((t, c) for t, _, c in figs)["Latency vs request rate"]
    assert "both y axes log" in caption
    assert all(base64.b64decode(b)[:4] == b"\x89PNG" for _, b, _ in figs)
    assert captured
    for labels in captured:
        assert labels and all("$" not in t and "^" not in t for t in labels), labels  # no 10^x mathtext


def test_default_report_folder_is_git_ignored():
    from pathlib import Path

    from rps_astro_cli.cli import bench

    ignore = (Path(__file__).resolve().parents[1] / ".gitignore").read_text().split()
    assert bench._DEFAULT_OUT + "/" in ignore


def test_latency_vs_rate_is_linear_when_the_values_span_less_than_a_decade():
    # 0.5 s TTFT and 2 s E2E at both rates: a log axis would look linear, so it is linear
    # and the caption says so (the caption once said "log scale" whatever the axis showed)
    assert not log_worthy([0.5, 0.5]) and not log_worthy([0.2, 1.9]) and log_worthy([0.2, 2.0])
    assert not log_worthy([None, 0.0, 3.0])  # zeros and gaps do not count
    res = _result(["sand"] * 5, rates=(1.0, 2.0))
    caption = {t: c for t, _, c in plots(report_dict(res), res)}["Latency vs request rate"]
    assert "both y axes linear" in caption and "log scale)" not in caption


def test_load_over_time_is_the_in_flight_step_function():
    # instance a: r0 sent 0 finished 2, r1 sent 1 finished 3; instance b: r2 sent 1 finished 1.5;
    # r3 has no instance (left out); at t=2 on a: one finished → 1 in flight
    recs = [RequestRecord("r0", sent_s=0.0, finish_s=2.0, instance="a"),
            RequestRecord("r1", sent_s=1.0, finish_s=3.0, instance="a"),
            RequestRecord("r2", sent_s=1.0, finish_s=1.5, instance="b"),
            RequestRecord("r3", sent_s=0.5, finish_s=0.7)]
    load = load_over_time(recs)
    assert load == {"a": ([0.0, 0.0, 1.0, 2.0, 3.0], [0, 1, 2, 1, 0]), "b": ([0.0, 1.0, 1.5], [0, 1, 0])}
    # a finish and a send at the same instant: the finish first (never a false peak of 2)
    same = load_over_time([RequestRecord("x", sent_s=0.0, finish_s=1.0, instance="a"),
                           RequestRecord("y", sent_s=1.0, finish_s=2.0, instance="a")])
    assert max(same["a"][1]) == 1


def test_instance_dispatch_predictor_and_class_panels_appear_with_their_data():
    res = _result(["sand", "pebbles", "rocks", "sand"])
    titles = [t for t, _, _ in plots(report_dict(res), res)]
    assert "Per-class latency" in titles and "Per-class TTFT CDFs" in titles
    assert not {"Per-instance load over time", "Dispatch decisions", "Predictor error"} & set(titles)
    for i, r in enumerate(res.runs[0].records):
        r.instance = f"i{i % 2}"
        r.predicted_e2e_s = 2.5
    figs = {t: c for t, _, c in plots(report_dict(res), res)}
    assert {"Per-instance load over time", "Dispatch decisions", "Predictor error"} <= set(figs)
    assert "predicted lengths" in figs["Predictor error"]
    one_class = _result(["sand"] * 3)
    assert "Per-class TTFT CDFs" not in [t for t, _, _ in plots(report_dict(one_class), one_class)]
