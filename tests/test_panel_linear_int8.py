"""int8 weights in the packed panel linears (csrc/panel_linear.cpp), on every vector path.

The checks and their tolerance are in tests/panel_linear_int8_checks.py. The lower paths (AVX-512
without VNNI, AVX2, portable) are compiled with CBSERVE_CPU_ISA in a subprocess each, which runs the
same checks and asserts that the module names its path.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from services.common.precision import cpu_flags
from services.worker import kernels
from tests.kernel_modules import built, panel_linear_module
from tests.panel_linear_int8_checks import (
    GATED_SHAPES,
    ROWS,
    SHAPES,
    check_gated,
    check_layout,
    check_linear,
    check_packing,
    check_quantize,
    check_rotation,
)
from tests.stack import REPO


def native_int8_path() -> str:
    """The int8 path `-march=native` compiles on this CPU."""
    flags = cpu_flags()
    if "avx512f" in flags:
        return "avx512-vnni" if "avx512_vnni" in flags else "avx512"
    if {"avx2", "fma"} <= flags:
        return "avx-vnni" if "avx_vnni" in flags else "avx2"
    return "portable"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_panels_sum_the_quantized_products_exactly(rows: int, k: int, n: int, bias: bool) -> None:
    check_linear(panel_linear_module(), rows, k, n, bias)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_weight_only_int8_panels_multiply_x_unrounded(rows: int, k: int, n: int) -> None:
    check_linear(panel_linear_module(), rows, k, n, True, int8_x=False)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "width"), GATED_SHAPES)
@pytest.mark.parametrize("int8_x", [True, False])
def test_int8_gated_panels_are_silu_of_gate_times_up(rows: int, k: int, width: int, int8_x: bool) -> None:
    check_gated(panel_linear_module(), rows, k, width, int8_x)


def test_rows_and_columns_rotate_as_torch_rotates_them() -> None:
    check_rotation(panel_linear_module())


def test_rows_and_columns_round_as_torch_rounds_them() -> None:
    check_quantize(panel_linear_module())


def test_panels_hold_each_groups_weights_then_its_scales_and_offsets() -> None:
    check_layout(panel_linear_module())


def test_bf16_weights_and_gated_panels_pack_as_their_values() -> None:
    check_packing(panel_linear_module())


def test_the_module_names_the_int8_path_this_cpu_compiles() -> None:
    if os.environ.get(kernels.ISA_SWITCH, "native") not in ("", "native"):
        pytest.skip(f"{kernels.ISA_SWITCH} holds this run to a lower path")
    assert panel_linear_module().int8_path() == native_int8_path()
    assert kernels.int8_path() == native_int8_path()  # what the worker's start-up log names
    for int8_x in (True, False):
        ops = built(kernels.packed_linear_ops(torch.int8, int8_x), "panel linears")
        assert (ops.dtype, ops.int8_x) == (torch.int8, int8_x)
        assert ops.torch_from_rows == kernels.gemm_crossover.NEVER  # no many-row copy: panels at every size
        w, x = torch.randn(40, 33), torch.randn(3, 33)
        assert torch.equal(ops.pack_weight(w), panel_linear_module().pack_weight_int8(w))
        assert torch.equal(ops.pack_weight_gated(w), panel_linear_module().pack_weight_gated_int8(w))
        want = panel_linear_module().panel_linear(x, ops.pack_weight(w), None, 40, int8_x)
        assert torch.equal(ops.packed_linear(x, ops.pack_weight(w), None, 40), want)


def test_bad_inputs_name_the_offending_value() -> None:
    ops = panel_linear_module()
    w = torch.randn(40, 33)
    packed = ops.pack_weight_int8(w)
    with pytest.raises(RuntimeError, match="x has 37 features, the weight 33 to 36"):
        ops.panel_linear(torch.randn(3, 37), packed, None, 40)
    with pytest.raises(RuntimeError, match="x must be float32, got BFloat16"):
        ops.panel_linear(torch.randn(3, 33).bfloat16(), packed, None, 40)
    not_int8 = "panels must come from pack_weight_int8, got"
    # The panels' width follows the vector path (32 columns with AVX-512, 16 with AVX2).
    panels, lines, width = packed.shape
    with pytest.raises(RuntimeError, match=rf"{not_int8} \[{panels}, {lines}, {width // 2}\]"):
        ops.panel_linear(torch.randn(3, 33), packed[:, :, : width // 2].contiguous(), None, 40)
    group = ops.int8_group() // 4 + 2  # a group's lines; a panel that ends with a group of no weights:
    short = torch.zeros(panels, group + 2, width, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=rf"{not_int8} \[{panels}, {group + 2}, {width}\]"):
        ops.panel_linear(torch.randn(3, 33), short, None, 40)
    with pytest.raises(RuntimeError, match=r"float32 or bfloat16 \[N, K\] weight only, got \[40, 33\] Half"):
        ops.pack_weight_int8(w.half())
    with pytest.raises(RuntimeError, match=r"\[2I, K\] weight only, got \[41, 33\]"):
        ops.pack_weight_gated_int8(torch.randn(41, 33))
    with pytest.raises(ValueError, match=r"float32, bfloat16 or int8 weights, not torch\.float16"):
        kernels.packed_linear_ops(torch.float16)


def run_lower_path(isa: str, int8_path: str) -> None:
    """In a subprocess with CBSERVE_CPU_ISA=isa: every check (check_every_case) on that path's build
    (cached under this run's CBSERVE_HOME beside the native one, so only a first run compiles it)."""
    env = {**os.environ, kernels.ISA_SWITCH: isa}
    script = (
        "from tests.kernel_modules import panel_linear_module\n"
        "from tests.panel_linear_int8_checks import check_every_case\n"
        "ops = panel_linear_module()\n"
        f"assert (ops.isa(), ops.int8_path()) == ({isa!r}, {int8_path!r}), ops.int8_path()\n"
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
    if "avx512f" not in cpu_flags():
        pytest.skip("avx2 is this CPU's best path: the tests above ran it")
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
