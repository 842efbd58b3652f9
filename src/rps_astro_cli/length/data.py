"""Training/evaluation data for response-length models: (prompt, response tokens) pairs.

Sources (`load_length_data`):
- Conversations, JSON/JSONL: ShareGPT (`[{id, conversations: [{from, value}]}]`), OpenAI
  chat (`{messages: [{role, content}]}`) or LMSYS-Chat-1M (`{conversation_id,
  conversation: [{role, content}]}`); every adjacent
  human → gpt turn pair is one sample (so a 3-exchange conversation gives 3 samples);
  the target is the reply's length in target-model tokens (a local tokenizer, or the
  shared fallback counter `rps_astro_cli.tokens.count_tokens_fallback`). Optionally the
  `context_turns` earlier turns are prepended to the prompt. ShareGPT V3's "split" files
  cut long conversations into chunks `<id>_<k>`: chunks share a conversation id here, so
  a split never puts one conversation on both sides.
- `(prompt, response_tokens)` JSONL or CSV (optional `conversation_id`; a `response`
  text column is counted instead when `response_tokens` is absent).
- Hub datasets (`hf:<name>[:<split>]`) through the `datasets` package when it is installed
  and the hub is reachable.

Rows with an empty prompt or an empty reply are dropped and counted in `notes`.
Splits (`split_by_conversation`) are by conversation id, never by row, with an explicit
numpy Generator.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.length.prompts import text_from_content
from rps_astro_cli.tokens import TokenCounter, load_counter

HUMAN_ROLES = frozenset({"human", "user"})
REPLY_ROLES = frozenset({"gpt", "assistant", "chatgpt", "bard", "bing"})
_CHUNK_SUFFIX = re.compile(r"_\d+$")


@dataclass(frozen=True, slots=True)
class LengthSample:
    """One training pair.

    prompt: the prompt text (untruncated; models truncate), with the loader's
    `context_turns` earlier turns prepended. response_tokens: reply length in
    target-model tokens (≥ 1). conversation_id: the split key. history: the texts of every
    turn before this human turn, oldest first, roles alternating as in the conversation
    (empty for a first turn or a (prompt, response_tokens) row); models that read the
    conversation's structure (`length.structured`) use it, the others see only `prompt`.
    message: this human turn's own text (= prompt when nothing was prepended).
    """

    prompt: str
    response_tokens: int
    conversation_id: str
    history: tuple[str, ...] = ()
    message: str | None = None

    @property
    def text(self) -> str:
        """This human turn's text alone."""
        return self.prompt if self.message is None else self.message


@dataclass
class LengthDataset:
    """A list of samples plus where they came from.

    source: the path or hub name. tokenizer: "fallback" or the tokenizer path used to count
    targets. notes: what loading dropped or changed.
    """

    samples: list[LengthSample]
    source: str = ""
    tokenizer: str = "fallback"
    notes: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def prompts(self) -> list[str]:
        return [s.prompt for s in self.samples]

    @property
    def targets(self) -> np.ndarray:
        """Response lengths, shape (n,), int64 tokens."""
        return np.fromiter((s.response_tokens for s in self.samples), dtype=np.int64, count=len(self.samples))

    @property
    def conversation_ids(self) -> list[str]:
        return [s.conversation_id for s in self.samples]

    @property
    def first_turn_mask(self) -> np.ndarray:
        """Whether each sample is its conversation's first exchange (no history), shape (n,)."""
        return np.fromiter((not s.history for s in self.samples), dtype=bool, count=len(self.samples))

    def sha256(self) -> str:
        """Hash of every (conversation id, prompt, target) in order: identifies the data
        an artifact was trained on without storing any of its text."""
        h = hashlib.sha256()
        for s in self.samples:
            h.update(s.conversation_id.encode("utf-8", "surrogatepass") + b"\x00")
            h.update(s.prompt.encode("utf-8", "surrogatepass") + b"\x00")
            h.update(str(s.response_tokens).encode() + b"\x01")
        return h.hexdigest()

    def subset(self, indices: Iterable[int]) -> LengthDataset:
        return LengthDataset(
            [self.samples[i] for i in indices], source=self.source, tokenizer=self.tokenizer
        )


@dataclass(frozen=True)
class DataSplit:
    """train / val / test parts of one dataset, disjoint by conversation id."""

    train: LengthDataset
    val: LengthDataset
    test: LengthDataset


def conversation_key(raw_id: Any, row: int) -> str:
    """The split key of a ShareGPT record: its id without a V3 chunk suffix `_<k>`;
    `row<N>` when the record has no id."""
    if raw_id is None or raw_id == "":
        return f"row{row}"
    return _CHUNK_SUFFIX.sub("", str(raw_id))


def split_by_conversation(
    data: LengthDataset, *, test_frac: float, val_frac: float, rng: np.random.Generator
) -> DataSplit:
    """Split `data` by conversation id: the sorted unique ids are permuted by `rng`; the
    first round(test_frac·n_ids) go to test, the next round(val_frac·n_ids) to val, the
    rest to train (a non-zero fraction gets at least one conversation).

    Raises:
        AstroUserError: a fraction is outside [0, 1) or test_frac + val_frac ≥ 1 while
            training needs rows (test_frac == 1 with val_frac == 0 is allowed: all test).
    """
    for name, frac in (("--test-split", test_frac), ("--val-split", val_frac)):
        if not 0.0 <= frac <= 1.0:
            raise AstroUserError(f"must be in [0, 1], got {frac}", field=name)
    if test_frac + val_frac > 1.0 or (test_frac + val_frac == 1.0 and val_frac > 0):
        raise AstroUserError(
            f"test ({test_frac}) + val ({val_frac}) fractions leave no training data",
            field="--test-split",
        )
    ids = np.array(sorted(set(data.conversation_ids)), dtype=object)
    order = ids[rng.permutation(len(ids))]
    n = len(ids)
    n_test = int(round(test_frac * n))
    n_val = int(round(val_frac * n))
    if test_frac > 0 and n_test == 0 and n > 0:
        n_test = 1
    if val_frac > 0 and n_val == 0 and n - n_test > 1:
        n_val = 1
    test_ids = set(order[:n_test])
    val_ids = set(order[n_test : n_test + n_val])
    tr, va, te = [], [], []
    for i, s in enumerate(data.samples):
        (te if s.conversation_id in test_ids else va if s.conversation_id in val_ids else tr).append(i)
    return DataSplit(data.subset(tr), data.subset(va), data.subset(te))


# ---------------------------------------------------------------------------- loading


def read_text_file(path: Path) -> str:
    """The file's text, strictly UTF-8 (a BOM is skipped).

    Raises:
        AstroUserError: the file is missing, or has bytes that are not UTF-8 (names the byte
            offset and line).
    """
    if not path.is_file():
        raise AstroUserError(f"no such file: {path}", field="--data")
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise AstroUserError(
            f"{path}: not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start}, line {line})",
            field="--data",
            fix="re-encode the file as UTF-8, e.g. iconv -f latin1 -t utf-8",
        ) from None


CONVERSATION_FIELDS = ("conversations", "conversation", "messages")  # ShareGPT, LMSYS-Chat, OpenAI


def conversation_field(rec: Any) -> str | None:
    """The record's list-of-turns field: ShareGPT `conversations` ({from, value} turns),
    LMSYS-Chat-1M `conversation` or OpenAI `messages` ({role, content} turns); None
    when it has none."""
    if isinstance(rec, dict):
        for k in CONVERSATION_FIELDS:
            if isinstance(rec.get(k), list):
                return k
    return None


def _sharegpt_samples(
    records: Iterable[Any], counter: TokenCounter, context_turns: int, notes: list[str], where: str
) -> Iterator[LengthSample]:
    n_empty_prompt = n_empty_reply = n_parts = n_bad = 0
    for row, rec in enumerate(records):
        key = conversation_field(rec)
        turns = rec.get(key) if key is not None else None
        if not isinstance(turns, list):
            n_bad += 1
            continue
        cid = conversation_key(rec.get("id", rec.get("conversation_id")), row)
        texts: list[str] = []
        roles: list[str] = []
        for t_i, turn in enumerate(turns):
            if not isinstance(turn, dict):
                n_bad += 1
                texts.append("")
                roles.append("")
                continue
            tkey = "value" if "value" in turn else "content"  # ShareGPT | OpenAI / LMSYS-Chat
            text, ignored = text_from_content(turn.get(tkey), where=f"{where}[{row}].{key}[{t_i}].{tkey}")
            n_parts += ignored
            texts.append(text)
            roles.append(str(turn.get("from", turn.get("role", ""))).lower())
        for i in range(len(turns) - 1):
            if roles[i] not in HUMAN_ROLES or roles[i + 1] not in REPLY_ROLES:
                continue
            prompt = texts[i]
            if context_turns > 0 and i > 0:
                prompt = "\n\n".join(texts[max(0, i - context_turns) : i] + [prompt])
            if not texts[i].strip():
                n_empty_prompt += 1
                continue
            target = counter(texts[i + 1])
            if target < 1:
                n_empty_reply += 1
                continue
            yield LengthSample(prompt, int(target), cid, history=tuple(texts[:i]), message=texts[i])
    if n_empty_prompt:
        notes.append(f"dropped {n_empty_prompt} pair(s) with an empty prompt")
    if n_empty_reply:
        notes.append(f"dropped {n_empty_reply} pair(s) with an empty reply")
    if n_parts:
        notes.append(f"ignored {n_parts} non-text content part(s)")
    if n_bad:
        notes.append(f"skipped {n_bad} record(s)/turn(s) that are not ShareGPT objects")


def _pair_samples(
    rows: Iterable[tuple[int, dict[str, Any]]], counter: TokenCounter, notes: list[str], where: str
) -> Iterator[LengthSample]:
    n_empty = 0
    for row, rec in rows:
        if "prompt" not in rec:
            raise AstroUserError(f"{where}: row {row} has no 'prompt'", field="--data",
                                 fix="columns: prompt,response_tokens")
        prompt, ignored = text_from_content(rec["prompt"], where=f"{where} row {row} prompt")
        if ignored:
            notes.append(f"row {row}: ignored {ignored} non-text content part(s)")
        if rec.get("response_tokens") not in (None, ""):
            try:
                target = int(float(rec["response_tokens"]))
            except (TypeError, ValueError):
                raise AstroUserError(
                    f"{where}: row {row}: response_tokens {rec['response_tokens']!r} is not a number", field="--data"
                ) from None
        elif isinstance(rec.get("response"), str):
            target = counter(rec["response"])
        else:
            raise AstroUserError(
                f"{where}: row {row} has neither 'response_tokens' nor 'response'", field="--data"
            )
        if not prompt.strip() or target < 1:
            n_empty += 1
            continue
        cid = rec.get("conversation_id")
        yield LengthSample(prompt, target, str(cid) if cid not in (None, "") else f"row{row}")
    if n_empty:
        notes.append(f"dropped {n_empty} row(s) with an empty prompt or response_tokens < 1")


def _parse_json(text: str, path: Path) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise AstroUserError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}", field="--data") from None


def load_length_data(
    source: str | Path,
    *,
    tokenizer: str | Path | None = None,
    context_turns: int = 0,
    counter: TokenCounter | None = None,
) -> LengthDataset:
    """Load (prompt, response tokens) samples from a file or the hub (see module docstring).

    Args:
        source: a `.json`/`.jsonl` (ShareGPT or pairs) or `.csv` (pairs) path, or
            `hf:<name>[:<split>]`.
        tokenizer: local tokenizer folder for counting reply tokens; None → fallback counter.
        context_turns: earlier turns prepended to each prompt (0 = the human turn alone).
        counter: overrides `tokenizer` (tests).

    Raises:
        AstroUserError: missing file, not UTF-8, invalid JSON/CSV, unknown format, no
            samples left, or the hub is unavailable.
    """
    if context_turns < 0:
        raise AstroUserError("must be ≥ 0", field="--context-turns")
    if counter is None:
        counter = load_counter(tokenizer)
    tok_name = str(tokenizer) if tokenizer else "fallback"
    notes: list[str] = []
    src = str(source)
    if src.startswith("hf:"):
        samples = list(_load_hub(src[3:], counter, context_turns, notes))
    else:
        path = Path(source)
        text = read_text_file(path)
        suffix = path.suffix.lower()
        if suffix == ".csv":
            reader = csv.DictReader(io.StringIO(text))
            if not reader.fieldnames or "prompt" not in reader.fieldnames:
                raise AstroUserError(
                    f"{path}: CSV needs a 'prompt' column, found {reader.fieldnames}", field="--data"
                )
            samples = list(_pair_samples(enumerate(reader, start=2), counter, notes, str(path)))
        elif suffix == ".jsonl":
            recs = []
            for n, line in enumerate(text.split("\n"), start=1):  # only \n: U+2028 may sit inside a string
                if line.strip():
                    try:
                        recs.append((n, json.loads(line)))
                    except json.JSONDecodeError as exc:
                        raise AstroUserError(f"{path}: line {n} is not JSON: {exc.msg}", field="--data") from None
            samples = list(_samples_from_records(recs, counter, context_turns, notes, str(path)))
        elif suffix == ".json":
            obj = _parse_json(text, path)
            if not isinstance(obj, list):
                raise AstroUserError(f"{path}: expected a JSON list of records", field="--data")
            samples = list(_samples_from_records(list(enumerate(obj)), counter, context_turns, notes, str(path)))
        else:
            raise AstroUserError(
                f"{path}: unknown data format {suffix!r}", field="--data", fix="use .json, .jsonl or .csv, or hf:<name>"
            )
    if not samples:
        raise AstroUserError(f"{source}: no (prompt, response) pairs found", field="--data")
    return LengthDataset(samples, source=src, tokenizer=tok_name, notes=notes)


def _samples_from_records(
    recs: list[tuple[int, Any]], counter: TokenCounter, context_turns: int, notes: list[str], where: str
) -> Iterator[LengthSample]:
    if recs and conversation_field(recs[0][1]) is not None:
        yield from _sharegpt_samples((r for _, r in recs), counter, context_turns, notes, where)
    else:
        for row, r in recs:
            if not isinstance(r, dict):
                raise AstroUserError(f"{where}: record {row} is not an object", field="--data")
            if "prompt" not in r:
                raise AstroUserError(
                    f"{where}: record {row} has none of the fields prompt, "
                    f"{', '.join(CONVERSATION_FIELDS)} (found: {', '.join(map(str, r)) or 'none'})",
                    field="--data",
                    fix="give ShareGPT {conversations: [{from, value}]}, OpenAI {messages: [{role, content}]}, "
                        "LMSYS-Chat {conversation: [{role, content}]} or {prompt, response_tokens} records")
        yield from _pair_samples(recs, counter, notes, where)


def _load_hub(spec: str, counter: TokenCounter, context_turns: int, notes: list[str]) -> Iterator[LengthSample]:
    name, _, split = spec.partition(":")
    try:
        import datasets  # optional extra 'hub'
    except ImportError:
        raise AstroUserError(
            "hub datasets need the 'datasets' package", field="--data",
            fix="pip install 'rps_astro_cli[hub]' or pass a file"
        ) from None
    try:
        ds = datasets.load_dataset(name, split=split or "train")
    except Exception as exc:  # network, missing dataset, auth: all user-facing here
        raise AstroUserError(
            f"cannot load hub dataset {name!r}: {type(exc).__name__}: {exc}", field="--data",
            fix="check the name and network, or download it and pass the file",
        ) from None
    yield from _samples_from_records(list(enumerate(ds)), counter, context_turns, notes, f"hf:{name}")


__all__ = [
    "DataSplit",
    "LengthDataset",
    "LengthSample",
    "load_length_data",
    "read_text_file",
    "split_by_conversation",
]
