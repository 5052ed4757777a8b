"""The worker's view of the KV cache: the surface `Engine` needs, local or across a socket.

`KVCache` (cachemgr/kv_cache.py) provides it in-process. `RemoteCache` provides it over a ZMQ DEALER
socket to the cachemgr process: it attaches (maps the pools the cachemgr owns), then forwards one
StepPlan per step and waits for the StepGrant. A cachemgr that does not answer within `timeout_s`
raises `CacheUnavailable`: the worker fails its requests and attaches again.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Protocol

import msgspec
import structlog
import torch
import zmq

from services.cachemgr.pool_memory import PoolHandles, PoolMemory, attach_pool_memory
from services.cachemgr.sizing import CacheSizing
from services.common.awake_clock import poll_awake
from services.common.cachemgr_messages import (
    PROTOCOL_VERSION,
    Attach,
    Attached,
    Failure,
    FlushCache,
    Flushed,
    FromCachemgr,
    KvEvents,
    KvSnapshot,
    KvSnapshotQuery,
    Stats,
    StatsQuery,
    StepGrant,
    StepPlan,
    ToCachemgr,
)
from services.common.kv_geometry import KVGeometry

log = structlog.get_logger(__name__)


class CacheClient(Protocol):
    geometry: KVGeometry
    sizing: CacheSizing
    memory: PoolMemory

    @property
    def prefix_caching(self) -> bool: ...

    def step(self, plan: StepPlan) -> StepGrant: ...

    def stats(self) -> dict[str, int]: ...

    def flush_cache(self) -> Flushed: ...

    def kv_snapshot(self) -> KvEvents: ...

    def close(self) -> None: ...


class CacheUnavailable(RuntimeError):
    """The cachemgr is gone, restarted, or refuses this worker."""


def geometry_from_dict(fields: dict[str, Any]) -> KVGeometry:
    return msgspec.convert(fields, KVGeometry)


class RemoteCache:
    def __init__(
        self,
        address: str,
        device: torch.device,
        *,
        worker_id: str | None = None,
        key: str = "",
        timeout_s: float = 10.0,
        attach_timeout_s: float | None = None,
        context: zmq.Context | None = None,
    ) -> None:
        self.address = address
        self.worker_id = worker_id or uuid.uuid4().hex[:12]
        self._key = key
        self.timeout_s = timeout_s
        self._context = context or zmq.Context.instance()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCachemgr)
        self._socket: zmq.Socket | None = None
        attached = self._attach(attach_timeout_s)
        self.cachemgr_id = attached.cachemgr_id
        self.geometry = geometry_from_dict(attached.geometry)
        self.sizing = msgspec.convert(attached.sizing, CacheSizing)
        self.max_request_tokens = attached.max_request_tokens
        self._prefix_caching = attached.prefix_caching
        handles = PoolHandles(attached.kv, attached.swap, attached.kv_prefaulted)
        self.memory = attach_pool_memory(handles, device)
        log.info(
            "attached to cachemgr",
            address=address,
            cachemgr_id=self.cachemgr_id,
            num_chunks=self.sizing.num_chunks,
            swap_slots=self.sizing.swap_slots,
            kv_handle=attached.kv.kind,
            swap_registered=self.memory.registered,
            released=attached.released,
        )

    @property
    def prefix_caching(self) -> bool:
        return self._prefix_caching

    def _connect(self) -> zmq.Socket:
        if self._socket is not None:
            self._socket.close(linger=0)
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        self._socket = sock
        return sock

    def _attach(self, timeout_s: float | None) -> Attached:
        """Attach, retrying while the cachemgr is not up yet (it may start after the worker)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self._connect()
            try:
                reply = self._call(Attach(self.worker_id, self._key), min(self.timeout_s, 2.0))
            except CacheUnavailable:
                if deadline is not None and time.monotonic() > deadline:
                    raise
                log.info("waiting for the cachemgr", address=self.address)
                continue
            if not isinstance(reply, Attached):
                raise CacheUnavailable(f"attach refused by the cachemgr: {reply}")
            return reply

    def _call(self, message: ToCachemgr, timeout_s: float) -> FromCachemgr:
        sock = self._socket
        assert sock is not None
        sock.send(self._encoder.encode(message))
        if not poll_awake(sock, timeout_s):
            # A late reply would pair with the next request: start over on a fresh socket.
            self._connect()
            raise CacheUnavailable(f"no answer from the cachemgr at {self.address} in {timeout_s:.1f} s")
        try:
            reply = self._decoder.decode(sock.recv())
        except msgspec.DecodeError as exc:
            raise CacheUnavailable(f"undecodable reply from the cachemgr: {exc}") from exc
        if reply.version != PROTOCOL_VERSION:
            raise CacheUnavailable(
                f"cachemgr speaks protocol {reply.version}, this worker {PROTOCOL_VERSION}"
            )
        if isinstance(reply, Failure):
            raise CacheUnavailable(f"cachemgr refused: {reply.reason}")
        return reply

    def step(self, plan: StepPlan) -> StepGrant:
        reply = self._call(plan, self.timeout_s)
        if not isinstance(reply, StepGrant) or reply.step != plan.step:
            raise CacheUnavailable(f"expected the grant of step {plan.step}, got {type(reply).__name__}")
        return reply

    def stats(self) -> dict[str, int]:
        reply = self._call(StatsQuery(), self.timeout_s)
        if not isinstance(reply, Stats):
            raise CacheUnavailable(f"expected stats, got {type(reply).__name__}")
        return reply.stats

    def flush_cache(self) -> Flushed:
        reply = self._call(FlushCache(), self.timeout_s)
        if not isinstance(reply, Flushed):
            raise CacheUnavailable(f"expected flushed, got {type(reply).__name__}")
        return reply

    def kv_snapshot(self) -> KvEvents:
        reply = self._call(KvSnapshotQuery(), self.timeout_s)
        if not isinstance(reply, KvSnapshot):
            raise CacheUnavailable(f"expected a KV snapshot, got {type(reply).__name__}")
        return reply.events

    def close(self) -> None:
        self.memory.close()
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
