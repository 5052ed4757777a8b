"""int8 weights in the packed panel linears (csrc/panel_linear.cpp), on every vector path.

The reference is computed from the same quantized operands the kernel multiplies: the module's own
`quantize_int8` rounds W's rows (output channels) and x's rows (tokens), itself checked against torch's
rounding. The kernel's integer sums must then be exact, so the only rounding left is the fp32
epilogue: float(sum) * sw * sx, plus the bias, four fp32 roundings (a sum beyond 2^24 converts with
one of them), so each output may differ from the float64 reference by at most 5 u (|sum sw sx| + |b|)
with u = 2^-24. One product off by one in a sum (a mis-paired k, a column's offset short) is off by
far more than that: a relative 1/|sum| of the output, and |sum| stays below 127^2 K.

Weight-only int8 (`int8_x=False`) multiplies x unrounded: its sums are fp32 sums of K products
x_k q_k (each |q_k| <= 127), within (K + 3) u sum |x_k q_k sw| + u |b| of float64's.

The lower paths (AVX-512 without VNNI, AVX2, portable) are compiled with CBSERVE_CPU_ISA in a
subprocess each, which runs the same checks and asserts that the module names its path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from services.common.precision import cpu_flags
from services.worker import kernels
from tests.stack import REPO
from tests.test_panel_linear_bf16 import module

U = 2.0**-24
# Rows: none, one tile (1, 5, the tallest AVX-512 tile 14), uneven splits into several (15, 38, 600).
ROWS = [0, 1, 5, 14, 15, 38, 600]
# (K, N): K short of a multiple of 4 by 3, 1 and 2 (33, 575, 577 pad the last lane), whole (64, 96);
# N a partial last panel (17; 200 = 6 x 32 + 8 or 12 x 16 + 8) and whole ones (64).
SHAPES = [(33, 17), (64, 64), (96, 200), (575, 200), (577, 64)]
# (K, I) of gated products: a partial last gated panel (100 = 6 x 16 + 4 or 12 x 8 + 4, 17), whole (64).
GATED_SHAPES = [(33, 17), (64, 64), (577, 100)]


def native_int8_path() -> str:
    """The int8 path `-march=native` compiles on this CPU."""
    flags = cpu_flags()
    if "avx512f" in flags:
        return "avx512-vnni" if "avx512_vnni" in flags else "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx-vnni" if "avx_vnni" in flags else "avx2"
    return "portable"


def quantized(ops: Any, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """t's rows as the kernel rounds them, in float64: (q, scale [rows, 1])."""
    q, scale = ops.quantize_int8(t.contiguous())
    return q.double(), scale.double().unsqueeze(1)


def reference(
    ops: Any, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, int8_x: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The product of the quantized operands in float64, and the bound of the module docstring."""
    qw, sw = quantized(ops, w)
    if int8_x:
        qx, sx = quantized(ops, x)
        product = (qx @ qw.T) * sx * sw.T
        bound = 5 * U * product.abs()
    else:
        xd = x.double()
        product = (xd @ qw.T) * sw.T
        bound = (x.shape[-1] + 3) * U * (xd.abs() @ qw.abs().T) * sw.T
    if bias is not None:
        product = product + bias.double()
        bound = bound + 5 * U * bias.double().abs()
    return product, bound


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape
    excess = (got.double() - want).abs() - bound
    assert excess.numel() == 0 or excess.max() <= 0, f"off by up to {excess.max():.3g} beyond the bound"


def check_quantize(ops: Any) -> None:
    """Each row: q = round(x * (127 / max|x|)) to nearest even, scale = max|x| * fp32(1/127); a zero row
    has scale 0. Exactly torch's arithmetic in float32."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(40, 577, generator=gen) * torch.logspace(-3, 3, 40).unsqueeze(1)
    x[7] = 0
    x[9, 5] = 0.5 * x[9].abs().max() / 127  # about half a step: rounds as torch rounds it
    q, scale = ops.quantize_int8(x)
    amax = x.abs().amax(1, keepdim=True)
    want = torch.where(amax > 0, torch.round(x * (127 / amax)), 0).to(torch.int8)
    assert q.dtype == torch.int8 and torch.equal(q, want)
    assert torch.equal(scale, (amax * torch.tensor(1 / 127, dtype=torch.float32)).squeeze(1))
    assert q[7].abs().sum() == 0 and scale[7] == 0


def check_linear(ops: Any, rows: int, k: int, n: int, bias: bool, int8_x: bool = True) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    w = torch.randn(n, k, generator=gen)
    w[n // 2] = 0  # a column of zeros: scale 0
    b = torch.randn(n, generator=gen) if bias else None
    packed = ops.pack_weight_int8(w)
    assert packed.dtype == torch.int8 and packed.shape[1] == (k + 3) // 4 + 2
    x = torch.randn(rows, k, generator=gen) * 3
    if rows > 1:
        x[1] = 0  # a row of zeros: scale 0, only the bias (the offsets must cancel exactly)
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
    check_quantize(ops)
    check_packing(ops)
    for rows in ROWS:
        for k, n in SHAPES:
            for bias in (False, True):
                check_linear(ops, rows, k, n, bias)
            check_linear(ops, rows, k, n, True, int8_x=False)
        for k, width in GATED_SHAPES:
            check_gated(ops, rows, k, width)
            check_gated(ops, rows, k, width, int8_x=False)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_panels_sum_the_quantized_products_exactly(rows: int, k: int, n: int, bias: bool) -> None:
    check_linear(module(), rows, k, n, bias)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_weight_only_int8_panels_multiply_x_unrounded(rows: int, k: int, n: int) -> None:
    check_linear(module(), rows, k, n, True, int8_x=False)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "width"), GATED_SHAPES)
@pytest.mark.parametrize("int8_x", [True, False])
def test_int8_gated_panels_are_silu_of_gate_times_up(rows: int, k: int, width: int, int8_x: bool) -> None:
    check_gated(module(), rows, k, width, int8_x)


def test_rows_and_columns_round_as_torch_rounds_them() -> None:
    check_quantize(module())


def test_bf16_weights_and_gated_panels_pack_as_their_values() -> None:
    check_packing(module())


def test_the_module_names_the_int8_path_this_cpu_compiles() -> None:
    if os.environ.get(kernels.ISA_SWITCH, "native") not in ("", "native"):
        pytest.skip(f"{kernels.ISA_SWITCH} holds this run to a lower path")
    assert module().int8_path() == native_int8_path()
    assert kernels.int8_path() == native_int8_path()  # what the worker's start-up log names
    from tests.test_attention import built

    for int8_x in (True, False):
        ops = built(kernels.packed_linear_ops(torch.int8, int8_x), "panel linears")
        assert (ops.dtype, ops.int8_x) == (torch.int8, int8_x)
        assert ops.torch_from_rows == kernels.gemm_crossover.NEVER  # no many-row copy: panels at every size
        w, x = torch.randn(40, 33), torch.randn(3, 33)
        assert torch.equal(ops.pack_weight(w), module().pack_weight_int8(w))
        assert torch.equal(ops.pack_weight_gated(w), module().pack_weight_gated_int8(w))
        want = module().panel_linear(x, ops.pack_weight(w), None, 40, int8_x)
        assert torch.equal(ops.packed_linear(x, ops.pack_weight(w), None, 40), want)


def test_bad_inputs_name_the_offending_value() -> None:
    ops = module()
    w = torch.randn(40, 33)
    packed = ops.pack_weight_int8(w)
    with pytest.raises(RuntimeError, match="x has 37 features, the weight 33 to 36"):
        ops.panel_linear(torch.randn(3, 37), packed, None, 40)
    with pytest.raises(RuntimeError, match="x must be float32, got BFloat16"):
        ops.panel_linear(torch.randn(3, 33).bfloat16(), packed, None, 40)
    with pytest.raises(RuntimeError, match=r"panels must come from pack_weight_int8, got \[2, 11, 64\]"):
        ops.panel_linear(torch.randn(3, 33), packed[:, :, :64].contiguous(), None, 40)
    with pytest.raises(RuntimeError, match=r"float32 or bfloat16 \[N, K\] weight only, got \[40, 33\] Half"):
        ops.pack_weight_int8(w.half())
    with pytest.raises(RuntimeError, match=r"\[2I, K\] weight only, got \[41, 33\]"):
        ops.pack_weight_gated_int8(torch.randn(41, 33))
    with pytest.raises(ValueError, match=r"float32, bfloat16 or int8 weights, not torch\.float16"):
        kernels.packed_linear_ops(torch.float16)


def run_lower_path(isa: str, int8_path: str) -> None:
    """In a subprocess with CBSERVE_CPU_ISA=isa: every check above on that path's build (cached under
    this run's CBSERVE_HOME beside the native one, so only a first run compiles it)."""
    env = {**os.environ, kernels.ISA_SWITCH: isa}
    script = (
        "from tests.test_panel_linear_int8 import check_every_case, module\n"
        f"ops = module(); assert (ops.isa(), ops.int8_path()) == ({isa!r}, {int8_path!r}), ops.int8_path()\n"
        "check_every_case(ops); print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.stdout.strip().endswith("ok"), (done.stdout[-2000:], done.stderr[-4000:])


def test_avx2_path_computes_the_same_sums() -> None:
    """AVX2 without AVX-512: vpdpbusd on AVX-VNNI where the CPU has it, else the widened vpmaddwd."""
    if not kernels.compiler_available():
        pytest.skip("no C++ toolchain here")
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("this CPU has no AVX2")
    run_lower_path("avx2", "avx-vnni" if "avx_vnni" in cpu_flags() else "avx2")


@pytest.mark.slow  # a second compile of the AVX-512 paths (its bf16 panels' test compiles it too)
def test_avx512_without_vnni_computes_the_same_sums() -> None:
    if not kernels.compiler_available():
        pytest.skip("no C++ toolchain here")
    if "avx512f" not in cpu_flags():
        pytest.skip("this CPU has no AVX-512")
    run_lower_path("avx512", "avx512")


@pytest.mark.slow  # a third compile, and scalar loops
def test_portable_path_computes_the_same_sums() -> None:
    if not kernels.compiler_available():
        pytest.skip("no C++ toolchain here")
    run_lower_path("portable", "portable")
