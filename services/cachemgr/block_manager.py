"""BlockManager: the cachemgr's pure core. One `step(plan) -> grant` call per worker step.

It owns block tables, the prefix index, refcounts, eviction and offload decisions; it never touches KV
bytes (the worker copies them as the grant says). No sockets, no tensors. It is the facade over:
- `cache_request.py`: `CacheRequest`, a request as the cachemgr sees it, and its states (*pending*,
  *active*, *offloaded*); a request the BlockManager soft-resets or releases is forgotten;
- `allocator.py` over `chunk_pool.py`: the block tables, the chunks, refcounts and LRU eviction;
- `prefix_cache.py`: the hash chain of full pages, prefix lookups, the pages in flight, KV events;
- `offload.py`: victims, swap-out and restore, over `swap_space.py`;
- `grant_builder.py`: the step's answer as it is built.

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

from collections import Counter, deque
from dataclasses import dataclass

from services.cachemgr.allocator import FullAttentionAllocator, SlidingAttentionAllocator, pages_for
from services.cachemgr.cache_request import CacheRequest, CacheState, take_ids
from services.cachemgr.chunk_pool import ChunkPool
from services.cachemgr.grant_builder import GrantBuilder
from services.cachemgr.offload import Offloader
from services.cachemgr.prefix_cache import PrefixCache
from services.cachemgr.swap_space import SwapSpace
from services.common.cachemgr_messages import (
    PROTOCOL_VERSION,
    Flushed,
    KvEvents,
    PlanEntry,
    Rejected,
    StepGrant,
    StepPlan,
)
from services.common.kv_geometry import KVGeometry


@dataclass
class CacheStats:
    prefix_queries: int = 0  # prompt tokens looked up in the prefix index
    prefix_hit_tokens: int = 0
    offloads: int = 0  # requests moved to the swap pool
    swap_restores: int = 0
    soft_resets: int = 0
    rejected: int = 0
    prefix_waits: int = 0  # admissions put off a step because another request computed their next page
    forks: int = 0  # requests started on a sibling's prompt pages (n > 1), computing none of them
    steps: int = 0


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
        self.prefix = PrefixCache(self.pool, self.page_size, self.sharing)
        self.offloader = Offloader(self.pool, self.swap, self.allocators, self.page_size)
        self.stats = CacheStats()

    # ----------------------------------------------------------------------------------------- step

    def step(self, plan: StepPlan) -> StepGrant:
        """Serve one plan whole, or raise ValueError having changed nothing: the grant of a plan that
        fails half way is never sent, so the worker would not know what that half did."""
        self._check_plan(plan)
        self.stats.steps += 1
        for entry in plan.entries:  # the ids first: a settling page may be waiting for them
            known = self.requests.get(entry.request_id)
            if known is not None:
                take_ids(known, entry)
        self._settle(keep=1 if plan.overlapped else 0)
        for rid in (*plan.frees, *plan.aborts):
            self._forget(rid)
        self.prefix.computing.clear()
        for grants in self._unsettled:  # the step still computing (async batching)
            for settling, _ in grants:
                if self.requests.get(settling.request_id) is settling:  # its pages will settle
                    self.prefix.note_computing(settling)

        out = GrantBuilder(plan.step)
        placed: set[str] = set()
        blocked: list[PlanEntry] = []
        admission_budget = self._admission_budget(plan)
        for entry in plan.entries:
            if entry.fork_of:
                if self._fork(entry, out):
                    placed.add(entry.request_id)
                continue
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
        out.kv_events = self.prefix.drain_events()
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
        return self.prefix.snapshot()

    def flush_cache(self) -> Flushed:
        """Between steps: drop the cached prefixes no request holds, and say so to routers."""
        return Flushed(self.pool.drop_evictable(), self.prefix.drain_events())

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

    def _ingest(self, entry: PlanEntry, out: GrantBuilder) -> CacheRequest | None:
        req = self.requests.get(entry.request_id)
        if req is None:
            req = CacheRequest(entry.request_id, entry.arrival, entry.cache_salt.encode(), [])
            reason = self._never_fits(entry)
            if reason:
                self.stats.rejected += 1
                out.rejected.append(Rejected(entry.request_id, reason))
                return None
            self.requests[entry.request_id] = req
            take_ids(req, entry)
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

    def _place(self, req: CacheRequest, entry: PlanEntry, out: GrantBuilder) -> bool:
        """Grant an admitted (ACTIVE) or offloaded request its planned tokens."""
        if req.state is CacheState.ACTIVE:
            return self._grow(req, entry.num_tokens, out)
        return self._restore(req, entry.num_tokens, out)

    def _need(self, rid: str, start: int, end: int) -> int:
        for alloc in self.allocators:
            alloc.recycle(rid, start)  # always safe: no later step reads before `start - window`
        return sum(a.chunks_needed(rid, end) for a in self.allocators)

    def _grow(self, req: CacheRequest, num_tokens: int, out: GrantBuilder) -> bool:
        start = req.num_granted
        end = start + num_tokens
        if self._need(req.request_id, start, end) > self.pool.num_free:
            return False
        tables = [a.grow(req.request_id, end) for a in self.allocators]
        out.grant(req, start, num_tokens, tables, replace=False)
        self.prefix.note_computing(req)
        return True

    def _admit(self, req: CacheRequest, entry: PlanEntry, out: GrantBuilder, budget: int | None) -> int:
        """Admit a request from its longest cached prefix on: it computes up to `entry.num_tokens`
        tokens from there, at most `budget`. Returns the tokens granted (0: it waits)."""
        if budget is not None and budget < 1:
            return 0
        if self.pool.num_free < self.safety_margin * self.pool.capacity:
            return 0
        hits, missed = self.prefix.lookup(req) if self.sharing else ([], None)
        if missed in self.prefix.computing:
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
        self.prefix.note_computing(req)
        return end - start

    def _fork(self, entry: PlanEntry, out: GrantBuilder) -> bool:
        """Start `entry`'s request on its parent's prompt, granted in this very step up to its end:
        it shares the parent's full pages (a reference each) and gets its own chunks for the partly
        filled last page, which the worker copies once this step's forward has written it. False,
        changing nothing, when the parent is not there yet (or no longer), the prompts differ, or no
        chunk is free: the worker then runs the request on its own."""
        parent = self.requests.get(entry.fork_of)
        if (
            not self.sharing
            or entry.request_id in self.requests
            or parent is None
            or parent.state is not CacheState.ACTIVE
            or parent.num_placeholders
            or parent.num_granted != parent.num_tokens
            or not any(granted is parent for granted, _ in out.in_flight)
            or entry.new_token_ids != parent.token_ids
            or entry.cache_salt.encode() != parent.salt
        ):
            return False
        end = parent.num_tokens
        partial = end % self.page_size != 0
        if partial and self.pool.num_free < sum(a.k for a in self.allocators):
            return False
        child = CacheRequest(
            entry.request_id,
            entry.arrival,
            parent.salt,
            list(parent.token_ids),
            state=CacheState.ACTIVE,
            num_computed=parent.num_computed,
            block_hashes=list(parent.block_hashes),
        )
        copies: list[tuple[int, int]] = []
        for alloc in self.allocators:
            table = alloc.tables[parent.request_id]
            alloc.attach(child.request_id, table[: len(table) - alloc.k] if partial else table)
            if partial:
                copies += zip(table[-alloc.k :], alloc.grow(child.request_id, end), strict=True)
        self.requests[child.request_id] = child
        self.stats.forks += 1
        out.fork(child, [a.tables[child.request_id] for a in self.allocators], copies)
        return True

    def _restore(self, req: CacheRequest, num_tokens: int, out: GrantBuilder) -> bool:
        start = req.num_granted
        if not self.offloader.swap_in(req, start + num_tokens, out.swap_in):
            return False
        self.stats.swap_restores += 1
        out.grant(req, start, num_tokens, [a.tables[req.request_id] for a in self.allocators], replace=True)
        self.prefix.note_computing(req)
        return True

    # ------------------------------------------------------------------------------------- offload

    def _choose_victims(self, blocked: list[PlanEntry], placed: set[str]) -> list[CacheRequest]:
        """See `Offloader.choose_victims`: the demand is what each blocked entry needs."""
        active = [r for r in self.requests.values() if r.state is CacheState.ACTIVE]
        demand = {
            e.request_id: self._need(
                e.request_id,
                self.requests[e.request_id].num_granted,
                self.requests[e.request_id].num_granted + e.num_tokens,
            )
            for e in blocked
        }
        return self.offloader.choose_victims(active, demand, placed)

    def _offload(self, req: CacheRequest, out: GrantBuilder) -> None:
        if self.offloader.swap_out(req, out.swap_out):
            self.stats.offloads += 1
            out.offloaded.append(req.request_id)
        else:
            # Soft reset: computed full pages stay in the prefix index (registered at commit), so
            # the re-prefill of prompt + generated tokens mostly hits the cache.
            self._forget(req.request_id)
            self.stats.soft_resets += 1
            out.soft_reset.append(req.request_id)

    # --------------------------------------------------------------------------------- bookkeeping

    def _register_full_pages(self, req: CacheRequest) -> None:
        if self.sharing and req.state is CacheState.ACTIVE:
            self.prefix.register_full_pages(req, self.allocators[0].tables[req.request_id])

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
        self.prefix.check()
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
