"""The chunk pool: free chunks, refcounts, and the prefix index with lazy LRU eviction.

Allocation order is what keeps a CPU pool's memory bounded by its working set: pages of a host pool
are committed the first time they are written, so a chunk that was never handed out costs nothing
until it is. An allocation takes, in order: the most recently freed unhashed chunk (its pages are
committed and likely still in cache), then a never-touched chunk, and only then evicts the least
recently used cached prefix. Cached prefixes are thus evicted exactly when they were before (no
prefix hit is lost), while reused scratch pages keep the committed set from creeping up to the pool.

Invariants (checked by `check()`; the property tests call it after every step):
- every allocatable chunk is in exactly one of: `untouched` (never handed out), `free` (released
  without a hash), `evictable` (refcount 0, content and hash kept), or in use (refcount > 0);
- `hash_of` and `by_hash` are inverse maps; only chunks in use or evictable carry a hash;
- the reserved chunks `[0, RESERVED_CHUNKS)` are never handed out.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from services.common.kv_geometry import RESERVED_CHUNKS


class ChunkPool:
    def __init__(self, num_chunks: int) -> None:
        if num_chunks <= RESERVED_CHUNKS:
            raise ValueError(f"pool needs more than {RESERVED_CHUNKS} chunks, got {num_chunks}")
        self.num_chunks = num_chunks
        self.refcount = [0] * num_chunks
        self.untouched: deque[int] = deque(range(RESERVED_CHUNKS, num_chunks))
        self.free: list[int] = []  # a stack: the last one released is the first one reused
        # Oldest-released first: popitem(last=False) evicts the least recently used.
        self.evictable: OrderedDict[int, bytes] = OrderedDict()
        self.hash_of: dict[int, bytes] = {}
        self.by_hash: dict[bytes, int] = {}
        self.evicted: list[bytes] = []  # digests evicted since the owner last drained them

    @property
    def capacity(self) -> int:
        return self.num_chunks - RESERVED_CHUNKS

    @property
    def num_free(self) -> int:
        """Chunks an allocation can take now (never-used, unhashed, and evictable)."""
        return len(self.untouched) + len(self.free) + len(self.evictable)

    @property
    def num_committed(self) -> int:
        """Chunks handed out at least once (whose memory a host pool has committed)."""
        return self.capacity - len(self.untouched)

    @property
    def num_used(self) -> int:
        return self.capacity - self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take `n` chunks with refcount 1. The caller checks `num_free` first: asking for more is a bug."""
        if n > self.num_free:
            raise RuntimeError(f"allocate({n}) with only {self.num_free} free chunks")
        out = []
        for _ in range(n):
            if self.free:
                chunk = self.free.pop()
            elif self.untouched:
                chunk = self.untouched.popleft()
            else:
                chunk, digest = self.evictable.popitem(last=False)
                del self.hash_of[chunk], self.by_hash[digest]
                self.evicted.append(digest)
            self.refcount[chunk] = 1
            out.append(chunk)
        return out

    def share(self, chunk: int) -> None:
        """Take one more reference to a cached chunk (a prefix hit)."""
        if self.refcount[chunk] == 0:
            del self.evictable[chunk]
        self.refcount[chunk] += 1

    def release(self, chunks: list[int]) -> None:
        for chunk in chunks:
            if chunk < 0:
                continue  # a recycled sliding page
            count = self.refcount[chunk]
            if count <= 0:
                raise RuntimeError(f"release of chunk {chunk} with refcount {count}")
            self.refcount[chunk] = count - 1
            if count == 1:
                if chunk in self.hash_of:
                    self.evictable[chunk] = self.hash_of[chunk]
                else:
                    self.free.append(chunk)

    def drop_evictable(self) -> int:
        """Forget every cached chunk no request holds; returns how many."""
        dropped = len(self.evictable)
        for chunk, digest in self.evictable.items():
            del self.hash_of[chunk], self.by_hash[digest]
            self.evicted.append(digest)
            self.free.append(chunk)
        self.evictable.clear()
        return dropped

    def lookup(self, digest: bytes) -> int | None:
        return self.by_hash.get(digest)

    def register(self, chunk: int, digest: bytes) -> bool:
        """Record that `chunk` (in use, full, computed) holds the content named by `digest`; True if
        the cache gained it.

        A digest already owned by another chunk keeps its owner: the duplicate stays unhashed and
        returns to the free side when released.
        """
        if digest in self.by_hash or chunk in self.hash_of:
            return False
        self.hash_of[chunk] = digest
        self.by_hash[digest] = chunk
        return True

    def num_evictable_in(self, chunks: list[int]) -> int:
        return sum(1 for c in chunks if self.refcount[c] == 0)

    def check(self) -> None:
        untouched, free = set(self.untouched), set(self.free)
        if len(free) != len(self.free) or len(untouched) != len(self.untouched):
            raise AssertionError("duplicate chunk on a free list")
        evictable = set(self.evictable)
        in_use = {c for c in range(RESERVED_CHUNKS, self.num_chunks) if self.refcount[c] > 0}
        states = (untouched, free, evictable, in_use)
        if sum(map(len, states)) != len(set().union(*states)):
            raise AssertionError("a chunk is in two states at once")
        if sum(map(len, states)) != self.capacity:
            raise AssertionError("a chunk is in no state")
        handed_out = any(self.refcount[c] for c in range(RESERVED_CHUNKS))
        if handed_out or any(c < RESERVED_CHUNKS for c in free | untouched):
            raise AssertionError("a reserved chunk was handed out")
        if any(c in free or c in untouched for c in self.hash_of):
            raise AssertionError("a free chunk carries a hash")
        if any(self.by_hash.get(d) != c for c, d in self.hash_of.items()) or len(self.by_hash) != len(
            self.hash_of
        ):
            raise AssertionError("hash maps disagree")
        if any(self.evictable[c] != self.hash_of.get(c) for c in evictable):
            raise AssertionError("an evictable chunk lost its hash")
