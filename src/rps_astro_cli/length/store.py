"""Length-model artifacts on disk: save, resolve, check and load them; the shipped default.

An artifact is a folder: `meta.json` (format version, model name, params, data hash,
split, tokenizer, target model, metrics, library versions, and the SHA-256 of every
other file) plus the model's own files. Loading checks all of it and names what is wrong.

This module sits above the model modules: it imports each built-in model (so they are
registered in `LENGTH_MODELS` before a meta.json is read) and the interface in `base`;
nothing in `base` or in a model module imports it back.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from rps_astro_cli.errors import AstroUserError

# Built-in models register themselves in LENGTH_MODELS on import (transformer models import
# torch only when used).
from rps_astro_cli.length.base import (
    DEFAULT_MODEL,
    FORMAT_VERSION,
    LENGTH_ARTIFACTS_DIR,
    LENGTH_MODELS,
    META_FILE,
    LengthModel,
    LengthModelMeta,
)
from rps_astro_cli.length.baselines import LinearPromptBaseline, MedianBaseline
from rps_astro_cli.length.chat_gbm import ChatGBMLengthModel
from rps_astro_cli.length.classic import ClassicLengthModel
from rps_astro_cli.length.transformer import MiniLMLengthModel, RobertaLengthModel

BUILTIN_MODELS = (ChatGBMLengthModel, ClassicLengthModel, LinearPromptBaseline, MedianBaseline, MiniLMLengthModel,
                  RobertaLengthModel)
"""The model classes this module registers by importing them (see the comment above)."""



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
    """The shipped CPU default (`artifacts/length/<DEFAULT_MODEL>`), loaded once per process."""
    return load_length_model(LENGTH_ARTIFACTS_DIR / DEFAULT_MODEL)

