"""The `hf-generate` and `hf-static` systems of `cbserve bench offline`: transformers' `generate`, one
request at a time, and in static left-padded batches of `--static-batch` requests.

EOS is ignored as every other system ignores it: by an empty `eos_token_id` list, not `min_new_tokens`
(which masks the EOS logit and so changes the greedy token whenever EOS would have been the argmax).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, cast

import torch

from services.bench.offline.results import WARMUP_NEW_TOKENS, WARMUP_PROMPT, SystemResult
from services.bench.workload import Workload

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel


@torch.inference_mode()
def run_hf_generate(model: PreTrainedModel, workload: Workload) -> SystemResult:
    def one(prompt: list[int], n: int) -> list[int]:
        return _hf_generate(model, [prompt], n, pad_id=0)[0][:n]

    one(WARMUP_PROMPT, WARMUP_NEW_TOKENS)
    start = time.perf_counter()
    outputs = [one(p, n) for p, n in zip(workload.prompts, workload.max_new_tokens, strict=True)]
    wall = time.perf_counter() - start
    return SystemResult("hf-generate", wall, outputs, workload.total_prompt_tokens)


@torch.inference_mode()
def run_hf_static(model: PreTrainedModel, workload: Workload, batch_size: int, pad_id: int) -> SystemResult:
    """Static batches in workload order; each batch runs to its longest request (the rest is waste)."""
    _hf_generate(model, [WARMUP_PROMPT] * min(batch_size, 2), WARMUP_NEW_TOKENS, pad_id)
    outputs: list[list[int]] = []
    wasted = 0
    start = time.perf_counter()
    for lo in range(0, workload.num_requests, batch_size):
        prompts = workload.prompts[lo : lo + batch_size]
        wanted = workload.max_new_tokens[lo : lo + batch_size]
        generated = _hf_generate(model, prompts, max(wanted), pad_id)
        outputs.extend(g[:n] for g, n in zip(generated, wanted, strict=True))
        wasted += sum(len(g) - n for g, n in zip(generated, wanted, strict=True))
    wall = time.perf_counter() - start
    return SystemResult(
        "hf-static",
        wall,
        outputs,
        workload.total_prompt_tokens,
        wasted_output_tokens=wasted,
        extra={"batch_size": batch_size},
    )


def _hf_generate(
    model: PreTrainedModel, prompts: list[list[int]], new_tokens: int, pad_id: int
) -> list[list[int]]:
    """Greedy `generate` on left-padded prompts; returns exactly `new_tokens` ids per prompt.

    `eos_token_id=[]` disables stopping without touching logits (an explicit `None` would be replaced by
    the model's default EOS). `min_new_tokens` is not used: it masks EOS and so changes greedy outputs.
    """
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, eos_token_id=[], pad_token_id=pad_id, use_cache=True
    )
    out = cast("GenerationMixin", model).generate(
        input_ids=input_ids, attention_mask=attention_mask, generation_config=config
    )
    return out[:, width:].tolist()


def pad_token_id(model: PreTrainedModel, tokenizer: Any) -> int:
    # Padded positions are masked out, so any valid id does; prefer the model's own pad id.
    for candidate in (
        getattr(tokenizer, "pad_token_id", None),
        model.generation_config.pad_token_id,
        model.config.pad_token_id,
    ):
        if isinstance(candidate, int) and candidate >= 0:
            return candidate
    return 0
