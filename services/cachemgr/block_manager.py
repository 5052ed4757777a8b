"""BlockManager: the cachemgr's pure core. One `step(plan) -> grant` call per worker step.

It owns block tables, the prefix index, refcounts, eviction and offload decisions; it never touches KV
bytes (the worker copies them as the grant says). No sockets, no tensors.

Request states here: *pending* (known, no blocks yet), *active* (holds blocks), *offloaded* (its
blocks live in swap slots). A request the BlockManager soft-resets or releases is forgotten.

A grant *settles* (its tokens count as computed, its full pages enter the prefix cache) when the next
plan arrives, or with async batching (`StepPlan.overlapped`) the plan after that: the worker plans
step N+1 while step N computes. Until then it is *in flight*; the next grant starts after it.

An admission whose next uncached page is in flight for another request waits: it hits that page once
it settles, a step later, instead of computing the same KV again in the meantime. A burst of requests
behind one shared prompt (a system prompt, a few-shot preamble) so computes the prompt once, as
SGLang's in-batch prefix check does; the budget it would have spent on the copy goes to others.

Invariants (see `check`):
- every chunk's refcount equals the number of table entries naming it across all requests;
- an active request's tables cover every token it has computed or is computing;
- a page is hashed only once its KV is settled and every token id in it is known;
- admission is all-or-nothing across allocators: a refused request holds nothing;
- the last active request is never offloaded; requests placed in this step keep their blocks;
- a step is all or nothing: a plan it refuses (ValueError) has changed nothing, not even a count.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum

from services.cachemgr.allocator import FullAttentionAllocator, SlidingAttentionAllocator, pages_for
from services.cachemgr.chunk_pool import ChunkPool
from services.cachemgr.swap_space import SwapSpace
from services.common.cachemgr_messages import (
    PROTOCOL_VERSION,
    Flushed,
    Granted,
    KvEvents,
    PlanEntry,
    Rejected,
    StepGrant,
    StepPlan,
    StoredBlock,
)
from services.common.kv_geometry import KVGeometry


class CacheState(Enum):
    PENDING = "pending"
    ACTIVE = "active"
    OFFLOADED = "offloaded"


@dataclass
class CacheRequest:
    request_id: str
    arrival: int
    salt: bytes
    token_ids: list[int]  # the ids known; `num_placeholders` more tokens follow
    state: CacheState = CacheState.PENDING
    num_computed: int = 0  # settled
    in_flight: int = 0  # granted, not settled yet
    num_placeholders: int = 0  # tokens a running step samples, ids not sent yet
    block_hashes: list[bytes] = field(default_factory=list)  # chain over full computed pages

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_placeholders

    @property
    def num_granted(self) -> int:
        """Where its next grant starts."""
        return self.num_computed + self.in_flight


@dataclass
class CacheStats:
    prefix_queries: int = 0  # prompt tokens looked up in the prefix index
    prefix_hit_tokens: int = 0
    offloads: int = 0  # requests moved to the swap pool
    swap_restores: int = 0
    soft_resets: int = 0
    rejected: int = 0
    prefix_waits: int = 0  # admissions put off a step because another request computed their next page
    steps: int = 0


def block_hash(parent: bytes, token_ids: list[int], salt: bytes) -> bytes:
    """Collision-resistant chained hash: a collision would hand one tenant another's KV."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(len(salt).to_bytes(4, "little"))  # length-prefixed: no salt can mimic a parent digest
    h.update(salt)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    def __init__(
        self,
        geometry: KVGeometry,
        num_chunks: int,
        *,
        swap_slots: int = 0,
        allow_block_sharing: bool = True,
        safety_margin: float = 0.0,
        max_step_tokens: int = 512,
    ) -> None:
        self.geometry = geometry
        self.page_size = geometry.page_size
        self.pool = ChunkPool(num_chunks)
        self.swap = SwapSpace(swap_slots)
        self.allocators: list[FullAttentionAllocator] = []
        for g, kind in enumerate(geometry.groups):
            k = geometry.chunks_per_block(g)
            if kind == "full":
                self.allocators.append(FullAttentionAllocator(self.pool, self.page_size, k))
            else:
                window = geometry.sliding_window
                assert window is not None  # KVGeometry guarantees it for sliding layers
                self.allocators.append(SlidingAttentionAllocator(self.pool, self.page_size, k, window))
        # Sharing needs every allocator to share: a sliding layer's old pages are gone.
        self.sharing = allow_block_sharing and all(a.supports_sharing for a in self.allocators)
        self.safety_margin = safety_margin
        self.max_step_tokens = max_step_tokens
        self.requests: dict[str, CacheRequest] = {}
        # Each step's grants until they settle, oldest first: (request, tokens) pairs.
        self._unsettled: deque[list[tuple[CacheRequest, int]]] = deque()
        # The hashes of the full pages in flight (granted, not settled): see the module docstring.
        self._computing: set[bytes] = set()
        self.stats = CacheStats()
        # KV events (see cachemgr_messages.KvEvents): the announced pages, in the order announced, so that
        # evicting a salted page (never announced) is not announced either, and so that a subscriber
        # joining late can be given the whole live set (`kv_snapshot`).
        self._announced: dict[bytes, StoredBlock] = {}
        self._stored: list[StoredBlock] = []
        self._cleared = self.sharing

    # ----------------------------------------------------------------------------------------- step

    def step(self, plan: StepPlan) -> StepGrant:
        """Serve one plan whole, or raise ValueError having changed nothing: the grant of a plan that
        fails half way is never sent, so the worker would not know what that half did."""
        self._check_plan(plan)
        self.stats.steps += 1
        for entry in plan.entries:  # the ids first: a settling page may be waiting for them
            known = self.requests.get(entry.request_id)
            if known is not None:
                _take_ids(known, entry)
        self._settle(keep=1 if plan.overlapped else 0)
        for rid in (*plan.frees, *plan.aborts):
            self._forget(rid)
        self._computing.clear()
        for grants in self._unsettled:  # the step still computing (async batching)
            for settling, _ in grants:
                if self.requests.get(settling.request_id) is settling:  # its pages will settle
                    self._note_computing(settling)

        out = _GrantBuilder(plan.step)
        placed: set[str] = set()
        blocked: list[PlanEntry] = []
        admission_budget = self._admission_budget(plan)
        for entry in plan.entries:
            req = self._ingest(entry, out)
            if req is None:
                continue
            if blocked and req.state is not CacheState.ACTIVE:
                # Running requests are stuck: admitting or restoring others now would only take the
                # memory they need and push older requests out (newest-first would be violated).
                continue
            if req.state is CacheState.PENDING:
                admitted = self._admit(req, entry, out, admission_budget)
                if admitted:
                    placed.add(req.request_id)
                    if admission_budget is not None:
                        admission_budget -= admitted
            elif self._place(req, entry, out):
                placed.add(req.request_id)
            elif req.state is CacheState.ACTIVE:
                blocked.append(entry)
        while blocked:
            victims = self._choose_victims(blocked, placed)
            if not victims:
                break
            for victim in victims:
                self._offload(victim, out)
            still = []
            for entry in blocked:
                req = self.requests.get(entry.request_id)
                if req is None or req.state is not CacheState.ACTIVE:
                    continue  # it was a victim itself
                if self._place(req, entry, out):
                    placed.add(req.request_id)
                else:
                    still.append(entry)
            blocked = still
        self.swap.end_step()
        self._unsettled.append(out.in_flight)
        out.blocked = [e.request_id for e in blocked]
        out.kv_events = self._drain_kv_events()
        return out.build()

    def _settle(self, keep: int) -> None:
        """Count all but the last `keep` steps' grants as computed, then cache every full page whose
        KV is computed and whose ids are known (pages are registered here, at the step's start only,
        so that a step's KV events store before they remove)."""
        while len(self._unsettled) > keep:
            for req, n in self._unsettled.popleft():
                if self.requests.get(req.request_id) is req:  # not forgotten (nor re-admitted) since
                    req.in_flight -= n
                    req.num_computed += n
        for req in self.requests.values():
            self._register_full_pages(req)

    def kv_snapshot(self) -> KvEvents:
        """Between steps: the live announced pages as one resync (`cleared`, then each page, parents
        first), for a subscriber that joins after the cache started."""
        return KvEvents(cleared=True, stored=list(self._announced.values()))

    def flush_cache(self) -> Flushed:
        """Between steps: drop the cached prefixes no request holds, and say so to routers."""
        return Flushed(self.pool.drop_evictable(), self._drain_kv_events())

    def _drain_kv_events(self) -> KvEvents | None:
        removed = [d for d in self.pool.evicted if self._announced.pop(d, None) is not None]
        self.pool.evicted.clear()
        if not (self._cleared or self._stored or removed):
            return None
        events = KvEvents(self._cleared, self._stored, removed)
        self._cleared, self._stored = False, []
        return events

    @staticmethod
    def _check_plan(plan: StepPlan) -> None:
        """Refuse, before anything changes, every plan the step below could not serve to the end."""
        if plan.version != PROTOCOL_VERSION:
            raise ValueError(f"StepPlan version {plan.version} != {PROTOCOL_VERSION}")
        seen: set[str] = set()
        for entry in plan.entries:
            if entry.request_id in seen:
                # A second entry would be granted blocks over the first one's, or forget a request
                # that the first left blocked, whose victims are then chosen for nobody.
                raise ValueError(f"StepPlan {plan.step} names request {entry.request_id!r} twice")
            seen.add(entry.request_id)
            # The wire's decoder bounds token ids, an in-process caller may not; `block_hash` packs
            # them as signed 64-bit integers and would raise half way through the step.
            if not all(0 <= t < 2**63 for t in entry.new_token_ids):
                raise ValueError(
                    f"StepPlan {plan.step}: a token id of {entry.request_id!r} is negative or over 64 bits"
                )
            if entry.num_placeholders < 0:
                raise ValueError(
                    f"StepPlan {plan.step}: {entry.request_id!r} has {entry.num_placeholders} placeholders"
                )

    # ------------------------------------------------------------------------------------ ingestion

    def _ingest(self, entry: PlanEntry, out: _GrantBuilder) -> CacheRequest | None:
        req = self.requests.get(entry.request_id)
        if req is None:
            req = CacheRequest(entry.request_id, entry.arrival, entry.cache_salt.encode(), [])
            reason = self._never_fits(entry)
            if reason:
                self.stats.rejected += 1
                out.rejected.append(Rejected(entry.request_id, reason))
                return None
            self.requests[entry.request_id] = req
            _take_ids(req, entry)
        available = req.num_tokens - req.num_granted
        if entry.num_tokens < 1 or entry.num_tokens > available:
            self._forget(entry.request_id)
            self.stats.rejected += 1
            out.rejected.append(
                Rejected(entry.request_id, f"num_tokens {entry.num_tokens} not in [1, {available}]")
            )
            return None
        return req

    def _never_fits(self, entry: PlanEntry) -> str:
        """Why this request could not run even in an empty pool ("" if it can)."""
        total = max(entry.max_total_tokens, len(entry.new_token_ids) + entry.num_placeholders)
        need = 0
        for alloc in self.allocators:
            if isinstance(alloc, SlidingAttentionAllocator):
                span = min(total, alloc.window - 1 + min(self.max_step_tokens, total))
                pages = min(pages_for(total, self.page_size), pages_for(span, self.page_size) + 1)
            else:
                pages = pages_for(total, self.page_size)
            need += pages * alloc.k
        if need > self.pool.capacity:
            return f"needs {need} KV chunks for {total} tokens; the pool has {self.pool.capacity}"
        return ""

    def max_request_tokens(self) -> int:
        """Most tokens (prompt + output) one request can hold in an empty pool; see `_never_fits`."""
        full_k, sliding_need = 0, 0
        for alloc in self.allocators:
            if isinstance(alloc, SlidingAttentionAllocator):
                span = alloc.window - 1 + self.max_step_tokens
                sliding_need += (pages_for(span, self.page_size) + 1) * alloc.k
            else:
                full_k += alloc.k
        if not full_k:
            return 2**31 - 1  # sliding pages recycle: the cache never limits a request's length
        return max(0, (self.pool.capacity - sliding_need) // full_k) * self.page_size

    # ------------------------------------------------------------------------------------ placement

    def _admission_budget(self, plan: StepPlan) -> int | None:
        """What `plan.token_budget` leaves to admissions once every admitted or offloaded entry has its
        planned tokens (those are exact: only an admission can hit the prefix cache)."""
        if plan.token_budget is None:
            return None
        planned = 0
        for entry in plan.entries:
            req = self.requests.get(entry.request_id)
            if req is not None and req.state is not CacheState.PENDING:
                planned += entry.num_tokens
        return plan.token_budget - planned

    def _place(self, req: CacheRequest, entry: PlanEntry, out: _GrantBuilder) -> bool:
        """Grant an admitted (ACTIVE) or offloaded request its planned tokens."""
        if req.state is CacheState.ACTIVE:
            return self._grow(req, entry.num_tokens, out)
        return self._restore(req, entry.num_tokens, out)

    def _need(self, rid: str, start: int, end: int) -> int:
        for alloc in self.allocators:
            alloc.recycle(rid, start)  # always safe: no later step reads before `start - window`
        return sum(a.chunks_needed(rid, end) for a in self.allocators)

    def _grow(self, req: CacheRequest, num_tokens: int, out: _GrantBuilder) -> bool:
        start = req.num_granted
        end = start + num_tokens
        if self._need(req.request_id, start, end) > self.pool.num_free:
            return False
        tables = [a.grow(req.request_id, end) for a in self.allocators]
        out.grant(req, start, num_tokens, tables, replace=False)
        self._note_computing(req)
        return True

    def _admit(self, req: CacheRequest, entry: PlanEntry, out: _GrantBuilder, budget: int | None) -> int:
        """Admit a request from its longest cached prefix on: it computes up to `entry.num_tokens`
        tokens from there, at most `budget`. Returns the tokens granted (0: it waits)."""
        if budget is not None and budget < 1:
            return 0
        if self.pool.num_free < self.safety_margin * self.pool.capacity:
            return 0
        hits, missed = self._lookup_prefix(req) if self.sharing else ([], None)
        if missed in self._computing:
            self.stats.prefix_waits += 1
            return 0
        start = len(hits) * self.page_size
        end = min(start + entry.num_tokens, req.num_tokens)
        if budget is not None:
            end = min(end, start + budget)
        if not entry.may_sample:
            end = min(end, req.num_tokens - 1)  # the worker has no logits row for its sample
        if end <= start:
            return 0
        need = pages_for(end, self.page_size) * sum(a.k for a in self.allocators) - len(hits)
        if need > self.pool.num_free - self.pool.num_evictable_in(hits):
            return 0
        if self.sharing:
            self.stats.prefix_queries += req.num_tokens
            self.stats.prefix_hit_tokens += start
            req.block_hashes = [self.pool.hash_of[c] for c in hits]
            self.allocators[0].attach(req.request_id, hits)
        for alloc in self.allocators:
            alloc.grow(req.request_id, end)
        req.state = CacheState.ACTIVE
        req.num_computed = start
        out.grant(req, start, end - start, [a.tables[req.request_id] for a in self.allocators], replace=True)
        self._note_computing(req)
        return end - start

    def _lookup_prefix(self, req: CacheRequest) -> tuple[list[int], bytes | None]:
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

    def _note_computing(self, req: CacheRequest) -> None:
        """Count `req`'s granted full pages of known ids past its settled ones as in flight."""
        if not self.sharing:
            return
        p = self.page_size
        digest = req.block_hashes[-1] if req.block_hashes else b""
        for i in range(len(req.block_hashes), min(req.num_granted, len(req.token_ids)) // p):
            digest = block_hash(digest, req.token_ids[i * p : (i + 1) * p], req.salt)
            self._computing.add(digest)

    def _restore(self, req: CacheRequest, num_tokens: int, out: _GrantBuilder) -> bool:
        layout = self.swap.held[req.request_id]
        live = sum(1 for table in layout for s in table if s >= 0)
        start = req.num_granted
        end = start + num_tokens
        growth = 0
        for alloc, table in zip(self.allocators, layout, strict=True):
            growth += max(0, pages_for(end, self.page_size) - len(table) // alloc.k) * alloc.k
        if live + growth > self.pool.num_free:
            return False
        self.swap.give_back(req.request_id, read_this_step=True)
        fresh = iter(self.pool.allocate(live))
        for alloc, slots in zip(self.allocators, layout, strict=True):
            alloc.install(req.request_id, _relocate(slots, fresh, out.swap_in))
            alloc.grow(req.request_id, end)
        req.state = CacheState.ACTIVE
        self.stats.swap_restores += 1
        out.grant(req, start, num_tokens, [a.tables[req.request_id] for a in self.allocators], replace=True)
        self._note_computing(req)
        return True

    # ------------------------------------------------------------------------------------- offload

    def _choose_victims(self, blocked: list[PlanEntry], placed: set[str]) -> list[CacheRequest]:
        """Fewest requests, newest first, whose blocks cover the blocked demand.

        Never a request placed in this step, never the last active request. A blocked request may be
        its own victim (its demand then disappears with it).
        """
        active = [r for r in self.requests.values() if r.state is CacheState.ACTIVE]
        demand = {
            e.request_id: self._need(
                e.request_id,
                self.requests[e.request_id].num_granted,
                self.requests[e.request_id].num_granted + e.num_tokens,
            )
            for e in blocked
        }
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

    def _offload(self, req: CacheRequest, out: _GrantBuilder) -> None:
        rid = req.request_id
        for alloc in self.allocators:
            alloc.recycle(rid, req.num_granted)  # pages no later step reads are not worth saving
        live = [c for a in self.allocators for c in a.live_chunks(rid)]
        if live and self.swap.num_free >= len(live):
            slots = iter(self.swap.take(len(live)))
            layout = []
            for alloc in self.allocators:
                table = alloc.detach(rid)
                layout.append(_relocate(table, slots, out.swap_out))
                self.pool.release(table[::-1])
            self.swap.held[rid] = layout
            req.state = CacheState.OFFLOADED
            self.stats.offloads += 1
            out.offloaded.append(rid)
        else:
            # Soft reset: computed full pages stay in the prefix index (registered at commit), so
            # the re-prefill of prompt + generated tokens mostly hits the cache.
            self._forget(rid)
            self.stats.soft_resets += 1
            out.soft_reset.append(rid)

    # --------------------------------------------------------------------------------- bookkeeping

    def _register_full_pages(self, req: CacheRequest) -> None:
        if not self.sharing or req.state is not CacheState.ACTIVE:
            return
        table = self.allocators[0].tables[req.request_id]
        p = self.page_size
        for i in range(len(req.block_hashes), min(req.num_computed, len(req.token_ids)) // p):
            parent = req.block_hashes[-1] if req.block_hashes else b""
            tokens = req.token_ids[i * p : (i + 1) * p]
            digest = block_hash(parent, tokens, req.salt)
            req.block_hashes.append(digest)
            if self.pool.register(table[i], digest) and not req.salt:
                self._announced[digest] = StoredBlock(digest, parent, tokens)
                self._stored.append(self._announced[digest])

    def _forget(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is None:
            return
        if req.state is CacheState.OFFLOADED:
            self.swap.give_back(rid)
        for alloc in self.allocators:
            alloc.release(rid)

    def release_all(self) -> int:
        """Forget every request (its worker is gone); returns how many. In-flight tokens are not
        committed: the step that computed them may never have run. Full hashed pages stay cached."""
        rids = list(self.requests)
        for rid in rids:
            self._forget(rid)
        self._unsettled.clear()
        self.swap.end_step()
        return len(rids)

    def stats_dict(self) -> dict[str, int]:
        return {
            "total_blocks": self.pool.capacity,
            "free_blocks": len(self.pool.free) + len(self.pool.untouched),
            "committed_blocks": self.pool.num_committed,
            "evictable_blocks": len(self.pool.evictable),
            "used_blocks": self.pool.num_used,
            "swap_slots": self.swap.num_slots,
            "swap_slots_used": self.swap.num_slots - self.swap.num_free,
            "requests_known": len(self.requests),
            **vars(self.stats),
        }

    def check(self) -> None:
        """Assert every invariant in the module docstring (used by property tests)."""
        self.pool.check()
        self.swap.check()
        if not self._announced.keys() <= self.pool.by_hash.keys():
            raise AssertionError("a page announced as cached is no longer cached")
        refs: Counter[int] = Counter()
        for alloc in self.allocators:
            for rid, table in alloc.tables.items():
                req = self.requests.get(rid)
                if req is None or req.state is not CacheState.ACTIVE:
                    raise AssertionError(f"table for {rid} which is not active")
                covered = len(table) // alloc.k * self.page_size
                if covered < req.num_granted:
                    raise AssertionError(f"{rid}: table covers {covered} < {req.num_granted}")
                refs.update(c for c in table if c >= 0)
        for chunk in range(self.pool.num_chunks):
            if self.pool.refcount[chunk] != refs[chunk]:
                raise AssertionError(
                    f"chunk {chunk}: refcount {self.pool.refcount[chunk]} != {refs[chunk]} references"
                )
        for rid, req in self.requests.items():
            if req.state is CacheState.OFFLOADED and rid not in self.swap.held:
                raise AssertionError(f"offloaded {rid} holds no swap slots")


def _take_ids(req: CacheRequest, entry: PlanEntry) -> None:
    """The entry's ids extend the known ones (filling earlier placeholders first); its placeholders
    are then all that follows."""
    req.token_ids.extend(entry.new_token_ids)
    req.num_placeholders = entry.num_placeholders


def _relocate(table: list[int], fresh: Iterator[int], moves: list[tuple[int, int]]) -> list[int]:
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


class _GrantBuilder:
    """Collects one step's answer; the lists become the immutable StepGrant."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.granted: list[Granted] = []
        self.blocked: list[str] = []
        self.offloaded: list[str] = []
        self.soft_reset: list[str] = []
        self.rejected: list[Rejected] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.kv_events: KvEvents | None = None
        self.in_flight: list[tuple[CacheRequest, int]] = []

    def grant(self, req: CacheRequest, start: int, n: int, tables: list[list[int]], replace: bool) -> None:
        req.in_flight += n
        self.in_flight.append((req, n))
        self.granted.append(Granted(req.request_id, start, n, [list(t) for t in tables], replace))

    def build(self) -> StepGrant:
        return StepGrant(
            step=self.step,
            granted=self.granted,
            blocked=self.blocked,
            offloaded=self.offloaded,
            soft_reset=self.soft_reset,
            rejected=self.rejected,
            swap_out=self.swap_out,
            swap_in=self.swap_in,
            kv_events=self.kv_events,
        )
