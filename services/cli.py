"""The `cbserve` command line: argparse subcommands, each a handler returning an exit code.

Handlers import what they need when they run, so `cbserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]


def _prepare_model(args: argparse.Namespace) -> int:
    from services.common.model_source import prepare_default_model

    print(prepare_default_model(force=args.force))
    return 0


def _bench_offline(args: argparse.Namespace) -> int:
    from services.bench import offline

    return offline.run(args)


def _chat(args: argparse.Namespace) -> int:
    from services.worker.chat import chat_loop

    return chat_loop(args.model, args.max_new_tokens, args.temperature)


def build_parser() -> argparse.ArgumentParser:
    from services.bench.arguments import add_offline_arguments

    parser = argparse.ArgumentParser(prog="cbserve", description="Continuous-batching LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    prepare = commands.add_parser(
        "prepare-model", help="convert the embedded SmolLM2 GGUF model once and print its directory"
    )
    prepare.add_argument("--force", action="store_true", help="convert again even if a conversion exists")
    prepare.set_defaults(handler=_prepare_model)

    chat = commands.add_parser("chat", help="chat with a model through the in-process engine (stdin/stdout)")
    chat.add_argument("--model", default=None, help="local model directory (default: embedded SmolLM2)")
    chat.add_argument("--max-new-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.set_defaults(handler=_chat)

    bench = commands.add_parser("bench", help="benchmarks")
    benchmarks = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    offline = benchmarks.add_parser("offline", help="offline throughput: engine vs transformers, same run")
    add_offline_arguments(offline)
    offline.set_defaults(handler=_bench_offline)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]), run the chosen subcommand and return its exit status."""
    args = build_parser().parse_args(argv)
    from services.common.logging import configure_logging

    configure_logging(json=not sys.stderr.isatty())
    handler: Handler = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
