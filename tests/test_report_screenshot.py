"""The HTML report as a person sees it: a headless Chromium screenshot of a small virtual
run's report.html (issue 17). Skipped where no Chromium is installed (`apt-get install
chromium`); the PNG goes to $ASTRO_TEST_ARTIFACTS (default: the test's tmp folder)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _browser() -> str | None:
    return next((p for b in BROWSERS if (p := shutil.which(b))), None)


def test_report_html_screenshot(tmp_path):
    browser = _browser()
    if browser is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium)")
    out = tmp_path / "bench"
    # a mix with classes over 4 instances: every panel (per-instance load, dispatch, predictor
    # error, per-class) is on the page
    r = subprocess.run([sys.executable, "-m", "rps_astro_cli.cli.main", "bench", "--virtual", "-w", "mix-mh",
                        "-n", "60", "--rates", "2,4", "--out", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    page = (out / "report.html").read_text()
    for title in ("Latency CDFs", "Latency vs request rate", "Per-instance load over time", "Dispatch decisions",
                  "Predictor error", "Per-class latency", "Per-class TTFT CDFs"):
        assert f"<h2>{title}</h2>" in page, title
    art = Path(os.environ.get("ASTRO_TEST_ARTIFACTS") or tmp_path)
    art.mkdir(parents=True, exist_ok=True)
    png = art / "report_html_screenshot.png"
    s = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--window-size=1280,7600", f"--screenshot={png}", (out / "report.html").as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert png.is_file(), s.stderr[-2000:]
    from PIL import Image

    with Image.open(png) as im:
        assert im.size == (1280, 7600)
        colors = im.convert("RGB").getcolors(maxcolors=1 << 20)
    # a rendered page (text, tables, plots), not a blank or error page: many colours, and
    # the white background far from all of it
    assert colors is None or len(colors) > 50
