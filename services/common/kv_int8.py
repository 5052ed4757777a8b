"""The int8 KV row format (`--kv-cache-dtype int8`), and the torch code that writes and reads it.

Each (token, kv head) row of an int8 pool holds `head_dim` int8 values followed by their float32
scale in `SCALE_BYTES` bytes (native byte order), so the pool's last dimension is `head_dim +
SCALE_BYTES` int8 elements.

The values are those of the row rotated: the row is split into blocks of B dims, B the largest of
64, 16, 4, 1 that divides head_dim (`block_size`), and each block x is stored as H_B x, H_B the
normalized Sylvester Hadamard matrix (orthonormal, symmetric, its own inverse). Keys have a few
outlier channels, and one scale per row set by them rounds every other channel coarsely; the
rotation spreads each outlier over its block, so the scale is set by the row's energy rather than
its largest channel (QuaRot's idea). H_B x is computed by the fast Walsh-Hadamard butterflies,
stages h = 1, 2, 4, .., B / 2 each taking the pairs (i, i + h) to (a + b, a - b), then times
1 / sqrt(B) (1/8, 1/4 or 1/2: B is a power of 4, so that product is exact).

The rotated row y is then quantized symmetric, per token and per kv head: scale = max|y| x (1 / 127),
q = round-half-even(y x (1 / scale)) clamped to [-127, 127], all in float32; a row of zeros has
scale 0 and values 0. A page is filled a token at a time, so a scale per page would have to be known
before its last token is: per-token scales are what a paged writer can compute, as OpenVINO's u8 KV
does. Carrying the scale inside the row leaves every chunk copy (swap, prefix sharing, shared
memory) a plain copy of bytes.

Readers: `dequantize` returns the true values (each value times the scale, then rotated back by the
same H_B). The native attention kernels (csrc/paged_attention.cpp) read the rotated rows as stored
and rotate the query instead, (H q).(H k) = q.k, and the output back once, sum p (H v) = H sum p v.

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
# The integer steps of a query row's rounding (`round_queries`): 127 x 256 + 127, so that the native
# kernels can split each into a high and a low signed byte.
QUERY_LEVELS = 32639.0
# The rotation's block sizes, largest first, and 1 / sqrt(B) for each (exact: powers of 4).
HADAMARD_NORMS = {64: 0.125, 16: 0.25, 4: 0.5, 1: 1.0}


def scale_bytes(dtype: torch.dtype) -> int:
    """Bytes each pool row of `dtype` holds after its head_dim values: the int8 format's scale, else 0."""
    return SCALE_BYTES if dtype == KV_INT8 else 0


def block_size(head_dim: int) -> int:
    """B of the rotation for rows of `head_dim`: the largest of 64, 16, 4, 1 that divides it."""
    return next(b for b in HADAMARD_NORMS if head_dim % b == 0)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Rows `x [..., head_dim]` (float32) with each block of `block_size(head_dim)` dims times H_B: the
    butterflies in the native writer's order, then times 1 / sqrt(B). H_B is its own inverse, so this
    both rotates and rotates back."""
    lead, d = x.shape[:-1], x.shape[-1]
    b = block_size(d)
    if b == 1:
        return x
    h = 1
    while h < b:
        # Index g * 2h + s * h + j: s = 0 and s = 1 are the pair (i, i + h).
        y = x.reshape(*lead, d // (2 * h), 2, h)
        a, c = y.select(-2, 0), y.select(-2, 1)
        x = torch.stack([a + c, a - c], dim=-2).reshape(*lead, d)
        h *= 2
    return x * HADAMARD_NORMS[b]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows `x [..., head_dim]` (any float dtype) as int8 pool rows `[..., head_dim + SCALE_BYTES]`."""
    y = hadamard(x.float())
    scale = y.abs().amax(-1, keepdim=True) * INV_127
    inv = torch.where(scale > 0, scale.reciprocal(), torch.zeros_like(scale))
    values = torch.round(y * inv).clamp_(-127, 127).to(KV_INT8)
    return torch.cat([values, scale.view(KV_INT8)], dim=-1)


def round_queries(q: torch.Tensor) -> torch.Tensor:
    """Query rows `q [..., head_dim]` as attention over int8 rows reads them: rotated as the rows are
    (`hadamard`), each rotated row r rounded to nearest even on QUERY_LEVELS steps of its own scale,
    r = round(r x (QUERY_LEVELS / m)) x (m / QUERY_LEVELS) with m = max |r|, then rotated back. The
    native kernels multiply those integer levels into the int8 values exactly (with AVX512-VNNI) and
    compute the same float32 operations to round them; 15 bits, far finer than the keys' 8."""
    r = hadamard(q.float())
    m = r.abs().amax(-1, keepdim=True)
    # Tensor by tensor: torch divides a number by a tensor as the number times the tensor's reciprocal,
    # and may divide a tensor by a number that way too, which the kernels' one division does not match.
    levels_t = torch.full_like(m, QUERY_LEVELS)
    inv = torch.where(m > 0, levels_t / m, torch.zeros_like(m))
    levels = torch.round((r * inv).clamp_(-QUERY_LEVELS, QUERY_LEVELS))
    return hadamard(levels * (m / levels_t)).to(q.dtype)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """int8 pool rows `[..., head_dim + SCALE_BYTES]` as `[..., head_dim]` values of `dtype` (computed in
    float32: each value times its row's scale, then rotated back)."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.float32)
    return hadamard(rows[..., :head_dim].float() * scale).to(dtype)


def to_pool(x: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows `[..., head_dim]` as the pool of `pool_dtype` stores them."""
    return quantize(x) if pool_dtype == KV_INT8 else x.to(pool_dtype)


def from_pool(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows (as `to_pool` wrote them) as `[..., head_dim]` values of `dtype`."""
    return dequantize(rows, dtype) if rows.dtype == KV_INT8 else rows.to(dtype)
