"""A GPU's fallback forward, on a CPU engine: what the CUDA graph tests (tests/test_cuda_graphs.py) and
the device check (scripts/gpu_check) run where no GPU is."""

from __future__ import annotations

from collections.abc import Callable

from services.common.switches import switched
from services.worker import layer_forward
from services.worker.attention_kernels import AttentionKernels
from services.worker.batch import PADDING_WASTE
from services.worker.engine import Engine


def cuda_like(build: Callable[[], Engine]) -> Engine:
    """The engine `build()` makes, with transformers' modules and gather + SDPA attention: what a CUDA
    device runs a model with where neither our Triton forward nor the Triton attention does
    (`CBSERVE_FORWARD=transformers`, `CBSERVE_PAGED_ATTENTION=gather`; a Llama under `auto` gets both,
    tests/test_gpu_llama.py runs them on the CPU under Triton's interpreter, too slowly for these).
    It is built with transformers' forward: a CPU's own forward, once built, has let the model's
    plain weights go (its packed copies are all it reads)."""
    with switched(layer_forward.SWITCH, "transformers"):
        engine = build()
    runner = engine.runner
    runner.attention = AttentionKernels("gather")
    runner.builder.decode_kernel = runner.builder.prefill_kernel = None
    runner.builder.padding_waste = PADDING_WASTE["cuda"]
    return engine
