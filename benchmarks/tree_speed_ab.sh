#!/usr/bin/env bash
# Speed of this tree against an older commit, arms interleaved and rotated (issue 30's
# "no slower" check): the virtual cluster (cluster_sim_speed.py) and the dispatch
# pipeline's decision cost (dispatch_decision_cost.py), each tree importing its own src
# with this checkout's compiled look-ahead copied in (sim/ must be unchanged between them).
#
#   bash benchmarks/tree_speed_ab.sh a50e845 [rounds] [json-dir]
#
# json-dir: each round's figures as JSON there (round-R-ARM.json, cluster_sim_speed.py --json).
set -euo pipefail
base=${1:?base commit}; rounds=${2:-3}; json_dir=${3:-}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
mkdir -p "$work/base" "$work/new"
git -C "$here" archive "$base" src artifacts | tar -x -C "$work/base"
cp -r "$here/src" "$here/artifacts" "$work/new/"
cp "$here"/src/rps_astro_cli/sim/lookahead_engine/*.so "$work/base/src/rps_astro_cli/sim/lookahead_engine/"
cp "$here"/src/rps_astro_cli/sim/lookahead_engine__mypyc*.so "$work/base/src/rps_astro_cli/sim/"
for r in $(seq 1 "$rounds"); do
  if [ $((r % 2)) -eq 1 ]; then order="base new"; else order="new base"; fi
  for arm in $order; do
    echo "== round $r: $arm"
    json_arg=()
    if [ -n "$json_dir" ]; then mkdir -p "$json_dir"; json_arg=(--json "$(cd "$json_dir" && pwd)/round-$r-$arm.json"); fi
    (cd "$work/$arm" && PYTHONPATH=src "$here/.venv/bin/python" "$here/benchmarks/cluster_sim_speed.py" \
        --requests 3000 --instances 8 --rate 20 --policies round_robin,llumnix,power_of_k ${json_arg[@]+"${json_arg[@]}"} | tail -3)
  done
done
