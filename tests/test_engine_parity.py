"""Greedy outputs of the engine equal transformers `generate` (fp32) token for token.

Every model family runs through every configuration that changes how tokens reach the model: a roomy
cache, prompts chunked across steps, prefix-cache hits, offloading to the swap pool, soft resets,
both policies, and query/KV padding; each with async batching off and on. After each run nothing leaks.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from services.common.cachemgr_messages import StepGrant, StepPlan
from services.worker.engine import Engine
from tests.parity import (
    CONFIGS,
    NEW_TOKENS,
    SMOL_CONFIGS,
    assert_no_leak,
    chat_prompts,
    make_prompts,
    reference,
    reference_attn,
)
from tests.tiny_models import FAMILIES

# Cache sizes (in chunks) small enough that the six test prompts cannot all be resident at once, so
# offloading must happen; each still fits one request. Hybrids need more chunks per page.
TIGHT_BLOCKS = {"llama": 16, "qwen2": 16, "qwen3": 16, "mistral": 10, "gemma2": 36, "gemma3": 44}


# What the batches of a configuration must show (BatchBuilder's counts): outputs that match prove
# nothing about chunking or padding if none happened. "roomy" must show none of them.
SHAPED = {
    "chunked": ("prompt_chunks",),
    "prefill_first": ("prompt_chunks",),
    "padded": ("padded_queries", "padded_keys"),
    "prefill_first_padded": ("prompt_chunks", "padded_queries", "padded_keys"),
}


def assert_shaped(engine: Engine, config_name: str) -> None:
    builder = engine.runner.builder
    counts = {n: getattr(builder, n) for n in ("prompt_chunks", "padded_queries", "padded_keys")}
    if config_name == "roomy":
        assert not any(counts.values()), counts
    for name in SHAPED.get(config_name, ()):
        assert counts[name] > 0, (config_name, counts)


# Async batching off and on: outputs must not tell them apart.
ASYNC = pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])


def count_overlapped(engine: Engine) -> list[bool]:
    """The `overlapped` flag of every plan the engine sends from now on: True where it planned a step
    while the one before still computed, which is what async batching is."""
    flags: list[bool] = []
    step = engine.cache.step

    def recording(plan: StepPlan) -> StepGrant:
        flags.append(plan.overlapped)
        return step(plan)

    engine.cache.step = recording  # type: ignore[method-assign]
    return flags


def assert_overlapped(flags: list[bool], async_batching: bool) -> None:
    assert any(flags) == async_batching, flags


@ASYNC
@pytest.mark.parametrize("config_name", list(CONFIGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_matches_generate(
    family: str, config_name: str, async_batching: bool, tiny_models: Callable[[str], Path]
) -> None:
    model_dir = tiny_models(family)
    cb = dict(CONFIGS[config_name])
    if config_name in ("swap", "soft_reset"):
        cb["num_blocks"] = TIGHT_BLOCKS[family]
    prompts = make_prompts(seed=7)
    expected = reference(model_dir, reference_attn(family), prompts)
    with Engine.from_pretrained(model_dir, use_async_batching=async_batching, **cb) as engine:
        overlapped = count_overlapped(engine)
        assert engine.generate(prompts, NEW_TOKENS, ignore_eos=True) == expected
        assert_overlapped(overlapped, async_batching)
        stats = engine.stats()
        if config_name == "swap":
            assert stats["offloads"] > 0 and stats["swap_restores"] > 0, stats
        if config_name == "soft_reset":
            assert stats["soft_resets"] > 0, stats
        assert_shaped(engine, config_name)
        assert_no_leak(engine)


@ASYNC
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prefix_hits_keep_outputs_exact(
    family: str, async_batching: bool, tiny_models: Callable[[str], Path]
) -> None:
    model_dir = tiny_models(family)
    shared = [random.Random(3).randint(3, 255) for _ in range(40)]
    first, second = make_prompts(11, 3, shared), make_prompts(12, 4, shared)
    attn = reference_attn(family)
    with Engine.from_pretrained(
        model_dir, num_blocks=128, page_size=8, use_async_batching=async_batching
    ) as engine:
        assert engine.generate(first, NEW_TOKENS, ignore_eos=True) == reference(model_dir, attn, first)
        before = engine.stats()["prefix_hit_tokens"]
        assert engine.generate(second, NEW_TOKENS, ignore_eos=True) == reference(model_dir, attn, second)
        assert engine.stats()["prefix_hit_tokens"] - before >= 4 * 40 // 8 * 8
        assert_no_leak(engine)


@ASYNC
def test_entirely_cached_prompt_recomputes_its_last_token(
    async_batching: bool, tiny_models: Callable[[str], Path]
) -> None:
    model_dir = tiny_models("llama")
    prompt = [random.Random(5).randint(3, 255) for _ in range(32)]  # exactly 4 pages of 8
    expected = reference(model_dir, "sdpa", [prompt])
    with Engine.from_pretrained(
        model_dir, num_blocks=64, page_size=8, use_async_batching=async_batching
    ) as engine:
        assert engine.generate([prompt], NEW_TOKENS, ignore_eos=True) == expected
        assert engine.generate([prompt], NEW_TOKENS, ignore_eos=True) == expected
        assert engine.stats()["prefix_hit_tokens"] == 24  # three full pages; the last page recomputes
        assert_no_leak(engine)


@ASYNC
def test_eos_stops_like_generate(async_batching: bool, tiny_models: Callable[[str], Path]) -> None:
    """With EOS active, requests stop on it exactly where transformers does."""
    model_dir = tiny_models("qwen2")
    prompts = make_prompts(seed=21, count=12)
    expected = reference(model_dir, "sdpa", prompts, eos=True)
    with Engine.from_pretrained(model_dir, num_blocks=128, use_async_batching=async_batching) as engine:
        assert engine.generate(prompts, NEW_TOKENS) == expected
        assert_no_leak(engine)


# --------------------------------------------------------------------------------- embedded SmolLM2


@pytest.fixture(scope="module")
def smol_chats(smollm2_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = chat_prompts(smollm2_dir)
    return prompts, reference(smollm2_dir, "sdpa", prompts, eos=True)


# In the default run SmolLM2 keeps one engine for each of its three kinds of work: "roomy" (sync, the
# second round's prefix hits), "chunked-async" and "swap-async". Its other configurations are in the
# slow run: the tiny families above run each of them (prefill_first and padding, swap, soft resets)
# sync and async, six families, token for token, and tests/test_stack.py streams six SmolLM2 chats at
# once through a sync stack (64 tokens a step), equal to generate.
SMOL_DEFAULT_RUN = {("roomy", False), ("chunked", True), ("swap", True)}


@pytest.mark.parametrize(
    ("config_name", "async_batching"),
    # Async batching where it is cheapest: chunks, prefix hits and the swap round trip (the tiny
    # models above cover every configuration with it).
    [
        pytest.param(
            name,
            a,
            marks=() if (name, a) in SMOL_DEFAULT_RUN else pytest.mark.slow,
            id=f"{name}-async" if a else name,
        )
        for name, a in [*((name, False) for name in SMOL_CONFIGS), ("chunked", True), ("swap", True)]
    ],
)
def test_smollm2_chat_matches_generate(
    config_name: str,
    async_batching: bool,
    smollm2_dir: Path,
    smol_chats: tuple[list[list[int]], list[list[int]]],
) -> None:
    prompts, expected = smol_chats
    # The system prompt is shared: a second round hits the prefix cache.
    with Engine.from_pretrained(
        smollm2_dir, use_async_batching=async_batching, **SMOL_CONFIGS[config_name]
    ) as engine:
        assert engine.generate(prompts, NEW_TOKENS) == expected
        assert engine.generate(prompts, NEW_TOKENS) == expected
        stats = engine.stats()
        if config_name == "roomy":
            assert stats["prefix_hit_tokens"] > 0, stats
        if config_name == "swap":
            assert stats["swap_restores"] > 0, stats
        if config_name == "soft_reset":
            assert stats["soft_resets"] > 0, stats
        assert_shaped(engine, config_name)
        assert_no_leak(engine)
