"""report.html of a bench run (`bench.report`'s module docstring): report.md rendered,
and the matplotlib plots embedded as PNG, each with its caption."""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any

from rps_astro_cli.bench.report_md import _cell, _find

# -- plots -----------------------------------------------------------------------------------

def _png(fig) -> str:
    buf = io.BytesIO()
    fig.tight_layout()  # panel titles and axis labels clear of their neighbours
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _legend(ax) -> None:
    """A legend only when something is labelled (matplotlib warns "No artists with labels")."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


LOG_SPAN = 10.0  # a latency axis is log-scaled only when its values span at least this factor


def log_worthy(values: list[float | None]) -> bool:
    """Whether a latency axis over `values` reads better log-scaled: positive values spanning
    ≥ `LOG_SPAN` × (narrower, a log axis looks linear and its caption would mislead)."""
    v = [x for x in values if isinstance(x, (int, float)) and x > 0 and math.isfinite(x)]
    return len(v) > 1 and max(v) / min(v) >= LOG_SPAN


def load_over_time(records, step_s: float | None = None) -> dict[str, tuple[list[float], list[int]]]:
    """Requests in flight per instance: instance → (times, counts) as a step function that
    rises at each request's send and falls at its finish (failed requests at their
    finish too; unfinished ones never fall). Records without an instance are left out."""
    events: dict[str, list[tuple[float, int]]] = {}
    for r in records:
        if r.instance is None:
            continue
        ev = events.setdefault(str(r.instance), [])
        ev.append((r.sent_s, 1))
        if r.finish_s is not None:
            ev.append((r.finish_s, -1))
    out: dict[str, tuple[list[float], list[int]]] = {}
    for inst, ev in sorted(events.items()):
        ev.sort(key=lambda e: (e[0], e[1]))  # a finish before a send at the same instant
        ts, ns, n = [0.0], [0], 0
        for t, d in ev:
            n += d
            ts.append(t)
            ns.append(n)
        out[inst] = (ts, ns)
    return out


def plots(rep: dict[str, Any], result) -> list[tuple[str, str, str]]:
    """(title, base64 PNG, caption) plots: latency CDFs; latency vs request rate per
    policy; per-instance load over time; dispatch decisions per instance; predictor error
    (runs with per-request predictions); per-class panels (workloads with classes). Each
    caption says what its axes are, their scale included."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out: list[tuple[str, str, str]] = []
    with_recs = [r for r in result.runs if r.records][:8]
    if with_recs:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        for run in with_recs:
            for ax, key in zip(axes, ("ttft_s", "e2e_s")):
                v = np.sort([x for x in (getattr(r, key) for r in run.records) if x is not None])
                if len(v):
                    ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=run.label)
        for ax, name in zip(axes, ("TTFT (s)", "E2E (s)")):
            ax.set_xlabel(name)
            ax.set_ylabel("share of completed requests")
            ax.grid(alpha=0.3)
        _legend(axes[0])
        out.append(("Latency CDFs", _png(fig),
                    "Share of completed requests (y, 0–1) whose TTFT (left) / E2E latency (right) is at most x "
                    "seconds (linear axes), one line per run; a line further left is faster."))
    series: dict[str, list[tuple[float, float | None, float | None]]] = {}
    for run in rep["runs"]:
        if isinstance(run["rate_rps"], (int, float)):
            m = run["metrics"]["overall"]
            key = run["label"].split(" @ ")[0]
            series.setdefault(key, []).append((run["rate_rps"], m["ttft_s"]["p99"], m["e2e_s"]["mean"]))
    if any(len(v) > 1 for v in series.values()):
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        for key, pts in series.items():
            pts.sort()
            axes[0].plot([p[0] for p in pts], [p[1] if p[1] is not None else np.nan for p in pts], "o-", label=key)
            axes[1].plot([p[0] for p in pts], [p[2] if p[2] is not None else np.nan for p in pts], "o-", label=key)
        axes[0].set_ylabel("P99 TTFT (s)")
        axes[1].set_ylabel("mean E2E (s)")
        goals = {(c["metric"], c["percentile"], c["threshold_s"]) for c in rep.get("capacity") or []}
        goal_txt = ""
        for metric, q, thr in goals:  # the capacity goal, drawn where the panel shows its statistic
            if metric == "ttft" and q == 99 and isinstance(thr, (int, float)):
                axes[0].axhline(thr, color="r", ls=":", lw=1, label=f"goal: P99 TTFT ≤ {thr:g} s")
                goal_txt = f"; the red dotted line is the capacity goal P99 TTFT ≤ {thr:g} s"
        from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

        scales = []
        for j, ax in enumerate(axes):
            ax.set_xlabel("request rate (req/s)")
            ax.grid(alpha=0.3)
            if log_worthy([p[1 + j] for pts in series.values() for p in pts]):
                ax.set_yscale("log")
                # plain "0.5", "2", "10" labels at 1-2-5 steps; no crowded minor-tick labels
                ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
                ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
                ax.yaxis.set_minor_formatter(NullFormatter())
                scales.append("log")
            else:
                scales.append("linear")
        _legend(axes[0])
        scale = (f"both y axes {scales[0]}" if scales[0] == scales[1]
                 else f"TTFT y axis {scales[0]}, E2E y axis {scales[1]}")
        out.append(("Latency vs request rate", _png(fig),
                    f"P99 TTFT (left) and mean E2E latency (right), seconds, at each offered request rate "
                    f"(x, linear), one line per dispatch policy ({scale}: a y axis is log-scaled only when its "
                    f"values span ≥ {LOG_SPAN:g}×){goal_txt}; where a line turns up steeply the cluster saturates."))
    inst_runs = [r for r in with_recs if any(x.instance is not None for x in r.records)][:4]
    if inst_runs:
        cols = min(2, len(inst_runs))
        rows = (len(inst_runs) + cols - 1) // cols
        fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
        for ax, run in zip(axes.flat, inst_runs):
            load = load_over_time(run.records)
            for inst, (ts, ns) in list(load.items())[:16]:
                ax.step(ts, ns, where="post", label=inst, lw=1)
            ax.set_title(run.label, fontsize=8)
            ax.set_xlabel("time since the run's start (s)")
            ax.set_ylabel("requests in flight")
            ax.grid(alpha=0.3)
            if len(load) <= 8:
                _legend(ax)
        for ax in list(axes.flat)[len(inst_runs):]:
            ax.set_visible(False)
        out.append(("Per-instance load over time", _png(fig),
                    "Requests in flight on each instance (y: sent and not yet finished, linear) over the run's "
                    "time (x, seconds from its start, linear), one line per instance (at most 16), one panel per "
                    "run (at most 4); lines that stay together mean an even load."))
        fig, ax = plt.subplots(figsize=(10, 3.2))
        insts = sorted({str(x.instance) for r in inst_runs for x in r.records if x.instance is not None})[:32]
        width = 0.8 / len(inst_runs)
        for j, run in enumerate(inst_runs):
            counts = [sum(1 for x in run.records if str(x.instance) == i) for i in insts]
            ax.bar(np.arange(len(insts)) + j * width, counts, width, label=run.label)
        ax.set_xticks(np.arange(len(insts)) + 0.4 - width / 2, insts, rotation=30 if len(insts) > 8 else 0,
                      fontsize=7)
        ax.set_ylabel("requests dispatched")
        ax.grid(alpha=0.3, axis="y")
        _legend(ax)
        out.append(("Dispatch decisions", _png(fig),
                    "Requests each instance was sent (y, linear), one bar per run: how the dispatch policy "
                    "split the load (an even split is the goal only when the instances and requests are alike)."))
    pred_runs = [r for r in with_recs if any(x.predicted_e2e_s is not None and x.e2e_s is not None
                                             for x in r.records)]
    if pred_runs:
        lengths = ("oracle lengths (the dispatcher knew every reply's true length)"
                   if _find(rep.get("config"), "oracle_lengths") else "predicted lengths (the length tagger's)")
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        hi = 0.0
        for run in pred_runs:
            pairs = [(x.predicted_e2e_s, x.e2e_s) for x in run.records
                     if x.predicted_e2e_s is not None and x.e2e_s is not None]
            p, a = np.array([q[0] for q in pairs]), np.array([q[1] for q in pairs])
            axes[0].scatter(a, p, s=6, alpha=0.6, label=run.label)
            hi = max(hi, float(a.max()), float(p.max()))
            rel = np.sort((p[a > 0] - a[a > 0]) / a[a > 0] * 100)
            if len(rel):
                axes[1].plot(rel, np.arange(1, len(rel) + 1) / len(rel), label=run.label)
        axes[0].plot([0, hi], [0, hi], "k--", lw=0.8, label="predicted = observed")
        axes[0].set_xlabel("observed E2E (s)")
        axes[0].set_ylabel("predicted E2E (s)")
        axes[1].set_xlabel("(predicted − observed) / observed E2E (%)")
        axes[1].set_ylabel("share of requests")
        axes[1].axvline(0, color="k", lw=0.8)
        for ax in axes:
            ax.grid(alpha=0.3)
        _legend(axes[0])
        out.append(("Predictor error", _png(fig),
                    "Left: the dispatcher's E2E prediction for the instance it chose (y) against the E2E observed "
                    "(x), one dot per request, seconds, linear axes; dots on the dashed line were predicted "
                    "exactly. Right: CDF of the signed relative error (x, %, linear; right of 0 predicted too "
                    f"slow). With {lengths}."))
    class_runs = [r for r in rep["runs"] if len(r["metrics"]) > 2][:4]
    if class_runs:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        width = 0.8 / len(class_runs)
        for j, run in enumerate(class_runs):
            groups = [g for g in ("sand", "pebbles", "rocks") if g in run["metrics"]]
            x = np.arange(len(groups)) + j * width
            for ax, key in zip(axes, ("ttft_s", "normalized_s_per_token")):
                vals = [run["metrics"][g][key]["mean"] or 0 for g in groups]
                ax.bar(x, vals, width, label=run["label"])
                ax.set_xticks(np.arange(len(groups)) + 0.4 - width / 2, groups)
        axes[0].set_ylabel("mean TTFT (s)")
        axes[1].set_ylabel("mean normalized latency (s/token)")
        _legend(axes[0])
        out.append(("Per-class latency", _png(fig),
                    "Mean TTFT (left, s) and mean normalized latency (right: E2E / output tokens, s/token) per "
                    "request class (sand = text, pebbles = image, rocks = video), one bar per run, linear axes."))
        cls_recs = [r for r in with_recs if len({x.req_class for x in r.records}) > 1][:8]
        classes = [c for c in ("sand", "pebbles", "rocks") if any(x.req_class == c for r in cls_recs
                                                                    for x in r.records)]
        if cls_recs and classes:
            fig, axes = plt.subplots(1, len(classes), figsize=(3.6 * len(classes), 3.2), squeeze=False)
            for ax, c in zip(axes[0], classes):
                for run in cls_recs:
                    v = np.sort([x.ttft_s for x in run.records if x.req_class == c and x.ttft_s is not None])
                    if len(v):
                        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=run.label)
                ax.set_title(c, fontsize=9)
                ax.set_xlabel("TTFT (s)")
                ax.set_ylabel("share of requests")
                ax.grid(alpha=0.3)
            _legend(axes[0][0])
            out.append(("Per-class TTFT CDFs", _png(fig),
                        "One panel per request class: share of its completed requests (y, 0–1) whose TTFT is at "
                        "most x seconds (linear axes), one line per run; RPS-Serve aims to pull sand (text) left "
                        "without pushing pebbles and rocks far right."))
    return out


def md_to_html(md: str) -> str:
    """report.md rendered by markdown-it-py (CommonMark + tables), raw HTML in it escaped."""
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": False}).enable("table").render(md)


# click a plot: shown at its full resolution (scroll sideways); click again: fitted to the page
_ZOOM_JS = ("document.querySelectorAll('figure img').forEach(function(i){i.title='click to zoom';"
            "i.onclick=function(){i.parentNode.classList.toggle('zoom')}})")


def html_report(rep: dict[str, Any], result, md: str) -> str:
    """report.html: report.md rendered, then each plot as a figure with its caption (a click
    on a plot shows it at full resolution)."""
    try:
        figs = plots(rep, result)
    except Exception as exc:  # a plot must never lose the report
        figs = []
        md += f"\n(plots unavailable: {type(exc).__name__}: {_cell(exc)})\n"
    def figure(t: str, b: str, c: str) -> str:
        return (f"<figure><h2>{html.escape(t)}</h2><div class='plot'><img alt='{html.escape(t)}' "
                f"src='data:image/png;base64,{b}'/></div><figcaption>{html.escape(c)}</figcaption></figure>")

    body = md_to_html(md)
    cap_at = body.find("<h2>SLO capacity</h2>") if rep.get("capacity") else -1
    end = body.find("</table>", cap_at) if cap_at >= 0 else -1
    up = [f for f in figs if f[0] == "Latency vs request rate"] if end >= 0 else []
    if up:  # a capacity run: its latency-vs-rate plot right below the capacity table (the answer first)
        end += len("</table>")
        body = body[:end] + figure(*up[0]) + body[end:]
    imgs = "\n".join(figure(*f) for f in figs if f not in up)
    style = ("body{font-family:sans-serif;margin:2em;max-width:1200px}table{border-collapse:collapse;font-size:12px;"
             "margin-bottom:1em}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}"
             "blockquote{border-left:4px solid #d90;margin:0.5em 0;padding:0.2em 1em;background:#fff8e6}"
             "figure{margin:1em 0}.plot{overflow-x:auto}img{max-width:100%;cursor:zoom-in}"
             "figure.zoom img{max-width:none;width:200%;cursor:zoom-out}"
             "figcaption{font-size:13px;color:#444;max-width:900px}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>astro bench</title>"
            f"<style>{style}</style></head><body>{body}{imgs}<script>{_ZOOM_JS}</script></body></html>")
