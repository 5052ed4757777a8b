"""How many KV chunks and swap slots to create.

The pool's bytes, first match wins:
- `num_blocks` chunks;
- `kv_cache_space` GiB;
- free memory x `max_memory_percent`, less what one step of the model needs besides the KV pool
  (activations for `max_batch_tokens`, attention workspace, logits for `max_requests_per_batch` rows):
  the default on a GPU (90%), whose memory the server owns;
- on a CPU host, a fixed `DEFAULT_CPU_KV_CACHE` capped at a quarter of RAM. Host memory is shared
  with everything else on the machine, and sizing from what happens to be free made the pool 19 to
  22 GB on a 24 GiB machine, differently on every start. 4 GiB is the size vLLM-CPU's recipe sets
  (`VLLM_CPU_KVCACHE_SPACE=4`) and holds about 90k tokens of SmolLM2 in fp32: more context than two
  cores compute in any reasonable time.
On CUDA "free" is `cudaMemGetInfo`; on CPU it is MemAvailable (and the free space of /dev/shm when the
pool lives there). A host pool's pages are committed only when first written (see `chunk_pool`).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from services.common.config import CBConfig
from services.common.kv_geometry import RESERVED_CHUNKS, KVGeometry
from services.common.tensor_handles import shm_dir

GIB = 1 << 30
DEFAULT_CPU_KV_CACHE = 4 * GIB
# The share of free memory a pool takes unless `max_memory_percent` says: its size on a GPU, a cap
# on a CPU host (whose fixed default must still leave room for the step around it).
DEFAULT_MEMORY_PERCENT = 0.9


@dataclass(frozen=True)
class CacheSizing:
    num_chunks: int  # including the reserved ones
    swap_slots: int
    chunk_bytes: int
    free_bytes: int
    workspace_bytes: int
    source: str  # which setting decided: "num_blocks", "kv_cache_space", "max_memory_percent" or "default"
    # The cache budget: KV pages attention may gather in one step within the reserved workspace.
    max_pages_per_step: int

    @property
    def kv_bytes(self) -> int:
        return self.num_chunks * self.chunk_bytes

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"kv_bytes": self.kv_bytes}


def meminfo_bytes(field: str) -> int:
    """A /proc/meminfo field (`MemAvailable`, `MemTotal`) in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/meminfo")


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return meminfo_bytes("MemAvailable")


def shm_free_bytes() -> int:
    st = os.statvfs(shm_dir())
    return st.f_bavail * st.f_frsize


def attention_workspace_bytes(model_config: Any, cfg: CBConfig) -> int:
    """Scores and gathered K/V of one layer's attention pass: every batch token against a full context."""
    c = getattr(model_config, "text_config", None) or model_config
    context = min(int(getattr(c, "max_position_embeddings", 4096)), 8192)
    return cfg.max_batch_tokens * int(c.num_attention_heads) * context * 4


def step_workspace_bytes(model_config: Any, cfg: CBConfig, dtype_bytes: int) -> int:
    """A generous estimate of one forward's transient memory beyond weights and KV."""
    c = getattr(model_config, "text_config", None) or model_config
    heads = int(c.num_attention_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    per_token = 6 * c.hidden_size + 3 * c.intermediate_size + 4 * heads * head_dim
    activations = cfg.max_batch_tokens * per_token * dtype_bytes
    logits = cfg.max_requests_per_batch * c.vocab_size * 4 * 3
    return activations + attention_workspace_bytes(model_config, cfg) + logits


def size_cache(
    geometry: KVGeometry,
    model_config: Any,
    cfg: CBConfig,
    device: torch.device,
    *,
    reserve_bytes: int = 0,
    shm: bool = False,
) -> CacheSizing:
    """`reserve_bytes`: memory someone else still needs (the weights a worker has yet to load).
    `shm`: the pool lives in /dev/shm; writing past that filesystem's free space would SIGBUS."""
    chunk_bytes = geometry.chunk_bytes
    # The step's values in the pool's dtype, or, beside a format with scales (int8), float32 at most:
    # the activations, and the pages attention gathers (dequantized).
    element_bytes = 4 if geometry.scale_bytes else geometry.dtype_bytes
    workspace = step_workspace_bytes(model_config, cfg, element_bytes)
    free = free_memory_bytes(device) - reserve_bytes
    if shm and device.type == "cpu":
        free = min(free, shm_free_bytes())
    fits = int(free * (cfg.max_memory_percent or DEFAULT_MEMORY_PERCENT)) - workspace
    if cfg.num_blocks is not None:
        num_chunks, source = cfg.num_blocks + RESERVED_CHUNKS, "num_blocks"
    else:
        if cfg.kv_cache_space is not None:
            budget, source = int(cfg.kv_cache_space * GIB), "kv_cache_space"
        elif cfg.max_memory_percent is not None or device.type == "cuda":
            budget, source = fits, "max_memory_percent" if cfg.max_memory_percent else "default"
        else:
            budget, source = min(DEFAULT_CPU_KV_CACHE, meminfo_bytes("MemTotal") // 4, fits), "default"
        num_chunks = budget // chunk_bytes
        if num_chunks <= RESERVED_CHUNKS:
            raise RuntimeError(
                f"no room for a KV cache: {budget / GIB:.2f} GiB ({source}; {free / GIB:.2f} GiB free, "
                f"{workspace / GIB:.2f} GiB step workspace) < {RESERVED_CHUNKS + 1} chunks of {chunk_bytes} B"
            )
    swap_slots = int(cfg.cpu_offload_space * GIB) // chunk_bytes
    if shm and device.type == "cpu" and (num_chunks + swap_slots) * chunk_bytes > shm_free_bytes():
        raise RuntimeError(
            f"a KV pool of {num_chunks * chunk_bytes / GIB:.2f} GiB and a swap pool of "
            f"{swap_slots * chunk_bytes / GIB:.2f} GiB do not fit the {shm_free_bytes() / GIB:.2f} GiB "
            f"free in {shm_dir()} (writing past it would crash the stack)"
        )
    gathered_page_bytes = 2 * geometry.page_size * geometry.num_kv_heads * geometry.head_dim * element_bytes
    max_pages = attention_workspace_bytes(model_config, cfg) // gathered_page_bytes
    return CacheSizing(num_chunks, swap_slots, chunk_bytes, free, workspace, source, max_pages)
