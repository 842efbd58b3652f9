"""`astro train-length` / `astro eval-length` through Typer's CliRunner."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from rps_astro_cli.cli.main import app

runner = CliRunner()
TOPICS = ["gardens", "rivers", "engines", "castles", "markets", "planets", "bridges", "forests"]


@pytest.fixture(scope="module")
def pairs_csv(tmp_path_factory):
    rng = np.random.default_rng(5)
    lines = ["prompt,response_tokens,conversation_id"]
    for i in range(80):
        topic = TOPICS[rng.integers(len(TOPICS))]
        if i % 2:
            lines.append(f"Write a long detailed essay about {topic},{int(rng.integers(700, 900))},c{i}")
        else:
            lines.append(f"yes or no: is it {topic}?,{int(rng.integers(4, 8))},c{i}")
    p = tmp_path_factory.mktemp("d") / "pairs.csv"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def trained(pairs_csv, tmp_path_factory):
    out = tmp_path_factory.mktemp("m") / "classic"
    r = runner.invoke(app, ["train-length", "--data", str(pairs_csv), "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    return out, json.loads(r.stdout)


def test_train_length_json(trained):
    out, res = trained
    assert res["model"] == "classic" and res["artifact"] == str(out)
    # 80 conversations: 16 test, 8 val, 56 train (one pair each)
    assert (res["n_train"], res["n_val"], res["n_test"]) == (56, 8, 16)
    assert res["metrics"]["n"] == 16 and res["metrics"]["mae"] < 100  # the planted signal is easy
    assert (out / "meta.json").is_file() and (out / "model.npz").is_file()


def test_eval_length_json_and_report(trained, pairs_csv, tmp_path):
    out, _ = trained
    r = runner.invoke(app, ["eval-length", "--data", str(pairs_csv), "--model", str(out), "--json",
                            "--out", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)
    assert list(res) == ["classic", "linear-prompt", "median"]
    for row in res.values():
        assert row["n"] == 16 and {"mae", "mape", "kendall_tau", "median_ae",
                                   "bucket_accuracy", "p50_ms_batch1"} <= set(row)
    assert res["classic"]["mae"] < res["median"]["mae"]
    # median baseline MAE on a half-essay / half-yes-no split is several hundred tokens
    assert res["median"]["mae"] > 300
    assert res["median"]["kendall_tau"] is None  # constant prediction: τ undefined
    assert sorted(p.name for p in (tmp_path / "rep").iterdir()) == ["error_cdf.png", "metrics.json",
                                                                    "metrics.md", "scatter.png"]


def test_eval_length_table(trained, pairs_csv):
    out, _ = trained
    r = runner.invoke(app, ["eval-length", "--data", str(pairs_csv), "--model", str(out),
                            "--no-baselines", "--no-latency"])
    assert r.exit_code == 0, r.output
    assert "classic" in r.stdout and "│ median" not in r.stdout and "16 pairs" in r.stdout


def test_eval_length_table_fits_80_columns_without_cutting_numbers(trained, pairs_csv, monkeypatch):
    from rps_astro_cli.cli.common import console

    out, _ = trained
    args = ["eval-length", "--data", str(pairs_csv), "--model", str(out), "--no-latency"]
    res = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    monkeypatch.setattr(console, "_width", 80)  # a pipe / default terminal
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "…" not in r.stdout and max(len(line) for line in r.stdout.splitlines()) <= 80
    for name, row in res.items():  # every metric printed in full, as the JSON has it
        assert f"│ {name}" in r.stdout
        for key, nd in (("mae", 1), ("mape", 1), ("median_ae", 1), ("bucket_accuracy", 3)):
            assert f"{row[key]:.{nd}f}" in r.stdout


def test_split_columns_by_hand():
    from rps_astro_cli.cli.tables import split_columns, table_width

    assert table_width([10, 8, 8]) == 36  # 26 + 3·3 + 1
    assert split_columns([10, 8, 8, 8], 40) == [[0, 1, 2], [0, 3]]
    assert split_columns([10, 8, 8, 8], 47) == [[0, 1, 2, 3]]
    assert split_columns([10, 8], 5) == [[0, 1]]  # too wide alone: still printed (folded)


def test_help():
    for cmd in ("train-length", "eval-length"):
        r = runner.invoke(app, [cmd, "--help"])
        assert r.exit_code == 0 and "--data" in r.stdout


def _err(r):
    return r.stderr if hasattr(r, "stderr") else r.output


def test_bad_inputs_exit_2(trained, tmp_path, pairs_csv):
    out, _ = trained
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'[{"id": "a", "conversations": [{"from": "human", "value": "caf\xe9"}]}]')
    cases = [
        (["eval-length", "--data", str(bad), "--model", str(out)], "not valid UTF-8"),
        (["eval-length", "--data", str(pairs_csv), "--model", str(tmp_path / "nothing")], "no length-model artifact"),
        (["train-length", "--data", str(pairs_csv), "--model", "gpt5", "--out", str(tmp_path / "x")],
         "unknown length model 'gpt5'"),
        (["train-length", "--data", str(pairs_csv), "--test-split", "0.7", "--val-split", "0.4", "--out",
          str(tmp_path / "y")], "leave no training data"),
        (["train-length", "--data", str(pairs_csv), "--epochs", "2", "--out", str(tmp_path / "z")],
         "apply to roberta/minilm only"),
    ]
    for args, needle in cases:
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output)
        msg = " ".join(_err(r).split())
        assert needle in msg and "Traceback" not in r.output, (args, msg)


def test_corrupt_artifact_exit_2(trained, tmp_path, pairs_csv):
    import shutil

    out, _ = trained
    d = tmp_path / "broken"
    shutil.copytree(out, d)
    (d / "model.npz").write_bytes(b"not a zip")
    r = runner.invoke(app, ["eval-length", "--data", str(pairs_csv), "--model", str(d)])
    assert r.exit_code == 2 and "checksum mismatch" in " ".join(_err(r).split())


def test_long_prompt_truncation_is_noted(trained, tmp_path):
    out, _ = trained
    rows = [{"prompt": "Write a long detailed essay about rivers " * 2500, "response_tokens": 800,
             "conversation_id": "a"},
            {"prompt": "", "response_tokens": 5, "conversation_id": "b"},
            {"prompt": "yes or no: is it gardens?", "response_tokens": 5, "conversation_id": "c"}]
    p = tmp_path / "long.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n", encoding="utf-8")
    r = runner.invoke(app, ["eval-length", "--data", str(p), "--model", str(out), "--test-split", "1.0",
                            "--val-split", "0", "--json", "--no-latency"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["classic"]["n"] == 2
    err = " ".join(_err(r).split())
    assert "dropped 1 row(s) with an empty prompt" in err
    assert "classic: 1 prompt(s) longer than 32768 characters were truncated" in err
    assert "baselines skipped" in err
