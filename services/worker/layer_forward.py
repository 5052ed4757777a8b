"""Whose forward runs a model's layers: ours, fused, or transformers' eager modules.

- `native` (fused_llama.py): a Llama-family model on the CPU, in float32 or bfloat16, over a float32,
  bfloat16, float16 or int8 pool, with the native kernels built; the only forward that runs
  `--quantization`.
- `triton` (gpu_llama.py): a Llama-family model on a CUDA device, in float32, bfloat16 or float16, over a
  float32, bfloat16 or float16 pool, unquantized: cuBLAS products and Triton passes.
- `transformers`: anything else, and the fallback (a model or pool the others refuse, no Triton).

`CBSERVE_FORWARD` overrides the choice: `auto` (the default, as above), `triton` (the Triton forward
on any device: on the CPU only under Triton's interpreter, `TRITON_INTERPRET=1`, which is how the test
suite runs the GPU's forward without a GPU; an error where it cannot run), or `transformers`
(transformers' layers everywhere: the baseline the device check measures ours against). Which
kernels attend is attention_kernels.py's choice, apart from this one.
"""

from __future__ import annotations

from typing import Protocol

import structlog
import torch
from torch import nn

from services.common.switches import switch
from services.worker.attention import AttentionBatch
from services.worker.attention_kernels import NATIVE_KV_DTYPES
from services.worker.fused_llama import FusedLlama
from services.worker.packed_linear import PackedWeight

log = structlog.get_logger(__name__)

SWITCH = "CBSERVE_FORWARD"
CHOICES = ("auto", "triton", "transformers")


class OwnForward(Protocol):
    """What the runner needs of our forwards (FusedLlama, GpuLlama)."""

    name: str  # native or triton
    activation_dtype: torch.dtype  # the queries' dtype, which the attention kernels are chosen for

    def packed_weights(self) -> list[PackedWeight]: ...

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor: ...


def choice() -> str:
    return switch(SWITCH, CHOICES)


def choose(
    model: nn.Module, quantization: str, kv_dtype: torch.dtype, max_positions: int
) -> OwnForward | None:
    """Our forward for `model` over a pool of `kv_dtype`, or None where transformers' layers run it.
    `max_positions`: more than any position a step holds (the Triton forward's rotary table)."""
    wanted = choice()
    if wanted == "transformers":
        return None
    device = next(model.parameters()).device
    if wanted == "triton" or device.type == "cuda":
        try:
            from services.worker import gpu_llama  # imports triton, which a CPU host may not have
        except ImportError as exc:
            if wanted == "triton":
                raise
            log.warning("no Triton: transformers' layers run the model", error=str(exc))
            return None
        why = gpu_llama.refusal(model, kv_dtype, quantization)
        if why is None:
            return gpu_llama.GpuLlama(model, max_positions)
        if wanted == "triton":
            raise ValueError(f"{SWITCH}=triton cannot run this model: {why}")
        log.info("transformers' layers run the model", reason=why)
        return None
    if kv_dtype not in NATIVE_KV_DTYPES:
        # The fused passes write only the pages the native attention reads (a float64 model's are not).
        log.info("transformers' layers run the model", reason=f"a KV pool of {kv_dtype}")
        return None
    return FusedLlama.build(model, quantization)
