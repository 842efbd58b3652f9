"""The response-length model interface, its registry and artifact metadata.

Stable interface for the tagger service:

    model = load_length_model("chat-gbm")         # a name under artifacts/length/ or a folder
    tokens = model.predict(["Write a poem", ...])  # numpy int64 array, shape (n,), every value ≥ 1
    model = default_length_model()                 # artifacts/length/chat-gbm, loaded once
    tokens = model.predict_chats([messages, ...])  # OpenAI chat messages → same, reading the
                                                   # conversation as the model was trained to
    dists = model.predict_dist_chats([messages])   # → [LengthDistribution]: quantiles (p10…p90)
    remaining_tokens(dists[0], generated_tokens=g) # E[L − g | L > g] (`length.dist`)

`predict` takes strings or OpenAI content-part lists (see `length.prompts`), truncates
prompts longer than MAX_PROMPT_CHARS, and returns predicted reply lengths in tokens of
the artifact's target model (`model.meta.target_model`, counted with
`model.meta.tokenizer`). Notes about truncation/ignored parts of the latest call are on
`last_notes` (per instance, so not meaningful across threads: concurrent callers that
need the notes call `length.prompts.prepare_prompts` themselves). `predict` itself keeps
no other state and is safe to call from several threads.

How a chat is read: a model with `reads_history` (the shipped `chat-gbm`) gets the last
user message and the earlier turns separately (`length.prompts.chat_turns`); any other
model gets one prompt string with `context_turns` earlier turns prepended (in meta.data;
`classic` was trained with 1), built the same way as in training. `predict` on a bare
prompt is a chat without history.

Distributions: `fit` may return a calibration under "dist" (recorded in meta.fit);
`predict_dists` then turns each point prediction into quantiles. Models without one (older
artifacts, the transformers) raise a user error naming the fix.

Saving, loading and the shipped default live in `length.store` (re-exported by the
package); this module is the bottom of `length/`: the model modules import it, it imports
none of them.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from rps_astro_cli.data_paths import ARTIFACTS_DIR
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.length.data import LengthDataset, LengthSample
from rps_astro_cli.length.dist import LengthDistribution, LogSpreadCalibration
from rps_astro_cli.length.prompts import chat_turns, prepare_prompts, prompt_from_messages, truncate_prompt
from rps_astro_cli.registry import Registry

FORMAT_VERSION = 1
META_FILE = "meta.json"
LENGTH_ARTIFACTS_DIR = ARTIFACTS_DIR / "length"
DEFAULT_MODEL = "chat-gbm"
"""The shipped default (`artifacts/length/chat-gbm`): 5-fold × 3-seed CV on ShareGPT in BENCHMARKS.md."""
MAX_PREDICTED_TOKENS = 32_768
"""Predictions are clipped to [1, MAX_PREDICTED_TOKENS] tokens."""

LENGTH_MODELS: Registry[type[LengthModel]] = Registry("length model")

ProgressFn = Callable[[str, float], None]
"""progress(message, fraction_done in [0, 1]) — the CLI renders it with Rich."""


@dataclass
class LengthModelMeta:
    """What an artifact records besides its weights (written to meta.json).

    model: registry name. params: the model's hyper-parameters. data: {source, sha256,
    n_pairs, n_train, n_val, n_test, notes}. split: {seed, test_frac, val_frac}.
    tokenizer: "fallback" or the path that counted targets. target_model: whose replies'
    lengths are learned (free text). responder: who wrote the training replies.
    metrics: test-split metrics (see evaluate.py). fit: what `fit` chose/recorded
    (alpha, epochs, validation history). train_s: wall-clock seconds to fit.
    files: relative path → SHA-256 of every artifact file but meta.json.
    versions: library versions at training time.
    """

    model: str
    params: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    split: dict[str, Any] = field(default_factory=dict)
    tokenizer: str = "fallback"
    target_model: str = "unspecified"
    responder: str = "unspecified"
    metrics: dict[str, Any] = field(default_factory=dict)
    fit: dict[str, Any] = field(default_factory=dict)
    train_s: float = 0.0
    created_utc: str = ""
    files: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> LengthModelMeta:
        if not isinstance(d, dict):
            raise AstroUserError(f"{where}: meta.json must hold an object", field="model")
        known = set(cls.__dataclass_fields__)
        if "model" not in d:
            raise AstroUserError(f"{where}: meta.json has no 'model' field", field="model")
        for key in ("params", "data", "split", "metrics", "fit", "files", "versions"):
            if key in d and not isinstance(d[key], dict):
                raise AstroUserError(f"{where}: field {key!r} must be an object", field="model")
        return cls(**{k: v for k, v in d.items() if k in known})


class LengthModel(abc.ABC):
    """Predicts a request's output length (tokens) from its prompt.

    Subclasses set `name`, implement `fit`, `_predict_raw`, `save_files` and `load_files`,
    and register with `@LENGTH_MODELS.register(name)`.
    """

    name: ClassVar[str]
    reads_history: ClassVar[bool] = False
    """True: the model reads a chat's last user message and its earlier turns separately
    (implements `_predict_raw_turns`); False: one prompt string (`_predict_raw`)."""

    def __init__(self) -> None:
        self.meta = LengthModelMeta(model=self.name)
        self.last_notes: list[str] = []

    @abc.abstractmethod
    def fit(
        self,
        train: LengthDataset,
        val: LengthDataset | None,
        *,
        rng: np.random.Generator,
        progress: ProgressFn | None = None,
    ) -> dict[str, Any]:
        """Train on `train`, using `val` (may be empty) for model selection/early stopping.
        Returns a small dict of what was chosen (e.g. {"alpha": 3.0, "epochs": 4})."""

    @abc.abstractmethod
    def _predict_raw(self, texts: list[str]) -> np.ndarray:
        """Predicted lengths (float tokens, shape (n,)) for prepared, truncated texts."""

    @abc.abstractmethod
    def save_files(self, directory: Path) -> None:
        """Write the model's own files into `directory` (meta.json is written by the caller)."""

    @classmethod
    @abc.abstractmethod
    def load_files(cls, directory: Path, meta: LengthModelMeta) -> LengthModel:
        """Rebuild from `save_files` output. Raise AstroUserError naming a bad file/field."""

    def params(self) -> dict[str, Any]:
        """Hyper-parameters recorded in meta.json."""
        return {}

    @property
    def context_turns(self) -> int:
        """Earlier turns the model was trained to see before the user message (meta.data)."""
        return int(self.meta.data.get("context_turns", 0) or 0)

    def predict_chats(self, chats: Sequence[Sequence[Any]]) -> np.ndarray:
        """`predict` for chat requests: each item is an OpenAI `messages` list. A model that
        reads the conversation's structure (`reads_history`) gets the last user message and
        the turns before it; any other model reads the prompt built by
        `prompt_from_messages(messages, self.context_turns)`.

        Raises:
            AstroUserError: a chat has no user message or malformed messages.
        """
        if self.reads_history:
            turns = [chat_turns(m) for m in chats]
            return self._finish(self._raw_turns([t for t, _ in turns], [h for _, h in turns]))
        return self.predict([prompt_from_messages(m, self.context_turns) for m in chats])

    def predict(self, prompts: Sequence[Any]) -> np.ndarray:
        """Predicted output tokens, numpy int64 shape (len(prompts),), each in
        [1, MAX_PREDICTED_TOKENS]. Empty input → empty array.

        Raises:
            AstroUserError: an item is not text or OpenAI content parts.
        """
        return self._finish(self._raw(prompts))

    def predict_samples(self, samples: Sequence[LengthSample]) -> np.ndarray:
        """`predict` for dataset samples, reading what the tagger would read for that turn:
        the message and its history (`reads_history`), else the sample's prompt."""
        if self.reads_history:
            return self._finish(self._raw_turns([s.text for s in samples], [s.history for s in samples]))
        return self.predict([s.prompt for s in samples])

    # ---- length as a distribution

    def predict_dists(self, prompts: Sequence[Any]) -> list[LengthDistribution]:
        """The predicted reply-length distribution (quantiles, `length.dist`) of each prompt.

        Raises:
            AstroUserError: an item is not text or content parts; the model has no
                distribution calibration (trained before it existed: retrain it).
        """
        return self._dists(self._raw(prompts))

    def predict_dist_chats(self, chats: Sequence[Sequence[Any]]) -> list[LengthDistribution]:
        """`predict_dists` for chat requests (the prompt is read as in `predict_chats`)."""
        if self.reads_history:
            turns = [chat_turns(m) for m in chats]
            return self._dists(self._raw_turns([t for t, _ in turns], [h for _, h in turns]))
        return self.predict_dists([prompt_from_messages(m, self.context_turns) for m in chats])

    def predict_dist_samples(self, samples: Sequence[LengthSample]) -> list[LengthDistribution]:
        """`predict_dists` for dataset samples (read as in `predict_samples`)."""
        if self.reads_history:
            return self._dists(self._raw_turns([s.text for s in samples], [s.history for s in samples]))
        return self.predict_dists([s.prompt for s in samples])

    @property
    def calibration(self) -> LogSpreadCalibration | None:
        """The distribution calibration recorded by `fit` (meta.fit["dist"]), if any."""
        raw = self.meta.fit.get("dist") if isinstance(self.meta.fit, dict) else None
        return LogSpreadCalibration.from_dict(raw) if raw else None

    def _dists(self, raw: np.ndarray) -> list[LengthDistribution]:
        cal = self.calibration
        if cal is None:
            raise AstroUserError(
                f"length model {self.name!r} has no distribution calibration (meta.json fit.dist)",
                field="--model", fix="retrain it with this version of astro (astro train-length)",
            )
        return cal.distributions(self._clip(raw))

    # ---- shared plumbing

    def _raw(self, prompts: Sequence[Any]) -> np.ndarray:
        prepared = prepare_prompts(prompts)
        self.last_notes = prepared.notes
        if not prepared.texts:
            return np.zeros(0)
        if self.reads_history:  # a bare prompt is a chat without history
            return np.asarray(self._predict_raw_turns(prepared.texts, [()] * len(prepared.texts)), dtype=np.float64)
        return np.asarray(self._predict_raw(prepared.texts), dtype=np.float64)

    def _raw_turns(self, texts: list[str], histories: list[tuple[str, ...]]) -> np.ndarray:
        """Raw predictions (float tokens) of a `reads_history` model for messages and their
        histories (every text truncated as in `length.prompts`)."""
        if not texts:
            return np.zeros(0)
        prepared = prepare_prompts(texts)
        self.last_notes = prepared.notes
        hist = [tuple(truncate_prompt(h)[0] for h in turns) for turns in histories]
        return np.asarray(self._predict_raw_turns(prepared.texts, hist), dtype=np.float64)

    def _predict_raw_turns(self, texts: list[str], histories: list[tuple[str, ...]]) -> np.ndarray:
        """`reads_history` models implement this: predicted lengths (float tokens) for
        prepared messages and their histories (earlier turns, oldest first)."""
        raise NotImplementedError(f"{self.name} does not read conversation history")

    @staticmethod
    def _clip(raw: np.ndarray) -> np.ndarray:
        raw = np.nan_to_num(np.asarray(raw, dtype=np.float64), nan=1.0, posinf=MAX_PREDICTED_TOKENS, neginf=1.0)
        return np.clip(raw, 1, MAX_PREDICTED_TOKENS)

    def _finish(self, raw: np.ndarray) -> np.ndarray:
        if len(raw) == 0:
            return np.zeros(0, dtype=np.int64)
        return np.rint(self._clip(raw)).astype(np.int64)
