"""A BlockManager's state as plain values: what tests compare before and after a step that must change
nothing (a refused plan, a hostile message)."""

from __future__ import annotations

from services.cachemgr.block_manager import BlockManager


def state_of(bm: BlockManager) -> tuple[object, ...]:
    """Everything a step may change, as plain values: equal before and after a refused plan."""
    pool, swap = bm.pool, bm.swap
    return (
        {
            rid: (r.state, r.num_computed, r.in_flight, list(r.token_ids), list(r.block_hashes))
            for rid, r in bm.requests.items()
        },
        [{rid: list(t) for rid, t in a.tables.items()} for a in bm.allocators],
        (
            list(pool.untouched),
            list(pool.free),
            list(pool.evictable.items()),
            list(pool.refcount),
            dict(pool.hash_of),
        ),
        (list(swap.free), list(swap.draining), {rid: [list(t) for t in ts] for rid, ts in swap.held.items()}),
        dict(vars(bm.stats)),
    )
