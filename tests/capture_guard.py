"""What a CUDA graph cannot hold, caught on the CPU: a capture run under `CaptureGuard` records every
op that reads a value on the host (a sync, whose value the graph would freeze) or sizes an output by
values; `guarded_capture` is a `ModelRunner.use_graphs` capture that fails on any."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from services.worker.cuda_graphs import Step

HOST_READS = frozenset(
    {
        "aten._local_scalar_dense.default",
        "aten.item.default",
        "aten.nonzero.default",
        "aten.masked_select.default",
        "aten.equal.default",
        "aten.is_nonzero.default",
        "aten.unique_dim.default",
        "aten._unique2.default",
        "aten.repeat_interleave.Tensor",
    }
)


class CaptureGuard(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        indices = args[1] if name.startswith("aten.index") and isinstance(args[1], list | tuple) else ()
        if name in HOST_READS or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices):
            self.violations.append(name)
        return func(*args, **(kwargs or {}))


def guarded_capture(step: Step) -> Step:
    with CaptureGuard() as guard:
        step()
    assert not guard.violations, f"not capturable: {guard.violations}"
    return step
