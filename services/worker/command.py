"""`cbserve worker`, `cbserve chat` and `cbserve prepare-kernels`: their flags and their runs; and the
flags `cbserve up` passes on to its worker."""

from __future__ import annotations

import argparse

from services.common.cli_args import (
    DEFAULT_CACHEMGR_ADDRESS,
    DEFAULT_WORKER_ADDRESS,
    add_cb_arguments,
    add_env_argument,
    add_max_tokens,
    add_model_arguments,
    bounded,
    model_dir,
    served_precision,
    usage_error,
)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker's own settings, which `cbserve up` takes too."""
    add_env_argument(
        parser, "--threads", type=bounded(int, 1), help="worker torch threads (default: usable cores)"
    )
    add_env_argument(
        parser,
        "--cachemgr-timeout",
        type=bounded(float, 0, strict=True),
        default=10.0,
        help="seconds to wait for the cachemgr's answer before failing requests",
    )
    add_env_argument(
        parser,
        "--gateway-timeout",
        type=bounded(float, 0, strict=True),
        default=15.0,
        help="seconds of gateway silence before its requests are aborted",
    )
    add_env_argument(
        parser,
        "--grammar-compile-timeout-s",
        type=bounded(float, 0, strict=True),
        default=10.0,
        help="seconds a constraint (structured output) may take to compile before its request fails "
        "with INVALID_ARGUMENT",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    add_env_argument(
        parser, "--worker-address", default=DEFAULT_WORKER_ADDRESS, help="ZMQ bind address for gateways"
    )
    add_env_argument(parser, "--cachemgr-address", default=DEFAULT_CACHEMGR_ADDRESS, help="cachemgr address")
    add_env_argument(
        parser,
        "--ready-file",
        help="a file that exists while the worker is attached and warm, "
        "for `cbserve health --ready-file` (containers' health checks)",
    )
    add_worker_arguments(parser)
    add_cb_arguments(parser)


def check_gemm_crossover() -> None:
    """A bad CBSERVE_GEMM_CROSSOVER is a usage error at start, not a worker failing on first use."""
    from services.worker import gemm_crossover

    try:
        gemm_crossover.pinned()
    except ValueError as exc:
        raise usage_error(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from services.worker.server import run_worker

    check_gemm_crossover()
    model = model_dir(args.model)
    config, dtype = served_precision(args, model)
    return run_worker(
        model,
        args.worker_address,
        args.cachemgr_address,
        config,
        args.device,
        dtype,
        threads=args.threads,
        cachemgr_timeout_s=args.cachemgr_timeout,
        gateway_timeout_s=args.gateway_timeout,
        grammar_compile_timeout_s=args.grammar_compile_timeout_s,
        ready_path=Path(args.ready_file) if args.ready_file else None,
    )


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local model directory (default: embedded SmolLM2)")
    add_max_tokens(parser, 256, "most tokens per answer")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")


def run_chat(args: argparse.Namespace) -> int:
    from services.worker.chat import chat_loop

    return chat_loop(model_dir(args.model), args.max_tokens, args.temperature)


def run_prepare_kernels(args: argparse.Namespace) -> int:
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
