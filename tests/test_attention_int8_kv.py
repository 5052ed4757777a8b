"""int8 KV pages (common/kv_int8.py): the writers and the attention kernels that read them in place.

A stored row is the original rotated block by block by the normalized Hadamard matrix H_B, then
quantized per row. The kernels rotate the queries instead of the keys and the outputs back, round each
rotated query row to 15 bits of its own scale (`round_queries`; with AVX512-VNNI the dots are then
exact integer sums) and apply each row's scale once, so on every vector path they give the float32
result of the rounded queries on the dequantized pool within float32 rounding. Against the
unquantized K/V the error is the format's: each stored value is within half its row's scale of the
rotated original, and `format_bound` carries that and the queries' rounding through the rotation
back, the scores, the softmax and the sum of values.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.common.kv_int8 import (
    QUERY_LEVELS,
    SCALE_BYTES,
    block_size,
    dequantize,
    hadamard,
    quantize,
    round_queries,
)
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
    can move when K and V are stored as int8 rows and the queries rounded (`round_queries`), per query
    row `[R, 1]`, plus float32 rounding.

    A stored value is within s/2 of the rotated original H x (s: its row's scale, H = H_B block by
    block), so the row read back is x + H e with |e|_inf <= s/2. A score moves by q.(H e) = (H q).e, at
    most scale * |H q|_1 * max s_k / 2, and by the query's rounding, each element of H q within half a
    step m / QUERY_LEVELS (m = max |H q|) times the stored key's |.|_1 <= |H k|_1 + D max s_k / 2: delta
    in all (soft-capping only shrinks it). Each softmax weight moves by a factor within exp(+-2 delta),
    so the weights by at most exp(2 delta) - 1 in L1. An element of H e is a sum of B terms of e times
    +-1/sqrt(B), at most sqrt(B) s/2: the output moves by at most sqrt(B) max s_v / 2 (under weights
    summing to 1) plus the weights' shift times max |v|.
    """
    k8, v8 = quantize(k), quantize(v)
    hq, s_k = hadamard(q), scales(k8).max()
    stored = hadamard(k).abs().sum(-1).max() + q.shape[-1] * s_k / 2
    half_step = hq.abs().amax(-1, keepdim=True) / (2 * QUERY_LEVELS)
    delta = scale * (hq.abs().sum(-1, keepdim=True) * s_k / 2 + half_step * stored)
    root_b = block_size(q.shape[-1]) ** 0.5
    return root_b * scales(v8).max() / 2 + torch.expm1(2 * delta) * v.abs().max() + 1e-5


def hadamard_matrix(d: int) -> torch.Tensor:
    """The format's rotation of rows of `d` as a float64 matrix `[d, d]` built from its definition:
    block diagonal, each block of B = block_size(d) the Sylvester Hadamard matrix over sqrt(B)."""
    b = block_size(d)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < b:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return torch.block_diag(*[h / b**0.5] * (d // b))


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
    rounded = round_queries(q)  # as every path reads an int8 pool's queries
    reference = gather_sdpa(
        rounded, dequantize(k_cache), dequantize(v_cache), slots, lengths, d**-0.5, softcap
    )
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
        reference = causal_reference(
            round_queries(q[rows]), dequantize(k8), dequantize(v8), d**-0.5, softcap, window
        )
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


@pytest.mark.parametrize("d", [32, 64])  # the writer's loops, and its AVX-512 rows of 64 in registers
def test_a_zero_row_has_scale_zero_and_values_zero(d: int) -> None:
    rows = torch.randn(2, 3, d, generator=torch.Generator().manual_seed(1))
    rows[1, 2] = 0.0
    stored = native_store(rows)
    assert torch.equal(stored, quantize(rows))
    assert not stored[1, 2].any()  # values and scale bytes alike
    assert torch.equal(dequantize(stored[1, 2]), torch.zeros(d))
    assert (scales(stored[0]) > 0).all()


@pytest.mark.parametrize(("d", "b"), [(64, 64), (128, 64), (80, 16), (96, 16), (48, 16), (24, 4), (6, 1)])
def test_block_size_is_the_largest_power_of_four_up_to_64_that_divides_head_dim(d: int, b: int) -> None:
    assert block_size(d) == b


@pytest.mark.parametrize("d", [64, 128, 80, 96, 24, 7])
def test_the_rotation_is_the_block_hadamard_matrix_and_its_own_inverse(d: int) -> None:
    x = torch.randn(5, 3, d, generator=torch.Generator().manual_seed(d))
    rotated = hadamard(x)
    reference = x.double() @ hadamard_matrix(d).T
    # Each output is a sum of B float32 terms of magnitude at most max|x| / sqrt(B), log2(B) roundings.
    torch.testing.assert_close(rotated.double(), reference, rtol=0, atol=1e-6 * float(x.abs().max()))
    torch.testing.assert_close(hadamard(rotated), x, rtol=0, atol=1e-6 * float(x.abs().max()))


@pytest.mark.parametrize("d", [64, 128, 80, 96, 24, 6])
def test_stored_values_are_the_rotated_row_within_half_a_step(d: int) -> None:
    """Both writers' bytes are the definition: y = H x, scale = max|y| / 127, values y / scale rounded;
    read back, a row is within sqrt(B) half-steps of the original in each element."""
    gen = torch.Generator().manual_seed(2 + d)
    rows = torch.randn(4, 2, d, generator=gen)
    rows[0, 0, 5], rows[1, 1, d - 1], rows[2, 0, 0] = 1e4, -3e3, 1e-30  # 1e-30: a tiny one, not an outlier
    stored = native_store(rows)
    assert torch.equal(stored, quantize(rows))
    y = rows.double() @ hadamard_matrix(d).T
    step = scales(stored).double()
    torch.testing.assert_close(step, y.abs().amax(-1) / 127, rtol=1e-6, atol=0)
    # Half a step, and the float32 rounding of the rotation (up to 127 steps' worth) and of the product.
    values = stored[..., :d].double()
    assert ((values * step[..., None] - y).abs() <= step[..., None] * (0.5 + 1e-5)).all()
    root_b = block_size(d) ** 0.5
    error = (dequantize(stored).double() - rows.double()).abs()
    assert (error <= step[..., None] * (root_b * 0.5 + 1e-4)).all()
    assert dequantize(stored)[0, 0].abs().argmax() == 5 and dequantize(stored)[1, 1].abs().argmax() == d - 1


def test_the_rotation_spreads_an_outlier_over_its_block() -> None:
    """The reason for the rotation: one outlier no longer sets the scale that every other channel of
    the row is rounded to. With B = 64, |H x|_inf <= |x|_1 of the block / 8."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(8, 1, 64, generator=gen)
    rows[:, 0, 17] = 200.0  # a key's outlier channel
    stored = native_store(rows)
    per_row_scale = rows.abs().amax(-1) / 127  # what one scale per unrotated row would be
    assert (scales(stored) <= rows.abs().sum(-1) / 8 / 127 * (1 + 1e-6)).all()
    error = (dequantize(stored) - rows).square().sum(-1).sqrt()
    # Half a step of the unrotated format, in every element but the outlier, would be that much.
    assert (error < per_row_scale / 2 * 63**0.5 / 2).all()


@pytest.mark.parametrize("d", [8, 64])  # blocks of B = 4, and of 64 (AVX-512's rows in registers)
def test_ties_round_to_even(d: int) -> None:
    """A scale of exactly 1 (a row whose largest rotated value is 127): x.5 values sit on a tie. The row
    stored is H of the wanted rotated values (H is its own inverse; exact on these dyadic values)."""
    wanted = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.0]).repeat(d // 8)
    row = hadamard(wanted.view(1, 1, d))
    assert torch.equal(hadamard(row).view(d), wanted)
    stored = native_store(row)
    assert torch.equal(stored, quantize(row))
    assert stored[0, 0, :d].tolist() == [127, 0, 2, 2, 0, -2, -2, 3] * (d // 8)


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
