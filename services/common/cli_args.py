"""Command-line settings shared by every `cbserve` subcommand.

Every continuous-batching setting of `CBConfig` is a kebab-case flag (`--page-size`) and an
environment variable `CBSERVE_<NAME>` (`CBSERVE_PAGE_SIZE`); a flag given on the command line wins.
Unset settings stay None and are not passed, so `CBConfig`'s own defaults apply.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable
from typing import Any

from services.common.config import DEFAULT_SAFETY_MARGIN, KV_CACHE_DTYPES, QUANTIZATIONS, CBConfig

# (name, parser, help) for each CBConfig field; `bool` fields become --x/--no-x switches.
CB_SETTINGS: tuple[tuple[str, Any, str], ...] = (
    ("page_size", int, "tokens per KV page"),
    ("num_blocks", int, "KV blocks (overrides memory-based sizing)"),
    ("max_batch_tokens", int, "tokens computed per step"),
    ("long_prefill_token_threshold", int, "most prompt tokens one request computes per step (0: no cap)"),
    ("kv_cache_space", float, "GiB of KV cache (overrides max_memory_percent)"),
    ("max_memory_percent", float, "fraction of free memory for the KV cache"),
    ("prefault_kv_pool", bool, "commit a host KV pool's memory at start (off: as pages are first written)"),
    (
        "kv_cache_dtype",
        str,
        "KV page dtype: auto (the weights', but float16 beside float32 weights that --dtype auto chose on "
        "a CPU), float32, bfloat16, float16 or int8",
    ),
    ("max_requests_per_batch", int, "rows of logits (sampling requests) per step"),
    ("allow_block_sharing", bool, "prefix caching"),
    ("scheduler_type", str, "fifo or prefill_first"),
    ("quantization", str, "the layers' linears: none, int8 (weights and inputs) or int8-weight-only"),
    ("safety_margin", float, "free-cache fraction below which no prefill is admitted"),
    ("cpu_offload_space", float, "GiB of CPU swap pool (0: offloading falls back to soft reset)"),
    ("q_padding_interval_size", int, "query length padding (CUDA graphs)"),
    ("kv_padding_interval_size", int, "KV length padding (CUDA graphs)"),
    ("use_cuda_graph", bool, "replay CUDA graphs: decode steps whole, others piecewise (CUDA devices only)"),
    ("use_async_batching", bool, "plan and build the next step while the forward runs"),
    ("arrival_gap_ms", float, "with nothing running, gather requests arriving < this many ms apart (0: off)"),
)
CB_SETTING_NAMES = tuple(name for name, _, _ in CB_SETTINGS)
CHOICES: dict[str, list[str]] = {
    "quantization": list(QUANTIZATIONS),
    "scheduler_type": sorted(DEFAULT_SAFETY_MARGIN),
    "kv_cache_dtype": list(KV_CACHE_DTYPES),
}

_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def env_name(dest: str) -> str:
    return "CBSERVE_" + dest.upper()


def parse_bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise ValueError(f"not a boolean: {text!r}")


def bounded(
    kind: Callable[[str], Any], low: float, high: float | None = None, *, strict: bool = False
) -> Callable[[str], Any]:
    """An argparse type: `kind(text)` that is at least `low` (above it when `strict`) and at most
    `high`; otherwise a usage error that names the bound and the value (a port of 99999 used to
    wrap around to 34463, a negative queue size to refuse every request)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "an int" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        too_low = value <= low if strict else value < low
        if too_low or (high is not None and value > high) or value != value:  # NaN equals nothing
            bound = f"> {low}" if strict else f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return value

    return parse


PORT = bounded(int, 0, 65535)


def add_env_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    flag: str,
    *,
    type: Callable[[str], Any] = str,
    default: Any = None,
    help: str = "",
    **kwargs: Any,
) -> None:
    """`parser.add_argument(flag, ...)` whose default comes from `CBSERVE_<DEST>` when that is set."""
    dest = flag.lstrip("-").replace("-", "_")
    env = os.environ.get(env_name(dest))
    if type is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = type
    if env is not None:
        try:
            default = parse_bool(env) if type is bool else type(env)
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise usage_error(f"{env_name(dest)}={env!r}: {exc}") from None
    parser.add_argument(flag, default=default, help=f"{help} [{env_name(dest)}]", **kwargs)


# What an unset setting means when CBConfig's default is None.
_UNSET_MEANS = {
    "num_blocks": "from kv_cache_space or max_memory_percent",
    "kv_cache_space": "4 GiB on a CPU, at most a quarter of RAM",
    "max_memory_percent": "0.9 on a GPU",
    "safety_margin": ", ".join(f"{k} {v}" for k, v in DEFAULT_SAFETY_MARGIN.items()),
    "use_cuda_graph": "on for a CUDA device, off elsewhere",
    "use_async_batching": "on where CUDA graphs are, off elsewhere",
}


def add_cb_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("continuous batching (unset: the engine's defaults)")
    defaults = {f.name: f.default for f in dataclasses.fields(CBConfig)}
    for name, kind, help_text in CB_SETTINGS:
        extra = {"choices": CHOICES[name]} if name in CHOICES else {}
        if os.environ.get(env_name(name)) is None:  # else the variable's value shows as the default
            default = _UNSET_MEANS.get(name, defaults[name])
            if kind is bool:
                default = "on" if default is True else "off" if default is False else default
            help_text = f"{help_text} (default: {default})"
        add_env_argument(group, "--" + name.replace("_", "-"), type=kind, help=help_text, **extra)


def cb_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The continuous-batching settings given (flag or environment), as CBConfig keyword arguments."""
    return {n: getattr(args, n) for n in CB_SETTING_NAMES if getattr(args, n, None) is not None}


def settings_env(settings: dict[str, Any]) -> dict[str, str]:
    """Settings as the `CBSERVE_*` variables a child `cbserve` process reads them from."""
    return {env_name(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in settings.items()}


# argparse's exit status for a bad command line, used for every configuration error: a process
# that exits with it will fail the same way when started again (`cbserve up` does not restart it).
CONFIG_ERROR_EXIT = 2


def usage_error(message: str) -> SystemExit:
    """What a command raises for a bad flag or variable: argparse's form and exit status, no traceback."""
    print(f"cbserve: error: {message}", file=sys.stderr)
    return SystemExit(CONFIG_ERROR_EXIT)


def model_dir(model: str | None) -> str:
    """`--model` resolved to a local directory before anything starts (the default is prepared
    here), so that a bad one is a usage error, not a traceback or children crash-looping on it."""
    from services.common.model_source import resolve_model

    try:
        return str(resolve_model(model))
    except ValueError as exc:
        raise usage_error(str(exc)) from None


def cb_config(args: argparse.Namespace) -> CBConfig:
    """The settings given, checked; against the command's `--device` too, where it has one."""
    try:
        config = CBConfig.from_kwargs(**cb_settings(args))
        device = getattr(args, "device", None)
        if device is not None:
            config.cuda_graph_enabled(device.split(":")[0])
        return config
    except (TypeError, ValueError) as exc:
        raise usage_error(str(exc)) from None


# The internal sockets' defaults: where a cachemgr binds and a worker connects, where a worker binds
# and a gateway connects.
DEFAULT_CACHEMGR_ADDRESS = "tcp://127.0.0.1:5557"
DEFAULT_WORKER_ADDRESS = "tcp://127.0.0.1:5556"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--model`, `--device`, `--dtype`: what every process that holds the model or its KV reads."""
    from services.common.config import DTYPES

    add_env_argument(parser, "--model", help="local model directory (default: the embedded SmolLM2-135M)")
    add_env_argument(parser, "--device", default="cpu", help="cpu, cuda or cuda:N")
    add_env_argument(
        parser,
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="the weights' dtype (and the KV pages', unless --kv-cache-dtype says): auto is bfloat16 "
        "where the device computes it natively, else on a CPU float32 weights with float16 KV pages "
        "(a bfloat16 checkpoint keeps bfloat16 where AVX2 widens it); float32 is exact",
    )


def served_precision(args: argparse.Namespace, model: str) -> tuple[CBConfig, Any]:
    """The settings and the weights' dtype (a torch.dtype) that a worker or a cachemgr serves the model
    in directory `model` with on `--device`: `--dtype` and `--kv-cache-dtype`, each `auto` resolved
    as precision.py says, the same in both processes."""
    from pathlib import Path

    from services.common.precision import dtype_name, resolve_dtype, resolve_kv_cache_dtype

    config = cb_config(args)
    dtype = resolve_dtype(args.dtype, Path(model), args.device)
    kv = resolve_kv_cache_dtype(config.kv_cache_dtype, args.dtype, dtype, args.device)
    return dataclasses.replace(config, kv_cache_dtype=dtype_name(kv)), dtype


def add_max_tokens(parser: argparse.ArgumentParser, default: int | None, help: str) -> None:
    """`--max-tokens`, the API's name, in every command; `--max-new-tokens` (chat's old name) is still
    read but no longer shown."""
    parser.add_argument("--max-tokens", type=bounded(int, 1), default=default, help=help)
    parser.add_argument(
        "--max-new-tokens",
        dest="max_tokens",
        type=bounded(int, 1),
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
