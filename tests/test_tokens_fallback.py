"""The fallback token counter's documented rule (tokens.py): words cost ceil(len/4)
tokens, every non-space symbol 1; ids are the CRC-32 of each 4-character word chunk."""

from __future__ import annotations

import re
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from rps_astro_cli.tokens import count_tokens_fallback, token_ids_fallback


def _reference_pieces(text: str) -> list[str]:
    """The rule written out directly: word runs cut into 4-character chunks, symbols alone."""
    out = []
    for w in re.findall(r"\w+|[^\w\s]", text):
        out += [w[j:j + 4] for j in range(0, len(w), 4)]
    return out


def test_hand_counted_cases() -> None:
    # "hello" 2 (5 chars), "," 1, "world" 2, "!" 1
    assert count_tokens_fallback("hello, world!") == 6
    # "abcdefghi" → abcd|efgh|i = 3; "x_1" 1; "?" "?" 2
    assert count_tokens_fallback("abcdefghi x_1 ??") == 6
    assert count_tokens_fallback("") == 0 and count_tokens_fallback(" \n\t ") == 0
    # non-ASCII letters are word characters: "ñandú" 2, "東京タワー" 2
    assert count_tokens_fallback("ñandú 東京タワー") == 4
    ids = token_ids_fallback("abcdefghi!")
    assert ids == [zlib.crc32(b"abcd"), zlib.crc32(b"efgh"), zlib.crc32(b"i"), zlib.crc32(b"!")]


# any character but a surrogate (not UTF-8-encodable), astral ones included
_CHARS = st.one_of(st.characters(max_codepoint=0xD7FF), st.characters(min_codepoint=0xE000))


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.text(alphabet=_CHARS, max_size=200))
def test_matches_the_rule_written_out(text: str) -> None:
    pieces = _reference_pieces(text)
    assert count_tokens_fallback(text) == len(pieces)
    assert token_ids_fallback(text) == [zlib.crc32(p.encode("utf-8")) for p in pieces]
