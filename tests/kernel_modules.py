"""The native kernel modules (services/worker/kernels.py) as the kernel tests load them.

`built` turns a kernel that did not build into a skip where no C++ compiler exists and into a failure
where one does; `native_kernels_off` runs a block as CBSERVE_NATIVE_KERNELS=0 does; the `*_module`
functions build one kernel's module alone, for the vector path CBSERVE_CPU_ISA holds this process to
(a lower path's child run compiles nothing else).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

from services.common.precision import NATIVE_SWITCH
from services.worker import kernels

T = TypeVar("T")


def built(kernel: T | None, what: str) -> T:
    """The kernel; a skip where no compiler exists, a failure where one does (a broken build must not
    turn the kernel tests into skips while the engine quietly runs the fallback)."""
    if kernel is not None:
        return kernel
    if not kernels.native_kernels_enabled():
        pytest.skip(f"{NATIVE_SWITCH}=0: {what}")
    if kernels.compiler_available():
        pytest.fail(f"a C++ compiler is here but the kernel did not build ({what}); see the logged error")
    pytest.skip(f"no C++ toolchain: {what}")


@contextmanager
def native_kernels_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Within: CBSERVE_NATIVE_KERNELS=0, and no kernel built before is remembered (nor after)."""
    monkeypatch.setenv(NATIVE_SWITCH, "0")
    caches = [f for f in vars(kernels).values() if hasattr(f, "cache_clear")]
    for kernel in caches:
        kernel.cache_clear()
    try:
        yield
    finally:
        for kernel in caches:
            kernel.cache_clear()


@functools.cache
def attention_module() -> Any:
    """The paged attention module alone: a lower path's subprocess compiles nothing else."""
    return built(kernels._build("paged_attention"), "paged attention")


@functools.cache
def fused_ops_module() -> Any:
    """The fused ops module alone (its KV writer), built for the path this run is held to, if any."""
    return built(kernels._build("fused_ops"), "fused ops")


def panel_linear_module() -> Any:
    """The panel kernel built for this process's CBSERVE_CPU_ISA (alone: not the other kernels)."""
    return built(kernels._build("panel_linear"), "panel linears")
