"""Paged attention over a ragged batch, registered with transformers' attention interface.

Stock transformers decoders call `paged_attention(module, q, k, v, ...)` for every layer; the step's
`AttentionBatch` arrives through the forward kwargs (`cb_batch=`). All scheduled tokens are packed in
one sequence (batch axis 1). For each layer we:

1. write the new K/V of every token into its KV slot in the paged pool;
2. attend the decode rows (one query token each) as one batch;
3. attend the prefill chunks (several query tokens each).

Kernels read each context in place from the pool, one call for the decode rows and one for all
prefill chunks: on the CPU in float32 the native ones (csrc/paged_attention.cpp), on a GPU the Triton
ones (triton_attention.py); attention_kernels.py chooses. Without them each row group gathers its
context into a padded batch and calls SDPA with a mask. Either way Python work per layer is constant,
and attention cost follows the tokens each request really reads; there is no mask over the whole
packed batch.

Grouped-query attention is folded into the query axis (`[B, kv_heads, group * q, D]`) so K/V are never
repeated per query head.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from services.common.kv_int8 import KV_INT8, from_pool, round_queries, to_pool
from services.worker.kernels import PagedDecode, PagedPrefill

ATTENTION_NAME = "cbserve_paged"


@dataclass
class RowGroup:
    """Requests attended together: query rows (packed-token indices) and the KV slots they read.

    `rows` is `[B * Q]` (padded query positions point at row 0); where some are padded, `kept` holds
    the `[B * Q]` positions that are real and `kept_rows` their packed rows, both built on the host, so
    that no layer selects them with a boolean mask (each would wait for the device); `bias`
    is the additive mask `[B, 1, group * Q, L]`: 0 where a query may attend, -inf elsewhere (already
    folded for GQA; built once per step, since SDPA would convert a boolean mask in every layer), or
    None for decode rows that the native decode kernel attends (it reads `lengths`, not a mask).
    `slots[view]` is `[B * L]`: pool slots in that view, padding slot where masked.
    """

    rows: torch.Tensor
    kept: torch.Tensor | None  # None: every row is real
    kept_rows: torch.Tensor | None
    num_queries: int  # Q
    num_keys: int  # L
    bias: torch.Tensor | None
    lengths: torch.Tensor  # [B]: keys each request really reads (the rest of its L is padding)
    slots: dict[tuple[int, int], torch.Tensor]


@dataclass
class RaggedPrefill:
    """Prefill chunks that the native kernel attends in place, with no padding and no mask.

    Request b's query tokens are the packed rows `first_rows[b] .. first_rows[b] + num_queries[b]`; its
    keys are the first `lengths[b]` entries of `slots[view][b]` (`[B, L]`), the last query token sees
    them all and each earlier one a key fewer; with a sliding `window` (0: none) only its last
    `window` keys. `max_queries` is the most of any request, known on the host (a GPU kernel's launch
    grid is sized by it).
    """

    first_rows: torch.Tensor
    num_queries: torch.Tensor
    lengths: torch.Tensor
    slots: dict[tuple[int, int], torch.Tensor]
    window: int
    max_queries: int


@dataclass
class AttentionBatch:
    """Per-step attention metadata, shared by all layers of the forward.

    `write_slots[view]` is `[T]`: where each packed token's K/V goes in that view. A view is an
    (allocator group, chunk index within the block) pair; `views_of_layer[l]` names layer l's view and
    `kv_of_layer[l]` its flat `(K, V)` slot arrays `[num_chunks * page_size, kv_heads, row_elems]`
    (head_dim, and an int8 pool's scales: common/kv_int8.py).
    """

    num_tokens: int
    write_slots: dict[tuple[int, int], torch.Tensor]
    groups: dict[int, list[RowGroup]]  # per allocator group: decode and prefill row groups
    views_of_layer: list[tuple[int, int]]
    kv_of_layer: list[tuple[torch.Tensor, torch.Tensor]]
    decode_kernel: PagedDecode | None = None  # native one-query attention reading the pool in place
    prefill: dict[int, RaggedPrefill] = field(default_factory=dict)  # per allocator group
    prefill_kernel: PagedPrefill | None = None

    def kv_target(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer `layer`'s K and V slot arrays and, per packed token, the slot its K/V goes to."""
        k_cache, v_cache = self.kv_of_layer[layer]
        return k_cache, v_cache, self.write_slots[self.views_of_layer[layer]]


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    # Logit soft-capping (Gemma2) has no fused kernel: do it by hand.
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap + bias
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def attend_paged(
    batch: AttentionBatch,
    layer: int,
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """One layer's attention for the packed tokens: `q [T, H, D]`, `key`/`value [T, kv_heads, D]`
    (rows may be strided) -> `[T, H, D]`. Writes the new K/V into the pool first."""
    k_cache, v_cache, slots = batch.kv_target(layer)
    # The pool's dtype may differ from the model's, and int8 rows carry their scale.
    k_cache.index_copy_(0, slots, to_pool(key, k_cache.dtype))
    v_cache.index_copy_(0, slots, to_pool(value, v_cache.dtype))
    return attend_stored(batch, layer, q, scale, softcap)


def attend_stored(
    batch: AttentionBatch, layer: int, q: torch.Tensor, scale: float, softcap: float | None = None
) -> torch.Tensor:
    """`attend_paged` for a layer whose new K/V the caller already wrote into the pool."""
    view = batch.views_of_layer[layer]
    k_cache, v_cache = batch.kv_of_layer[layer]
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    group = num_heads // kv_heads

    native = batch.decode_kernel is not None or batch.prefill_kernel is not None
    if native and q.stride(1) != head_dim:
        q = q.contiguous()  # the native kernels want each token's heads adjacent; transformers' are not
    out = q.new_zeros(q.shape)
    groups = batch.groups[view[0]]
    # Gathered rows read an int8 pool's queries rounded as the native kernels read them.
    if k_cache.dtype == KV_INT8 and any(rg.bias is not None for rg in groups):
        gathered_q = round_queries(q)
    else:
        gathered_q = q
    for rg in groups:
        b, kv_len = rg.lengths.shape[0], rg.num_keys
        nq = rg.num_queries
        slots = rg.slots[view]
        if rg.bias is None:  # decode rows for the native kernel
            if batch.decode_kernel is None:
                raise RuntimeError("a row group without a mask needs the native decode kernel; none is built")
            # Decode rows: read each context once, in place, instead of gathering a padded copy.
            batch.decode_kernel(
                q, out, rg.rows, k_cache, v_cache, slots.view(b, kv_len), rg.lengths, scale, softcap or 0.0
            )
            continue
        # [B*Q, H, D] -> [B, kv, group*Q, D]: query head h uses kv head h // group.
        # index_select, not advanced indexing: measured 2.3x faster for a 4000-key gather.
        qg = gathered_q.index_select(0, rg.rows).view(b, nq, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(b, kv_heads, group * nq, head_dim)
        kg = (
            from_pool(k_cache.index_select(0, slots), q.dtype)
            .view(b, kv_len, kv_heads, head_dim)
            .transpose(1, 2)
        )
        vg = (
            from_pool(v_cache.index_select(0, slots), q.dtype)
            .view(b, kv_len, kv_heads, head_dim)
            .transpose(1, 2)
        )
        res = _attend(qg, kg, vg, rg.bias, scale, softcap)
        res = (
            res.view(b, kv_heads, group, nq, head_dim)
            .permute(0, 3, 1, 2, 4)
            .reshape(b * nq, num_heads, head_dim)
        )
        if rg.kept is None:
            out.index_copy_(0, rg.rows, res)
        else:
            assert rg.kept_rows is not None  # set with `kept`
            out.index_copy_(0, rg.kept_rows, res.index_select(0, rg.kept))
    ragged = batch.prefill.get(view[0])
    if ragged is not None and batch.prefill_kernel is not None:
        batch.prefill_kernel(
            q,
            out,
            k_cache,
            v_cache,
            ragged.first_rows,
            ragged.num_queries,
            ragged.slots[view],
            ragged.lengths,
            scale,
            softcap or 0.0,
            ragged.window,
            max_queries=ragged.max_queries,
        )
    return out


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    cb_batch: AttentionBatch | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: `query [1, H, T, D]` -> `[1, T, H, D]`."""
    if cb_batch is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs the step's AttentionBatch (cb_batch=)")
    q = query[0].transpose(0, 1)
    scale = scaling if scaling is not None else q.shape[2] ** -0.5
    layer = cast(int, module.layer_idx)  # transformers' attention modules carry their layer's index
    out = attend_paged(cb_batch, layer, q, key[0].transpose(0, 1), value[0].transpose(0, 1), scale, softcap)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, paged_attention)
