"""Length data loading, prompt preparation and conversation-level splits."""

import json

import numpy as np
import pytest

from rps_astro_cli.data_paths import data_dir
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.length.data import (
    LengthDataset,
    LengthSample,
    conversation_key,
    load_length_data,
    split_by_conversation,
)
from rps_astro_cli.length.prompts import MAX_PROMPT_CHARS, prepare_prompts, text_from_content, truncate_prompt

# Made-up conversations (no dataset text). Fallback token counts: a word costs ceil(len/4).
TINY_SHAREGPT = [
    {"id": "abc_0", "conversations": [
        {"from": "human", "value": "Hi there"},
        {"from": "gpt", "value": "Hello friend how are you"},   # 2+2+1+1+1 = 7 tokens
        {"from": "human", "value": "Tell me more"},
        {"from": "gpt", "value": "Sure"},                       # 1 token
    ]},
    {"id": "abc_1", "conversations": [
        {"from": "gpt", "value": "starting with a reply"},      # no human before it: not a pair
        {"from": "human", "value": "q"},
        {"from": "gpt", "value": "a b"},                        # 2 tokens
    ]},
    {"id": "x", "conversations": [{"from": "human", "value": "  "}, {"from": "gpt", "value": "reply"}]},
    {"id": "y", "conversations": [{"from": "human", "value": "hey"}, {"from": "gpt", "value": ""}]},
    {"id": "z", "conversations": [
        {"from": "human", "value": [{"type": "text", "text": "describe"},
                                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]},
        {"from": "gpt", "value": "an image"},                   # 1+2 = 3 tokens
    ]},
]


def _write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(json.dumps(obj), encoding="utf-8")
    return p


def test_sharegpt_pairs(tmp_path):
    ds = load_length_data(_write(tmp_path, "s.json", TINY_SHAREGPT))
    assert [(s.prompt, s.response_tokens, s.conversation_id) for s in ds.samples] == [
        ("Hi there", 7, "abc"), ("Tell me more", 1, "abc"), ("q", 2, "abc"), ("describe", 3, "z"),
    ]
    assert ds.tokenizer == "fallback"
    assert "dropped 1 pair(s) with an empty prompt" in ds.notes
    assert "dropped 1 pair(s) with an empty reply" in ds.notes
    assert "ignored 1 non-text content part(s)" in ds.notes
    assert ds.targets.tolist() == [7, 1, 2, 3]


def test_context_turns_and_jsonl(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in TINY_SHAREGPT) + "\n", encoding="utf-8")
    ds = load_length_data(p, context_turns=1)
    assert ds.samples[1].prompt == "Hello friend how are you\n\nTell me more"
    assert ds.samples[0].prompt == "Hi there"


def test_pairs_csv_and_jsonl(tmp_path):
    c = tmp_path / "p.csv"
    c.write_text("prompt,response_tokens,conversation_id\nhello,12,c1\nbye,0,c2\nagain,30,c1\n", encoding="utf-8")
    ds = load_length_data(c)
    assert [(s.prompt, s.response_tokens, s.conversation_id) for s in ds.samples] == [("hello", 12, "c1"),
                                                                                      ("again", 30, "c1")]
    assert ds.notes == ["dropped 1 row(s) with an empty prompt or response_tokens < 1"]
    j = tmp_path / "p.jsonl"
    j.write_text('{"prompt": "a", "response": "one two three"}\n{"prompt": "b", "response_tokens": 5}\n',
                 encoding="utf-8")
    ds = load_length_data(j)
    # "one two three" = 1 + 1 + 2 tokens
    assert [(s.response_tokens, s.conversation_id) for s in ds.samples] == [(4, "row1"), (5, "row2")]


@pytest.mark.parametrize(
    "name, content, needle",
    [
        ("bad.json", b'[{"id": "a", "conversations": [{"from": "human", "value": "caf\xe9"}]}]', "not valid UTF-8"),
        ("bad.json", b'[{"id": "a",', "invalid JSON"),
        ("bad.txt", b"hello", "unknown data format"),
        ("bad.csv", b"text,n\nx,1\n", "'prompt' column"),
        ("bad.jsonl", b'{"prompt": "a", "response_tokens": "many"}\n', "is not a number"),
        ("empty.json", b"[]", "no (prompt, response) pairs"),
    ],
)
def test_bad_files(tmp_path, name, content, needle):
    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(AstroUserError, match="--data") as e:
        load_length_data(p)
    assert needle in str(e.value)


def test_non_utf8_names_offset(tmp_path):
    p = tmp_path / "x.json"
    p.write_bytes(b'[\n"caf\xe9"]')
    with pytest.raises(AstroUserError) as e:
        load_length_data(p)
    assert "offset 6, line 2" in str(e.value) and "0xe9" in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(AstroUserError, match="no such file"):
        load_length_data(tmp_path / "nope.json")


def test_conversation_key():
    assert conversation_key("QWJhYmc_12", 0) == "QWJhYmc"
    assert conversation_key("plain", 0) == "plain"
    assert conversation_key(None, 7) == "row7"


def _many(n_conv: int, per: int) -> LengthDataset:
    return LengthDataset([LengthSample(f"p{c}-{k}", 10 + k, f"c{c}") for c in range(n_conv) for k in range(per)])


def test_split_by_conversation_sizes_and_disjoint():
    ds = _many(50, 3)
    sp = split_by_conversation(ds, test_frac=0.2, val_frac=0.1, rng=np.random.default_rng(3))
    ids = [set(part.conversation_ids) for part in (sp.train, sp.val, sp.test)]
    assert [len(i) for i in ids] == [35, 5, 10]
    assert [len(p) for p in (sp.train, sp.val, sp.test)] == [105, 15, 30]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    again = split_by_conversation(ds, test_frac=0.2, val_frac=0.1, rng=np.random.default_rng(3))
    assert again.test.conversation_ids == sp.test.conversation_ids
    other = split_by_conversation(ds, test_frac=0.2, val_frac=0.1, rng=np.random.default_rng(4))
    assert set(other.test.conversation_ids) != ids[2]


def test_split_fraction_errors():
    ds = _many(5, 1)
    with pytest.raises(AstroUserError, match="--test-split"):
        split_by_conversation(ds, test_frac=1.5, val_frac=0.0, rng=np.random.default_rng(0))
    with pytest.raises(AstroUserError, match="no training data"):
        split_by_conversation(ds, test_frac=0.6, val_frac=0.4, rng=np.random.default_rng(0))
    all_test = split_by_conversation(ds, test_frac=1.0, val_frac=0.0, rng=np.random.default_rng(0))
    assert len(all_test.test) == 5 and len(all_test.train) == 0


def test_sha256_depends_on_content():
    a, b = _many(3, 2), _many(3, 2)
    assert a.sha256() == b.sha256()
    b.samples[0] = LengthSample("changed", 10, "c0")
    assert a.sha256() != b.sha256()


# --------------------------------------------------------------------- prompts


def test_truncate_100k_prompt():
    text = "A" * 50_000 + "B" * 50_000
    cut, was_cut = truncate_prompt(text)
    assert was_cut and len(cut) == MAX_PROMPT_CHARS
    assert cut.startswith("A" * 24_576) and cut.endswith("B" * (MAX_PROMPT_CHARS - 24_576 - 3))
    prepared = prepare_prompts([text, "short"])
    assert prepared.texts[1] == "short"
    assert prepared.notes == [f"1 prompt(s) longer than {MAX_PROMPT_CHARS} characters were truncated"]
    assert truncate_prompt("x" * MAX_PROMPT_CHARS) == ("x" * MAX_PROMPT_CHARS, False)


def test_content_parts():
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "x"}},
             {"type": "video_url", "video_url": {"url": "y"}}, {"type": "text", "text": "here"}]
    assert text_from_content(parts) == ("look\n\nhere", 2)
    assert text_from_content(None) == ("", 0)
    prepared = prepare_prompts([parts, ""])
    assert prepared.texts == ["look\n\nhere", ""]
    assert "2 non-text content part(s) were ignored" in prepared.notes[0]


@pytest.mark.parametrize(
    "prompts, field",
    [("just a string", "prompts"), (["ok", 5], "prompts[1]"), (["ok", b"raw"], "prompts[1]"),
     ([[{"type": "text", "text": 3}]], "prompts[0][0].text"), ([[7]], "prompts[0][0]")],
)
def test_bad_prompts_name_the_field(prompts, field):
    with pytest.raises(AstroUserError) as e:
        prepare_prompts(prompts)
    assert e.value.field == field


@pytest.mark.skipif(data_dir() is None or not (data_dir() / "sharegpt/sharegpt_v3_sample500.json").is_file(),
                    reason="shared ShareGPT sample absent")
def test_real_sharegpt_sample_counts():
    ds = load_length_data(data_dir() / "sharegpt/sharegpt_v3_sample500.json")
    # 1,794 adjacent human→gpt pairs in 500 records; 2 have an empty prompt; 500 record ids
    # collapse to 492 conversations once V3 chunk suffixes are stripped, 490 of which have
    # at least one non-empty pair.
    assert len(ds) == 1792
    assert len(set(ds.conversation_ids)) == 490
    assert ds.notes == ["dropped 2 pair(s) with an empty prompt"]
    assert ds.targets.min() >= 1


def test_hub_without_datasets_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(AstroUserError, match=r"need the 'datasets' package.*rps_astro_cli\[hub\]"):
        load_length_data("hf:anon/sharegpt")


def test_prompt_from_messages():
    from rps_astro_cli.length.prompts import prompt_from_messages

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "first"},
            {"role": "assistant", "content": "answer one"},
            {"role": "user", "content": [{"type": "text", "text": "second"}, {"type": "image_url", "image_url": {}}]}]
    assert prompt_from_messages(msgs, 0) == "second"
    assert prompt_from_messages(msgs, 1) == "answer one\n\nsecond"
    assert prompt_from_messages(msgs, 5) == "first\n\nanswer one\n\nsecond"  # system skipped
    assert prompt_from_messages(msgs[:2], 1) == "first"
    with pytest.raises(AstroUserError, match="no user message"):
        prompt_from_messages([{"role": "assistant", "content": "x"}])
    with pytest.raises(AstroUserError) as e:
        prompt_from_messages([{"content": "x"}])
    assert e.value.field == "messages[0]"


def test_prompt_from_messages_matches_training_pairs(tmp_path):
    """A chat request rebuilt from the same turns gives exactly the training prompt."""
    from rps_astro_cli.length.prompts import prompt_from_messages

    p = tmp_path / "s.json"
    p.write_text(json.dumps(TINY_SHAREGPT), encoding="utf-8")
    ds = load_length_data(p, context_turns=1)
    roles = {"human": "user", "gpt": "assistant"}
    conv = TINY_SHAREGPT[0]["conversations"][:3]
    msgs = [{"role": roles[t["from"]], "content": t["value"]} for t in conv]
    assert prompt_from_messages(msgs, 1) == ds.samples[1].prompt
