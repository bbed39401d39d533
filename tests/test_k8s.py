"""The kustomize base in k8s/, its autoscaling components (k8s/keda, k8s/autoscaler) and its
vLLM worker variant (k8s/vllm): well-formed, valid against the Kubernetes API schemas,
buildable, and consistent with the app's settings and with the image recipes in docker/.

Offline and fast: no cluster. The kustomizations are built with `kustomize` or `kubectl
kustomize` when one is on the PATH, and always with the small builder below, which must agree.
"""

from __future__ import annotations

import ast
import base64
import copy
import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pydantic
import pytest
import yaml

from fleet import commands
from shared.keys import JOBS_GROUP, Keys
from shared.settings import Settings
from shared.states import LANES, Lane

K8S = Path(__file__).resolve().parent.parent / "k8s"
COMPONENTS = {"keda": K8S / "keda", "controller": K8S / "autoscaler"}
# The vLLM worker variant, a Component too: the workers with ENGINE=vllm and their own image.
VLLM = K8S / "vllm"
# The overlays k8s/README.md tells users to write: the base, optionally with the vLLM
# variant, and with at most one autoscaling component (in either order with the variant).
OVERLAYS = {
    "base": [],
    "keda": [COMPONENTS["keda"]],
    "controller": [COMPONENTS["controller"]],
    "vllm": [VLLM],
    "vllm+keda": [VLLM, COMPONENTS["keda"]],
    "vllm+controller": [COMPONENTS["controller"], VLLM],
}
ROOT = K8S.parent
DOCKER = ROOT / "docker"
NAMESPACE = "inference-fleet"
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}
CLUSTER_SCOPED_KINDS = {"Namespace"}
# Schemas shipped by kubernetes-validate (pinned in requirements.txt): its newest.
KUBERNETES_VERSION = "1.37"
# Custom resources: the Kubernetes schemas do not have them (tested field by field below).
CRD_KINDS = {"ScaledObject", "TriggerAuthentication"}
CONSUMER_GROUP = JOBS_GROUP


def _yaml_files() -> list[Path]:
    return sorted([*K8S.glob("*.yaml"), *K8S.glob("*.yml")])


def _load(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


KUSTOMIZATION = _load(K8S / "kustomization.yaml")[0]
OBJECT_FILES = [p for p in _yaml_files() if p.name != "kustomization.yaml"]
OBJECTS = [obj for path in OBJECT_FILES for obj in _load(path)]
COMPONENT_FILES = {
    name: sorted([*path.glob("*.yaml"), *path.glob("*.yml")]) for name, path in COMPONENTS.items()
}
VLLM_FILES = sorted([*VLLM.glob("*.yaml"), *VLLM.glob("*.yml")])
COMPONENT_OBJECTS = {
    name: [obj for p in files if p.name != "kustomization.yaml" for obj in _load(p)]
    for name, files in COMPONENT_FILES.items()
}
# Every object of the base and of the optional components.
ALL_OBJECTS = OBJECTS + [obj for objs in COMPONENT_OBJECTS.values() for obj in objs]


def _objects(kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in OBJECTS if o.get("kind") == kind}


def _workloads(objects: list[dict] | None = None) -> dict[str, dict]:
    return {
        f"{o['kind']}/{o['metadata']['name']}": o
        for o in (OBJECTS if objects is None else objects)
        if o["kind"] in WORKLOAD_KINDS
    }


def _one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    (obj,) = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    return obj


def _env(container: dict) -> dict[str, str | None]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _containers(workload: dict) -> Iterator[dict]:
    spec = workload["spec"]["template"]["spec"]
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def _container(kind: str, name: str) -> dict:
    (container,) = _objects(kind)[name]["spec"]["template"]["spec"]["containers"]
    return container


def _argv(container: dict) -> list[str]:
    return [*container.get("command", []), *container.get("args", [])]


@pytest.mark.parametrize(
    "path",
    [*_yaml_files(), *(p for files in COMPONENT_FILES.values() for p in files), *VLLM_FILES],
    ids=lambda p: str(p.relative_to(K8S)),
)
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
    for obj in ALL_OBJECTS:
        assert obj.get("apiVersion"), obj
        assert obj.get("kind"), obj
        name = obj.get("metadata", {}).get("name")
        assert name, f"{obj['kind']} without metadata.name"
        if obj["kind"] in CLUSTER_SCOPED_KINDS:
            continue
        assert obj["metadata"].get("namespace") == NAMESPACE, f"{obj['kind']}/{name}"
    assert NAMESPACE in _objects("Namespace")
    for objects in (OBJECTS + COMPONENT_OBJECTS["keda"], OBJECTS + COMPONENT_OBJECTS["controller"]):
        keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
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
    for workload_id, workload in _workloads(ALL_OBJECTS).items():
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


def _secret_ref(container: dict, name: str) -> tuple[str, str]:
    (var,) = [e for e in container.get("env", []) if e["name"] == name]
    ref = var["valueFrom"]["secretKeyRef"]
    return ref["name"], ref["key"]


def test_webhook_worker_runs_the_launchers_command_without_a_gpu():
    deployment = _objects("Deployment")["webhooks"]
    container = _container("Deployment", "webhooks")
    # What `make up` runs (fleet.commands), as `celery ...` instead of `python -m celery ...`.
    launcher = commands.webhook_worker("webhooks@$(POD_NAME)")
    assert launcher[:2] == [commands.PYTHON, "-m"]
    assert _argv(container) == launcher[2:]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert {"configMapRef": {"name": "fleet-config"}} in container["envFrom"]
    resources = container["resources"]
    assert not any("gpu" in key for part in resources.values() for key in part)
    for key in ("cpu", "memory"):
        assert resources["requests"][key] and resources["limits"][key]
    assert "tolerations" not in deployment["spec"]["template"]["spec"]
    # Warm shutdown outlasts one attempt.
    (config,) = _objects("ConfigMap").values()
    settings = Settings(**{k.lower(): v for k, v in config["data"].items()})
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > settings.webhook_timeout_s
    # Its /metrics port, named for the PodMonitor, is the one the worker serves.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == settings.webhook_metrics_port == 9450


def test_webhook_worker_probes_ping_its_own_celery_hostname():
    container = _container("Deployment", "webhooks")
    assert "--hostname=webhooks@$(POD_NAME)" in _argv(container)
    for probe in ("startupProbe", "livenessProbe"):
        shell, flag, script = container[probe]["exec"]["command"]
        assert (shell, flag) == ("sh", "-c"), probe  # probes get no $(VAR) expansion
        assert script.startswith("python -m celery -A webhooks.celery_app inspect ping"), probe
        assert '-d "webhooks@$POD_NAME"' in script, probe
        timeout = int(re.search(r"--timeout=(\d+)", script).group(1))
        assert container[probe]["timeoutSeconds"] > timeout, probe
    assert "readinessProbe" not in container  # no Service sends it traffic


def test_gateway_and_webhook_worker_sign_with_the_same_secret():
    refs = {name: _secret_ref(_container("Deployment", name), "WEBHOOK_SECRET")
            for name in ("gateway", "webhooks")}  # fmt: skip
    assert refs["gateway"] == refs["webhooks"]
    secret_name, key = refs["gateway"]
    assert key in _objects("Secret")[secret_name]["stringData"]


def test_webhook_secret_placeholder_cannot_be_used():
    """A valid placeholder would let a fleet sign with a key published here: the settings
    must refuse it, so the gateway and the webhook worker stop at start until it is set."""
    (secret,) = _objects("Secret").values()
    placeholder = secret["stringData"]["WEBHOOK_SECRET"]
    assert placeholder.startswith("whsec_")
    with pytest.raises(pydantic.ValidationError, match="WEBHOOK_SECRET"):
        Settings(webhook_secret=placeholder)
    generated = "whsec_" + base64.b64encode(os.urandom(32)).decode()  # as the comment says
    assert Settings(webhook_secret=generated).webhook_secret is not None


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


# --- Redis auth ------------------------------------------------------------------------------

REDIS_SECRET_KEY = "REDIS_PASSWORD"
# REDIS_URL of every fleet pod: the in-cluster Redis, with the Secret's password.
FLEET_REDIS_URL = "redis://:$(REDIS_PASSWORD)@redis:6379/0"


def _redis_secret() -> tuple[str, str]:
    """The name of the Secret that holds the Redis password, and its placeholder value."""
    (secret,) = _objects("Secret").values()
    return secret["metadata"]["name"], secret["stringData"][REDIS_SECRET_KEY]


def _fleet_redis_url() -> str:
    return _env(_container("Deployment", "gateway"))["REDIS_URL"]


def _strings(node: object) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)


def test_redis_requires_the_password_from_the_secret():
    container = _container("StatefulSet", "redis")
    env = container["env"]
    names = [e["name"] for e in env]
    secret_name, _ = _redis_secret()
    password_var = env[names.index("REDIS_PASSWORD")]
    assert password_var["valueFrom"]["secretKeyRef"] == {
        "name": secret_name,
        "key": REDIS_SECRET_KEY,
    }
    # The readiness probe's redis-cli authenticates from the environment.
    assert names.index("REDISCLI_AUTH") > names.index("REDIS_PASSWORD")
    assert _env(container)["REDISCLI_AUTH"] == "$(REDIS_PASSWORD)"
    assert "redis-cli" in " ".join(container["readinessProbe"]["exec"]["command"])
    # requirepass comes on stdin ("-", last), never as an argument anyone can see in ps.
    argv = _argv(container)
    assert argv[:2] == ["sh", "-c"]
    script = argv[2]
    assert "requirepass $REDIS_PASSWORD" in script
    assert "--requirepass" not in script


def _run_redis_start(tmp_path: Path, password: str) -> subprocess.CompletedProcess:
    """The Redis container's start script, with an image entrypoint that prints what it was
    given (its arguments, then its stdin) instead of starting Redis."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    entrypoint = bin_dir / "docker-entrypoint.sh"
    entrypoint.write_text('#!/bin/sh\necho "argv: $*"\ncat\n')
    entrypoint.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "REDIS_PASSWORD": password}
    return subprocess.run(
        _argv(_container("StatefulSet", "redis")), env=env, capture_output=True, text=True,
        timeout=10, check=False,
    )  # fmt: skip


def test_redis_start_script_hands_the_password_over_on_stdin(tmp_path):
    password = "0123456789abcdef" * 4  # as `openssl rand -hex 32` makes them
    started = _run_redis_start(tmp_path, password)
    assert started.returncode == 0, started.stderr
    argv_line, stdin = started.stdout.split("\n", 1)
    assert argv_line.startswith("argv: redis-server ") and argv_line.endswith(" -")
    assert password not in argv_line
    assert "--appendonly yes" in argv_line and "--protected-mode yes" in argv_line
    assert stdin == f"requirepass {password}\n"
    # The Secret's placeholder, an empty password or one a URL cannot carry: no Redis.
    _, placeholder = _redis_secret()
    for refused in (placeholder, "", "has/slash", "has space", "a@b"):
        started = _run_redis_start(tmp_path, refused)
        assert started.returncode == 1 and not started.stdout, refused
        assert "REDIS_PASSWORD" in started.stderr


def test_every_fleet_pod_connects_with_the_redis_password(builds):
    """Every container that loads the fleet's settings builds REDIS_URL from the Secret's
    password, defined before it (a $(VAR) expands only variables defined above it)."""
    secret_name, _ = _redis_secret()
    seen: dict[str, set[str]] = {name: set() for name in builds}
    for name, objects in builds.items():
        for workload_id, workload in _workloads(objects).items():
            for container in _containers(workload):
                if {"configMapRef": {"name": "fleet-config"}} not in container.get("envFrom", []):
                    continue
                where = f"{name}: {workload_id}"
                names = [e["name"] for e in container.get("env", [])]
                assert "REDIS_URL" in names and "REDIS_PASSWORD" in names, where
                assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL"), where
                assert _secret_ref(container, "REDIS_PASSWORD") == (
                    secret_name,
                    REDIS_SECRET_KEY,
                ), where
                assert _env(container)["REDIS_URL"] == FLEET_REDIS_URL, where
                seen[name].add(workload_id)
    fleet = {f"Deployment/{n}" for n in ("gateway", "worker", "webhooks", "flower")}
    assert seen["base"] == fleet
    assert seen["controller"] == fleet | {"Deployment/autoscaler"}
    # As a pod gets it: a URL the settings take, with the password masked when shown.
    url = FLEET_REDIS_URL.replace("$(REDIS_PASSWORD)", "0123abcd" * 8)
    settings = Settings(redis_url=url)
    assert settings.shown_redis_url == "redis://:***@redis:6379/0"


def test_keda_authenticates_to_redis_with_the_secrets_password():
    auth = _one(COMPONENT_OBJECTS["keda"], "TriggerAuthentication")
    assert auth["apiVersion"] == "keda.sh/v1alpha1"
    secret_name, _ = _redis_secret()
    assert auth["spec"]["secretTargetRef"] == [
        {"parameter": "password", "name": secret_name, "key": REDIS_SECRET_KEY}
    ]
    for trigger in _triggers().values():
        assert trigger["authenticationRef"] == {"name": auth["metadata"]["name"]}
        assert "password" not in trigger["metadata"]


def test_no_manifest_holds_a_redis_password():
    """The only password is the Secret's placeholder: every Redis URL and password variable
    takes it from the Secret, and nothing passes one on a command line (--requirepass,
    redis-cli -a), where `ps` on the node would show it."""
    _, placeholder = _redis_secret()
    patches = [yaml.safe_load(p["patch"]) for p in _load(VLLM / "kustomization.yaml")[0]["patches"]]
    for obj in [*ALL_OBJECTS, *patches]:
        if isinstance(obj, dict) and obj.get("kind") == "Secret":
            continue
        for text in _strings(obj):
            for url in re.findall(r"rediss?://\S+", text):
                assert urlsplit(url).password in (None, "$(REDIS_PASSWORD)"), url
            assert "--requirepass" not in text and "redis-cli -a" not in text, text
            assert not re.search(r"requirepass (?!\$REDIS_PASSWORD\b)", text), text
    for workload in _workloads(ALL_OBJECTS).values():
        for container in _containers(workload):
            for name, value in _env(container).items():
                if "PASSWORD" in name or name == "REDISCLI_AUTH":
                    assert value in (None, "$(REDIS_PASSWORD)"), f"{container['name']}: {name}"
    text = "".join(p.read_text() for p in K8S.rglob("*.y*ml"))
    assert text.count(f'{REDIS_SECRET_KEY}: "{placeholder}"') == 1


def test_configmap_keys_are_fleet_settings_with_valid_values():
    (config,) = _objects("ConfigMap").values()
    data = config["data"]
    assert all(isinstance(v, str) for v in data.values()), "ConfigMap values must be strings"
    unknown = sorted(k for k in data if k.lower() not in Settings.model_fields)
    assert not unknown, f"not fields of shared.settings.Settings: {unknown}"
    assert all(k == k.upper() for k in data)
    settings = Settings(**{k.lower(): v for k, v in data.items()})
    assert settings.gateway_host == "0.0.0.0"
    assert settings.model
    assert "REDIS_URL" not in data, "it carries the Redis password: each Deployment sets it"
    assert settings.require_api_keys, "a cluster's gateway answers only requests with a key"
    gateway_ports = {p["containerPort"] for p in _container("Deployment", "gateway")["ports"]}
    assert settings.gateway_port in gateway_ports


def test_service_links_cannot_clobber_settings():
    """A Service named X injects X_PORT=tcp://... into pods, and FLOWER_PORT/GATEWAY_PORT are
    integer settings (Flower reads FLOWER_PORT too): the fleet's pods must turn links off."""
    for workload_id, workload in _workloads(ALL_OBJECTS).items():
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


# --- kustomize builds ------------------------------------------------------------------------

# The kustomize features the files here use; the builder below refuses any other.
KUSTOMIZATION_FIELDS = {
    "apiVersion",
    "kind",
    "namespace",
    "labels",
    "resources",
    "components",
    "patches",
}


def _json_patch(obj: dict, ops: list[dict]) -> None:
    """Apply RFC 6902 test, remove, add and replace in place (add to a list inserts at the
    index, or appends for "-"). A failed test fails the build, as it fails kustomize's."""
    for op in ops:
        *parents, last = [
            part.replace("~1", "/").replace("~0", "~") for part in op["path"].split("/")[1:]
        ]
        node = obj
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            key = len(node) if (op["op"], last) == ("add", "-") else int(last)
            size = len(node) + (op["op"] == "add")
            assert 0 <= key < size, f"index out of range at {op['path']}"
        else:
            key = last
            assert op["op"] == "add" or key in node, f"nothing at {op['path']}"
        value = copy.deepcopy(op.get("value"))  # one patch may apply to several objects
        if op["op"] == "test":
            assert node[key] == value, f"JSON patch test failed at {op['path']}: {node[key]!r}"
        elif op["op"] == "remove":
            del node[key]
        elif op["op"] == "add" and isinstance(node, list):
            node.insert(key, value)
        elif op["op"] in ("add", "replace"):
            node[key] = value
        else:
            raise AssertionError(f"the test's builder does not know this JSON patch: {op}")


def _targets(target: dict, obj: dict) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    return all(
        target.get(field) in (None, value)
        for field, value in (
            ("group", group),
            ("version", version),
            ("kind", obj["kind"]),
            ("name", obj["metadata"]["name"]),
            ("namespace", obj["metadata"].get("namespace")),
        )
    )


def _build(directory: Path, accumulated: list[dict] | None = None) -> list[dict]:
    """A small `kustomize build` of `directory` (a Component when `accumulated` is given: the
    objects of the kustomization that lists it). Every listed path must exist."""
    (kustomization,) = _load(directory / "kustomization.yaml")
    kind = kustomization["kind"]
    assert kind == ("Component" if accumulated is not None else "Kustomization"), directory
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{directory}: fields the test's builder does not know: {unknown}"
    objects = copy.deepcopy(accumulated or [])
    for entry in kustomization.get("resources", []):
        path = directory / entry
        assert path.exists(), f"{directory / 'kustomization.yaml'}: {entry} does not exist"
        objects += _build(path) if path.is_dir() else _load(path)
    for entry in kustomization.get("components", []):
        path = directory / entry
        assert (path / "kustomization.yaml").is_file(), f"{directory}: component {entry}"
        objects = _build(path, objects)
    if "namespace" in kustomization:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED_KINDS:
                obj["metadata"]["namespace"] = kustomization["namespace"]
    for entry in kustomization.get("labels", []):
        assert not entry.get("includeSelectors") and not entry.get("includeTemplates")
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(entry["pairs"])
    for patch in kustomization.get("patches", []):
        assert "path" not in patch, "the test's builder knows inline patches only"
        ops = yaml.safe_load(patch["patch"])
        assert isinstance(ops, list), "the test's builder knows JSON 6902 patches only"
        matched = [obj for obj in objects if _targets(patch["target"], obj)]
        assert matched, f"{directory}: patch target {patch['target']} matches nothing"
        for obj in matched:
            _json_patch(obj, ops)
    return objects


def _sorted(objects: list[dict]) -> list[dict]:
    return sorted(
        objects,
        key=lambda o: (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]),
    )


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.fixture(scope="module")
def overlays(tmp_path_factory) -> dict[str, Path]:
    """The overlays of OVERLAYS, as k8s/README.md tells users to write them. They must live
    outside k8s/ (kustomize refuses an overlay inside its base's directory)."""
    root = tmp_path_factory.mktemp("overlays")
    made = {"base": K8S}
    for name, components in OVERLAYS.items():
        if not components:
            continue
        directory = root / name
        directory.mkdir()
        kustomization = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [os.path.relpath(K8S, directory)],
            "components": [os.path.relpath(component, directory) for component in components],
        }
        (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
        made[name] = directory
    return made


@pytest.fixture(scope="module")
def builds(overlays) -> dict[str, list[dict]]:
    return {name: _sorted(_build(directory)) for name, directory in overlays.items()}


def test_autoscaling_is_optional_components_outside_the_base():
    listed = [*KUSTOMIZATION.get("resources", []), *KUSTOMIZATION.get("components", [])]
    for path in COMPONENTS.values():
        (kustomization,) = _load(path / "kustomization.yaml")
        assert kustomization["kind"] == "Component"
        assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
        assert not any(path.name in Path(entry).parts for entry in listed), path.name


@pytest.mark.parametrize("name", OVERLAYS)
def test_kustomization_builds(name, overlays, builds):
    objects = builds[name]
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {(o["kind"], o["metadata"]["name"]) for o in OBJECTS} <= names
    for component, path in COMPONENTS.items():
        own = {(o["kind"], o["metadata"]["name"]) for o in COMPONENT_OBJECTS[component]}
        if path in OVERLAYS[name]:
            assert own <= names, component
        else:
            assert not names & own, f"{component} pulled in without being listed"
    for obj in objects:
        labels = obj["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/part-of") == NAMESPACE, obj["metadata"]["name"]
    command = _kustomize_command()
    if command is None:
        return  # no kustomize binary here: the builder above stands in for it
    built = subprocess.run(
        [*command, str(overlays[name])], capture_output=True, text=True, timeout=60, check=False
    )
    assert built.returncode == 0, built.stderr
    assert _sorted([d for d in yaml.safe_load_all(built.stdout) if d]) == objects


@pytest.mark.parametrize("name", ["keda", "controller", "vllm+keda", "vllm+controller"])
def test_autoscaled_workers_have_no_fixed_replica_count(name, builds):
    """With `replicas` in the manifest every `kubectl apply` would reset the workers to it."""
    assert "replicas" not in _one(builds[name], "Deployment", "worker")["spec"]
    assert "replicas" in _one(builds["base"], "Deployment", "worker")["spec"]


def _validate(obj: dict) -> None:
    try:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        error = f"at {'.'.join(str(p) for p in exc.path)}: {exc.message} (Kubernetes {exc.version})"
    else:
        return
    pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} {error}")  # outside the except: short


def test_every_manifest_validates_against_the_kubernetes_schemas(builds):
    """Strict: an unknown or misspelt field, a wrong type or a missing required field fails."""
    shipped = kubernetes_validate.utils.all_versions()
    assert any(v.startswith(f"{KUBERNETES_VERSION}.") for v in shipped), shipped
    seen, crds = set(), set()
    for obj in [*ALL_OBJECTS, *(o for objects in builds.values() for o in objects)]:
        if obj["kind"] in CRD_KINDS:
            crds.add(obj["kind"])
            continue
        key = json.dumps(obj, sort_keys=True)
        if key not in seen:
            seen.add(key)
            _validate(obj)
    assert crds == CRD_KINDS


# --- KEDA --------------------------------------------------------------------------------------


def _scaled_object() -> dict:
    return _one(COMPONENT_OBJECTS["keda"], "ScaledObject")


def _triggers() -> dict[Lane, dict]:
    """The ScaledObject's triggers by lane: one on each lane's stream (configmap.yaml's
    KEY_PREFIX and model)."""
    (config,) = _objects("ConfigMap").values()
    settings = Settings(**{k.lower(): v for k, v in config["data"].items()})
    keys = Keys(settings.key_prefix)
    lanes = {keys.stream(settings.served_model, lane): lane for lane in LANES}
    triggers = _scaled_object()["spec"]["triggers"]
    streams = [t["metadata"]["stream"] for t in triggers]
    assert sorted(streams) == sorted(lanes), "one trigger on each lane's stream"
    return {lanes[t["metadata"]["stream"]]: t for t in triggers}


def _controller_env() -> dict[str, str]:
    (container,) = _one(COMPONENT_OBJECTS["controller"], "Deployment")["spec"]["template"]["spec"][
        "containers"
    ]
    return _env(container)


def test_scaled_object_scales_the_worker_deployment_on_stream_lag():
    scaled = _scaled_object()
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    assert target["name"] == "worker" and "worker" in _objects("Deployment")
    assert target.get("kind", "Deployment") == "Deployment"
    assert target.get("apiVersion", "apps/v1") == "apps/v1"
    for field in ("minReplicaCount", "maxReplicaCount", "cooldownPeriod", "pollingInterval"):
        assert isinstance(spec[field], int) and spec[field] >= 0, field
    assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    assert spec["maxReplicaCount"] >= 1
    for trigger in _triggers().values():
        assert trigger["type"] == "redis-streams"
        meta = trigger["metadata"]
        assert all(isinstance(v, str) for v in meta.values()), "trigger metadata values: strings"
        # Lag mode: consumerGroup and lagCount set, no other mode's threshold.
        assert meta["consumerGroup"] == CONSUMER_GROUP
        assert int(meta["lagCount"]) >= 1
        assert int(meta["activationLagCount"]) >= 0
        assert not {"pendingEntriesCount", "streamLength"} & meta.keys()
    # Both lanes alike: queued batch work adds workers, and wakes one from zero, as jobs do.
    interactive, batch = (_triggers()[lane]["metadata"] for lane in (Lane.INTERACTIVE, Lane.BATCH))
    assert {k: v for k, v in batch.items() if k != "stream"} == {
        k: v for k, v in interactive.items() if k != "stream"
    }


def test_scaled_object_reads_the_stream_the_gateway_writes():
    (config,) = _objects("ConfigMap").values()
    settings = Settings(**{k.lower(): v for k, v in config["data"].items()})
    triggers = _triggers()
    assert triggers[Lane.INTERACTIVE]["metadata"]["stream"] == (
        f"fleet:{{{settings.served_model}}}:stream"
    )
    assert triggers[Lane.BATCH]["metadata"]["stream"] == (
        f"fleet:{{{settings.served_model}}}:batch-stream"
    )
    meta = triggers[Lane.INTERACTIVE]["metadata"]
    # The Redis of REDIS_URL, reached from KEDA's own namespace: a Service of the fleet's
    # namespace by its namespaced name, any other host as it is.
    url = urlsplit(_fleet_redis_url())
    assert int(meta.get("databaseIndex", "0")) == int(url.path.strip("/") or 0)
    if "address" in meta:
        host, port = meta["address"].rsplit(":", 1)
    else:
        host, port = meta["host"], meta["port"]
    assert int(port) == (url.port or 6379)
    if url.hostname in _objects("Service"):
        assert host.split(".")[:2] == [url.hostname, NAMESPACE], host
        service = _objects("Service")[url.hostname]
        assert int(port) in {p["port"] for p in service["spec"]["ports"]}
    else:
        assert host == url.hostname
    # Lag (XINFO GROUPS) needs Redis 7.
    image = _container("StatefulSet", "redis")["image"]
    assert int(image.split(":")[1].split(".")[0]) >= 7


def test_scaled_object_scales_up_at_once_and_down_slowly():
    spec = _scaled_object()["spec"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    # KEDA hands the behavior to its HorizontalPodAutoscaler: it must be a valid one.
    _validate(
        {
            "apiVersion": "autoscaling/v2",
            "kind": "HorizontalPodAutoscaler",
            "metadata": {"name": "keda-hpa-worker", "namespace": NAMESPACE},
            "spec": {
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "worker"},
                "minReplicas": max(1, spec["minReplicaCount"]),
                "maxReplicas": spec["maxReplicaCount"],
                "behavior": behavior,
            },
        }
    )
    for direction in ("scaleUp", "scaleDown"):  # the schema has no enum for these
        assert {p["type"] for p in behavior[direction]["policies"]} <= {"Pods", "Percent"}
        assert behavior[direction].get("selectPolicy", "Max") in {"Max", "Min", "Disabled"}
    assert behavior["scaleUp"].get("stabilizationWindowSeconds", 0) == 0
    down = behavior["scaleDown"]["stabilizationWindowSeconds"]
    assert down >= 60
    assert down == int(_controller_env()["SCALE_DOWN_COOLDOWN_S"])


def test_keda_and_the_controller_scale_by_the_same_numbers():
    spec = _scaled_object()["spec"]
    env = _controller_env()
    for lane, trigger in _triggers().items():
        assert int(trigger["metadata"]["lagCount"]) == int(env["TARGET_BACKLOG_PER_WORKER"])
        assert trigger["name"] == lane.value
    # Both lanes' lags are added up, as the controller adds up both backlogs.
    modifiers = spec["advanced"]["scalingModifiers"]
    assert modifiers["formula"] == "interactive + batch"
    assert int(modifiers["target"]) == int(env["TARGET_BACKLOG_PER_WORKER"])
    assert modifiers["metricType"] == "AverageValue"
    meta = _triggers()[Lane.INTERACTIVE]["metadata"]
    assert spec["minReplicaCount"] == int(env["MIN_WORKERS"])
    assert spec["maxReplicaCount"] == int(env["MAX_WORKERS"])
    assert spec["cooldownPeriod"] == int(env["SCALE_DOWN_COOLDOWN_S"])
    assert spec["pollingInterval"] == int(env["AUTOSCALER_INTERVAL_S"])
    # desired = clamp(ceil(backlog / target), min, max), e.g. 20 waiting jobs -> 3 workers.
    target, low, high = int(meta["lagCount"]), spec["minReplicaCount"], spec["maxReplicaCount"]
    assert min(max(math.ceil(20 / target), low), high) == min(max(3, low), high)


# --- the controller ------------------------------------------------------------------------------


def test_controller_runs_the_fleet_autoscaler_alone_in_kubernetes_mode():
    objects = COMPONENT_OBJECTS["controller"]
    deployment = _one(objects, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 1
    assert spec["strategy"]["type"] == "Recreate"
    pod = spec["template"]["spec"]
    assert pod["enableServiceLinks"] is False
    assert pod.get("automountServiceAccountToken", True) is True
    assert pod["serviceAccountName"] == _one(objects, "ServiceAccount")["metadata"]["name"]
    (container,) = pod["containers"]
    assert _argv(container) == ["python", "-m", "fleet.autoscaler"]
    assert container["image"] == _container("Deployment", "worker")["image"]
    assert {"configMapRef": {"name": "fleet-config"}} in container["envFrom"]
    env = _env(container)
    assert env["AUTOSCALER_MODE"] == "kubernetes"
    assert env["AUTOSCALER_DEPLOYMENT"] in _objects("Deployment")
    namespace = {e["name"]: e for e in container["env"]}.get("AUTOSCALER_NAMESPACE")
    if namespace is not None:
        assert namespace["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    low, high = int(env["MIN_WORKERS"]), int(env["MAX_WORKERS"])
    assert 0 <= low <= high and high >= 1
    assert int(env["TARGET_BACKLOG_PER_WORKER"]) >= 1
    assert float(env["SCALE_DOWN_COOLDOWN_S"]) >= 0 and float(env["AUTOSCALER_INTERVAL_S"]) > 0
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == 9500
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}


def test_controller_role_may_patch_the_worker_scale_and_nothing_more():
    objects = COMPONENT_OBJECTS["controller"]
    role = _one(objects, "Role")
    binding = _one(objects, "RoleBinding")
    account = _one(objects, "ServiceAccount")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert {
        "kind": "ServiceAccount",
        "name": account["metadata"]["name"],
        "namespace": NAMESPACE,
    } in binding["subjects"]
    deployment = _controller_env()["AUTOSCALER_DEPLOYMENT"]

    def verbs(resource: str) -> set[str]:
        return {
            verb
            for rule in role["rules"]
            if "apps" in rule["apiGroups"] and resource in rule["resources"]
            if deployment in rule.get("resourceNames", [deployment])
            for verb in rule["verbs"]
        }

    assert {"get", "patch", "update"} <= verbs("deployments/scale")
    assert "get" in verbs("deployments")
    granted = {verb for rule in role["rules"] for verb in rule["verbs"]}
    assert granted <= {"get", "list", "watch", "patch", "update"}, "no create or delete"
    assert all("*" not in rule["resources"] + rule["verbs"] for rule in role["rules"])


# --- the vLLM worker variant -----------------------------------------------------------------

VLLM_BUILDS = [name for name, components in OVERLAYS.items() if VLLM in components]
# Environment variables of the worker that are not fleet settings (read by libraries).
LIBRARY_ENV = {"HF_HOME", "VLLM_CACHE_ROOT"}
QUANTITY_UNITS = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def _quantity(value: str | int) -> int:
    """A Kubernetes memory quantity in bytes (the binary suffixes used here)."""
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)?", str(value)).groups()
    return int(number) * QUANTITY_UNITS[unit or ""]


def _without_vllm(name: str) -> str:
    """The overlay that differs from `name` by the vLLM variant only."""
    return name.removeprefix("vllm").removeprefix("+") or "base"


def _worker(objects: list[dict]) -> tuple[dict, dict]:
    """The worker Deployment's pod spec and its container."""
    pod = _one(objects, "Deployment", "worker")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def test_vllm_variant_is_an_optional_component_outside_the_base():
    (kustomization,) = _load(VLLM / "kustomization.yaml")
    assert kustomization["kind"] == "Component"
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    assert "resources" not in kustomization, "the variant patches the base's worker, adds nothing"
    listed = [*KUSTOMIZATION.get("resources", []), *KUSTOMIZATION.get("components", [])]
    assert not any(VLLM.name in Path(entry).parts for entry in listed)


@pytest.mark.parametrize("name", VLLM_BUILDS)
def test_vllm_variant_changes_the_worker_deployment_only(name, builds):
    """Same objects as without it, the gateway and the autoscaler on the fleet's image; the
    worker keeps its name, command, heartbeat probes, drain hook and scheduling."""
    vllm, plain = builds[name], builds[_without_vllm(name)]

    def rest(objects: list[dict]) -> list[dict]:
        return [
            o for o in objects if (o["kind"], o["metadata"]["name"]) != ("Deployment", "worker")
        ]

    assert rest(vllm) == rest(plain)
    with_vllm, without = (_one(b, "Deployment", "worker") for b in (vllm, plain))
    assert with_vllm["metadata"] == without["metadata"]
    assert with_vllm["spec"].get("replicas") == without["spec"].get("replicas")
    assert with_vllm["spec"]["selector"] == without["spec"]["selector"]
    assert with_vllm["spec"]["template"]["metadata"] == without["spec"]["template"]["metadata"]
    (pod, container), (plain_pod, plain_container) = _worker(vllm), _worker(plain)
    for field in ("terminationGracePeriodSeconds", "tolerations", "enableServiceLinks"):
        assert pod.get(field) == plain_pod.get(field), field
    for field in ("name", "command", "args", "envFrom", "ports", "lifecycle"):
        assert container.get(field) == plain_container.get(field), field
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe] == plain_container[probe], probe
    assert container["startupProbe"]["exec"] == plain_container["startupProbe"]["exec"]


def test_vllm_worker_runs_the_vllm_image_with_engine_vllm(builds):
    _, container = _worker(builds["vllm"])
    assert container["image"].rsplit(":", 1)[0] == "inference-fleet-vllm"
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names)), "an env var set twice (the last one would win)"
    env = _env(container)
    assert env["ENGINE"] == "vllm"
    assert env["DEVICE"] == "cuda"  # never vLLM on the CPU of a GPU-less node
    # Its settings as the worker reads them: the ConfigMap, overridden by the container's
    # own env (a literal value), are fleet settings with valid values.
    literal = {k: v for k, v in env.items() if v is not None}
    unknown = sorted(k for k in literal if k.lower() not in Settings.model_fields)
    assert set(unknown) <= LIBRARY_ENV, f"not fleet settings: {unknown}"
    (config,) = _objects("ConfigMap").values()
    values = {**config["data"], **{k: v for k, v in literal.items() if k not in LIBRARY_ENV}}
    settings = Settings(**{k.lower(): v for k, v in values.items()})
    assert settings.engine == "vllm"
    assert 0 < settings.vllm_gpu_memory_utilization <= 1
    # Continuous batching runs more sequences at once than a transformers micro-batch.
    plain = Settings(**{k.lower(): v for k, v in config["data"].items()})
    assert settings.max_batch_size >= plain.max_batch_size
    # The base (the transformers image) does not ask for vLLM.
    assert _env(_worker(builds["base"])[1]).get("ENGINE") in (None, "auto", "transformers")


def test_vllm_worker_gets_one_whole_gpu_and_shared_memory(builds):
    pod, container = _worker(builds["vllm"])
    resources = container["resources"]
    for part in ("requests", "limits"):  # stated by the variant, whatever the base asks
        assert int(resources[part]["nvidia.com/gpu"]) == 1, part
        assert resources[part]["cpu"] and resources[part]["memory"], part
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    shm = volumes[mounts["/dev/shm"]]["emptyDir"]
    assert shm["medium"] == "Memory"
    # Bigger than a container's default 64Mi; memory-backed, so within the memory limit.
    size = _quantity(shm["sizeLimit"])
    assert 64 * 2**20 < size < _quantity(resources["limits"]["memory"])
    # vLLM's compile cache and the hub cache on the scratch volume, kept across restarts.
    env = _env(container)
    (cache,) = [
        path for path, name in mounts.items() if "emptyDir" in volumes[name] and path != "/dev/shm"
    ]
    for var in ("VLLM_CACHE_ROOT", "HF_HOME"):
        assert env[var].startswith(cache + "/"), var


def test_vllm_worker_has_time_to_compile_and_load_its_model(builds):
    def allowed_s(objects: list[dict]) -> int:
        probe = _worker(objects)[1]["startupProbe"]
        return probe["periodSeconds"] * probe["failureThreshold"]

    assert allowed_s(builds["vllm"]) >= max(allowed_s(builds["base"]), 30 * 60)


@pytest.mark.parametrize("name", ["vllm+keda", "vllm+controller"])
def test_autoscalers_scale_the_vllm_workers(name, builds):
    objects = builds[name]
    if name.endswith("keda"):
        target = _one(objects, "ScaledObject")["spec"]["scaleTargetRef"]
        assert target.get("kind", "Deployment") == "Deployment"
        deployment = target["name"]
    else:
        (container,) = _one(objects, "Deployment", "autoscaler")["spec"]["template"]["spec"][
            "containers"
        ]
        deployment = _env(container)["AUTOSCALER_DEPLOYMENT"]
        assert any(
            deployment in rule.get("resourceNames", []) for rule in _one(objects, "Role")["rules"]
        )
    scaled = _one(objects, "Deployment", deployment)
    (container,) = scaled["spec"]["template"]["spec"]["containers"]
    assert _env(container)["ENGINE"] == "vllm"
    assert container["image"].startswith("inference-fleet-vllm:")
    assert "replicas" not in scaled["spec"]


# --- image recipes (docker/) -------------------------------------------------------------------


def _recipe_images(builds: dict[str, list[dict]]) -> set[str]:
    """The fleet's own images the manifests name (not redis)."""
    return {
        container["image"].rsplit(":", 1)[0]
        for objects in builds.values()
        for workload in _workloads(objects).values()
        for container in _containers(workload)
        if container["image"].startswith("inference-fleet")
    }


def _requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def test_every_fleet_image_has_a_recipe_whose_sources_exist(builds):
    images = _recipe_images(builds)
    assert images == {"inference-fleet", "inference-fleet-vllm"}
    for image in sorted(images):
        recipe = DOCKER / f"{image}.Dockerfile"
        assert recipe.is_file(), f"no recipe for the image {image}"
        text = recipe.read_text().replace("\\\n", " ")
        copies = re.findall(r"^COPY\s+(?!--)(.+)$", text, flags=re.MULTILINE)
        assert copies, recipe.name
        for line in copies:
            *sources, _destination = line.split()
            for source in sources:
                assert source == "." or (ROOT / source).exists(), f"{recipe.name}: {source}"
        # Requirements files pull others in with -r: those must be copied too.
        copied = {source for line in copies for source in line.split()[:-1]}
        for requirements in (s for s in copied if s.startswith("requirements")):
            for line in _requirement_lines(ROOT / requirements):
                if line.startswith("-r "):
                    assert "." in copied or line[3:].strip() in copied, f"{recipe.name}: {line}"


def test_vllm_image_is_vllms_own_image_of_the_pinned_version():
    text = (DOCKER / "inference-fleet-vllm.Dockerfile").read_text()
    (version,) = re.findall(r"^ARG VLLM_VERSION=(\S+)$", text, flags=re.MULTILINE)
    assert re.search(r"^FROM vllm/vllm-openai:v\$\{VLLM_VERSION\}$", text, flags=re.MULTILINE)
    assert f"vllm=={version}" in _requirement_lines(ROOT / "requirements-vllm.txt")
    assert "-r requirements-vllm.txt" in text
    # vLLM's image starts `vllm serve`: the worker image must not.
    assert re.search(r"^ENTRYPOINT \[\]$", text, flags=re.MULTILINE)


def test_vllm_image_holds_every_package_the_worker_imports():
    """The vLLM image copies only the packages a worker needs: every first-party module that
    they import must be among them."""
    text = (DOCKER / "inference-fleet-vllm.Dockerfile").read_text()
    copied = {Path(s).parts[0] for s in re.findall(r"^COPY\s+(\w+)/\s", text, flags=re.MULTILINE)}
    assert "workers" in copied and "shared" in copied
    first_party = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    imported = set()
    for package in copied:
        for source in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text(), str(source))):
                if isinstance(node, ast.Import):
                    imported |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    imported.add(node.module.split(".")[0])
    missing = sorted((imported & first_party) - copied)
    assert not missing, f"the worker imports packages the vLLM image lacks: {missing}"
