"""The gateway <-> worker protocol: each side sends at most one message per loop turn (per step).

The gateway coalesces the calls that arrived since its last send into one `GatewayMessage` (new
requests, aborts, a load query); an empty one is a heartbeat. The worker answers with one
`WorkerMessage` per step to each gateway that has requests in it, carrying every update, plus a
status (load and model facts) every heartbeat interval and in reply to a load query.
msgspec structs, never pickle; `version` must match.
"""

from __future__ import annotations

import msgspec

from services.common.cachemgr_messages import KvEvents
from services.common.sampling_params import SamplingParams

PROTOCOL_VERSION = 1


class NewRequest(msgspec.Struct, frozen=True):
    request_id: str  # unique per gateway; the worker keys requests by (gateway, request_id)
    prompt_ids: list[int]  # validated per request by the worker: one bad request fails alone
    params: SamplingParams
    priority: int = 0
    cache_salt: str = ""
    trace_id: str = ""  # the client's x-request-id, bound in the worker's log lines
    # A request of the same gateway, sent before with the same prompt (a sibling of one n > 1 call),
    # whose prompt KV this one shares where it can (see worker/request.py, `Request.fork_of`).
    fork_of: str = ""


class GatewayMessage(msgspec.Struct, frozen=True):
    gateway_id: str
    adds: list[NewRequest] = []
    aborts: list[str] = []
    load_query: int = 0  # nonzero: answer with a status carrying this id
    flush_cache: int = 0  # nonzero: drop the cached prefixes no request holds, answer with this id
    key: str = ""  # the stack's internal key (common/wire.py); a message without it is dropped
    version: int = PROTOCOL_VERSION


class TokenLogprob(msgspec.Struct, array_like=True, frozen=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class RequestOutput(msgspec.Struct, array_like=True, frozen=True):
    """A request's news since its previous output. `finish` is "" while it runs, else one of
    eos, stop_token, length, aborted, error (then `error` says why and `code` gives the gRPC status
    name to report: INVALID_ARGUMENT for a bad request, UNAVAILABLE when the stack failed it)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish: str = ""
    error: str = ""
    code: str = ""
    cached_tokens: int = -1  # prompt tokens served from the prefix cache; sent once, when known
    queue_seconds: float = -1.0  # arrival at the worker -> first scheduled; sent once
    # Asked-for prompt logprobs, of prompt tokens 1.. (the first has none); sent once, with the
    # first token.
    prompt_logprobs: list[TokenLogprob] | None = None


class Load(msgspec.Struct, frozen=True):
    requests_running: int = 0
    requests_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    swap_slots_used: int = 0
    swap_slots_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    offloads: int = 0
    soft_resets: int = 0
    swap_restores: int = 0
    kv_pool_bytes: int = 0
    kv_pool_committed_bytes: int = 0
    host_available_bytes: int = 0
    steps: int = 0
    computed_tokens: int = 0
    forks: int = 0
    # Bookkeeping that must drain to zero when idle (checked by the soak test, exported as metrics).
    worker_streams: int = 0  # requests the worker tracks on behalf of gateways
    cache_requests: int = 0  # requests the cachemgr holds state for


class WorkerFacts(msgspec.Struct, frozen=True):
    """What the gateway needs to validate and describe requests before they reach the worker."""

    vocab_size: int
    max_request_tokens: int  # prompt + output tokens one request may hold (model and cache limits)
    page_size: int
    total_blocks: int
    prefix_caching: bool
    dtype: str
    device: str
    max_logprobs: int
    kv_bytes: int = 0  # the KV pool's size in memory (0: not reported)
    kv_dtype: str = ""  # the KV pages' dtype ("": not reported)


class WorkerStatus(msgspec.Struct, frozen=True):
    worker_id: str  # changes when the worker restarts
    ready: bool  # attached to the cachemgr and warmed up
    facts: WorkerFacts | None
    load: Load
    load_query: int = 0  # the query this answers, if any


class StepTimes(msgspec.Struct, array_like=True, frozen=True):
    """Seconds one worker step spent in each phase (the step profile). With async batching forward
    and sample overlap the others, so `total` is the step's wall time, not the phases' sum; `wait`
    is the part of the forward the overlap did not hide. The grammar phases are parts of schedule
    (the matchers accepting tokens and filling masks) and of sample (the masks applied), zero in a
    step without constrained requests."""

    schedule: float
    cache: float
    build: float
    forward: float
    sample: float
    emit: float
    num_tokens: int
    num_requests: int
    wait: float
    total: float
    grammar_advance: float = 0.0
    grammar_fill: float = 0.0
    grammar_apply: float = 0.0


class WorkerMessage(msgspec.Struct, frozen=True):
    worker_id: str
    outputs: list[RequestOutput] = []
    status: WorkerStatus | None = None
    step: StepTimes | None = None
    kv_events: list[KvEvents] = []  # the prefix cache's changes since the last message, in order
    flushed: list[tuple[int, int]] = []  # (flush_cache id, cached blocks dropped, -1: no cache reachable)
    version: int = PROTOCOL_VERSION
