"""The cachemgr process: owns the KV and swap pools and serves `BlockManager.step` over ZMQ.

A ROUTER socket takes `Attach`, `StepPlan` and `StatsQuery` from one worker at a time. A worker that
attaches with a new id replaces the previous one, whose requests are dropped (its full pages stay in
the prefix cache); an attach without the stack's internal key, and plans from any peer but the
attached one, are refused. Messages that do not decode are logged and
dropped: nothing received is ever executed.
"""

from __future__ import annotations

import signal
import uuid
from types import FrameType

import msgspec
import structlog
import torch
import zmq

from services.cachemgr.kv_cache import KVCache
from services.common.cachemgr_messages import (
    PROTOCOL_VERSION,
    Attach,
    Attached,
    Failure,
    FlushCache,
    FromCachemgr,
    KvSnapshot,
    KvSnapshotQuery,
    Stats,
    StatsQuery,
    StepPlan,
    ToCachemgr,
)
from services.common.config import CBConfig
from services.common.precision import kv_cache_dtype
from services.common.tensor_handles import remove_stale_shm
from services.common.wire import internal_key, key_matches

log = structlog.get_logger(__name__)

POLL_MS = 200


def weights_bytes(model_config: object, dtype: torch.dtype) -> int:
    """Bytes of the weights a worker will load: counted on the meta device, nothing allocated."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return sum(p.numel() for p in model.parameters()) * dtype.itemsize


class CacheServer:
    def __init__(self, cache: KVCache, key: str = "") -> None:
        self.cache = cache
        self.key = key
        self.cachemgr_id = uuid.uuid4().hex[:12]
        self.worker: bytes | None = None  # routing id of the attached worker
        self.worker_id = ""
        self._decoder = msgspec.msgpack.Decoder(ToCachemgr)
        self._encoder = msgspec.msgpack.Encoder()

    def handle(self, peer: bytes, payload: bytes) -> FromCachemgr | None:
        try:
            message = self._decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("dropped an undecodable message", peer=peer.hex(), size=len(payload), error=str(exc))
            return None
        if message.version != PROTOCOL_VERSION:
            return Failure(f"protocol version {message.version} is not {PROTOCOL_VERSION}")
        if isinstance(message, Attach):
            return self._attach(peer, message)
        if peer != self.worker:
            return Failure("not attached: send Attach first")
        if isinstance(message, StatsQuery):
            return Stats(self.cache.stats())
        if isinstance(message, KvSnapshotQuery):
            return KvSnapshot(self.cache.kv_snapshot())
        if isinstance(message, FlushCache):
            flushed = self.cache.flush_cache()
            log.info("cache flushed", blocks=flushed.blocks)
            return flushed
        assert isinstance(message, StepPlan)
        try:
            return self.cache.step(message)
        except Exception as exc:  # a plan it cannot serve must not take the pool's owner down
            log.error("bad step plan", step=message.step, error=repr(exc))
            return Failure(f"bad step plan {message.step}: {exc!r}")

    def _attach(self, peer: bytes, message: Attach) -> Attached | Failure:
        if not key_matches(self.key, message.key):
            log.warning(
                "refused an attach without the internal key", peer=peer.hex(), worker_id=message.worker_id
            )
            return Failure("attach refused: wrong internal key")
        released = 0
        if message.worker_id != self.worker_id:
            released = self.cache.release_all()
        self.worker, self.worker_id = peer, message.worker_id
        memory = self.cache.memory
        assert memory.handles is not None, "a served cache is created with shared=True"
        log.info("worker attached", worker_id=message.worker_id, released=released)
        return Attached(
            cachemgr_id=self.cachemgr_id,
            geometry=msgspec.to_builtins(self.cache.geometry),
            sizing=msgspec.to_builtins(self.cache.sizing),
            kv=memory.handles.kv,
            swap=memory.handles.swap,
            kv_prefaulted=memory.handles.kv_prefaulted,
            prefix_caching=self.cache.prefix_caching,
            max_request_tokens=self.cache.block_manager.max_request_tokens(),
            released=released,
        )

    def serve(self, address: str) -> None:
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        stopping = False

        def stop(signum: int, frame: FrameType | None) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        log.info("cachemgr serving", address=address, cachemgr_id=self.cachemgr_id)
        try:
            while not stopping:
                if not sock.poll(POLL_MS):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 2:
                    log.warning("dropped a message with a wrong frame count", frames=len(frames))
                    continue
                peer, payload = frames
                reply = self.handle(peer, payload)
                if reply is not None:
                    sock.send_multipart([peer, self._encoder.encode(reply)])
        finally:
            sock.close(linger=0)
            log.info("cachemgr stopped", cachemgr_id=self.cachemgr_id)


def run_cachemgr(model: str | None, address: str, config: CBConfig, device: str, dtype: torch.dtype) -> int:
    """`dtype`: the worker's weights'; the pool's follows `config.kv_cache_dtype`."""
    from transformers import AutoConfig

    from services.common.model_source import resolve_model

    torch.set_num_threads(1)  # the worker needs the cores
    removed = remove_stale_shm()
    if removed:
        log.info("removed shared memory of dead cachemgrs", files=removed)
    model_config = AutoConfig.from_pretrained(resolve_model(model))
    dev = torch.device(device)
    reserve = weights_bytes(model_config, dtype) if dev.type == "cuda" else 0
    kv_dtype = kv_cache_dtype(config, dtype)
    cache = KVCache(model_config, config, kv_dtype, dev, shared=True, reserve_bytes=reserve)
    try:
        CacheServer(cache, internal_key()).serve(address)
    finally:
        cache.close()
    return 0
