"""The gateway's KV event log: numbered batches, replay from a cursor, snapshots when history is gone."""

from __future__ import annotations

import asyncio

from services.common.cachemgr_messages import KvEvents, StoredBlock
from services.gateway.kv_event_log import KvBatch, KvEventLog


def page(n: int, parent: int | None = None) -> StoredBlock:
    return StoredBlock(bytes([n]), bytes([parent]) if parent is not None else b"", [n, n])


async def take(log: KvEventLog, start: int, n: int) -> list[KvBatch]:
    out: list[KvBatch] = []
    async for batch in log.subscribe(start):
        out.append(batch)
        if len(out) == n:
            return out
    raise AssertionError("subscription ended")


def test_a_cursor_replays_what_it_missed_then_follows_live_batches() -> None:
    async def run() -> None:
        log = KvEventLog()
        for n in range(3):
            await log.append(KvEvents(stored=[page(n)]))
        task = asyncio.create_task(take(log, 2, 3))
        await asyncio.sleep(0)
        await log.append(KvEvents(removed=[bytes([0])]))
        batches = await asyncio.wait_for(task, 5)
        assert [(b.sequence, b.snapshot) for b in batches] == [(2, False), (3, False), (4, False)]
        assert batches[-1].events.removed == [bytes([0])]

    asyncio.run(run())


def test_without_a_usable_cursor_a_snapshot_of_live_pages_comes_first() -> None:
    async def run() -> None:
        log = KvEventLog(history=2)
        await log.append(KvEvents(stored=[page(1), page(2, 1)]))
        await log.append(KvEvents(stored=[page(3)], removed=[bytes([1])]))
        await log.append(KvEvents(stored=[page(4, 3)]))
        for start in (0, 1):  # 0: from the current state; 1: older than the two batches kept
            [snap] = await take(log, start, 1)
            assert snap.snapshot and snap.sequence == 3
            assert snap.events == KvEvents(cleared=True, stored=[page(2, 1), page(3), page(4, 3)])
        assert [b.sequence for b in await take(log, 2, 2)] == [2, 3]  # still in history

    asyncio.run(run())


def test_a_cleared_cache_empties_the_snapshot() -> None:
    async def run() -> None:
        log = KvEventLog()
        await log.append(KvEvents(stored=[page(1)]))
        await log.append(KvEvents(cleared=True, stored=[page(9)]))
        assert log.snapshot().events.stored == [page(9)] and log.live_pages == 1

    asyncio.run(run())


def test_a_subscriber_before_any_batch_waits_for_the_first() -> None:
    async def run() -> None:
        log = KvEventLog()
        task = asyncio.create_task(take(log, 0, 1))
        await asyncio.sleep(0)
        await log.append(KvEvents(cleared=True))
        [first] = await asyncio.wait_for(task, 5)
        assert (first.sequence, first.snapshot, first.events.cleared) == (1, False, True)

    asyncio.run(run())
