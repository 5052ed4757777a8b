"""What the cachemgr owns: the pool memory and the BlockManager that decides over it.

The in-process engine holds one `KVCache` directly; the cachemgr process holds one with `shared=True`
and serves it over ZMQ (`cachemgr/server.py`). Either way the worker sees the same surface
(`geometry`, `sizing`, `memory`, `step`, `stats`), see `worker/cache_client.py`.
"""

from __future__ import annotations

import time
from typing import Any

import structlog
import torch

from services.cachemgr.block_manager import BlockManager
from services.cachemgr.pool_memory import PoolMemory, create_pool_memory
from services.cachemgr.sizing import CacheSizing, meminfo_bytes, size_cache
from services.common.cachemgr_messages import Flushed, KvEvents, StepGrant, StepPlan
from services.common.config import CBConfig
from services.common.kv_geometry import RESERVED_CHUNKS, KVGeometry
from services.common.kv_int8 import scale_bytes
from services.common.precision import dtype_name

log = structlog.get_logger(__name__)


class KVCache:
    def __init__(
        self,
        model_config: Any,
        config: CBConfig,
        dtype: torch.dtype,
        device: torch.device,
        *,
        shared: bool = False,
        reserve_bytes: int = 0,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        self.geometry = KVGeometry.from_model_config(
            model_config, config.page_size, dtype.itemsize, scale_bytes(dtype)
        )
        self.sizing: CacheSizing = size_cache(
            self.geometry, model_config, config, device, reserve_bytes=reserve_bytes, shm=shared
        )
        started = time.perf_counter()
        self.memory: PoolMemory = create_pool_memory(
            self.geometry,
            self.sizing.num_chunks,
            self.sizing.swap_slots,
            dtype,
            device,
            shared=shared,
            prefault=config.prefault_kv_pool,
        )
        self.block_manager = BlockManager(
            self.geometry,
            self.sizing.num_chunks,
            swap_slots=self.sizing.swap_slots,
            allow_block_sharing=config.allow_block_sharing,
            safety_margin=config.effective_safety_margin,
            max_step_tokens=config.max_batch_tokens,
        )
        log.info(
            "kv cache sized",
            **self.sizing.as_dict(),
            kv_dtype=dtype_name(dtype),
            kv_bytes_per_token=self.geometry.bytes_per_token,
            kv_tokens=self.geometry.tokens_held(self.sizing.num_chunks),
            layers_per_chunk=self.geometry.layers_per_chunk,
            groups=self.geometry.groups,
            prefix_caching=self.block_manager.sharing,
            shared=shared,
            prefault_kv_pool=config.prefault_kv_pool,
            pool_seconds=round(time.perf_counter() - started, 2),
        )

    @property
    def prefix_caching(self) -> bool:
        return self.block_manager.sharing

    def step(self, plan: StepPlan) -> StepGrant:
        return self.block_manager.step(plan)

    def stats(self) -> dict[str, int]:
        stats = self.block_manager.stats_dict()
        # Device memory is committed whole at allocation, a prefaulted host pool at start, another host
        # pool page by page as it is written.
        whole = self.device.type == "cuda" or self.memory.prefaulted
        committed = stats["total_blocks"] if whole else stats["committed_blocks"]
        return stats | {
            "kv_pool_bytes": self.sizing.kv_bytes,
            "kv_pool_committed_bytes": (committed + RESERVED_CHUNKS) * self.sizing.chunk_bytes,
            "host_available_bytes": meminfo_bytes("MemAvailable"),
        }

    def flush_cache(self) -> Flushed:
        return self.block_manager.flush_cache()

    def kv_snapshot(self) -> KvEvents:
        return self.block_manager.kv_snapshot()

    def release_all(self) -> int:
        return self.block_manager.release_all()

    def close(self) -> None:
        self.memory.close()
