"""The native decode kernel agrees with the gather + SDPA path, and the engine is exact either way."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.worker import kernels
from services.worker.engine import Engine
from tests.test_engine_parity import CONFIGS, make_prompts, reference, reference_attn


@pytest.fixture
def kernels_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(kernels.SWITCH, "0")
    kernels.paged_decode_kernel.cache_clear()
    yield
    kernels.paged_decode_kernel.cache_clear()


def gather_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """The fallback's math written out plainly (gathered copy, explicit softcap and mask)."""
    b, kv, _, d = q.shape
    length = slots.shape[1]
    k = k_cache[slots.reshape(-1)].view(b, length, kv, d).transpose(1, 2)
    v = v_cache[slots.reshape(-1)].view(b, length, kv, d).transpose(1, 2)
    keep = torch.arange(length)[None, :] < lengths[:, None]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), v)


@pytest.mark.parametrize("softcap", [0.0, 20.0])
@pytest.mark.parametrize(("kv", "group", "d"), [(2, 2, 16), (3, 3, 64), (1, 4, 32)])
def test_native_decode_matches_reference(kv: int, group: int, d: int, softcap: float) -> None:
    kernel = kernels.paged_decode_kernel()
    if kernel is None:
        pytest.skip("no C++ toolchain: the engine runs the fallback path (tested below)")
    gen = torch.Generator().manual_seed(0)
    b, length, num_slots = 7, 45, 400
    k_cache = torch.randn(num_slots, kv, d, generator=gen)
    v_cache = torch.randn(num_slots, kv, d, generator=gen)
    slots = torch.randint(0, num_slots, (b, length), generator=gen)
    lengths = torch.randint(1, length + 1, (b,), generator=gen)
    q = torch.randn(b, kv, group, d, generator=gen)
    got = kernel(q, k_cache, v_cache, slots, lengths, d**-0.5, softcap)
    want = gather_sdpa(q, k_cache, v_cache, slots, lengths, d**-0.5, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if not softcap:
        sdpa = F.scaled_dot_product_attention(
            q,
            k_cache[slots.reshape(-1)].view(b, length, kv, d).transpose(1, 2),
            v_cache[slots.reshape(-1)].view(b, length, kv, d).transpose(1, 2),
            attn_mask=torch.arange(length)[None, None, None, :] < lengths[:, None, None, None],
        )
        torch.testing.assert_close(got, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config_name", ["chunked", "padded"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_fallback_path_is_exact(
    family: str, config_name: str, tiny_models: Callable[[str], Path], kernels_off: None
) -> None:
    model_dir = tiny_models(family)
    prompts = make_prompts(seed=9)
    with Engine.from_pretrained(model_dir, **CONFIGS[config_name]) as engine:
        assert engine.runner.builder.decode_kernel is None
        assert engine.generate(prompts, 20, ignore_eos=True) == reference(
            model_dir, reference_attn(family), prompts
        )
