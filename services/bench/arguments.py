"""Arguments of `cbserve bench offline`, kept apart from the benchmark so `cbserve --help` stays light."""

from __future__ import annotations

import argparse
from pathlib import Path

from services.common.cli_args import add_cb_arguments, bounded

SYSTEMS = ("engine", "stack", "hf-cb", "hf-generate", "hf-static")
DEFAULT_SYSTEMS = "engine,hf-cb,hf-generate"


def add_offline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument(
        "--num-requests", type=bounded(int, 1), default=48, help="requests in the W1 workload"
    )
    parser.add_argument("--seed", type=int, default=0, help="W1 seed")
    parser.add_argument(
        "--systems",
        default=DEFAULT_SYSTEMS,
        help=f"comma-separated, run in this order; from {','.join(SYSTEMS)} (default {DEFAULT_SYSTEMS})",
    )
    parser.add_argument(
        "--static-batch",
        type=bounded(int, 1),
        default=None,
        metavar="N",
        help="add hf-static with batches of N",
    )
    parser.add_argument(
        "--stack",
        action="store_true",
        help="add the `stack` system: the whole gRPC service (cbserve up) with the same engine settings",
    )
    parser.add_argument(
        "--repeat",
        type=bounded(int, 1),
        default=1,
        metavar="N",
        help="rounds of all systems in turn; medians reported",
    )
    parser.add_argument(
        "--threads", type=bounded(int, 1), default=None, help="torch threads (default: usable cores)"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results here")
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare greedy outputs with hf-generate token for token (exit 1 if the engine differs)",
    )
    add_cb_arguments(parser)
