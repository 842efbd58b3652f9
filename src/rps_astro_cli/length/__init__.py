"""Response-length prediction (the Astrolabe length tagger's models).

Public interface (kept stable for the tagger service):
- `load_length_model(name_or_path) -> LengthModel`
- `LengthModel.predict(prompts) -> numpy int64 array of predicted output tokens (≥ 1)`
- `default_length_model()` → the shipped CPU default, `artifacts/length/<DEFAULT_MODEL>`.
- `LengthModel.predict_dists(prompts)` / `predict_dist_chats(chats)` → `LengthDistribution`s,
  and `remaining_tokens(dist, generated_tokens)` = E[L − g | L > g] for running requests.

Layers inside the package, each importing only those below it: `prompts`, `data`, `dist`
→ `base` (interface, registry) → the models (`baselines`, `classic`, `chat_gbm`,
`transformer`) → `store` (save/load, registers the built-in models) → `evaluate` →
`pipeline` → `crossval`; `resolve` (the tagger's spec → callable) sits on the package.
"""

from rps_astro_cli.length.base import (
    DEFAULT_MODEL,
    LENGTH_ARTIFACTS_DIR,
    LENGTH_MODELS,
    LengthModel,
    LengthModelMeta,
)
from rps_astro_cli.length.dist import LengthDistribution, remaining_tokens
from rps_astro_cli.length.store import default_length_model, load_length_model, save_length_model

__all__ = [
    "DEFAULT_MODEL",
    "LENGTH_ARTIFACTS_DIR",
    "LENGTH_MODELS",
    "LengthModel",
    "LengthDistribution",
    "LengthModelMeta",
    "default_length_model",
    "load_length_model",
    "remaining_tokens",
    "save_length_model",
]
