"""The native kernel builds the suite loads, compiled ahead of it: `make test` starts this in the
background before its linters, which keep one core busy for most of a minute while the other is free.

On a fresh machine the builds are minutes of compiler time: this CPU's best path for every kernel, then
the lower paths that the kernel tests hold a build to in a child process where that path is below this
CPU's best (AVX2 for every kernel under AVX-512, AVX-512 without BF16/VNNI for the panels under
AVX512-BF16; on a CPU whose best is one of them those tests skip, and its build is not made). Each build
holds its kernel's lock (kernels._build), so a test that needs one before it is done waits for it
instead of compiling it a second time; where the builds are there already, this only loads them. A build
that fails here fails again, with its error, in the test that needs it.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from services.common.precision import ISA_SWITCH, cpu_flags
from services.worker import kernels


def builds(flags: frozenset[str]) -> list[tuple[str, tuple[str, ...]]]:
    """(path, kernels) that the suite loads on a CPU with `flags`, in the order it first needs them."""
    wanted = [("native", ("fused_ops", "paged_attention", "panel_linear", "memory_probe"))]
    if "avx512f" in flags:
        wanted.append(("avx2", ("paged_attention", "panel_linear", "fused_ops")))
    if {"avx512f", "avx512_bf16"} <= flags:
        wanted.append(("avx512", ("panel_linear",)))
    return wanted


def main() -> None:
    for path, stems in builds(cpu_flags()):
        os.environ[ISA_SWITCH] = path  # kernels._build reads it for each build
        with ThreadPoolExecutor(2) as pool:  # two cores: a compiler process each
            list(pool.map(kernels._build, stems))


if __name__ == "__main__":
    main()
