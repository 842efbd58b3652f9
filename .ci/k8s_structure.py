"""Structure checks of one rendered overlay (called by .ci/k8s.sh; needs PyYAML).

Usage: python .ci/k8s_structure.py OVERLAY RENDERED.yaml

Checks what the schema validation cannot: the engine pod holds the engine container and
its Predictor as a native sidecar reading it over localhost; the scheduler Deployment has
>= 2 replicas; the headless engine Service selects the engine pods and names its ports
http / predictor (what discovery maps); the discovery Role is exactly get/list/watch on
endpointslices; the Prometheus Operator monitors (no schema in kubernetes-validate)
select existing pods / Services and name ports they have. The GIE overlay (a Deployment
astro-epp instead of the scheduler): the EPP, its Service, RBAC and probes, and the
InferencePool (GIE's v1 schema facts: kubernetes-validate has none for it) and HTTPRoute
wired to the engine pods and the EPP (`check_gie`). A heterogeneous fleet (overlay hetero:
one engine Deployment per group, `check_engine_groups`): each group's pod holds the engine and
its Predictor on the same profile, no Deployment selects another group's pods, the engine
Service selects them all, and each group's pod is astro-engine's but for its profile and
group label (a copy that drifted from the base is caught). Exit 1 on any problem.
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
    errors += check_engine_groups(docs, by)
    gie = ("Deployment", "astro-epp") in by  # GIE mode: the gateway + EPP replace the scheduler
    sched = by.get(("Deployment", "astro-scheduler"))
    if gie:
        errors += check_gie(docs, by, eng)
    elif sched is None or sched["spec"].get("replicas", 1) < 2:
        errors.append("no Deployment astro-scheduler with >= 2 replicas")
    svc = by.get(("Service", "astro-engine"))
    if svc is None or svc["spec"].get("clusterIP") != "None":
        errors.append("no headless Service astro-engine")
    elif {p["name"] for p in svc["spec"]["ports"]} != {"http", "predictor"}:
        errors.append("Service astro-engine must name its ports http and predictor (discovery maps them)")
    elif not sel_matches({"matchLabels": svc["spec"]["selector"]}, pod_labels):
        errors.append("Service astro-engine does not select the engine pods")
    if ("Service", "astro-scheduler") not in by and not gie:
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


GROUP_LABEL = "astro.io/engine-group"


def _profile_env(container: dict) -> str | None:
    return next((e.get("value") for e in container.get("env") or [] if e["name"] == "ASTRO_PROFILE"), None)


def _without_group(pod: dict) -> dict:
    """An engine pod template with its group label and ASTRO_PROFILE values taken out."""
    import copy

    pod = copy.deepcopy(pod)
    pod["metadata"]["labels"].pop(GROUP_LABEL, None)
    for c in [*pod["spec"].get("containers", []), *pod["spec"].get("initContainers", [])]:
        c["env"] = [e for e in c.get("env") or [] if e["name"] != "ASTRO_PROFILE"]
    return pod


def check_engine_groups(docs: list[dict], by: dict) -> list[str]:
    """Every engine Deployment (pods labelled component=engine) beside astro-engine is a
    group of a heterogeneous fleet: see the module docstring."""
    groups = [d for d in docs if d["kind"] == "Deployment"
              and d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "engine"]
    if len(groups) < 2:
        return []
    errs = []
    base = by.get(("Deployment", "astro-engine"))
    svc = by.get(("Service", "astro-engine"))
    for d in groups:
        name = d["metadata"]["name"]
        tmpl = d["spec"]["template"]
        labels = tmpl["metadata"]["labels"]
        if GROUP_LABEL not in labels or d["spec"]["selector"]["matchLabels"].get(GROUP_LABEL) != labels[GROUP_LABEL]:
            errs.append(f"engine group {name}: its selector and pods need their own {GROUP_LABEL} label")
        for other in groups:
            if other is not d and sel_matches(d["spec"]["selector"], other["spec"]["template"]["metadata"]["labels"]):
                errs.append(f"engine group {name}: its selector also selects the pods of {other['metadata']['name']}")
        pod = tmpl["spec"]
        main = {c["name"]: c for c in pod.get("containers", [])}
        side = {c["name"]: c for c in pod.get("initContainers", [])}
        if "engine" not in main or "predictor" not in side:
            errs.append(f"engine group {name}: no engine container with its Predictor sidecar")
            continue
        prof = _profile_env(main["engine"])
        if not prof or _profile_env(side["predictor"]) != prof:
            errs.append(f"engine group {name}: the engine and its Predictor must name the same ASTRO_PROFILE")
        if svc is not None and not sel_matches({"matchLabels": svc["spec"]["selector"]}, labels):
            errs.append(f"Service astro-engine does not select the pods of engine group {name}")
        if base is not None and d is not base and _without_group(tmpl) != _without_group(base["spec"]["template"]):
            errs.append(f"engine group {name}: its pod differs from astro-engine's in more than its profile and "
                        f"{GROUP_LABEL} (a copy that drifted from the base)")
    return errs


# InferencePool inference.networking.k8s.io/v1 (GIE v1.x), as its published CRD defines
# it: the fields a spec may have (anything else is pruned or refused by the API server),
# the required ones, the enums and ranges. kubernetes-validate has no schema for CRDs, and
# CI cannot fetch GIE's CRD (only package registries are reachable), so this is checked here.
POOL_SPEC = {"selector", "targetPorts", "endpointPickerRef", "appProtocol"}
POOL_REQUIRED = {"selector", "targetPorts"}
PICKER_REF = {"name", "kind", "group", "port", "failureMode"}


def _port_ok(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 65535


def check_inference_pool(d: dict) -> list[str]:
    """Schema facts of one InferencePool (v1)."""
    name = d["metadata"]["name"]
    errs = []
    if d.get("apiVersion") != "inference.networking.k8s.io/v1":
        errs.append(f"InferencePool {name}: apiVersion must be inference.networking.k8s.io/v1 (GIE v1.x)")
    spec = d.get("spec") or {}
    if set(spec) - POOL_SPEC:
        errs.append(f"InferencePool {name}: unknown spec fields {sorted(set(spec) - POOL_SPEC)}")
    if POOL_REQUIRED - set(spec):
        errs.append(f"InferencePool {name}: missing spec fields {sorted(POOL_REQUIRED - set(spec))}")
    sel = spec.get("selector") or {}
    ml = sel.get("matchLabels")
    if set(sel) != {"matchLabels"} or not isinstance(ml, dict) or not 1 <= len(ml) <= 64 \
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in ml.items()):
        errs.append(f"InferencePool {name}: selector must be exactly matchLabels (1-64 string pairs)")
    ports = spec.get("targetPorts")
    if not isinstance(ports, list) or not 1 <= len(ports) <= 8 \
            or not all(isinstance(p, dict) and set(p) == {"number"} and _port_ok(p["number"]) for p in ports) \
            or len({p["number"] for p in ports}) != len(ports):
        errs.append(f"InferencePool {name}: targetPorts must be 1-8 unique {{number: 1-65535}}")
    if spec.get("appProtocol", "http") not in ("http", "kubernetes.io/h2c"):
        errs.append(f"InferencePool {name}: appProtocol must be http or kubernetes.io/h2c")
    ref = spec.get("endpointPickerRef")
    if ref is not None:
        if set(ref) - PICKER_REF or "name" not in ref:
            errs.append(f"InferencePool {name}: endpointPickerRef fields must be name (required) + {sorted(PICKER_REF)}")
        if ref.get("failureMode", "FailClose") not in ("FailOpen", "FailClose"):
            errs.append(f"InferencePool {name}: endpointPickerRef.failureMode must be FailOpen or FailClose")
        port = ref.get("port")
        if ref.get("kind", "Service") == "Service" and (not isinstance(port, dict) or set(port) != {"number"}
                                                        or not _port_ok(port["number"])):
            errs.append(f"InferencePool {name}: endpointPickerRef.port {{number}} is required for a Service")
    return errs


def check_gie(docs: list[dict], by: dict, eng: dict | None) -> list[str]:
    """The GIE overlay: the EPP Deployment runs `astro serve epp` with discovery, its
    Service exposes the gRPC port its probes use, the InferencePool (v1 schema facts)
    selects the engine pods on their OpenAI port and names the EPP Service and port, the
    HTTPRoute sends to the pool, the EPP's service account is bound to the discovery Role."""
    errs = []
    epp = by[("Deployment", "astro-epp")]
    pod = epp["spec"]["template"]
    c = next((c for c in pod["spec"]["containers"] if c["name"] == "epp"), None)
    if c is None or c["args"][:2] != ["serve", "epp"]:
        return ["EPP pod: no container 'epp' running `astro serve epp`"]
    args = c["args"]
    flag = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    if flag.get("--discover") != "kubernetes" or flag.get("--discover-service") != "astro-engine":
        errs.append("EPP: not `--discover kubernetes --discover-service astro-engine`")
    grpc_port = int(flag.get("--port", "9002"))
    cports = {p["name"]: p["containerPort"] for p in c.get("ports", [])}
    if cports.get("grpc") != grpc_port:
        errs.append(f"EPP: container port 'grpc' is not its --port {grpc_port}")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        g = (c.get(probe) or {}).get("grpc")
        if not g or g.get("port") != grpc_port:
            errs.append(f"EPP: {probe} is not a gRPC health probe on port {grpc_port}")
    if (c.get("readinessProbe") or {}).get("grpc", {}).get("service") != "readiness":
        errs.append("EPP: readinessProbe must ask the gRPC health service 'readiness'")
    sa = pod["spec"].get("serviceAccountName")
    if not any(d["kind"] == "RoleBinding" and d["roleRef"]["name"] == "astro-scheduler-discovery"
               and any(x["kind"] == "ServiceAccount" and x["name"] == sa for x in d["subjects"]) for d in docs):
        errs.append(f"EPP: service account {sa!r} is not bound to Role astro-scheduler-discovery")
    pools = [d for d in docs if d["kind"] == "InferencePool"]
    if len(pools) != 1:
        return errs + [f"want one InferencePool, found {len(pools)}"]
    pool = pools[0]
    errs += check_inference_pool(pool)
    spec = pool.get("spec") or {}
    if eng is not None:
        labels = eng["spec"]["template"]["metadata"]["labels"]
        if not sel_matches(spec.get("selector") or {}, labels):
            errs.append("InferencePool: its selector does not select the engine pods")
        http = [p["containerPort"] for c in eng["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"
                for p in c.get("ports", []) if p["name"] == "http"]
        if [p.get("number") for p in spec.get("targetPorts") or []] != http:
            errs.append(f"InferencePool: targetPorts must be the engine's OpenAI port {http}")
    ref = spec.get("endpointPickerRef") or {}
    svc = by.get(("Service", ref.get("name")))
    if svc is None:
        errs.append(f"InferencePool: endpointPickerRef names no Service ({ref.get('name')!r})")
    else:
        if not sel_matches({"matchLabels": svc["spec"]["selector"]}, pod["metadata"]["labels"]):
            errs.append(f"Service {svc['metadata']['name']} does not select the EPP pods")
        sp = [p for p in svc["spec"]["ports"] if p["port"] == (ref.get("port") or {}).get("number")]
        if not sp or sp[0].get("targetPort") not in ("grpc", grpc_port):
            errs.append("InferencePool: endpointPickerRef.port is not the EPP Service's gRPC port")
    routes = [d for d in docs if d["kind"] == "HTTPRoute"]
    to_pool = [b for r in routes for rule in r["spec"].get("rules", []) for b in rule.get("backendRefs", [])
               if b.get("group") == "inference.networking.k8s.io" and b.get("kind") == "InferencePool"
               and b.get("name") == pool["metadata"]["name"]]
    if not to_pool:
        errs.append("no HTTPRoute sends to the InferencePool")
    return errs


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
