"""The kustomize base in k8s/: well-formed, complete, and consistent with the app's settings.

Offline and fast: it reads the YAML files only (no cluster, no kustomize binary).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from shared.settings import Settings

K8S = Path(__file__).resolve().parent.parent / "k8s"
NAMESPACE = "inference-fleet"
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
CLUSTER_SCOPED_KINDS = {"Namespace"}


def _yaml_files() -> list[Path]:
    return sorted([*K8S.glob("*.yaml"), *K8S.glob("*.yml")])


def _load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


KUSTOMIZATION = _load(K8S / "kustomization.yaml")[0]
OBJECT_FILES = [p for p in _yaml_files() if p.name != "kustomization.yaml"]
OBJECTS = [obj for path in OBJECT_FILES for obj in _load(path)]


def _objects(kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in OBJECTS if o.get("kind") == kind}


def _workloads() -> dict[str, dict]:
    return {
        f"{o['kind']}/{o['metadata']['name']}": o for o in OBJECTS if o["kind"] in WORKLOAD_KINDS
    }


def _containers(workload: dict) -> Iterator[dict]:
    spec = workload["spec"]["template"]["spec"]
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def _container(kind: str, name: str) -> dict:
    (container,) = _objects(kind)[name]["spec"]["template"]["spec"]["containers"]
    return container


def _argv(container: dict) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: p.name)
def test_every_yaml_file_parses(path):
    docs = _load(path)
    assert docs, f"{path.name} holds no document"
    assert all(isinstance(doc, dict) for doc in docs)


def test_kustomization_lists_exactly_the_object_files():
    assert KUSTOMIZATION["kind"] == "Kustomization"
    assert KUSTOMIZATION["namespace"] == NAMESPACE
    listed = KUSTOMIZATION["resources"]
    assert len(listed) == len(set(listed)), "a resource is listed twice"
    missing = [name for name in listed if not (K8S / name).is_file()]
    assert not missing, f"listed in kustomization.yaml but absent: {missing}"
    unlisted = sorted({p.name for p in OBJECT_FILES} - set(listed))
    assert not unlisted, f"not listed in kustomization.yaml: {unlisted}"


def test_kustomization_labels_every_object_part_of_the_fleet():
    pairs = {}
    for entry in KUSTOMIZATION.get("labels", []):
        pairs |= entry["pairs"]
    pairs |= KUSTOMIZATION.get("commonLabels", {})
    assert pairs.get("app.kubernetes.io/part-of") == NAMESPACE


def test_every_object_is_well_formed_and_in_the_namespace():
    assert OBJECTS
    for obj in OBJECTS:
        assert obj.get("apiVersion"), obj
        assert obj.get("kind"), obj
        name = obj.get("metadata", {}).get("name")
        assert name, f"{obj['kind']} without metadata.name"
        if obj["kind"] in CLUSTER_SCOPED_KINDS:
            continue
        assert obj["metadata"].get("namespace") == NAMESPACE, f"{obj['kind']}/{name}"
    assert NAMESPACE in _objects("Namespace")
    keys = [(o["kind"], o["metadata"]["name"]) for o in OBJECTS]
    assert len(keys) == len(set(keys)), "two objects of one kind share a name"


def test_worker_deployment_gets_a_gpu_and_time_to_finish_its_batch():
    worker = _objects("Deployment")["worker"]
    pod = worker["spec"]["template"]["spec"]
    container = _container("Deployment", "worker")
    resources = container["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) == 1
    assert int(resources["requests"].get("nvidia.com/gpu", 1)) == 1
    for key in ("cpu", "memory"):
        assert resources["requests"][key] and resources["limits"][key]
    assert pod["terminationGracePeriodSeconds"] >= 120
    assert container["readinessProbe"]
    assert container["startupProbe"]["failureThreshold"] >= 60  # model download and load


def test_worker_probe_reads_the_heartbeat_of_its_own_celery_hostname():
    container = _container("Deployment", "worker")
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    argv = _argv(container)
    assert argv[:4] == ["celery", "-A", "workers.celery_app", "worker"]
    assert "--pool=solo" in argv
    assert "--queues=gpu" in argv
    assert "--hostname=infer@$(POD_NAME)" in argv
    check = " ".join(container["readinessProbe"]["exec"]["command"])
    assert "':worker:infer@' + os.environ['POD_NAME']" in check
    assert "KEY_PREFIX" in check
    compile(container["readinessProbe"]["exec"]["command"][-1], "probe", "exec")


def test_gateway_ready_means_process_up_not_fleet_ready():
    container = _container("Deployment", "gateway")
    assert _argv(container) == ["gunicorn", "-c", "gateway/gunicorn_conf.py", "gateway.wsgi:app"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz"
    assert _objects("Deployment")["gateway"]["spec"]["replicas"] == 2


def test_every_env_reference_is_defined_here():
    config_maps = {name: o.get("data", {}) for name, o in _objects("ConfigMap").items()}
    secrets = {
        name: {**o.get("stringData", {}), **o.get("data", {})}
        for name, o in _objects("Secret").items()
    }
    for workload_id, workload in _workloads().items():
        for container in _containers(workload):
            where = f"{workload_id} {container['name']}"
            for source in container.get("envFrom", []):
                if "configMapRef" in source:
                    assert source["configMapRef"]["name"] in config_maps, where
                if "secretRef" in source:
                    assert source["secretRef"]["name"] in secrets, where
            for var in container.get("env", []):
                ref = var.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    key_ref, defined = ref["configMapKeyRef"], config_maps
                elif "secretKeyRef" in ref:
                    key_ref, defined = ref["secretKeyRef"], secrets
                else:
                    continue
                assert key_ref["name"] in defined, f"{where}: {var['name']}"
                assert key_ref["key"] in defined[key_ref["name"]], f"{where}: {var['name']}"


def test_flower_reads_its_basic_auth_from_the_secret():
    container = _container("Deployment", "flower")
    env = {e["name"]: e for e in container["env"]}
    assert env["FLOWER_BASIC_AUTH"]["valueFrom"]["secretKeyRef"]["name"] in _objects("Secret")


def test_redis_runs_with_aof():
    container = _container("StatefulSet", "redis")
    assert container["image"].startswith("redis:7")
    argv = " ".join(_argv(container))
    assert "--appendonly yes" in argv
    assert "--appendfsync everysec" in argv
    redis = _objects("StatefulSet")["redis"]
    (claim,) = redis["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts[claim["metadata"]["name"]] == "/data"
    assert "redis" in _objects("Service")


def test_configmap_keys_are_fleet_settings_with_valid_values():
    (config,) = _objects("ConfigMap").values()
    data = config["data"]
    assert all(isinstance(v, str) for v in data.values()), "ConfigMap values must be strings"
    unknown = sorted(k for k in data if k.lower() not in Settings.model_fields)
    assert not unknown, f"not fields of shared.settings.Settings: {unknown}"
    assert all(k == k.upper() for k in data)
    settings = Settings(**{k.lower(): v for k, v in data.items()})
    assert settings.gateway_host == "0.0.0.0"
    assert settings.model and settings.redis_url
    gateway_ports = {p["containerPort"] for p in _container("Deployment", "gateway")["ports"]}
    assert settings.gateway_port in gateway_ports


def test_service_links_cannot_clobber_settings():
    """A Service named X injects X_PORT=tcp://... into pods, and FLOWER_PORT/GATEWAY_PORT are
    integer settings (Flower reads FLOWER_PORT too): the fleet's pods must turn links off."""
    for workload_id, workload in _workloads().items():
        assert workload["spec"]["template"]["spec"].get("enableServiceLinks") is False, workload_id


def test_every_service_selects_a_pod_and_a_port_it_has():
    workloads = list(_workloads().values())
    for name, service in _objects("Service").items():
        selector = service["spec"]["selector"]
        matching = [
            w
            for w in workloads
            if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert matching, f"Service {name} selects no pod"
        ports = {
            (p.get("name"), p["containerPort"])
            for w in matching
            for c in _containers(w)
            for p in c.get("ports", [])
        }
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert any(target in pair for pair in ports), f"Service {name}: {target}"
