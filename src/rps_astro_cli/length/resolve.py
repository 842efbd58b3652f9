"""Resolve a length-model spec (a tagger `--model` / bench `--length-model` value) to
a predict callable: the length package's models or the bin-median baseline. One loader for
the tagger service and the virtual bench, so both read the same artifacts the same way."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.length.bin_median import BASELINE_PATH, BinMedianLengthModel

log = logging.getLogger("astro.tagger")


def resolve_length_model(spec: str | Path | None) -> tuple[str, Callable[..., int]]:
    """(name, predict(prompt_text, prompt_tokens, messages=None) → output tokens) for `spec`.
    Give `messages` (the chat body's OpenAI messages list) for chat requests: package
    models then predict with `predict_chats`, seeing the same context turns as in
    training; the baseline only uses `prompt_tokens`.

    - None / "" / "auto": the length package's shipped default
      (`rps_astro_cli.length.default_length_model()`, `artifacts/length/chat-gbm`) when it
      loads, else the baseline below (logged);
    - "baseline", or a `bin_median` JSON (or a folder holding `model.json` of that kind):
      the baseline of `length/bin_median.py`;
    - anything else: `rps_astro_cli.length.load_length_model(spec)` (a name under
      `artifacts/length/` or a folder path).

    Raises:
        AstroUserError: the artifact is missing or cannot be loaded (names it).
    """
    if spec in (None, "", "auto"):
        try:
            from rps_astro_cli.length import default_length_model

            model = default_length_model()
            return f"{model.meta.model} (default)", _wrap(model)
        except (ImportError, AstroUserError, OSError) as exc:
            log.warning("default length model unavailable (%s); using the baseline", exc)
            spec = "baseline"
    if spec == "baseline":
        m = BinMedianLengthModel.load(BASELINE_PATH)
        return "baseline", lambda _text, ntok, messages=None: m.predict_tokens(ntok)
    p = Path(str(spec))
    baseline_file = next((c for c in (p, p / "model.json") if _is_bin_median(c)), None)
    if baseline_file is not None:
        found = BinMedianLengthModel.load(baseline_file)
        return str(spec), lambda _text, ntok, messages=None: found.predict_tokens(ntok)
    from rps_astro_cli.length import load_length_model as load_pkg_model  # late: tests patch it

    return str(spec), _wrap(load_pkg_model(str(spec)))


def _is_bin_median(path: Path) -> bool:
    """Whether `path` is a JSON file of the baseline's kind."""
    import json

    if not (path.is_file() and path.suffix == ".json"):
        return False
    try:
        return json.loads(path.read_text()).get("kind") == "bin_median"
    except (ValueError, AttributeError, OSError):
        return False


def _wrap(model: Any) -> Callable[..., int]:
    """A `LengthModel` as the tagger's callable (text, tokens, messages=None) → tokens:
    `model.predict_chats([messages])[0]` for a chat (falling back to `predict([text])`
    when the chat has no user message), else `model.predict([text])[0]`."""

    def predict(text: str, _n: int, messages: Any = None) -> int:
        if messages is not None:
            try:
                return max(1, int(model.predict_chats([messages])[0]))
            except AstroUserError:  # e.g. only system/assistant turns: predict from the text
                pass
        return max(1, int(model.predict([text or " "])[0]))

    # the model's distribution calibration (`length.dist`), read by the tagger for quantiles
    predict.calibration = getattr(model, "calibration", None)  # type: ignore[attr-defined]
    return predict
