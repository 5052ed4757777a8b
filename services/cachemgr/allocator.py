"""Per-attention-type allocators drawing chunks from one shared ChunkPool.

Each allocator keeps, per request, a flat block table: `chunks_per_block` chunk ids per logical page
(page i of the request covers token positions `[i * page_size, (i + 1) * page_size)`). Sliding layers
only need the window, so pages that fell out of it are recycled (returned to the pool) and show as -1.
"""

from __future__ import annotations

from services.cachemgr.chunk_pool import ChunkPool

RECYCLED = -1


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class FullAttentionAllocator:
    """Keeps every page of a request. Supports prefix sharing (chunks may be shared, refcounted)."""

    supports_sharing = True

    def __init__(self, pool: ChunkPool, page_size: int, chunks_per_block: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self.k = chunks_per_block
        self.tables: dict[str, list[int]] = {}

    def chunks_needed(self, rid: str, end: int) -> int:
        """New chunks to hold tokens `[0, end)`."""
        have = len(self.tables.get(rid, ())) // self.k
        return max(0, pages_for(end, self.page_size) - have) * self.k

    def attach(self, rid: str, shared: list[int]) -> None:
        """Start a table with cached chunks (prefix hit); each gains a reference."""
        for chunk in shared:
            self.pool.share(chunk)
        self.tables[rid] = list(shared)

    def grow(self, rid: str, end: int) -> list[int]:
        """Allocate the chunks for tokens up to `end`; return the appended table entries."""
        new = self.pool.allocate(self.chunks_needed(rid, end))
        self.tables.setdefault(rid, []).extend(new)
        return new

    def recycle(self, rid: str, start: int) -> None:
        """Nothing to recycle: full attention reads every past token."""

    def live_chunks(self, rid: str) -> list[int]:
        return [c for c in self.tables.get(rid, ()) if c != RECYCLED]

    def release(self, rid: str) -> None:
        # Tail first: LRU then evicts a prefix's last pages before its first ones, so what stays
        # cached is still reachable (lookup walks from the first page and stops at a miss).
        self.pool.release(self.tables.pop(rid, [])[::-1])

    def detach(self, rid: str) -> list[int]:
        """Drop the table without releasing (the caller releases); returns it with RECYCLED holes."""
        return self.tables.pop(rid, [])

    def install(self, rid: str, table: list[int]) -> None:
        """Place a whole table whose chunks the caller already allocated (restore from swap)."""
        self.tables[rid] = table


class SlidingAttentionAllocator(FullAttentionAllocator):
    """Keeps only the pages a token at `start` or later can still see: positions `> start - window`.

    Pages wholly before that are recycled as soon as a step starts at `start`, so a request holds
    about `window / page_size + 1` pages plus its current chunk, whatever its length. Sliding
    blocks are never shared (the prefix cache is off for models with sliding layers).
    """

    supports_sharing = False

    def __init__(self, pool: ChunkPool, page_size: int, chunks_per_block: int, window: int) -> None:
        super().__init__(pool, page_size, chunks_per_block)
        self.window = window

    def first_live_position(self, start: int) -> int:
        return max(0, start - self.window + 1)

    def recycle(self, rid: str, start: int) -> None:
        table = self.tables.get(rid)
        if not table:
            return
        dead_pages = self.first_live_position(start) // self.page_size
        dead = table[: dead_pages * self.k]
        if any(c != RECYCLED for c in dead):
            self.pool.release(dead)
            table[: dead_pages * self.k] = [RECYCLED] * len(dead)
