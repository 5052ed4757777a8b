"""Compiling Triton kernels for an H100/H200 (sm_90) without one: a recorder that stands in for a
kernel in its module's globals to capture what the wrapper launches, and a compile of a recorded
launch with the ptxas and cuobjdump that ship with triton, returning the stack bytes a thread needs
(0 unless registers spilled). The kernel tests' child processes run these with the interpreter off."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


class Launches:
    """Stands in for a kernel in a module's globals: records what the wrapper launches."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[object, ...], dict[str, object]]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: object, **kwargs: object) -> None:
            self.calls.append((args, kwargs))

        return launch


def arg_type(value: object) -> str:
    """Triton's signature type of a launch argument (the tests' ints are all small)."""
    if isinstance(value, torch.Tensor):
        return (
            "*"
            + {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64"}[
                value.dtype
            ]
        )
    return "fp32" if isinstance(value, float) else "i32"


def sm90_stack_bytes(
    kernel: Any, name: str, args: tuple[object, ...], kwargs: dict[str, object], work: Path
) -> int:
    """Compiles one recorded launch for sm_90 (ptxas ships with triton) and returns the stack a thread
    needs: 0 unless registers spilled."""
    options = {"num_warps": kwargs.pop("num_warps", 4)}  # 4: what a launch without it gets
    values = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    constexprs = {p.name: values[p.name] for p in kernel.params if p.is_constexpr}
    signature = {p.name: "constexpr" if p.is_constexpr else arg_type(values[p.name]) for p in kernel.params}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    cubin = work / f"{name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    usage = subprocess.run([CUOBJDUMP, "-res-usage", str(cubin)], capture_output=True, text=True, check=True)
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    assert found, usage.stdout
    return int(found.group(2))


CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
