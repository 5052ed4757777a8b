"""The checks of bf16 weights in the packed panel linears (csrc/panel_linear.cpp), shared by
tests/test_panel_linear_bf16.py and the child runs it starts on lower vector paths: the product is
bf16(x) . bf16(W)^T summed in fp32, checked against float64 sums of the same bf16 values.

Tolerance: a product of two bf16 values has at most 16 significant bits, so it is exact in fp32; the
only rounding is in the fp32 sums. A sum of n terms (K products, plus the bias) added one at a time
in fp32, in any order and grouping, is off by at most gamma_(n-1) * sum |term| with gamma_m =
m u / (1 - m u), u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 3.1), and
(K + 1) u >= gamma_K for every K up to 4096. So each output may differ from the float64 reference by
at most (K + 1) * 2^-24 * (sum_k |x_k w_k| + |b|), nothing looser. A wrong pairing of k, a wrong
rounding of x or W (off by 2^-9 relative), or a wrong column are orders of magnitude beyond it.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

U = 2.0**-24  # fp32's unit roundoff
# Rows: none, one tile (1, 5, the tallest AVX-512 tile 14), uneven splits into several (15, 38, 600).
ROWS = [0, 1, 5, 14, 15, 38, 600]
# (K, N): odd K (33, 577: the last weight pairs with a zero), even K (64, 96); N a partial last panel
# (17; 200 = 6 x 32 + 8 or 12 x 16 + 8) and whole ones (64).
SHAPES = [(33, 17), (64, 64), (96, 200), (577, 200)]
# (K, I) of gated products: a partial last gated panel (100 = 6 x 16 + 4 or 12 x 8 + 4, 17), whole (64).
GATED_SHAPES = [(33, 17), (64, 64), (577, 100)]


def reference(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16(x) . bf16(W)^T + bias in float64, and the bound on fp32 summation's error (module docstring)."""
    xb, wb = x.bfloat16().double(), w.bfloat16().double()
    want, magnitude = xb @ wb.T, xb.abs() @ wb.abs().T
    if bias is not None:
        want, magnitude = want + bias.double(), magnitude + bias.double().abs()
    return want, (x.shape[-1] + 1) * U * magnitude


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    excess = (got.double() - want).abs() - bound
    assert excess.numel() == 0 or excess.max() <= 0, f"off by up to {excess.max():.3g} beyond the bound"


def check_linear(ops: Any, rows: int, k: int, n: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    packed = ops.pack_weight_bf16(w)
    assert packed.dtype == torch.bfloat16 and packed.shape[1] == (k + 1) // 2
    assert torch.equal(ops.pack_weight_bf16(w.bfloat16()), packed)  # bf16 weights pack as their values
    x = torch.randn(rows, k, generator=gen) * 3
    want, bound = reference(x, w, b)
    assert_within(ops.panel_linear(x, packed, b, n), want, bound)
    # Rows with a stride (a slice of a wider activation), and the engine's leading batch axis.
    wide = torch.randn(rows, k + 7, generator=gen)[:, 3 : 3 + k]
    want, bound = reference(wide, w, b)
    assert_within(ops.panel_linear(wide, packed, b, n), want, bound)
    assert_within(ops.panel_linear(wide.unsqueeze(0), packed, b, n), want.unsqueeze(0), bound.unsqueeze(0))


def check_gated(ops: Any, rows: int, k: int, width: int) -> None:
    """silu(gate) * up, each of gate and up within the bound above (dg, du); then, first order,
    |d out| <= max|silu'| dg |up| + |silu(gate)| du + dg du, max|silu'| < 1.1, plus the fp32
    activation itself: e^x to a few ulp (vec_exp.h) and five roundings, 16 u of |out| in all."""
    gen = torch.Generator().manual_seed(rows * 1000 + k + width)
    w = torch.randn(2 * width, k, generator=gen)
    packed = ops.pack_weight_gated_bf16(w)
    assert torch.equal(ops.pack_weight_gated_bf16(w.bfloat16()), packed)
    x = torch.randn(rows, k + 5, generator=gen)[:, 2 : 2 + k]  # strided rows
    want, bound = reference(x, w, None)
    (gate, up), (dg, du) = want.chunk(2, dim=-1), bound.chunk(2, dim=-1)
    out = F.silu(gate) * up
    tolerance = 1.1 * dg * up.abs() + F.silu(gate).abs() * du + dg * du + 16 * U * out.abs()
    assert_within(ops.panel_linear_gated(x, packed, width), out, tolerance)


def check_x_rounds_like_torch(ops: Any) -> None:
    """Through the identity (exact: one product of 1, the rest zeros) y is bf16(x) itself: ties round
    to even both ways, on the vector blocks and on the scalar columns after them."""
    k = 37  # two 16-pair blocks of the AVX512-BF16 pack, then scalar pairs; odd
    halfway = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1 + 2**-8 + 2**-20, 3.0e38, 0.1, -0.0])
    x = torch.randn(15, k, generator=torch.Generator().manual_seed(1))
    x.view(-1)[: halfway.numel() * 40 : 40] = halfway  # in the blocks, on several rows
    x[:, -halfway.numel() :] = halfway  # in the scalar columns
    got = ops.panel_linear(x, ops.pack_weight_bf16(torch.eye(k)), None, k)
    assert torch.equal(got, x.bfloat16().float())


def check_few_rows_alone_get_their_bits(ops: Any) -> None:
    """Rows' outputs are the same bits alone (one to six rows, a decode step of a few requests) as
    among other rows, on bf16 and float32 panels: on AVX2 up to three rows run several panels at a time,
    and four to six as two tiles taking turns over chunks of the panels' lines (100 k: the last chunk
    short), and the engine's tokens must not change with the batch around them."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 100, generator=gen)
    packs = ((ops.pack_weight_bf16, ops.pack_weight_gated_bf16), (ops.pack_weight, ops.pack_weight_gated))
    for (pack, pack_gated), n in itertools.product(packs, (17, 48, 200)):  # odd, even and partial panels
        w, b, w2 = (torch.randn(shape, generator=gen) for shape in ((n, 100), (n,), (2 * n, 100)))
        packed, gated = pack(w), pack_gated(w2)
        together = ops.panel_linear(x, packed, b, n), ops.panel_linear_gated(x, gated, n)
        for rows in range(1, 7):
            for r in range(x.shape[0] - rows + 1):
                few, where = x[r : r + rows], (n, r, rows)
                assert torch.equal(ops.panel_linear(few, packed, b, n), together[0][r : r + rows]), where
                assert torch.equal(ops.panel_linear_gated(few, gated, n), together[1][r : r + rows]), where


def check_every_case(ops: Any) -> None:
    for rows in ROWS:
        for k, n in SHAPES:
            for bias in (False, True):
                check_linear(ops, rows, k, n, bias)
        for k, width in GATED_SHAPES:
            check_gated(ops, rows, k, width)
    check_x_rounds_like_torch(ops)
    check_few_rows_alone_get_their_bits(ops)
