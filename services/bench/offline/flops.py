"""The two ends of the GFLOP/s column of `cbserve bench offline`: the useful work a workload costs
(parameters x tokens, the LM head only on the rows that sample) and the machine's practical ceiling,
an fp32 matmul measured in the same run, since a shared host's speed varies from one run to the next."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def measure_matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Median fp32 GFLOP/s of an n x n x n torch matmul: the machine's practical ceiling, this run."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # first call picks kernels and grows the allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def param_split(model: PreTrainedModel) -> tuple[int, int]:
    """(parameters outside the input embedding and LM head, LM head parameters).

    The LM head is split out because it runs only on rows that sample; with tied embeddings it is the
    embedding matrix, which `parameters()` lists once, so the split is done by identity, not by name.
    """
    embedding = model.get_input_embeddings().weight
    head_module = model.get_output_embeddings()
    head = head_module.weight if head_module is not None else None
    body = sum(p.numel() for p in model.parameters() if p is not embedding and p is not head)
    return body, (head.numel() if head is not None else 0)


def meta_model(model_path: Path) -> PreTrainedModel:
    """The architecture without weights, for counting parameters when no HF system is run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
