"""One step's answer as the BlockManager builds it; `build` makes the immutable `StepGrant`.

Invariant: each grant counts its tokens as in flight on the request at once (`CacheRequest.in_flight`)
and is remembered (`in_flight`) until the step settles.
"""

from __future__ import annotations

from services.cachemgr.cache_request import CacheRequest
from services.common.cachemgr_messages import Granted, KvEvents, Rejected, StepGrant


class GrantBuilder:
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
        self.page_copies: list[tuple[int, int]] = []
        self.kv_events: KvEvents | None = None
        self.in_flight: list[tuple[CacheRequest, int]] = []

    def grant(self, req: CacheRequest, start: int, n: int, tables: list[list[int]], replace: bool) -> None:
        req.in_flight += n
        self.in_flight.append((req, n))
        self.granted.append(Granted(req.request_id, start, n, [list(t) for t in tables], replace))

    def fork(self, child: CacheRequest, tables: list[list[int]], copies: list[tuple[int, int]]) -> None:
        """A fork starts at its prompt's end with nothing to compute; the KV its parent computes this
        step is in flight for it too, and settles with the step."""
        end = len(child.token_ids)
        child.in_flight = end - child.num_computed
        self.in_flight.append((child, child.in_flight))
        self.granted.append(Granted(child.request_id, end, 0, [list(t) for t in tables], True))
        self.page_copies += copies

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
            page_copies=self.page_copies,
            kv_events=self.kv_events,
        )
