"""The worker's book of its gateways: who they are, which requests each owns, and the news each is owed.

Gateways are peers of the worker's ROUTER socket, known by their ZMQ routing id. A request's engine id
is keyed by that routing id (`request_key`), which a peer cannot forge, so no gateway can reach
another's requests. News (outputs, status, prefix-cache events, flush answers) collects on each
gateway during a turn and leaves as one `WorkerMessage` per gateway (`messages`). A gateway silent for
the timeout is presumed dead (`expire`): its requests are dropped from the book and it is told so, in
case it lives after all, so that no stream waits for ever.

No sockets and no engine here: the worker's loop (server.py) aborts in the engine what this book
gives up, and sends what it collects.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import structlog

from services.common.cachemgr_messages import KvEvents
from services.common.gateway_messages import (
    NewRequest,
    RequestOutput,
    StepTimes,
    TokenLogprob,
    WorkerMessage,
    WorkerStatus,
)
from services.worker.request import FinishReason, Request

log = structlog.get_logger(__name__)


@dataclass
class Gateway:
    routing_id: bytes
    gateway_id: str
    last_seen: float
    requests: set[str] = field(default_factory=set)  # engine request ids
    # This turn's news, sent as one message by the loop's flush.
    outputs: list[RequestOutput] = field(default_factory=list)
    status: WorkerStatus | None = None
    kv_events: list[KvEvents] = field(default_factory=list)
    flushed: list[tuple[int, int]] = field(default_factory=list)

    def refuse(self, request_id: str, error: str, code: str) -> None:
        """End one of this gateway's requests with an error (it may never have reached the engine)."""
        self.outputs.append(RequestOutput(request_id, [], finish="error", error=error, code=code))


def request_key(gateway: Gateway, request_id: str) -> str:
    """The engine's id of a gateway's request."""
    return f"{gateway.routing_id.hex()}/{request_id}"


@dataclass
class Tracked:
    """One request in the book: whose it is and what it has been sent."""

    gateway: Gateway
    request_id: str  # the gateway's id
    trace_id: str
    emitted: int = 0
    started: bool = False


def _logprobs(req: Request, start: int, end: int) -> list[TokenLogprob] | None:
    if req.params.logprobs is None:
        return None
    return [
        TokenLogprob(req.output_ids[i], lp.token_logprob, lp.top)
        for i, lp in enumerate(req.logprobs[start:end], start)
        if lp is not None
    ]


def _prompt_logprobs(req: Request) -> list[TokenLogprob] | None:
    if req.params.prompt_logprobs is None:
        return None
    return [
        TokenLogprob(token, lp.token_logprob, lp.top)
        for token, lp in zip(req.prompt_ids[1:], req.prompt_logprobs, strict=True)
    ]


class GatewaySessions:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.gateways: dict[bytes, Gateway] = {}
        self.tracked: dict[str, Tracked] = {}

    def __iter__(self) -> Iterator[Gateway]:
        return iter(self.gateways.values())

    def seen(self, routing_id: bytes, gateway_id: str, now: float) -> tuple[Gateway, bool]:
        """The gateway a message came from, and whether it is new (a new gateway id on a known
        routing id is a new gateway too)."""
        gateway = self.gateways.get(routing_id)
        new = gateway is None or gateway.gateway_id != gateway_id
        if gateway is None or new:
            gateway = self.gateways[routing_id] = Gateway(routing_id, gateway_id, now)
            log.info("gateway connected", gateway_id=gateway_id)
        gateway.last_seen = now
        return gateway, new

    def track(self, gateway: Gateway, new: NewRequest) -> None:
        key = request_key(gateway, new.request_id)
        self.tracked[key] = Tracked(gateway, new.request_id, new.trace_id)
        gateway.requests.add(key)

    def untrack(self, gateway: Gateway, request_id: str) -> Tracked | None:
        """Drop a gateway's request from the book (the loop aborts it in the engine); None when it
        finished already or was never known: aborts race with completions."""
        key = request_key(gateway, request_id)
        tracked = self.tracked.get(key)
        if tracked is None or tracked.gateway is not gateway:
            return None
        del self.tracked[key]
        gateway.requests.discard(key)
        return tracked

    def emit(self, req: Request) -> bool:
        """Queue what `req` has that its gateway has not been sent; whether that finished it."""
        tracked = self.tracked.get(req.request_id)
        if tracked is None:
            return False
        start, end = tracked.emitted, len(req.output_ids)
        tracked.emitted = end
        first = not tracked.started and req.scheduled_at is not None
        tracked.started = tracked.started or first
        finish, error, code = "", "", ""
        if req.finished:
            assert req.finish_reason is not None
            finish = req.finish_reason.value
            if req.finish_reason is FinishReason.ERROR:
                error, code = req.error, "INVALID_ARGUMENT"
            del self.tracked[req.request_id]
            tracked.gateway.requests.discard(req.request_id)
            log.info(
                "request finished",
                request_id=tracked.trace_id,
                reason=finish,
                error=error or None,
                completion_tokens=len(req.output_ids),
                cached_tokens=req.num_cached_tokens,
            )
        tracked.gateway.outputs.append(
            RequestOutput(
                tracked.request_id,
                req.output_ids[start:end],
                _logprobs(req, start, end),
                finish=finish,
                error=error,
                code=code,
                cached_tokens=req.num_cached_tokens if first else -1,
                queue_seconds=req.scheduled_at - req.arrived_at if first and req.scheduled_at else -1.0,
                prompt_logprobs=_prompt_logprobs(req) if start == 0 < end else None,
            )
        )
        return req.finished

    def fail_all(self, reason: str, code: str) -> list[str]:
        """End every request in the book with an error; their engine ids, for the loop to abort."""
        keys = list(self.tracked)
        for key, tracked in self.tracked.items():
            tracked.gateway.refuse(tracked.request_id, reason, code)
            tracked.gateway.requests.discard(key)
        self.tracked.clear()
        return keys

    def expire(self, now: float) -> list[tuple[Gateway, list[str]]]:
        """Gateways silent for `timeout_s` (of awake time), removed with their requests (each ended
        with an error in the gateway's news) and the engine ids of those requests."""
        expired = []
        for routing_id, gateway in list(self.gateways.items()):
            if now - gateway.last_seen <= self.timeout_s:
                continue
            keys = list(gateway.requests)
            for key in keys:
                tracked = self.tracked.pop(key)
                gateway.refuse(tracked.request_id, "the worker presumed this gateway dead", "UNAVAILABLE")
            gateway.requests.clear()
            del self.gateways[routing_id]
            log.warning("gateway timed out; its requests were aborted", gateway_id=gateway.gateway_id)
            expired.append((gateway, keys))
        return expired

    def queue_kv_events(self, events: KvEvents) -> None:
        for gateway in self.gateways.values():  # every gateway: each may have routers subscribed
            gateway.kv_events.append(events)

    def messages(self, worker_id: str, profile: StepTimes | None) -> list[tuple[Gateway, WorkerMessage]]:
        """One message per gateway with news: its outputs, its status if due, the step profile (with
        outputs), the prefix cache's changes; the news is then cleared."""
        out = []
        for gateway in self.gateways.values():
            if gateway.outputs or gateway.status is not None or gateway.kv_events or gateway.flushed:
                step = profile if gateway.outputs else None
                message = WorkerMessage(
                    worker_id, gateway.outputs, gateway.status, step, gateway.kv_events, gateway.flushed
                )
                out.append((gateway, message))
                gateway.outputs, gateway.status, gateway.kv_events, gateway.flushed = [], None, [], []
        return out
