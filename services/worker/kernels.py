"""Native CPU kernels, compiled once on first use by torch's extension builder (cached under
`$CBSERVE_HOME/kernels`).

One switch: `CBSERVE_NATIVE_KERNELS=0` turns them off. Without the switch, without a compiler, or off
the CPU/float32 path, attention falls back to gather + SDPA and linears to torch's GEMM, which give
the same results up to fp32 rounding; the tests run both.

Each kernel picks its vector path at compile time from what this CPU has (`-march=native`): AVX-512
with bf16 dot products, AVX-512, AVX2 with FMA, or portable loops. `CBSERVE_CPU_ISA` compiles a lower
path than the CPU's best (`ISA_FLAGS`), so that every path can be run and tested on a CPU that has a
higher one; each module's `isa()` names the path it was built for.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import re
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog
import torch

from services.common.model_source import cbserve_home
from services.common.precision import ISA_SWITCH, native_kernels_enabled
from services.worker import gemm_crossover, torch_gemm

log = structlog.get_logger(__name__)

_CSRC = Path(__file__).parent / "csrc"
# The compiler flags of each path a build may be held to, after -march=native: GCC drops every feature
# that needs one it is told to drop (-mno-avx512f takes all AVX-512 subsets with it).
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "native": (),
    "avx512": ("-mno-avx512bf16", "-mno-avx512vnni", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"),
    "avx2": ("-mno-avx512f", "-mno-amx-tile"),
    "portable": ("-march=x86-64",),
}

# Flags of one kernel's own, after the shared ones. paged_attention's prefill and decode kernels must
# give a row the same bits from code of different shapes (csrc/paged_common.h), so its float
# arithmetic must stay as written: none of fast-math's unsafe rewrites (reassociated sums, a division
# by a loop's invariant made a product by its reciprocal in the loop but not in its tail), no product
# fused into a later add, and a vector division correctly rounded rather than a refined reciprocal
# estimate, which a scalar division does not match.
KERNEL_FLAGS: dict[str, tuple[str, ...]] = {
    "paged_attention": ("-fno-unsafe-math-optimizations", "-ffp-contract=off", "-mno-recip")
}

PagedDecode = Callable[..., None]
PagedPrefill = Callable[..., None]


def isa() -> str:
    """The path the kernels are compiled for (`ISA_FLAGS`); a value outside it is a usage error."""
    value = os.environ.get(ISA_SWITCH, "native") or "native"
    if value not in ISA_FLAGS:
        raise ValueError(f"{ISA_SWITCH} must be one of {', '.join(ISA_FLAGS)}, got {value!r}")
    return value


def _cpu_tag() -> str:
    """-march=native code must never run on another CPU: key the build by this CPU's feature flags."""
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "")
    return hashlib.sha1(flags.encode()).hexdigest()[:10]


def _build_dir(stem: str) -> Path:
    held = "" if isa() == "native" else f"{isa()}_"
    return cbserve_home() / "kernels" / f"cbserve_{stem}_{held}{_cpu_tag()}"


def _source_files(stem: str) -> list[Path]:
    """`csrc/<stem>.cpp` and the local headers it includes (`#include "..."`), theirs in turn: what its
    build reads."""
    files = [_CSRC / f"{stem}.cpp"]
    for source in files:  # grows as it goes: each header once
        for name in re.findall(r'#include "([^"]+)"', source.read_text()):
            if _CSRC / name not in files:
                files.append(_CSRC / name)
    return files


def compile_flags(stem: str, path: str, march: str = "native") -> list[str]:
    """The compiler flags of `stem`'s build held to `path` (`ISA_FLAGS`) for the CPU `march` names."""
    # -fopenmp: at::parallel_for is an OpenMP pragma in torch's headers, serial without it.
    flags = ["-O3", f"-march={march}", *ISA_FLAGS[path], "-fopenmp", "-ffast-math"]
    return flags + list(KERNEL_FLAGS.get(stem, ()))


def _build(stem: str) -> Any:
    """Compile (once per CPU and source) and import `csrc/<stem>.cpp`; None when that fails."""
    if not native_kernels_enabled():
        return None
    source = _CSRC / f"{stem}.cpp"
    try:
        from torch.utils.cpp_extension import load

        build_dir = _build_dir(stem)
        name = build_dir.name
        build_dir.mkdir(parents=True, exist_ok=True)
        # torch takes a lock file on every load, even with nothing to build, and a process killed
        # meanwhile (a worker stopped while it starts) leaves it behind: every later load then
        # waits on it for ever. Our loads hold an flock instead, which dies with its holder, so
        # under it a torch lock file can only be such a leftover.
        with open(build_dir / "load.flock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            # Silent, a first start looked hung: say that a compile is coming and how long it took.
            built = [so.stat().st_mtime for so in build_dir.glob("*.so")]
            newest = max(path.stat().st_mtime for path in _source_files(stem))  # ninja tracks them all
            compiling = not built or max(built) < newest
            if compiling:
                log.info("compiling native kernel, once per CPU and source (about 30 s)", kernel=stem)
            started = time.monotonic()
            # The extension's libgomp.so.1 resolves to the one torch already loaded: one pool.
            module = load(
                name=name,
                sources=[str(source)],
                extra_cflags=compile_flags(stem, isa()),
                extra_ldflags=["-lmvec", "-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
            if compiling:
                log.info("native kernel compiled", kernel=stem, seconds=round(time.monotonic() - started, 1))
            return module
    except Exception as exc:  # the fallbacks are exact too: serve on, but a broken build is an error
        if compiler_available():
            log.error("native kernel failed to build, using torch's", kernel=stem, error=str(exc))
        else:
            log.warning("no C++ compiler: native kernel unavailable, using torch's", kernel=stem)
        return None


def compiler_available() -> bool:
    """Whether torch's extension builder has a C++ compiler (`$CXX`, else `c++`) to call."""
    return shutil.which(os.environ.get("CXX", "c++")) is not None


_KERNELS = ("fused_ops", "paged_attention", "panel_linear")


@functools.cache
def _built() -> dict[str, Any]:
    """Every kernel, compiled side by side on a first start: each is one compiler process, and one
    after the other they took about a minute on two cores. (Before the GEMM crossover is measured,
    which must not share the cores with a compiler.)"""
    with ThreadPoolExecutor(len(_KERNELS)) as pool:
        return dict(zip(_KERNELS, pool.map(_build, _KERNELS), strict=True))


def _paged_attention() -> Any:
    return _built()["paged_attention"]


@functools.cache
def paged_decode_kernel() -> PagedDecode | None:
    """`paged_decode(q [T, H, D], out, rows [B], k_cache [S, kv, D], v_cache, slots [B, L], lengths [B],
    scale, softcap)`: attention of one query token per request (packed row `rows[b]`) over its first
    `lengths[b]` slots, written into `out`. Without it, attention gathers the context and calls SDPA."""
    module = _paged_attention()
    return None if module is None else module.paged_decode


@functools.cache
def paged_prefill_kernel(head_dim: int) -> PagedPrefill | None:
    """`paged_prefill(q [T, H, D], out, k_cache [S, kv, D], v_cache, first_rows [B], num_queries [B],
    slots [B, L], lengths [B], scale, softcap, window)`: causal attention of each request's query
    tokens (packed rows `first_rows[b]` on) over its first `lengths[b]` slots, written into `out`; each
    row's output is, bit for bit, what `paged_decode` gives for it over the same keys. None where it
    does not run (a head size without a vector path on AVX-512 or AVX2): prefill then gathers + SDPA."""
    module = _paged_attention()
    if module is None or not module.prefill_supports(head_dim):
        return None
    return module.paged_prefill


class PanelLinear:
    """Linears on weights packed once into column panels (csrc/panel_linear.cpp): `pack_weight(W [N, K])`,
    then `packed_linear(x [..., K], packed, bias, N) -> [..., N]`; for an MLP's gate and up,
    `pack_weight_gated([Wg; Wu] [2I, K])`, then `packed_linear_gated(x, packed, I) -> silu(x Wg^T) *
    (x Wu^T) [..., I]`. x and the outputs are float32; `dtype` is the weights' in the panels: float32,
    bfloat16 (x is then rounded to bfloat16 for the products, which accumulate in float32), or int8
    (each output column's weights in groups of consecutive inputs, each group on a scale of its own;
    with `int8_x` each row of x is rounded to int8 in the same groups as it is multiplied, each
    group's sum exact in int32 and scaled into float32, else x multiplies as it is, in float32).
    Products of `torch_from_rows` rows or more run faster on torch's GEMM on this CPU
    (`gemm_crossover`, `torch_gemm`): their callers send them there.
    """

    def __init__(
        self, module: Any, torch_from_rows: int, dtype: torch.dtype = torch.float32, int8_x: bool = True
    ) -> None:
        self._module = module
        self.torch_from_rows = torch_from_rows
        self.dtype = dtype
        self.int8_x = int8_x
        self._pack, self._pack_gated = (getattr(module, name) for name in _PACKS[dtype])

    def pack_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return self._pack(weight)

    def packed_linear(
        self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        return self._module.panel_linear(x, packed, bias, out_features, self.int8_x)

    def pack_weight_gated(self, weight: torch.Tensor) -> torch.Tensor:
        return self._pack_gated(weight)

    def packed_linear_gated(self, x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
        return self._module.panel_linear_gated(x, packed, out_features, self.int8_x)


# The module's packing functions for the panels' weights of each dtype: plain, gated.
_PACKS = {
    torch.float32: ("pack_weight", "pack_weight_gated"),
    torch.bfloat16: ("pack_weight_bf16", "pack_weight_gated_bf16"),
    torch.int8: ("pack_weight_int8", "pack_weight_gated_int8"),
}
PANEL_DTYPES = tuple(_PACKS)


def packed_linear_ops(dtype: torch.dtype = torch.float32, int8_x: bool = True) -> PanelLinear | None:
    """The packed linears for weights of `dtype` (one of PANEL_DTYPES), or None (switched off, or not
    built): then linears run torch's own GEMM. int8 weights: `int8_x` rounds each input row to int8
    too. One object per dtype (and int8_x), however it is asked for."""
    return _packed_linear_ops(dtype, int8_x if dtype == torch.int8 else True)


@functools.cache
def _packed_linear_ops(dtype: torch.dtype, int8_x: bool) -> PanelLinear | None:
    if dtype not in PANEL_DTYPES:
        raise ValueError(f"panels hold float32, bfloat16 or int8 weights, not {dtype}")
    module = _built()["panel_linear"]
    if module is None:
        return None
    if dtype == torch.int8:
        # The int8 panels serve every size, with no copy for many rows: with VNNI they multiply four
        # int8 products per lane where bf16 multiplies two, so they outran torch's bf16 GEMM (oneDNN,
        # reordered weights) at a prefill's hundreds of rows too, and a copy in a wider type would
        # undo the quarter of the bytes. Weight-only int8 (FMAs on widened weights) is there for its
        # agreement, not for prefill speed.
        return PanelLinear(module, gemm_crossover.NEVER, dtype, int8_x)
    crossover = gemm_crossover.pinned()
    if crossover is not None:
        return PanelLinear(module, crossover, dtype)
    ops = PanelLinear(module, gemm_crossover.NEVER, dtype)
    # A new kernel or a new way to measure it: measured again.
    sources = b"".join(
        path.read_bytes()
        for path in (*_source_files("panel_linear"), Path(gemm_crossover.__file__), Path(torch_gemm.__file__))
    )
    source_hash = hashlib.sha1(sources).hexdigest()[:10]
    ops.torch_from_rows = gemm_crossover.torch_from_rows(
        _build_dir("panel_linear"), source_hash, ops.pack_weight, ops.packed_linear, dtype
    )
    return ops


def int8_path() -> str | None:
    """How the int8 panels multiply (the module's `int8_path()`: avx512-vnni, avx512, avx-vnni, avx2 or
    portable); None when the panel kernel is not built."""
    module = _built()["panel_linear"]
    return None if module is None else module.int8_path()


def paths() -> dict[str, str]:
    """The vector path each built kernel runs (its `isa()`), for the start-up log; {} when none is built."""
    built = _built().items()
    return {name: module.isa() for name, module in built if module is not None and hasattr(module, "isa")}


@functools.cache
def fused_ops() -> Any:
    """`rms_norm`, `add_rms_norm`, `rotary_store_kv_` and `argmax_rows` (csrc/fused_ops.cpp), or None:
    then the model runs transformers' own forward."""
    return _built()["fused_ops"]


@functools.cache
def memory_probe() -> Any:
    """`read_all(buffer) -> int` (csrc/memory_probe.cpp): reads a buffer with every thread at the
    machine's read rate, or None (not built). Built on first use only: the benchmarks need it, the
    serving processes do not."""
    return _build("memory_probe")
