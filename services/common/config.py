"""Continuous-batching settings shared by every process.

One dataclass holds every continuous-batching setting (docs/configuration.md lists them); each
process reads the fields it needs. The CLI exposes each field as a kebab-case flag and a
`CBSERVE_<NAME>` environment variable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

SchedulerType = Literal["fifo", "prefill_first"]
# The weights' dtype (`auto`: services/common/precision.py) and the KV pool's (`auto`: precision.py;
# int8: services/common/kv_int8.py).
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = (*DTYPES, "int8")

# The safety margin each policy gets unless one is given: fifo keeps headroom so that running decodes
# are not starved by newly admitted prefills; prefill_first drains prefills and needs none.
DEFAULT_SAFETY_MARGIN: dict[str, float] = {"fifo": 0.15, "prefill_first": 0.0}
# The layers' linears' weights apart from `--dtype` (worker/fused_llama.py): `int8` rounds them to int8
# per output channel and each linear's input to int8 per token; `int8-weight-only` the weights alone
# (the inputs multiply in float32); `none` keeps them in the dtype.
QUANTIZATIONS = ("none", "int8", "int8-weight-only")


@dataclass(frozen=True)
class CBConfig:
    """Continuous-batching configuration.

    Invariants checked in `__post_init__`: positive sizes, a known scheduler type, a margin in
    [0, 1). `safety_margin=None` means the policy's default.
    """

    page_size: int = 32
    num_blocks: int | None = None
    max_batch_tokens: int = 512
    # Caps one request's prefill chunk per step (vLLM's name and meaning), so that a very long prompt
    # leaves part of the token budget to the prompts that arrive behind it. 0: no cap.
    long_prefill_token_threshold: int = 0
    # KV pool size, first match wins: `num_blocks`; `kv_cache_space` GiB; `max_memory_percent` of free
    # memory; else the device's default (see cachemgr/sizing.py: 90% of free memory on a GPU, a fixed
    # size on a CPU host, which other programs share).
    kv_cache_space: float | None = None
    max_memory_percent: float | None = None
    # A host pool's pages are written once at start (cachemgr/pool_memory.py), as the peers do, so that
    # no step waits for the kernel to fault in fresh KV pages. Off: committed as first written.
    prefault_kv_pool: bool = True
    # The KV pages' element type apart from the weights' (KV_CACHE_DTYPES): bfloat16 or float16 pages
    # hold twice the tokens of float32 ones in the same bytes, int8 ones (a scale per token and kv
    # head) nearly four times. `auto`: the weights' dtype (as a server resolves it: precision.py).
    kv_cache_dtype: str = "auto"
    max_requests_per_batch: int = 64
    allow_block_sharing: bool = True
    scheduler_type: SchedulerType = "fifo"
    quantization: str = "none"  # QUANTIZATIONS; on a CPU with the native kernels only
    safety_margin: float | None = None
    cpu_offload_space: float = 0.0  # GiB of swap pool; 0 means offloading falls back to soft reset
    q_padding_interval_size: int = 0  # 0: no padding of the packed query length
    kv_padding_interval_size: int = 0  # 0: no padding of per-request KV lengths
    # Decode steps replay whole CUDA graphs (worker/cuda_graphs.py), other steps piecewise ones with
    # our own forward (worker/piecewise_graphs.py). None: on for a CUDA device, off elsewhere; True
    # on another device is refused where the device is known (`cuda_graph_enabled`).
    use_cuda_graph: bool | None = None
    # While no request has started (none running), the worker takes requests that keep arriving less
    # than this many ms apart into its next step (for at most 5x this in all), so that a burst (a
    # closed-loop client's next wave, a batch job) prefills in one step instead of one request first
    # and the rest a whole prefill later. A lone request waits this long once; a wave as large as the
    # one that last finished (closed-loop clients back) waits only for its last member; a running
    # request never waits for it. 0: off.
    arrival_gap_ms: float = 8.0
    # The host plans, round-trips and builds step N+1 while step N's forward runs (engine.py). None: on
    # where decode steps replay CUDA graphs, whose forward leaves the host idle; off elsewhere. An eager
    # forward launches its kernels from Python, on the GIL the host work needs, so the two would slow
    # each other. On a CPU that host work competes with the forward's threads for the cores.
    use_async_batching: bool | None = None

    def __post_init__(self) -> None:
        for name in ("page_size", "max_batch_tokens", "max_requests_per_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks!r}")
        if self.scheduler_type not in DEFAULT_SAFETY_MARGIN:
            raise ValueError(
                f"scheduler_type must be one of {sorted(DEFAULT_SAFETY_MARGIN)}, got {self.scheduler_type!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            known = ", ".join(KV_CACHE_DTYPES)
            raise ValueError(f"kv_cache_dtype must be one of {known}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_space is not None and not self.kv_cache_space > 0:
            raise ValueError(f"kv_cache_space must be > 0 GiB, got {self.kv_cache_space!r}")
        if self.max_memory_percent is not None and not 0.0 < self.max_memory_percent <= 1.0:
            raise ValueError(f"max_memory_percent must be in (0, 1], got {self.max_memory_percent!r}")
        if self.safety_margin is not None and not 0.0 <= self.safety_margin < 1.0:
            raise ValueError(f"safety_margin must be in [0, 1), got {self.safety_margin!r}")
        if self.quantization not in QUANTIZATIONS:
            known = ", ".join(QUANTIZATIONS)
            raise ValueError(f"quantization must be one of {known}, got {self.quantization!r}")
        if not 0 <= self.arrival_gap_ms <= 1000:
            raise ValueError(f"arrival_gap_ms must be in [0, 1000], got {self.arrival_gap_ms!r}")
        if self.cpu_offload_space < 0:
            raise ValueError(f"cpu_offload_space must be >= 0 GiB, got {self.cpu_offload_space!r}")
        for name in ("long_prefill_token_threshold", "q_padding_interval_size", "kv_padding_interval_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")

    def async_batching_enabled(self, device_type: str) -> bool:
        """Whether steps overlap (`use_async_batching`) on a device of this type."""
        if self.use_async_batching is None:
            return self.cuda_graph_enabled(device_type)
        return self.use_async_batching

    def cuda_graph_enabled(self, device_type: str) -> bool:
        """Whether the forward replays CUDA graphs on a device of this type ("cuda", "cpu", ...)."""
        if self.use_cuda_graph is None:
            return device_type == "cuda"
        if self.use_cuda_graph and device_type != "cuda":
            raise ValueError(
                f"use_cuda_graph needs a CUDA device, this one is {device_type!r} "
                "(leave the setting unset, or turn it off)"
            )
        return self.use_cuda_graph

    @property
    def effective_safety_margin(self) -> float:
        if self.safety_margin is not None:
            return self.safety_margin
        return DEFAULT_SAFETY_MARGIN[self.scheduler_type]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> CBConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown continuous-batching settings: {unknown}")
        return cls(**kwargs)
