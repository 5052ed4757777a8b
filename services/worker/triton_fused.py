"""The Llama layer's element-wise passes on GPUs, in Triton: the `ops` object of the GPU's forward
(gpu_llama.py).

The CPU forward (fused_llama.py) runs its norms, rotary and K/V writes as the fused passes of
csrc/fused_ops.cpp; on a GPU, transformers' eager layers run them as some forty small kernels a layer
(issue 51). `TritonFusedOps` has the same methods with the same arguments, order and in-place effects,
one kernel launch each, plus `silu_mul`: the CPU's gate|up product writes SiLU(gate) * up itself, a GPU's
cuBLAS product cannot, so the gated product is a pass of its own there.

- `rms_norm(x, weight, eps)`: y = weight * x / sqrt(mean(x^2) + eps) per row, a new `[T, W]` tensor.
- `add_rms_norm(x, residual, weight, eps)`: residual += x in place; returns rms_norm(residual).
- `rotary_store_kv_(qkv, num_heads, kv_heads, head_dim, cos, sin, positions, k_cache, v_cache, slots)`:
  rotary in place on the q and k heads of each packed q|k|v row (rotate-half: with c, s the row's
  position's cos/sin rows and h = D / 2, out[i] = x[i] c[i] - x[i + h] s[i] and
  out[i + h] = x[i + h] c[i + h] + x[i] s[i + h]), then the row's k heads (rotated) and v heads written
  to pool slot `slots[t]`. Padded tokens carry a real slot (the pool's reserved padding slot, as the
  batch builder gives them) and write there like any other.
- `silu_mul(gate_up, out=None)`: `[T, 2I]` -> `[T, I]`, silu(gate_up[:, :I]) * gate_up[:, I:].

Activations may be float32, bfloat16 or float16; the weight, cos and sin tables any of the three. Each
kernel widens what it loads to float32, computes in float32, and rounds once on store to the
activations' dtype (the pools' for the K/V writes). Where the CPU ops differ:

- The CPU ops take float32 activations only (that forward keeps float32 activations even for bfloat16
  weights). A 16-bit GPU forward keeps 16-bit activations and residual with float32 math inside each
  kernel, as vLLM's do: then `add_rms_norm` rounds the sum into `residual` first and normalises that
  rounded residual, so that its result is rms_norm of the residual it leaves; and the K/V rows written
  to the pool are the rotated rows as `qkv` now holds them (rounded to its dtype), cast to the pool's.
- Pools are float32, bfloat16 or float16 (the CPU's int8 pools are refused: ValueError).
- The CPU op checks every position and slot on the host before writing. Here the index values are
  trusted, as in triton_attention.py: positions within the rotary table and slots within the pool are
  the caller's to hold, since checking them would read the device.

Grids come from tensor shapes only and nothing reads a device value on the host, so every launch can
run under CUDA-graph capture once its kernel is compiled (one compile per set of constants: dtypes,
block sizes; warm up before capturing).
"""

from __future__ import annotations

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Values a thread holds at most in the one-tile row passes: past it they take more warps, up to 8
# (a row of 8192 then holds 32 a thread, in registers).
VALUES_PER_THREAD = 16
# silu_mul's programs each take this many columns of a row: enough work a program, and enough programs
# for a decode step's few rows over a 14336-wide FFN.
SILU_BLOCK = 1024


def _row_warps(block: int) -> int:
    return min(8, max(1, block // (32 * VALUES_PER_THREAD)))


@triton.jit
def _normalize(x, w, mask, width, eps):
    """weight * x / sqrt(mean(x^2) + eps) of one float32 row tile (masked columns are 0). sqrt and the
    divisions correctly rounded: Triton's defaults approximate them on a GPU, the CPU op rounds them."""
    ss = tl.sum(tl.where(mask, x * x, 0.0), 0)
    r = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, width.to(tl.float32)) + eps))
    return w * (x * r)


# `width` unspecialised: Triton would make a width of 1 a constexpr, which has no `.to` in `_normalize`.
@triton.jit(do_not_specialize=["width"])
def _rms_norm_kernel(x, weight, y, width, eps, stride_x, BLOCK: tl.constexpr):
    """Program t: row t."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    v = tl.load(x + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    out = _normalize(v, w, mask, width, eps)
    tl.store(y + t * width + cols, out.to(y.dtype.element_ty), mask=mask)


# `width` unspecialised: Triton would make a width of 1 a constexpr, which has no `.to` in `_normalize`.
@triton.jit(do_not_specialize=["width"])
def _add_rms_norm_kernel(x, residual, weight, y, width, eps, stride_x, BLOCK: tl.constexpr):
    """Program t: residual row t += x row t, rounded to the residual's dtype, then normalised as stored."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    v = tl.load(x + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(residual + t * width + cols, mask=mask, other=0.0).to(tl.float32)
    total = (v + r).to(residual.dtype.element_ty)
    tl.store(residual + t * width + cols, total, mask=mask)
    w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
    out = _normalize(total.to(tl.float32), w, mask, width, eps)
    tl.store(y + t * width + cols, out.to(y.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_store_kv_kernel(
    qkv,
    cos,
    sin,
    positions,
    k_cache,
    v_cache,
    slots,
    stride_t,
    stride_p,
    stride_ks,
    stride_kh,
    NUM_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Program t: token t's q and k heads rotated in place, BLOCK_H heads a tile (a tile's rows are
    heads, its columns one half of each head's dims), its k heads stored rotated and its v heads copied
    to slot `slots[t]`."""
    t = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    rotated: tl.constexpr = NUM_HEADS + KV_HEADS
    row = qkv + t * stride_t
    pos = tl.load(positions + t)
    slot = tl.load(slots + t)
    cols = tl.arange(0, BLOCK_HALF)
    col_ok = cols < half
    # The position's cos/sin rows, loaded once for all heads.
    c1 = tl.load(cos + pos * stride_p + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos + pos * stride_p + half + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin + pos * stride_p + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin + pos * stride_p + half + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    heads = tl.arange(0, BLOCK_H)
    for h0 in tl.range(0, rotated, BLOCK_H):
        h = h0 + heads
        mask = (h < rotated)[:, None] & col_ok[None, :]
        first = row + h[:, None] * HEAD_DIM + cols[None, :]
        x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
        # Rounded to qkv's dtype once: the pool gets the values qkv holds.
        y1 = (x1 * c1 - x2 * s1).to(qkv.dtype.element_ty)
        y2 = (x2 * c2 + x1 * s2).to(qkv.dtype.element_ty)
        tl.store(first, y1, mask=mask)
        tl.store(first + half, y2, mask=mask)
        is_k = mask & (h >= NUM_HEADS)[:, None]
        dst = k_cache + slot * stride_ks + (h - NUM_HEADS)[:, None] * stride_kh + cols[None, :]
        tl.store(dst, y1.to(k_cache.dtype.element_ty), mask=is_k)
        tl.store(dst + half, y2.to(k_cache.dtype.element_ty), mask=is_k)
    dims = tl.arange(0, 2 * BLOCK_HALF)
    for h0 in tl.range(0, KV_HEADS, BLOCK_H):
        h = h0 + heads
        mask = (h < KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
        v = tl.load(row + (rotated + h)[:, None] * HEAD_DIM + dims[None, :], mask=mask)
        dst = v_cache + slot * stride_ks + h[:, None] * stride_kh + dims[None, :]
        tl.store(dst, v.to(v_cache.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up, out, inner, stride_g, stride_o, BLOCK: tl.constexpr):
    """Program (t, block): columns block * BLOCK .. of row t."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    gate = tl.load(gate_up + t * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up + t * stride_g + inner + cols, mask=mask, other=0.0).to(tl.float32)
    # x / (1 + e^-x): e^-x overflows to inf for x below about -88, and the quotient is then -0, not NaN.
    act = gate / (1.0 + tl.exp(-gate))
    tl.store(out + t * stride_o + cols, (act * up).to(out.dtype.element_ty), mask=mask)


def _check_rows(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or t.dtype not in DTYPES or (t.numel() > 0 and t.stride(1) != 1):
        raise ValueError(
            f"{name} must be [rows, width] in one of {DTYPES} with contiguous rows, got {tuple(t.shape)} "
            f"{t.dtype} strides {t.stride()}"
        )


def _check_weight(weight: torch.Tensor, width: int) -> None:
    if weight.dtype not in DTYPES or not weight.is_contiguous() or weight.numel() != width:
        raise ValueError(
            f"weight must be contiguous [{width}] in one of {DTYPES}, got {tuple(weight.shape)} "
            f"{weight.dtype}"
        )


class TritonFusedOps:
    """csrc/fused_ops.cpp's passes (argmax_rows aside) on CUDA tensors, plus `silu_mul`; see the top."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * x / rms(x) per row of `x [T, W]` (any row stride), a new contiguous tensor."""
        _check_rows(x, "x")
        rows, width = x.shape
        _check_weight(weight, width)
        y = torch.empty((rows, width), dtype=x.dtype, device=x.device)
        if rows > 0:
            block = triton.next_power_of_2(width)
            _rms_norm_kernel[(rows,)](
                x, weight, y, width, eps, x.stride(0), BLOCK=block, num_warps=_row_warps(block)
            )
        return y

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += x (in place, rounded to its dtype); returns rms_norm(residual) as a new tensor."""
        _check_rows(x, "x")
        rows, width = x.shape
        if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
            raise ValueError(
                f"residual must be contiguous {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} "
                f"{residual.dtype} strides {residual.stride()}"
            )
        _check_weight(weight, width)
        y = torch.empty_like(residual)
        if rows > 0:
            block = triton.next_power_of_2(width)
            _add_rms_norm_kernel[(rows,)](
                x, residual, weight, y, width, eps, x.stride(0), BLOCK=block, num_warps=_row_warps(block)
            )
        return y

    def rotary_store_kv_(
        self,
        qkv: torch.Tensor,
        num_heads: int,
        kv_heads: int,
        head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """Rotary in place on the q and k heads of `qkv [T, (num_heads + 2 kv_heads) * head_dim]` at
        `positions [T]` (rows of `cos`/`sin [max_positions, head_dim]`), then its k and v heads written
        to `k_cache`/`v_cache [S, kv_heads, head_dim]` at `slots [T]`."""
        _check_rows(qkv, "qkv")
        tokens = qkv.shape[0]
        if head_dim % 2 or qkv.shape[1] != (num_heads + 2 * kv_heads) * head_dim:
            raise ValueError(
                f"qkv rows of {qkv.shape[1]} are not {num_heads} + 2 x {kv_heads} heads of {head_dim} "
                "(an even size)"
            )
        if (
            cos.shape != sin.shape
            or cos.dim() != 2
            or cos.shape[1] != head_dim
            or cos.stride() != sin.stride()
        ):
            raise ValueError(
                f"cos/sin must be [positions, {head_dim}] alike, got {tuple(cos.shape)} strides "
                f"{cos.stride()} and {tuple(sin.shape)} strides {sin.stride()}"
            )
        if cos.dtype not in DTYPES or sin.dtype not in DTYPES or cos.stride(1) != 1:
            raise ValueError(
                f"cos/sin must have contiguous rows in one of {DTYPES}, got {cos.dtype}, {sin.dtype}"
            )
        for name, index in (("positions", positions), ("slots", slots)):
            if index.dtype != torch.int64 or index.shape != (tokens,) or not index.is_contiguous():
                raise ValueError(
                    f"{name} must be contiguous int64 [{tokens}], got {tuple(index.shape)} {index.dtype}"
                )
        if k_cache.dtype not in DTYPES or v_cache.dtype != k_cache.dtype:
            raise ValueError(
                f"k_cache and v_cache must share one of {DTYPES}, got {k_cache.dtype} and {v_cache.dtype}"
            )
        expected = (k_cache.shape[0], kv_heads, head_dim)
        if k_cache.shape != expected or v_cache.shape != expected:
            raise ValueError(
                f"k_cache and v_cache must be [slots, {kv_heads}, {head_dim}], got {tuple(k_cache.shape)} "
                f"and {tuple(v_cache.shape)}"
            )
        if not k_cache.is_contiguous() or not v_cache.is_contiguous():
            raise ValueError(
                f"k_cache and v_cache must be contiguous, got strides {k_cache.stride()}, {v_cache.stride()}"
            )
        if tokens == 0:
            return
        block_half = triton.next_power_of_2(head_dim // 2)
        # A tile of heads x half a head's dims: about 2048 values (16 a thread over 4 warps) per operand.
        block_h = min(triton.next_power_of_2(num_heads + kv_heads), max(1, 2048 // block_half))
        _rotary_store_kv_kernel[(tokens,)](
            qkv,
            cos,
            sin,
            positions,
            k_cache,
            v_cache,
            slots,
            qkv.stride(0),
            cos.stride(0),
            k_cache.stride(0),  # v_cache's too: both contiguous, of one shape (checked above)
            k_cache.stride(1),
            NUM_HEADS=num_heads,
            KV_HEADS=kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=block_h,
            BLOCK_HALF=block_half,
        )

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate_up[:, :I]) * gate_up[:, I:] of `gate_up [T, 2I]`, into `out [T, I]` (contiguous
        rows, gate_up's dtype; a new tensor if None); returns it."""
        _check_rows(gate_up, "gate_up")
        rows, width = gate_up.shape
        if width % 2:
            raise ValueError(f"gate_up's rows must be two halves, got width {width}")
        inner = width // 2
        if out is None:
            out = torch.empty((rows, inner), dtype=gate_up.dtype, device=gate_up.device)
        elif (
            out.shape != (rows, inner)
            or out.dtype != gate_up.dtype
            or (out.numel() > 0 and out.stride(1) != 1)
        ):
            raise ValueError(
                f"out must be [{rows}, {inner}] {gate_up.dtype} with contiguous rows, got {tuple(out.shape)} "
                f"{out.dtype} strides {out.stride()}"
            )
        if rows > 0 and inner > 0:
            _silu_mul_kernel[(rows, triton.cdiv(inner, SILU_BLOCK))](
                gate_up, out, inner, gate_up.stride(0), out.stride(0), BLOCK=SILU_BLOCK
            )
        return out
