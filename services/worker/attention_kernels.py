"""Which kernels attend a batch's paged KV in place: the native C++ ones on the CPU
(csrc/paged_attention.cpp), the Triton ones on a GPU (triton_attention.py), or none, where each row
group gathers its context and calls SDPA (attention.py).

`CBSERVE_PAGED_ATTENTION` overrides the choice: `auto` (the default, as above), `triton` (the Triton
kernels on any device: on the CPU only under Triton's interpreter, `TRITON_INTERPRET=1`, which is how the
test suite runs the GPU's attention path without a GPU), or `gather` (gather + SDPA everywhere, the
baseline the GPU check measures the kernels against).
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from services.common.switches import switch
from services.worker.kernels import PagedDecode, PagedPrefill, paged_decode_kernel, paged_prefill_kernel

log = structlog.get_logger(__name__)

SWITCH = "CBSERVE_PAGED_ATTENTION"
CHOICES = ("auto", "triton", "gather")
# The pages the native kernels read, and the Triton ones.
NATIVE_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
TRITON_KV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class AttentionKernels:
    """`name`: native, triton or gather (no kernel: the batch gathers each context for SDPA)."""

    name: str
    decode: PagedDecode | None = None
    prefill: PagedPrefill | None = None


def choice() -> str:
    return switch(SWITCH, CHOICES)


def choose(
    device: torch.device, kv_dtype: torch.dtype, activation_dtype: torch.dtype, head_dim: int
) -> AttentionKernels:
    """The kernels for a pool of `kv_dtype` pages read by queries of `activation_dtype` on `device`."""
    wanted = choice()
    if wanted == "gather":
        return AttentionKernels("gather")
    if wanted == "triton" or device.type == "cuda":
        if kv_dtype not in TRITON_KV_DTYPES:
            if wanted == "triton":
                raise ValueError(f"{SWITCH}=triton reads float32, bfloat16 or float16 pages, not {kv_dtype}")
            return AttentionKernels("gather")  # int8 pages on a GPU: no Triton kernel reads them yet
        try:
            from services.worker import triton_attention
        except ImportError as exc:
            if wanted == "triton":
                raise
            log.warning("no Triton: attention gathers each context for SDPA", error=str(exc))
            return AttentionKernels("gather")
        return AttentionKernels("triton", triton_attention.decode, triton_attention.prefill)
    if device.type == "cpu" and activation_dtype == torch.float32 and kv_dtype in NATIVE_KV_DTYPES:
        decode, prefill = paged_decode_kernel(), paged_prefill_kernel(head_dim)
        if decode is not None:
            return AttentionKernels("native", decode, None if prefill is None else _sized_by_itself(prefill))
    return AttentionKernels("gather")


def _sized_by_itself(prefill: PagedPrefill) -> PagedPrefill:
    """The native prefill under the Triton one's call: `max_queries` sizes a GPU launch grid, and the
    native kernel reads `num_queries` on the host instead."""

    def call(*args: object, max_queries: int) -> None:
        prefill(*args)

    return call
