"""The `smg` router in front of this stack's gateway: what `cbserve up --http-port N` adds.

smg (the Shepherd model gateway, PyPI `smg`, installed by the extra `cbserve[router]`) serves the
OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models, /health,
/readiness) and talks to the gateway over gRPC in the SMG worker protocol (gateway/vllm_engine.py).
It tokenizes, renders chat templates and detokenizes itself, from the model directory's tokenizer
files, and sends the gateway token ids. The supervisor runs it as a fourth child.
"""

from __future__ import annotations

import argparse
import ipaddress
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from services.common.cli_args import PORT, add_env_argument

INSTALL_HINT = "pip install 'cbserve[router]'"
# Where smg's own Prometheus metrics go unless told otherwise (its default).
DEFAULT_METRICS_PORT = 29000


class RouterUnavailable(ValueError):
    """Why this stack cannot put smg in front of its gateway."""


def smg_executable() -> str | None:
    """The `smg` console script: the one installed beside this Python (a virtual environment that
    was never activated is not on PATH), else the first on PATH."""
    beside = Path(sys.executable).parent / "smg"
    return str(beside) if beside.is_file() else shutil.which("smg")


def _dialable(host: str) -> str:
    """How a client on this machine reaches a server listening on `host`, as a URL's host part."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host  # a name
    if address.is_unspecified:  # 0.0.0.0 / ::, listening on every interface: loopback is one
        address = ipaddress.ip_address("::1" if address.version == 6 else "127.0.0.1")
    return f"[{address}]" if address.version == 6 else str(address)


def http_url(host: str, port: int) -> str:
    """The URL of smg's OpenAI API when it listens on `host:port`, as a client here dials it."""
    return f"http://{_dialable(host)}:{port}"


def gateway_url(host: str, port: int) -> str:
    """The URL smg dials for a gateway listening on `host:port`."""
    return f"grpc://{_dialable(host)}:{port}"


def smg_command(
    *,
    host: str,
    http_port: int,
    metrics_port: int,
    worker_urls: Sequence[str],
    model_dir: str,
    policy: str = "cache_aware",
) -> list[str]:
    """The command that runs smg on `host:http_port` in front of `worker_urls` (gateways, see
    `gateway_url`); raises RouterUnavailable saying why it cannot."""
    from services.common.model_source import has_tokenizer  # imports torch: not for `cbserve --help`

    smg = smg_executable()
    if smg is None:
        raise RouterUnavailable(f"the smg router is not installed: {INSTALL_HINT}")
    if not has_tokenizer(Path(model_dir)):
        raise RouterUnavailable(f"smg tokenizes requests itself, and {model_dir} holds no tokenizer files")
    return [
        smg,
        "launch",
        "--host",
        host,
        "--port",
        str(http_port),
        "--worker-urls",
        *worker_urls,
        "--model-path",
        model_dir,
        "--policy",
        policy,
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        # smg registers a gateway once it serves; by default it would look again only every 30 s.
        "--worker-startup-check-interval",
        "1",
        # On SIGTERM smg waits half this (at most 5 s) even with no request in flight: a stop of
        # `cbserve up` gives requests over HTTP a second, not a pause on every Ctrl-C.
        "--shutdown-grace-period-secs",
        "1",
        "--log-json",
    ]


def router_argv(
    *,
    host: str,
    http_port: int,
    metrics_port: int,
    gateway_port: int,
    model_dir: str,
    gateway_tls: bool,
    gateway_api_keys: bool,
) -> list[str]:
    """`cbserve up`'s router: smg in front of its own gateway alone. The policy is cache-aware, what
    a fleet wants once more gateways join (smg's POST /workers). Raises RouterUnavailable."""
    if gateway_tls or gateway_api_keys:
        raise RouterUnavailable(
            "smg reaches the gateway over plaintext gRPC without a key; serve without --tls-cert and "
            "API keys, and secure the HTTP port in front of smg"
        )
    return smg_command(
        host=host,
        http_port=http_port,
        metrics_port=metrics_port,
        model_dir=model_dir,
        worker_urls=[gateway_url(host, gateway_port)],
    )


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(f"OpenAI-compatible HTTP through the smg router ({INSTALL_HINT})")
    add_env_argument(
        group,
        "--http-port",
        type=PORT,
        default=0,
        help="serve /v1/chat/completions, /v1/completions and /v1/models on this port: smg runs "
        "in front of the gateway as a fourth child (0: off)",
    )
    add_env_argument(
        group,
        "--router-metrics-port",
        type=PORT,
        default=DEFAULT_METRICS_PORT,
        help="smg's Prometheus port (with --http-port)",
    )
