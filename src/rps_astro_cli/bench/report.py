"""The report folder of a bench run.

- `report.json` (schema "astro.bench/1"):

      {"schema": "astro.bench/1", "created_unix_s": float, "astro_version": str,
       "command": [argv...] | null,
       "config": {...BenchConfig, api_key removed...},   # repeat a run from it (seed included)
       "workload": {name, source, num_requests, modalities, skipped, notes, warnings,
                    has_timestamps},
       "target": {"mode": "live"|"virtual", ...URLs / profile / policy / instances},
       "runs": [{"label", "policy", "k", "rate_rps", "arrival", "wall_s",
                 "metrics": {"overall"|"sand"|"pebbles"|"rocks": GroupMetrics},
                 "extras": {...scraped figures...}}],
       "capacity": [{"label", "goal", "metric", "percentile", "threshold_s",
                     "capacity_rps", "interpolated_rps", "probes": [...], "note"}],
       "exit_code": int, "exit_reasons": [str], "warnings": [str]}

  GroupMetrics fields (seconds unless named otherwise; null = "n/a"): num_requests,
  num_completed, num_failed, duration_s, ttft_s / tpot_s / itl_s / e2e_s /
  normalized_s_per_token as {count, mean, p50, p90, p99}, throughput_rps,
  output_tokens_per_s, total_output_tokens, slo {good, violation_rate, goodput_rps,
  per_metric{m: {violations, rate, severity_mean_s}}} | null, preemptions,
  length_mae_tokens, length_mape, predictor_e2e_mae_s, predictor_e2e_mape,
  predictor_ttft_mae_s, errors {text: count}. Formulas: `metrics.py`, docs/metrics.md.
- `requests.jsonl`: one `RequestRecord.to_dict()` per line plus `"run"` (the run label),
  for every run that kept its records (capacity probes keep metrics only).
- `report.md`: the tables (`markdown`: a capacity run opens with its answer, the SLO capacity
  table, then the policies at their capacity, the setup and the per-probe detail; runs policy
  by policy, rates ascending; a figure the mode does not measure is left out and every "n/a"
  says why). `report.html`: the tables and matplotlib plots embedded as PNG (a capacity run's
  latency-vs-rate plot right below its capacity table),
  each with a caption that names its axes and their scale (`plots`: latency CDFs; TTFT/E2E
  vs rate per policy; per-instance load over time; dispatch decisions per instance;
  predictor error; per-class bars and TTFT CDFs); a click on a plot zooms it.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from rps_astro_cli import __version__
from rps_astro_cli.bench.capacity import STEADY_MIN_RATIO
from rps_astro_cli.bench.metrics import top_errors

SCHEMA = "astro.bench/1"


def _clean(o: Any) -> Any:
    if isinstance(o, float):
        return o if math.isfinite(o) else ("inf" if o > 0 else "-inf" if o < 0 else None)
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, Path):
        return str(o)
    return o


def report_dict(result) -> dict[str, Any]:
    """The report.json mapping of a `BenchResult` (module docstring)."""
    return _clean({
        "schema": SCHEMA, "created_unix_s": time.time(), "astro_version": __version__,
        "command": list(sys.argv) if sys.argv and sys.argv[0].endswith("astro") else None,
        "config": result.config.to_dict(), "workload": result.workload, "target": result.target,
        "runs": [r.summary() for r in result.runs],
        "capacity": [c.to_dict() for c in result.capacity],
        "exit_code": result.exit_code, "exit_reasons": result.exit_reasons, "warnings": result.warnings,
    })


OUT_FIX = "name a folder, new or existing, that you can write, e.g. --out bench-results/run1"


def check_out_dir(out_dir: Path) -> None:
    """Check, before a run starts, that the report can be written into `out_dir`: it is a
    folder or can be created as one, and a file can be created in it. Leaves nothing
    behind: the folders it made for the check and its probe file are removed.

    Raises:
        AstroUserError: names --out, the reason and the fix.
    """
    import os
    import tempfile

    from rps_astro_cli.errors import AstroUserError

    p = Path(out_dir).expanduser()
    if p.exists() and not p.is_dir():
        raise AstroUserError(f"{p} is a file, not a folder (the report is a folder of files: report.json, "
                             "report.md, ...)", field="--out", fix=OUT_FIX)
    missing: list[Path] = []
    q = p
    while not os.path.lexists(q) and q != q.parent:  # lexists: a dangling link is not missing
        missing.append(q)
        q = q.parent
    made: list[Path] = []
    try:
        for d in reversed(missing):
            d.mkdir()
            made.append(d)
        with tempfile.NamedTemporaryFile(dir=p, prefix=".astro-write-check-"):
            pass
    except OSError as exc:
        what = "cannot create the report folder" if missing else "cannot write into the report folder"
        raise AstroUserError(f"{what} {p} ({exc.strerror or type(exc).__name__}"
                             + (f": {exc.filename}" if exc.filename and str(exc.filename) != str(p) else "") + ")",
                             field="--out", fix=OUT_FIX) from None
    finally:
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:
                pass


def write_report(result, out_dir: Path) -> Path:
    """Write report.json, requests.jsonl, report.md and report.html into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rep = report_dict(result)
    (out_dir / "report.json").write_text(json.dumps(rep, indent=1))
    with (out_dir / "requests.jsonl").open("w") as fh:
        for run in result.runs:
            for rec in run.records:
                d = rec.to_dict()
                d["itl_s"] = [round(x, 6) for x in d["itl_s"]]  # µs resolution keeps the file small
                fh.write(json.dumps(_clean({"run": run.label, **d})) + "\n")
    write_csv(rep, result, out_dir)
    md = markdown(rep)
    (out_dir / "report.md").write_text(md)
    (out_dir / "report.html").write_text(html_report(rep, result, md))
    return out_dir


CSV_STATS = ("mean", "p50", "p90", "p99")
CSV_DISTS = ("ttft_s", "tpot_s", "itl_s", "e2e_s", "normalized_s_per_token")
CSV_SCALARS = ("num_requests", "num_completed", "num_failed", "duration_s", "throughput_rps",
               "output_tokens_per_s", "total_output_tokens", "preemptions")
REQUEST_CSV_COLUMNS = ("run", "request_id", "modality", "req_class", "success", "prompt_tokens", "output_tokens",
                       "expected_output_tokens", "scheduled_s", "sent_s", "ttft_s", "tpot_s", "e2e_s",
                       "instance", "finish_reason", "error")


def write_csv(rep: dict[str, Any], result, out_dir: Path) -> None:
    """summary.csv: one row per (run, group), every number in full (seconds; empty =
    n/a); requests.csv: one row per request with its per-request metrics."""
    import csv

    with (out_dir / "summary.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["run", "group", "rate_rps", *CSV_SCALARS, *(f"{d[:-2]}_{s}_s" if d.endswith("_s") else f"{d}_{s}"
                                                                for d in CSV_DISTS for s in CSV_STATS),
                    "slo_violation_rate", "goodput_rps", "ttft_definition"])
        tdef = rep["config"].get("ttft_definition") if (rep.get("target") or {}).get("mode") != "virtual" else ""
        for run in rep["runs"]:
            for g, m in run["metrics"].items():
                slo = m.get("slo") or {}
                w.writerow([run["label"], g, run["rate_rps"], *(_csv(m.get(k)) for k in CSV_SCALARS),
                            *(_csv(m[d][s]) for d in CSV_DISTS for s in CSV_STATS),
                            _csv(slo.get("violation_rate")), _csv(slo.get("goodput_rps")), tdef])
    with (out_dir / "requests.csv").open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(REQUEST_CSV_COLUMNS)
        for run in result.runs:
            for r in run.records:
                d = {"run": run.label, **r.to_dict()}
                w.writerow([_csv(d.get(c)) for c in REQUEST_CSV_COLUMNS])


def _csv(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("inf" if v > 0 else "-inf")
    return str(v)


# -- tables ----------------------------------------------------------------------------------

def fmt(v: Any, scale: float = 1.0, digits: int = 3) -> str:
    """Number → short text; None → "n/a"."""
    if v is None:
        return "n/a"
    if isinstance(v, str):
        return v
    if isinstance(v, float) and not math.isfinite(v):
        return "inf"
    x = v * scale
    if isinstance(v, int) and scale == 1.0:
        return str(v)
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"


SUMMARY_COLUMNS = ("run", "group", "ok/all", "req/s", "out tok/s", "TTFT mean", "TTFT p99", "TPOT mean",
                   "ITL p99", "E2E mean", "E2E p99", "norm s/tok", "SLO viol", "goodput", "preempt")


def groups(run: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(group, metrics) to print for a run: "overall", plus one row per class only when
    the run has more than one class (a single class's row would repeat "overall")."""
    items = list(run["metrics"].items())
    return items if len(items) > 2 else [(g, m) for g, m in items if g == "overall"]


def pct(v: float | None) -> str:
    """Fraction → "12.3%"; None → "n/a"."""
    return "n/a" if v is None else f"{100 * v:.1f}%"


def summary_rows(rep: dict[str, Any]) -> list[list[str]]:
    """One row per (run, group) of `groups`: the summary table (seconds; rates per second)."""
    rows = []
    for run in rep["runs"]:
        for g, m in groups(run):
            slo = m.get("slo") or {}
            rows.append([run["label"], g, f"{m['num_completed']}/{m['num_requests']}",
                         fmt(m["throughput_rps"]), fmt(m["output_tokens_per_s"]),
                         fmt(m["ttft_s"]["mean"]), fmt(m["ttft_s"]["p99"]), fmt(m["tpot_s"]["mean"]),
                         fmt(m["itl_s"]["p99"]), fmt(m["e2e_s"]["mean"]), fmt(m["e2e_s"]["p99"]),
                         fmt(m["normalized_s_per_token"]["mean"]),
                         "n/a" if slo.get("violation_rate") is None else f"{100 * slo['violation_rate']:.1f}%",
                         fmt(slo.get("goodput_rps")), fmt(m.get("preemptions"))])
    return rows


def _cell(v: Any) -> str:
    """Text safe inside a Markdown table cell: one line, `|` escaped, Markdown's emphasis
    and code characters escaped (a model name like `a*b` stays literal)."""
    text = " ".join(str(v).split())
    for ch in ("\\", "|", "*", "`", "<", ">", "[", "]"):
        text = text.replace(ch, "\\" + ch)
    return text


def _md_table(header: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_cell(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def plain(v: Any) -> str:
    """A value as words for a person: dicts as "k: v, k: v", lists joined with ", ",
    None as "none" (never a Python repr or JSON)."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {plain(x)}" for k, x in v.items()) or "none"
    if isinstance(v, (list, tuple)):
        return ", ".join(plain(x) for x in v) or "none"
    if isinstance(v, float):
        return fmt(v)
    return str(v)


def setup_rows(rep: dict[str, Any]) -> list[list[str]]:
    """The report's setup as (setting, value) rows: workload, data, sampling, target,
    units, TTFT/ITL definition, reply lengths, send lag, seed, SLO."""
    wl, tg, cfg = rep["workload"], rep["target"], rep["config"]
    slo = plain(cfg.get("slo")) + ("" if cfg.get("slo_scale") is None else f"; E2E ≤ {cfg['slo_scale']} × isolated")
    rows = [["workload", f"{wl['name']}: {wl['num_requests']} requests ({plain(wl.get('modalities') or {})})"],
            ["data", str(wl.get("source"))],
            ["sampling", "vllm (as vllm bench serve: same filter, order and send plan for the seed)"
             if cfg.get("sampling") == "vllm" else "astro"],
            ["skipped", plain(wl.get("skipped") or None)], ["adjusted", plain(wl.get("notes") or None)]]
    rows += [[f"target {k}", plain(v)] for k, v in tg.items() if k not in ("recipe", "reply_lengths")]
    rows += [["units", time_unit(rep)], ["TTFT/ITL definition", ttft_definition_text(rep)],
             ["reply lengths", reply_lengths_text(rep)], ["bench send lag", send_lag_text(rep)],
             ["seed", str(cfg.get("seed"))], ["SLO", slo]]
    return rows


def time_unit(rep: dict[str, Any]) -> str:
    """How the report's times are measured: "latencies in s", or for a live sim cluster
    with time_scale ≠ 1 the engine-seconds statement (see `live.py`)."""
    ts = (rep.get("target") or {}).get("time_scale", 1.0)
    if ts in (None, 1, 1.0):
        return "latencies in s"
    return (f"times in ENGINE seconds: wall ÷ time_scale {ts:g} (the sim engines run "
            f"{1 / ts:g}× real time); rates in engine req/s")


TTFT_DEFINITION_TEXT = {
    "astro": "astro (TTFT at the first chunk with non-empty text; ITL between text chunks; E2E at the last text chunk)",
    "vllm": "vllm (as vllm bench serve: TTFT at the first chunk with choices, whatever its text; every later "
            "chunk an ITL gap; E2E at the last such chunk)",
}


def ttft_definition_text(rep: dict[str, Any]) -> str:
    """How TTFT/ITL were measured, in words (every report says it)."""
    tg = rep.get("target") or {}
    if tg.get("mode") == "virtual":
        return "virtual run: simulated token times (no stream; both definitions coincide)"
    d = (rep.get("config") or {}).get("ttft_definition") or tg.get("ttft_definition") or "astro"
    return TTFT_DEFINITION_TEXT.get(d, d)


def reply_lengths_text(rep: dict[str, Any]) -> str:
    """The sim engines' reply-length source and the check of it over the runs."""
    tg = rep.get("target") or {}
    src = tg.get("reply_lengths") or ("the dataset's reply length (virtual cluster)" if tg.get("mode") == "virtual"
                                      else na("the target did not say how it sets reply lengths"))
    eq = sum((r.get("extras") or {}).get("outputs_equal_expected") or 0 for r in rep["runs"])
    done = sum((r.get("extras") or {}).get("outputs_completed") or 0 for r in rep["runs"])
    return f"{src}; {eq} of {done} completed replies had exactly the dataset's length" if done else src


def send_lag_text(rep: dict[str, Any]) -> str:
    """The bench's own send lag (planned → actual send), worst run."""
    p99 = [x for x in ((r.get("extras") or {}).get("send_lag_s_p99") for r in rep["runs"]) if x is not None]
    mx = [x for x in ((r.get("extras") or {}).get("send_lag_s_max") for r in rep["runs"]) if x is not None]
    if not p99:
        return na("no run sent a request")
    return f"P99 {max(p99) * 1e3:.0f} ms, max {max(mx) * 1e3:.0f} ms (worst run)"


def markdown(rep: dict[str, Any]) -> str:
    """report.md text. A capacity run opens with its answer: the SLO capacity table
    (probes by rate), the policies compared at their capacity, then the setup and the
    per-probe detail; any other run opens with its setup and summary. Runs are listed
    policy by policy, rates ascending; a row or column that means nothing for the run's
    mode is left out (ITL in a virtual run), and every "n/a" says why."""
    lines = ["# astro bench report", ""]
    warn = [line for w in rep.get("warnings") or [] for line in (f"> **warning:** {_cell(w)}", "")]
    setup = ["## Setup", "", _md_table(("setting", "value"), setup_rows(rep)), ""]
    if rep["capacity"]:
        lines += capacity_lines(rep) + warn + comparison_lines(rep) + setup
        lines += probe_lines(rep)
        detail = " per probe"
    else:
        lines += setup + warn
        detail = ""
    lines += [f"## Summary{detail} (seconds)", "", summary_table(rep), ""]
    lines += [f"## Percentiles{detail} (seconds)", "", percentile_table(rep), ""]
    slo_rows = []
    for run in ordered_runs(rep):
        for g, m in groups(run):
            for met, s in ((m.get("slo") or {}).get("per_metric") or {}).items():
                slo_rows.append([run["label"], g, met, str(s["violations"]),
                                 na("no request completed") if s["rate"] is None else f"{100 * s['rate']:.1f}%",
                                 na("no violations") if s["severity_mean_s"] is None else fmt(s["severity_mean_s"])])
    if slo_rows:
        lines += ["## SLO violations per metric (over completed requests)", "",
                  _md_table(("run", "group", "metric", "violations", "rate", "severity mean s"), slo_rows), ""]
    lines += ["## Prediction, dispatch and failures", "", *prediction_lines(rep), ""]
    fail_rows = [[run["label"], g, str(m["num_failed"]), top_errors(m.get("errors") or {}, k=5)]
                 for run in ordered_runs(rep) for g, m in run["metrics"].items()
                 if g == "overall" and m.get("num_failed")]
    if fail_rows:
        lines += ["## Failed requests (top reasons)", "",
                  _md_table(("run", "group", "failed", "reasons"), fail_rows), ""]
    if rep["exit_reasons"]:
        lines += ["## Exit", ""] + [f"- {r}" for r in rep["exit_reasons"]]
    return "\n".join(lines) + "\n"


def na(reason: str) -> str:
    """"n/a" with its reason: the report never prints a bare "n/a"."""
    return f"n/a ({reason})"


def is_virtual(rep: dict[str, Any]) -> bool:
    return (rep.get("target") or {}).get("mode") == "virtual"


def variant(run: dict[str, Any]) -> str:
    """The policy variant of a run: its label before " @ " (a capacity result's label)."""
    return str(run["label"]).split(" @ ")[0]


def _rate_key(run: dict[str, Any]) -> float:
    r = run.get("rate_rps")
    return float(r) if isinstance(r, (int, float)) else math.inf


def ordered_runs(rep: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs policy by policy (in the order the policies ran), each policy's rates
    ascending (a capacity search probes them in search order: 8, 4, 2, 3, ...)."""
    first: dict[str, int] = {}
    for run in rep["runs"]:
        first.setdefault(variant(run), len(first))
    return sorted(rep["runs"], key=lambda run: (first[variant(run)], _rate_key(run)))


def _probe_run(rep: dict[str, Any], label: str, rate: float | None) -> dict[str, Any] | None:
    """The run of capacity result `label` at `rate` (None: no such run)."""
    if rate is None:
        return None
    return next((r for r in rep["runs"] if variant(r) == label and isinstance(r.get("rate_rps"), (int, float))
                 and math.isclose(r["rate_rps"], rate, rel_tol=1e-9)), None)


def _value_s(v: Any) -> str:
    if v is None:
        return na("no request produced this metric")
    return "inf (a request failed)" if v == "inf" else f"{fmt(v)} s"


def interpolated_reason(c: dict[str, Any]) -> str:
    """Why a capacity result has no interpolated rate (`capacity._interpolate`)."""
    probes = c["probes"]
    if c["capacity_rps"] is None:
        return "no probe met the goal"
    above = [p for p in probes if not p["meets"] and p["rate_rps"] > c["capacity_rps"]]
    if not above:
        return "no probe above the capacity missed the goal"
    v = min(above, key=lambda p: p["rate_rps"])["value_s"]
    if v is None or v == "inf":
        return "the first missing probe above it had a failed request (value ∞)"
    if isinstance(v, (int, float)) and v <= c["threshold_s"]:
        return "the first missing probe above it missed steady state, not the latency goal"
    return "the latency did not rise between the two probes around it"


def capacity_lines(rep: dict[str, Any]) -> list[str]:
    """The answer of a capacity run: one row per policy, probes by rate."""
    rows = []
    for c in rep["capacity"]:
        probes = sorted(c["probes"], key=lambda p: p["rate_rps"])
        lowest = min((p["rate_rps"] for p in probes), default=None)
        cap = (fmt(c["capacity_rps"]) if c["capacity_rps"] is not None
               else "none (no probe ran)" if lowest is None
               else f"none (missed the goal at every rate probed, down to {fmt(lowest)} req/s)")
        interp = (fmt(c["interpolated_rps"]) if c["interpolated_rps"] is not None
                  else na(interpolated_reason(c)))
        rows.append([c["label"], c["goal"], cap, interp,
                     ", ".join(f"{p['rate_rps']:.3g}:{'ok' if p['meets'] else 'miss'}" for p in probes),
                     c["note"] or "none"])
    order = ", ".join(f"{p['rate_rps']:.3g}" for p in rep["capacity"][0]["probes"]) if rep["capacity"] else ""
    return ["## SLO capacity", "",
            _md_table(("policy", "goal", "capacity req/s", "interpolated req/s", "probes (by rate)", "note"), rows),
            "", "Capacity: the highest rate probed that met the goal and reached steady state; interpolated: where "
            "the goal's latency crosses its threshold between the last passing and the first failing probe. "
            f"Probes are listed by rate (the search probed {rep['capacity'][0]['label']} in the order {order}).", ""]


def comparison_lines(rep: dict[str, Any]) -> list[str]:
    """The policies compared, each at its capacity (the highest passing probe)."""
    rows = []
    for c in rep["capacity"]:
        run = _probe_run(rep, c["label"], c["capacity_rps"])
        if run is None:
            why = na("no rate met the goal" if c["capacity_rps"] is None else "the probe's run is not in the report")
            rows.append([c["label"], fmt(c["capacity_rps"]) if c["capacity_rps"] is not None else why] + [why] * 5)
            continue
        m = run["metrics"]["overall"]
        rows.append([c["label"], fmt(c["capacity_rps"]), stat(m, "ttft_s", "p99", rep), stat(m, "ttft_s", "mean", rep),
                     stat(m, "e2e_s", "mean", rep), stat(m, "e2e_s", "p99", rep), achieved(run, rep)])
    return ["## Policy comparison at capacity (seconds)", "",
            _md_table(("policy", "capacity req/s", "TTFT p99", "TTFT mean", "E2E mean", "E2E p99",
                       "achieved req/s"), rows),
            "", "Each policy's figures at its capacity probe. " + ACHIEVED_NOTE, ""]


def probe_lines(rep: dict[str, Any]) -> list[str]:
    """Every capacity probe, by rate: the goal's value, the steady-state check (arrivals
    and completions per second over the second half of the arrivals), the verdict."""
    rows = []
    for c in rep["capacity"]:
        for p in sorted(c["probes"], key=lambda p: p["rate_rps"]):
            run = _probe_run(rep, c["label"], p["rate_rps"])
            st = (((run or {}).get("extras") or {}).get("capacity_probe") or {}).get("steady_state") or {}
            off, ach = st.get("offered_rps"), st.get("achieved_rps")
            nohalf = na("arrivals all at one instant: no second half to measure")
            if not st:
                off_s = ach_s = steady = na("the probe's run kept no steady-state check")
            else:
                off_s = fmt(off) if off is not None else nohalf
                ach_s = fmt(ach) if ach is not None else nohalf
                steady = "yes" if st.get("steady") else "no: requests beyond capacity queued"
                if st.get("short"):
                    steady += " (run too short to be sure)"
            if p["meets"]:
                verdict = "met"
            elif p["value_s"] is None or p["value_s"] == "inf" or p["value_s"] > c["threshold_s"]:
                verdict = "missed the latency goal"
            else:
                verdict = "missed steady state"
            rows.append([c["label"], fmt(p["rate_rps"]), _value_s(p["value_s"]), off_s, ach_s, steady, verdict])
    return ["## Capacity probes (by rate)", "",
            _md_table(("policy", "offered req/s", "goal value", "arrivals/s (2nd half)", "completions/s (2nd half)",
                       "steady state", "verdict"), rows),
            "", f"A probe meets the goal when its latency percentile is within the threshold and, over the second "
            f"half of its arrivals, completions keep up with arrivals (≥ {STEADY_MIN_RATIO:.0%} of them).", ""]


ACHIEVED_NOTE = ("achieved = completed requests ÷ (last finish − first send): a run's last replies finish after "
                 "its arrivals stop, so a short run reads below the offered rate even when nothing queued; "
                 "\"queue grew\" marks a capacity probe whose completions fell behind its arrivals.")


def stat(m: dict[str, Any], key: str, s: str, rep: dict[str, Any]) -> str:
    """A latency statistic, or "n/a" with why it has no value."""
    v = (m.get(key) or {}).get(s)
    if v is not None:
        return fmt(v)
    return na(NO_SAMPLES.get(key, "no samples") if m.get("num_completed") else "no request completed")


NO_SAMPLES = {"ttft_s": "no reply had a token", "tpot_s": "no reply had 2 or more tokens",
              "itl_s": "no reply streamed 2 or more chunks", "e2e_s": "no request completed",
              "normalized_s_per_token": "no reply had a token", "ttft_harness_s": "no engine arrival stamps"}


def achieved(run: dict[str, Any], rep: dict[str, Any]) -> str:
    """The completed throughput of a run, marked when its queue grew (capacity probes)."""
    m = run["metrics"]["overall"]
    if m.get("throughput_rps") is None:
        return na("no request completed")
    st = ((run.get("extras") or {}).get("capacity_probe") or {}).get("steady_state") or {}
    return fmt(m["throughput_rps"]) + (" (queue grew)" if st and not st.get("steady", True) else "")


def summary_table(rep: dict[str, Any]) -> str:
    """report.md's summary: `SUMMARY_COLUMNS` with the rate as offered and achieved, less
    the columns that mean nothing here (ITL in a virtual run, SLO columns without an
    SLO), each left out with a line that says why."""
    virtual = is_virtual(rep)
    has_slo = any((m.get("slo") or {}) for run in rep["runs"] for _, m in groups(run))
    header = ["run", "group", "ok/all", "offered req/s", "achieved req/s", "out tok/s", "TTFT mean", "TTFT p99",
              "TPOT mean", "ITL p99", "E2E mean", "E2E p99", "norm s/tok", "SLO viol", "goodput", "preempt"]
    rows = []
    for run in ordered_runs(rep):
        for g, m in groups(run):
            slo = m.get("slo") or {}
            rate = run.get("rate_rps")
            offered = fmt(rate) if isinstance(rate, (int, float)) else str(rate or run.get("arrival"))
            done = m["num_completed"]
            rows.append([run["label"], g, f"{done}/{m['num_requests']}", offered,
                         achieved(run, rep) if g == "overall" else
                         (fmt(m["throughput_rps"]) if m["throughput_rps"] is not None else na("no request completed")),
                         fmt(m["output_tokens_per_s"]) if m["output_tokens_per_s"] is not None
                         else na("no request completed"),
                         stat(m, "ttft_s", "mean", rep), stat(m, "ttft_s", "p99", rep), stat(m, "tpot_s", "mean", rep),
                         stat(m, "itl_s", "p99", rep), stat(m, "e2e_s", "mean", rep), stat(m, "e2e_s", "p99", rep),
                         stat(m, "normalized_s_per_token", "mean", rep),
                         (na("no request completed") if slo.get("violation_rate") is None
                          else f"{100 * slo['violation_rate']:.1f}%"),
                         fmt(slo.get("goodput_rps")) if slo.get("goodput_rps") is not None else na("no good request"),
                         fmt(m["preemptions"]) if m.get("preemptions") is not None
                         else na("not counted for a class" if g != "overall" else "no preemption counter")])
    drop = {"ITL p99": "ITL: not measured in a virtual run (simulated token times, no stream)"} if virtual else {}
    if not has_slo:
        drop.update({"SLO viol": "SLO viol, goodput: no SLO set (--slo)", "goodput": ""})
    keep = [i for i, h in enumerate(header) if h not in drop]
    notes = [f"Not shown: {w}." for w in drop.values() if w]
    return "\n\n".join([_md_table([header[i] for i in keep], [[r[i] for i in keep] for r in rows]),
                        ACHIEVED_NOTE[0].upper() + ACHIEVED_NOTE[1:], *notes])


def percentile_table(rep: dict[str, Any]) -> str:
    """One row per (run, group, metric); ITL left out of a virtual run (not measured)."""
    virtual = is_virtual(rep)
    prow = []
    for run in ordered_runs(rep):
        for g, m in groups(run):
            for key, name in (("ttft_s", "TTFT"), ("ttft_harness_s", "TTFT (harness)"), ("tpot_s", "TPOT"),
                              ("itl_s", "ITL"), ("e2e_s", "E2E"), ("normalized_s_per_token", "norm s/tok")):
                d = m.get(key)
                if d is None or (virtual and key == "itl_s"):  # harness TTFT: virtual runs only
                    continue
                prow.append([run["label"], g, name, str(d["count"]),
                             *(stat(m, key, s, rep) for s in ("mean", "p50", "p90", "p99"))])
    out = _md_table(("run", "group", "metric", "n", "mean", "p50", "p90", "p99"), prow)
    return out + ("\n\nNot shown: ITL, not measured in a virtual run (simulated token times, no stream)."
                  if virtual else "")


def lengths_label(rep: dict[str, Any]) -> str:
    """"oracle lengths" or "predicted lengths": what the Predictor was told of each reply's length."""
    return "oracle lengths" if _find(rep.get("config"), "oracle_lengths") else "predicted lengths"


def prediction_lines(rep: dict[str, Any]) -> list[str]:
    """The prediction / dispatch / failure table: the Predictor's error labelled with the
    lengths it was given; a column n/a in every run is left out with its reason."""
    virtual = is_virtual(rep)
    lengths = lengths_label(rep)
    header = ["run", "length MAE tok", "length MAPE %", f"predictor E2E MAE s ({lengths})",
              f"predictor E2E MAPE % ({lengths})", "sched overhead p50 ms", "sched overhead p99 ms", "decide p50 µs",
              "predictor CPU ms/query", "predictor CPU %", "errors"]
    rows = []
    for run in ordered_runs(rep):
        m = run["metrics"]["overall"]
        ex = run.get("extras") or {}
        disp = ex.get("dispatch") or {}
        pe = disp.get("predictor_e2e") or {}
        pol = run.get("policy") or variant(run)
        no_disp = "virtual run: no scheduler service" if virtual else "no dispatch decisions from the scheduler"
        no_pred = f"no Predictor asked: {pol} reads no predictions" if (virtual or disp) else no_disp
        no_len = "no reply-length predictions recorded" if not m.get("num_completed") or virtual or disp \
            else "no reply-length predictions recorded: none came from the scheduler"
        mae = m.get("predictor_e2e_mae_s") if m.get("predictor_e2e_mae_s") is not None else pe.get("mae_s")
        mape = m.get("predictor_e2e_mape") if m.get("predictor_e2e_mape") is not None else pe.get("mape")
        over = disp.get("overhead_ms") or {}
        dec = (ex.get("decide_us") or {}).get("p50") if ex.get("decide_us") \
            else _us((disp.get("decide_ms") or {}).get("p50"))
        cpu_why = ("virtual run: Predictors run in-process, not timed" if virtual
                   else "no Predictor metrics scraped: no Predictor services, or none asked")
        rows.append([run["label"],
                     _or(fmt, m.get("length_mae_tokens"), no_len), _or(pct, m.get("length_mape"), no_len),
                     _or(fmt, mae, no_pred), _or(pct, mape, no_pred),
                     _or(fmt, over.get("p50"), no_disp), _or(fmt, over.get("p99"), no_disp),
                     _or(fmt, dec, "no dispatch decisions timed"),
                     _or(fmt, ex.get("predictor_cpu_ms_per_query"), cpu_why),
                     _or(fmt, ex.get("predictor_cpu_percent_mean"), cpu_why),
                     top_errors(m.get("errors") or {}) or "none"])
    empty = [i for i in range(1, len(header)) if rows and all(r[i].startswith("n/a (") for r in rows)]
    notes = []
    for i in empty:
        reasons = sorted({r[i][len("n/a ("):-1] for r in rows})
        notes.append(f"- {header[i]}: {na('; '.join(reasons))} in every run")
    keep = [i for i in range(len(header)) if i not in empty]
    text = ("oracle lengths: the Predictor was given every reply's true length, so its E2E error is the latency "
            "model's alone (docs/metrics.md: about 5 % measured so)" if lengths == "oracle lengths"
            else "predicted lengths: the Predictor used the length tagger's predicted reply lengths, so its E2E "
            "error carries the tagger's length error (length MAPE column) and reads far above the oracle-length "
            "figures (docs/metrics.md: 5 % with oracle lengths, ~60 % with predicted ones)")
    out = [_md_table([header[i] for i in keep], [[r[i] for i in keep] for r in rows])]
    if 3 not in empty or 4 not in empty:  # some run has a Predictor error: say what lengths it was given
        out += ["", f"Predictor error with {text}."]
    if notes:
        out += ["", "Not shown:", "", *notes]
    return out


def _or(f: Any, v: Any, reason: str) -> str:
    return na(reason) if v is None else f(v)


def _us(ms: float | None) -> float | None:
    return None if ms is None else ms * 1000


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


def _find(d: Any, key: str) -> Any:
    """The first value of `key` in a nested mapping (the config's sections), else None."""
    if isinstance(d, dict):
        if key in d:
            return d[key]
        for v in d.values():
            if (hit := _find(v, key)) is not None:
                return hit
    return None


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
