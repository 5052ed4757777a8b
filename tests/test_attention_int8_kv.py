"""int8 KV pages (common/kv_int8.py): the writers and the attention kernels that read them in place.

The kernels compute in float32 on the widened int8 values and apply each row's scale once, so on every
vector path they give the float32 result on the dequantized pool within float32 rounding. Against
the unquantized K/V the error is the format's: each stored value is within half its row's scale of
the original, and `format_bound` carries that through the scores, the softmax and the sum of values.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.common.kv_int8 import SCALE_BYTES, dequantize, quantize
from services.worker import kernels
from services.worker.attention import AttentionBatch, attend_paged
from services.worker.engine import Engine
from tests.attention_cases import (
    DECODE_SHAPES,
    causal_reference,
    decode_batch,
    expected_path,
    gather_sdpa,
    prefill_batch,
    rerun_on_lower_path,
    rotary_batch,
)
from tests.kernel_modules import attention_module, fused_ops_module, native_kernels_off
from tests.parity import CONFIGS, make_prompts

FP32_TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scale of each int8 row `[..., D + SCALE_BYTES]`: `[...]`."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32).squeeze(-1)


def format_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The most attention of queries `q [R, D]` over keys `k`, `v [L, D]` (one kv head, original float32)
    can move when K and V are stored as int8 rows, per query row `[R, 1]`, plus float32 rounding.

    A stored value is within s/2 of the original (s: its row's scale). A score then moves by at most
    delta = scale * |q|_1 * max s_k / 2 (soft-capping only shrinks that), each softmax weight by a
    factor within exp(+-2 delta), so the weights by at most exp(2 delta) - 1 in L1; the output moves by
    the values' error (at most max s_v / 2, under weights summing to 1) plus that shift times max |v|.
    """
    k8, v8 = quantize(k), quantize(v)
    delta = scale * q.abs().sum(-1, keepdim=True) * scales(k8).max() / 2
    return scales(v8).max() / 2 + torch.expm1(2 * delta) * v.abs().max() + 1e-5


def test_module_names_its_vector_path() -> None:
    assert attention_module().isa() == expected_path()


@pytest.mark.parametrize("softcap", [0.0, 20.0])
@pytest.mark.parametrize(("kv", "group", "d", "b", "length"), DECODE_SHAPES)
def test_int8_decode_matches_float32_on_the_dequantized_pool(
    kv: int, group: int, d: int, b: int, length: int, softcap: float
) -> None:
    num_slots = 2 * length + 300
    k_orig, v_orig, packed, rows, slots, lengths = decode_batch(
        kv, group, d, b, length, num_slots=num_slots, seed=d + length
    )
    k_cache, v_cache = quantize(k_orig), quantize(v_orig)
    assert k_cache.shape == (num_slots, kv, d + SCALE_BYTES) and k_cache.dtype == torch.int8
    out = torch.full(packed.shape, 7.0)
    attention_module().paged_decode(packed, out, rows, k_cache, v_cache, slots, lengths, d**-0.5, softcap)
    others = torch.ones(b + 3, dtype=torch.bool).index_fill_(0, rows, False)
    assert torch.equal(out[others], torch.full_like(out[others], 7.0))  # left alone
    got, q = out[rows].view(b, kv, group, d), packed[rows].view(b, kv, group, d)
    reference = gather_sdpa(q, dequantize(k_cache), dequantize(v_cache), slots, lengths, d**-0.5, softcap)
    torch.testing.assert_close(got, reference, **FP32_TOLERANCE)
    exact = gather_sdpa(q, k_orig, v_orig, slots, lengths, d**-0.5, softcap)
    for i in range(b):
        keys = slots[i, : lengths[i]]
        for h in range(kv):
            bound = format_bound(q[i, h], k_orig[keys, h], v_orig[keys, h], d**-0.5)
            assert ((got[i, h] - exact[i, h]).abs() <= bound).all(), (i, h, bound)


@pytest.mark.parametrize(("softcap", "window"), [(0.0, 0), (20.0, 0), (0.0, 13)])
@pytest.mark.parametrize(("kv", "group", "d"), [(3, 3, 64), (2, 2, 16), (1, 5, 128), (4, 1, 32), (2, 2, 48)])
def test_int8_prefill_matches_float32_on_the_dequantized_pool(
    kv: int, group: int, d: int, softcap: float, window: int
) -> None:
    module = attention_module()
    if not module.prefill_supports(d):
        pytest.skip(f"no prefill kernel for head size {d} on the {module.isa()} path")
    k_orig, v_orig, (q, first_rows, num_queries, slots, lengths) = prefill_batch(
        kv, group, d, window, torch.float32
    )
    k_cache, v_cache = quantize(k_orig), quantize(v_orig)
    out = torch.full(q.shape, 7.0)
    module.paged_prefill(
        q, out, k_cache, v_cache, first_rows, num_queries, slots, lengths, d**-0.5, softcap, window
    )
    assert torch.equal(out[:2], torch.full_like(out[:2], 7.0))  # someone else's rows: left alone
    for first, n, keys, s in zip(first_rows, num_queries, lengths, slots, strict=True):
        rows, keys_of = slice(first, first + n), s[:keys]
        k8, v8 = k_cache[keys_of], v_cache[keys_of]
        reference = causal_reference(q[rows], dequantize(k8), dequantize(v8), d**-0.5, softcap, window)
        torch.testing.assert_close(out[rows], reference, **FP32_TOLERANCE)
        exact = causal_reference(q[rows], k_orig[keys_of], v_orig[keys_of], d**-0.5, softcap, window)
        for h in range(kv):
            heads = slice(h * group, (h + 1) * group)
            q_rows = q[rows, heads].reshape(-1, d)
            bound = format_bound(q_rows, k_orig[keys_of, h], v_orig[keys_of, h], d**-0.5)
            error = (out[rows, heads] - exact[:, heads]).reshape(-1, d).abs()
            assert (error <= bound).all(), (h, bound)


def test_an_int8_pool_of_the_wrong_row_size_is_refused() -> None:
    module = attention_module()
    k_cache, _, (q, first_rows, num_queries, slots, lengths) = prefill_batch(2, 2, 32, 0, torch.float32)
    unscaled = k_cache.to(torch.int8)  # rows of 32: no room for the scales
    out = torch.zeros(q.shape)
    with pytest.raises(RuntimeError, match=r"\[slots, kv_heads, 36\] for head size 32"):
        module.paged_decode(q, out, first_rows, unscaled, unscaled, slots, lengths, 0.1, 0.0)
    if module.prefill_supports(32):
        with pytest.raises(RuntimeError, match=r"\[slots, kv_heads, 36\] for head size 32"):
            module.paged_prefill(
                q, out, unscaled, unscaled, first_rows, num_queries, slots, lengths, 0.1, 0.0, 0
            )
    assert not out.any()


def native_store(rows: torch.Tensor) -> torch.Tensor:
    """`rows [T, kv_heads, D]` as rotary_store_kv_ writes them to an int8 pool, as K and as V, with a
    rotation that is the identity (cos 1, sin 0: each value times 1 less its partner times 0)."""
    t, kv_heads, d = rows.shape
    flat = rows.reshape(t, kv_heads * d)
    qkv = torch.cat([flat, flat, flat], dim=1)  # as many query heads as kv heads, then K, then V
    cos, sin = torch.ones(1, d), torch.zeros(1, d)
    k_cache, v_cache = (torch.zeros(t + 2, kv_heads, d + SCALE_BYTES, dtype=torch.int8) for _ in range(2))
    slots = torch.arange(t) + 2
    positions = torch.zeros(t, dtype=torch.long)
    fused_ops_module().rotary_store_kv_(
        qkv, kv_heads, kv_heads, d, cos, sin, positions, k_cache, v_cache, slots
    )
    assert torch.equal(k_cache, v_cache) and not k_cache[:2].any()
    return k_cache[slots]


def test_native_and_torch_writers_store_the_same_bytes() -> None:
    """rotary_store_kv_ (the fused forward's writer), torch's `quantize` and attend_paged's write (the
    generic path's): the same rotated rows give the same bytes."""
    t, heads, kv_heads, d = 23, 9, 3, 64
    qkv, cos, sin, positions, slots = rotary_batch(t, heads, kv_heads, d, seed=8)
    qkv = qkv * 3
    k_cache, v_cache = (torch.zeros(40, kv_heads, d + SCALE_BYTES, dtype=torch.int8) for _ in range(2))
    fused_ops_module().rotary_store_kv_(qkv, heads, kv_heads, d, cos, sin, positions, k_cache, v_cache, slots)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d)  # rotated in place
    v = qkv[:, (heads + kv_heads) * d :].view(t, kv_heads, d)
    assert torch.equal(k_cache[slots], quantize(k)) and torch.equal(v_cache[slots], quantize(v))
    untouched = torch.ones(40, dtype=torch.bool).index_fill_(0, slots, False)
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
    generic_k, generic_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    batch = AttentionBatch(t, {(0, 0): slots}, {0: []}, [(0, 0)], [(generic_k, generic_v)])
    attend_paged(batch, 0, torch.zeros(t, heads, d), k, v, d**-0.5)
    assert torch.equal(generic_k, k_cache) and torch.equal(generic_v, v_cache)


def test_a_zero_row_has_scale_zero_and_values_zero() -> None:
    rows = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(1))
    rows[1, 2] = 0.0
    stored = native_store(rows)
    assert torch.equal(stored, quantize(rows))
    assert not stored[1, 2].any()  # values and scale bytes alike
    assert torch.equal(dequantize(stored[1, 2]), torch.zeros(32))
    assert (scales(stored[0]) > 0).all()


def test_a_row_with_large_outliers_keeps_them_and_rounds_the_rest_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(4, 2, 64, generator=gen)
    rows[0, 0, 5], rows[1, 1, 63], rows[2, 0, 0] = 1e4, -3e3, 1e-30  # 1e-30: a tiny one, not an outlier
    stored = native_store(rows)
    assert torch.equal(stored, quantize(rows))
    assert stored[0, 0, 5] == 127 and stored[1, 1, 63] == -127
    step = scales(stored)
    assert torch.equal(step, rows.abs().amax(-1) * torch.tensor(1 / 127, dtype=torch.float32))
    # Half a step, and the float32 rounding of values up to 127 steps.
    error = (dequantize(stored) - rows).abs()
    assert (error <= step[..., None] * (0.5 + 127 * 2**-22)).all()
    torch.testing.assert_close(dequantize(stored)[0, 0, 5], torch.tensor(1e4))


def test_ties_round_to_even() -> None:
    """A scale of exactly 1 (a row whose largest value is 127): x.5 values sit on a tie."""
    row = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.0])
    stored = native_store(row.view(1, 1, 8))
    assert torch.equal(stored, quantize(row.view(1, 1, 8)))
    assert stored[0, 0, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 3]


# Every test above, again on each vector path below this CPU's best (a build of its own, cached like
# any other); the portable path's build and scalar loops are left to the slow run.
@pytest.mark.parametrize("path", ["avx2", pytest.param("portable", marks=pytest.mark.slow)])
def test_lower_path_agrees(path: str) -> None:
    rerun_on_lower_path(Path(__file__), path)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_generic_path_reads_int8_pages_as_the_native_one(
    family: str, tiny_models: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the native kernels (as on a GPU) int8 pages are written by `quantize` and read by gather
    + dequantize + SDPA: a request's tokens are the native path's."""
    if os.environ.get(kernels.ISA_SWITCH, "native") != "native":
        pytest.skip("a lower path's run checks its kernels (above), not whole engines: three more builds")
    model_dir = tiny_models(family)
    prompts = make_prompts(seed=9)
    settings = {**CONFIGS["chunked"], "kv_cache_dtype": "int8"}
    with Engine.from_pretrained(model_dir, **settings) as engine:
        assert engine.runner.kv_pool.dtype == torch.int8
        native = engine.generate(prompts, 20, ignore_eos=True)
    with native_kernels_off(monkeypatch), Engine.from_pretrained(model_dir, **settings) as engine:
        assert engine.runner.builder.decode_kernel is None and engine.runner.fused is None
        assert engine.generate(prompts, 20, ignore_eos=True) == native
