"""The prefix cache's bookkeeping over requests' pages: the hash chain of each request's full pages,
the lookup of a cached prefix, the pages in flight, and the KV events routers are told.

The `ChunkPool` maps digests to chunks and evicts them; this module decides which digests are looked
up and registered, and announces them. A page's digest chains its parent's, the request's cache salt
and its token ids (`block_hash`).

Invariants:
- a page is hashed only once its KV is settled and every token id in it is known;
- `computing` holds the digests of the full pages of known ids granted and not settled yet, as noted
  since the step's start: an admission that misses on one of them waits for it to settle;
- every announced page is still cached (`check`); a salted page is never announced, so neither is its
  eviction;
- pages register only when a step starts (the BlockManager's `_settle`), so that a step's events
  store before they remove.
"""

from __future__ import annotations

import hashlib
from array import array

from services.cachemgr.cache_request import CacheRequest
from services.cachemgr.chunk_pool import ChunkPool
from services.common.cachemgr_messages import KvEvents, StoredBlock


def block_hash(parent: bytes, token_ids: list[int], salt: bytes) -> bytes:
    """Collision-resistant chained hash: a collision would hand one tenant another's KV."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(len(salt).to_bytes(4, "little"))  # length-prefixed: no salt can mimic a parent digest
    h.update(salt)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class PrefixCache:
    """`sharing`: prefix caching is on; without it nothing is hashed, looked up or announced."""

    def __init__(self, pool: ChunkPool, page_size: int, sharing: bool) -> None:
        self.pool = pool
        self.page_size = page_size
        self.sharing = sharing
        # The hashes of the full pages in flight (granted, not settled): see the module docstring.
        self.computing: set[bytes] = set()
        # KV events (see cachemgr_messages.KvEvents): the announced pages, in the order announced, so that
        # evicting a salted page (never announced) is not announced either, and so that a subscriber
        # joining late can be given the whole live set (`snapshot`).
        self._announced: dict[bytes, StoredBlock] = {}
        self._stored: list[StoredBlock] = []
        self._cleared = sharing

    def lookup(self, req: CacheRequest) -> tuple[list[int], bytes | None]:
        """Cached chunks for the longest prefix of full pages of known ids, leaving at least the last
        prompt token to compute (its logits are needed); and the hash of the page that missed (None:
        no page was left to look up)."""
        hits: list[int] = []
        parent = b""
        p = self.page_size
        for i in range(min(req.num_tokens - 1, len(req.token_ids)) // p):
            digest = block_hash(parent, req.token_ids[i * p : (i + 1) * p], req.salt)
            chunk = self.pool.lookup(digest)
            if chunk is None:
                return hits, digest
            hits.append(chunk)
            parent = digest
        return hits, None

    def note_computing(self, req: CacheRequest) -> None:
        """Count `req`'s granted full pages of known ids past its settled ones as in flight."""
        if not self.sharing:
            return
        p = self.page_size
        digest = req.block_hashes[-1] if req.block_hashes else b""
        for i in range(len(req.block_hashes), min(req.num_granted, len(req.token_ids)) // p):
            digest = block_hash(digest, req.token_ids[i * p : (i + 1) * p], req.salt)
            self.computing.add(digest)

    def register_full_pages(self, req: CacheRequest, table: list[int]) -> None:
        """Hash the active `req`'s full pages of settled KV and known ids not hashed yet, and cache
        them under the chunks of `table` (its first allocator's); an unsalted page newly cached is
        announced."""
        p = self.page_size
        for i in range(len(req.block_hashes), min(req.num_computed, len(req.token_ids)) // p):
            parent = req.block_hashes[-1] if req.block_hashes else b""
            tokens = req.token_ids[i * p : (i + 1) * p]
            digest = block_hash(parent, tokens, req.salt)
            req.block_hashes.append(digest)
            if self.pool.register(table[i], digest) and not req.salt:
                self._announced[digest] = StoredBlock(digest, parent, tokens)
                self._stored.append(self._announced[digest])

    def snapshot(self) -> KvEvents:
        """The live announced pages as one resync (`cleared`, then each page, parents first)."""
        return KvEvents(cleared=True, stored=list(self._announced.values()))

    def drain_events(self) -> KvEvents | None:
        """The events since the last drain: pages stored, then the announced pages the pool evicted
        (None: nothing happened)."""
        removed = [d for d in self.pool.evicted if self._announced.pop(d, None) is not None]
        self.pool.evicted.clear()
        if not (self._cleared or self._stored or removed):
            return None
        events = KvEvents(self._cleared, self._stored, removed)
        self._cleared, self._stored = False, []
        return events

    def check(self) -> None:
        if not self._announced.keys() <= self.pool.by_hash.keys():
            raise AssertionError("a page announced as cached is no longer cached")
