"""The worker <-> cachemgr protocol: attach once, then one StepPlan in, one StepGrant out, per step.

Typed msgspec structs so that the same objects cross a ZMQ socket as msgpack (never pickle) or are
passed directly to `BlockManager.step` in-process. Every message carries `version`; a peer rejects a
version it does not speak. Messages are tagged so that one decoder reads any of a link's kinds, and
anything else (garbage, truncated, foreign) fails to decode and is dropped.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from services.common.tensor_handles import TensorHandle

# 2: placeholders and overlapped steps (async batching); 3: admission budget; 4: forks (n > 1)
PROTOCOL_VERSION = 4
# Token ids out of this range fail to decode, so they never reach the hashing code.
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**31)]


class PlanEntry(msgspec.Struct, array_like=True, frozen=True):
    """One request the worker would like to run this step, in policy order.

    `new_token_ids` are the request's tokens the cachemgr has not been sent yet (the whole prompt the
    first time, the last sampled token afterwards); the cachemgr keeps the token list for hashing.
    `num_tokens` is how many tokens the worker wants to compute this step. For a request not admitted
    yet it counts from wherever its prefix hit leaves it, and the grant may be shorter (the step's
    `token_budget`); such a chunk reaches the prompt's end, and so samples, only with `may_sample`
    (the worker holds a logits row for it).

    With async batching the plan leaves before the step still computing has sampled: its tokens are
    `num_placeholders` more after `new_token_ids`, ids unknown. They count toward `num_tokens` (a
    decode computes one), and their ids lead the request's next `new_token_ids`; a page holding one
    enters the prefix cache only once its id is known.

    `fork_of` names a request whose prompt this one shares (a sibling of the same n > 1 call): the
    entry follows its parent's in the plan, plans no token, and asks to start where the parent's
    prompt ends, sampling from the parent's logits row. It is granted only in the step whose grant
    takes the parent to its prompt's end; otherwise it is passed over, and the worker plans it as a
    request of its own from then on.
    """

    request_id: str
    num_tokens: int
    new_token_ids: list[TokenId]
    arrival: int
    cache_salt: str = ""
    max_total_tokens: int = 0  # prompt + max new tokens, for the fits-at-all check on first sight
    num_placeholders: Annotated[int, msgspec.Meta(ge=0, lt=2**31)] = 0
    may_sample: bool = True
    fork_of: str = ""


class StepPlan(msgspec.Struct, frozen=True, tag="plan"):
    step: int
    entries: list[PlanEntry]
    frees: list[str] = []  # finished requests: release their blocks before anything else
    aborts: list[str] = []  # cancelled/errored requests: release likewise
    # The previous step still computes (async batching): its grants count as computed from the next
    # plan on, so that no page enters the prefix cache before its KV is written.
    overlapped: bool = False
    # Tokens the whole step may compute (the worker's `max_batch_tokens`). The worker cannot know
    # admissions' prefix hits, so it plans more admissions than fit if none hit; the cachemgr grants
    # them, in order, what the running entries' planned tokens and the earlier admissions leave.
    # None: every entry as planned.
    token_budget: int | None = None
    version: int = PROTOCOL_VERSION


class Granted(msgspec.Struct, array_like=True, frozen=True):
    """A placed request. It computes tokens `[start, start + num_tokens)` this step.

    `start` differs from the worker's count only on admission with a prefix hit, and for a fork, which
    starts at its parent's prompt end and computes nothing (`num_tokens == 0`). `tables` holds, per
    allocator group, chunk ids to append to the worker's mirror of the block table, or the whole table
    when `replace` (admission from scratch, restore from swap). Recycled sliding pages show as -1.
    """

    request_id: str
    start: int
    num_tokens: int
    tables: list[list[int]]
    replace: bool


class Rejected(msgspec.Struct, array_like=True, frozen=True):
    request_id: str
    reason: str


class StoredBlock(msgspec.Struct, array_like=True, frozen=True):
    """A full page whose KV entered the prefix cache: its chained hash, its parent's (b"" for a
    prompt's first page) and its tokens, which is what a router needs to mirror the cache."""

    digest: bytes
    parent: bytes
    token_ids: list[int]


class KvEvents(msgspec.Struct, frozen=True):
    """What one step did to the prefix cache, for routers that track each replica's cache (SMG's
    `SubscribeKvEvents`). Salted pages are left out: they can serve only their own tenant, whom a
    router cannot tell by tokens. Within a step every `stored` page precedes every `removed` hash
    (pages are registered at the step's start; eviction happens while it places requests).
    `cleared`: this BlockManager is new (its cachemgr started), so whatever a subscriber knew is gone."""

    cleared: bool = False
    stored: list[StoredBlock] = []
    removed: list[bytes] = []


class StepGrant(msgspec.Struct, frozen=True, tag="grant"):
    step: int
    granted: list[Granted]
    blocked: list[str]  # active requests that could not get blocks and were not offloaded
    offloaded: list[str]  # moved to the swap pool; progress kept, restored later without recompute
    soft_reset: list[str]  # blocks freed; re-queue with generated tokens appended to the prompt
    rejected: list[Rejected]  # can never fit (bad request): fail it
    swap_out: list[tuple[int, int]]  # (chunk, swap slot): copy before this step's forward
    swap_in: list[tuple[int, int]]  # (swap slot, chunk): copy after swap_out, before the forward
    # (chunk, chunk): a fork's own copy of its parent's partly filled last page, copied after this
    # step's forward (which writes the parent's last tokens into it) and before the next one.
    page_copies: list[tuple[int, int]] = []
    kv_events: KvEvents | None = None  # None: the prefix cache did not change
    version: int = PROTOCOL_VERSION


class Attach(msgspec.Struct, frozen=True, tag="attach"):
    """A worker (re)starting. A new `worker_id` makes the cachemgr drop the previous worker's requests:
    their full pages stay in the prefix cache, so re-submitted requests recompute little."""

    worker_id: str
    key: str = ""  # the stack's internal key (common/wire.py): without it nobody is given the pools
    version: int = PROTOCOL_VERSION


class StatsQuery(msgspec.Struct, frozen=True, tag="stats_query"):
    version: int = PROTOCOL_VERSION


class Attached(msgspec.Struct, frozen=True, tag="attached"):
    cachemgr_id: str
    geometry: dict[str, Any]  # KVGeometry fields
    sizing: dict[str, Any]  # CacheSizing fields
    kv: TensorHandle
    swap: TensorHandle | None
    kv_prefaulted: bool
    prefix_caching: bool
    max_request_tokens: int
    released: int  # requests of a previous worker dropped on this attach
    version: int = PROTOCOL_VERSION


class FlushCache(msgspec.Struct, frozen=True, tag="flush_cache"):
    """Drop every cached prefix no request holds (SMG's FlushCache); pages in use stay."""

    version: int = PROTOCOL_VERSION


class Flushed(msgspec.Struct, frozen=True, tag="flushed"):
    blocks: int  # cached blocks dropped
    kv_events: KvEvents | None  # their removal, for routers (no step may follow soon)
    version: int = PROTOCOL_VERSION


class KvSnapshotQuery(msgspec.Struct, frozen=True, tag="kv_snapshot_query"):
    version: int = PROTOCOL_VERSION


class KvSnapshot(msgspec.Struct, frozen=True, tag="kv_snapshot"):
    events: KvEvents  # `cleared` and every live announced page: a late subscriber's starting state
    version: int = PROTOCOL_VERSION


class Stats(msgspec.Struct, frozen=True, tag="stats"):
    stats: dict[str, int]
    version: int = PROTOCOL_VERSION


class Failure(msgspec.Struct, frozen=True, tag="failure"):
    """The cachemgr could not serve a message: not attached, wrong version, bad plan."""

    reason: str
    version: int = PROTOCOL_VERSION


ToCachemgr = Attach | StepPlan | StatsQuery | FlushCache | KvSnapshotQuery
FromCachemgr = Attached | StepGrant | Stats | Flushed | KvSnapshot | Failure
