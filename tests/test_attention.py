"""The native kernels (decode attention, packed linears) agree with torch's paths, and the engine is
exact either way."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.worker import kernels
from services.worker.engine import Engine
from services.worker.packed_linear import PackedLinear, pack_linears
from tests.test_engine_parity import CONFIGS, make_prompts, reference, reference_attn


@pytest.fixture
def kernels_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(kernels.SWITCH, "0")
    kernels.paged_decode_kernel.cache_clear()
    kernels.packed_linear_ops.cache_clear()
    yield
    kernels.paged_decode_kernel.cache_clear()
    kernels.packed_linear_ops.cache_clear()


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
        assert not any(isinstance(m, PackedLinear) for m in engine.model.modules())
        assert engine.generate(prompts, 20, ignore_eos=True) == reference(
            model_dir, reference_attn(family), prompts
        )


@pytest.mark.parametrize("rows", [0, 1, 7, 38, 600])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_torch(rows: int, bias: bool) -> None:
    if kernels.packed_linear_ops() is None:
        pytest.skip("no MKL or C++ toolchain: linears stay torch's (the fallback test covers it)")
    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(96, 200, bias=bias)
    torch.nn.init.normal_(linear.weight, generator=gen)
    x = torch.randn(1, rows, 96, generator=gen)  # the engine's packed batch axis
    packed = PackedLinear(linear, kernels.packed_linear_ops())
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-4)
    assert packed.weight is linear.weight


def test_pack_linears_keeps_tied_weights(tiny_models: Callable[[str], Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models("llama"))
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    swapped = pack_linears(model)
    if kernels.packed_linear_ops() is None:
        assert swapped == 0
        return
    assert swapped == linears > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert pack_linears(model) == 0  # already packed


def test_prefill_groups_bound_padding() -> None:
    from services.worker.batch import MAX_PADDING_WASTE, prefill_groups

    queries = [300, 1, 60, 290, 64, 8]
    keys = [300, 301, 460, 290, 64, 520]
    groups = prefill_groups([0, 2, 3, 4, 5], queries, keys)
    assert sorted(i for g in groups for i in g) == [0, 2, 3, 4, 5]
    assert [0, 3] in groups  # two prompts of nearly one shape share a group
    for g in groups:
        padded = len(g) * max(queries[i] for i in g) * max(keys[i] for i in g)
        assert padded <= MAX_PADDING_WASTE * sum(queries[i] * keys[i] for i in g)
    assert prefill_groups([], queries, keys) == []
