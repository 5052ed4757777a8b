"""The weights' and the KV pages' dtypes: `--dtype` and `--kv-cache-dtype`, each `auto` resolved the
same way in every process of a stack.

`--dtype auto` follows what a user of vLLM gets from its own `auto`: a 16-bit checkpoint runs in its
dtype and a float32 one in bfloat16, on a device that computes bfloat16 natively. On a CPU that means
AVX512-BF16 or AMX (the panels' products then take bfloat16 operands in hardware); a float16
checkpoint runs as bfloat16 there (the native kernels have no float16 weights). A CPU without either,
or native kernels held below that path (`CBSERVE_CPU_ISA`), runs a float32 or float16 checkpoint in
float32, where bfloat16 would round the weights for no speed (its products are float32 FMAs either
way); a bfloat16 checkpoint keeps bfloat16 on the AVX2 path, which widens each weight exactly as it
loads it: half the bytes that a decode step streams, and half the memory (docs/performance.md has
a 1B model's figures).
Exact float32 is always one flag away (`--dtype float32`).

The KV pages' dtype (`--kv-cache-dtype`): `auto` follows the weights, but where `--dtype auto` chose
float32 on a CPU (one without native bfloat16) the pages are float16, as OpenVINO GenAI's and
llama.cpp's defaults are on such CPUs: half the bytes that a decode step's attention reads, while
F16C widens each value exactly and teacher-forced top-1 agreement with float32 stays at 0.9997
(tests/test_precision.py). `--dtype float32` asks for exact float32 and keeps float32 pages.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from services.common.config import DTYPES, KV_CACHE_DTYPES, CBConfig

NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# Holds the native kernels' build to a path below this CPU's best (worker/kernels.py): every such path
# is below AVX512-BF16.
ISA_SWITCH = "CBSERVE_CPU_ISA"
# `0` turns the native kernels off (worker/kernels.py): bfloat16 products are then torch's.
NATIVE_SWITCH = "CBSERVE_NATIVE_KERNELS"


def dtype_name(dtype: torch.dtype) -> str:
    """The name `--dtype`, the logs and the tensor handles use: "float32", "bfloat16", ..."""
    return str(dtype).removeprefix("torch.")


def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_computes_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively and the native kernels may use it."""
    if os.environ.get(ISA_SWITCH, "native") not in ("", "native"):
        return False
    return bool(NATIVE_BF16_FLAGS & cpu_flags())


def native_kernels_enabled() -> bool:
    return os.environ.get(NATIVE_SWITCH, "1") != "0"


def cpu_widens_bf16() -> bool:
    """Whether the native kernels' AVX2 path (or a better one) runs bfloat16 weights here: widened to
    float32 as loaded, multiplied by FMAs, rather than torch's emulated bfloat16 products."""
    if not native_kernels_enabled() or os.environ.get(ISA_SWITCH, "native") == "portable":
        return False
    return {"avx2", "fma"} <= cpu_flags()


def checkpoint_dtype(model_dir: Path) -> torch.dtype | None:
    """The dtype the checkpoint's config.json names (`dtype`, or the older `torch_dtype`), if any."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, str(text), None) if text else None
    return dtype if isinstance(dtype, torch.dtype) else None


def resolve_dtype(name: str, model_dir: Path, device: str) -> torch.dtype:
    """`name` (one of DTYPES) as the dtype the weights load in on `device` ("cpu", "cuda:1", ...)."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    if name != "auto":
        return getattr(torch, name)
    stored = checkpoint_dtype(model_dir)
    if device.split(":")[0] == "cuda":
        return stored if stored in (torch.bfloat16, torch.float16) else torch.bfloat16
    if cpu_computes_bf16() or (stored == torch.bfloat16 and cpu_widens_bf16()):
        return torch.bfloat16
    return torch.float32


def resolve_kv_cache_dtype(name: str, dtype: str, weights: torch.dtype, device: str) -> torch.dtype:
    """`--kv-cache-dtype name` (one of KV_CACHE_DTYPES) beside the weights' `weights`, which `--dtype
    dtype` chose on `device`; `auto` as the module says."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}")
    if name != "auto":
        return getattr(torch, name)
    on_cpu = device.split(":")[0] == "cpu"
    if dtype == "auto" and on_cpu and weights == torch.float32 and "f16c" in cpu_flags():
        return torch.float16
    return weights


def kv_cache_dtype(config: CBConfig, weights: torch.dtype) -> torch.dtype:
    """The KV pool's dtype for a model whose weights are `weights` (`config.kv_cache_dtype`; `auto`:
    the weights')."""
    return weights if config.kv_cache_dtype == "auto" else getattr(torch, config.kv_cache_dtype)
