"""The int8 KV row format (`--kv-cache-dtype int8`), and the torch code that writes and reads it.

Each (token, kv head) row of an int8 pool holds `head_dim` int8 values followed by their float32
scale in `SCALE_BYTES` bytes (native byte order), so the pool's last dimension is `head_dim +
SCALE_BYTES` int8 elements. The scale is symmetric, per token and per kv head: scale = max|x| x
(1 / 127) over the row, q = round-half-even(x x (1 / scale)) clamped to [-127, 127], all in float32;
a row of zeros has scale 0 and values 0. A page is filled a token at a time, so a scale per page
would have to be known before its last token is: per-token scales are what a paged writer can
compute, as OpenVINO's u8 KV does. Carrying the scale inside the row leaves every chunk copy (swap,
prefix sharing, shared memory) a plain copy of bytes.

The native writer (csrc/fused_ops.cpp, `rotary_store_kv_`) computes the same float32 operations in
the same order, so both writers store the same bytes: a request's pages do not depend on which path
wrote them. (Each value is multiplied by the scale's reciprocal rather than divided by the scale:
that is the operation both sides can pin under the native build's fast-math flags.)
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 after each row's values
KV_INT8 = torch.int8
# A Python number, not a tensor (a copy to the device would break CUDA graph capture): a float32
# tensor times it computes in float32 with it rounded to 1.0f / 127.0f, the native writer's constant.
INV_127 = 1.0 / 127.0


def scale_bytes(dtype: torch.dtype) -> int:
    """Bytes each pool row of `dtype` holds after its head_dim values: the int8 format's scale, else 0."""
    return SCALE_BYTES if dtype == KV_INT8 else 0


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows `x [..., head_dim]` (any float dtype) as int8 pool rows `[..., head_dim + SCALE_BYTES]`."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) * INV_127
    inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
    values = torch.round(x * inv).clamp_(-127, 127).to(KV_INT8)
    return torch.cat([values, scale.view(KV_INT8)], dim=-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 pool rows `[..., head_dim + SCALE_BYTES]` as `[..., head_dim]` values of `dtype` (computed in
    float32: each value times its row's scale)."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return (rows[..., :head_dim].float() * scale).to(dtype)


def to_pool(x: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows `[..., head_dim]` as the pool of `pool_dtype` stores them."""
    return quantize(x) if pool_dtype == KV_INT8 else x.to(pool_dtype)


def from_pool(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows (as `to_pool` wrote them) as `[..., head_dim]` values of `dtype`."""
    return dequantize(rows, dtype) if rows.dtype == KV_INT8 else rows.to(dtype)
