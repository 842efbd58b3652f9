"""The README's main job (`astro demo`) end to end on a tiny scale: a real sim cluster,
real ShareGPT prompts from ../shared/data, a report on disk."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rps_astro_cli.data_paths import data_dir

pytestmark = pytest.mark.slow


@pytest.mark.skipif(data_dir() is None, reason="needs ../shared/data (developer machines and CI)")
def test_demo_serves_and_benchmarks_real_sharegpt(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "rps_astro_cli.cli.main", "demo", "--instances", "2",
         "--num-requests", "6", "--request-rate", "20", "--out", str(out)],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((out / "report.json").read_text())
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    # every request came back with tokens, through the scheduler (live mode)
    assert all(r.get("ok", True) and r["output_tokens"] >= 1 for r in rows), rows[0]
    assert "sharegpt" in json.dumps(report["config"])
    # the cluster was stopped: no serve process left behind writing cluster.json
    assert (tmp_path / "runs").is_dir()
    # it ends with astro's dispatch beside the load-aware baselines on the same requests, the
    # ratio computed from that comparison's own report
    last = proc.stdout.strip().splitlines()[-5:]
    assert last[0].startswith("side by side") and "predicted lengths" in last[0], last
    ratio_line = last[-1]
    side = json.loads((out.parent / "side-by-side" / "report.json").read_text())
    p99 = {r["label"].split()[0]: r["metrics"]["overall"]["ttft_s"]["p99"] for r in side["runs"]}
    assert set(p99) == {"llumnix", "least_requests", "power_of_k"}
    best = min(p99["llumnix"], p99["least_requests"])
    assert f"P99 TTFT ×{p99['power_of_k'] / best:.2f}" in ratio_line, ratio_line


def test_demo_without_data_folder_says_synthetic_on_its_first_line(tmp_path: Path, monkeypatch) -> None:
    """No sample-data folder: the first line names the synthetic source and a warning says how
    to set ASTRO_DATA_DIR (the cluster itself fails fast here on a missing profile)."""
    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app

    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["demo", "--instances", "1", "--profile", str(tmp_path / "no-profile.json")],
                           env={"ASTRO_DATA_DIR": str(tmp_path / "absent"), "COLUMNS": "80"})
    lines = r.output.splitlines()
    assert "SYNTHETIC ShareGPT-like" in lines[0] and "200 ShareGPT requests" not in lines[0]
    assert "WARNING" in lines[1] and "ASTRO_DATA_DIR" in lines[1] and "export ASTRO_DATA_DIR=" in lines[1]
    assert r.exit_code != 0  # the bad profile stops `astro serve`
    help_text = " ".join(CliRunner().invoke(app, ["demo", "--help"], env={"COLUMNS": "200"}).output.split())
    assert "real ShareGPT prompts" not in help_text and "synthetic ShareGPT-like" in help_text


@pytest.mark.skipif(data_dir() is None, reason="needs ../shared/data (developer machines and CI)")
def test_demo_data_source_names_the_folder() -> None:
    from rps_astro_cli.cli.demo import data_source

    source, warning = data_source()
    assert str(data_dir()) in source and warning is None
