"""Checks of the rendered overlays against what the processes need to run in production: the KV cache and weights
of the default pair fit each pool's memory limit, threads match CPU limits, the coordinator reads the target's
tokenizer and its API key from a Secret, Ray pods pass their probes with minimal Ray, TLS reaches the workers,
pools spread over nodes, images are pinned per component. Renders with tests/test_deploy.py's kustomize."""
from __future__ import annotations

import json
import math
import re

import pytest

from specdec.common import defaults
from tests.test_deploy import (BASE, DEPLOY, OVERLAYS, POOLS, ROOT, configmap_env, container, find, pod_labels,
                               pod_templates, render)

# ---------------------------------------------------------------- model, memory and threads

# SmolLM2-135M-Instruct (default-target): its public config.json. The shipped draft's shape is read from its file.
DEFAULT_TARGET_SHAPE = dict(layers=30, kv_heads=3, head_dim=64, params=134.5e6)
GiB = 2**30
# What a replica needs beyond its KV cache: torch, buffers and the interpreter. Measured on the default target in
# bf16: 3.85 GiB RSS with 3.04 GiB of KV, of which 0.25 GiB weights (float32 weights are counted separately).
RUNTIME_BYTES = 0.75 * GiB
HEADROOM = 0.85  # the estimate may use at most this share of the memory limit


def default_draft_shape() -> dict:
    from specdec.modeling.hub import DEFAULT_DRAFT_DIR

    cfg = json.loads((DEFAULT_DRAFT_DIR / "config.json").read_text())
    with open(DEFAULT_DRAFT_DIR / "model.safetensors", "rb") as f:  # safetensors: 8-byte header size, JSON header
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    params = sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return dict(layers=cfg["num_hidden_layers"], kv_heads=cfg["num_key_value_heads"],
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"], params=params)


def quantity(q) -> float:
    """A Kubernetes quantity (memory or CPU) as a number: bytes, or cores."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "m": 1e-3}
    q = str(q)
    for u, f in units.items():
        if q.endswith(u):
            return float(q[: -len(u)]) * f
    return float(q)


def pool_settings(objs: list[dict], comp: str):
    from draft_service.config import DraftSettings
    from target_service.config import TargetSettings

    cls = {"draft": DraftSettings, "target": TargetSettings}[comp]
    prefix = POOLS[comp]["env"]
    env = configmap_env(objs, f"specdec-{comp}-config")
    return cls(**{k.removeprefix(prefix).lower(): v for k, v in env.items()
                  if k.removeprefix(prefix).lower() in cls.model_fields})


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_default_pair_kv_fits_the_memory_limit(overlay):
    """Each replica preallocates its KV slots at start (specdec/state/kv_slots.py: K and V per layer, [slots,
    max_context + 64, kv_heads, head_dim]). In float32 (dtype auto on a CPU without bf16 GEMMs), plus float32
    weights and the runtime, that must fit the container's memory limit with headroom; cpu-demo's target was
    OOMKilled at start (64 sessions, 2Gi)."""
    objs = render(BASE if overlay == "base" else DEPLOY / "overlays" / overlay)
    shapes = {defaults.DEFAULT_TARGET: DEFAULT_TARGET_SHAPE, defaults.DEFAULT_DRAFT: default_draft_shape()}
    checked = 0
    for comp in POOLS:
        s = pool_settings(objs, comp)
        if s.model not in shapes or s.device != "cpu":
            continue  # another pair (the gpu overlay's): its memory is the GPU's
        shape = shapes[s.model]
        kv = s.worker_slots() * (s.max_context + 64) * shape["kv_heads"] * shape["head_dim"] * 2 * shape["layers"] * 4
        need = kv + shape["params"] * 4 + RUNTIME_BYTES
        res = container(objs, comp)["resources"]
        limit = quantity(res["limits"]["memory"])
        assert need <= HEADROOM * limit, (f"{overlay} {comp}: {s.worker_slots()} KV slots = {kv / GiB:.2f} GiB, "
                                          f"needs ~{need / GiB:.2f} GiB against a {res['limits']['memory']} limit")
        checked += 1
    assert checked == (0 if overlay == "gpu" else 2)


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_pool_threads_match_cpu_limits(overlay):
    """torch sizes its intra-op pool from the node's cores unless told: each pool sets *_THREADS to its CPU limit."""
    objs = render(BASE if overlay == "base" else DEPLOY / "overlays" / overlay)
    for comp in POOLS:
        limits = container(objs, comp)["resources"]["limits"]
        assert "cpu" in limits, f"{overlay} {comp}: no CPU limit"
        assert pool_settings(objs, comp).threads == quantity(limits["cpu"]), f"{overlay} {comp}"


# ---------------------------------------------------------------- coordinator

def head_and_workers(objs: list[dict]) -> tuple[dict, list[dict]]:
    (rc,) = find(objs, "RayCluster")
    return rc["spec"]["headGroupSpec"], rc["spec"].get("workerGroupSpecs", [])


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_coordinator_tokenizer_is_the_target_model(overlay):
    """The coordinator tokenizes prompts: with another model's tokenizer than the target's, every request is wrong
    without any error (the gpu overlay once left the default SmolLM2 tokenizer beside a Llama pair)."""
    from coordinator.config import CoordinatorSettings

    objs = render(BASE if overlay == "base" else DEPLOY / "overlays" / overlay)
    cfg = configmap_env(objs, "specdec-coordinator-config")
    settings = CoordinatorSettings(**{k.removeprefix("COORDINATOR_").lower(): v for k, v in cfg.items()})
    target = pool_settings(objs, "target").model
    head, _ = head_and_workers(objs)
    pod = head["template"]["spec"]
    if settings.tokenizer == target:
        assert target == defaults.DEFAULT_TARGET, "a hub id here makes the head download the model's weights"
        return
    # a directory that the head's init container fills with TARGET_MODEL's tokenizer, from the target's ConfigMap
    inits = [c for c in pod.get("initContainers", []) if settings.tokenizer in " ".join(c["command"])]
    assert len(inits) == 1, (f"COORDINATOR_TOKENIZER={settings.tokenizer!r} is neither TARGET_MODEL ({target!r}) nor "
                             f"a directory that an init container of the head fills")
    (init,) = inits
    assert 'os.environ["TARGET_MODEL"]' in " ".join(init["command"])
    refs = [e["configMapRef"]["name"] for e in init["envFrom"]]
    (cm,) = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] in refs]
    assert cm["metadata"]["name"].startswith("specdec-target-config")
    assert any(e["name"] == "HF_TOKEN" and e["valueFrom"]["secretKeyRef"]["name"] == "specdec-hf-token"
               for e in init["env"]), "gated models need the hub token"
    mount = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    head_mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
    cache = next(p for p in mount if settings.tokenizer.startswith(p + "/"))
    assert head_mounts.get(cache) == mount[cache]
    assert "emptyDir" in {v["name"]: v for v in pod["volumes"]}[mount[cache]]
    assert settings.served_model_name == target, "the HTTP API names the model it serves"


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_coordinator_api_key_comes_from_a_secret(overlay):
    objs = render(BASE if overlay == "base" else DEPLOY / "overlays" / overlay)
    head, _ = head_and_workers(objs)
    env = {e["name"]: e for e in head["template"]["spec"]["containers"][0]["env"]}
    ref = env["COORDINATOR_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("specdec-coordinator-api-key", "api-key")
    assert ref["optional"] is (overlay != "gpu"), "optional in base and cpu-demo, required in gpu"
    assert "COORDINATOR_API_KEY" not in configmap_env(objs, "specdec-coordinator-config"), "a key is no setting"
    guide = (ROOT / "docs" / "operations" / "deploy.md").read_text()
    assert "create secret generic specdec-coordinator-api-key" in guide


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_ray_pods_work_with_minimal_ray(overlay):
    """The image has `ray`, not `ray[default]`: no dashboard agent HTTP server, no metrics endpoint. Without probes of
    their own, KubeRay injects HTTP probes into the workers that never pass. Each worker group's num-cpus is its CPU
    limit (Ray places one pipeline actor per counted CPU)."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"ray[<>=]", d) for d in deps), "these checks assume the minimal ray package"
    objs = render(BASE if overlay == "base" else DEPLOY / "overlays" / overlay)
    head, workers = head_and_workers(objs)
    assert workers
    for group in [head, *workers]:
        assert "metrics-export-port" not in group["rayStartParams"], "minimal Ray serves no metrics"
        for c in group["template"]["spec"]["containers"]:
            assert "ray-metrics" not in {p["name"] for p in c.get("ports", [])}
            for kind in ("readinessProbe", "livenessProbe"):
                probe = c.get(kind)
                assert probe, f"{c['name']}: no {kind}; KubeRay would inject an HTTP one"
                assert "httpGet" not in probe and "wget" not in " ".join(probe.get("exec", {}).get("command", []))
    for g in workers:
        (c,) = g["template"]["spec"]["containers"]
        assert c["readinessProbe"]["exec"]["command"] == ["ray", "health-check"]
        assert quantity(g["rayStartParams"]["num-cpus"]) == quantity(c["resources"]["limits"]["cpu"])
    (policy,) = find(objs, "NetworkPolicy", "specdec-coordinator")
    assert 8080 not in {p["port"] for r in policy["spec"]["ingress"] for p in r.get("ports", [])}
    assert ":8080" not in (ROOT / "docs" / "operations" / "deploy.md").read_text()


def test_tls_reaches_the_coordinator_workers():
    """The head hands its pipeline actors the TLS file paths (coordinator/server.py client_tls); actors on worker
    pods open those files there, so the worker pods mount the same Secret at the same path."""
    objs = render(DEPLOY / "overlays" / "gpu")
    head, workers = head_and_workers(objs)

    def tls_mounts(pod: dict) -> dict[str, str]:
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        return {m["mountPath"]: secrets[m["name"]] for c in pod["containers"] for m in c.get("volumeMounts", [])
                if m["name"] in secrets}

    want = tls_mounts(head["template"]["spec"])
    assert want == {"/etc/specdec/tls": "specdec-coordinator-tls"}
    for g in workers:
        assert tls_mounts(g["template"]["spec"]) == want, g["groupName"]


# ---------------------------------------------------------------- availability and images

@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_pools_spread_over_nodes(overlay):
    objs = render(BASE if overlay == "base" else DEPLOY / "overlays" / overlay)
    for comp in POOLS:
        (dep,) = find(objs, "Deployment", f"specdec-{comp}")
        (tsc,) = dep["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert (tsc["topologyKey"], tsc["whenUnsatisfiable"]) == ("kubernetes.io/hostname", "ScheduleAnyway")
        assert tsc["labelSelector"]["matchLabels"].items() <= pod_labels(dep).items()
    if overlay == "gpu":
        for h in find(objs, "HorizontalPodAutoscaler"):
            assert h["spec"]["minReplicas"] >= 2, f"{h['metadata']['name']}: one node's loss takes the pool"


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_images_are_pinned_per_component(overlay):
    """Every container, init containers too, names its image with an explicit tag. The pools run the CUDA variant
    only in the gpu overlay; the coordinator never needs CUDA."""
    objs = render(BASE if overlay == "base" else DEPLOY / "overlays" / overlay)
    for owner, spec, labels in pod_templates(objs):
        want = "cuda" if overlay == "gpu" and labels["app.kubernetes.io/component"] in POOLS else "cpu"
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            assert c["image"] == f"{defaults.IMAGE_NAME}:{want}", f"{owner}/{c['name']}: {c['image']}"


# ---------------------------------------------------------------- docs

def test_deploy_doc_is_complete():
    text = (ROOT / "docs" / "operations" / "deploy.md").read_text()
    assert not re.search(r"<[A-Z_]+>", text), "unfilled placeholders"
    assert "session 27" not in text.lower(), "project history belongs in the changelog, not the guide"
    probe = re.search(r"`python /etc/specdec/probe/grpc_tls_health\.py[^`]*`", text)
    assert probe and "--server-name" in probe.group(0), "the probe dials 127.0.0.1: it needs the SAN to check"
    assert "dialed by pod IP" in text and "SAN" in text
