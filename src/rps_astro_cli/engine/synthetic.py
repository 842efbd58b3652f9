"""The sim engine's output text: one short word per token, with `seed` and `stop` honoured.

- Without `seed`, token i is `WORDS[i % 16]` (the same text for every request).
- With `seed` (an integer), the words are drawn from `numpy.random.default_rng(seed)`:
  the same seed gives the same text (and, when the engine draws the output length,
  the same length: `SimEngine.target_output_tokens`), a different seed another text.
- `stop` strings end the output as vLLM's detokenizer does: after each token the text
  is searched for each stop string (in the order given); the first token whose text
  completes one is the last token generated (it counts in `completion_tokens`), the
  text is cut where the stop string begins (kept whole with
  `include_stop_str_in_output`), and finish_reason is "stop". Stop strings are not
  checked before `min_tokens` tokens. A stop string the synthetic words never form
  (e.g. "\\n") never fires: the output runs to its length.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

WORDS = (" the", " of", " and", " to", " in", " a", " is", " that",
         " for", " it", " as", " was", " with", " be", " by", " on")
WORDS_JSON = tuple(json.dumps(w) for w in WORDS)


def synthetic_text(num_tokens: int, word_ids: Sequence[int] | None = None) -> str:
    """The text of `num_tokens` tokens (token i is WORDS[word_ids[i]], or WORDS[i % 16])."""
    if word_ids is None:
        return "".join(WORDS[i % len(WORDS)] for i in range(num_tokens))
    return "".join(WORDS[int(w)] for w in word_ids[:num_tokens])


def seeded_words(rng: np.random.Generator, num_tokens: int) -> tuple[int, ...]:
    """`num_tokens` word indices drawn uniformly from WORDS with `rng`."""
    return tuple(int(w) for w in rng.integers(0, len(WORDS), size=num_tokens))


@dataclass(frozen=True)
class OutputText:
    """One request's output text, when it is not the plain cycle (seed or stop given).

    word_ids: the word index of every token (len = the output's token count).
    text: the whole output text (after the stop cut).
    stop_reason: the stop string that ended the output, or None.
    """

    word_ids: tuple[int, ...]
    text: str
    stop_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.word_ids)

    def deltas(self) -> list[str]:
        """Each token's streamed text: the words' text clipped to `text`, so the stream
        never shows a stop string that the final text does not hold (the tokens from the
        one where the cut falls on carry what is left of the text, then "")."""
        out: list[str] = []
        pos, end = 0, len(self.text)
        for w in self.word_ids:
            nxt = pos + len(WORDS[w])
            out.append(self.text[min(pos, end):min(nxt, end)])
            pos = nxt
        return out


def plan_output(num_tokens: int, rng: np.random.Generator | None, stop: Sequence[str] = (),
                min_tokens: int = 0, include_stop: bool = False) -> OutputText:
    """The output of at most `num_tokens` tokens: seeded words when `rng` is given (else the
    cycle), cut at the first stop string as the module docstring says."""
    word_ids = seeded_words(rng, num_tokens) if rng is not None else tuple(i % len(WORDS) for i in range(num_tokens))
    full = "".join(WORDS[w] for w in word_ids)
    ends: list[int] = []
    pos = 0
    for w in word_ids:
        pos += len(WORDS[w])
        ends.append(pos)
    best: tuple[int, int, int, str] | None = None  # (last token index, stop's order, start char, stop)
    for order, s in enumerate(stop):
        if not s:
            continue
        p = full.find(s)
        while p >= 0:
            k = _token_at(ends, p + len(s))
            if k + 1 >= max(1, min_tokens):
                if best is None or (k, order) < best[:2]:
                    best = (k, order, p, s)
                break
            p = full.find(s, p + 1)
    if best is None:
        return OutputText(word_ids, full)
    k, _, p, s = best
    return OutputText(word_ids[:k + 1], full[:p + len(s)] if include_stop else full[:p], s)


def _token_at(ends: list[int], char_end: int) -> int:
    """Index of the first token whose text ends at or after `char_end`."""
    import bisect

    return bisect.bisect_left(ends, char_end)


# -- log-probabilities -------------------------------------------------------------------
_LN_HALF = math.log(0.5)


def top_logprobs(token: str, key: int, k: int) -> list[tuple[str, float]]:
    """Synthetic but well-formed log-probabilities of one sampled `token`: the
    max(k, 1) most likely tokens, most likely first, the sampled token among them at
    rank 0 (so, as in vLLM, a completions `top_logprobs` dict has max(k, 1) entries and a
    chat `top_logprobs` list k). `key` picks the values (the same key, the same values).

    The sampled token's probability is p0 = 0.5 + 0.04 · (key mod 10) (0.50 to 0.86);
    rank r ≥ 1 has (1 − p0) · 0.5^r, so the probabilities fall with rank and sum below 1.
    The alternatives are the other synthetic words (`WORDS`, from word key mod 16 on),
    then `" <r>"` for rank r ≥ 16: every token string distinct.
    """
    p0 = 0.5 + 0.04 * (key % 10)
    out = [(token, math.log(p0))]
    start = key % len(WORDS)
    alts = [w for j in range(len(WORDS)) if (w := WORDS[(start + j) % len(WORDS)]) != token]
    for r in range(1, max(k, 1)):
        alt = alts[r - 1] if r - 1 < len(alts) else f" <{r}>"
        out.append((alt, math.log(1.0 - p0) + r * _LN_HALF))
    return out


def token_key(token: str, position: int) -> int:
    """The `top_logprobs` key of the token at `position` (an output or prompt token)."""
    return zlib.crc32(token.encode("utf-8")) + 7 * position


def chat_logprobs(tokens: Sequence[str], k: int, start: int = 0) -> dict[str, Any]:
    """vLLM's chat `logprobs` object for these sampled tokens (output positions from
    `start`): {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}] × k}]}."""
    content = []
    for i, t in enumerate(tokens):
        top = top_logprobs(t, token_key(t, start + i), k)
        content.append({"token": t, "logprob": top[0][1], "bytes": list(t.encode("utf-8")),
                        "top_logprobs": [{"token": a, "logprob": lp, "bytes": list(a.encode("utf-8"))}
                                         for a, lp in top[:k]]})
    return {"content": content}


def completion_logprobs(tokens: Sequence[str], k: int, start: int = 0, text_offset: int = 0,
                        prompt_tokens: Sequence[str] = ()) -> dict[str, Any]:
    """vLLM's completions `logprobs` object: {text_offset, token_logprobs, tokens,
    top_logprobs} over the echoed `prompt_tokens` (the first has no log-probability: None
    in both lists, as vLLM's prompt logprobs) then the sampled `tokens` (output positions
    from `start`). text_offset starts at `text_offset` and adds each token string's length."""
    offsets: list[int] = []
    lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    pos = text_offset
    seq = [(t, token_key(t, -1 - j)) for j, t in enumerate(prompt_tokens)] + \
        [(t, token_key(t, start + i)) for i, t in enumerate(tokens)]
    for j, (t, key) in enumerate(seq):
        offsets.append(pos)
        pos += len(t)
        if j == 0 and prompt_tokens:
            lps.append(None)
            tops.append(None)
            continue
        top = top_logprobs(t, key, k)
        lps.append(top[0][1])
        tops.append(dict(top))
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": [t for t, _ in seq], "top_logprobs": tops}
