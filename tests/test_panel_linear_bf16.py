"""bf16 weights in the packed panel linears (csrc/panel_linear.cpp): on every vector path the product
is bf16(x) . bf16(W)^T summed in fp32, checked against float64 sums of the same bf16 values.

The checks and their tolerance are in tests/panel_linear_bf16_checks.py. The lower paths (AVX-512
without BF16, AVX2, portable) are compiled with CBSERVE_CPU_ISA in a subprocess each, which runs the
same checks and asserts that the module names its path.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from services.worker import kernels
from tests.kernel_modules import built, panel_linear_module
from tests.panel_linear_bf16_checks import (
    GATED_SHAPES,
    ROWS,
    SHAPES,
    check_few_rows_alone_get_their_bits,
    check_gated,
    check_linear,
    check_x_rounds_like_torch,
)
from tests.stack import REPO


def expected_isa() -> str:
    """The path `-march=native` compiles on this CPU."""
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    if {"avx512f", "avx512_bf16"} <= flags:
        return "avx512-bf16"
    if "avx512f" in flags:
        return "avx512"
    return "avx2" if {"avx2", "fma"} <= flags else "portable"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "n"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_panels_match_the_bf16_product(rows: int, k: int, n: int, bias: bool) -> None:
    check_linear(panel_linear_module(), rows, k, n, bias)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("k", "width"), GATED_SHAPES)
def test_bf16_gated_panels_are_silu_of_gate_times_up(rows: int, k: int, width: int) -> None:
    check_gated(panel_linear_module(), rows, k, width)


def test_x_is_rounded_to_bf16_as_torch_rounds_it() -> None:
    check_x_rounds_like_torch(panel_linear_module())


def test_few_rows_alone_get_their_bits() -> None:
    check_few_rows_alone_get_their_bits(panel_linear_module())


def test_the_module_names_the_path_this_cpu_compiles() -> None:
    if os.environ.get(kernels.ISA_SWITCH, "native") not in ("", "native"):
        pytest.skip(f"{kernels.ISA_SWITCH} holds this run to a lower path")
    assert panel_linear_module().isa() == expected_isa()
    assert kernels.paths()["panel_linear"] == expected_isa()  # what the worker's start-up log names
    ops = built(kernels.packed_linear_ops(torch.bfloat16), "panel linears")  # bf16 weights' PanelLinear
    w = torch.randn(40, 33)
    assert torch.equal(ops.pack_weight(w), panel_linear_module().pack_weight_bf16(w))
    assert torch.equal(ops.pack_weight_gated(w), panel_linear_module().pack_weight_gated_bf16(w))


def test_bad_inputs_name_the_offending_value() -> None:
    ops = panel_linear_module()
    w = torch.randn(40, 33)
    packed = ops.pack_weight_bf16(w)
    x = torch.randn(3, 33)
    with pytest.raises(RuntimeError, match="panels must be float32, bfloat16 or int8, got Half"):
        ops.panel_linear(x, packed.half(), None, 40)
    with pytest.raises(RuntimeError, match="x has 36 features, the weight 33 or 34"):
        ops.panel_linear(torch.randn(3, 36), packed, None, 40)
    with pytest.raises(RuntimeError, match="x must be float32, got BFloat16"):
        ops.panel_linear(x.bfloat16(), packed, None, 40)
    with pytest.raises(RuntimeError, match="x must be float32, got Double"):
        ops.panel_linear_gated(x.double(), ops.pack_weight_gated_bf16(w), 20)
    with pytest.raises(RuntimeError, match=r"float32 or bfloat16 \[N, K\] weight only, got \[40, 33\] Half"):
        ops.pack_weight_bf16(w.half())
    with pytest.raises(RuntimeError, match=r"\[2I, K\] weight only, got \[41, 33\]"):
        ops.pack_weight_gated_bf16(torch.randn(41, 33))


def run_lower_path(isa: str) -> None:
    """In a subprocess with CBSERVE_CPU_ISA=isa: every check (check_every_case) on that path's build
    (cached under this run's CBSERVE_HOME beside the native one, so only a first run compiles it)."""
    env = {**os.environ, kernels.ISA_SWITCH: isa}
    script = (
        "from tests.kernel_modules import panel_linear_module\n"
        "from tests.panel_linear_bf16_checks import check_every_case\n"
        f"ops = panel_linear_module(); assert ops.isa() == {isa!r}, ops.isa()\n"
        "check_every_case(ops); print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.stdout.strip().endswith("ok"), (done.stdout[-2000:], done.stderr[-4000:])


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_lower_vector_paths_compute_the_same_product(isa: str) -> None:
    if not kernels.compiler_available():
        pytest.skip("no C++ toolchain here")
    if isa == "avx512" and expected_isa() not in ("avx512-bf16", "avx512"):
        pytest.skip("this CPU has no AVX-512")
    if isa == "avx2" and expected_isa() == "portable":
        pytest.skip("this CPU has no AVX2")
    if isa == expected_isa():
        pytest.skip(f"{isa} is this CPU's best path: the tests above ran it")
    run_lower_path(isa)


@pytest.mark.slow  # a third compile, and scalar loops
def test_portable_path_computes_the_same_product() -> None:
    if not kernels.compiler_available():
        pytest.skip("no C++ toolchain here")
    run_lower_path("portable")
