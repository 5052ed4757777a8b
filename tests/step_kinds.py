"""Which steps piecewise graphs ran (worker/piecewise_graphs.py): a test asserts that a mixed step,
a prompt chunk beside decode rows, was among them."""

from __future__ import annotations

import torch

from services.worker.batch import ForwardBatch
from services.worker.piecewise_graphs import PiecewiseGraphs


def step_kinds(pieces: PiecewiseGraphs) -> list[tuple[bool, bool]]:
    """(has a prompt chunk, has a decode row) of each step the pieces run, recorded as they run."""
    kinds: list[tuple[bool, bool]] = []
    run = pieces.run

    def recording(batch: ForwardBatch) -> torch.Tensor:
        groups = [rg for gs in batch.attention.groups.values() for rg in gs]
        prefill = bool(batch.attention.prefill) or any(rg.num_queries > 1 for rg in groups)
        kinds.append((prefill, any(rg.num_queries == 1 for rg in groups)))
        return run(batch)

    pieces.run = recording  # type: ignore[method-assign]
    return kinds
