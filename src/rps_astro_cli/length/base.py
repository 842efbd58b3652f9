"""The response-length model interface, its registry, and artifact save/load.

Stable interface for the tagger service:

    model = load_length_model("classic")          # a name under artifacts/length/ or a folder
    tokens = model.predict(["Write a poem", ...])  # numpy int64 array, shape (n,), every value ≥ 1
    model = default_length_model()                 # artifacts/length/classic, loaded once
    tokens = model.predict_chats([messages, ...])  # OpenAI chat messages → same, using the
                                                   # artifact's context_turns (see below)

`predict` takes strings or OpenAI content-part lists (see `length.prompts`), truncates
prompts longer than MAX_PROMPT_CHARS, and returns predicted reply lengths in tokens of
the artifact's target model (`model.meta.target_model`, counted with
`model.meta.tokenizer`). Notes about truncation/ignored parts of the latest call are on
`last_notes` (per instance, so not meaningful across threads: concurrent callers that
need the notes call `length.prompts.prepare_prompts` themselves). `predict` itself keeps
no other state and is safe to call from several threads.

Models may be trained with earlier turns prepended to the prompt (`context_turns`, in
meta.data; the shipped classic uses 1: the previous turn helps a lot on ShareGPT).
`predict_chats` builds each prompt from a chat history the same way as training did;
`predict` on the bare last user message still works, a little less accurately.

An artifact is a folder: `meta.json` (format version, model name, params, data hash,
split, tokenizer, target model, metrics, library versions, and the SHA-256 of every
other file) plus the model's own files. Loading checks all of it and names what is wrong.
"""

from __future__ import annotations

import abc
import functools
import hashlib
import json
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from rps_astro_cli.data_paths import ARTIFACTS_DIR
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.length.data import LengthDataset
from rps_astro_cli.length.prompts import prepare_prompts, prompt_from_messages
from rps_astro_cli.registry import Registry

FORMAT_VERSION = 1
META_FILE = "meta.json"
LENGTH_ARTIFACTS_DIR = ARTIFACTS_DIR / "length"
DEFAULT_MODEL = "classic"
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
        """`predict` for chat requests: each item is an OpenAI `messages` list; its prompt
        is built by `prompt_from_messages(messages, self.context_turns)`.

        Raises:
            AstroUserError: a chat has no user message or malformed messages.
        """
        return self.predict([prompt_from_messages(m, self.context_turns) for m in chats])

    def predict(self, prompts: Sequence[Any]) -> np.ndarray:
        """Predicted output tokens, numpy int64 shape (len(prompts),), each in
        [1, MAX_PREDICTED_TOKENS]. Empty input → empty array.

        Raises:
            AstroUserError: an item is not text or OpenAI content parts.
        """
        prepared = prepare_prompts(prompts)
        self.last_notes = prepared.notes
        if not prepared.texts:
            return np.zeros(0, dtype=np.int64)
        raw = np.asarray(self._predict_raw(prepared.texts), dtype=np.float64)
        raw = np.nan_to_num(raw, nan=1.0, posinf=MAX_PREDICTED_TOKENS, neginf=1.0)
        return np.clip(np.rint(raw), 1, MAX_PREDICTED_TOKENS).astype(np.int64)


# ------------------------------------------------------------------------ save / load


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _artifact_files(directory: Path) -> list[Path]:
    return sorted(
        p for p in directory.rglob("*")
        if p.is_file() and p.name != META_FILE and "checkpoint" not in p.relative_to(directory).parts
    )


def library_versions() -> dict[str, str]:
    """Versions of the libraries an artifact depends on (for mismatch messages)."""
    import sklearn

    out = {"python": platform.python_version(), "numpy": np.__version__, "scikit-learn": sklearn.__version__}
    from rps_astro_cli import __version__

    out["rps_astro_cli"] = __version__
    return out


def save_length_model(model: LengthModel, directory: str | Path) -> Path:
    """Write `model` (its files + meta.json with checksums) into `directory`, creating it.
    Returns the folder."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.save_files(out)
    meta = model.meta
    meta.model = model.name
    meta.params = model.params()
    meta.format_version = FORMAT_VERSION
    meta.created_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    meta.versions = {**library_versions(), **meta.versions}
    meta.files = {p.relative_to(out).as_posix(): _sha256_file(p) for p in _artifact_files(out)}
    (out / META_FILE).write_text(json.dumps(asdict(meta), indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def resolve_artifact(name_or_path: str | Path) -> Path:
    """The artifact folder for a name (`artifacts/length/<name>`) or a path.

    Raises:
        AstroUserError: neither exists (lists the shipped artifacts).
    """
    p = Path(name_or_path)
    if p.is_dir():
        return p
    if p.is_file() and p.name == META_FILE:
        return p.parent
    cand = LENGTH_ARTIFACTS_DIR / str(name_or_path)
    if "/" not in str(name_or_path) and cand.is_dir():
        return cand
    shipped = sorted(d.name for d in LENGTH_ARTIFACTS_DIR.glob("*") if (d / META_FILE).is_file())
    raise AstroUserError(
        f"no length-model artifact {str(name_or_path)!r}",
        field="--model",
        fix=f"pass an artifact folder or one of: {', '.join(shipped) or '(none shipped)'}; "
        "train one with astro train-length",
    )


def read_meta(directory: Path) -> LengthModelMeta:
    """Parse and check `directory/meta.json` (format version, registered model name).

    Raises:
        AstroUserError: missing/invalid meta.json, other format version, unknown model.
    """
    mp = directory / META_FILE
    if not mp.is_file():
        raise AstroUserError(
            f"{directory}: no {META_FILE}; not a length-model artifact", field="--model",
            fix="point at a folder written by astro train-length",
        )
    try:
        raw = json.loads(mp.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AstroUserError(f"{mp}: corrupt meta.json ({exc})", field="--model", fix="retrain the artifact") from None
    meta = LengthModelMeta.from_dict(raw, str(mp))
    if meta.format_version != FORMAT_VERSION:
        raise AstroUserError(
            f"{mp}: artifact format_version {meta.format_version}, this astro reads {FORMAT_VERSION}",
            field="--model", fix="retrain it with this version of astro",
        )
    _import_builtin_models()
    if meta.model not in LENGTH_MODELS:
        raise AstroUserError(
            f"{mp}: model {meta.model!r} is not a known length model "
            f"(known: {', '.join(LENGTH_MODELS.names())})", field="--model",
        )
    return meta


def verify_files(directory: Path, meta: LengthModelMeta) -> None:
    """Check every file listed in meta.files exists with its recorded SHA-256.

    Raises:
        AstroUserError: names the first missing or changed file.
    """
    if not meta.files:
        raise AstroUserError(f"{directory}/{META_FILE}: lists no model files", field="--model")
    for rel, digest in sorted(meta.files.items()):
        fp = directory / rel
        if not fp.is_file():
            raise AstroUserError(f"{fp}: missing artifact file", field="--model", fix="retrain or restore the artifact")
        if _sha256_file(fp) != digest:
            raise AstroUserError(
                f"{fp}: checksum mismatch with {META_FILE} (file corrupt or replaced)",
                field="--model", fix="retrain or restore the artifact",
            )


def load_length_model(name_or_path: str | Path) -> LengthModel:
    """Load a saved length model by name (`artifacts/length/<name>`) or folder path.

    Raises:
        AstroUserError: no such artifact; meta.json missing/corrupt/wrong version/unknown
            model; a file missing or with a wrong checksum; the model's files inconsistent
            with its meta (each message names the file or field).
    """
    directory = resolve_artifact(name_or_path)
    meta = read_meta(directory)
    verify_files(directory, meta)
    model = LENGTH_MODELS.get(meta.model).load_files(directory, meta)
    model.meta = meta
    return model


@functools.lru_cache(maxsize=1)
def default_length_model() -> LengthModel:
    """The shipped CPU default (`artifacts/length/classic`), loaded once per process."""
    return load_length_model(LENGTH_ARTIFACTS_DIR / DEFAULT_MODEL)


def _import_builtin_models() -> None:
    """Register the built-in models (their modules register on import; transformer models
    import torch only when used)."""
    from rps_astro_cli.length import baselines, classic, transformer  # noqa: F401
