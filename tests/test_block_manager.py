"""BlockManager semantics (examples) and a stateful property test that plays a worker against it.

The BlockManager is pure Python: these tests drive `BlockManager.step(plan) -> grant` directly, with no
mocks. The property test mirrors what a real worker does with a grant: it keeps its own copy of every
block table (applying `replace`/append deltas), performs the swap copies and the forward's KV writes on a
simulated pool whose "KV" is the `(salt, group, sub-chunk, token prefix)` a position was computed from, and
then checks that everything a request can still attend to holds exactly its own KV. That catches wrong
prefix hits (including across salts), chunks handed out while still live, bad swap copy lists, writes
into shared chunks, and cached pages whose KV is not what their hash names, on top of `bm.check()`.
It plays the async batching protocol too: each plan leaves while the previous step's forward still runs,
that forward's KV writes and samples land only after the grant (before its swap copies), and the tokens
it samples travel as placeholders.

Protocol reminders (docs/architecture.md, the step protocol):
- the worker sends each request's tokens once: the whole prompt on first sight, then each sampled token;
- tokens granted at step N count as computed when step N+1's plan arrives (with async batching, N+2's);
- a grant computes `[start, start + num_tokens)`; `start` differs from the worker's count only on admission
  with a prefix hit;
- frees/aborts in a plan are released before anything else.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from services.cachemgr.allocator import RECYCLED, pages_for
from services.cachemgr.block_manager import BlockManager
from services.cachemgr.cache_request import CacheState
from services.cachemgr.prefix_cache import block_hash
from services.common.cachemgr_messages import (
    PROTOCOL_VERSION,
    KvEvents,
    PlanEntry,
    StepGrant,
    StepPlan,
    StoredBlock,
)
from services.common.kv_geometry import RESERVED_CHUNKS, KVGeometry
from tests.block_manager_state import state_of

P = 4  # page_size of every geometry below


def _geometry(kinds: tuple[str, ...], window: int | None = None) -> KVGeometry:
    return KVGeometry(
        num_layers=len(kinds),
        num_kv_heads=2,
        head_dim=16,
        page_size=P,
        dtype_bytes=4,
        layer_kinds=kinds,  # type: ignore[arg-type]
        sliding_window=window,
    )


FULL = _geometry(("full", "full"))
SLIDING = _geometry(("sliding", "sliding"), window=8)
HYBRID = _geometry(("sliding", "full", "sliding", "full"), window=8)  # one chunk per block of each kind
HYBRID_3 = _geometry(("sliding", "full", "full", "full"), window=6)  # a full block is 3 chunks


def make_bm(geometry: KVGeometry, capacity: int, **kwargs) -> BlockManager:
    """A BlockManager whose pool has `capacity` allocatable chunks (plus the reserved ones)."""
    bm = BlockManager(geometry, capacity + RESERVED_CHUNKS, **kwargs)
    assert bm.pool.capacity == capacity
    return bm


def E(
    rid: str,
    n: int,
    new: Sequence[int] = (),
    arrival: int = 0,
    salt: str = "",
    max_total: int = 0,
    may_sample: bool = True,
) -> PlanEntry:
    return PlanEntry(rid, n, list(new), arrival, salt, max_total, may_sample=may_sample)


class Driver:
    """Numbers the steps and runs `bm.check()` after each one."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.n = 0

    def step(
        self,
        *entries: PlanEntry,
        frees: Iterable[str] = (),
        aborts: Iterable[str] = (),
        overlapped: bool = False,
        token_budget: int | None = None,
    ) -> StepGrant:
        self.n += 1
        plan = StepPlan(
            self.n,
            list(entries),
            frees=list(frees),
            aborts=list(aborts),
            overlapped=overlapped,
            token_budget=token_budget,
        )
        grant = self.bm.step(plan)
        assert grant.step == self.n
        assert grant.version == PROTOCOL_VERSION
        self.bm.check()
        return grant


def granted(grant: StepGrant) -> dict[str, tuple[int, int]]:
    return {g.request_id: (g.start, g.num_tokens) for g in grant.granted}


def table(bm: BlockManager, rid: str, group: int = 0) -> list[int]:
    return bm.allocators[group].tables[rid]


def toks(base: int, n: int) -> list[int]:
    return list(range(base, base + n))


# ============================================================================== admission


def test_version_mismatch_raises() -> None:
    bm = make_bm(FULL, 4)
    with pytest.raises(ValueError, match="version"):
        bm.step(StepPlan(1, [E("a", 1, [1])], version=PROTOCOL_VERSION + 1))
    assert bm.requests == {}


def test_granted_tokens_count_as_computed_at_the_next_plan() -> None:
    bm = make_bm(FULL, 8)
    d = Driver(bm)
    g = d.step(E("a", 5, toks(10, 7)))
    assert granted(g) == {"a": (0, 5)}
    assert table(bm, "a") and len(table(bm, "a")) == 2  # pages for tokens [0, 5)
    assert (bm.requests["a"].num_computed, bm.requests["a"].in_flight) == (0, 5)
    g = d.step(E("a", 2))  # the rest of the prompt: nothing new to send
    assert granted(g) == {"a": (5, 2)}
    assert (bm.requests["a"].num_computed, bm.requests["a"].in_flight) == (5, 2)
    assert g.granted[0].replace is False and g.granted[0].tables == [[]]  # page 1 already covers 5..7


def test_admission_is_all_or_nothing() -> None:
    bm = make_bm(FULL, 4)
    d = Driver(bm)
    assert granted(d.step(E("a", 12, toks(0, 12), arrival=0))) == {"a": (0, 12)}  # 3 of 4 chunks
    g = d.step(E("b", 8, toks(100, 8), arrival=1))  # needs 2, one is free
    assert g.granted == [] and g.blocked == [] and g.rejected == [] and g.offloaded == []
    assert bm.requests["b"].state is CacheState.PENDING
    assert all("b" not in a.tables for a in bm.allocators)
    assert bm.pool.num_free == 1
    # Once `a` is gone `b` is admitted; its prompt was sent already, so nothing new is sent.
    g = d.step(E("b", 8, [], arrival=1), frees=["a"])
    assert granted(g) == {"b": (0, 8)}
    assert bm.requests["b"].token_ids == toks(100, 8)


def test_admission_is_all_or_nothing_across_allocators() -> None:
    # Hybrid: each page costs one full and one sliding chunk. 3 free chunks cover the full side of a
    # 2-page prompt but not both sides: nothing may be taken from either allocator.
    bm = make_bm(HYBRID, 5)
    d = Driver(bm)
    d.step(E("a", 4, toks(0, 4)))
    assert bm.pool.num_free == 3
    g = d.step(E("b", 8, toks(100, 8), arrival=1))
    assert g.granted == []
    assert all("b" not in a.tables for a in bm.allocators)
    assert bm.pool.num_free == 3
    assert bm.stats_dict()["used_blocks"] == 2


def test_chunk_smaller_than_prompt_admits_only_its_pages() -> None:
    bm = make_bm(FULL, 3)
    d = Driver(bm)
    g = d.step(E("a", 4, toks(0, 12), max_total=12))
    assert (
        granted(g) == {"a": (0, 4)} and g.granted[0].tables == [table(bm, "a")] and len(table(bm, "a")) == 1
    )


def test_safety_margin_blocks_new_admissions_but_not_growth() -> None:
    bm = make_bm(FULL, 10, safety_margin=0.5)
    d = Driver(bm)
    d.step(E("a", 24, toks(0, 24), arrival=0))  # 6 chunks; 4 free < 0.5 * 10
    g = d.step(E("a", 1, [7]), E("b", 1, [1], arrival=1))
    assert granted(g) == {"a": (24, 1)}  # growth: a new page for position 24
    assert bm.requests["b"].state is CacheState.PENDING and "b" not in bm.allocators[0].tables
    assert g.blocked == []
    assert bm.pool.num_free == 3
    # Freeing `a` lifts the margin.
    g = d.step(E("b", 1), frees=["a"])
    assert granted(g) == {"b": (0, 1)}


# ============================================================================== rejection


def test_request_that_can_never_fit_is_rejected_with_a_reason() -> None:
    bm = make_bm(FULL, 4)
    d = Driver(bm)
    g = d.step(E("big", 20, toks(0, 20)), E("ok", 4, toks(50, 4), arrival=1))
    assert [r.request_id for r in g.rejected] == ["big"]
    assert "needs 5 KV chunks" in g.rejected[0].reason and "4" in g.rejected[0].reason
    assert "big" not in bm.requests and granted(g) == {"ok": (0, 4)}
    # max_total_tokens (prompt + max new tokens) counts, not only the prompt.
    g = d.step(E("long", 4, toks(0, 4), arrival=2, max_total=17))
    assert [r.request_id for r in g.rejected] == ["long"]
    assert bm.stats.rejected == 2
    assert bm.pool.num_free == 3


def test_sliding_request_longer_than_the_pool_is_not_rejected() -> None:
    # 40 tokens with a window of 8 and at most 4 tokens per step never hold more than 4 pages.
    bm = make_bm(SLIDING, 4, max_step_tokens=4)
    d = Driver(bm)
    g = d.step(E("s", 4, toks(0, 40), max_total=44))
    assert g.rejected == [] and granted(g) == {"s": (0, 4)}
    for start in range(4, 40, 4):
        assert granted(d.step(E("s", 4))) == {"s": (start, 4)}
    assert sum(1 for c in table(bm, "s") if c != RECYCLED) <= 4


def test_plan_entry_asking_more_tokens_than_available_is_rejected() -> None:
    bm = make_bm(FULL, 8)
    d = Driver(bm)
    g = d.step(E("a", 5, toks(0, 4)))  # asks 5 of a 4-token prompt
    assert [r.request_id for r in g.rejected] == ["a"] and "not in [1, 4]" in g.rejected[0].reason
    assert "a" not in bm.requests and bm.pool.num_free == 8
    g = d.step(E("b", 0, toks(0, 4)))  # zero tokens is no request either
    assert [r.request_id for r in g.rejected] == ["b"]
    # An active request forgetting to send its sampled token: rejected and all its blocks released.
    d.step(E("c", 6, toks(0, 6)))
    assert bm.pool.num_free == 6
    g = d.step(E("c", 1))
    assert [r.request_id for r in g.rejected] == ["c"] and "not in [1, 0]" in g.rejected[0].reason
    assert "c" not in bm.requests and bm.pool.num_free == 8
    assert bm.stats_dict()["used_blocks"] == 0


def test_frees_and_aborts_are_released_before_anything_else() -> None:
    bm = make_bm(FULL, 4)
    d = Driver(bm)
    d.step(E("a", 8, toks(0, 8)), E("b", 8, toks(100, 8), arrival=1))
    assert bm.pool.num_free == 0
    g = d.step(E("c", 16, toks(200, 16), arrival=2), frees=["a"], aborts=["b"])
    assert granted(g) == {"c": (0, 16)}
    assert set(bm.requests) == {"c"}
    # Unknown ids in frees/aborts are harmless.
    d.step(frees=["nope"], aborts=["nope either"])


# ============================================================================== prefix caching


def test_prefix_hit_same_salt_full_pages_only() -> None:
    bm = make_bm(FULL, 16)
    d = Driver(bm)
    a = toks(0, 10)
    d.step(E("a", 10, a, salt="t1"))
    # `a`'s pages are registered when its tokens count as computed: at the next plan.
    g = d.step(E("b", 11, [*a[:9], 99, 98], arrival=1, salt="t1"))
    assert granted(g) == {"b": (8, 3)}  # 2 full pages hit; the partial third page is not shared
    assert table(bm, "b")[:2] == table(bm, "a")[:2] and table(bm, "b")[2] != table(bm, "a")[2]
    assert g.granted[0].replace and g.granted[0].tables == [table(bm, "b")]
    assert [bm.pool.refcount[c] for c in table(bm, "a")] == [2, 2, 1]
    assert bm.stats.prefix_hit_tokens == 8 and bm.stats.prefix_queries == 10 + 11
    # A hit never covers the page holding the last prompt token: an entirely cached 8-token prompt
    # recomputes its whole last page (its logits are needed, and a shared page is never written).
    g = d.step(E("c", 8, a[:8], arrival=2, salt="t1"))
    assert granted(g) == {"c": (4, 4)}
    assert table(bm, "c")[0] == table(bm, "a")[0] and table(bm, "c")[1] != table(bm, "a")[1]
    # A partial page never hits: 6 tokens hit only page 0.
    g = d.step(E("d", 6, a[:6], arrival=3, salt="t1"))
    assert granted(g) == {"d": (4, 2)}
    # The worker asked fewer tokens than the hit skips: it still gets what it asked after the hit.
    g = d.step(E("e", 2, [*a[:9], 77], arrival=4, salt="t1"))
    assert granted(g) == {"e": (8, 2)}
    assert bm.pool.refcount[table(bm, "a")[0]] == 5


def test_admissions_share_the_token_budget_their_prefix_hits_leave() -> None:
    bm = make_bm(FULL, 32)
    d = Driver(bm)
    a = toks(0, 12)
    d.step(E("a", 12, a))
    followers = {rid: [*a[:8], *toks(50 + 10 * i, 4)] for i, rid in enumerate("bcdef")}
    # Every follower is planned whole (12 tokens); its 8-token hit leaves 4 to compute. Of the budget
    # of 10, a's decode has 1, b and c take 4 each, d the 1 left (a chunk), and e waits.
    g = d.step(
        E("a", 1, [5]),
        *(E(rid, 12, ids, arrival=1 + i) for i, (rid, ids) in enumerate(followers.items()) if rid != "f"),
        token_budget=10,
    )
    assert granted(g) == {"a": (12, 1), "b": (8, 4), "c": (8, 4), "d": (8, 1)}
    assert bm.requests["e"].state is CacheState.PENDING and "e" not in bm.allocators[0].tables
    # Without a logits row for it, an admission stops short of its last token, hit or not.
    g = d.step(E("e", 12, may_sample=False), E("f", 12, followers["f"], arrival=5, may_sample=False))
    assert granted(g) == {"e": (8, 3), "f": (8, 3)}
    # A budget the planned running entries use up admits nothing.
    g = d.step(E("b", 1, [6]), E("e", 1), E("g", 12, a, arrival=6), token_budget=2)
    assert granted(g) == {"b": (12, 1), "e": (11, 1)}
    assert bm.requests["g"].state is CacheState.PENDING


def test_prefix_hit_requires_same_salt() -> None:
    bm = make_bm(FULL, 16)
    d = Driver(bm)
    a = toks(0, 9)
    d.step(E("a", 9, a, salt="tenant-1"))
    g = d.step(
        E("other", 9, a, arrival=1, salt="tenant-2"),
        E("unsalted", 9, a, arrival=2),
        E("same", 9, a, arrival=3, salt="tenant-1"),
    )
    assert granted(g) == {"other": (0, 9), "unsalted": (0, 9), "same": (8, 1)}
    assert not set(table(bm, "other")) & set(table(bm, "a"))
    assert not set(table(bm, "unsalted")) & set(table(bm, "a"))


def test_prefix_is_registered_only_once_computed() -> None:
    bm = make_bm(FULL, 16)
    d = Driver(bm)
    a = toks(0, 12)
    # Same step as `a`'s prefill: nothing is computed yet, no hit. b's salt makes its pages other
    # than a's, so it computes beside a instead of waiting for a's pages.
    g = d.step(E("a", 4, a, salt="s"), E("b", 12, a, arrival=1, salt="t"))
    assert granted(g) == {"a": (0, 4), "b": (0, 12)}
    # Next plan: a's first page is computed, its second in flight: c hits the first only.
    g = d.step(E("a", 4), E("c", 12, a, arrival=2, salt="s"))
    assert "c" not in granted(g) and bm.pool.lookup(bm.requests["a"].block_hashes[0]) is not None
    g = d.step(E("a", 4), E("c", 12))
    assert granted(g)["c"] == (8, 4)
    assert table(bm, "c")[:2] == table(bm, "a")[:2]


def test_an_admission_waits_for_its_next_page_in_flight_and_then_hits_it() -> None:
    """A burst behind one shared prompt computes it once: the followers wait while its pages are in
    flight and then hit them."""
    bm = make_bm(FULL, 32)
    d = Driver(bm)
    shared = toks(0, 8)
    prompts = {rid: [*shared, *toks(100 * (i + 1), 3)] for i, rid in enumerate("abc")}
    # a's first chunk puts both shared pages in flight; b and c wait rather than compute them too,
    # and the budget they leave goes to d, whose prompt shares nothing.
    g = d.step(
        E("a", 6, prompts["a"]),
        E("b", 11, prompts["b"], arrival=1),
        E("c", 11, prompts["c"], arrival=2),
        E("d", 11, toks(500, 11), arrival=3),
        token_budget=20,
    )
    assert granted(g) == {"a": (0, 6), "d": (0, 11)}
    assert bm.stats.prefix_waits == 2
    # Page 0 settled, page 1 (tokens 4-7) is still being computed by a: they wait another step.
    g = d.step(E("a", 5), E("b", 11), E("c", 11), E("d", 1, [9]), token_budget=20)
    assert granted(g) == {"a": (6, 5), "d": (11, 1)}
    assert bm.stats.prefix_waits == 4
    g = d.step(E("a", 1, [7]), E("b", 11), E("c", 11), token_budget=20)
    assert granted(g) == {"a": (11, 1), "b": (8, 3), "c": (8, 3)}
    assert table(bm, "b")[:2] == table(bm, "c")[:2] == table(bm, "a")[:2]
    assert bm.stats.prefix_hit_tokens == 16


def test_a_follower_stops_waiting_when_the_page_it_waits_for_is_dropped() -> None:
    bm = make_bm(FULL, 16)
    d = Driver(bm)
    prompt = toks(0, 9)
    g = d.step(E("a", 9, prompt), E("b", 9, prompt, arrival=1), overlapped=True)
    assert granted(g) == {"a": (0, 9)}
    # a is aborted while its step still computes (async batching): its pages will never settle, and
    # b computes them itself instead of waiting for them.
    g = d.step(E("b", 9), aborts=["a"], overlapped=True)
    assert granted(g) == {"b": (0, 9)}


def test_no_prefix_sharing_when_disabled_or_with_sliding_layers() -> None:
    for geometry, sharing_allowed in ((FULL, False), (SLIDING, True), (HYBRID, True), (HYBRID_3, True)):
        bm = make_bm(geometry, 40, allow_block_sharing=sharing_allowed)
        assert bm.sharing is False
        d = Driver(bm)
        a = toks(0, 9)
        d.step(E("a", 9, a))
        g = d.step(E("b", 9, a, arrival=1))
        assert granted(g) == {"b": (0, 9)}
        for group in range(len(bm.allocators)):
            assert not set(table(bm, "a", group)) & set(table(bm, "b", group))
        assert bm.pool.hash_of == {}


def test_refcounts_of_shared_chunks() -> None:
    bm = make_bm(FULL, 16)
    d = Driver(bm)
    a = toks(0, 8)
    d.step(E("a", 8, a))
    d.step(E("b", 5, [*a, 1], arrival=1), E("c", 5, [*a, 2], arrival=2))
    shared = table(bm, "a")
    assert table(bm, "b")[:2] == shared and table(bm, "c")[:2] == shared
    assert [bm.pool.refcount[c] for c in shared] == [3, 3]
    d.step(frees=["a"])
    assert [bm.pool.refcount[c] for c in shared] == [2, 2]
    assert not set(shared) & set(bm.pool.evictable)
    d.step(frees=["b"], aborts=["c"])
    assert [bm.pool.refcount[c] for c in shared] == [0, 0]
    assert list(bm.pool.evictable) == shared[::-1]  # content and hash kept; released tail first
    stats = bm.stats_dict()
    assert stats["used_blocks"] == 0 and stats["free_blocks"] + stats["evictable_blocks"] == 16


def F(rid: str, parent: str, prompt: Sequence[int], arrival: int = 1, salt: str = "") -> PlanEntry:
    """A fork entry: `rid` starts on `parent`'s prompt (n > 1)."""
    return PlanEntry(rid, 0, list(prompt), arrival, salt, fork_of=parent)


@pytest.mark.parametrize("length", [2 * P, 2 * P + 3], ids=["whole-pages", "partial-page"])
def test_a_fork_shares_the_prompt_pages_and_copies_a_partial_last_one(length: int) -> None:
    bm = make_bm(FULL, 16)
    k = bm.allocators[0].k  # chunks per page: 1 wherever prefix caching is on (all-full layers)
    d = Driver(bm)
    prompt = toks(0, length)
    grant = d.step(E("a", length, prompt), F("b", "a", prompt), F("c", "a", prompt, arrival=2))
    assert granted(grant) == {"a": (0, length), "b": (length, 0), "c": (length, 0)}
    parent = table(bm, "a")
    full = length // P * k
    for child in ("b", "c"):
        assert table(bm, child)[:full] == parent[:full]
    assert [bm.pool.refcount[c] for c in parent[:full]] == [3] * full
    own = [table(bm, child)[full:] for child in ("b", "c")]
    if length % P:
        assert grant.page_copies == [(s, d) for o in own for s, d in zip(parent[full:], o, strict=True)]
        assert len({*own[0], *own[1], *parent[full:]}) == 3 * k
    else:
        assert grant.page_copies == [] and own == [[], []]
    assert bm.stats.forks == 2 and bm.stats.prefix_queries == length  # the forks looked nothing up
    # The forks decode on their own pages; the parent's end frees none of theirs.
    d.step(E("a", 1, [7]), E("b", 1, [8]), E("c", 1, [9]))
    d.step(E("b", 1, [10]), E("c", 1, [11]), frees=["a"])
    assert bm.requests["b"].num_computed == length + 1
    d.step(frees=["b", "c"])
    assert bm.stats_dict()["used_blocks"] == 0


def test_a_fork_is_passed_over_unless_its_parent_reaches_its_prompts_end_in_this_step() -> None:
    bm = make_bm(FULL, 16)
    d = Driver(bm)
    prompt = toks(0, 10)
    grant = d.step(E("a", 4, prompt, may_sample=False), F("b", "a", prompt))  # a chunk short of the end
    assert granted(grant) == {"a": (0, 4)}
    assert "b" not in bm.requests and grant.page_copies == []
    grant = d.step(E("a", 6), F("b", "a", toks(1, 10)))  # the prompts differ
    assert granted(grant) == {"a": (4, 6)} and "b" not in bm.requests
    grant = d.step(E("a", 1, [99]), F("b", "a", prompt))  # the parent sampled already
    assert "b" not in granted(grant)
    grant = d.step(F("b", "nobody", prompt))
    assert granted(grant) == {} and bm.stats.forks == 0
    d.step(frees=["a"])
    assert bm.stats_dict()["used_blocks"] == 0


def test_a_fork_without_a_free_chunk_for_its_last_page_is_passed_over() -> None:
    bm = make_bm(FULL, 3)
    d = Driver(bm)
    prompt = toks(0, 2 * P + 1)  # three pages: the pool is full
    grant = d.step(E("a", len(prompt), prompt), F("b", "a", prompt))
    assert granted(grant) == {"a": (0, len(prompt))} and "b" not in bm.requests


def test_forks_offload_and_restore_like_any_request() -> None:
    bm = make_bm(FULL, 6, swap_slots=8)
    d = Driver(bm)
    prompt = toks(0, 10)  # three pages: two shared, the last copied
    d.step(E("a", 10, prompt), F("b", "a", prompt, arrival=2))
    d.step(E("a", 1, [50]), E("b", 1, [60]), E("x", 8, toks(100, 8), arrival=1))
    d.step(E("a", 1, [51]), E("b", 1, [61]))
    assert bm.pool.num_free == 0
    # Both need a fourth page: the newest, the fork, is offloaded; a keeps the pages they shared.
    grant = d.step(E("a", 1, [52]), E("b", 1, [62]))
    assert grant.offloaded == ["b"] and granted(grant) == {"a": (12, 1)}
    assert [bm.pool.refcount[c] for c in table(bm, "a")[:2]] == [1, 1]
    grant = d.step(E("b", 1), frees=["x", "a"])
    assert bm.requests["b"].state is CacheState.ACTIVE and len(grant.swap_in) == 3
    assert granted(grant) == {"b": (12, 1)}
    d.step(frees=["b"])
    assert bm.stats_dict()["used_blocks"] == 0 and bm.stats_dict()["swap_slots_used"] == 0


def test_evictable_blocks_are_reclaimed_lru_only_when_nothing_is_free() -> None:
    bm = make_bm(FULL, 6)
    d = Driver(bm)
    a, b = toks(0, 8), toks(100, 8)
    d.step(E("a", 8, a, salt="s"))
    d.step(E("b", 8, b, arrival=1, salt="s"))
    d.step(frees=["a"])  # released first: least recently used
    d.step(frees=["b"])
    # Each request's pages are released tail first, so a chain loses its end before its start.
    a_chunks, b_chunks = list(bm.pool.evictable)[:2], list(bm.pool.evictable)[2:]
    assert bm.stats_dict()["evictable_blocks"] == 4 and bm.stats_dict()["free_blocks"] == 2
    a0 = block_hash(b"", a[:4], b"s")
    a1 = block_hash(a0, a[4:8], b"s")
    assert bm.pool.lookup(a0) == a_chunks[1] and bm.pool.lookup(a1) == a_chunks[0]
    # Two fresh chunks come from the free side: nothing cached is evicted.
    d.step(E("x", 8, toks(200, 8), arrival=2))
    assert list(bm.pool.evictable) == [*a_chunks, *b_chunks]
    # One more chunk: the least recently released (a's last page) is evicted and its hash dropped;
    # a's first page stays cached and reachable.
    d.step(E("y", 4, toks(300, 4), arrival=3))
    assert table(bm, "y") == [a_chunks[0]]
    assert bm.pool.lookup(a1) is None and a_chunks[0] not in bm.pool.hash_of
    assert bm.pool.lookup(a0) == a_chunks[1]
    assert list(bm.pool.evictable) == [a_chunks[1], *b_chunks]
    # b's prefix is still cached and hits; a hit takes its chunks off the evictable side before the
    # new page is allocated (which evicts a's second page, the least recently used left).
    g = d.step(E("b2", 9, [*b, 5], arrival=4, salt="s"))
    assert granted(g) == {"b2": (8, 1)} and table(bm, "b2") == [*b_chunks[::-1], a_chunks[1]]
    assert list(bm.pool.evictable) == []


def test_a_prefix_hit_makes_cached_blocks_most_recently_used() -> None:
    bm = make_bm(FULL, 5)
    d = Driver(bm)
    a, b = toks(0, 8), toks(100, 8)
    d.step(E("a", 8, a), E("b", 8, b, arrival=1))
    d.step(frees=["a"])
    d.step(frees=["b"])
    a_chunks, b_chunks = list(bm.pool.evictable)[:2], list(bm.pool.evictable)[2:]
    d.step(E("c", 9, [*a, 1], arrival=2))  # hits a's pages, one fresh chunk from the free side
    d.step(frees=["c"])
    assert list(bm.pool.evictable) == [*b_chunks, *a_chunks]
    d.step(E("y", 8, toks(300, 8), arrival=3))  # the free chunk, then b's first page (now the LRU)
    assert table(bm, "y")[1] == b_chunks[0]
    assert list(bm.pool.evictable) == [b_chunks[1], *a_chunks]


def test_kv_events_announce_unsalted_pages_and_their_eviction() -> None:
    bm = make_bm(FULL, 4)
    d = Driver(bm)
    a, b = toks(0, 9), toks(100, 9)
    g = d.step(E("a", 9, a), E("s", 4, b[:4], arrival=1, salt="tenant"))
    assert g.kv_events == KvEvents(cleared=True)  # a new cache: subscribers start from nothing
    g = d.step(frees=["s", "a"])  # a's two full pages and s's one are committed, then released
    a0 = block_hash(b"", a[:4], b"")
    a1 = block_hash(a0, a[4:8], b"")
    assert g.kv_events == KvEvents(stored=[StoredBlock(a0, b"", a[:4]), StoredBlock(a1, a0, a[4:8])])
    assert d.step().kv_events is None  # nothing changed
    g = d.step(E("b", 9, b, arrival=2))  # 3 chunks: the free partial page, then two evictions (LRU)
    assert g.kv_events == KvEvents(removed=[a1])  # s's salted page, released first, went silently


def test_flush_cache_drops_cached_pages_only_and_says_so() -> None:
    bm = make_bm(FULL, 8)
    d = Driver(bm)
    a, b = toks(0, 8), toks(100, 8)
    d.step(E("a", 8, a), E("b", 8, b, arrival=1))
    d.step(frees=["a"])  # a's pages committed and cached; b's committed and still held
    held = list(table(bm, "b"))
    flushed = bm.flush_cache()
    bm.check()
    a0 = block_hash(b"", a[:4], b"")
    assert flushed.blocks == 2 and flushed.kv_events == KvEvents(removed=[block_hash(a0, a[4:8], b""), a0])
    assert bm.stats_dict()["evictable_blocks"] == 0 and table(bm, "b") == held
    g = d.step(E("a2", 9, [*a, 1], arrival=2), E("b2", 9, [*b, 1], arrival=3))
    assert granted(g) == {"a2": (0, 9), "b2": (8, 1)}  # a's prefix is gone, b's (in use) still hits


# ============================================================================== committed memory
# A host pool's pages cost memory from their first write on; the pool should touch new chunks only
# when neither a released scratch chunk nor (within capacity) nothing else is at hand.


def test_a_released_chunk_is_reused_before_an_untouched_one() -> None:
    bm = make_bm(FULL, 8, allow_block_sharing=False)
    d = Driver(bm)
    d.step(E("a", 8, toks(0, 8)))
    first = table(bm, "a")
    d.step(frees=["a"])
    d.step(E("b", 8, toks(100, 8), arrival=1))
    assert sorted(table(bm, "b")) == sorted(first)
    assert table(bm, "b")[0] == first[0]  # the most recently released (released tail first) is reused first


def test_committed_chunks_follow_the_working_set_not_the_request_count() -> None:
    """The issue's measurement, in miniature: rounds of distinct prompts whose pages are never cached
    (sharing off, and the partial last page of each prompt with sharing on) leave the committed set at
    the working set, where the old first-in-first-out free list walked through the whole pool."""
    bm = make_bm(FULL, 64, allow_block_sharing=False)
    d = Driver(bm)
    for round_ in range(10):
        rids = [f"r{round_}.{i}" for i in range(3)]
        d.step(*(E(rid, 10, toks(1000 * round_ + 100 * i, 10), arrival=i) for i, rid in enumerate(rids)))
        d.step(frees=rids)
        assert bm.pool.num_committed == 9, round_  # 3 requests x 3 pages, whatever the round
    assert bm.stats_dict()["committed_blocks"] == 9


def test_cached_prefixes_are_kept_until_untouched_chunks_run_out() -> None:
    """Prefix hits are what the old policy got: a cached chunk is evicted only when no released and
    no untouched chunk is left; only the unhashed partial pages are reused early."""
    bm = make_bm(FULL, 12)
    d = Driver(bm)
    a = toks(0, 10)  # pages 0 and 1 full (hashed), page 2 partial
    d.step(E("a", 10, a))
    d.step(frees=["a"])
    assert bm.stats_dict()["evictable_blocks"] == 2 and bm.pool.num_committed == 3
    d.step(E("x", 10, toks(500, 10), arrival=1))  # the partial page back, then two untouched
    assert bm.pool.num_committed == 5 and bm.stats_dict()["evictable_blocks"] == 2
    d.step(frees=["x"])
    g = d.step(E("a2", 11, [*a, 7], arrival=2))
    assert granted(g) == {"a2": (8, 3)}  # a's two full pages still hit


# ============================================================================== sliding window


def test_sliding_allocator_recycles_pages_that_left_the_window() -> None:
    bm = make_bm(SLIDING, 8)
    d = Driver(bm)
    d.step(E("s", 10, toks(0, 20), max_total=20))  # pages 0..2
    assert len(table(bm, "s")) == 3 and bm.pool.num_free == 5
    # A step starting at 10 reads positions >= 3: page 0 (positions 0..3) is still needed.
    g = d.step(E("s", 1))
    assert granted(g) == {"s": (10, 1)} and RECYCLED not in table(bm, "s")
    # Starting at 11, position 3 is out of the window (11 - 8 + 1 = 4): page 0 goes back to the pool.
    first = table(bm, "s")[0]
    g = d.step(E("s", 5))
    assert granted(g) == {"s": (11, 5)}
    assert len(table(bm, "s")) == 4  # pages 0..3 cover positions [0, 16)
    # The recycled page is released before the step's new page is allocated, which reuses it.
    assert table(bm, "s")[0] == RECYCLED and table(bm, "s")[3] == first
    assert g.granted[0].tables == [table(bm, "s")[3:]]
    # At 16 the window starts at 9: pages 0 and 1 are dead.
    d.step(E("s", 4))
    assert table(bm, "s")[:2] == [RECYCLED, RECYCLED]
    assert sum(1 for c in table(bm, "s") if c != RECYCLED) == 3
    assert bm.pool.num_free == 8 - 3


def test_hybrid_keeps_every_full_page_and_recycles_sliding_pages() -> None:
    bm = make_bm(HYBRID, 16, max_step_tokens=4)
    d = Driver(bm)
    assert [type(a).__name__ for a in bm.allocators] == [
        "FullAttentionAllocator",
        "SlidingAttentionAllocator",
    ]
    d.step(E("h", 4, toks(0, 24), max_total=24))
    for _ in range(4):
        d.step(E("h", 4))
    full, sliding = table(bm, "h", 0), table(bm, "h", 1)
    assert len(full) == len(sliding) == 5  # positions [0, 20)
    assert RECYCLED not in full
    assert sliding[:2] == [RECYCLED, RECYCLED]  # last start 16: window from 9
    assert bm.stats_dict()["used_blocks"] == 5 + 3


def test_hybrid_with_multi_chunk_blocks() -> None:
    bm = make_bm(HYBRID_3, 40, max_step_tokens=4)
    assert [a.k for a in bm.allocators] == [3, 1]
    d = Driver(bm)
    g = d.step(E("h", 5, toks(0, 16), max_total=16))
    assert [len(t) for t in g.granted[0].tables] == [6, 2]
    d.step(E("h", 4))
    d.step(E("h", 4))  # starts at 9: window 6 starts at 4 -> page 0 dead
    assert table(bm, "h", 1)[0] == RECYCLED and RECYCLED not in table(bm, "h", 1)[1:]
    assert len(table(bm, "h", 0)) == 4 * 3 and RECYCLED not in table(bm, "h", 0)


# ============================================================================== offloading


def _three_active(bm: BlockManager) -> Driver:
    """a (2 pages), b (2 pages), c (1 page) admitted in arrival order."""
    d = Driver(bm)
    d.step(
        E("a", 8, toks(0, 8), arrival=0),
        E("b", 8, toks(100, 8), arrival=1),
        E("c", 4, toks(200, 4), arrival=2),
    )
    return d


def test_blocked_request_offloads_the_newest_to_swap() -> None:
    bm = make_bm(FULL, 6, swap_slots=8)
    d = _three_active(bm)
    c_chunks = list(table(bm, "c"))
    a_table = list(table(bm, "a"))
    # a takes the last free chunk; b cannot grow: the newest non-placed active request (c) goes.
    g = d.step(E("a", 1, [1], arrival=0), E("b", 1, [2], arrival=1))
    assert granted(g) == {"a": (8, 1), "b": (8, 1)}
    assert g.offloaded == ["c"] and g.soft_reset == [] and g.blocked == []
    assert [chunk for chunk, _ in g.swap_out] == c_chunks
    slots = [slot for _, slot in g.swap_out]
    assert bm.swap.held["c"] == [slots] and bm.swap.num_free == 7
    assert bm.requests["c"].state is CacheState.OFFLOADED and "c" not in bm.allocators[0].tables
    assert table(bm, "a")[:2] == a_table  # placed earlier in the step: kept
    assert bm.stats.offloads == 1
    # Restore once there is room: swap_in pairs into fresh chunks, slots freed, progress kept.
    g = d.step(E("c", 1, [3], arrival=2), frees=["a"])
    assert granted(g) == {"c": (4, 1)}
    restored = g.granted[0]
    assert restored.replace and restored.tables == [table(bm, "c")]
    assert [slot for slot, _ in g.swap_in] == slots
    assert [chunk for _, chunk in g.swap_in] == table(bm, "c")[:1]
    assert len(table(bm, "c")) == 2  # plus the page for position 4
    assert bm.swap.num_free == 8 and bm.swap.held == {} and bm.stats.swap_restores == 1
    assert bm.requests["c"].token_ids == [*toks(200, 4), 3]


def test_offload_skips_requests_placed_earlier_in_the_step() -> None:
    bm = make_bm(FULL, 6, swap_slots=8)
    d = _three_active(bm)
    b_chunks = list(table(bm, "b"))
    # c (the newest) is placed first and takes the last chunk; a and b are stuck. c keeps its blocks:
    # the newest non-placed request, b, goes (covering both demands), then a is placed.
    g = d.step(E("c", 1, [1], arrival=2), E("a", 1, [2], arrival=0), E("b", 1, [3], arrival=1))
    assert granted(g) == {"c": (4, 1), "a": (8, 1)}
    assert g.offloaded == ["b"] and g.blocked == []
    assert [chunk for chunk, _ in g.swap_out] == b_chunks
    assert set(bm.allocators[0].tables) == {"a", "c"}


def test_offload_takes_the_fewest_newest_requests_that_cover_the_demand() -> None:
    bm = make_bm(FULL, 8, swap_slots=16)
    d = Driver(bm)
    d.step(
        E("a", 4, toks(0, 28), arrival=0),
        E("b", 8, toks(100, 8), arrival=1),
        E("c", 4, toks(200, 4), arrival=2),
        E("d", 4, toks(300, 4), arrival=3),
    )
    assert bm.pool.num_free == 3
    # a wants 20 more tokens: 5 chunks, two more than free. d then c (1 chunk each) cover it; b stays.
    g = d.step(E("a", 20, arrival=0))
    assert g.offloaded == ["d", "c"] and granted(g) == {"a": (4, 20)}
    assert set(bm.allocators[0].tables) == {"a", "b"} and bm.pool.num_free == 0
    assert len(g.swap_out) == 2 and set(bm.swap.held) == {"c", "d"}


def test_soft_reset_without_swap_space() -> None:
    bm = make_bm(FULL, 6)
    d = _three_active(bm)
    g = d.step(E("a", 1, [1], arrival=0), E("b", 1, [2], arrival=1))
    assert g.soft_reset == ["c"] and g.offloaded == [] and g.swap_out == []
    assert granted(g) == {"a": (8, 1), "b": (8, 1)}
    assert "c" not in bm.requests and bm.stats.soft_resets == 1
    # c's one hashed page went evictable and b's growth (nothing else was free) reclaimed it. The worker
    # re-sends prompt + generated as a new request; it is recomputed from scratch.
    g = d.step(E("c", 5, [*toks(200, 4), 9], arrival=2), frees=["a", "b"])
    assert granted(g) == {"c": (0, 5)}


def test_soft_reset_keeps_full_pages_in_the_prefix_cache() -> None:
    bm = make_bm(FULL, 7)
    d = Driver(bm)
    c_prompt = toks(200, 9)
    d.step(E("a", 8, toks(0, 8), arrival=0), E("c", 9, c_prompt, arrival=1))  # 2 + 3 chunks
    # a grows by 3 pages, 2 are free: c (newest, not placed) is soft reset.
    g = d.step(E("a", 9, toks(50, 9), arrival=0))
    assert g.soft_reset == ["c"] and granted(g) == {"a": (8, 9)}
    # c's two full pages survived as evictable (a took the free chunks and c's unhashed last page).
    g = d.step(E("c", 10, [*c_prompt, 42], arrival=1), frees=["a"])
    assert granted(g) == {"c": (8, 2)}


def test_swap_space_too_small_falls_back_to_soft_reset() -> None:
    bm = make_bm(FULL, 6, swap_slots=1)
    d = Driver(bm)
    d.step(
        E("a", 8, toks(0, 8), arrival=0),
        E("b", 4, toks(100, 4), arrival=1),
        E("c", 8, toks(200, 8), arrival=2),
    )
    g = d.step(E("a", 1, [1], arrival=0), E("b", 1, [2], arrival=1))
    # c holds 2 chunks, the swap pool has 1 slot: soft reset.
    assert g.soft_reset == ["c"] and g.offloaded == [] and bm.swap.num_free == 1
    assert granted(g) == {"a": (8, 1), "b": (4, 1)}


def test_the_last_active_request_is_never_offloaded() -> None:
    bm = make_bm(FULL, 2, swap_slots=8)
    d = Driver(bm)
    d.step(E("a", 8, toks(0, 8)))  # max_total unknown (0): a may outgrow the pool
    g = d.step(E("a", 1, [1]))
    assert g.blocked == ["a"] and g.offloaded == [] and g.soft_reset == [] and g.granted == []
    assert bm.requests["a"].state is CacheState.ACTIVE and len(table(bm, "a")) == 2
    # Pending requests hold nothing and do not count as active.
    g = d.step(E("a", 1), E("p", 1, [7], arrival=1))
    assert g.blocked == ["a"] and g.offloaded == [] and bm.requests["p"].state is CacheState.PENDING


def test_an_offloaded_request_waits_for_room_without_triggering_offloads() -> None:
    bm = make_bm(FULL, 4, swap_slots=8)
    d = Driver(bm)
    d.step(E("a", 8, toks(0, 8), arrival=0), E("b", 8, toks(100, 8), arrival=1))
    # Only a is planned and stuck; b (newest, not placed) goes to swap, then a grows.
    g = d.step(E("a", 1, [1], arrival=0))
    assert g.offloaded == ["b"] and granted(g) == {"a": (8, 1)}
    # b's restore does not fit beside a. A restore never triggers offloading: b just waits, neither
    # granted nor blocked.
    g = d.step(E("b", 1, [2], arrival=1))
    assert g.granted == [] and g.blocked == [] and g.offloaded == []
    assert bm.requests["b"].state is CacheState.OFFLOADED


# ============================================================================== all or nothing


def test_a_plan_naming_a_request_twice_is_refused_whole() -> None:
    """Once a bug: the second entry of `b` was rejected and forgot `b` while its first entry waited
    as blocked, and choosing victims for it raised KeyError after `a` had been freed and `c` restored
    (chunks taken, swap slots left draining) for a grant that was never sent."""
    bm = make_bm(FULL, 6, swap_slots=8)
    d = _three_active(bm)
    assert d.step(E("a", 1, [1], arrival=0), E("b", 1, [2], arrival=1)).offloaded == ["c"]
    before = state_of(bm)
    plan = [E("c", 1, [3], arrival=2), E("b", 9, toks(300, 9), arrival=1), E("b", 0, arrival=1)]
    with pytest.raises(ValueError, match="'b' twice"):
        bm.step(StepPlan(d.n + 1, plan, frees=["a"]))
    assert state_of(bm) == before
    bm.check()
    # The same plan without the duplicate is served: c is restored, b cannot grow and goes to swap.
    g = d.step(*plan[:2], frees=["a"])
    assert granted(g) == {"c": (4, 1)} and g.offloaded == ["b"] and not bm.swap.draining


def test_a_plan_with_a_token_id_the_hash_cannot_hold_is_refused_whole() -> None:
    """In-process plans skip the wire's type checks; an id past 64 bits would raise in the hash after
    `a` was admitted."""
    bm = make_bm(FULL, 8)
    d = Driver(bm)
    d.step(E("a", 4, toks(0, 8)))
    before = state_of(bm)
    with pytest.raises(ValueError, match="token id"):
        bm.step(StepPlan(d.n + 1, [E("a", 4), E("b", 9, [1, 2, 3, 2**64, 5, 6, 7, 8, 9], arrival=1)]))
    assert state_of(bm) == before


# ============================================================================== async batching


def test_an_overlapped_plan_leaves_the_running_step_unsettled() -> None:
    """The worker plans step N+1 while N computes: N's pages enter the prefix cache with N+2's plan."""
    bm = make_bm(FULL, 16)
    d = Driver(bm)
    a = toks(0, 9)
    d.step(E("a", 8, a))
    g = d.step(E("a", 1), E("b", 9, a, arrival=1, salt="t"), overlapped=True)
    assert granted(g) == {"a": (8, 1), "b": (0, 9)}  # a continues after its running chunk; b: no hit
    assert (bm.requests["a"].num_computed, bm.requests["a"].in_flight) == (0, 9)
    assert bm.pool.hash_of == {}
    # c's pages are a's, in flight since step 1: it waits for them, not for step 2's partial page.
    g = d.step(E("c", 9, a, arrival=2), overlapped=True)
    assert granted(g) == {"c": (8, 1)}  # step 1 settled: a's two pages are cached
    assert (bm.requests["a"].num_computed, bm.requests["a"].in_flight) == (8, 1)
    d.step(frees=["a", "b", "c"])
    assert bm.stats_dict()["used_blocks"] == 0 and bm.requests == {}


def test_placeholders_count_as_tokens_and_their_pages_wait_for_their_ids() -> None:
    bm = make_bm(FULL, 16)
    d = Driver(bm)
    d.step(E("a", 3, [1, 2, 3]))  # samples token 3, still running when the next plan leaves
    g = d.step(PlanEntry("a", 1, [], 0, num_placeholders=1), overlapped=True)
    assert granted(g) == {"a": (3, 1)}  # computes the placeholder; samples token 4
    # Step 2 settles without naming a: position 3 is computed, but its id is still unknown.
    d.step()
    assert bm.requests["a"].num_computed == 4 and bm.pool.hash_of == {}
    # The ids arrive first thing in a plan: the page is cached before anything is placed, and b hits it.
    g = d.step(E("a", 1, [7, 8]), E("b", 5, [1, 2, 3, 7, 9], arrival=1))
    assert granted(g) == {"a": (4, 1), "b": (4, 1)}
    assert bm.pool.lookup(block_hash(b"", [1, 2, 3, 7], b"")) == table(bm, "a")[0] == table(bm, "b")[0]
    before = state_of(bm)
    with pytest.raises(ValueError, match="-1 placeholders"):
        bm.step(StepPlan(d.n + 1, [PlanEntry("a", 1, [], 0, num_placeholders=-1)]))
    assert state_of(bm) == before


# ============================================================== regressions (found by the model)


def test_swap_slot_freed_by_a_restore_is_not_reused_by_an_offload_in_the_same_step() -> None:
    bm = make_bm(FULL, 6, swap_slots=4)
    d = Driver(bm)
    d.step(E("a", 7, toks(0, 7), arrival=0), E("b", 4, toks(100, 20), arrival=1))
    g = d.step(E("a", 1, [1], arrival=0), E("b", 16, arrival=1))
    assert g.offloaded == ["b"]  # b blocked, a placed: b is its own victim
    # b is restored (first loop), then a is stuck and offloaded (victim loop) in the same step.
    g = d.step(E("b", 12, arrival=1), E("a", 1, [2], arrival=0))
    assert g.offloaded == ["a"] and [g_.request_id for g_ in g.granted] == ["b"]
    read_by_swap_in = {slot for slot, _ in g.swap_in}
    written_by_swap_out = {slot for _, slot in g.swap_out}
    assert not read_by_swap_in & written_by_swap_out, (g.swap_out, g.swap_in)


def test_sliding_restore_fits_in_an_empty_pool() -> None:
    bm = make_bm(SLIDING, 6, swap_slots=16, max_step_tokens=8)
    d = Driver(bm)
    d.step(E("q", 4, toks(0, 4), arrival=0, max_total=8), E("r", 8, toks(100, 40), arrival=1, max_total=40))
    d.step(E("r", 1, arrival=1))
    d.step(E("r", 8, arrival=1))  # starts at 9: nothing recycled yet, r holds pages 0..4
    g = d.step(E("q", 1, [5], arrival=0))  # q needs a page; r (newest, not planned) is offloaded
    assert g.offloaded == ["r"]
    # r now computes from 17 (window from 10: pages 0 and 1 are dead). Steady state: 5 chunks, and the
    # pool is empty after q finishes, so an 8-token step must be granted.
    g = d.step(E("r", 8, arrival=1), frees=["q"])
    assert g.rejected == []
    assert granted(g) == {"r": (17, 8)}


# ============================================================================== stateful worker model

VOCAB = 6  # small: sampled tokens and tails collide often, so prefixes are shared often
BASES = (toks(1000, 16), toks(2000, 16))
SALTS = ("", "", "x")


@dataclass
class WReq:
    """The worker's view of one request."""

    rid: str
    arrival: int
    salt: str
    tokens: list[int]  # prompt + sampled tokens (the last sampled one is not computed yet)
    max_total: int
    sent: int = 0  # tokens the BlockManager has been sent (this incarnation)
    computed: int = 0  # [0, computed) computed (or granted last step: computed by the next plan)
    written: int = 0  # [0, written) holds its KV: `computed` but for a step whose forward still runs
    pending: int = 0  # tokens a step still running samples (async): they follow `tokens`
    state: str = "new"  # new (BM does not know it) | pending | active | offloaded
    tables: list[list[int]] | None = None  # mirror of the block tables, from the grants
    done: bool = False  # finished: freed in the next plan
    aborted: bool = False


@dataclass
class Computing:
    """A grant whose forward has not run yet, with the tables it was given (the worker's mirror and
    the BlockManager's) as they were then: the forward reads those, whatever later grants change."""

    r: WReq
    start: int
    n: int
    samples: bool
    mirror: list[list[int]]
    bm_tables: list[list[int]]


class WorkerModel(RuleBasedStateMachine):
    """A simple worker driving a BlockManager, with a simulated KV pool and swap pool.

    With `overlap` (async batching) a step's forward runs after the next step's grant: each plan
    leaves while the previous step computes."""

    def __init__(
        self, geometry: KVGeometry, swap_pages: int, sharing: bool = True, overlap: bool = False
    ) -> None:
        super().__init__()
        self.geometry = geometry
        self.swap_pages = swap_pages  # swap pool size, in pages (all groups' chunks of one page)
        self.allow_sharing = sharing
        self.overlap = overlap
        self.running: list[Computing] = []  # the latest step's grants, until its forward runs
        self.bm: BlockManager | None = None
        self.reqs: dict[str, WReq] = {}
        self.next_id = 0
        self.steps = 0
        # Simulated bytes: per chunk, per slot in the page, what was computed there.
        self.kv: dict[int, list[object]] = {}
        self.swap_kv: dict[int, list[object]] = {}
        self.consistent = True  # False while a step is half applied (after a failed check)
        # A router's view of the prefix cache, built from the grants' KV events alone.
        self.mirror: dict[bytes, bytes] = {}
        self.unsalted: set[bytes] = set()  # every digest an unsalted request's pages could have

    # ------------------------------------------------------------------ setup

    @initialize(
        pages=st.integers(2, 9),
        margin=st.sampled_from([0.0, 0.0, 0.25]),
        max_step=st.sampled_from([4, 8, 64]),
    )
    def setup(self, pages: int, margin: float, max_step: int) -> None:
        per_page = sum(self.geometry.chunks_per_block(g) for g in range(len(self.geometry.groups)))
        self.max_step = max_step
        self.bm = make_bm(
            self.geometry,
            pages * per_page,
            swap_slots=self.swap_pages * per_page,
            allow_block_sharing=self.allow_sharing,
            safety_margin=margin,
            max_step_tokens=max_step,
        )

    # ------------------------------------------------------------------ rules

    def live(self) -> list[WReq]:
        return [r for r in self.reqs.values() if not r.done and not r.aborted]

    @staticmethod
    def available(r: WReq) -> int:
        """Tokens r could compute now; none when the running step samples its last one (the engine
        plans no token past a request's length limit)."""
        if r.pending and len(r.tokens) + r.pending >= r.max_total:
            return 0
        return len(r.tokens) + r.pending - r.computed

    def plannable(self) -> list[WReq]:
        return [r for r in self.live() if self.available(r)]

    @precondition(lambda self: self.bm is not None and len(self.reqs) < 6)
    @rule(
        base=st.sampled_from(range(len(BASES))),
        shared=st.sampled_from([0, 5, 8, 12, 16]),
        tail=st.lists(st.integers(0, VOCAB - 1), max_size=8),
        salt=st.sampled_from(SALTS),
        max_new=st.integers(1, 8),
    )
    def add_request(self, base: int, shared: int, tail: list[int], salt: str, max_new: int) -> None:
        prompt = BASES[base][:shared] + tail
        if not prompt:
            prompt = [0]
        rid = f"r{self.next_id}"
        self.reqs[rid] = WReq(rid, self.next_id, salt, prompt, len(prompt) + max_new)
        self.next_id += 1

    @precondition(lambda self: self.bm is not None and self.live())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from([r.rid for r in self.live()]), label="abort")
        self.reqs[rid].aborted = True

    @precondition(lambda self: self.bm is not None)
    @rule(data=st.data(), steps=st.integers(1, 4))
    def step(self, data: st.DataObject, steps: int) -> None:
        """`steps` worker steps, each planning a random subset in random order with random chunks."""
        for _ in range(steps):
            order = data.draw(st.permutations([r.rid for r in self.plannable()]), label="order")
            k = data.draw(st.just(len(order)) | st.integers(0, len(order)), label="how many")
            chosen = []
            for r in (self.reqs[rid] for rid in order[:k]):
                most = min(self.available(r), self.max_step)
                chosen.append((r, data.draw(st.just(most) | st.integers(1, most), label=r.rid)))
            self.run_step(chosen, data)

    # ------------------------------------------------------------------ one step

    def apply_kv_events(self, grant: StepGrant) -> None:
        """Mirror the cache as a subscriber would; it must end up knowing exactly the unsalted cached
        pages, each announced with the tokens and parent that hash to it."""
        bm = self.bm
        assert bm is not None
        events = grant.kv_events
        if events is not None:
            if events.cleared:
                self.mirror.clear()
            for block in events.stored:
                assert block.digest not in self.mirror
                assert block.digest == block_hash(block.parent, block.token_ids, b"")  # unsalted, exact
                self.mirror[block.digest] = block.parent
            for digest in events.removed:
                del self.mirror[digest]
        for r in self.reqs.values():
            parent = b""
            for i in range(len(r.tokens) // P if not r.salt else 0):
                parent = block_hash(parent, r.tokens[i * P : (i + 1) * P], b"")
                self.unsalted.add(parent)
        assert set(self.mirror) == set(bm.pool.by_hash) & self.unsalted
        snapshot = bm.kv_snapshot()  # what a subscriber joining now starts from: the same view
        assert snapshot.cleared and {b.digest: b.parent for b in snapshot.stored} == self.mirror

    def run_step(self, chosen: list[tuple[WReq, int]], data: st.DataObject | None) -> StepGrant:
        bm = self.bm
        assert bm is not None
        self.consistent = False
        frees = [r.rid for r in self.reqs.values() if r.done and r.state != "new"]
        aborts = [r.rid for r in self.reqs.values() if r.aborted and r.state != "new"]
        for rid in [r.rid for r in self.reqs.values() if r.done or r.aborted]:
            del self.reqs[rid]
        entries = []
        asked: dict[str, int] = {}
        may_sample: dict[str, bool] = {}
        before = {r.rid: r.state for r, _ in chosen}
        for r, n in chosen:
            assert 1 <= n <= self.available(r)
            admission = r.state in ("new", "pending")
            may_sample[r.rid] = not admission or data is None or data.draw(st.booleans(), label="may sample")
            entries.append(
                PlanEntry(
                    r.rid,
                    n,
                    r.tokens[r.sent :],
                    r.arrival,
                    r.salt,
                    r.max_total,
                    r.pending,
                    may_sample[r.rid],
                )
            )
            asked[r.rid] = n
            r.sent = len(r.tokens)
        old_tables = {rid: [list(t) for t in self._bm_tables(rid)] for rid in self._bm_active()}
        active_before = len(old_tables) - sum(1 for rid in frees + aborts if rid in old_tables)
        # As the worker plans: the running entries' tokens fit the budget, admissions may overshoot it.
        running_tokens = sum(n for r, n in chosen if before[r.rid] in ("active", "offloaded"))
        budgets = st.none() | st.integers(running_tokens, running_tokens + self.max_step)
        token_budget = None if data is None else data.draw(budgets, label="budget")
        admission_budget = None if token_budget is None else token_budget - running_tokens

        self.steps += 1
        plan = StepPlan(
            self.steps,
            entries,
            frees=frees,
            aborts=aborts,
            overlapped=bool(self.running),
            token_budget=token_budget,
        )
        grant = bm.step(plan)
        bm.check()
        assert grant.step == self.steps
        self.apply_kv_events(grant)
        self.check_cached_pages()

        # ---- the grant's shape
        granted_ids = [g.request_id for g in grant.granted]
        assert len(set(granted_ids)) == len(granted_ids)
        assert set(granted_ids) <= set(asked)
        moved = set(grant.offloaded) | set(grant.soft_reset)
        assert not moved & set(granted_ids), "a request placed in this step lost its blocks"
        assert not set(grant.offloaded) & set(grant.soft_reset)
        assert set(grant.blocked) <= set(asked) and not set(grant.blocked) & set(granted_ids)
        for rej in grant.rejected:
            # This worker never asks more than it has; only first-sight "never fits" is expected.
            assert before.get(rej.request_id) == "new" and "needs" in rej.reason, rej
            if self.geometry.all_full:
                need = pages_for(self.reqs[rej.request_id].max_total, P) * bm.allocators[0].k
                assert need > bm.pool.capacity
            del self.reqs[rej.request_id]
        if self.geometry.all_full:
            for r, _ in chosen:
                if before[r.rid] == "new" and r.rid in self.reqs:
                    assert pages_for(r.max_total, P) * bm.allocators[0].k <= bm.pool.capacity
        for rid in moved:
            assert self.reqs[rid].state == "active" and rid in old_tables, rid
        if active_before > 0:
            assert self._bm_active(), "the last active request was offloaded"
        for rid, state in before.items():
            if state == "active" and rid in self.reqs:
                outcomes = (rid in granted_ids) + (rid in grant.blocked) + (rid in moved)
                assert outcomes == 1, f"{rid}: granted, blocked, offloaded or reset, exactly one"

        # ---- the previous step's forward (async), then swap copies: out (victims' live chunks) before
        # in, then this step's forward
        self.finish_running(data)
        out_slots = [slot for _, slot in grant.swap_out]
        assert len(set(out_slots)) == len(out_slots)
        victims_chunks = {c for rid in grant.offloaded for t in old_tables[rid] for c in t if c >= 0}
        assert {c for c, _ in grant.swap_out} <= victims_chunks
        # As the worker orders them: every swap_out copy, then every swap_in copy.
        for chunk, slot in grant.swap_out:
            self.swap_kv[slot] = list(self.kv[chunk])
        for slot, chunk in grant.swap_in:
            self.kv[chunk] = list(self.swap_kv[slot])
        for rid in grant.offloaded:
            r = self.reqs[rid]
            r.state, r.tables = "offloaded", None
        for rid in grant.soft_reset:
            r = self.reqs[rid]  # re-queue prompt + generated as a new request
            r.state, r.tables, r.sent, r.computed, r.written = "new", None, 0, 0, 0

        for rid, state in before.items():
            if rid in self.reqs and state == "new" and self.reqs[rid].state == "new" and rid not in moved:
                self.reqs[rid].state = "pending"  # sent, not admitted (maybe admitted just below)

        if token_budget is not None:
            assert sum(g.num_tokens for g in grant.granted) <= token_budget
        for g in grant.granted:
            r = self.reqs[g.request_id]
            state = before[r.rid]
            n = asked[r.rid]
            assert 1 <= g.num_tokens <= n, "granted more tokens than planned"
            assert len(g.tables) == len(bm.allocators)
            if state in ("new", "pending"):
                assert g.replace and g.start % P == 0 and g.start <= len(r.tokens) - 1
                if not bm.sharing:
                    assert g.start == 0
                end = min(g.start + n, len(r.tokens) + r.pending)
                if not may_sample[r.rid]:
                    end = min(end, len(r.tokens) + r.pending - 1)
                if admission_budget is not None:
                    end = min(end, g.start + admission_budget)
                    admission_budget -= end - g.start  # admissions take the budget in plan order
                assert g.num_tokens == end - g.start
                r.tables = [list(t) for t in g.tables]
                r.written = g.start  # a prefix hit's pages hold their KV already
            elif state == "offloaded":
                assert g.replace and g.start == r.computed and g.num_tokens == n
                r.tables = [list(t) for t in g.tables]
            else:
                assert state == "active" and not g.replace
                assert g.start == r.computed and g.num_tokens == n
                assert r.tables is not None
                for mirror, delta in zip(r.tables, g.tables, strict=True):
                    mirror.extend(delta)
            r.state = "active"
            self.check_writable(r, g.start, g.num_tokens)
            r.computed = g.start + g.num_tokens
            samples = r.computed == len(r.tokens) + r.pending  # the last token's logits: sample one
            r.pending += samples
            tables = [list(t) for t in r.tables]
            bm_tables = [list(t) for t in self._bm_tables(r.rid)]
            self.running.append(Computing(r, g.start, g.num_tokens, samples, tables, bm_tables))
        if not self.overlap:
            self.finish_running(data)

        self.check_outside()
        self.consistent = True
        return grant

    def check_writable(self, r: WReq, start: int, n: int) -> None:
        """The grant's positions `[start, start + n)` are r's alone to write."""
        bm = self.bm
        assert bm is not None and r.tables is not None
        for g, mirror in enumerate(r.tables):
            k = bm.allocators[g].k
            assert len(mirror) >= pages_for(start + n, P) * k, "table does not cover the step"
            for pos in range(start, start + n):
                for j in range(k):
                    chunk = mirror[pos // P * k + j]
                    assert chunk >= RESERVED_CHUNKS, f"{r.rid}: writes position {pos} into {chunk}"
                    assert bm.pool.refcount[chunk] == 1, f"{r.rid}: writes into shared chunk {chunk}"

    def finish_running(self, data: st.DataObject | None) -> None:
        """Run the forward of the latest step's grants, then take their samples (a request finished or
        aborted since computes its wasted token all the same, but takes no sample)."""
        running, self.running = self.running, []
        for c in running:
            self.forward(c)
            c.r.written = max(c.r.written, c.start + c.n)
            if not c.samples or c.r.done or c.r.aborted or c.r.rid not in self.reqs:
                continue
            c.r.pending -= 1
            tok = data.draw(st.integers(0, VOCAB - 1), label="sample") if data else 0
            c.r.tokens.append(tok)
            eos = data.draw(st.booleans(), label="eos") if data else False
            c.r.done = len(c.r.tokens) >= c.r.max_total or (eos and tok == 0)

    def forward(self, c: Computing) -> None:
        """Write the KV of `[start, start + n)` through the worker's mirror; then check the KV this
        step attends to is the request's own."""
        bm = self.bm
        assert bm is not None
        for g, mirror in enumerate(c.mirror):
            k = bm.allocators[g].k
            for pos in range(c.start, c.start + c.n):
                for j in range(k):
                    chunk = mirror[pos // P * k + j]
                    self.kv.setdefault(chunk, [None] * P)[pos % P] = self.value(c.r, g, j, pos)
        # What the step attends to, through the worker's mirror and through the BlockManager's tables
        # (the mirror may still name a recycled page's old chunk; the BlockManager must not recycle a
        # page this step can see).
        self.check_kv(c.r, c.start, c.start + c.n, c.mirror)
        self.check_kv(c.r, c.start, c.start + c.n, c.bm_tables)

    def check_cached_pages(self) -> None:
        """A cached page holds the KV of exactly the tokens (and salt) its hash chain names: it was
        cached only after its forward ran and its ids were known."""
        bm = self.bm
        assert bm is not None
        for chunk, digest in bm.pool.hash_of.items():
            page = self.kv.get(chunk, [None] * P)
            assert None not in page, f"cached chunk {chunk} holds no KV at some position: {page}"
            salt, _, _, tokens = page[-1]
            assert [kv[3] for kv in page] == [tokens[: len(tokens) - P + i + 1] for i in range(P)]
            parent = b""
            for i in range(len(tokens) // P):
                parent = block_hash(parent, list(tokens[i * P : (i + 1) * P]), salt.encode())
            assert len(tokens) % P == 0 and parent == digest, f"cached chunk {chunk} holds other KV"

    def value(self, r: WReq, group: int, sub: int, pos: int) -> object:
        return (r.salt, group, sub, tuple(r.tokens[: pos + 1]))

    def first_live(self, group: int, start: int) -> int:
        if self.geometry.groups[group] == "full":
            return 0
        window = self.geometry.sliding_window
        assert window is not None
        return max(0, start - window + 1)

    def check_kv(self, r: WReq, start: int, end: int, tables: list[list[int]]) -> None:
        """Every position a step starting at `start` attends to, up to `end`, holds r's KV."""
        bm = self.bm
        assert bm is not None
        for g, tbl in enumerate(tables):
            k = bm.allocators[g].k
            for pos in range(self.first_live(g, start), end):
                for j in range(k):
                    chunk = tbl[pos // P * k + j]
                    assert chunk >= RESERVED_CHUNKS, f"{r.rid}: position {pos} (group {g}) recycled"
                    got = self.kv.get(chunk, [None] * P)[pos % P]
                    want = self.value(r, g, j, pos)
                    assert got == want, f"{r.rid}: KV at {pos} (group {g}, chunk {chunk}) is {got}"

    # ------------------------------------------------------------------ outside checks

    def _bm_active(self) -> list[str]:
        assert self.bm is not None
        return [rid for rid, q in self.bm.requests.items() if q.state is CacheState.ACTIVE]

    def _bm_tables(self, rid: str) -> list[list[int]]:
        assert self.bm is not None
        return [a.tables[rid] for a in self.bm.allocators]

    def check_outside(self) -> None:
        bm = self.bm
        assert bm is not None
        # States and token lists agree.
        known = {rid: r for rid, r in self.reqs.items() if r.state != "new"}
        assert set(bm.requests) == set(known)
        want_state = {
            "pending": CacheState.PENDING,
            "active": CacheState.ACTIVE,
            "offloaded": CacheState.OFFLOADED,
        }
        for rid, r in known.items():
            q = bm.requests[rid]
            assert q.state is want_state[r.state], (rid, q.state, r.state)
            assert q.token_ids == r.tokens[: r.sent]
            if r.state == "pending":
                assert q.num_granted == 0
            else:
                assert q.num_granted == r.computed
        # Tables: the worker's mirror equals the BlockManager's, except that a sliding page the
        # BlockManager recycled (-1) may still name its old chunk in the mirror (append deltas cannot
        # say "recycled"); only pages wholly outside the window may be recycled.
        active = {rid for rid, r in known.items() if r.state == "active"}
        for g, alloc in enumerate(bm.allocators):
            assert set(alloc.tables) == active
            for rid in active:
                r = self.reqs[rid]
                assert r.tables is not None
                bm_t, mirror = alloc.tables[rid], r.tables[g]
                assert len(bm_t) == len(mirror), (rid, g, bm_t, mirror)
                live_from = self.first_live(g, r.computed)
                for i, (b, m) in enumerate(zip(bm_t, mirror, strict=True)):
                    if b == RECYCLED:
                        page = i // alloc.k
                        assert (page + 1) * P <= live_from, f"{rid}: page {page} recycled while in window"
                    else:
                        assert b == m, (rid, g, bm_t, mirror)
        # Chunk accounting from outside: distinct chunks named by tables are the used ones.
        used = {c for a in bm.allocators for t in a.tables.values() for c in t if c >= 0}
        assert len(used) == bm.pool.num_used
        assert bm.pool.num_free + bm.pool.num_used == bm.pool.capacity
        stats = bm.stats_dict()
        assert (
            stats["free_blocks"] + stats["evictable_blocks"] + stats["used_blocks"] == stats["total_blocks"]
        )
        # Swap slots: held exactly by the offloaded requests.
        offloaded = {rid for rid, r in known.items() if r.state == "offloaded"}
        assert set(bm.swap.held) == offloaded
        held = sum(1 for layout in bm.swap.held.values() for t in layout for s in t if s >= 0)
        assert stats["swap_slots_used"] == held
        # Every active request still holds its own KV over everything it can attend to; every
        # offloaded one has it in its swap slots.
        for rid in active:
            r = self.reqs[rid]
            self.check_kv(r, r.computed, r.written, self._bm_tables(rid))
        self.check_cached_pages()
        for rid in offloaded:
            r = self.reqs[rid]
            for g, slots in enumerate(bm.swap.held[rid]):
                k = bm.allocators[g].k
                # A page no later step can see is not saved: it would cost a chunk at the restore.
                dead = self.first_live(g, r.computed) // P * k
                assert all(s < 0 for s in slots[:dead]), f"{rid}: swap keeps pages out of the window"
                for pos in range(self.first_live(g, r.computed), r.computed):
                    for j in range(k):
                        slot = slots[pos // P * k + j]
                        assert slot >= 0, f"{rid}: position {pos} not in swap"
                        assert self.swap_kv[slot][pos % P] == self.value(r, g, j, pos)

    # ------------------------------------------------------------------ the end

    def teardown(self) -> None:
        if self.bm is None or not self.consistent:
            return  # nothing set up, or a check already failed: do not bury its message
        self.drain()
        bm = self.bm
        for r in self.reqs.values():
            r.aborted = not r.done
        self.run_step([], None)  # frees/aborts everything
        self.run_step([], None)  # and one more empty plan
        stats = bm.stats_dict()
        assert stats["used_blocks"] == 0, stats
        assert stats["free_blocks"] + stats["evictable_blocks"] == stats["total_blocks"], stats
        assert stats["swap_slots_used"] == 0 and stats["requests_known"] == 0, stats
        assert bm.requests == {} and all(a.tables == {} for a in bm.allocators)

    def drain(self) -> None:
        """Liveness: plan every request in arrival order with the largest chunk until all finish."""
        idle = 0
        for _ in range(1000):
            pending = sorted(self.live(), key=lambda r: r.arrival)
            if not pending:
                return
            chosen = [(r, min(self.available(r), self.max_step)) for r in pending if self.available(r)]
            grant = self.run_step(chosen, None)
            if grant.granted or grant.soft_reset or grant.offloaded or grant.rejected:
                idle = 0
            else:
                idle += 1
            assert idle < 3, f"no progress: {[(r.rid, r.state, r.computed, len(r.tokens)) for r in pending]}"
        raise AssertionError("requests never finished")


STATEFUL_SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["sync", "async"])


@pytest.mark.fuzz
@OVERLAP
@pytest.mark.parametrize("swap_pages", [0, 3, 64], ids=["no-swap", "small-swap", "swap"])
@pytest.mark.parametrize(
    "geometry", [FULL, SLIDING, HYBRID, HYBRID_3], ids=["full", "sliding", "hybrid", "hybrid-3chunk"]
)
def test_worker_model(geometry: KVGeometry, swap_pages: int, overlap: bool) -> None:
    run_state_machine_as_test(
        lambda: WorkerModel(geometry, swap_pages, overlap=overlap),
        settings=settings(max_examples=20, stateful_step_count=30, **STATEFUL_SETTINGS),
    )


@pytest.mark.fuzz
@OVERLAP
def test_worker_model_without_sharing(overlap: bool) -> None:
    run_state_machine_as_test(
        lambda: WorkerModel(FULL, 64, sharing=False, overlap=overlap),
        settings=settings(max_examples=20, stateful_step_count=30, **STATEFUL_SETTINGS),
    )


@pytest.mark.slow
@pytest.mark.fuzz
@OVERLAP
@pytest.mark.parametrize("swap_pages", [0, 3, 64], ids=["no-swap", "small-swap", "swap"])
@pytest.mark.parametrize(
    "geometry", [FULL, SLIDING, HYBRID, HYBRID_3], ids=["full", "sliding", "hybrid", "hybrid-3chunk"]
)
def test_worker_model_long(geometry: KVGeometry, swap_pages: int, overlap: bool) -> None:
    run_state_machine_as_test(
        lambda: WorkerModel(geometry, swap_pages, overlap=overlap),
        settings=settings(max_examples=200, stateful_step_count=80, **STATEFUL_SETTINGS),
    )
