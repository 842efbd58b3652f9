"""Response-length prediction (the Astrolabe length tagger's models).

Public interface (kept stable for the tagger service):
- `load_length_model(name_or_path) -> LengthModel`
- `LengthModel.predict(prompts) -> numpy int64 array of predicted output tokens (≥ 1)`
- `default_length_model()` → the shipped CPU default, `artifacts/length/classic`.
"""

from rps_astro_cli.length.base import (
    DEFAULT_MODEL,
    LENGTH_ARTIFACTS_DIR,
    LENGTH_MODELS,
    LengthModel,
    LengthModelMeta,
    _import_builtin_models,
    default_length_model,
    load_length_model,
    save_length_model,
)

_import_builtin_models()

__all__ = [
    "DEFAULT_MODEL",
    "LENGTH_ARTIFACTS_DIR",
    "LENGTH_MODELS",
    "LengthModel",
    "LengthModelMeta",
    "default_length_model",
    "load_length_model",
    "save_length_model",
]
