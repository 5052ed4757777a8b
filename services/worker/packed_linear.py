"""Linears with their weights packed once into column panels (CPU; `kernels.PanelLinear`).

torch's own GEMM (MKL here) re-packs a weight matrix on every product; our panel kernel streams
weights packed once (see csrc/panel_linear.cpp): 2x torch's at the few rows of a decode step, where
the weights' reads set the pace. Products of many rows go to torch's GEMM where this CPU runs it
faster (`gemm_crossover`), on weights prepared for it once (`torch_gemm`: oneDNN's reordered copy where
torch has oneDNN, else the plain weights). `pack_linears` swaps every `nn.Linear` of a CPU float32
model for a `PackedLinear` that keeps the original parameters (tied weights, `.weight` readers and
checkpoints see no change: transformers' forward still runs the model) plus the packed copy. Results
equal torch's GEMM up to fp32 summation order, as any change of batch shape does.

`FusedLlama` reads only its packed copies, so it lets the plain weights go (`plain=False`: the
linears' parameters become meta tensors of their shape) and a model's weights are held once, as the
panels (and oneDNN's copy where many rows go to it). Weights may be bfloat16 (`FusedLlama` on a
bfloat16 model): the panels then hold them in bfloat16, the inputs and outputs stay float32, and each
product is bf16(x) times the weights, summed in float32, on the panels and on torch's GEMM alike. Or
int8 (`--quantization int8`): rounded in groups of 32 consecutive inputs of each output channel, each
group on a float32 scale of its own (llama.cpp's Q8_0), so that the weights' bytes drop to about
(1/4 + 2/32) of float32's: a quarter, plus each group's line of scales and line of offsets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.worker import torch_gemm
from services.worker.gemm_crossover import NEVER
from services.worker.kernels import packed_linear_ops


def joined_weight(linears: Sequence[nn.Linear]) -> torch.Tensor:
    """The linears' weights concatenated once, each linear's parameter becoming a view of its rows:
    one copy stays, which transformers' modules and a tied head still read."""
    if len(linears) == 1:
        return linears[0].weight.detach()
    with torch.no_grad():
        weight = torch.cat([lin.weight.detach() for lin in linears])
        first = 0
        for lin in linears:
            lin.weight = nn.Parameter(weight[first : first + lin.out_features], requires_grad=False)
            first += lin.out_features
    return weight


@dataclass
class PackedWeight:
    """One or several linears' weights, concatenated along the outputs (`weight [N, K]`) and packed
    once, and their bias: `x [..., K] -> [..., N]`. `many_rows`: the copy that products of
    `ops.torch_from_rows` rows or more multiply by (`torch_gemm.prepare`), None where the panels
    serve every size. `gated`: an MLP's gate and up, `x -> silu(gate) * up [..., N / 2]`; the panels
    apply it as they write, so the product's full width never reaches memory."""

    ops: Any
    weight: torch.Tensor
    packed: torch.Tensor
    bias: torch.Tensor | None
    many_rows: torch.Tensor | None
    gated: bool = False

    @classmethod
    def of(
        cls, ops: Any, *linears: nn.Linear, many_rows: bool = True, gated: bool = False, plain: bool = True
    ) -> PackedWeight:
        """Several linears' weights are concatenated once, and each linear's parameter becomes a view
        of its rows: one plain copy of the weights stays (`plain`), besides the packed one and, where
        this CPU's crossover sends many rows to torch's GEMM, its prepared one. `many_rows=False`
        spares that copy for a product that seldom has many rows (the LM head: the panels serve it at
        every size). `gated`: the linears are an MLP's gate and up (one width, no biases).
        `plain=False` lets the plain copy go, for a forward that reads only this one (int8 panels are
        then the only copy): the linears' parameters become meta tensors of their shape (the prepared
        copy keeps the storage where it is the plain weight itself)."""
        if any(lin.weight.is_meta for lin in linears):
            raise ValueError(
                f"the weights of {linears} were let go by the engine that packed them before: an engine"
                " takes the model it is given on the CPU, so one of another quantization needs a model of"
                " its own"
            )
        if gated and (
            len(linears) != 2
            or any(lin.bias is not None for lin in linears)
            or linears[0].out_features != linears[1].out_features
        ):
            raise ValueError(f"a gated product takes a gate and an up linear, one width, no bias: {linears}")
        with torch.no_grad():
            weight = joined_weight(linears)
            biases = [lin.bias for lin in linears]
            bias = (
                None
                if all(b is None for b in biases)
                else torch.cat(
                    [
                        b.detach().float() if b is not None else torch.zeros(lin.out_features)
                        for b, lin in zip(biases, linears, strict=True)
                    ]
                )
            )
            prepared = None
            if many_rows and ops.torch_from_rows < NEVER:
                prepared = torch_gemm.prepare(weight.to(ops.dtype))
            packed = ops.pack_weight_gated(weight) if gated else ops.pack_weight(weight)
            if not plain:
                weight = weight.to("meta")
                for lin in linears:
                    lin.weight = nn.Parameter(lin.weight.to("meta"), requires_grad=False)
            return cls(ops, weight, packed, bias, prepared, gated)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.many_rows is not None and x.numel() >= self.ops.torch_from_rows * x.shape[-1]:
            if self.ops.dtype == torch.float32:
                y = torch_gemm.linear(x, self.many_rows, self.bias)
            else:  # a bias is added in float32, as the panels add it
                y = torch_gemm.linear(x.to(self.ops.dtype), self.many_rows, None).float()
                if self.bias is not None:
                    y += self.bias
            if self.gated:
                gate, up = y.chunk(2, dim=-1)
                return F.silu(gate) * up
            return y
        if self.gated:
            return self.ops.packed_linear_gated(x, self.packed, self.weight.shape[0] // 2)
        return self.ops.packed_linear(x, self.packed, self.bias, self.weight.shape[0])


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
