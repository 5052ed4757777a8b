"""A request as the cachemgr sees it: the token ids it knows, its state, and how far its KV is
computed.

States: *pending* (known, no blocks yet), *active* (holds blocks), *offloaded* (its blocks live in
swap slots). A request the BlockManager soft-resets or releases is forgotten.

Invariants:
- `num_granted = num_computed + in_flight <= num_tokens`: tokens settled, then tokens granted to a
  step that has not settled yet (see block_manager.py), then tokens not granted;
- `block_hashes` chains over its first full pages of settled KV and known ids, one digest a page.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from services.common.cachemgr_messages import PlanEntry


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


def take_ids(req: CacheRequest, entry: PlanEntry) -> None:
    """The entry's ids extend the known ones (filling earlier placeholders first); its placeholders
    are then all that follows."""
    req.token_ids.extend(entry.new_token_ids)
    req.num_placeholders = entry.num_placeholders
