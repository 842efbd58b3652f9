"""report.md of a bench run (`bench.report`'s module docstring): the tables, and the
helpers that format a figure or say why it is "n/a"."""

from __future__ import annotations

import math
from typing import Any

from rps_astro_cli.bench.capacity import STEADY_MIN_RATIO
from rps_astro_cli.bench.metrics import top_errors

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


def _find(d: Any, key: str) -> Any:
    """The first value of `key` in a nested mapping (the config's sections), else None."""
    if isinstance(d, dict):
        if key in d:
            return d[key]
        for v in d.values():
            if (hit := _find(v, key)) is not None:
                return hit
    return None
