"""The forward a CUDA device runs, on a CPU engine: what the CUDA graph tests (tests/test_cuda_graphs.py)
and the device check (scripts/gpu_check.py) run where no GPU is."""

from __future__ import annotations

from services.worker.batch import PADDING_WASTE
from services.worker.engine import Engine


def cuda_like(engine: Engine) -> Engine:
    """The forward a CUDA device runs: transformers' modules and gather + SDPA attention."""
    runner = engine.runner
    runner.fused = None
    runner.builder.decode_kernel = runner.builder.prefill_kernel = None
    runner.builder.padding_waste = PADDING_WASTE["cuda"]
    return engine
