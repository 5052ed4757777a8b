"""The replica's prefix-cache changes, numbered for subscribers (SMG's `SubscribeKvEvents`).

The worker forwards each step's `KvEvents` (see `common/cachemgr_messages.py`); every one becomes a batch with
the next sequence number. The log keeps the last `history` batches, so that a subscriber resuming
from a sequence number it has seen replays what it missed, and a mirror of the live cached pages, so
that a subscriber without a usable cursor (0, or older than the history) starts from a snapshot: the
mirror as one batch (`cleared`, then every live page, parents first) numbered with the latest sequence,
after which live batches follow with no gap and no duplicate.

Pure asyncio, no I/O: the gateway feeds it from its worker link and the servicer reads it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.common.cachemgr_messages import KvEvents, StoredBlock

DEFAULT_HISTORY = 4096


@dataclass(frozen=True)
class KvBatch:
    sequence: int
    timestamp: float
    events: KvEvents
    snapshot: bool = False  # a resync built from the mirror, not a batch the worker sent


class KvEventLog:
    def __init__(self, history: int = DEFAULT_HISTORY) -> None:
        self.sequence = 0  # of the latest batch; 0 before the first
        # Whether the mirror holds every live page: the log saw the cache start empty (`cleared`).
        # A gateway that starts beside a running cachemgr knows nothing of what it cached before.
        self.complete = False
        self._history: deque[KvBatch] = deque(maxlen=history)
        # Live cached pages in the order they were stored: a page's parent, if cached, precedes it.
        self._live: dict[bytes, StoredBlock] = {}
        self._changed = asyncio.Condition()

    @property
    def live_pages(self) -> int:
        return len(self._live)

    async def append(self, events: KvEvents) -> None:
        if events.cleared:
            self._live.clear()
            self.complete = True
        for block in events.stored:
            self._live[block.digest] = block
        for digest in events.removed:
            self._live.pop(digest, None)
        self.sequence += 1
        self._history.append(KvBatch(self.sequence, time.time(), events))
        async with self._changed:
            self._changed.notify_all()

    def snapshot(self) -> KvBatch:
        return KvBatch(self.sequence, time.time(), KvEvents(True, list(self._live.values())), snapshot=True)

    def since(self, start: int) -> list[KvBatch] | None:
        """Batches numbered `start` and later, or None when the history no longer reaches `start`."""
        if start < 1 or start > self.sequence + 1:
            return None
        if start == self.sequence + 1:
            return []
        if not self._history or self._history[0].sequence > start:
            return None
        return [b for b in self._history if b.sequence >= start]

    async def subscribe(self, start: int = 0) -> AsyncIterator[KvBatch]:
        """Batches from `start` on (a snapshot first when that history is gone), then live ones for
        as long as the caller iterates."""
        replay = self.since(start)
        if replay is None:
            replay = [self.snapshot()] if self.sequence else []  # before any batch: nothing to resync
        pending, cursor = replay, replay[-1].sequence if replay else self.sequence
        while True:
            for batch in pending:
                yield batch
            async with self._changed:
                while self.sequence <= cursor:
                    await self._changed.wait()
            recent = self.since(cursor + 1)
            # None: fell behind the history, resync
            pending = recent if recent is not None else [self.snapshot()]
            cursor = pending[-1].sequence
