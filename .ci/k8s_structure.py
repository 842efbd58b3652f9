"""Structure checks of one rendered overlay (called by .ci/k8s.sh; needs PyYAML).

Usage: python .ci/k8s_structure.py OVERLAY RENDERED.yaml

Checks what the schema validation cannot: the engine pod holds the engine container and
its Predictor as a native sidecar reading it over localhost; the scheduler Deployment has
>= 2 replicas; the headless engine Service selects the engine pods and names its ports
http / predictor (what discovery maps); the discovery Role is exactly get/list/watch on
endpointslices; the Prometheus Operator monitors (no schema in kubernetes-validate)
select existing pods / Services and name ports they have. Exit 1 on any problem.
"""

from __future__ import annotations

import sys

import yaml


def sel_matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def check(docs: list[dict]) -> list[str]:
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    errors = []
    eng = by.get(("Deployment", "astro-engine"))
    pod_labels: dict = {}
    pod_ports: set[str] = set()
    if eng is None:
        errors.append("no Deployment astro-engine")
    else:
        pod_labels = eng["spec"]["template"]["metadata"]["labels"]
        pod = eng["spec"]["template"]["spec"]
        main = {c["name"]: c for c in pod.get("containers", [])}
        side = {c["name"]: c for c in pod.get("initContainers", [])}
        pod_ports = {pt["name"] for c in [*main.values(), *side.values()] for pt in c.get("ports", [])}
        if "engine" not in main or main["engine"]["args"][:2] != ["serve", "engine"]:
            errors.append("engine pod: no container 'engine' running `astro serve engine`")
        p = side.get("predictor")
        if p is None or p.get("restartPolicy") != "Always" or p["args"][:2] != ["serve", "predictor"]:
            errors.append("engine pod: no native sidecar 'predictor' (init container, restartPolicy Always)")
        elif "http://127.0.0.1:8000" not in p["args"]:
            errors.append("engine pod: the Predictor does not read its engine over localhost")
    sched = by.get(("Deployment", "astro-scheduler"))
    if sched is None or sched["spec"].get("replicas", 1) < 2:
        errors.append("no Deployment astro-scheduler with >= 2 replicas")
    svc = by.get(("Service", "astro-engine"))
    if svc is None or svc["spec"].get("clusterIP") != "None":
        errors.append("no headless Service astro-engine")
    elif {p["name"] for p in svc["spec"]["ports"]} != {"http", "predictor"}:
        errors.append("Service astro-engine must name its ports http and predictor (discovery maps them)")
    elif not sel_matches({"matchLabels": svc["spec"]["selector"]}, pod_labels):
        errors.append("Service astro-engine does not select the engine pods")
    if ("Service", "astro-scheduler") not in by:
        errors.append("no Service astro-scheduler")
    role = by.get(("Role", "astro-scheduler-discovery"))
    want = [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]}]
    if role is None or role["rules"] != want:
        errors.append("Role astro-scheduler-discovery is not exactly get/list/watch on endpointslices")
    for d in docs:
        name = d["metadata"]["name"]
        if d["kind"] == "PodMonitor":
            if not sel_matches(d["spec"]["selector"], pod_labels):
                errors.append(f"PodMonitor {name} selects no engine pod")
            for ep in d["spec"]["podMetricsEndpoints"]:
                if ep["port"] not in pod_ports:
                    errors.append(f"PodMonitor {name}: the engine pod has no container port named {ep['port']!r}")
        elif d["kind"] == "ServiceMonitor":
            svcs = [s for s in docs if s["kind"] == "Service"
                    and sel_matches(d["spec"]["selector"], s["metadata"].get("labels") or {})]
            if not svcs:
                errors.append(f"ServiceMonitor {name} selects no Service")
            for ep in d["spec"]["endpoints"]:
                for s in svcs:
                    if ep["port"] not in {p.get("name") for p in s["spec"]["ports"]}:
                        errors.append(f"ServiceMonitor {name}: Service {s['metadata']['name']} has no port "
                                      f"{ep['port']!r}")
    return errors


def main() -> int:
    overlay, path = sys.argv[1], sys.argv[2]
    with open(path) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    errors = check(docs)
    for e in errors:
        print(f"k8s.sh: {overlay} overlay: {e}", file=sys.stderr)
    print(f"k8s.sh: {overlay} overlay structure: {len(docs)} resources, {len(errors)} problems")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
