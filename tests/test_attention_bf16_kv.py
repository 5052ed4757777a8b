"""The paged attention kernels read bfloat16 K/V pools in place. A bfloat16 widens to float32 exactly
and all arithmetic stays float32 in the same order, so on every vector path the output equals, bit for
bit, the float32 kernel's on the upcast pool (`k_cache.float()`), and so the reference within the
float32 tests' tolerance."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from services.worker import kernels
from tests.stack import REPO
from tests.test_attention import built, causal_reference, gather_sdpa, prefill_batch

# The vector paths, lowest first, as the module's isa() names them.
PATHS = ("portable", "avx2", "avx512")


@functools.cache
def attention_module() -> Any:
    """The paged attention module alone: a lower path's subprocess (below) compiles nothing else."""
    return built(kernels._build("paged_attention"), "paged attention")


def expected_path() -> str:
    """The path a build here has: this CPU's best, or the lower one CBSERVE_CPU_ISA holds it to."""
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    best = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "portable"
    held = kernels.isa()
    return best if held == "native" else min(best, held, key=PATHS.index)


def bf16_pool(*shape: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(torch.bfloat16)


def test_module_names_its_vector_path() -> None:
    assert attention_module().isa() == expected_path()


# test_attention.py's decode grid, and contexts long enough that the prefetch runs far past its first
# distance ahead (16 and 48: rows of a head that are half a cache line, and one and a half, in bfloat16).
DECODE_SHAPES = [
    (2, 2, 16, 7, 45),
    (3, 3, 64, 7, 45),  # SmolLM2's shape
    (1, 4, 32, 7, 45),
    (1, 5, 128, 2, 45),  # few requests: one task per head; five queries exceed one register pass
    (2, 3, 24, 1, 45),  # a head size off the vector path
    (4, 1, 80, 9, 45),
    (1, 71, 64, 3, 45),  # Falcon-7B's multi-query shape: more query heads per kv head than registers
    (1, 2, 16, 3, 900),
    (3, 1, 48, 6, 700),
]


@pytest.mark.parametrize("softcap", [0.0, 20.0])
@pytest.mark.parametrize(("kv", "group", "d", "b", "length"), DECODE_SHAPES)
def test_bf16_decode_is_fp32_decode_on_the_upcast_pool(
    kv: int, group: int, d: int, b: int, length: int, softcap: float
) -> None:
    kernel = attention_module().paged_decode
    gen = torch.Generator().manual_seed(d + length)
    num_slots = 2 * length + 300
    k_cache = bf16_pool(num_slots, kv, d, generator=gen)
    v_cache = bf16_pool(num_slots, kv, d, generator=gen)
    slots = torch.randint(0, num_slots, (b, length), generator=gen)
    lengths = torch.randint(1, length + 1, (b,), generator=gen)
    width = kv * group * d
    packed = torch.randn(b + 3, width + 8, generator=gen)[:, :width].view(b + 3, kv * group, d)
    rows = torch.randperm(b + 3, generator=gen)[:b]
    got, want = torch.full(packed.shape, 7.0), torch.full(packed.shape, 7.0)
    kernel(packed, got, rows, k_cache, v_cache, slots, lengths, d**-0.5, softcap)
    kernel(packed, want, rows, k_cache.float(), v_cache.float(), slots, lengths, d**-0.5, softcap)
    assert torch.equal(got, want)  # the other rows too: left alone (7.0) by both
    q = packed[rows].view(b, kv, group, d)
    reference = gather_sdpa(q, k_cache.float(), v_cache.float(), slots, lengths, d**-0.5, softcap)
    torch.testing.assert_close(got[rows].view(b, kv, group, d), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("softcap", "window"), [(0.0, 0), (20.0, 0), (0.0, 13)])
@pytest.mark.parametrize(("kv", "group", "d"), [(3, 3, 64), (2, 2, 16), (1, 5, 128), (4, 1, 32), (2, 2, 48)])
def test_bf16_prefill_is_fp32_prefill_on_the_upcast_pool(
    kv: int, group: int, d: int, softcap: float, window: int
) -> None:
    module = attention_module()
    if not module.prefill_supports(d):
        pytest.skip(f"no prefill kernel for head size {d} on the {module.isa()} path")
    k_cache, v_cache, (q, first_rows, num_queries, slots, lengths) = prefill_batch(
        kv, group, d, window, torch.bfloat16
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
        (torch.float16, torch.float16, "got Half and Half"),
        (torch.float64, torch.float64, "got Double and Double"),
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


def rerun_on_lower_path(test_file: Path, path: str) -> None:
    """`test_file`'s tests, but those named `lower_path`, in a child run built for `path`."""
    if os.environ.get(kernels.ISA_SWITCH, "native") != "native":
        pytest.skip(f"this run is the {os.environ[kernels.ISA_SWITCH]} path's")
    if PATHS.index(path) >= PATHS.index(expected_path()):
        pytest.skip(f"{path} is this CPU's best path: the tests above ran it")
    run_on_path(test_file, path)


def run_on_path(test_file: Path, path: str) -> None:
    """rerun_on_lower_path's child run, for a `path` that names this CPU's best but is a build of its
    own (AVX-512 held below AVX512-BF16)."""
    env = {**os.environ, kernels.ISA_SWITCH: path}
    tests = str(test_file.relative_to(REPO))
    child = [sys.executable, "-m", "pytest", tests, "-q", "-x", "-k", "not lower_path"]
    run = subprocess.run(child, env=env, cwd=REPO, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1] and " failed" not in run.stdout.splitlines()[-1]
