"""The gateway's link to the worker: an asyncio ZMQ DEALER socket.

Calls register a stream (an asyncio.Queue of `RequestOutput`) and queue their add or abort; everything
queued in one event-loop turn leaves as one `GatewayMessage`. A heartbeat (an empty message) goes out
every `heartbeat_s` so the worker knows this gateway lives. The worker's periodic status tells
readiness and load.

No status for `worker_timeout_s` makes the worker not ready (no new calls; health NOT_SERVING), but
its requests stand: a worker busy with one long step (a huge unchunked prefill) speaks again with
the same id and its streams carry on. A new worker id means it restarted and its requests are gone.
Their streams are not failed: once the new worker is ready, each is re-submitted as its prompt plus
the tokens it already streamed, with its token limits reduced by as many, so the client sees the
stream continue with no token repeated or missing (greedy output equals an uninterrupted run). Full
pages of the lost requests stay in the cachemgr's prefix cache, so the re-prefill recomputes little;
how much is counted (`recomputed_tokens`). A stream that gets no news for `resubmit_timeout_s` after
its worker went silent or was replaced fails UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
import structlog
import zmq
import zmq.asyncio

from services.common.awake_clock import AwakeClock
from services.common.gateway_messages import (
    PROTOCOL_VERSION,
    GatewayMessage,
    Load,
    NewRequest,
    RequestOutput,
    StepTimes,
    WorkerFacts,
    WorkerMessage,
    WorkerStatus,
)
from services.common.wire import decode_or_drop
from services.gateway.kv_event_log import KvEventLog

log = structlog.get_logger(__name__)


@dataclass
class _Stream:
    request: NewRequest  # as first sent (its prompt and limits)
    queue: asyncio.Queue[RequestOutput] = field(default_factory=asyncio.Queue)
    tokens: list[int] = field(default_factory=list)  # ids delivered to the stream so far
    lost_at: float | None = None  # the worker holding it died; waits for re-submission
    resubmitted: bool = False  # the next output is the re-submission's first


def resubmission(request: NewRequest, generated: list[int]) -> NewRequest:
    """What a lost request continues as: the tokens it streamed become part of its prompt. Prompt
    logprobs came with the first token: asked for again only if none was streamed. The streamed
    tokens stay output to the presence and frequency penalties."""
    n = len(generated)
    p = request.params
    params = msgspec.structs.replace(
        p,
        max_new_tokens=p.max_new_tokens - n,
        min_new_tokens=max(0, p.min_new_tokens - n),
        prompt_logprobs=None if generated else p.prompt_logprobs,
        generated_in_prompt=p.generated_in_prompt + n,
    )
    return msgspec.structs.replace(request, prompt_ids=[*request.prompt_ids, *generated], params=params)


class WorkerClient:
    def __init__(
        self,
        address: str,
        *,
        heartbeat_s: float = 0.5,
        worker_timeout_s: float = 10.0,
        resubmit_timeout_s: float = 60.0,
        key: str = "",
        on_ready_change: Callable[[bool], None] | None = None,
        on_step: Callable[[StepTimes], None] | None = None,
    ) -> None:
        self.address = address
        self.gateway_id = uuid.uuid4().hex[:12]
        self.key = key
        self.heartbeat_s = heartbeat_s
        self.worker_timeout_s = worker_timeout_s
        self.resubmit_timeout_s = resubmit_timeout_s
        self.resubmitted = 0  # requests re-submitted after a worker loss, since start
        self.recomputed_tokens = 0  # prompt tokens their re-prefills computed (not cache hits)
        self.on_ready_change = on_ready_change
        self.on_step = on_step
        self.ready = False
        self.facts: WorkerFacts | None = None
        self.load = Load()
        self.worker_id = ""
        self.kv_events = KvEventLog()  # the prefix cache's changes, for routers (SubscribeKvEvents)
        self._streams: dict[str, _Stream] = {}
        self._adds: list[NewRequest] = []
        self._aborts: list[str] = []
        self._load_waiters: dict[int, asyncio.Future[Load]] = {}
        self._flush_waiters: dict[int, asyncio.Future[int]] = {}
        self._query_ids = itertools.count(1)
        self._flush_scheduled = False
        # The worker's silence, in awake time: the heartbeat task reads it every heartbeat_s.
        self._clock = AwakeClock(grace_s=max(1.0, 2 * heartbeat_s))
        self._last_status = self._clock.now()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerMessage)
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Queue only to a connected worker: with none, a send fails at once instead of piling up
        # messages that a worker started later would receive stale.
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._socket.connect(self.address)
        self._send()
        self._tasks = [asyncio.create_task(self._receive()), asyncio.create_task(self._heartbeat())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._aborts:
            self._flush()
        self._socket.close(linger=0)
        self._context.term()

    # ---------------------------------------------------------------------------------------- calls

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    def submit(
        self, request: NewRequest, queue: asyncio.Queue[RequestOutput] | None = None
    ) -> asyncio.Queue[RequestOutput]:
        """Send `request`; its outputs arrive on the returned queue, `queue` if given (the choices of
        one call share theirs)."""
        stream = self._streams[request.request_id] = _Stream(request, queue or asyncio.Queue())
        self._adds.append(request)
        self._schedule_flush()
        return stream.queue

    def release(self, request_id: str, *, abort: bool) -> None:
        """Forget a stream; `abort` also tells the worker to stop computing it and free its blocks."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and abort and stream.lost_at is None:
            self._aborts.append(request_id)
            self._schedule_flush()

    async def query_load(self, timeout_s: float = 5.0) -> Load:
        return await self._ask(self._load_waiters, "load_query", timeout_s)

    def load_now(self, timeout_s: float = 1.0) -> Load:
        """The worker's load as of its current step, for a caller on another thread (the metrics
        server). The periodic status can be a whole status interval old, long enough for a short run
        to come and go unseen; the last status stands in when the worker is not ready or does not
        answer within `timeout_s`."""
        loop = self._loop
        if not self.ready or loop is None or loop.is_closed():
            return self.load
        answer = asyncio.run_coroutine_threadsafe(self.query_load(timeout_s), loop)
        try:
            return answer.result(timeout_s + 1.0)  # the margin: the loop may be busy scheduling it
        except TimeoutError:
            answer.cancel()
            return self.load

    async def flush_cache(self, timeout_s: float = 5.0) -> int:
        """Have the cachemgr drop the cached prefixes no request holds; returns how many blocks, or
        -1 when the worker could not reach it."""
        return await self._ask(self._flush_waiters, "flush_cache", timeout_s)

    async def _ask(
        self,
        waiters: dict[int, asyncio.Future[Any]],
        field: Literal["load_query", "flush_cache"],
        timeout_s: float,
    ) -> Any:
        """Send the worker a numbered question (`field` of GatewayMessage) and wait for its answer,
        which `_receive` hands to the waiter of that number."""
        query = next(self._query_ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        waiters[query] = future
        if field == "load_query":
            self._send(load_query=query)
        else:
            self._send(flush_cache=query)
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            waiters.pop(query, None)

    # -------------------------------------------------------------------------------------- sending

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        adds, aborts, self._adds, self._aborts = self._adds, self._aborts, [], []
        if adds or aborts:
            self._send(adds, aborts)

    def _send(
        self,
        adds: list[NewRequest] | None = None,
        aborts: list[str] | None = None,
        load_query: int = 0,
        flush_cache: int = 0,
    ) -> None:
        """Send one `GatewayMessage` (no arguments: a heartbeat) carrying the internal key."""
        message = GatewayMessage(
            self.gateway_id, adds or [], aborts or [], load_query, flush_cache, key=self.key
        )
        # With IMMEDIATE set, no connected worker (or a full queue) means not writable: fail what
        # cannot be sent now rather than let it wait for a worker that may never read it.
        events = self._socket.getsockopt(zmq.EVENTS)
        assert isinstance(events, int)  # EVENTS is an int option; pyzmq types all as int | bytes
        if not events & zmq.POLLOUT:
            for new in message.adds:
                self._deliver(
                    RequestOutput(
                        new.request_id, [], finish="error", error="worker unreachable", code="UNAVAILABLE"
                    )
                )
            return
        sent = self._socket.send(self._encoder.encode(message), zmq.NOBLOCK)
        # pyzmq annotates an Awaitable; zmq.asyncio's send returns an asyncio.Future.
        assert isinstance(sent, asyncio.Future)
        sent.add_done_callback(_log_send_failure)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self._send()
            now = self._clock.now()
            if self.ready and now - self._last_status > self.worker_timeout_s:
                log.error("worker silent; no new calls until it speaks", timeout_s=self.worker_timeout_s)
                self._set_ready(False)
            silent_for = now - self._last_status
            self._expire_lost(silent_for if silent_for > self.worker_timeout_s else 0.0)

    # ------------------------------------------------------------------------------------ receiving

    async def _receive(self) -> None:
        while True:
            message = decode_or_drop(self._decoder, await self._socket.recv(), "worker", PROTOCOL_VERSION)
            if message is None:
                continue
            if message.worker_id != self.worker_id:
                if self.worker_id:
                    log.error("worker replaced", old=self.worker_id, new=message.worker_id)
                    self._worker_lost()
                self.worker_id = message.worker_id
            if message.status is not None:
                self._on_status(message.status)
            for output in message.outputs:
                self._deliver(output)
            for events in message.kv_events:
                await self.kv_events.append(events)
            for query, blocks in message.flushed:
                waiter = self._flush_waiters.get(query)
                if waiter is not None and not waiter.done():
                    waiter.set_result(blocks)
            if message.step is not None and self.on_step is not None:
                self.on_step(message.step)

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None or stream.lost_at is not None:
            return  # released, or news from a worker that is gone
        if stream.resubmitted:
            stream.resubmitted = False
            if output.cached_tokens >= 0:
                prompt = len(stream.request.prompt_ids) + len(stream.tokens)
                self.recomputed_tokens += prompt - output.cached_tokens
                log.info(
                    "re-submitted request resumed",
                    request_id=output.request_id,
                    prompt_tokens=prompt,
                    cached_tokens=output.cached_tokens,
                )
            # The client's usage and timings describe the request as it first ran.
            output = msgspec.structs.replace(output, cached_tokens=-1, queue_seconds=-1.0)
        stream.tokens += output.token_ids
        stream.queue.put_nowait(output)
        if output.finish:
            del self._streams[output.request_id]

    def _on_status(self, status: WorkerStatus) -> None:
        self._last_status = self._clock.now()
        self.load = status.load
        if status.facts is not None:
            self.facts = status.facts
        if status.load_query:
            # The worker answers only the newest query it read in a turn. Queries are numbered in
            # sending order and one socket keeps that order, so this load was taken after every
            # earlier query had arrived: it answers them all.
            for query, waiter in self._load_waiters.items():
                if query <= status.load_query and not waiter.done():
                    waiter.set_result(status.load)
        self._set_ready(status.ready and status.facts is not None)
        if self.ready:
            self._resubmit()

    def _set_ready(self, ready: bool) -> None:
        if ready != self.ready:
            self.ready = ready
            log.info("worker readiness changed", ready=ready, worker_id=self.worker_id)
            if self.on_ready_change is not None:
                self.on_ready_change(ready)

    def _worker_lost(self) -> None:
        self._set_ready(False)
        now = self._clock.now()
        for stream in self._streams.values():
            if stream.lost_at is None:
                stream.lost_at = now
        self._adds = [a for a in self._adds if a.request_id not in self._streams]
        self._aborts.clear()  # the new worker never knew them

    def _resubmit(self) -> None:
        lost = [(rid, s) for rid, s in self._streams.items() if s.lost_at is not None]
        for rid, stream in lost:
            stream.lost_at = None
            left = stream.request.params.max_new_tokens - len(stream.tokens)
            if left <= 0:  # everything was streamed; only the final message was lost
                self._deliver(RequestOutput(rid, [], finish="length"))
                continue
            stream.resubmitted = True
            self._adds.append(resubmission(stream.request, stream.tokens))
        if lost:
            self.resubmitted += len(lost)
            log.warning("re-submitted requests of a lost worker", requests=len(lost))
            self._schedule_flush()

    def _expire_lost(self, silent_for: float) -> None:
        """Fail the streams that waited `resubmit_timeout_s` for a new worker, or all of them once the
        worker has been silent that long (hung, or dead with nothing restarting it)."""
        now = self._clock.now()
        for rid, stream in list(self._streams.items()):
            waited = now - stream.lost_at if stream.lost_at is not None else silent_for
            if waited > self.resubmit_timeout_s:
                if stream.lost_at is None:
                    self._aborts.append(rid)  # a hung worker that ever wakes frees its blocks
                stream.lost_at = None
                error = f"no worker served the request for {self.resubmit_timeout_s:.0f} s"
                self._deliver(RequestOutput(rid, [], finish="error", error=error, code="UNAVAILABLE"))
        if self._aborts:
            self._schedule_flush()


def _log_send_failure(sent: asyncio.Future[None]) -> None:
    if not sent.cancelled() and sent.exception() is not None:
        log.warning("a message to the worker was dropped", error=str(sent.exception()))
