"""`chat-gbm`: the numpy tree walker against scikit-learn and a hand-built stump, the
history cues on a hand-made chat, learning a planted history signal, chats vs samples,
distributions, save/load and corrupt artifacts."""

import json
import math

import numpy as np
import pytest

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.length import load_length_model, save_length_model
from rps_astro_cli.length.chat_gbm import MISSING, N_HISTORY, ChatGBMLengthModel, TreeEnsemble, history_features
from rps_astro_cli.length.data import LengthDataset, LengthSample
from rps_astro_cli.length.evaluate import compute_metrics


def test_tree_walker_hand_built_stump():
    # node 0: x0 ≤ 1 → node 1 (leaf 2.0) else node 2 (leaf 5.0); NaN goes right; baseline 1
    t = TreeEnsemble(feature=np.array([0, 0, 0]), threshold=np.array([1.0, 0, 0]), left=np.array([1, -1, -1]),
                     right=np.array([2, -1, -1]), value=np.array([0.0, 2.0, 5.0]),
                     missing_left=np.array([False, False, False]), roots=np.array([0]), baseline=1.0)
    assert t.predict(np.array([[0.5], [1.0], [2.0], [np.nan]])).tolist() == [3.0, 3.0, 6.0, 6.0]


def test_tree_walker_matches_sklearn_with_missing_values():
    from sklearn.ensemble import HistGradientBoostingRegressor

    rng = np.random.default_rng(0)
    X = rng.normal(size=(400, 5))
    y = X[:, 0] * 2 + np.where(X[:, 1] > 0, 1.0, -1.0) + rng.normal(scale=0.1, size=400)
    X[rng.random((400, 5)) < 0.2] = np.nan
    est = HistGradientBoostingRegressor(loss="absolute_error", max_iter=40, max_leaf_nodes=6).fit(X, y)
    Xt = rng.normal(size=(100, 5))
    Xt[rng.random((100, 5)) < 0.2] = np.nan
    np.testing.assert_allclose(TreeEnsemble.from_sklearn(est).predict(Xt), est.predict(Xt), rtol=1e-12, atol=1e-12)


def test_history_features_hand_computed():
    # fallback tokens: words of ≤ 4 letters cost 1 token each
    hist = ("tell me", "one two six", "and then", "a b c d e f g")
    f = history_features("go on", hist)
    assert len(f) == N_HISTORY
    L = math.log1p
    assert f[0] == 1.0 and f[1] == pytest.approx(L(4))
    assert f[2:5] == pytest.approx([L(7), L(3), MISSING])  # last replies, newest first
    assert f[5] == pytest.approx(L(5)) and f[6] == pytest.approx(L(5)) and f[7] == pytest.approx(L(7))
    assert f[8] == pytest.approx(L(2))  # previous user message: "and then"
    assert f[9] == 1.0 and f[10] == 0.0  # the last reply ends without punctuation, holds no code
    assert f[11] == pytest.approx(L(sum(map(len, hist))))
    assert f[12] == pytest.approx(L(2)) and f[13] == pytest.approx(0.0) and f[14] == 1.0
    g = history_features("Write a poem.", ())
    assert g[0] == 0.0 and [g[i] for i in (2, 5, 8, 9, 13)] == [MISSING] * 5 and g[14] == 0.0


def conversations(n: int, seed: int) -> LengthDataset:
    """n made-up two-exchange chats: the first reply's length is random (20–800 tokens)
    and the second reply, to an uninformative "go on", is as long as the first (±5%)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        first = int(rng.integers(20, 800))
        reply = " ".join(["word"] * first)
        out.append(LengthSample("Tell me about it", first, f"c{seed}-{i}", history=(), message="Tell me about it"))
        second = int(first * rng.uniform(0.95, 1.05))
        out.append(LengthSample("go on", second, f"c{seed}-{i}", history=("Tell me about it", reply), message="go on"))
    return LengthDataset(out)


@pytest.fixture(scope="module")
def fitted():
    m = ChatGBMLengthModel(n_hash=2**12)
    info = m.fit(conversations(120, 1), None, rng=np.random.default_rng(0))
    m.meta.fit = info
    return m, info


def test_chat_gbm_learns_the_history_signal(fitted):
    m, info = fitted
    test = LengthDataset([s for s in conversations(40, 2).samples if s.history])
    pred = m.predict_samples(test.samples)
    met = compute_metrics(test.targets, pred)
    assert met.kendall_tau > 0.8 and met.mape < 20
    # a bare prompt has no history to read: the same message predicts one constant-ish value
    assert len(set(m.predict(["go on"] * 3).tolist())) == 1
    assert set(info) >= {"shift", "oof_mae", "dist"}


def test_predict_chats_reads_the_same_history_as_samples(fitted):
    m, _ = fitted
    s = conversations(3, 3).samples[1]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": s.history[0]},
            {"role": "assistant", "content": s.history[1]}, {"role": "user", "content": s.text}]
    assert m.predict_chats([chat]).tolist() == m.predict_samples([s]).tolist()
    (d,) = m.predict_dist_chats([chat])
    assert d.quantiles_tokens[0] <= d.median_tokens <= d.quantiles_tokens[-1]
    assert d.levels == (0.1, 0.25, 0.5, 0.75, 0.9)


def test_text_score_hot_path_equals_training_design(fitted):
    m, _ = fitted
    texts = ["Write a long essay about rivers", "", "yes?"]
    D = m._dense(texts)
    A = m._design(m._tf(texts), D, m.idf, m.dense_mean, m.dense_std)
    full = np.concatenate([m.coef, m.dense_coef])
    np.testing.assert_allclose(m._text_scores(texts, D), A @ full + m.text_intercept, rtol=1e-10, atol=1e-12)


def test_save_load_roundtrip_and_corruption(fitted, tmp_path):
    m, _ = fitted
    out = save_length_model(m, tmp_path / "gbm")
    back = load_length_model(out)
    samples = conversations(10, 4).samples
    assert back.predict_samples(samples).tolist() == m.predict_samples(samples).tolist()
    assert back.calibration == m.calibration
    meta = json.loads((out / "meta.json").read_text())
    assert meta["model"] == "chat-gbm" and meta["params"]["reads_history"] is True
    bad = tmp_path / "bad"
    save_length_model(m, bad)
    with np.load(bad / "model.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["tree_left"][0] = 10**6  # points outside the model
    np.savez_compressed(bad / "model.npz", **arrays)
    meta = json.loads((bad / "meta.json").read_text())
    from rps_astro_cli.length.store import _sha256_file

    meta["files"]["model.npz"] = _sha256_file(bad / "model.npz")
    (bad / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(AstroUserError, match="tree arrays point outside"):
        load_length_model(bad)


def test_chat_gbm_needs_enough_data():
    with pytest.raises(AstroUserError, match="needs ≥ 20"):
        ChatGBMLengthModel(n_hash=2**10).fit(conversations(5, 0), None, rng=np.random.default_rng(0))


def test_approx_tokens_exact_when_short_and_close_when_long():
    from rps_astro_cli.length.chat_gbm import COUNT_EDGE_CHARS, approx_tokens

    assert approx_tokens("one two six") == 3.0
    long = "word " * 2000  # 10,000 characters, 2,000 fallback tokens
    assert len(long) > 2 * COUNT_EDGE_CHARS
    assert approx_tokens(long) == pytest.approx(2000, rel=0.01)
