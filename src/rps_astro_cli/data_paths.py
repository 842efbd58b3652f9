"""Where sample data lives: `$ASTRO_DATA_DIR`, else `../shared/data` beside the checkout
(developer machines and CI), else None (users' machines: loaders fall back to the hub or
to synthetic generators and say so)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS_DIR = REPO_ROOT / "artifacts"
RECIPES_DIR = REPO_ROOT / "recipes"


def data_dir() -> Path | None:
    """The sample-data folder, or None when none is present."""
    env = os.environ.get("ASTRO_DATA_DIR")
    if env:
        p = Path(env).expanduser()
        return p if p.is_dir() else None
    for cand in (REPO_ROOT.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"):
        if cand.is_dir():
            return cand
    return None
