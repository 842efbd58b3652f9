"""Turning whatever a client sent into the prompt text a length model reads.

Rules (the same at training and at prediction time, so the models see one distribution):
- Text longer than `MAX_PROMPT_CHARS` is cut to its first `HEAD_CHARS` and last
  `TAIL_CHARS` characters joined by `TRUNCATION_MARK` (long pasted documents usually put
  the instruction at the start or the end); a note says so.
- OpenAI-style content parts (`[{"type": "text", "text": ...}, {"type": "image_url", ...}]`)
  contribute their text parts, joined by a blank line; other parts are ignored and counted
  in a note (the length tagger predicts from text; image/video token counts are added by
  the tagger service from the modality profile).
- An empty prompt is allowed at prediction time (a request may be image-only): models
  answer their learned value for empty text. Loaders drop empty prompts from training data
  and say how many.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rps_astro_cli.errors import AstroUserError

MAX_PROMPT_CHARS = 32_768
"""Longest prompt (characters) a length model reads; longer ones are truncated."""
HEAD_CHARS = 24_576
TAIL_CHARS = MAX_PROMPT_CHARS - HEAD_CHARS - 3
TRUNCATION_MARK = "\n…\n"


@dataclass(frozen=True)
class PreparedPrompts:
    """Prompts ready for a model.

    texts: one string per input prompt, each at most MAX_PROMPT_CHARS characters.
    notes: human-readable notes (truncations, ignored content parts), possibly empty.
    """

    texts: list[str]
    notes: list[str] = field(default_factory=list)


def truncate_prompt(text: str) -> tuple[str, bool]:
    """(text cut to MAX_PROMPT_CHARS as described in the module docstring, whether cut)."""
    if len(text) <= MAX_PROMPT_CHARS:
        return text, False
    return text[:HEAD_CHARS] + TRUNCATION_MARK + text[-TAIL_CHARS:], True


def text_from_content(content: Any, *, where: str = "content") -> tuple[str, int]:
    """Text of a chat message's `content` and the number of non-text parts ignored.

    `content` may be a string, None (→ ""), or a list of OpenAI content parts (dicts with
    `type`; `text` parts contribute `text`, others such as `image_url`/`video_url`/
    `input_audio` are counted). Bare strings inside the list count as text.

    Raises:
        AstroUserError: `content` is some other type, or a text part has no string `text`.
    """
    if content is None:
        return "", 0
    if isinstance(content, str):
        return content, 0
    if isinstance(content, list):
        texts: list[str] = []
        ignored = 0
        for i, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text":
                if not isinstance(part.get("text"), str):
                    raise AstroUserError(
                        "text content part has no string 'text'", field=f"{where}[{i}].text"
                    )
                texts.append(part["text"])
            elif isinstance(part, dict):
                ignored += 1
            else:
                raise AstroUserError(
                    f"content part of type {type(part).__name__} is neither text nor a part object",
                    field=f"{where}[{i}]",
                )
        return "\n\n".join(texts), ignored
    raise AstroUserError(
        f"expected text or a list of content parts, got {type(content).__name__}", field=where
    )


def prepare_prompts(prompts: Sequence[Any]) -> PreparedPrompts:
    """Validate and normalize prompts for `LengthModel.predict`.

    Each item is a string or OpenAI content (see `text_from_content`). Texts are truncated
    to MAX_PROMPT_CHARS.

    Raises:
        AstroUserError: `prompts` is a bare string (a common mistake: pass a list), or an
            item is not text/content parts (the field names its index).
    """
    if isinstance(prompts, (str, bytes)):
        raise AstroUserError(
            "expected a list of prompts, got a single string", field="prompts", fix="wrap it: [prompt]"
        )
    texts: list[str] = []
    n_cut = n_ignored = 0
    for i, p in enumerate(prompts):
        if isinstance(p, bytes):
            raise AstroUserError(
                "got bytes, expected text", field=f"prompts[{i}]", fix="decode it as UTF-8 first"
            )
        text, ignored = text_from_content(p, where=f"prompts[{i}]")
        text, cut = truncate_prompt(text)
        n_cut += cut
        n_ignored += ignored
        texts.append(text)
    notes = []
    if n_cut:
        notes.append(f"{n_cut} prompt(s) longer than {MAX_PROMPT_CHARS} characters were truncated")
    if n_ignored:
        notes.append(f"{n_ignored} non-text content part(s) were ignored (length is predicted from text)")
    return PreparedPrompts(texts=texts, notes=notes)


def prompt_from_messages(messages: Sequence[Any], context_turns: int = 0) -> str:
    """The prompt text a length model trained with `context_turns` reads for a chat request.

    Mirrors the training pairs (`length.data`): the last `user` message's text, preceded
    by the `context_turns` non-system messages right before it, joined by blank lines.
    System messages are skipped (ShareGPT training data has none).

    Raises:
        AstroUserError: `messages` is not a list of {role, content} objects or has no user
            message.
    """
    text, history = chat_turns(messages)
    keep = history[max(0, len(history) - max(0, context_turns)) :]
    return "\n\n".join([*keep, text])


def chat_turns(messages: Sequence[Any]) -> tuple[str, tuple[str, ...]]:
    """(the last user message's text, the texts of the non-system messages before it, oldest
    first) — the chat seen as the training pairs of `length.data` see a conversation
    (`LengthSample.text` and `LengthSample.history`). Messages after the last user message
    are ignored.

    Raises:
        AstroUserError: `messages` is not a list of {role, content} objects or has no user
            message.
    """
    if not isinstance(messages, (list, tuple)):
        raise AstroUserError("expected a list of chat messages", field="messages")
    turns: list[tuple[str, str]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or "role" not in msg:
            raise AstroUserError("each message needs a 'role'", field=f"messages[{i}]")
        if msg["role"] == "system":
            continue
        turns.append((msg["role"], text_from_content(msg.get("content"), where=f"messages[{i}].content")[0]))
    users = [k for k, (role, _) in enumerate(turns) if role == "user"]
    if not users:
        raise AstroUserError("no user message to predict a reply for", field="messages")
    j = users[-1]
    return turns[j][1], tuple(text for _, text in turns[:j])
