"""report.md wording: one class → no class row repeating "overall"; MAPE printed in percent;
readable tick labels on the log-scale latency-vs-rate plot."""

from __future__ import annotations

from rps_astro_cli.bench.config import BenchConfig
from rps_astro_cli.bench.metrics import all_metrics
from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.bench.report import markdown, plots, report_dict, summary_rows
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
    plt.Figure.savefig = spy
    try:
        figs = plots(report_dict(res), res)
    finally:
        plt.Figure.savefig = orig
    assert "Latency vs request rate" in [t for t, _ in figs]
    assert all(base64.b64decode(b)[:4] == b"\x89PNG" for _, b in figs)
    assert captured
    for labels in captured:
        assert labels and all("$" not in t and "^" not in t for t in labels), labels  # no 10^x mathtext


def test_default_report_folder_is_git_ignored():
    from pathlib import Path

    from rps_astro_cli.cli import bench

    ignore = (Path(__file__).resolve().parents[1] / ".gitignore").read_text().split()
    assert bench._DEFAULT_OUT + "/" in ignore
