"""`cbserve gateway`: its flags, the checks of its public port's TLS files and keys, and its run; and
the flags `cbserve up` passes on to its gateway."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from services.common.cli_args import DEFAULT_WORKER_ADDRESS, PORT, add_env_argument, bounded

if TYPE_CHECKING:
    from services.gateway.security import Access, TlsFiles
    from services.gateway.settings import GatewaySettings


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    add_env_argument(parser, "--host", default="127.0.0.1", help="gRPC and metrics listen address")
    add_env_argument(parser, "--port", type=PORT, default=50051, help="gRPC port")
    add_env_argument(
        parser,
        "--metrics-port",
        type=PORT,
        default=9090,
        help="HTTP port of Prometheus' /metrics and a plain /health (0: off)",
    )
    add_env_argument(
        parser,
        "--served-model-name",
        help="the model's name in GetModelInfo and metrics (default: the model directory's name)",
    )
    add_env_argument(
        parser,
        "--max-queue-size",
        type=bounded(int, 1),
        default=1024,
        help="streams waiting for their first token before RESOURCE_EXHAUSTED",
    )
    add_env_argument(
        parser,
        "--drain-grace",
        type=bounded(float, 0),
        default=30.0,
        help="seconds in-flight streams may take to finish after SIGTERM",
    )
    add_env_argument(
        parser,
        "--default-max-tokens",
        type=bounded(int, 1),
        default=256,
        help="max_tokens of requests that set none",
    )
    add_env_argument(
        parser, "--max-stop-strings", type=bounded(int, 0), default=16, help="stop strings per request"
    )
    add_env_argument(
        parser,
        "--max-n",
        type=bounded(int, 1),
        default=16,
        help="choices one request may ask for (sampling n); more is INVALID_ARGUMENT",
    )
    add_env_argument(
        parser, "--max-message-bytes", type=bounded(int, 1), default=16 << 20, help="gRPC message limit"
    )
    add_env_argument(
        parser,
        "--max-concurrent-streams",
        type=bounded(int, 1),
        default=1024,
        help="concurrent streams per HTTP/2 connection",
    )
    add_env_argument(
        parser,
        "--keepalive-time",
        type=bounded(float, 0, strict=True),
        default=30.0,
        help="seconds between pings",
    )
    add_env_argument(
        parser,
        "--worker-timeout",
        type=bounded(float, 0, strict=True),
        default=10.0,
        help="seconds without a worker status before it is presumed dead",
    )
    add_env_argument(
        parser,
        "--resubmit-timeout",
        type=bounded(float, 0),
        default=60.0,
        help="seconds streams of a lost worker wait for a new one",
    )
    add_env_argument(
        parser,
        "--ready-file",
        help="a file that exists while the gateway serves, for "
        "`cbserve health --ready-file` (containers' health checks)",
    )
    add_env_argument(
        parser,
        "--announce-http",
        metavar="URL",
        help="the OpenAI HTTP endpoint in front of this gateway: the `serving` line waits "
        "until its /v1/models lists the model, and names it",
    )

    access = parser.add_argument_group("the public port's security (docs/deployment.md)")
    add_env_argument(access, "--tls-cert", help="PEM certificate (chain): the gRPC port speaks TLS")
    add_env_argument(access, "--tls-key", help="PEM private key of --tls-cert")
    add_env_argument(
        access,
        "--tls-client-ca",
        help="PEM CA certificates: clients must present a certificate they issued (mutual TLS)",
    )
    access.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        metavar="KEY",
        help="an API key callers present as `authorization: Bearer KEY` (repeatable; "
        "a command line shows in `ps`: prefer the variable or the file) "
        "[CBSERVE_API_KEYS, comma-separated]",
    )
    add_env_argument(access, "--api-key-file", help="a file of API keys, one a line (# starts a comment)")
    add_env_argument(
        access, "--open-health", type=bool, default=True, help="grpc.health.v1 answers callers without a key"
    )
    add_env_argument(
        access,
        "--open-reflection",
        type=bool,
        default=True,
        help="server reflection answers callers without a key",
    )
    add_env_argument(
        access,
        "--max-streams-per-key",
        type=bounded(int, 0),
        default=0,
        help="Generate streams one API key may hold open, beyond which it gets "
        "RESOURCE_EXHAUSTED (0: no limit)",
    )
    add_env_argument(
        access,
        "--health-port",
        type=PORT,
        default=0,
        help="a plaintext port serving grpc.health.v1 alone, for probes that do no TLS (0: off)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_env_argument(parser, "--model", help="local model directory (default: the embedded SmolLM2-135M)")
    add_env_argument(parser, "--worker-address", default=DEFAULT_WORKER_ADDRESS, help="worker to connect to")
    add_gateway_arguments(parser)


def public_port(args: argparse.Namespace) -> tuple[TlsFiles | None, Access]:
    """The gateway's TLS files and who may call it, checked: a usage error if they cannot work."""
    import os
    from pathlib import Path

    from services.common.cli_args import env_name, usage_error
    from services.gateway.security import Access, ApiKeys, ConfigError, TlsFiles, read_key_file, split_keys

    try:
        tls = None
        if args.tls_cert or args.tls_key:
            if not (args.tls_cert and args.tls_key):
                raise ConfigError("--tls-cert and --tls-key go together")
            client_ca = Path(args.tls_client_ca) if args.tls_client_ca else None
            tls = TlsFiles(Path(args.tls_cert), Path(args.tls_key), client_ca)
            tls.check()
        elif args.tls_client_ca:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key")
        # --api-key flags replace CBSERVE_API_KEYS, as every flag replaces its variable.
        given = args.api_keys
        if given is None:
            given = split_keys(os.environ.get(env_name("api_keys"), ""))
        if args.api_key_file:
            given = [*given, *read_key_file(Path(args.api_key_file))]
        keys = ApiKeys(given) if given else None
        return tls, Access(keys, args.open_health, args.open_reflection, args.max_streams_per_key)
    except ConfigError as exc:
        raise usage_error(str(exc)) from None


def gateway_settings(args: argparse.Namespace) -> GatewaySettings:
    from pathlib import Path

    from services.gateway.inputs import Limits
    from services.gateway.settings import GatewaySettings

    tls, access = public_port(args)
    return GatewaySettings(
        max_queue_size=args.max_queue_size,
        drain_grace_s=args.drain_grace,
        max_message_bytes=args.max_message_bytes,
        max_concurrent_streams=args.max_concurrent_streams,
        keepalive_time_s=args.keepalive_time,
        worker_timeout_s=args.worker_timeout,
        resubmit_timeout_s=args.resubmit_timeout,
        limits=Limits(
            default_max_tokens=args.default_max_tokens,
            max_stop_strings=args.max_stop_strings,
            max_n=args.max_n,
        ),
        tls=tls,
        access=access,
        health_port=args.health_port or None,
        served_model_name=args.served_model_name,
        ready_path=Path(args.ready_file) if args.ready_file else None,
        http_url=args.announce_http,
    )


def run(args: argparse.Namespace) -> int:
    import asyncio

    from services.common.cli_args import model_dir
    from services.gateway.server import serve

    settings = gateway_settings(args)
    metrics_port = args.metrics_port or None
    model_dir(args.model)  # refused here if bad
    asyncio.run(serve(args.model, args.worker_address, args.host, args.port, metrics_port, settings))
    return 0
