"""Where the KV pool and the swap pool live.

The cachemgr owns both pools; this module is the one small interface that creates them, so that a
later step can back them by POSIX shared memory or a CUDA IPC handle without touching the cores.

Layout (see `kv_geometry`): `[layers_per_chunk, 2, num_chunks, page_size, kv_heads, head_dim]`; the swap
pool has the same layout with `num_slots` in place of `num_chunks`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.common.kv_geometry import RESERVED_CHUNKS, KVGeometry


@dataclass
class PoolMemory:
    kv: torch.Tensor
    swap: torch.Tensor | None

    def close(self) -> None:
        self.kv = torch.empty(0)
        self.swap = None


def pool_shape(geometry: KVGeometry, units: int) -> tuple[int, ...]:
    g = geometry
    return (g.layers_per_chunk, 2, units, g.page_size, g.num_kv_heads, g.head_dim)


def create_pool_memory(
    geometry: KVGeometry, num_chunks: int, swap_slots: int, dtype: torch.dtype, device: torch.device
) -> PoolMemory:
    # torch.empty: untouched pages of a large CPU pool are never committed. Only the reserved padding
    # chunks are read before being written (masked reads), and must hold finite values: 0 * NaN = NaN.
    kv = torch.empty(pool_shape(geometry, num_chunks), dtype=dtype, device=device)
    kv[:, :, :RESERVED_CHUNKS].zero_()
    swap = None
    if swap_slots:
        swap = torch.empty(pool_shape(geometry, swap_slots), dtype=dtype, device="cpu")
        if device.type == "cuda":
            swap = swap.pin_memory()  # async host<->device copies need page-locked memory
    return PoolMemory(kv=kv, swap=swap)
