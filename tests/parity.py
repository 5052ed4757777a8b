"""What the engine's outputs are compared with, and the workloads they are compared on.

The reference is transformers in float32: greedy `generate` (cached per model, attention and prompts)
and the log-probabilities of a prompt. The workloads: random token prompts, the engine configurations
that change how tokens reach the model, chat prompts and configurations for the embedded SmolLM2, and
the pool sizes that make the tiny models offload. `assert_no_leak` is what every run must leave: no
block held, no swap slot used, and a block manager that passes its own check.
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from services.worker.engine import Engine

NEW_TOKENS = 20

CONFIGS: dict[str, dict[str, Any]] = {
    "roomy": {"num_blocks": 256},
    # Several prompts in flight at once, each capped at 7 tokens a step: ragged chunks of every size.
    "chunked": {"num_blocks": 256, "max_batch_tokens": 16, "long_prefill_token_threshold": 7},
    "prefill_first": {"num_blocks": 256, "max_batch_tokens": 24, "scheduler_type": "prefill_first"},
    # KV lengths padded to 16, not 8: with 8 Mistral's sliding layers never pad (its window, 24, is a
    # multiple of 8 and is what a long context reads).
    "padded": {"num_blocks": 256, "q_padding_interval_size": 16, "kv_padding_interval_size": 16},
    "swap": {"page_size": 8, "cpu_offload_space": 0.01},
    "soft_reset": {"page_size": 8, "max_batch_tokens": 32},
}

# Pools (in chunks of 8 tokens) that hold the longest request of two rounds sharing a 40-token prefix
# (make_prompts(11, 3, shared), then make_prompts(12, 4, shared): 40 shared + 60 + 20 tokens) but not
# three at once: with pages of 8 and a swap pool, requests are offloaded and restored
# (tests/test_cuda_graphs.py, scripts/gpu_check). Not Mistral's: its sliding layers recycle their
# pages, so that no running request ever blocks and none is offloaded.
SWAP_BLOCKS = {"llama": 20, "qwen3": 20, "gemma2": 40}


def reference_attn(family: str) -> str:
    # transformers has no SDPA path for Gemma2 (logit soft-capping): its reference is eager.
    return "eager" if family == "gemma2" else "sdpa"


def make_prompts(seed: int, count: int = 6, prefix: list[int] | None = None) -> list[list[int]]:
    rng = random.Random(seed)
    head = prefix or []
    return [head + [rng.randint(3, 255) for _ in range(rng.randint(5, 60))] for _ in range(count)]


def generate_reference(
    model_dir: Path,
    prompts: list[list[int]],
    new_tokens: int,
    device: str,
    attn: str = "sdpa",
    eos: bool = False,
) -> list[list[int]]:
    """transformers' greedy `generate` (fp32, EOS ignored unless `eos`) on `device`, one prompt at a
    time."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    model = model.to(device).eval()
    if not eos:
        model.generation_config.eos_token_id = None
    outs = []
    for prompt in prompts:
        out = model.generate(
            torch.tensor([prompt], device=device), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
        outs.append(out[0, len(prompt) :].tolist())
    return outs


@cache
def _reference(
    model_dir: Path, attn: str, prompts: tuple[tuple[int, ...], ...], eos: bool
) -> list[list[int]]:
    return generate_reference(model_dir, [list(p) for p in prompts], NEW_TOKENS, "cpu", attn, eos)


def reference(model_dir: Path, attn: str, prompts: list[list[int]], eos: bool = False) -> list[list[int]]:
    """`generate_reference` on the CPU for NEW_TOKENS tokens, computed once per session."""
    return _reference(model_dir, attn, tuple(map(tuple, prompts)), eos)


def reference_prompt_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' fp32 logits over the prompt: row i scores prompt token i + 1."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_no_leak(engine: Engine) -> None:
    stats = engine.stats()
    assert stats["used_blocks"] == 0, stats
    assert stats["free_blocks"] + stats["evictable_blocks"] == stats["total_blocks"], stats
    assert stats["swap_slots_used"] == 0, stats
    engine.cache.block_manager.check()


# --------------------------------------------------------------------------------- embedded SmolLM2

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "How do plants make food?",
]
SMOL_CONFIGS: dict[str, dict[str, Any]] = {
    "roomy": {"num_blocks": 64, "page_size": 16},
    "chunked": {"num_blocks": 64, "page_size": 16, "max_batch_tokens": 24},
    "prefill_first_padded": {
        "num_blocks": 64,
        "page_size": 16,
        "max_batch_tokens": 40,
        "scheduler_type": "prefill_first",
        "q_padding_interval_size": 32,
        "kv_padding_interval_size": 16,
    },
    "swap": {"num_blocks": 10, "page_size": 16, "cpu_offload_space": 0.05, "safety_margin": 0.0},
    "soft_reset": {"num_blocks": 10, "page_size": 16, "safety_margin": 0.0},
}


def chat_prompts(model_dir: Path) -> list[list[int]]:
    """CHATS through the model's chat template, each after one shared system prompt."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = []
    for text in CHATS:
        messages = [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": text},
        ]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return prompts
