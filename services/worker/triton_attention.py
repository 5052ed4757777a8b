"""Paged attention on GPUs in Triton, reading K/V in place from the pool through each request's slots.

Two entry points with the native CPU kernels' calling convention (services/worker/kernels.py's
`PagedDecode` / `PagedPrefill`, csrc/paged_attention.cpp), so that a CUDA batch can take them as its
`decode_kernel` / `prefill_kernel`:

- `decode(q, out, rows, k_cache, v_cache, slots, lengths, scale, softcap)`: one query token per request
  (packed row `rows[b]`) over its first `lengths[b]` keys, `slots[b, :lengths[b]]`. Split-K: the keys
  are cut into splits, one program per (request, kv head, split) writes a partial softmax (running max,
  sum, unnormalised output) into a workspace, and a second kernel merges the splits into `out`.
- `prefill(q, out, k_cache, v_cache, first_rows, num_queries, slots, lengths, scale, softcap, window)`:
  request b's query tokens are packed rows `first_rows[b] ..` `+ num_queries[b]`, the last of them sees
  all `lengths[b]` keys and each earlier one a key fewer; with `window > 0` each sees only its last
  `window` keys. One program per (request, query block, kv head), flash-attention style.

`q`/`out` are `[T, H, D]` (each head's dims contiguous, any token and head stride); `k_cache`/`v_cache`
`[num_slots, kv_heads, D]` float32, bfloat16 or float16; query head h reads kv head h // (H // kv_heads).
Each program holds all query heads of its kv head in one tile (GQA: each K/V row is loaded once for the
group). Softmax runs online in float32; `softcap > 0` caps the scaled scores at softcap * tanh(s / softcap).

Nothing here reads a device value on the host or branches on one in Python: launch grids come from
tensor shapes and Python ints only, so both entry points can run under CUDA-graph capture once their
kernels are compiled (the first call of each shape class compiles; warm up before capturing). For the
same reason the index values are trusted, unlike the native kernels' host-side checks: rows within T,
lengths within L, a chunk's queries within its keys are the caller's to hold.
"""

from __future__ import annotations

import os

import torch
import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]

POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A tile holds the queries' and each key block's full head: past 256 dims it no longer fits registers.
MAX_HEAD_DIM = 256
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _dot_type(q_dtype: torch.dtype, pool_dtype: torch.dtype) -> tuple[object, str]:
    """The dots' operand type and input precision. Same 16-bit type on both sides: tensor-core dots in
    that type (probabilities rounded to it before P @ V, as FlashAttention does); otherwise float32, in
    IEEE precision, since TF32 would keep only 10 mantissa bits of fp32 queries. Triton 3.9's interpreter
    multiplies bfloat16 operands as their raw 16-bit integers (interpreter.py create_dot), so under it
    bfloat16 dots take the operands widened to float32, which hold every bfloat16 value exactly."""
    if q_dtype == pool_dtype and q_dtype != torch.float32:
        if not (q_dtype == torch.bfloat16 and _interpreting()):
            return _TL_DTYPES[q_dtype], "tf32"  # the precision applies to fp32 operands only
    return tl.float32, "ieee"


@triton.jit
def _scores(q, k, scale, softcap, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """Scaled (and capped) scores of the query tile `q [M, D]` against the key tile `k [N, D]`, in the
    base-2 exponent domain (times log2(e)), so that the softmax can use exp2."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    if SOFTCAP:
        # tanh from one exp of a non-positive argument: no overflow, and no tanh needed from libdevice
        # (which the interpreter lacks).
        e = tl.exp(-2.0 * tl.abs(s) / softcap)
        t = (1.0 - e) / (1.0 + e)
        s = softcap * tl.where(s < 0, -t, t)
    return s * 1.4426950408889634


@triton.jit
def _online_softmax_step(s, v, m, total, acc, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """Fold one key block's scores `s [M, N]` (masked keys at -inf) and values `v [N, D]` into the running
    max `m`, sum `total` and unnormalised output `acc`. A row whose keys so far are all masked keeps m = -inf:
    its exponents are taken against 0 instead, so that they come out 0 and never NaN."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_base)
    p = tl.exp2(s - m_base[:, None])
    total = total * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v, input_precision=PRECISION)
    return m_new, total, acc


@triton.jit
def _decode_split_kernel(
    q,
    rows,
    k_cache,
    v_cache,
    slots,
    lengths,
    part_acc,
    part_max,
    part_sum,
    scale,
    softcap,
    keys_per_split,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_sb,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (b, kv head, split): the GROUP query heads of request b over its keys of this split."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP
    num_splits = tl.num_programs(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    row = tl.load(rows + b)
    qt = tl.load(
        q + row * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT)
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, tl.load(lengths + b).to(tl.int32))
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < end
        # The in-place read: each key's row is found through its slot, no gathered copy.
        slot = tl.load(slots + b * stride_sb + j, mask=j_ok, other=0).to(tl.int64)
        kv_ok = j_ok[:, None] & d_ok[None, :]
        kt = tl.load(
            k_cache + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_ok, other=0.0
        )
        s = _scores(qt, kt.to(DOT), scale, softcap, SOFTCAP, PRECISION)
        s = tl.where(j_ok[None, :], s, float("-inf"))
        vt = tl.load(
            v_cache + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_ok, other=0.0
        )
        m, total, acc = _online_softmax_step(s, vt.to(DOT), m, total, acc, DOT, PRECISION)
    # Partials [B, H, splits] (max, sum) and [B, H, splits, D] (output); an empty split leaves -inf, 0, 0.
    part = (b * num_heads + heads) * num_splits + split
    tl.store(part_max + part, m, mask=g_ok)
    tl.store(part_sum + part, total, mask=g_ok)
    tl.store(part_acc + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@triton.jit
def _decode_reduce_kernel(
    out,
    rows,
    part_acc,
    part_max,
    part_sum,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (b, query head): merge the splits' partial softmaxes and write the row's output."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NUM_SPLITS
    d_ok = d < HEAD_DIM
    part = (b * num_heads + h) * NUM_SPLITS + s
    ms = tl.load(part_max + part, mask=s_ok, other=float("-inf"))
    ls = tl.load(part_sum + part, mask=s_ok, other=0.0)
    top = tl.max(ms, 0)
    w = tl.exp2(ms - tl.where(top == float("-inf"), 0.0, top))
    total = tl.sum(w * ls, 0)
    acc = tl.load(
        part_acc + part[:, None] * HEAD_DIM + d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0
    )
    # A request with no keys (lengths[b] == 0, e.g. a row padding a captured graph's batch) gets zeros.
    o = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    row = tl.load(rows + b)
    tl.store(out + row * stride_ot + h * stride_oh + d, o.to(out.dtype.element_ty), mask=d_ok)


@triton.jit
def _prefill_kernel(
    q,
    out,
    k_cache,
    v_cache,
    first_rows,
    num_queries,
    slots,
    lengths,
    scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_sb,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Program (b, query block, kv head): BLOCK_M query tokens of request b times the GROUP query heads
    of the kv head, one tile of BLOCK_M * BLOCK_G rows (token-major), over the keys they may see."""
    b = tl.program_id(0)
    x0 = tl.program_id(1) * BLOCK_M
    kvh = tl.program_id(2)
    nq = tl.load(num_queries + b).to(tl.int32)
    if x0 >= nq:  # the grid covers the longest chunk; shorter ones leave their last blocks idle
        return
    length = tl.load(lengths + b).to(tl.int32)
    first = tl.load(first_rows + b).to(tl.int64)
    i = tl.arange(0, BLOCK_M * BLOCK_G)
    x = x0 + i // BLOCK_G
    g = i % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    row_ok = (x < nq) & (g < GROUP)
    d_ok = d < HEAD_DIM
    heads = kvh * GROUP + g
    qt = tl.load(
        q + (first + x)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(DOT)
    # Query x sits at key position pos = length - nq + x and sees keys (pos - span, pos]; without a
    # window the span is the whole context.
    pos = length - nq + x
    span = tl.where(window > 0, window, length)
    lo = tl.maximum(length - nq + x0 - span + 1, 0)
    hi = tl.minimum(length - nq + x0 + BLOCK_M, length)
    m = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < hi
        slot = tl.load(slots + b * stride_sb + j, mask=j_ok, other=0).to(tl.int64)
        kv_ok = j_ok[:, None] & d_ok[None, :]
        kt = tl.load(
            k_cache + slot[:, None] * stride_ks + kvh * stride_kh + d[None, :], mask=kv_ok, other=0.0
        )
        s = _scores(qt, kt.to(DOT), scale, softcap, SOFTCAP, PRECISION)
        seen = (j[None, :] <= pos[:, None]) & (j[None, :] > pos[:, None] - span) & j_ok[None, :]
        s = tl.where(seen & row_ok[:, None], s, float("-inf"))
        vt = tl.load(
            v_cache + slot[:, None] * stride_vs + kvh * stride_vh + d[None, :], mask=kv_ok, other=0.0
        )
        m, total, acc = _online_softmax_step(s, vt.to(DOT), m, total, acc, DOT, PRECISION)
    o = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(
        out + (first + x)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        o.to(out.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def _check(q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Shapes, dtypes and strides the kernels assume (host metadata only); returns the GQA group size."""
    if q.dim() != 3 or out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(
            f"q and out must be [T, H, D] of one dtype, got {tuple(q.shape)} {q.dtype} and "
            f"{tuple(out.shape)} {out.dtype}"
        )
    if q.dtype not in POOL_DTYPES:
        raise ValueError(f"q must be one of {POOL_DTYPES}, got {q.dtype}")
    if k_cache.dtype not in POOL_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache must share one of {POOL_DTYPES}, got {k_cache.dtype} and {v_cache.dtype}"
        )
    head_dim = q.shape[2]
    if k_cache.dim() != 3 or v_cache.shape != k_cache.shape or k_cache.shape[2] != head_dim:
        raise ValueError(
            f"k_cache and v_cache must be [num_slots, kv_heads, {head_dim}], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head size {head_dim} is over the {MAX_HEAD_DIM} a tile holds")
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(2) != 1:
            raise ValueError(f"{name}'s head dims must be contiguous, got strides {t.stride()}")
    if q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not share {k_cache.shape[1]} kv heads")
    return q.shape[1] // k_cache.shape[1]


def _check_index(slots: torch.Tensor, **per_request: torch.Tensor) -> int:
    """The index tensors' shapes and types (not their values: that would read the device); returns B."""
    if slots.dim() != 2 or slots.stride(1) != 1:
        raise ValueError(
            f"slots must be [B, L] with contiguous rows, got {tuple(slots.shape)} {slots.stride()}"
        )
    batch = slots.shape[0]
    for name, t in (("slots", slots), *per_request.items()):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got {t.dtype}")
        if name != "slots" and t.shape != (batch,):
            raise ValueError(f"{name} must be [{batch}], got {tuple(t.shape)}")
    return batch


def _pow2(n: int, least: int = 16) -> int:
    """A tile side of at least `least` (tl.dot's smallest) covering n."""
    return max(least, triton.next_power_of_2(n))


def decode(
    q: torch.Tensor,
    out: torch.Tensor,
    rows: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    softcap: float,
    *,
    keys_per_split: int = 256,
    max_splits: int = 32,
    block_keys: int = 32,
    num_warps: int = 4,
) -> None:
    """Attention of each request's query token (packed row `rows[b]`) over its first `lengths[b]` keys,
    `slots[b, :lengths[b]]` (`slots [B, L]`, padded past `lengths[b]`), written into `out`'s rows `rows`;
    other rows of `out` are left alone. `softcap <= 0`: none.

    The keys are cut into min(ceil(L / keys_per_split), max_splits) splits of a multiple of `block_keys`
    keys each (from L, the padded width, so that a captured graph's grid holds for any lengths); the
    splits' partials go to a float32 workspace allocated here (on the caching allocator, which a graph
    capture serves from its pool). `num_warps` is per program of the split pass."""
    group = _check(q, out, k_cache, v_cache)
    batch = _check_index(slots, rows=rows, lengths=lengths)
    width, kv_heads, head_dim = slots.shape[1], k_cache.shape[1], q.shape[2]
    if batch == 0:
        return
    num_splits = max(1, min(max_splits, triton.cdiv(width, keys_per_split)))
    split_keys = triton.cdiv(triton.cdiv(width, num_splits), block_keys) * block_keys
    heads = q.shape[1]
    part_acc = torch.empty(batch, heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(batch, heads, num_splits, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    dot, precision = _dot_type(q.dtype, k_cache.dtype)
    block_d = _pow2(head_dim)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q,
        rows,
        k_cache,
        v_cache,
        slots,
        lengths,
        part_acc,
        part_max,
        part_sum,
        scale,
        softcap,
        split_keys,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        slots.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=_pow2(group),
        BLOCK_D=block_d,
        BLOCK_N=block_keys,
        SOFTCAP=softcap > 0,
        DOT=dot,
        PRECISION=precision,
        num_warps=num_warps,
    )
    _decode_reduce_kernel[(batch, heads)](
        out,
        rows,
        part_acc,
        part_max,
        part_sum,
        out.stride(0),
        out.stride(1),
        NUM_SPLITS=num_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d,
    )


def prefill(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    first_rows: torch.Tensor,
    num_queries: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    softcap: float,
    window: int,
    *,
    max_queries: int | None = None,
    block_rows: int = 64,
    block_keys: int = 32,
    num_warps: int = 8,
) -> None:
    """Causal attention of each request's chunk (packed rows `first_rows[b] .. + num_queries[b]`) over
    its first `lengths[b]` keys `slots[b]`, written into `out`'s rows of the chunks; other rows are left
    alone. `softcap <= 0`: none; `window > 0`: each query sees only its last `window` keys.

    `max_queries`, a Python int, bounds every `num_queries[b]`: the grid has ceil(max_queries /
    query block) blocks per request, and the blocks past a shorter chunk return at once. The caller
    knows it from its host-side schedule; left None it is T (q's packed tokens), which is always enough
    and wastes idle programs on batches of many short chunks. A query block is `block_rows` tile rows
    (its query tokens times the kv head's query heads, the latter padded to a power of two). Eight
    warps, not Triton's four: compiled for sm_90, a 64-row tile of 128-dim heads spilled registers at
    four (to the stack: bf16 a little, fp32 over 1 KB a thread) and spills none at eight."""
    group = _check(q, out, k_cache, v_cache)
    batch = _check_index(slots, first_rows=first_rows, num_queries=num_queries, lengths=lengths)
    if window < 0:
        raise ValueError(f"window must be 0 (none) or positive, got {window}")
    queries = q.shape[0] if max_queries is None else max_queries
    if batch == 0 or queries == 0:
        return
    block_g = triton.next_power_of_2(group)
    # The tile must be at least 16 rows (tl.dot's smallest), and a power of two.
    block_m = max(1, _pow2(block_rows) // block_g, 16 // block_g)
    kv_heads, head_dim = k_cache.shape[1], q.shape[2]
    dot, precision = _dot_type(q.dtype, k_cache.dtype)
    _prefill_kernel[(batch, triton.cdiv(queries, block_m), kv_heads)](
        q,
        out,
        k_cache,
        v_cache,
        first_rows,
        num_queries,
        slots,
        lengths,
        scale,
        softcap,
        window,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        slots.stride(0),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_G=block_g,
        BLOCK_D=_pow2(head_dim),
        BLOCK_N=block_keys,
        SOFTCAP=softcap > 0,
        DOT=dot,
        PRECISION=precision,
        num_warps=num_warps,
    )
