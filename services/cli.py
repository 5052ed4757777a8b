"""The `cbserve` command line: argparse subcommands, each dispatching to a handler that returns an exit code.

Invariants:
- This module imports no heavy dependency itself; a handler imports what it needs when it runs.
  (Registering `bench offline` imports `services.bench.offline`, so its import cost counts here.)
- A missing or broken optional subcommand module (`services.bench.offline`) never breaks the others;
  invoking that subcommand reports why it is unavailable and exits 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]


def _prepare_model(args: argparse.Namespace) -> int:
    from services.common.model_source import prepare_default_model

    print(prepare_default_model(force=args.force))
    return 0


def _add_bench_offline(bench: argparse._SubParsersAction) -> None:
    parser = bench.add_parser("offline", help="offline throughput benchmark (no server processes)")
    try:
        from services.bench import offline
    except ImportError as exc:
        reason = str(exc)

        def unavailable(args: argparse.Namespace) -> int:
            print(f"cbserve bench offline is unavailable: {reason}", file=sys.stderr)
            return 2

        # Any arguments are accepted so the user sees the real cause, not a usage error.
        parser.set_defaults(handler=unavailable, accepts_unknown_args=True)
        return
    offline.add_arguments(parser)
    parser.set_defaults(handler=offline.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cbserve", description="Continuous-batching LLM inference server.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    prepare = commands.add_parser(
        "prepare-model",
        help="convert the embedded SmolLM2 GGUF model once and print its directory",
    )
    prepare.add_argument("--force", action="store_true", help="convert again even if a conversion exists")
    prepare.set_defaults(handler=_prepare_model)

    bench = commands.add_parser("bench", help="benchmarks")
    _add_bench_offline(bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv[1:]), run the chosen subcommand and return its exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_unknown_args", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler: Handler = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
