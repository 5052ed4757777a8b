"""The worker process: the engine loop between gateways (ZMQ ROUTER) and the cachemgr (DEALER).

Each turn: drain every gateway message (new requests, aborts, load queries, heartbeats), run one
engine step, and send each gateway one `WorkerMessage` with all of its requests' news. A step's
news leaves once the cachemgr has committed that step's KV (the next step's plan does), so what
clients have seen of a worker that dies is in the prefix cache, but for the last partial page.
Gateways are peers of a ROUTER socket, so several may share one worker; which requests each owns and
the news each is owed are in gateway_sessions.py. A gateway silent for `gateway_timeout_s` is presumed
dead and its requests are aborted (their blocks return).

The KV memory belongs to the cachemgr. When it stops answering, every request fails with
UNAVAILABLE and the worker attaches again (a fresh attach id makes the cachemgr drop whatever an
earlier attach left behind); the model stays loaded.
"""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import torch
import zmq

from services.common import ready_file
from services.common.awake_clock import AwakeClock
from services.common.config import CBConfig
from services.common.gateway_messages import (
    PROTOCOL_VERSION,
    GatewayMessage,
    Load,
    NewRequest,
    StepTimes,
    WorkerFacts,
    WorkerMessage,
    WorkerStatus,
)
from services.common.heap import huge_page_bytes
from services.common.kv_geometry import RESERVED_CHUNKS
from services.common.sampling_params import SamplingParams
from services.common.wire import decode_or_drop, internal_key, key_matches
from services.worker.cache_client import CacheUnavailable, RemoteCache
from services.worker.engine import Engine
from services.worker.gateway_sessions import Gateway, GatewaySessions, request_key
from services.worker.grammar import DEFAULT_COMPILE_TIMEOUT_S

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = structlog.get_logger(__name__)

STATUS_INTERVAL_S = 0.5
IDLE_POLL_MS = 50


class WorkerServer:
    def __init__(
        self,
        model: PreTrainedModel,
        config: CBConfig,
        *,
        address: str,
        cachemgr_address: str,
        cachemgr_timeout_s: float = 10.0,
        gateway_timeout_s: float = 15.0,
        key: str = "",
        ready_path: Path | None = None,
        tokenizer: Any = None,
        grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer  # for constraints (structured output) only: requests come as ids
        self.grammar_compile_timeout_s = grammar_compile_timeout_s
        self.ready_path = ready_path  # exists while attached and warm (common/ready_file.py)
        self.key = key
        self.config = config
        self.address = address
        self.cachemgr_address = cachemgr_address
        self.cachemgr_timeout_s = cachemgr_timeout_s
        self.worker_id = uuid.uuid4().hex[:12]
        self.engine: Engine | None = None
        self.facts: WorkerFacts | None = None
        self.sessions = GatewaySessions(gateway_timeout_s)
        self.stopping = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(GatewayMessage)
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished gateway's messages are dropped
        self._last_status = 0.0
        self._clock = AwakeClock()  # for gateways' silence: read every turn, before and after the step
        self._pending_queries: dict[bytes, int] = {}
        self._pending_flushes: dict[bytes, int] = {}
        self._profile: StepTimes | None = None  # the latest step's, sent with this turn's messages
        # Finishes minus arrivals since the last gather that timed out (the rest were not coming
        # soon). A closed-loop client sends its next request when one finishes, so with the engine
        # idle this is the wave coming; it reaches 0 just as that wave is in (_gather_arrivals).
        self._awaited = 0

    # ------------------------------------------------------------------------------------ lifecycle

    def run(self) -> None:
        ready_file.mark(self.ready_path, False)  # a killed predecessor's
        self._socket.bind(self.address)
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        log.info("worker listening", address=self.address, worker_id=self.worker_id)
        try:
            while not self.stopping:
                if self.engine is None:
                    self._try_attach()
                self._turn()
        finally:
            self._fail_all("worker stopping", "UNAVAILABLE")
            self._flush()
            if self.engine is not None:
                try:
                    self.engine.close()  # sends the aborts: the cachemgr gets its blocks back now
                except CacheUnavailable:
                    pass
                self._detach()
            self._socket.close(linger=0)
            log.info("worker stopped", worker_id=self.worker_id)

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _try_attach(self) -> None:
        try:
            cache = RemoteCache(
                self.cachemgr_address,
                self.model.device,
                worker_id=f"{self.worker_id}.{uuid.uuid4().hex[:6]}",
                key=self.key,
                timeout_s=self.cachemgr_timeout_s,
                attach_timeout_s=1.0,
                context=self._context,
            )
        except CacheUnavailable as exc:
            log.debug("cachemgr not reachable", error=str(exc))
            return
        try:
            self.engine = Engine(
                self.model,
                self.config,
                self.tokenizer,
                cache=cache,
                grammar_compile_timeout_s=self.grammar_compile_timeout_s,
            )
            self._warm_up(self.engine)
            self.engine.on_kv_events = self.sessions.queue_kv_events
            self._send_kv_snapshot(list(self.sessions))  # a cache they did not know
        except CacheUnavailable as exc:
            log.warning("cachemgr lost during warm-up", error=str(exc))
            self._detach()
            return
        except Exception:
            cache.close()
            raise
        model_config = self.model.config
        text = getattr(model_config, "text_config", None) or model_config
        runs = self.engine.runner.describe()
        max_positions = int(getattr(text, "max_position_embeddings", 2**31 - 1))
        self.facts = WorkerFacts(
            vocab_size=self.engine.vocab_size,
            # A request's whole context must also fit one step's attention workspace (cache budget).
            max_request_tokens=min(
                max_positions,
                cache.max_request_tokens,
                cache.sizing.max_pages_per_step * cache.geometry.page_size,
            ),
            page_size=self.config.page_size,
            total_blocks=cache.sizing.num_chunks - RESERVED_CHUNKS,  # what requests can be given
            prefix_caching=cache.prefix_caching,
            dtype=str(runs["weights"]),  # describe() gives dtype names (str) under object values
            device=str(self.model.device),
            max_logprobs=SamplingParams.MAX_LOGPROBS,
            kv_bytes=cache.sizing.kv_bytes,
            kv_dtype=str(runs["kv_dtype"]),
        )
        self._last_status = 0.0  # announce readiness at once
        log.info(
            "worker ready",
            worker_id=self.worker_id,
            async_batching=self.engine.config.use_async_batching,
            huge_page_bytes=huge_page_bytes(),
            **msgspec.to_builtins(self.facts),
            **{k: v for k, v in runs.items() if k != "kv_dtype"},  # the facts carry it
        )
        ready_file.mark(self.ready_path, True)

    @staticmethod
    def _warm_up(engine: Engine) -> None:
        """One tiny generation: builds kernels and touches every code path before the first client."""
        engine.generate([[0, 1, 2, 3]], 2, ignore_eos=True)

    def _detach(self) -> None:
        ready_file.mark(self.ready_path, False)
        if self.engine is not None:
            try:
                self.engine.finish_running()  # its forward writes the pool being unmapped
                self.engine.cache.close()
            finally:
                self.engine = None
                self.facts = None

    # ------------------------------------------------------------------------------------ the loop

    def _turn(self) -> None:
        busy = self.engine is not None and self.engine.has_work
        if self._socket.poll(0 if busy else IDLE_POLL_MS):
            self._drain()
            self._gather_arrivals()
        if self.engine is not None and self.engine.has_work:
            try:
                self._step(self.engine)
            except CacheUnavailable as exc:
                self._lose_cachemgr(exc)
        # Drain again first: a long step (or a wait for the cachemgr) must not make the heartbeats
        # that arrived meanwhile look missing.
        self._drain()
        self._expire_gateways()
        self._flush_cache()
        self._send_status()
        if self.engine is None or not self.engine.has_work:
            self._flush()  # else the next step sends this news once its plan has committed the KV

    def _gather_arrivals(self) -> None:
        """While every request is still to start, wait for those still arriving (`arrival_gap_ms`).

        A burst reaches the worker over a few ms (each request passes the router and a gateway on its
        own, milliseconds apart). Stepping at the first arrival would prefill it alone, and the rest
        would wait a whole prefill for the next step: one step for the whole wave gives every one of
        them an earlier first token.

        It stops early once the wave is in: as many requests as had finished before it began (a lone
        client's next request then waits no gap at all). A wave nobody finished for (the first, a new
        client's) takes the count below 0 and waits out the gap."""
        gap_ms = self.config.arrival_gap_ms
        if gap_ms <= 0 or self.engine is None or not self.engine.only_pending:
            return
        deadline = time.monotonic() + 5 * gap_ms / 1e3
        while (left_ms := (deadline - time.monotonic()) * 1e3) > 0:
            if self._awaited == 0:
                return
            if not self._socket.poll(max(1, round(min(gap_ms, left_ms)))):
                break
            self._drain()
        self._awaited = 0

    def _drain(self) -> None:
        while True:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                log.warning("dropped a gateway message with a wrong frame count", frames=len(frames))
                continue
            routing_id, payload = frames
            message = decode_or_drop(self._decoder, payload, "gateway", PROTOCOL_VERSION)
            if message is None:
                continue
            if not key_matches(self.key, message.key):
                log.warning(
                    "dropped a gateway message without the internal key", gateway_id=message.gateway_id
                )
                continue
            self._handle(routing_id, message)

    def _handle(self, routing_id: bytes, message: GatewayMessage) -> None:
        gateway, first_seen = self.sessions.seen(routing_id, message.gateway_id, self._clock.now())
        if first_seen:
            self._last_status = 0.0
            self._send_kv_snapshot([gateway])
        for rid in message.aborts:
            self._abort(gateway, rid)
        for new in message.adds:
            self._add(gateway, new)
        if message.load_query:
            self._pending_queries[routing_id] = message.load_query
        if message.flush_cache:
            self._pending_flushes[routing_id] = message.flush_cache

    def _add(self, gateway: Gateway, new: NewRequest) -> None:
        key = request_key(gateway, new.request_id)
        engine, facts = self.engine, self.facts
        if engine is None or facts is None:
            gateway.refuse(new.request_id, "worker not ready", "UNAVAILABLE")
            return
        try:
            if key in self.sessions.tracked:
                raise ValueError(f"duplicate request_id {new.request_id!r}")
            total = len(new.prompt_ids) + new.params.max_new_tokens
            if total > facts.max_request_tokens:
                raise ValueError(
                    f"prompt + max_new_tokens = {total} tokens; a request holds at most "
                    f"{facts.max_request_tokens}"
                )
            engine.add_request(
                new.prompt_ids,
                new.params,
                request_id=key,
                priority=new.priority,
                cache_salt=new.cache_salt,
                fork_of=request_key(gateway, new.fork_of) if new.fork_of else None,
            )
        except (ValueError, TypeError) as exc:
            gateway.refuse(new.request_id, str(exc), "INVALID_ARGUMENT")
            return
        self._awaited -= 1
        self.sessions.track(gateway, new)
        log.info(
            "request added",
            request_id=new.trace_id,
            prompt_tokens=len(new.prompt_ids),
            max_tokens=new.params.max_new_tokens,
            priority=new.priority,
        )

    def _abort(self, gateway: Gateway, request_id: str) -> None:
        tracked = self.sessions.untrack(gateway, request_id)
        if tracked is None:
            return
        if self.engine is not None:
            self.engine.abort(request_key(gateway, request_id))
        log.info("request aborted by gateway", request_id=tracked.trace_id, internal_id=tracked.request_id)

    def _step(self, engine: Engine) -> None:
        flush_s = 0.0

        def flush() -> None:  # the previous step's news, sent from inside engine.step
            nonlocal flush_s
            t = time.perf_counter()
            self._flush()
            flush_s = time.perf_counter() - t

        t_step = time.perf_counter()
        updated = engine.step(on_committed=flush)
        t_emit = time.perf_counter()
        for req in updated:
            self._awaited += self.sessions.emit(req)
        times = engine.last_step_times
        if times.num_requests:
            t_end = time.perf_counter()
            # Schedule is the rest of the step call's wall time, so that it takes, too, what the
            # engine's timers cannot see: a wait for the GIL on the way out while the forward thread
            # runs Python (async batching).
            overlapped = engine.config.async_batching_enabled(engine.device.type)  # resolved by Engine
            schedule = times.rest_of(t_emit - t_step - flush_s, overlapped)
            self._profile = StepTimes(
                schedule,
                times.cache,
                times.build,
                times.forward,
                times.sample,
                t_end - t_emit + flush_s,
                times.num_tokens,
                times.num_requests,
                times.wait,
                t_end - t_step,
                times.grammar_advance,
                times.grammar_fill,
                times.grammar_apply,
            )

    def _fail_all(self, reason: str, code: str) -> None:
        for key in self.sessions.fail_all(reason, code):
            if self.engine is not None:
                self.engine.abort(key)

    def _lose_cachemgr(self, exc: CacheUnavailable) -> None:
        """The KV memory's owner stopped answering: every request fails, and the next turns attach again."""
        log.error("cachemgr unavailable; failing requests", error=str(exc))
        self._fail_all(f"KV cache manager unavailable: {exc}", "UNAVAILABLE")
        self._detach()

    def _expire_gateways(self) -> None:
        """A gateway silent for `gateway_timeout_s` (of awake time: see AwakeClock) is presumed dead;
        it is told at once, not with the turn's news, since it is no longer in the book."""
        for gateway, keys in self.sessions.expire(self._clock.now()):
            if self.engine is not None:
                for key in keys:
                    self.engine.abort(key)
            self._send(gateway, WorkerMessage(self.worker_id, gateway.outputs, None, None))

    # -------------------------------------------------------------------------------------- status

    def load(self) -> Load:
        if self.engine is None:
            return Load()
        stats = self.engine.stats()
        return Load(
            requests_running=stats["running"],
            requests_waiting=stats["waiting"],
            kv_blocks_used=stats["used_blocks"],
            kv_blocks_cached=stats["evictable_blocks"],
            kv_blocks_total=stats["total_blocks"],
            kv_blocks_free=stats["free_blocks"],
            swap_slots_used=stats["swap_slots_used"],
            swap_slots_total=stats["swap_slots"],
            prefix_cache_queries=stats["prefix_queries"],
            prefix_cache_hits=stats["prefix_hit_tokens"],
            offloads=stats["offloads"],
            soft_resets=stats["soft_resets"],
            swap_restores=stats["swap_restores"],
            kv_pool_bytes=stats["kv_pool_bytes"],
            kv_pool_committed_bytes=stats["kv_pool_committed_bytes"],
            host_available_bytes=stats["host_available_bytes"],
            steps=stats["steps"],
            computed_tokens=stats["computed_tokens"],
            forks=stats["forks"],
            worker_streams=len(self.sessions.tracked),
            cache_requests=stats["requests_known"],
        )

    def _send_status(self) -> None:
        now = time.monotonic()
        periodic = now - self._last_status >= STATUS_INTERVAL_S
        if not periodic and not self._pending_queries:
            return
        try:
            load = self.load()
        except CacheUnavailable as exc:
            self._lose_cachemgr(exc)
            load = Load()
        ready = self.engine is not None and not self.stopping
        targets = [g for g in self.sessions if periodic or g.routing_id in self._pending_queries]
        for gateway in targets:
            query = self._pending_queries.get(gateway.routing_id, 0)
            gateway.status = WorkerStatus(self.worker_id, ready, self.facts, load, query)
        self._pending_queries.clear()
        if periodic:
            self._last_status = now

    def _flush_cache(self) -> None:
        """Between steps, so that no grant in flight names a page being dropped."""
        if not self._pending_flushes:
            return
        blocks = -1
        if self.engine is not None:
            try:
                flushed = self.engine.cache.flush_cache()
            except CacheUnavailable as exc:
                log.error("cachemgr unavailable for a cache flush", error=str(exc))
            else:
                blocks = flushed.blocks
                if flushed.kv_events is not None:
                    self.sessions.queue_kv_events(flushed.kv_events)
                log.info("prefix cache flushed", blocks=blocks)
        for routing_id, query in self._pending_flushes.items():
            if routing_id in self.sessions.gateways:
                self.sessions.gateways[routing_id].flushed.append((query, blocks))
        self._pending_flushes.clear()

    def _send_kv_snapshot(self, gateways: list[Gateway]) -> None:
        """Give gateways that joined the cache late its whole live set, so their routers' view is
        complete. Called between steps: no later step's events can precede it."""
        if self.engine is None or not gateways:
            return
        try:
            snapshot = self.engine.cache.kv_snapshot()
        except CacheUnavailable as exc:
            log.warning("cachemgr did not give a KV snapshot", error=str(exc))
            return
        for gateway in gateways:
            gateway.kv_events = [snapshot]  # supersedes whatever older news was queued

    def _flush(self) -> None:
        """One message per gateway per turn (GatewaySessions.messages)."""
        profile, self._profile = self._profile, None
        for gateway, message in self.sessions.messages(self.worker_id, profile):
            self._send(gateway, message)

    def _send(self, gateway: Gateway, message: WorkerMessage) -> None:
        try:
            self._socket.send_multipart([gateway.routing_id, self._encoder.encode(message)], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("gateway not reading; message dropped", gateway_id=gateway.gateway_id)


def run_worker(
    model: str | None,
    address: str,
    cachemgr_address: str,
    config: CBConfig,
    device: str,
    dtype: torch.dtype,
    threads: int | None = None,
    cachemgr_timeout_s: float = 10.0,
    gateway_timeout_s: float = 15.0,
    ready_path: Path | None = None,
    grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
) -> int:
    import os

    from services.common.heap import ask_huge_pages, keep_freed_memory
    from services.common.model_source import load_model

    keep_freed_memory()
    ask_huge_pages()
    torch.set_num_threads(threads or len(os.sched_getaffinity(0)))
    loaded, tokenizer = load_model(model, dtype=dtype, device=device)
    WorkerServer(
        loaded,
        config,
        address=address,
        cachemgr_address=cachemgr_address,
        cachemgr_timeout_s=cachemgr_timeout_s,
        gateway_timeout_s=gateway_timeout_s,
        key=internal_key(),
        ready_path=ready_path,
        tokenizer=tokenizer,
        grammar_compile_timeout_s=grammar_compile_timeout_s,
    ).run()
    return 0
