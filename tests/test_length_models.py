"""Length models: baselines with hand-computed fits, classic learning a planted signal,
artifact save/load, corrupt or mismatched artifacts, and the shipped default."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.length import LENGTH_MODELS, default_length_model, load_length_model, save_length_model
from rps_astro_cli.length.base import LENGTH_ARTIFACTS_DIR
from rps_astro_cli.length.baselines import LinearPromptBaseline, MedianBaseline, _lad_line
from rps_astro_cli.length.classic import ClassicLengthModel, dense_cues
from rps_astro_cli.length.data import LengthDataset, LengthSample
from rps_astro_cli.length.prompts import MAX_PROMPT_CHARS

TOPICS = ["gardens", "rivers", "engines", "castles", "markets", "planets", "bridges", "forests"]


def planted(n: int, seed: int) -> LengthDataset:
    """Made-up prompts whose reply length is set by the request type: essays ≈ 800
    tokens, yes/no questions ≈ 6 tokens (±10% noise)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        topic = TOPICS[rng.integers(len(TOPICS))]
        if i % 2 == 0:
            prompt, base = f"Write a long detailed essay about {topic} and their history", 800
        else:
            prompt, base = f"Answer yes or no: are {topic} blue?", 6
        out.append(LengthSample(prompt, int(base * rng.uniform(0.9, 1.1)), f"c{i}"))
    return LengthDataset(out)


def test_registry_names():
    assert LENGTH_MODELS.names() == ["chat-gbm", "classic", "linear-prompt", "median", "minilm", "roberta"]
    with pytest.raises(AstroUserError, match="choose one of: chat-gbm, classic"):
        LENGTH_MODELS.get("bert")


def test_missing_torch_is_a_clear_error(monkeypatch):
    import sys

    from rps_astro_cli.length.transformer import _require

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(AstroUserError, match=r"need torch and transformers.*rps_astro_cli\[transformers\]"):
        _require()


def test_median_baseline():
    ds = LengthDataset([LengthSample(f"p{i}", t, f"c{i}") for i, t in enumerate([10, 20, 30, 40, 1000])])
    m = MedianBaseline()
    m.fit(ds, None, rng=np.random.default_rng(0))
    assert m.predict(["anything", ""]).tolist() == [30, 30]


def test_lad_line_exact_and_robust():
    x = np.array([0.0, 1, 2, 3, 4, 5])
    a, b = _lad_line(x, 10 + 2 * x)
    assert (a, b) == pytest.approx((10.0, 2.0), abs=1e-4)
    y = 10 + 2 * x
    y[5] = 1000.0  # one outlier barely moves a least-absolute-deviation fit
    a, b = _lad_line(x, y)
    assert (a, b) == pytest.approx((10.0, 2.0), abs=1e-3)


def test_linear_prompt_baseline():
    # fallback tokens: "w" words of ≤ 4 letters cost 1 token each; y = 10 + 2·tokens
    ds = LengthDataset([LengthSample(" ".join(["word"] * k), 10 + 2 * k, f"c{k}") for k in range(1, 9)])
    m = LinearPromptBaseline()
    m.fit(ds, None, rng=np.random.default_rng(0))
    assert m.predict(["one two ten four five", "x " * 20]).tolist() == [20, 50]


def test_classic_learns_planted_signal():
    m = ClassicLengthModel(n_hash=2**12)
    info = m.fit(planted(60, 1), planted(20, 2), rng=np.random.default_rng(0))
    assert info["alpha"] in (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
    pred = m.predict(["Write a long detailed essay about oceans and their history",
                      "Answer yes or no: are oceans blue?"])
    assert pred[0] > 400 and pred[1] < 30


def test_dense_cues_values():
    c = dense_cues("Hi?\n```x=1```")
    assert len(c) == 8
    assert c[0] == pytest.approx(np.log1p(13))
    assert c[2] == pytest.approx(np.log1p(1)) and c[3] == pytest.approx(np.log1p(1))
    assert c[4] == 1.0 and c[6] == 1.0 and c[7] == 0.0
    assert dense_cues("") == [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


@pytest.fixture(scope="module")
def saved_classic(tmp_path_factory):
    d = tmp_path_factory.mktemp("art") / "classic"
    m = ClassicLengthModel(n_hash=2**12)
    m.fit(planted(40, 1), planted(10, 2), rng=np.random.default_rng(0))
    m.meta.data = {"sha256": "abc"}
    save_length_model(m, d)
    return d, m


def test_save_load_roundtrip(saved_classic):
    d, m = saved_classic
    meta = json.loads((d / "meta.json").read_text())
    assert meta["model"] == "classic" and meta["format_version"] == 1 and meta["params"]["n_hash"] == 4096
    assert set(meta["files"]) == {"model.npz"} and len(meta["files"]["model.npz"]) == 64
    loaded = load_length_model(d)
    prompts = ["Write a long detailed essay about moons and their history", "Answer yes or no: is it?", ""]
    assert loaded.predict(prompts).tolist() == m.predict(prompts).tolist()
    assert loaded.meta.data["sha256"] == "abc"


def _copy(saved, tmp_path):
    d = tmp_path / "a"
    shutil.copytree(saved[0], d)
    return d


def _edit_meta(d, **changes):
    meta = json.loads((d / "meta.json").read_text())
    for k, v in changes.items():
        if isinstance(v, dict):
            meta[k].update(v)
        else:
            meta[k] = v
    (d / "meta.json").write_text(json.dumps(meta))


def _set_meta(d, key, value):
    meta = json.loads((d / "meta.json").read_text())
    meta[key] = value
    (d / "meta.json").write_text(json.dumps(meta))


@pytest.mark.parametrize(
    "damage, needle",
    [
        (lambda d: (d / "model.npz").write_bytes((d / "model.npz").read_bytes()[:-10] + b"0123456789"),
         "checksum mismatch"),
        (lambda d: (d / "model.npz").unlink(), "missing artifact file"),
        (lambda d: (d / "meta.json").unlink(), "no meta.json"),
        (lambda d: (d / "meta.json").write_text("{not json"), "corrupt meta.json"),
        (lambda d: _edit_meta(d, model="gpt-judge"), "'gpt-judge' is not a known length model"),
        (lambda d: _edit_meta(d, format_version=99), "format_version 99"),
        (lambda d: _edit_meta(d, params={"n_hash": 1024}), "array 'idf' has shape (8192,), expected (2048,)"),
        (lambda d: _edit_meta(d, files=[]), "field 'files' must be an object"),
        (lambda d: _set_meta(d, "files", {}), "lists no model files"),
    ],
)
def test_corrupt_artifacts_name_the_problem(saved_classic, tmp_path, damage, needle):
    d = _copy(saved_classic, tmp_path)
    damage(d)
    with pytest.raises(AstroUserError) as e:
        load_length_model(d)
    assert needle in str(e.value)


def test_chat_gbm_weights_that_do_not_match_meta_name_the_array(tmp_path):
    # the shipped chat-gbm artifact has n_hash 2**18, so idf holds 2 * 2**18 values; meta
    # claiming 2**17 must be refused naming idf's real and expected shapes
    d = tmp_path / "gbm"
    shutil.copytree(Path(LENGTH_ARTIFACTS_DIR) / "chat-gbm", d)
    _edit_meta(d, params={"n_hash": 2**17})
    with pytest.raises(AstroUserError) as e:
        load_length_model(d)
    assert "array 'idf' has shape (524288,), expected (262144,) for n_hash=131072" in str(e.value)


def test_unknown_artifact_name():
    with pytest.raises(AstroUserError, match="no length-model artifact 'nope'") as e:
        load_length_model("nope")
    assert "classic" in str(e.value)


# ------------------------------------------------------------- the shipped default


def test_default_artifact_predicts():
    m = default_length_model()
    assert m is default_length_model()  # loaded once
    assert m.name == "chat-gbm" and m.meta.tokenizer == "fallback" and m.reads_history
    assert "ChatGPT" in m.meta.responder
    huge = "Summarize this log line. " * 5000  # 125k characters
    parts = [{"type": "text", "text": "What is in this picture?"}, {"type": "image_url", "image_url": {"url": "x"}}]
    out = m.predict(["Write a short poem about the sea", "", huge, parts])
    assert out.dtype == np.int64 and out.shape == (4,) and (out >= 1).all()
    assert any("truncated" in n for n in m.last_notes) and any("non-text" in n for n in m.last_notes)
    assert len(huge) > MAX_PROMPT_CHARS
    with pytest.raises(AstroUserError, match=r"prompts\[0\]"):
        m.predict([{"role": "user"}])
    # chat requests: the model reads the last user message and the turns before it
    chat = [{"role": "user", "content": "Write a poem"}, {"role": "assistant", "content": "Roses are red. " * 60},
            {"role": "user", "content": "Another one"}]
    sample = LengthSample("Another one", 1, "c", history=("Write a poem", "Roses are red. " * 60),
                          message="Another one")
    assert m.predict_chats([chat]).tolist() == m.predict_samples([sample]).tolist()
    # a long previous reply predicts a longer next reply than a one-word one
    short = [chat[0], {"role": "assistant", "content": "Roses."}, chat[2]]
    assert m.predict_chats([chat])[0] > m.predict_chats([short])[0]
    (d,) = m.predict_dist_chats([chat])
    assert d.quantile(0.1) < d.median_tokens < d.quantile(0.9)


@pytest.mark.parametrize("name", ["chat-gbm", "classic"])
def test_shipped_artifacts_hold_no_text(name):
    d = LENGTH_ARTIFACTS_DIR / name
    assert sorted(p.name for p in d.iterdir()) == ["meta.json", "model.npz"]
    with np.load(d / "model.npz", allow_pickle=False) as z:
        # numbers only (floats, tree indices, flags): hashed features, no vocabulary
        assert all(z[k].dtype.kind in "fiub" for k in z.files)
    meta = json.loads((d / "meta.json").read_text())
    assert meta["data"]["source"] == "sharegpt_v3_sample500.json"  # a file name, not content
    assert meta["split"] == {"by": "conversation id", "seed": 0, "test_frac": 0.2, "val_frac": 0.1}
    assert meta["data"]["n_pairs"] == 1792
