"""torch's GEMM for the products of many rows, on weights prepared once.

Where torch has oneDNN (its x86 builds), a weight is reordered once into oneDNN's blocked layout and
a product calls oneDNN's matmul on it (brgemm, with AVX-512 where the CPU has it); elsewhere it is
`F.linear` on the plain weight, with no copy. oneDNN multiplies 16-bit weights only on CPUs with the
instructions for them (AVX-512 or AVX-NE-CONVERT) and refuses to reorder them elsewhere: there too a
16-bit weight goes to `F.linear`. oneDNN is preferred over `F.linear` because MKL takes
no AVX-512 path on AMD CPUs. `gemm_crossover` measures which of this and the panels serves from how
many rows on each machine. Results equal the panels' up to fp32 summation order.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# The rows oneDNN is told to expect when it reorders: its blocked layout came out the same for 256,
# 512 and 2048, and each ran every size from 256 to 2048 rows within 3% of the others.
_ROWS_HINT = 512


@functools.cache
def onednn_available() -> bool:
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


def onednn_serves(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies weights of `dtype` on this CPU."""
    if not onednn_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return dtype == torch.float32


def describe() -> str:
    return "oneDNN's matmul on weights reordered once" if onednn_available() else "torch's F.linear"


def prepare(weight: torch.Tensor) -> torch.Tensor:
    """What `linear` multiplies by for `weight [N, K]`: oneDNN's reordered copy, or the weight itself."""
    if not onednn_serves(weight.dtype):
        return weight
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ROWS_HINT)


def linear(x: torch.Tensor, prepared: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x [..., K] -> [..., N]` with a weight from `prepare`."""
    if prepared.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, prepared, bias, "none", [], "")
    return F.linear(x, prepared, bias)
