"""The checks of int8 weights in the packed panel linears (csrc/panel_linear.cpp), shared by
tests/test_panel_linear_int8.py and the child runs it starts on lower vector paths.

The panels' format: W's rows (output columns) are rounded to int8 in groups of G consecutive k (the
module's `int8_group()`, the last group shorter where G does not divide K), each (column, group) on a
scale of its own, and with `int8_x` x's rows are rounded in the same groups, each (row, group) on its
own scale. Before rounding, each whole group of both is rotated by the orthonormal Walsh-Hadamard matrix
(the module's `rotate_int8`, checked against torch's same float32 steps), which leaves the products'
sums as they were. The reference is computed from the same quantized operands the kernel multiplies: the
module's own `quantize_int8` rounds both, itself checked against torch's rounding. Each group's integer
sum S_g must then be exact (|S_g| <= 127^2 G < 2^24 converts to fp32 exactly), so the only rounding left
is the fp32 epilogue: y = sum over the NG groups of S_g sw_g sx_g, plus the bias. Each term takes two
roundings (its two scales), the NG terms' sum NG more and the bias one, so each output may differ from
the float64 reference by at most (NG + 4) u sum_g |S_g sw_g sx_g| + 5 u |b| with u = 2^-24 (one u spare
for the second-order terms). One product off in a group (a mis-paired k, a group's offset short) moves
its output by at least a product of two int8 values times its scales, hundreds of times that bound on
these random operands.

Weight-only int8 (`int8_x=False`) multiplies x rotated, unrounded, by each weight times its group's
scale (one rounding): its sums are fp32 sums of K products, within (K + 3) u sum_k |x_k q_k sw_k| + 5 u
|b| of float64's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from tests.panel_linear_bf16_checks import U, assert_within  # fp32's unit roundoff; the bound check

# Rows: none, one tile (1, 5, the tallest AVX-512 tile 14), uneven splits into several (15, 38, 600).
ROWS = [0, 1, 5, 14, 15, 38, 600]
# (K, N): K short of a multiple of 4 by 3, 1 and 2 (33, 575, 577 pad the last lane), whole (64, 96);
# whole groups and a shorter last one (at G = 32: 33 = 32 + 1, 64, 96, 575 = 17 x 32 + 31, 577 =
# 18 x 32 + 1); N a partial last panel (17; 200 = 6 x 32 + 8 or 12 x 16 + 8) and whole ones (64).
SHAPES = [(33, 17), (64, 64), (96, 200), (575, 200), (577, 64)]
# (K, I) of gated products: a partial last gated panel (100 = 6 x 16 + 4 or 12 x 8 + 4, 17), whole (64).
GATED_SHAPES = [(33, 17), (64, 64), (577, 100)]


def rotated(ops: Any, x: torch.Tensor) -> torch.Tensor:
    """x's rows [M, K] float32 with each whole group of G k times the orthonormal Walsh-Hadamard matrix,
    in the kernel's float32 operations: butterflies (a, b) -> (a + b, a - b) at strides 1, 2, .., G / 2,
    then one multiply by fp32(1 / sqrt(G)); a shorter last group as it is."""
    g, k = ops.int8_group(), x.shape[-1]
    whole = k // g * g
    v = x[:, :whole].reshape(x.shape[0], whole // g, g).clone()
    h = 1
    while h < g:
        pairs = v.view(*v.shape[:-1], g // (2 * h), 2, h)
        a, b = pairs[..., 0, :].clone(), pairs[..., 1, :].clone()
        pairs[..., 0, :], pairs[..., 1, :] = a + b, a - b
        h *= 2
    v = v * torch.tensor(1 / g**0.5, dtype=torch.float32)
    return torch.cat([v.reshape(x.shape[0], whole), x[:, whole:]], dim=1)


def quantized(ops: Any, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t's rows as the kernel rounds them, in float64: (q [rows, K], scales [rows, NG] of the groups)."""
    q, scale = ops.quantize_int8(t.contiguous())
    groups = -(-t.shape[-1] // ops.int8_group())
    assert scale.shape == (t.shape[0], groups) and scale.dtype == torch.float32
    return q.double(), scale.double()


def group_slices(ops: Any, k: int) -> list[slice]:
    g = ops.int8_group()
    return [slice(k0, min(k0 + g, k)) for k0 in range(0, k, g)]


def reference(
    ops: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, int8_x: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The product of the quantized operands in float64, and the bound of the module docstring."""
    qw, sw = quantized(ops, w)
    groups = group_slices(ops, x.shape[-1])
    if int8_x:
        qx, sx = quantized(ops, x)
        terms = [(qx[:, k] @ qw[:, k].T) * sx[:, g : g + 1] * sw[:, g] for g, k in enumerate(groups)]
        product = sum(terms, torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64))
        bound = (len(groups) + 4) * U * sum((t.abs() for t in terms), torch.zeros_like(product))
    else:  # x rotated as the weights were, unrounded
        xd = rotated(ops, x).double()
        scaled = torch.cat([qw[:, k] * sw[:, g : g + 1] for g, k in enumerate(groups)], dim=1)  # q_k sw_k
        product = xd @ scaled.T
        bound = (x.shape[-1] + 3) * U * (xd.abs() @ scaled.abs().T)
    if bias is not None:
        product = product + bias.double()
        bound = bound + 5 * U * bias.double().abs()
    return product, bound


def check_rotation(ops: Any) -> None:
    """The kernel rotates rows exactly as `rotated` does; the rotation is orthonormal and its own
    inverse (up to the float32 roundings of its steps); a shorter last group is left alone."""
    gen = torch.Generator().manual_seed(5)
    g, k = ops.int8_group(), 3 * ops.int8_group() + 7
    x = torch.randn(9, k, generator=gen) * torch.logspace(-3, 3, 9).unsqueeze(1)
    x[4, 3] = 1e4  # one outlier: rotated, its group's values are all about 1e4 / sqrt(G)
    got = ops.rotate_int8(x)
    assert torch.equal(got, rotated(ops, x))
    assert torch.equal(got[:, 3 * g :], x[:, 3 * g :])
    assert torch.allclose(
        ops.rotate_int8(got), x, rtol=1e-5, atol=1e-5 * x.abs().amax(1, keepdim=True).max().item()
    )
    assert torch.allclose(got.norm(dim=1), x.norm(dim=1), rtol=1e-5)
    assert got[4, :g].abs().min() > 0.5 * 1e4 / g**0.5


def check_quantize(ops: Any) -> None:
    """Each group of G k of a row (the last one shorter), rotated (`rotated`): q = round(x * (127 /
    max|x|)) to nearest even, scale = max|x| * fp32(1/127) over the group; a group of zeros has scale
    0. Exactly torch's arithmetic in float32."""
    gen = torch.Generator().manual_seed(3)
    g, k = ops.int8_group(), 577
    x = torch.randn(40, k, generator=gen) * torch.logspace(-3, 3, 40).unsqueeze(1)
    x[7] = 0
    x[8, g : 2 * g] = 0  # one group of zeros in a row of others
    x[10, -1] = 1e6  # the short last group's own scale
    q, scale = ops.quantize_int8(x)
    groups = -(-k // g)
    padded = torch.zeros(40, groups * g)
    padded[:, :k] = rotated(ops, x)
    amax = padded.view(40, groups, g).abs().amax(-1, keepdim=True)
    want = torch.where(amax > 0, torch.round(padded.view(40, groups, g) * (127 / amax)), 0)
    want = want.view(40, groups * g)[:, :k].to(torch.int8)
    assert q.dtype == torch.int8 and torch.equal(q, want)
    assert torch.equal(scale, (amax * torch.tensor(1 / 127, dtype=torch.float32)).squeeze(-1))
    assert q[7].abs().sum() == 0 and scale[7].abs().sum() == 0
    assert scale[8, 1] == 0 and scale[8, 0] > 0 and q[8, g : 2 * g].abs().sum() == 0
    assert q[10, -1] == 127 and scale[10, -1] == torch.tensor(1e6) * torch.tensor(1 / 127)


def check_layout(ops: Any) -> None:
    """The panels as the kernel's top comment describes them: per group of G k, its lines of four k
    per column lane, then its line of the columns' fp32 scales, then its line of -128 * the columns'
    int32 weight sums over the group; the last panel's missing columns zero."""
    k, n = 2 * ops.int8_group() + 5, 40
    w = torch.randn(n, k)
    packed = ops.pack_weight_int8(w)
    q, scale = ops.quantize_int8(w)
    panel = packed.shape[2] // 4  # columns per panel
    p = -(-n // panel)
    cols = torch.zeros(p * panel, k, dtype=torch.int8)
    cols[:n] = q
    scales = torch.zeros(p * panel, scale.shape[1])
    scales[:n] = scale
    line = 0
    for gi, ks in enumerate(group_slices(ops, k)):
        lines = -(-(ks.stop - ks.start) // 4)
        want = torch.zeros(p, panel, 4 * lines, dtype=torch.int8)
        want[:, :, : ks.stop - ks.start] = cols[:, ks].view(p, panel, -1)
        got = packed[:, line : line + lines].view(p, lines, panel, 4).permute(0, 2, 1, 3)
        assert torch.equal(got.reshape(p, panel, -1), want)
        line += lines
        assert torch.equal(packed[:, line].contiguous().view(torch.float32), scales[:, gi].view(p, panel))
        sums = -128 * cols[:, ks].int().sum(1).view(p, panel)
        assert torch.equal(packed[:, line + 1].contiguous().view(torch.int32), sums)
        line += 2
    assert line == packed.shape[1]


def check_linear(ops: Any, rows: int, k: int, n: int, bias: bool, int8_x: bool = True) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    w = torch.randn(n, k, generator=gen)
    w[n // 2] = 0  # a column of zeros: scale 0
    w[n - 1, : ops.int8_group()] = 0  # a column's first group of zeros
    b = torch.randn(n, generator=gen) if bias else None
    packed = ops.pack_weight_int8(w)
    groups = len(group_slices(ops, k))
    assert packed.dtype == torch.int8 and packed.shape[1] == (k + 3) // 4 + 2 * groups
    x = torch.randn(rows, k, generator=gen) * 3
    if rows > 1:
        x[1] = 0  # a row of zeros: scale 0, only the bias (the offsets must cancel exactly)
    if rows > 2:
        x[2, : ops.int8_group()] = 0  # a row's first group of zeros
    want, bound = reference(ops, x, w, b, int8_x)
    got = ops.panel_linear(x, packed, b, n, int8_x)
    assert_within(got, want, bound)
    if rows > 1:
        assert torch.equal(got[1], b if b is not None else torch.zeros(n))
    # Rows with a stride (a slice of a wider activation), and the engine's leading batch axis.
    wide = torch.randn(rows, k + 7, generator=gen)[:, 3 : 3 + k]
    want, bound = reference(ops, wide, w, b, int8_x)
    assert_within(ops.panel_linear(wide, packed, b, n, int8_x), want, bound)
    got = ops.panel_linear(wide.unsqueeze(0), packed, b, n, int8_x)
    assert_within(got, want.unsqueeze(0), bound.unsqueeze(0))


def check_gated(ops: Any, rows: int, k: int, width: int, int8_x: bool = True) -> None:
    """silu(gate) * up, gate and up each within the bound above (dg, du); then as the bf16 panels'
    test bounds it: 1.1 dg |up| + |silu(gate)| du + dg du, plus 16 u |out| for the activation."""
    gen = torch.Generator().manual_seed(rows * 1000 + k + width)
    w = torch.randn(2 * width, k, generator=gen)
    packed = ops.pack_weight_gated_int8(w)
    x = torch.randn(rows, k + 5, generator=gen)[:, 2 : 2 + k]  # strided rows
    want, bound = reference(ops, x, w, None, int8_x)
    (gate, up), (dg, du) = want.chunk(2, dim=-1), bound.chunk(2, dim=-1)
    out = F.silu(gate) * up
    tolerance = 1.1 * dg * up.abs() + F.silu(gate).abs() * du + dg * du + 16 * U * out.abs()
    assert_within(ops.panel_linear_gated(x, packed, width, int8_x), out, tolerance)


def check_packing(ops: Any) -> None:
    """Panels of bf16 weights are those of their values; the gated panels hold the gate's and the up's
    columns as two plain products do."""
    w = torch.randn(70, 33)
    assert torch.equal(ops.pack_weight_int8(w.bfloat16()), ops.pack_weight_int8(w.bfloat16().float()))
    x = torch.randn(9, 33)
    gate, up = (ops.panel_linear(x, ops.pack_weight_int8(half), None, 35) for half in w.chunk(2))
    got = ops.panel_linear_gated(x, ops.pack_weight_gated_int8(w), 35)
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=16 * U, atol=0)  # the activation's rounding


def check_every_case(ops: Any) -> None:
    check_rotation(ops)
    check_quantize(ops)
    check_layout(ops)
    check_packing(ops)
    for rows in ROWS:
        for k, n in SHAPES:
            for bias in (False, True):
                check_linear(ops, rows, k, n, bias)
            check_linear(ops, rows, k, n, True, int8_x=False)
        for k, width in GATED_SHAPES:
            check_gated(ops, rows, k, width)
            check_gated(ops, rows, k, width, int8_x=False)
