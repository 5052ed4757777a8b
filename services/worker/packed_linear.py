"""Linears with their weights packed once into column panels (CPU, float32; `kernels.PanelLinear`).

torch's own GEMM (MKL here) re-packs a weight matrix on every product and on this AMD CPU takes no
AVX-512 path; oneDNN on weights reordered once does better, and our panel kernel better still (see
csrc/panel_linear.cpp): 2x at the few rows of a decode step, where the weights' reads set the pace.
`pack_linears` swaps every `nn.Linear` of a CPU float32 model for a `PackedLinear` that keeps the
original parameters (tied weights, `.weight` readers and checkpoints see no change) plus the packed
copy. Results equal torch's GEMM up to fp32 summation order, as any change of batch shape does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from services.worker.kernels import packed_linear_ops


@dataclass
class PackedWeight:
    """One or several linears' weights, concatenated along the outputs and packed once, and their bias:
    `x [..., K] -> [..., N]`."""

    ops: Any
    packed: torch.Tensor
    bias: torch.Tensor | None
    out_features: int

    @classmethod
    def of(cls, ops: Any, *linears: nn.Module) -> PackedWeight:
        with torch.no_grad():
            weight = torch.cat([lin.weight.detach() for lin in linears]).contiguous()
            biases = [lin.bias for lin in linears]
            bias = None if all(b is None for b in biases) else torch.cat([
                b.detach() if b is not None else torch.zeros(lin.out_features)
                for b, lin in zip(biases, linears, strict=True)
            ])  # fmt: skip
            return cls(ops, ops.pack_weight(weight), bias, weight.shape[0])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.packed_linear(x, self.packed, self.bias, self.out_features)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, ops: Any) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: ties and state dicts are unchanged
        self.bias = linear.bias
        self.packed = PackedWeight.of(ops, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=True"


def pack_linears(model: nn.Module) -> int:
    """Swap the model's CPU float32 linears for packed ones, in place; how many were swapped (0 when
    the kernel is not built, the kernels are switched off, or the model is elsewhere)."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.device.type == "cpu"
        and child.weight.dtype == torch.float32
    ]
    # Only then the kernel: a model elsewhere (a GPU's) must not wait for a CPU kernel's compile.
    ops = packed_linear_ops() if targets else None
    if ops is None:
        return 0
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child, ops))
    return len(targets)
