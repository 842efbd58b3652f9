"""Profiling a deployment's own requests (`astro profile --workload`) and choosing the
classifier by TTFT (`astro fit --select ttft`): hand-computed footprints, class
boundaries known by construction, and the CLI end to end."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import hand_profile
from rps_astro_cli.cli.main import app
from rps_astro_cli.profiling.profiler import FootprintPoint, profile_footprints
from rps_astro_cli.profiling.rps_fit import select_classifier
from rps_astro_cli.rps.classifier import RequestClassifier, fit_classifier, load_classifier, threshold_classifier
from rps_astro_cli.rps.estimator import ImpactEstimator, LinearModel, fit_estimator
from rps_astro_cli.rps.records import ProfileRecord, read_profile_csv
from rps_astro_cli.sim.profile import VisionCosts

runner = CliRunner()


def _anyres_profile(**over):
    v = VisionCosts(tokens_per_image=729, tokens_per_frame=196, preprocess_s_per_image=0.01,
                    preprocess_s_per_frame=0.005, encoder_s_per_image=0.2, encoder_s_per_frame=0.05,
                    image_tokens_rule="anyres", tokens_per_video=1)
    return hand_profile(vision=v, **over)


def test_footprint_rows_by_hand(tmp_path):
    out = tmp_path / "w.csv"
    pts = [FootprintPoint("img", "image", 30, 100, image_sizes=((640, 480),)),
           FootprintPoint("vid", "video", 30, 400, n_frames=8),
           FootprintPoint("txt", "text", 50, 7),
           FootprintPoint("long", "video", 30, 400, n_frames=80)]
    run = profile_footprints(_anyres_profile(), pts, out)
    assert run.done == 3 and [k for k, _ in run.rejected] == ["long"]
    assert "max_model_len 16000" in run.rejected[0][1]  # 80·196 + 1 + 30 + 400 = 16111
    rows = {r.key: r for r in read_profile_csv(out)}
    img = rows["img"]
    # AnyRes: 640 × 480 → 2,929 tokens (the authors' records); KV = prompt + reply
    assert (img.vision_tokens, img.prompt_tokens, img.kv_tokens, img.output_tokens) == (2929, 2959, 3059, 100)
    # 2959 tokens in chunks of 512: 5 × 512 + 399, each step 0.01 + 0.0001 · chunk, the first + 0.2 s encoder
    assert img.impact_s == pytest.approx(6 * 0.01 + 0.0001 * 2959 + 0.2, rel=1e-5)
    assert img.preprocess_s == pytest.approx(0.01) and img.encoder_s == pytest.approx(0.2)
    vid = rows["vid"]
    assert (vid.vision_tokens, vid.kv_tokens, vid.n_frames) == (8 * 196 + 1, 30 + 1569 + 400, 8)
    assert vid.encoder_s == pytest.approx(8 * 0.05) and vid.preprocess_s == pytest.approx(8 * 0.005)
    assert rows["txt"].kv_tokens == 57 and rows["txt"].vision_tokens == 0
    # resumable; and a request above the whole KV cache (here 150 × 16 = 2,400 tokens) is rejected too
    again = profile_footprints(_anyres_profile(), pts[:3], out)
    assert (again.done, again.skipped_existing) == (0, 3)
    small = profile_footprints(_anyres_profile(num_gpu_blocks=150, max_model_len=4000), pts[:1], tmp_path / "s.csv")
    assert small.done == 0 and "KV cache's 2400 tokens" in small.rejected[0][1]


def _text_estimator() -> ImpactEstimator:
    # prefill = 0.001 s per token, KV = the prompt: S = ln(0.001 t) + ln(t) with mean 0, std 1
    lin = LinearModel(0.0, 0.001, 0.001)
    return ImpactEstimator(prefill={"text": lin}, kv={"text": LinearModel(0.0, 1.0, 1.0)})


def test_threshold_classifier_boundaries_by_hand():
    # S(t) = 2 ln t − ln 1000: boundaries at t = 100 (S = ln 10) and t = 1000 (S = ln 1000)
    clf = threshold_classifier(_text_estimator(), (0.0, 0.0), (1.0, 1.0), math.log(10), math.log(1000))
    got = {t: clf.classify(t, 0, "text") for t in (10, 99, 101, 999, 1001, 50_000)}
    assert got == {10: "sand", 99: "sand", 101: "pebbles", 999: "pebbles", 1001: "rocks", 50_000: "rocks"}
    assert isinstance(RequestClassifier.from_dict(clf.to_dict()), RequestClassifier)
    with pytest.raises(Exception, match="t_sand < t_rocks"):
        threshold_classifier(_text_estimator(), (0.0, 0.0), (1.0, 1.0), 2.0, 1.0)


def _rec(key, prompt):
    return ProfileRecord(key, "text", 0, 0, prompt, 0, prompt, 8, 0.0, 0.0, 0.001 * prompt, 0.0, 0.0)


def test_selection_finds_the_boundaries_an_objective_wants():
    # text lengths in three natural groups (10-40, 400-3200, 32000), which k-means finds; the
    # objective counts rows filed off another partition: {10..400} sand, {800..3200} pebbles, rest rocks
    lengths = [10, 20, 40, 400, 800, 1600, 3200, 32000]
    want = {10: "sand", 20: "sand", 40: "sand", 400: "sand", 800: "pebbles", 1600: "pebbles", 3200: "pebbles",
            32000: "rocks"}
    recs = [_rec(f"t{n}-{j}", n) for n in lengths for j in range(3)]
    est, _ = fit_estimator(recs, np.random.default_rng(0), test_fraction=0.0)
    km = fit_classifier(recs, est).classifier

    def score(clf):
        if clf is None:
            return 99.0
        return float(sum(clf.classify(n, 0, "text") != c for n, c in want.items()))

    assert km.classify(400, 0, "text") == "pebbles"  # k-means' own choice misfiles 400
    best, sel = select_classifier(recs, est, km, score, "misfiled rows")
    assert sel.kmeans.score == 1.0 and sel.chosen.score == 0.0 and sel.naive_score == 99.0
    assert {n: best.classify(n, 0, "text") for n in lengths} == want
    assert sel.kmeans.kind == "kmeans" and len(sel.candidates) > 1
    assert sel.chosen.crosstab["text"] == {"sand": 12, "pebbles": 9, "rocks": 3}


def test_replay_scores_zero_when_no_request_ever_waits():
    from rps_astro_cli.bench.rps_select import replay_scorer

    prof = _anyres_profile()
    # one request per 100 s on average, each done in < 1 s: FCFS and rps run every request alone
    recs = [ProfileRecord(f"r{i}", m, 1 if m == "image" else 0, 0, p, v, p + 20, 20, 0.0, 0.0, 0.05, 0.0, 0.0)
            for i, (m, p, v) in enumerate([("text", 50, 0), ("image", 800, 729)] * 10)]
    score, desc = replay_scorer(recs, prof, rate_rps=0.01, seeds=(1, 2), num_requests=20)
    assert score(None) == pytest.approx(0.0, abs=1e-9)
    assert "0.01 req/s" in desc and "seeds 1,2" in desc


def _recipe(tmp_path, prof_path):
    p = tmp_path / "r.yaml"
    p.write_text(f"name: t\ninstances: 1\nengine:\n  backend: sim\n  profile: {prof_path}\n"
                 "  instance_policy: rps\n  num_gpu_blocks: 600\n  max_model_len: 8000\n"
                 "  max_num_batched_tokens: 2048\n  chunked_prefill: true\n")
    return str(p)


@pytest.mark.slow
def test_cli_profile_workload_then_fit_by_ttft(tmp_path):
    pj = tmp_path / "anyres.json"
    pj.write_text(json.dumps(_anyres_profile().to_dict()))
    recipe = _recipe(tmp_path, pj)
    csv_path = tmp_path / "w.csv"
    res = runner.invoke(app, ["profile", "--recipe", recipe, "-w", "mix-mh", "-n", "20", "--seed", "0",
                              "--out", str(csv_path), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["new_rows"] + len(out["rejected"]) == 20
    assert "KV 600 blocks" in out["inputs"]["limits"] and "chunk 2048" in out["inputs"]["limits"]
    rows = read_profile_csv(csv_path)
    assert {r.modality for r in rows} == {"text", "image", "video"}
    assert all(r.kv_tokens == r.prompt_tokens + r.output_tokens for r in rows)
    # every image by the AnyRes rule of a COCO size, every video 8-32 frames (+ 1 newline)
    assert all(1700 <= r.vision_tokens <= 3700 for r in rows if r.modality == "image")
    assert all(r.vision_tokens == 196 * r.n_frames + 1 and 8 <= r.n_frames <= 32 for r in rows
               if r.modality == "video")
    res = runner.invoke(app, ["fit", str(csv_path), "--name", "tb", "--out-dir", str(tmp_path / "rps"),
                              "--select", "ttft", "--recipe", recipe, "--request-rate", "2",
                              "--select-seeds", "1", "--select-requests", "20"])
    assert res.exit_code == 0, res.output
    assert "naive classes" in res.output and "candidates" in res.output
    meta = json.loads((tmp_path / "rps" / "tb" / "metadata.json").read_text())
    sel = meta["classifier"]["selection"]
    assert sel["chosen"]["score"] <= sel["kmeans"]["score"]
    assert sel["chosen"]["score"] == min(c["score"] for c in sel["candidates"])
    # the console names what was chosen: k-means centroids, or the boundaries (no centroids)
    text = " ".join(res.output.split())
    if sel["chosen"]["kind"] == "kmeans":
        assert "centroids (k-means" in text and "boundaries" not in text.split("objective:")[0]
    else:
        assert f"boundaries {sel['chosen']['t_sand']:.3f} / {sel['chosen']['t_rocks']:.3f}" in text
        assert "centroids" not in text
    load_classifier(tmp_path / "rps" / "tb")


def test_cli_footprint_and_selection_errors_are_one_line(tmp_path):
    res = runner.invoke(app, ["profile", "--engine-url", "http://127.0.0.1:9", "-w", "mix-mh"])
    assert res.exit_code == 2 and "--workload" in res.output
    res = runner.invoke(app, ["profile", "--recipe", str(tmp_path / "none.yaml"), "-w", "mix-mh"])
    assert res.exit_code == 2 and "--recipe" in res.output
    res = runner.invoke(app, ["profile", "--sim-profile", "llava-onevision-7b-a100", "-w", "no-such-workload",
                              "--out", str(tmp_path / "x.csv")])
    assert res.exit_code == 2 and "no-such-workload" in res.output
    csv_path = tmp_path / "p.csv"
    profile_footprints(replace(_anyres_profile()), [FootprintPoint(f"t{i}", "text", 10 * (i + 1), 5)
                                                    for i in range(6)], csv_path)
    res = runner.invoke(app, ["fit", str(csv_path), "--name", "x", "--select", "ttft"])
    assert res.exit_code == 2 and "--recipe and --request-rate" in " ".join(res.output.split())
    res = runner.invoke(app, ["fit", str(csv_path), "--name", "x", "--select", "best"])
    assert res.exit_code == 2 and "--select" in res.output
    res = runner.invoke(app, ["fit", str(csv_path), "--name", "x", "--request-rate", "2"])
    assert res.exit_code == 2 and "--select ttft" in " ".join(res.output.split())
    assert "Traceback" not in res.output


def test_shipped_testbed_classifier_matches_its_profile_and_recipe():
    from rps_astro_cli.data_paths import ARTIFACTS_DIR
    from rps_astro_cli.profiling.rps_fit import _crosstab
    from rps_astro_cli.services.config import load_recipe

    assert load_recipe("rps-serve-testbed").engine.instance_policy_params["classifier"] == "rps-serve-testbed-mix-mh"
    clf = load_classifier("rps-serve-testbed-mix-mh")
    meta = json.loads((ARTIFACTS_DIR / "rps" / "rps-serve-testbed-mix-mh" / "metadata.json").read_text())
    rows = read_profile_csv(ARTIFACTS_DIR.parent / meta["profile"]["path"])
    sel = meta["classifier"]["selection"]
    # the saved classifier files its own profile's rows as the selection recorded
    assert _crosstab(clf, rows)[0] == sel["chosen"]["crosstab"]
    assert sel["chosen"]["score"] < sel["kmeans"]["score"] and sel["chosen"]["score"] < sel["naive_classes_score"]
    assert clf.classify(30, 0, "text") == "sand" and clf.classify(20 + 6273, 6273, "video") == "rocks"
