"""Build hook: compile the look-ahead engine (src/rps_astro_cli/sim/lookahead_engine/)
with mypyc, its modules as one group (one shared library: calls between them are native).

Everything else is in pyproject.toml. The compiled modules are an accelerator of the same
source (3–5x on benchmarks/lookahead_speed.py): when mypyc or a C compiler is missing,
or ASTRO_PURE_PYTHON=1 is set, the package installs without them (one printed line says
so) and runs the source. `rps_astro_cli.sim.engine_build` never imports a build older
than any of the engine's files.

With ASTRO_REQUIRE_BUILD=1 (.ci/run sets it) or CI=true a failed build fails the
install instead: CI must test the build that users get.
"""

import os
from pathlib import Path

from setuptools import setup

ENGINE = Path("src/rps_astro_cli/sim/lookahead_engine")
GROUP = "rps_astro_cli.sim.lookahead_engine"  # the shared library: sim/lookahead_engine__mypyc.*.so


def _ext_modules() -> list:
    if os.environ.get("ASTRO_PURE_PYTHON") == "1":
        return []
    strict = os.environ.get("ASTRO_REQUIRE_BUILD") == "1" or os.environ.get("CI", "").lower() == "true"
    files = sorted(str(p) for p in ENGINE.glob("*.py"))
    try:
        from mypyc.build import mypycify

        # --follow-imports=silent: type-check the engine only (its imports are read for
        # their types; numpy/pydantic need not be in the build environment)
        exts = mypycify(["--follow-imports=silent", "--ignore-missing-imports", *files],
                        opt_level="3", group_name=GROUP)
    except BaseException as e:  # mypyc absent, or a type error: install the pure-Python source
        if strict:
            raise RuntimeError(f"astro: the look-ahead engine did not compile with mypyc (ASTRO_REQUIRE_BUILD=1 "
                               f"or CI=true): {e}") from e
        print(f"astro: not compiling the look-ahead ({type(e).__name__}: {e}); using pure Python")
        return []
    for ext in exts:
        ext.optional = not strict  # no C compiler: install anyway, pure Python (not in CI)
    return exts


setup(ext_modules=_ext_modules())
