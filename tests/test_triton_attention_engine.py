"""The GPU's attention path in the engine, run on the CPU: `CBSERVE_PAGED_ATTENTION=triton` gives the
batches the Triton kernels (services/worker/attention_kernels.py), which run under Triton's interpreter
here, and greedy outputs still equal transformers `generate` (fp32) token for token: decode rows,
ragged prefill chunks, prefix hits, a soft reset, sliding windows and softcapping (gemma2), sync and
async. On a GPU the same switch's `auto` picks these kernels; this is what proves their wiring (the
metadata the batch builds, `max_queries`) without one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need triton (xgrammar brings it on Linux x86-64)")

from services.worker import attention_kernels
from services.worker.engine import Engine
from tests.parity import NEW_TOKENS, assert_no_leak, make_prompts, reference, reference_attn

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="on a GPU the device check runs this path compiled"
)


@pytest.fixture(autouse=True)
def triton_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(attention_kernels.SWITCH, "triton")


# Sync in the slow run: async batching's steps reach the kernels through the same batches.
@pytest.mark.parametrize(
    "async_batching", [pytest.param(False, marks=pytest.mark.slow), True], ids=["sync", "async"]
)
@pytest.mark.parametrize(
    ("family", "cb"),
    [
        ("llama", {"num_blocks": 256, "max_batch_tokens": 16, "long_prefill_token_threshold": 7}),
        # The interpreter runs each program in numpy: these take 15-50 s each on two cores.
        pytest.param("gemma2", {"num_blocks": 256, "max_batch_tokens": 24}, marks=pytest.mark.slow),
        pytest.param(
            "qwen2", {"num_blocks": 12, "page_size": 8, "max_batch_tokens": 32}, marks=pytest.mark.slow
        ),
    ],
    ids=["llama-chunked", "gemma2-window-softcap", "qwen2-soft-reset"],
)
def test_greedy_output_equals_generate(
    family: str, cb: dict[str, int], async_batching: bool, tiny_models: Callable[[str], Path]
) -> None:
    model_dir = tiny_models(family)
    prompts = make_prompts(seed=7, count=4)
    prompts += [prompts[0] + prompts[1][:5]]  # a prefix hit on the first prompt's pages
    expected = reference(model_dir, reference_attn(family), prompts)
    with Engine.from_pretrained(model_dir, use_async_batching=async_batching, **cb) as engine:
        assert engine.runner.attention.name == "triton"
        assert engine.generate(prompts, NEW_TOKENS, ignore_eos=True) == expected
        assert engine.runner.builder.prompt_chunks > 0
        if family == "qwen2":
            assert engine.stats()["soft_resets"] > 0
        assert_no_leak(engine)


def test_the_switch_names_its_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(attention_kernels.SWITCH, "flash")
    with pytest.raises(ValueError, match="CBSERVE_PAGED_ATTENTION must be one of"):
        attention_kernels.choose(torch.device("cpu"), torch.float32, torch.float32, 16)
    monkeypatch.setenv(attention_kernels.SWITCH, "triton")
    with pytest.raises(ValueError, match=r"not torch\.int8"):
        attention_kernels.choose(torch.device("cpu"), torch.int8, torch.float32, 16)
    monkeypatch.setenv(attention_kernels.SWITCH, "gather")
    assert attention_kernels.choose(torch.device("cpu"), torch.float32, torch.float32, 16).decode is None
