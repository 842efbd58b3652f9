"""Cross-validation harness for length models: folds by conversation, hand-computed
pinball loss and paired median ratios, and the `astro eval-length --cv` command."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from rps_astro_cli.cli.main import app
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.length.crossval import ModelRecipe, cross_validate, fold_of, pinball_loss, recipe_for

runner = CliRunner()


def test_fold_of_keeps_conversations_together_and_balances():
    cids = [f"c{i // 3}" for i in range(30)]  # 10 conversations of 3 pairs
    f = fold_of(cids, folds=5, seed=7)
    for c in set(cids):
        assert len({int(f[i]) for i in range(30) if cids[i] == c}) == 1
    assert np.bincount(f, minlength=5).tolist() == [6] * 5  # two conversations per fold
    assert fold_of(cids, folds=5, seed=7).tolist() == f.tolist()
    assert fold_of(cids, folds=5, seed=8).tolist() != f.tolist()


def test_pinball_loss_hand_computed():
    # y = 10; quantiles 5 (level 0.1) and 20 (level 0.9):
    # level 0.1, d = 5 → 0.1·5 = 0.5 ; level 0.9, d = −10 → (0.9 − 1)·(−10) = 1.0 ; mean 0.75
    assert pinball_loss(np.array([[5.0, 20.0]]), (0.1, 0.9), np.array([10.0])) == pytest.approx(0.75)


@pytest.fixture(scope="module")
def sharegpt_file(tmp_path_factory):
    """40 made-up conversations of 2 exchanges: short replies to yes/no questions, long
    ones to essay requests; the second reply as long as the first."""
    rng = np.random.default_rng(3)
    recs = []
    for i in range(40):
        essay = i % 2 == 0
        n1 = int(rng.integers(300, 400)) if essay else int(rng.integers(3, 6))
        q = "Write a long essay about rivers" if essay else "Is the sky blue? yes or no"
        recs.append({"id": f"c{i}", "conversations": [
            {"from": "human", "value": q}, {"from": "gpt", "value": " ".join(["word"] * n1)},
            {"from": "human", "value": "and another one"}, {"from": "gpt", "value": " ".join(["word"] * n1)},
        ]})
    p = tmp_path_factory.mktemp("cv") / "conv.json"
    p.write_text(json.dumps(recs), encoding="utf-8")
    return p


def test_cross_validate_rows_and_paired_ratios(sharegpt_file):
    res = cross_validate(sharegpt_file, [ModelRecipe("median", "median")], folds=4, seeds=(0, 1))
    assert [r["model"] for r in res.rows].count("median") == 8 and len(res.rows) == 16
    assert res.n_pairs == 80 and res.n_conversations == 40
    for r in res.rows:
        assert r["n"] == 20 and r["n_first"] == 10
        if r["model"] == "median":  # the arm is the baseline itself (integer-rounded)
            assert r["mae_ratio"] == pytest.approx(1.0, abs=0.01)
    s = res.summary["linear-prompt"]["mae"]
    assert s["min"] <= s["mean"] <= s["max"]


def test_recipes_and_errors():
    assert recipe_for("classic@1") == ModelRecipe("classic@1", "classic", 1)
    assert recipe_for("median") == ModelRecipe("median", "median", 0)
    with pytest.raises(AstroUserError, match="choose one of"):
        recipe_for("bert@1")
    with pytest.raises(AstroUserError, match="integer"):
        recipe_for("classic@x")
    with pytest.raises(AstroUserError, match="at least 2 folds"):
        cross_validate("x.json", [], folds=1)


def test_eval_length_cv_cli(sharegpt_file, tmp_path):
    r = runner.invoke(app, ["eval-length", "--data", str(sharegpt_file), "--cv", "4", "--cv-seeds", "0",
                            "--model", "median", "--json", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["folds"] == 4 and out["seeds"] == [0] and set(out["summary"]) == {"median", "linear-prompt"}
    assert (tmp_path / "cv.md").read_text().count("\n| ") == 4  # header, rule, 2 models
    r = runner.invoke(app, ["eval-length", "--data", str(sharegpt_file), "--cv", "4", "--cv-seeds", "a,b"])
    assert r.exit_code != 0 and "--cv-seeds" in r.output and "Traceback" not in r.output


def test_eval_length_cv_defaults_to_the_shipped_model(sharegpt_file):
    from rps_astro_cli.length import DEFAULT_MODEL

    r = runner.invoke(app, ["eval-length", "--data", str(sharegpt_file), "--cv", "2", "--cv-seeds", "0",
                            "--no-baselines", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert set(out["summary"]) == {DEFAULT_MODEL} and len(out["rows"]) == 2
    assert {r["fold"] for r in out["rows"]} == {0, 1} and all(r["n"] == 40 for r in out["rows"])
