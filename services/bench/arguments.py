"""Arguments of `cbserve bench offline`, kept apart from the benchmark so `cbserve --help` stays light."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

SYSTEMS = ("engine", "hf-cb", "hf-generate", "hf-static")
DEFAULT_SYSTEMS = "engine,hf-cb,hf-generate"

# Engine settings exposed as flags: (name, type, help). Only those given are passed, so that the
# engine's own defaults (and its memory-based sizing) are what a bare run measures.
ENGINE_FLAGS: tuple[tuple[str, Any, str], ...] = (
    ("page_size", int, "tokens per KV page"),
    ("num_blocks", int, "KV blocks (overrides memory-based sizing)"),
    ("max_batch_tokens", int, "tokens computed per step"),
    ("max_memory_percent", float, "fraction of free memory for the KV cache"),
    ("max_requests_per_batch", int, "rows of logits per step"),
    ("scheduler_type", str, "fifo or prefill_first"),
    ("safety_margin", float, "free-cache fraction below which no prefill is admitted"),
    ("cpu_offload_space", float, "GiB of CPU swap pool (0: soft reset)"),
    ("q_padding_interval_size", int, "query length padding (CUDA graphs)"),
    ("kv_padding_interval_size", int, "KV length padding (CUDA graphs)"),
)
ENGINE_SETTING_NAMES = (*(name for name, _, _ in ENGINE_FLAGS), "allow_block_sharing")


def add_offline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--num-requests", type=int, default=48, help="requests in the W1 workload")
    parser.add_argument("--seed", type=int, default=0, help="W1 seed")
    parser.add_argument(
        "--systems",
        default=DEFAULT_SYSTEMS,
        help=f"comma-separated, run in this order; from {','.join(SYSTEMS)} (default {DEFAULT_SYSTEMS})",
    )
    parser.add_argument(
        "--static-batch", type=int, default=None, metavar="N", help="add hf-static with batches of N"
    )
    parser.add_argument(
        "--repeat", type=int, default=1, metavar="N", help="rounds of all systems in turn; medians reported"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: usable cores)")
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results here")
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare greedy outputs with hf-generate token for token (exit 1 if the engine differs)",
    )
    group = parser.add_argument_group("engine settings (only those given are passed to the engine)")
    for name, kind, help_text in ENGINE_FLAGS:
        flag = "--" + name.replace("_", "-")
        if name == "scheduler_type":
            group.add_argument(flag, choices=("fifo", "prefill_first"), default=None, help=help_text)
        else:
            group.add_argument(flag, type=kind, default=None, help=help_text)
    group.add_argument(
        "--allow-block-sharing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prefix caching",
    )
