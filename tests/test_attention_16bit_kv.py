"""The paged attention kernels read bfloat16 and float16 K/V pools in place. Either widens to float32
exactly and all arithmetic stays float32 in the same order, so on every vector path the output equals,
bit for bit, the float32 kernel's on the upcast pool (`k_cache.float()`), and so the reference within
the float32 tests' tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.attention_cases import (
    DECODE_SHAPES,
    causal_reference,
    decode_batch,
    expected_path,
    gather_sdpa,
    prefill_batch,
    rerun_on_lower_path,
)
from tests.kernel_modules import attention_module


def test_module_names_its_vector_path() -> None:
    assert attention_module().isa() == expected_path()


POOL_DTYPES = (torch.bfloat16, torch.float16)


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
@pytest.mark.parametrize("softcap", [0.0, 20.0])
@pytest.mark.parametrize(("kv", "group", "d", "b", "length"), DECODE_SHAPES)
def test_16bit_decode_is_fp32_decode_on_the_upcast_pool(
    kv: int, group: int, d: int, b: int, length: int, softcap: float, pool_dtype: torch.dtype
) -> None:
    kernel = attention_module().paged_decode
    k_cache, v_cache, packed, rows, slots, lengths = decode_batch(
        kv, group, d, b, length, num_slots=2 * length + 300, seed=d + length
    )
    k_cache, v_cache = k_cache.to(pool_dtype), v_cache.to(pool_dtype)
    got, want = torch.full(packed.shape, 7.0), torch.full(packed.shape, 7.0)
    kernel(packed, got, rows, k_cache, v_cache, slots, lengths, d**-0.5, softcap)
    kernel(packed, want, rows, k_cache.float(), v_cache.float(), slots, lengths, d**-0.5, softcap)
    assert torch.equal(got, want)  # the other rows too: left alone (7.0) by both
    q = packed[rows].view(b, kv, group, d)
    reference = gather_sdpa(q, k_cache.float(), v_cache.float(), slots, lengths, d**-0.5, softcap)
    torch.testing.assert_close(got[rows].view(b, kv, group, d), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
@pytest.mark.parametrize(("softcap", "window"), [(0.0, 0), (20.0, 0), (0.0, 13)])
@pytest.mark.parametrize(("kv", "group", "d"), [(3, 3, 64), (2, 2, 16), (1, 5, 128), (4, 1, 32), (2, 2, 48)])
def test_16bit_prefill_is_fp32_prefill_on_the_upcast_pool(
    kv: int, group: int, d: int, softcap: float, window: int, pool_dtype: torch.dtype
) -> None:
    module = attention_module()
    if not module.prefill_supports(d):
        pytest.skip(f"no prefill kernel for head size {d} on the {module.isa()} path")
    k_cache, v_cache, (q, first_rows, num_queries, slots, lengths) = prefill_batch(
        kv, group, d, window, pool_dtype
    )
    got, want = torch.full(q.shape, 7.0), torch.full(q.shape, 7.0)
    for out, k, v in ((got, k_cache, v_cache), (want, k_cache.float(), v_cache.float())):
        module.paged_prefill(q, out, k, v, first_rows, num_queries, slots, lengths, d**-0.5, softcap, window)
    assert torch.equal(got, want)  # rows 0-1 too: left alone (7.0) by both
    for first, n, keys, s in zip(first_rows, num_queries, lengths, slots, strict=True):
        rows, keys_of = slice(first, first + n), s[:keys]
        reference = causal_reference(
            q[rows], k_cache[keys_of].float(), v_cache[keys_of].float(), d**-0.5, softcap, window
        )
        torch.testing.assert_close(got[rows], reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("k_dtype", "v_dtype", "named"),
    [
        (torch.float64, torch.float64, "got Double and Double"),
        (torch.float16, torch.bfloat16, "got Half and BFloat16"),
        (torch.float32, torch.bfloat16, "got Float and BFloat16"),
        (torch.bfloat16, torch.float32, "got BFloat16 and Float"),
    ],
)
def test_other_pool_dtypes_are_refused(k_dtype: torch.dtype, v_dtype: torch.dtype, named: str) -> None:
    module = attention_module()
    k_cache, v_cache, (q, first_rows, num_queries, slots, lengths) = prefill_batch(2, 2, 32, 0, torch.float32)
    k_cache, v_cache = k_cache.to(k_dtype), v_cache.to(v_dtype)
    out = torch.zeros(q.shape)
    with pytest.raises(RuntimeError, match=named):
        module.paged_decode(q, out, first_rows, k_cache, v_cache, slots, lengths, 0.1, 0.0)
    if module.prefill_supports(32):
        with pytest.raises(RuntimeError, match=named):
            module.paged_prefill(
                q, out, k_cache, v_cache, first_rows, num_queries, slots, lengths, 0.1, 0.0, 0
            )
    assert not out.any()


# Every test above, again on each vector path below this CPU's best (a build of its own, cached in
# $CBSERVE_HOME like any other, so only a first run compiles it). The portable path's compile and
# scalar loops (its prefill runs each query token as a decode row) are left to the slow run.
@pytest.mark.parametrize("path", ["avx2", pytest.param("portable", marks=pytest.mark.slow)])
def test_lower_path_agrees(path: str) -> None:
    rerun_on_lower_path(Path(__file__), path)
