"""Offload: choosing victims when running requests are blocked, moving a victim's live chunks to
swap slots, and restoring them. Bookkeeping only: the grant's swap copies tell the worker which
bytes to move (`swap_out` pairs (chunk, slot), `swap_in` pairs (slot, chunk)).

A victim whose live chunks do not fit the free swap slots is not moved: the BlockManager soft-resets
it instead (forgets it; its full pages stay in the prefix cache for the re-prefill).

Invariants:
- victims are the fewest requests, newest first, whose chunks cover the blocked demand; never a
  request placed in this step, never the last active request;
- an offloaded request's slot layout keeps its tables' shape: recycled pages (-1) stay holes, and
  every live chunk has one slot (`SwapSpace.held`);
- a restore is all or nothing: it happens only if its live chunks and its growth fit the free pool;
  the slots it reads stay draining until the step ends (the worker copies swap-out before swap-in).
"""

from __future__ import annotations

from collections.abc import Iterator

from services.cachemgr.allocator import FullAttentionAllocator, pages_for
from services.cachemgr.cache_request import CacheRequest, CacheState
from services.cachemgr.chunk_pool import ChunkPool
from services.cachemgr.swap_space import SwapSpace


class Offloader:
    def __init__(
        self, pool: ChunkPool, swap: SwapSpace, allocators: list[FullAttentionAllocator], page_size: int
    ) -> None:
        self.pool = pool
        self.swap = swap
        self.allocators = allocators
        self.page_size = page_size

    def choose_victims(
        self, active: list[CacheRequest], demand: dict[str, int], placed: set[str]
    ) -> list[CacheRequest]:
        """Fewest requests, newest first, whose blocks cover the blocked demand (new chunks per blocked
        request id).

        Never a request placed in this step, never the last active request. A blocked request may be
        its own victim (its demand then disappears with it).
        """
        shortfall = sum(demand.values()) - self.pool.num_free
        candidates = sorted(
            (r for r in active if r.request_id not in placed), key=lambda r: r.arrival, reverse=True
        )
        victims: list[CacheRequest] = []
        for victim in candidates:
            if shortfall <= 0 or len(active) - len(victims) <= 1:
                break
            victims.append(victim)
            shortfall -= demand.get(victim.request_id, 0) + self._exclusive_chunks(victim.request_id)
        return victims

    def _exclusive_chunks(self, rid: str) -> int:
        return sum(1 for a in self.allocators for c in a.live_chunks(rid) if self.pool.refcount[c] == 1)

    def swap_out(self, req: CacheRequest, moves: list[tuple[int, int]]) -> bool:
        """Move the active `req`'s live chunks to swap slots, recording the copies in `moves`; it is
        offloaded then. False: they do not fit the free slots (or there are none), and it still holds
        them, its pages no later step reads recycled."""
        rid = req.request_id
        for alloc in self.allocators:
            alloc.recycle(rid, req.num_granted)  # pages no later step reads are not worth saving
        live = [c for a in self.allocators for c in a.live_chunks(rid)]
        if not live or self.swap.num_free < len(live):
            return False
        slots = iter(self.swap.take(len(live)))
        layout = []
        for alloc in self.allocators:
            table = alloc.detach(rid)
            layout.append(relocate(table, slots, moves))
            self.pool.release(table[::-1])
        self.swap.held[rid] = layout
        req.state = CacheState.OFFLOADED
        return True

    def swap_in(self, req: CacheRequest, end: int, moves: list[tuple[int, int]]) -> bool:
        """Bring the offloaded `req`'s chunks back into fresh ones, recording the copies in `moves`, and
        grow its tables to hold tokens `[0, end)`; it is active then. False: that does not fit the free
        pool, and nothing changed."""
        layout = self.swap.held[req.request_id]
        live = sum(1 for table in layout for s in table if s >= 0)
        growth = 0
        for alloc, table in zip(self.allocators, layout, strict=True):
            growth += max(0, pages_for(end, self.page_size) - len(table) // alloc.k) * alloc.k
        if live + growth > self.pool.num_free:
            return False
        self.swap.give_back(req.request_id, read_this_step=True)
        fresh = iter(self.pool.allocate(live))
        for alloc, slots in zip(self.allocators, layout, strict=True):
            alloc.install(req.request_id, relocate(slots, fresh, moves))
            alloc.grow(req.request_id, end)
        req.state = CacheState.ACTIVE
        return True


def relocate(table: list[int], fresh: Iterator[int], moves: list[tuple[int, int]]) -> list[int]:
    """Give each live entry of `table` the next id from `fresh`, keep recycled holes, and record every
    (old, new) pair in `moves` (a swap copy list)."""
    out = []
    for old in table:
        if old < 0:
            out.append(old)
            continue
        new = next(fresh)
        moves.append((old, new))
        out.append(new)
    return out
