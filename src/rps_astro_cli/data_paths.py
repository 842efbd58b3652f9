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
    """The sample-data folder, or None when none is present (`$ASTRO_DATA_DIR` set to
    something that is not a folder counts as none: `data_dir_problem` says so)."""
    env = os.environ.get("ASTRO_DATA_DIR")
    if env:
        p = Path(env).expanduser()
        return p if p.is_dir() else None
    for cand in (REPO_ROOT.parent / "shared" / "data", Path.cwd().parent / "shared" / "data"):
        if cand.is_dir():
            return cand
    return None


def data_dir_problem() -> str | None:
    """What is wrong with `$ASTRO_DATA_DIR`, in words, when it is set but names no folder
    (a typo would otherwise pass silently: loaders fall back to the hub or to synthetic
    data, and the `../shared/data` default is not tried either); None when it is unset or
    a folder."""
    env = os.environ.get("ASTRO_DATA_DIR")
    if not env:
        return None
    p = Path(env).expanduser()
    if p.is_dir():
        return None
    what = "is a file" if p.exists() else "does not exist"
    return (f"ASTRO_DATA_DIR={env} is not a folder (it {what}): NO data folder was used, so files "
            "the workload would read from it count as missing. Fix: set ASTRO_DATA_DIR to the data "
            "folder (e.g. ../shared/data), or unset it. docs/data.md says where to get ShareGPT, LLaVA, "
            "BurstGPT and the Azure trace, and how to lay them out in that folder")
