"""Which build of the look-ahead engine (`sim/lookahead_engine/`) to import: its mypyc
build when that is current, else its source.

setup.py compiles the engine's modules with mypyc, as one group, at install when it can.
A build is used only when every module of the package has one that is not older than
its source by more than 2 s; otherwise (a file edited or pulled since the install built
it, a new file, or `ASTRO_PURE_PYTHON=1`) the whole package is imported from its `.py`
files. A stale build is never used: it would run old code. Reinstall (`pip install -e .`)
to rebuild.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

PACKAGE = "rps_astro_cli.sim.lookahead_engine"
ENGINE_DIR = Path(__file__).with_name("lookahead_engine")
_SLACK_S = 2.0  # a build written within this of its source counts as current


def _compiled(py: Path) -> Path | None:
    """The extension module built from `py`, if any."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        so = py.with_suffix(suffix)
        if so.exists():
            return so
    return None


def build_state(directory: Path = ENGINE_DIR) -> str:
    """"none" (no module is built), "current" (every module's build is at least as new
    as its source, to the slack), or "stale"."""
    sources = sorted(directory.glob("*.py"))
    builds = [_compiled(p) for p in sources]
    if not any(builds):
        return "none"
    for py, so in zip(sources, builds, strict=True):
        if so is None or py.stat().st_mtime > so.stat().st_mtime + _SLACK_S:
            return "stale"
    return "current"


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds `name` and its submodules as the `.py` files of `directory` (never a build)."""

    def __init__(self, name: str, directory: Path) -> None:
        self.name = name
        self.directory = directory

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None,
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname == self.name:
            return importlib.util.spec_from_file_location(
                fullname, self.directory / "__init__.py", submodule_search_locations=[str(self.directory)])
        head, _, sub = fullname.rpartition(".")
        if head == self.name and (self.directory / f"{sub}.py").exists():
            return importlib.util.spec_from_file_location(fullname, self.directory / f"{sub}.py")
        return None


def load_source(name: str = PACKAGE, directory: Path = ENGINE_DIR) -> ModuleType:
    """Import the engine package from its `.py` files as `name` (the real name, or another
    one to hold the interpreted engine beside a build), with every module of it."""
    finder = _SourceFinder(name, directory)
    sys.meta_path.insert(0, finder)
    try:
        pkg = importlib.import_module(name)
        for py in sorted(directory.glob("*.py")):
            if py.stem != "__init__":
                importlib.import_module(f"{name}.{py.stem}")
    finally:
        sys.meta_path.remove(finder)
    return pkg


def load_engine() -> ModuleType:
    """The engine package: its build when current (see the module docstring), else its
    source (with a warning when a stale build was skipped)."""
    forced = os.environ.get("ASTRO_PURE_PYTHON") == "1"
    if not any(ENGINE_DIR.glob("*.py")):
        return importlib.import_module(PACKAGE)  # an install without the source can only run the build
    state = build_state()
    if state == "none" or (state == "current" and not forced):
        return importlib.import_module(PACKAGE)
    if state == "stale" and not forced:
        warnings.warn("the compiled look-ahead is older than sim/lookahead_engine/: using the source "
                      "(reinstall with `pip install -e .` to rebuild it)", stacklevel=2)
    return load_source()


def is_native(pkg: ModuleType) -> bool:
    """True when `pkg` (the engine package) runs as its mypyc build."""
    mod = sys.modules.get(f"{pkg.__name__}.engine")
    return mod is not None and not str(mod.__file__).endswith(".py")
