#!/usr/bin/env bash
# Drift guard, lower end. Step 1 of .ci/run (the README's test command in a fresh venv)
# always tests the NEWEST releases pyproject.toml allows, so drift at the top shows there
# the day a release lands. This step tests the other end: every direct dependency at the
# LOWEST version pyproject.toml allows (transitive ones newest, as a user with an old pin
# would get), so a lower bound that no longer works (e.g. typer 0.12 with click ≥ 8.2)
# fails here instead of on a user's machine. It uses uv's `--resolution lowest-direct`
# (pip has no such mode). Prints the versions it tested. Usage: bash .ci/lowest.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ASTRO_LOWEST_VENV:-$(mktemp -d)/venv}
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q uv 2>&1 | grep -v "^WARNING: Location" || true
"$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --resolution lowest-direct -e '.[test]'
echo "lowest.sh: direct dependencies at their lower bounds:"
"$VENV/bin/python" - <<'PY'
from importlib.metadata import version
for n in ["numpy", "scikit-learn", "pydantic", "typer", "click", "rich", "fastapi", "starlette",
          "httpx", "uvicorn", "matplotlib", "prometheus-client", "pyyaml", "joblib", "threadpoolctl", "pytest", "hypothesis"]:
    print(f"  {n} {version(n)}")
PY
"$VENV/bin/pytest" -q -rs -p no:cacheprovider
