"""BENCHMARKS.md is generated from benchmarks/results/*.json by scripts/results_page.py.

These tests are CI's check that the page matches the JSON, stays short, links only to
headings that exist in docs/experiments/, and that the renderer refuses bad input.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from conftest import REPO, load_script

rp = load_script("scripts/results_page.py", "results_page")

RESULTS = REPO / "benchmarks" / "results"
PAGE = REPO / "BENCHMARKS.md"
EXPERIMENTS = REPO / "docs" / "experiments"


def _raw_claims():
    out = []
    for path in sorted(RESULTS.glob("*.json")):
        for claim in json.loads(path.read_text(encoding="utf-8")):
            out.append((path.name, claim))
    return out


def test_benchmarks_md_equals_the_render_of_the_results():
    rendered = rp.render(rp.load_results(RESULTS), EXPERIMENTS)
    assert PAGE.read_text(encoding="utf-8") == rendered, (
        "BENCHMARKS.md differs from benchmarks/results/*.json; run: python scripts/results_page.py --write"
    )


def test_check_mode_passes_on_the_repository():
    assert rp.main(["--check"]) == 0


def test_page_is_at_most_400_lines():
    n = len(PAGE.read_text(encoding="utf-8").splitlines())
    assert n <= 400, f"BENCHMARKS.md has {n} lines"


def test_there_are_results_and_every_area_has_a_table():
    areas = rp.load_results(RESULTS)
    assert len(areas) >= 10
    page = PAGE.read_text(encoding="utf-8")
    for stem, claims in areas:
        assert f"\n## {rp.area_title(stem)}\n" in page
        for claim in claims:
            assert f"\n| {claim['id']} | " in page, claim["id"]


def test_every_details_link_points_to_an_existing_experiment_heading():
    claims = _raw_claims()
    assert claims
    for name, claim in claims:
        target = claim["details"]
        rel, sep, anchor = target.partition("#")
        assert sep and anchor, f"{name}: {claim['id']}: details {target!r} has no anchor"
        assert rel.startswith("docs/experiments/"), f"{name}: {claim['id']}: {target!r}"
        path = REPO / rel
        assert path.is_file(), f"{name}: {claim['id']}: no file {rel}"
        anchors = rp.heading_anchors(path.read_text(encoding="utf-8"))
        assert anchor in anchors, f"{name}: {claim['id']}: no heading #{anchor} in {rel}"
    assert rp.check_details(rp.load_results(RESULTS)) == []


def test_every_result_has_a_known_status_engine_and_length_condition():
    for name, claim in _raw_claims():
        assert claim["status"] in {"met", "missed", "info"}, (name, claim["id"])
        cond = claim["conditions"]
        assert cond["engines"] in {"sim", "vllm-cpu", "n/a"}, (name, claim["id"])
        assert cond["lengths"] in {"oracle", "predicted", "n/a"}, (name, claim["id"])
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", claim["date"]), (name, claim["id"])
        assert cond["load"].strip() and cond["seeds"].strip(), (name, claim["id"])


def test_every_missed_claim_is_listed_where_astro_does_not_win():
    page = PAGE.read_text(encoding="utf-8")
    section = page.split(f"## {rp.MISSED_TITLE}\n", 1)[1].split("\n## ", 1)[0]
    missed = [c for _, c in _raw_claims() if c["status"] == "missed"]
    assert missed, "a results page with no miss is not credible here"
    for claim in missed:
        assert f"| {rp._cell(claim['claim'])} | {rp._cell(claim['figure'])} |" in section, claim["id"]
    assert section.count("\n| ") - 2 == len(missed)  # header and rule rows


def test_links_into_benchmarks_md_from_the_docs_resolve():
    anchors = rp.heading_anchors(PAGE.read_text(encoding="utf-8"))
    docs = [REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "ARCHITECTURE.md"]
    docs += sorted((REPO / "docs").glob("*.md"))
    for doc in docs:
        if not doc.is_file():
            continue
        for anchor in re.findall(r"\]\((?:\.\./)*BENCHMARKS\.md#([^)\s]+)\)", doc.read_text(encoding="utf-8")):
            assert anchor in anchors, f"{doc.name} links to BENCHMARKS.md#{anchor}, which is not a heading"


def test_relative_links_inside_experiment_files_resolve():
    files = sorted(EXPERIMENTS.glob("*.md"))
    assert files
    for path in files:
        text = path.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            rel, _, anchor = target.partition("#")
            dest = (path.parent / rel) if rel else path
            assert dest.exists(), f"{path.name}: link {target!r}: no {dest}"
            if anchor and dest.suffix == ".md":
                assert anchor in rp.heading_anchors(dest.read_text(encoding="utf-8")), (
                    f"{path.name}: link {target!r}: no such heading"
                )


def _copy_results(tmp_path):
    dest = tmp_path / "results"
    shutil.copytree(RESULTS, dest)
    return dest


def test_a_missing_field_is_an_error_naming_the_file_and_the_field(tmp_path, capsys):
    results = _copy_results(tmp_path)
    path = results / "dispatch.json"
    claims = json.loads(path.read_text(encoding="utf-8"))
    del claims[1]["date"]
    path.write_text(json.dumps(claims), encoding="utf-8")
    with pytest.raises(rp.ResultsError) as err:
        rp.load_results(results)
    msg = str(err.value)
    assert "dispatch.json" in msg and "claim #2" in msg and "missing field 'date'" in msg
    assert claims[1]["id"] in msg
    # the command line says the same and fails
    assert rp.main(["--check", "--results", str(results)]) == 2
    assert "dispatch.json" in capsys.readouterr().err


def test_a_missing_condition_and_unknown_values_are_errors(tmp_path):
    results = _copy_results(tmp_path)
    path = results / "prefix.json"
    original = json.loads(path.read_text(encoding="utf-8"))

    claims = json.loads(json.dumps(original))
    del claims[0]["conditions"]["lengths"]
    path.write_text(json.dumps(claims), encoding="utf-8")
    with pytest.raises(rp.ResultsError, match=r"prefix\.json.*missing field 'conditions\.lengths'"):
        rp.load_results(results)

    for field, value, pattern in (
        ("status", "won", r"field 'status' is 'won'"),
        ("date", "2026-13-40", r"field 'date'"),
        ("details", "BENCHMARKS.md#x", r"field 'details'"),
    ):
        claims = json.loads(json.dumps(original))
        claims[0][field] = value
        path.write_text(json.dumps(claims), encoding="utf-8")
        with pytest.raises(rp.ResultsError, match=r"prefix\.json.*" + pattern):
            rp.load_results(results)

    claims = json.loads(json.dumps(original))
    claims[0]["conditions"]["engines"] = "gpu"
    path.write_text(json.dumps(claims), encoding="utf-8")
    with pytest.raises(rp.ResultsError, match=r"conditions\.engines' is 'gpu'"):
        rp.load_results(results)


def test_a_duplicate_id_and_bad_json_are_errors(tmp_path):
    results = _copy_results(tmp_path)
    extra = json.loads((results / "soak.json").read_text(encoding="utf-8"))[:1]
    (results / "zz-extra.json").write_text(json.dumps(extra), encoding="utf-8")
    with pytest.raises(rp.ResultsError, match=r"zz-extra\.json: claim id 'soak-errors' also used in"):
        rp.load_results(results)
    (results / "zz-extra.json").write_text("[{", encoding="utf-8")
    with pytest.raises(rp.ResultsError, match=r"zz-extra\.json: not valid JSON"):
        rp.load_results(results)


def test_check_fails_with_a_diff_when_the_page_is_stale(tmp_path, capsys):
    page = tmp_path / "BENCHMARKS.md"
    page.write_text(PAGE.read_text(encoding="utf-8").replace("**met**", "**MET**", 1), encoding="utf-8")
    assert rp.main(["--check", "--page", str(page)]) == 1
    err = capsys.readouterr().err
    assert "does not match benchmarks/results/*.json" in err
    assert "python scripts/results_page.py --write" in err
    assert "-" in err and "**MET**" in err


def test_write_then_check_round_trips_and_render_is_deterministic(tmp_path):
    page = tmp_path / "BENCHMARKS.md"
    assert rp.main(["--write", "--page", str(page)]) == 0
    assert rp.main(["--check", "--page", str(page)]) == 0
    areas = rp.load_results(RESULTS)
    assert rp.render(areas, EXPERIMENTS) == rp.render(rp.load_results(RESULTS), EXPERIMENTS)
    assert [stem for stem, _ in areas] == sorted(stem for stem, _ in areas)


def test_a_claim_without_a_command_renders_a_dash(tmp_path):
    results = _copy_results(tmp_path)
    path = results / "soak.json"
    claims = json.loads(path.read_text(encoding="utf-8"))
    claims[0]["command"] = None
    path.write_text(json.dumps(claims), encoding="utf-8")
    text = rp.render(rp.load_results(results), EXPERIMENTS)
    row = next(line for line in text.splitlines() if line.startswith(f"| {claims[0]['id']} |"))
    assert "| — |" in row
