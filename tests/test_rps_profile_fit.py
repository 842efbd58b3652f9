"""`astro profile` (virtual and against a live sim engine) and `astro fit`."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import hand_profile
from rps_astro_cli.cli.main import app
from rps_astro_cli.policies import make_policy
from rps_astro_cli.profiling.profiler import plan_points, profile_engine, profile_virtual
from rps_astro_cli.profiling.rps_fit import fit_profile
from rps_astro_cli.rps.classifier import load_classifier
from rps_astro_cli.rps.estimator import isolated_latency
from rps_astro_cli.rps.records import read_profile_csv

runner = CliRunner()


def test_plan_interleaves_modalities_and_grows_sizes():
    pts = plan_points(["text", "video"], text_tokens=[16, 64], frame_counts=[4, 8], repeats=2)
    assert [p.key for p in pts] == ["text-t16-r0", "video-f4-r0", "text-t16-r1", "video-f4-r1",
                                    "text-t64-r0", "video-f8-r0", "text-t64-r1", "video-f8-r1"]
    assert pts[1].n_frames == 4 and pts[1].modality == "video"


def test_virtual_profile_is_resumable_and_exact(tmp_path):
    prof = hand_profile()
    out = tmp_path / "p.csv"
    pts = plan_points(text_tokens=[16, 1024], image_counts=[1, 2], frame_counts=[8], repeats=2)
    run1 = profile_virtual(prof, pts, out, np.random.default_rng(0), output_tokens=4, max_requests=5)
    assert run1.done == 5
    run2 = profile_virtual(prof, pts, out, np.random.default_rng(0), output_tokens=4)
    assert (run2.skipped_existing, run2.done) == (5, len(pts) - 5)
    rows = {r.key: r for r in read_profile_csv(out)}
    assert len(rows) == len(pts)
    img = rows["image-i2-r0"]
    assert img.vision_tokens == 2 * 729 and img.encoder_s == pytest.approx(0.4)
    assert img.preprocess_s == pytest.approx(0.02)
    iso = isolated_latency(prof, img.prompt_tokens, 4, 0.4, 0.02)
    assert img.ttft_s == pytest.approx(iso.ttft_s, rel=1e-5) and img.impact_s == pytest.approx(iso.prefill_s, rel=1e-5)


@pytest.mark.slow
def test_profile_against_a_live_sim_engine_matches_the_virtual_one(tmp_path):
    from rps_astro_cli.engine.sim_engine import SimEngine
    from rps_astro_cli.engine.sim_server import create_app
    from rps_astro_cli.protocol.http_server import ServerThread

    prof = hand_profile(vision=hand_profile().vision.__class__(729, 196, 0.01, 0.001, 0.02, 0.001))
    pts = plan_points(text_tokens=[64], image_counts=[1], frame_counts=[4], repeats=1)
    with ServerThread(create_app(SimEngine(prof))) as srv:
        run = profile_engine(srv.url, pts, tmp_path / "e.csv", np.random.default_rng(0), output_tokens=3)
    assert run.done == 3, (run.failed, run.rejected)
    profile_virtual(prof, pts, tmp_path / "v.csv", np.random.default_rng(0), output_tokens=3)
    live = {r.key: r for r in read_profile_csv(tmp_path / "e.csv")}
    virt = {r.key: r for r in read_profile_csv(tmp_path / "v.csv")}
    for k in virt:
        a, b = live[k], virt[k]
        assert (a.prompt_tokens, a.vision_tokens, a.kv_tokens) == (b.prompt_tokens, b.vision_tokens, b.kv_tokens)
        assert a.encoder_s == pytest.approx(b.encoder_s)
        assert a.prefill_s == pytest.approx(b.prefill_s, rel=1e-4)  # engine seconds, exact step model
        assert a.ttft_s >= b.prefill_s  # wall clock includes HTTP and preprocessing
    assert live["video-f4-r0"].vision_tokens == 4 * 196


def test_profile_unreachable_engine_is_a_user_error(tmp_path):
    res = runner.invoke(app, ["profile", "--engine-url", "http://127.0.0.1:9", "--out", str(tmp_path / "x.csv")])
    assert res.exit_code == 2 and "cannot reach the engine" in " ".join(res.output.split())


def test_cli_profile_then_fit_then_policy(tmp_path, monkeypatch):
    from rps_astro_cli.cli.common import console

    monkeypatch.setattr(console, "_width", 80)  # a pipe / default terminal: tables must not cut numbers
    pj = tmp_path / "hand.json"
    pj.write_text(json.dumps(hand_profile().to_dict()))
    csv_path = tmp_path / "w.csv"
    res = runner.invoke(app, ["profile", "--sim-profile", str(pj), "--out", str(csv_path), "--repeats", "2",
                              "--text-tokens", "16,64,256,1024,4096", "--image-counts", "1,2,4",
                              "--frame-counts", "8,32,64", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["new_rows"] == 2 * (5 + 3 + 3)
    assert csv_path.with_suffix(".png").is_file() and csv_path.with_suffix(".summary.md").is_file()
    # the table at 80 columns (rerun: every point already there) shows every number in full
    res = runner.invoke(app, ["profile", "--sim-profile", str(pj), "--out", str(csv_path), "--repeats", "2",
                              "--text-tokens", "16,64,256,1024,4096", "--image-counts", "1,2,4",
                              "--frame-counts", "8,32,64"])
    assert res.exit_code == 0, res.output
    assert "…" not in res.output and max(len(line) for line in res.output.splitlines()) <= 80
    for s in out["summary"]:
        assert f"{s['prompt_tokens_min']}/{s['prompt_tokens_median']:.0f}/{s['prompt_tokens_max']}" in res.output
        assert f"{s['prefill_ms_p90']:.1f}" in res.output and f"{s['preprocess_ms_median']:.1f}" in res.output

    res = runner.invoke(app, ["fit", str(csv_path), "--name", "hand", "--out-dir", str(tmp_path / "rps")])
    assert res.exit_code == 0, res.output
    assert "MAE ms" in res.output and "pebbles" in res.output and "naive classifier" in res.output
    assert "…" not in res.output
    meta = json.loads((tmp_path / "rps" / "hand" / "metadata.json").read_text())
    assert meta["profile"]["sha256"] == hashlib.sha256(csv_path.read_bytes()).hexdigest()
    assert meta["features"] == ["log_prefill_s", "log_kv_tokens"]
    assert sum(meta["classifier"]["counts"].values()) == 22
    cents = meta["classifier"]["centroids"]
    assert [c["class"] for c in cents] == ["sand", "pebbles", "rocks"]
    assert cents[0]["prefill_s"] < cents[1]["prefill_s"] < cents[2]["prefill_s"]
    assert cents[0]["kv_tokens"] < cents[1]["kv_tokens"] < cents[2]["kv_tokens"]
    clf = load_classifier(tmp_path / "rps" / "hand")
    assert clf.classify(20, 0, "text") == "sand"
    assert clf.classify(64 * 196 + 20, 64 * 196, "video") == "rocks"
    pol = make_policy("rps", classifier=str(tmp_path / "rps" / "hand"))
    assert pol.describe()["classifier"] == str(tmp_path / "rps" / "hand")


def test_cli_bad_arguments_are_one_line_errors(tmp_path):
    res = runner.invoke(app, ["profile", "--out", str(tmp_path / "x.csv")])
    assert res.exit_code == 2 and "--engine-url" in res.output
    res = runner.invoke(app, ["profile", "--sim-profile", "llava-onevision-7b-a100", "--modalities", "audio"])
    assert res.exit_code == 2 and "--modalities" in res.output
    res = runner.invoke(app, ["fit", str(tmp_path / "none.csv"), "--name", "x"])
    assert res.exit_code == 2 and "no profile file" in " ".join(res.output.split())
    bad = tmp_path / "bad.csv"
    bad.write_text("key,modality\nx,text\n")
    res = runner.invoke(app, ["fit", str(bad), "--name", "x"])
    assert res.exit_code == 2 and "lacks columns" in " ".join(res.output.split())
    with pytest.raises(Exception, match="test_fraction|--test-fraction"):
        fit_profile(bad, "x", tmp_path, test_fraction=1.5)


def test_shipped_llava_classifier_loads_and_orders_classes():
    clf = load_classifier("llava-onevision-7b-a100")
    assert clf.classify(50, 0, "text") == "sand"
    assert clf.classify(32 * 196 + 40, 32 * 196, "video") == "rocks"
    assert [c["class"] for c in clf.centroids_original()] == ["sand", "pebbles", "rocks"]
    assert not math.isnan(clf.centroids_original()[0]["prefill_s"])
