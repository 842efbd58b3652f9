"""Prompt/output token counting shared by the engine, the Predictor, the tagger and the
bench, so every part counts the same way.

When a Hugging Face tokenizer is available locally (`load_counter(path)`), it is used.
Otherwise the documented fallback `count_tokens_fallback` applies: split the text into
words (runs of letters/digits/underscore) and single non-space symbols; a word costs
ceil(len/4) tokens, a symbol 1 token. On English chat text this lands within ~15% of the
Llama-2 tokenizer (BPE averages ~4 characters per token), and it is deterministic,
dependency-free and fast (~1 µs per 100 characters).
"""

from __future__ import annotations

import array
import functools
import re
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

# one fallback token per match: a word (a run of L letters/digits/underscores) is cut by
# the greedy `\w{1,4}` into ceil(L/4) chunks, a non-space symbol is one match; counting
# and ids are then one `findall` (1.7× / 2.6× faster than walking word matches and
# slicing them, measured on the ShareGPT sample's turns)
FALLBACK_TOKEN_MAX_CHARS = 4  # the longest fallback token (one match of _TOKEN), in characters
_TOKEN = re.compile(rf"\w{{1,{FALLBACK_TOKEN_MAX_CHARS}}}|[^\w\s]", re.UNICODE)
_SPACE = re.compile(r"\s", re.UNICODE)  # the characters _TOKEN skips (no token covers them)

TokenCounter = Callable[[str], int]
TokenIds = Callable[[str], list[int]]
FALLBACK_VOCAB_SIZE = 1 << 32  # the fallback's ids are CRC-32s: 0 ≤ id < 2**32


def token_ids_fallback(text: str) -> list[int]:
    """Stable token ids of `text` under the fallback tokenization: each piece of
    `count_tokens_fallback` is cut into 4-character chunks, and a chunk's id is its
    CRC-32, so len(token_ids_fallback(t)) == count_tokens_fallback(t), equal texts get
    equal ids in every process, and text joined at whitespace keeps its prefix's ids
    (what prefix caching needs of a multi-turn history). A lone surrogate (text decoded
    from bad data; the HTTP servers refuse it) is one symbol, hashed as "surrogatepass"
    encodes it, never an error."""
    crc = zlib.crc32
    try:
        return [crc(piece.encode("utf-8")) for piece in _TOKEN.findall(text)]
    except UnicodeEncodeError:  # off the hot path: only text holding a lone surrogate
        return [crc(piece.encode("utf-8", "surrogatepass")) for piece in _TOKEN.findall(text)]


def count_tokens_fallback(text: str) -> int:
    """Fallback token count of `text` (tokens). Empty text → 0."""
    return len(_TOKEN.findall(text))


@functools.cache
def fallback_space_chars() -> tuple[str, ...]:
    """Every character `\\s` matches in `_TOKEN` (what no fallback token covers), found by
    running that regex over every code point once (~40 ms; cached): on CPython's Unicode
    database the 29 characters `str.isspace()` is true of."""
    every = array.array("I", range(sys.maxunicode + 1)).tobytes()
    text = every.decode(f"utf-32-{'le' if sys.byteorder == 'little' else 'be'}", "surrogatepass")
    return tuple(_SPACE.findall(text))


def fallback_tokens_at_least(text: str) -> int:
    """A lower bound of `count_tokens_fallback(text)` without tokenizing it: every
    character that is not whitespace (`fallback_space_chars`) starts or continues one
    match of `_TOKEN` (a `\\w` character is in a word chunk, any other one is a symbol),
    and a match holds at most `FALLBACK_TOKEN_MAX_CHARS` (4) characters, so the count is
    at least ceil(non-space characters / 4) — exactly that for runs of 4-letter words.
    ~0.7 ms per MB of ASCII text (one `str.translate`), ~4-7 ms per MB otherwise (one
    `str.count` per whitespace character), against ~40-50 ms to tokenize it."""
    if text.isascii():  # str.translate's ASCII fast path
        nonspace = len(text.translate(_space_table()))
    else:  # a character wider than the text's own (its `kind`) is counted in O(1)
        nonspace = len(text) - sum(text.count(c) for c in fallback_space_chars())
    return -(-nonspace // FALLBACK_TOKEN_MAX_CHARS)


@functools.cache
def _space_table() -> dict[int, None]:
    return dict.fromkeys(map(ord, fallback_space_chars()))


def load_token_ids(tokenizer_path: str | Path | None) -> TokenIds:
    """Token ids for `tokenizer_path` (a local HF tokenizer folder), or the fallback's;
    `load_counter`'s count is the length of these ids.

    Raises:
        AstroUserError: the path is given but no tokenizer loads from it.
    """
    if not tokenizer_path:
        return token_ids_fallback
    tok = _load_hf(tokenizer_path)
    return lambda text: list(tok(text, add_special_tokens=False)["input_ids"])


def load_counter(tokenizer_path: str | Path | None) -> TokenCounter:
    """A counter for `tokenizer_path` (a local HF tokenizer folder) or the fallback.

    Raises:
        AstroUserError: the path is given but no tokenizer loads from it.
    """
    if not tokenizer_path:
        return count_tokens_fallback
    tok = _load_hf(tokenizer_path)
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


class _FastTokenizer:
    """A `tokenizer.json` read by the `tokenizers` package (no transformers, no hub):
    called like a Hugging Face tokenizer, `tok(text, add_special_tokens=...)["input_ids"]`."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer  # optional (the test and transformers extras)

        self._tok = Tokenizer.from_file(str(path))

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self._tok.encode(text, add_special_tokens=add_special_tokens).ids}

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def __len__(self) -> int:  # the vocabulary with added tokens, as a transformers tokenizer's len()
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]


def _tokenizer_json(tokenizer_path: str | Path) -> Path | None:
    p = Path(tokenizer_path).expanduser()
    if p.is_file() and p.suffix == ".json":
        return p
    if p.is_dir() and (p / "tokenizer.json").is_file():
        return p / "tokenizer.json"
    return None


def load_counter_with_special(tokenizer_path: str | Path | None) -> TokenCounter:
    """Counts as `vllm bench serve` counts a dataset's prompt and reply,
    `len(tokenizer(text).input_ids)`: special tokens (BOS) included. Without a tokenizer,
    the fallback (which has no special tokens).

    Raises:
        AstroUserError: the path is given but no tokenizer loads from it.
    """
    if not tokenizer_path:
        return count_tokens_fallback
    tok = _load_hf(tokenizer_path)
    return lambda text: len(tok(text)["input_ids"])


def _load_hf(tokenizer_path: str | Path):  # type: ignore[no-untyped-def]
    """A tokenizer for a local folder or `tokenizer.json`: through the `tokenizers`
    package when the folder has a `tokenizer.json` and the package is installed (fast,
    no transformers), else transformers' AutoTokenizer."""
    from rps_astro_cli.errors import AstroUserError

    fast = _tokenizer_json(tokenizer_path)
    if fast is not None:
        try:
            return _FastTokenizer(fast)
        except ImportError:
            pass
        except Exception as exc:
            raise AstroUserError(f"cannot load a tokenizer from {fast}: {exc}", field="tokenizer") from exc
    try:
        from transformers import AutoTokenizer  # optional extra
    except ImportError as exc:  # pragma: no cover - depends on extras
        raise AstroUserError(
            "a tokenizer path was given but neither tokenizers (for a tokenizer.json) nor transformers is installed",
            field="tokenizer",
            fix="pip install 'rps_astro_cli[transformers]' or drop --tokenizer",
        ) from exc
    try:
        tok = AutoTokenizer.from_pretrained(str(tokenizer_path), local_files_only=True)
    except Exception as exc:
        raise AstroUserError(
            f"cannot load a tokenizer from {tokenizer_path}: {exc}", field="tokenizer"
        ) from exc
    return tok


# -- encode and decode (the sim engine's /tokenize and /detokenize) ---------------------
class FallbackCodec:
    """The fallback tokenization as a codec: `encode` is `token_ids_fallback`; `decode`
    knows the ids of the pieces this codec has encoded (a table of at most `max_ids`
    entries; ids are CRC-32 hashes, which cannot be inverted) and joins a word's pieces
    directly and words with one space — the fallback keeps no whitespace, so
    decode(encode(t)) is t with its whitespace normalized and a space before each
    punctuation mark. An id it never produced raises KeyError."""

    vocab_size = FALLBACK_VOCAB_SIZE  # ids are CRC-32s

    def __init__(self, max_ids: int = 1_000_000) -> None:
        self.max_ids = max_ids
        self._pieces: dict[int, tuple[str, bool]] = {}  # id -> (piece, starts a word)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out: list[int] = []
        table = self._pieces
        for m in _TOKEN.finditer(text):
            piece = m.group()
            tid = zlib.crc32(piece.encode("utf-8", "surrogatepass"))  # as token_ids_fallback
            if tid not in table and len(table) < self.max_ids:
                # a piece starts a word unless it continues a run of word characters
                # (`\w` is str.isalnum() or "_")
                at = m.start()
                prev = text[at - 1] if at else " "
                cont = (prev.isalnum() or prev == "_") and (piece[0].isalnum() or piece[0] == "_")
                table[tid] = (piece, not cont)
            out.append(tid)
        return out

    def token_strs(self, ids: list[int]) -> list[str]:
        return [self._pieces[i][0] for i in ids]

    def decode(self, ids: list[int]) -> str:
        parts: list[str] = []
        for i in ids:
            piece, starts = self._pieces[i]
            parts.append((" " + piece) if starts and parts else piece)
        return "".join(parts)


class HFCodec:
    """A local Hugging Face tokenizer (`tokenizer.json` through `tokenizers`, or
    transformers) as a codec."""

    def __init__(self, tokenizer_path: str | Path) -> None:
        self._tok = _load_hf(tokenizer_path)
        self.vocab_size = len(self._tok)  # ids 0 .. vocab_size − 1, added tokens included

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def token_strs(self, ids: list[int]) -> list[str]:
        try:
            strs = self._tok.convert_ids_to_tokens(list(ids))
        except (IndexError, OverflowError, TypeError):
            strs = [None]
        if any(t is None for t in strs):
            raise KeyError(next((i for i, t in zip(ids, strs) if t is None), ids[0] if ids else None))
        return list(strs)

    def decode(self, ids: list[int]) -> str:
        self.token_strs(ids)  # an id outside the vocabulary raises KeyError
        return self._tok.decode(list(ids))


def load_codec(tokenizer_path: str | Path | None) -> FallbackCodec | HFCodec:
    """The codec of `tokenizer_path` (a local HF tokenizer folder), or the fallback's.

    Raises:
        AstroUserError: the path is given but no tokenizer loads from it.
    """
    return HFCodec(tokenizer_path) if tokenizer_path else FallbackCodec()
