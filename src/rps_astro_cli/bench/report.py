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

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from rps_astro_cli import __version__
from rps_astro_cli.bench.report_html import html_report
from rps_astro_cli.bench.report_md import markdown

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
