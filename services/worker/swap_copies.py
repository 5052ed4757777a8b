"""Swap copies: the bytes of offloaded chunks between the KV pool and the swap pool, as a grant lists them.

The cachemgr decides which chunk goes to which swap slot; the worker moves the bytes before the
forward that may reuse the chunks, swap-out before swap-in (`SwapSpace` relies on that order).

On the CPU: one gather and one scatter per direction, in place.

On CUDA: on a side stream of their own, so that the host goes on building the step meanwhile. The side
stream first waits for the forwards already queued (they wrote the victims' KV), and the next forward
waits for the copies. The swap pool is page-locked host memory (pinned by the in-process pool, or
registered by the worker that maps the cachemgr's, see pool_memory.py), and each copy moves a run of
consecutive slots of one plane (a layer slot's K or V), contiguous on both sides: one asynchronous DMA,
where a strided host side would be staged through pageable memory and waited for.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import nullcontext

import torch


def slot_runs(slots: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """`(first index, count, first slot)` of each run of consecutive slots, in list order."""
    first = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            yield first, i - first, slots[first]
            first = i


class SwapCopies:
    """`by_planes` (default: on a CUDA pool) copies plane by plane as CUDA does, which tests can also
    ask for on the CPU."""

    def __init__(self, kv_pool: torch.Tensor, swap_pool: torch.Tensor | None, by_planes: bool | None = None):
        self.kv_pool = kv_pool
        self.swap_pool = swap_pool
        self.device = kv_pool.device
        self.by_planes = kv_pool.is_cuda if by_planes is None else by_planes
        self.stream = torch.cuda.Stream(self.device) if kv_pool.is_cuda else None
        # (layer slot, K/V) of the pool layout [layers_per_chunk, 2, chunks, page, kv_heads, row_elems]
        self.planes = [(layer, kv) for layer in range(kv_pool.shape[0]) for kv in range(2)]

    def copy(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> None:
        """`swap_out`: (chunk, slot) pairs; `swap_in`: (slot, chunk) pairs, copied after them."""
        if not swap_out and not swap_in:
            return
        if self.swap_pool is None:
            raise RuntimeError("the grant asks for swap copies but there is no swap pool")
        if not self.by_planes:
            self._in_place(self.swap_pool, swap_out, swap_in)
            return
        stream = self.stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if swap_out:
                self._out(self.swap_pool, swap_out)
            if swap_in:
                self._in(self.swap_pool, swap_in)
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)

    def _in_place(
        self, swap: torch.Tensor, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]
    ) -> None:
        if swap_out:
            chunks = torch.tensor([c for c, _ in swap_out], device=self.device)
            slots = torch.tensor([s for _, s in swap_out])
            swap.index_copy_(2, slots, self.kv_pool.index_select(2, chunks).to("cpu"))
        if swap_in:
            slots = torch.tensor([s for s, _ in swap_in])
            chunks = torch.tensor([c for _, c in swap_in], device=self.device)
            self.kv_pool.index_copy_(2, chunks, swap.index_select(2, slots).to(self.device))

    def _out(self, swap: torch.Tensor, swap_out: Sequence[tuple[int, int]]) -> None:
        chunks = torch.tensor([c for c, _ in swap_out], device=self.device)
        staged = self.kv_pool.index_select(2, chunks)  # on this stream: reused only after the copies
        for first, count, slot in slot_runs([s for _, s in swap_out]):
            for plane in self.planes:
                swap[plane][slot : slot + count].copy_(
                    staged[plane][first : first + count], non_blocking=True
                )

    def _in(self, swap: torch.Tensor, swap_in: Sequence[tuple[int, int]]) -> None:
        shape = list(self.kv_pool.shape)
        shape[2] = len(swap_in)
        staged = torch.empty(shape, dtype=self.kv_pool.dtype, device=self.device)
        for first, count, slot in slot_runs([s for s, _ in swap_in]):
            for plane in self.planes:
                staged[plane][first : first + count].copy_(
                    swap[plane][slot : slot + count], non_blocking=True
                )
        chunks = torch.tensor([c for _, c in swap_in], device=self.device)
        self.kv_pool.index_copy_(2, chunks, staged)
