"""Build hook: compile the look-ahead engine (src/rps_astro_cli/sim/jump.py) with mypyc.

Everything else is in pyproject.toml. The compiled module is an accelerator of the same
source (3–5x on benchmarks/lookahead_speed.py): when mypyc or a C compiler is
missing, or ASTRO_PURE_PYTHON=1 is set, the package installs without it and runs the
source. `rps_astro_cli.sim.lookahead` never imports a build older than jump.py.
"""

import os

from setuptools import setup

JUMP = "src/rps_astro_cli/sim/jump.py"


def _ext_modules() -> list:
    if os.environ.get("ASTRO_PURE_PYTHON") == "1":
        return []
    try:
        from mypyc.build import mypycify

        # --follow-imports=silent: type-check jump.py only (its imports are read for
        # their types; numpy/pydantic need not be in the build environment)
        exts = mypycify(["--follow-imports=silent", "--ignore-missing-imports", JUMP], opt_level="3")
    except BaseException as e:  # mypyc absent, or a type error: install the pure-Python source
        print(f"astro: not compiling the look-ahead ({type(e).__name__}: {e}); using pure Python")
        return []
    for ext in exts:
        ext.optional = True  # no C compiler: install anyway, pure Python
    return exts


setup(ext_modules=_ext_modules())
