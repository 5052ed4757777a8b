"""The fused rotary writer stores a 16-bit page's values byte for byte as torch's `.to(dtype)` rounds
them, at the formats' edges too: ties to even, float16's subnormals, its largest value and what lies
past it (infinite); NaN stays NaN. Pages written by our forward and by transformers' layers (a soft reset,
a prefix hit) then hold the same bytes. Also on the portable path, where float16's rounding is worked
out in integers instead of F16C's one instruction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.attention_cases import rerun_on_lower_path
from tests.kernel_modules import fused_ops_module


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Values at each rounding boundary of `dtype`'s format, both signs, and a spread of magnitudes."""
    info = torch.finfo(dtype)
    ulp_one = info.eps  # the spacing above 1.0
    ties = [1 + ulp_one / 2, 1 + 3 * ulp_one / 2, 2 - ulp_one / 4]  # to 1 (even), up (even), a near miss
    edges = [info.max, info.max * (1 + ulp_one / 4), info.max * (1 + ulp_one / 2), 7.0e4, 1e38, 0.0]
    tiny = info.smallest_normal
    if dtype == torch.float16:  # its subnormals: the least one, ties between them, half the least
        least = tiny * ulp_one
        edges += [least, least / 2, least * 0.51, 1.5 * least, 2.5 * least, tiny - least / 2, tiny * 0.999]
    gen = torch.Generator().manual_seed(7)
    spread = torch.exp2(torch.empty(512).uniform_(-30, 18, generator=gen)) * (
        1 + torch.rand(512, generator=gen)
    )
    values = torch.cat(
        [torch.tensor(ties + edges + [float("nan"), float("inf")], dtype=torch.float64).float(), spread]
    )
    return torch.cat([values, -values])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_pages_hold_torchs_rounding(dtype: torch.dtype) -> None:
    ops = fused_ops_module()
    values = edge_values(dtype)
    heads, kv_heads, d = 1, 1, 2
    t = len(values) // d  # a token's v head: d values
    qkv = torch.zeros(t, (heads + 2 * kv_heads) * d)
    qkv[:, 2 * d :] = values.view(t, d)
    cos, sin = torch.ones(8, d), torch.zeros(8, d)
    k_cache, v_cache = (torch.zeros(t, kv_heads, d, dtype=dtype) for _ in range(2))
    slots = torch.arange(t)
    ops.rotary_store_kv_(
        qkv, heads, kv_heads, d, cos, sin, torch.zeros(t, dtype=torch.long), k_cache, v_cache, slots
    )
    nan = values.isnan()  # NaN stays NaN (its payload bits are nobody's contract)
    assert torch.equal(v_cache.view(-1).isnan(), nan)
    want, got = values.to(dtype).view(torch.int16)[~nan], v_cache.view(-1).view(torch.int16)[~nan]
    wrong = (got != want).nonzero().flatten()[:8]
    assert not len(wrong), [(values[~nan][i].item(), hex(got[i].item()), hex(want[i].item())) for i in wrong]


@pytest.mark.parametrize("path", [pytest.param("portable", marks=pytest.mark.slow)])
def test_lower_path_agrees(path: str) -> None:
    rerun_on_lower_path(Path(__file__), path)
