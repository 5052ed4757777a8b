"""The GEMM crossover: the rule that picks it, and its measurement kept once per machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from services.worker import gemm_crossover, kernels, torch_gemm
from services.worker.gemm_crossover import NEVER, choose
from tests.kernel_modules import built


def test_torch_serves_from_the_crossover_that_costs_least_in_all() -> None:
    assert choose({64: (1.0, 1.2), 128: (1.0, 0.9), 256: (1.0, 0.8), 512: (1.0, 0.5)}) == 128
    # One size misjudged (the panels ahead at 256, between clear losses) does not move the crossover
    # above it: the sum over every size decides.
    assert choose({64: (1.0, 1.1), 128: (1.0, 0.88), 256: (1.0, 1.06), 512: (1.0, 0.82)}) == 128
    # A large loss at a size keeps the panels below it.
    assert choose({64: (1.0, 0.9), 128: (1.0, 2.0), 256: (1.0, 0.8), 512: (1.0, 0.5)}) == 256
    # A win inside the margin is a tie, and a tie keeps the panels.
    assert choose({64: (1.0, 0.99), 128: (1.0, 0.97)}) == NEVER
    assert choose({64: (1.0, 2.0), 512: (1.0, 3.0)}) == NEVER


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_gemm_multiplies_weights_of_each_dtype_on_this_cpu(dtype: torch.dtype) -> None:
    # oneDNN refuses 16-bit weights on a CPU without AVX-512 (or AVX-NE-CONVERT): they go to F.linear.
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(96, 64, generator=gen).to(dtype), torch.randn(300, 64, generator=gen).to(dtype)
    prepared = torch_gemm.prepare(weight)
    assert prepared.is_mkldnn == torch_gemm.onednn_serves(dtype)
    expected = x.double() @ weight.double().T
    torch.testing.assert_close(torch_gemm.linear(x, prepared, None).double(), expected, **_BOUNDS[dtype])


# Each product's inputs are the format's own values; only the float32 (or bfloat16) output rounds, and
# 64 products' sum in float32 differs from the exact one by far less than the bound.
_BOUNDS = {torch.float32: {"rtol": 1e-5, "atol": 1e-4}, torch.bfloat16: {"rtol": 1e-2, "atol": 5e-2}}


def test_the_last_level_cache_is_read_from_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for index, size in (("index0", "48K"), ("index2", "2048K"), ("index3", "307200K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    monkeypatch.setattr(gemm_crossover, "_SYSFS_CACHES", tmp_path)
    assert gemm_crossover.last_level_cache_bytes() == 300 << 20
    monkeypatch.setattr(gemm_crossover, "_SYSFS_CACHES", tmp_path / "absent")
    assert gemm_crossover.last_level_cache_bytes() == 32 << 20


def test_crossover_is_measured_once_then_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ops = built(kernels.packed_linear_ops(), "panel linears")
    # A cache of unknown size (32 MiB assumed): the measurement cycles through two layers, not the
    # hundreds of MB a large shared cache calls for, and keeps this test quick.
    monkeypatch.setattr(gemm_crossover, "_SYSFS_CACHES", tmp_path / "no-sysfs")
    monkeypatch.setattr(gemm_crossover, "QUIET", 0.0)  # CI's host may be busy: kept all the same
    first = gemm_crossover.torch_from_rows(tmp_path, "v1", ops.pack_weight, ops.packed_linear)
    threads = torch.get_num_threads()
    [kept] = tmp_path.glob(f"gemm-crossover-v1-torch{torch.__version__}-{threads}threads.json")
    record = json.loads(kept.read_text())
    assert record["torch_from_rows"] == first
    assert set(record["gflops"]) == {str(m) for m in gemm_crossover.ROWS}
    # The kept choice is what a later start uses, whatever it would measure now.
    kept.write_text(json.dumps({**record, "torch_from_rows": 4096}))
    assert gemm_crossover.torch_from_rows(tmp_path, "v1", ops.pack_weight, ops.packed_linear) == 4096
    # Another version of the kernel is measured for itself.
    assert gemm_crossover.torch_from_rows(tmp_path, "v2", ops.pack_weight, ops.packed_linear) != 4096
    kept.write_text("{not json")  # a damaged file is measured again, not trusted
    assert gemm_crossover.torch_from_rows(tmp_path, "v1", ops.pack_weight, ops.packed_linear) in {
        *gemm_crossover.ROWS,
        NEVER,
    }


def test_a_busy_measurement_serves_this_start_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ops = built(kernels.packed_linear_ops(), "panel linears")
    monkeypatch.setattr(gemm_crossover, "_SYSFS_CACHES", tmp_path / "no-sysfs")
    monkeypatch.setattr(gemm_crossover, "QUIET", 2.0)  # no measurement is quiet enough
    monkeypatch.setattr(gemm_crossover, "_ATTEMPTS", 2)
    chosen = gemm_crossover.torch_from_rows(tmp_path, "v1", ops.pack_weight, ops.packed_linear)
    assert chosen in {*gemm_crossover.ROWS, NEVER}
    assert list(tmp_path.glob("gemm-crossover-*")) == []  # the next start measures again


def test_other_work_on_the_cores_shows_in_the_cpu_share(monkeypatch: pytest.MonkeyPatch) -> None:
    """One busy loop per core beside the measurement leaves its threads about half the time."""
    ops = built(kernels.packed_linear_ops(), "panel linears")
    monkeypatch.setattr(gemm_crossover, "_SYSFS_CACHES", Path("/no-sysfs"))
    monkeypatch.setattr(gemm_crossover, "_ROUNDS", 5)
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(max(len(os.sched_getaffinity(0)), torch.get_num_threads()))
    ]
    try:
        time.sleep(0.5)  # the loops are running before the timing starts
        busy = gemm_crossover.measure(ops.pack_weight, ops.packed_linear)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert not busy.quiet, busy.cpu_share


PINS = [("never", NEVER), (" Never", NEVER), ("512", 512), ("", None)]


@pytest.mark.parametrize(("text", "crossover"), PINS)
def test_a_pinned_crossover_is_taken_as_given(
    text: str, crossover: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(gemm_crossover.SETTING, text)
    assert gemm_crossover.pinned() == crossover


@pytest.mark.parametrize("text", ["0", "-64", "Lots ", "1e3"])
def test_a_bad_pinned_crossover_is_refused_naming_it(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gemm_crossover.SETTING, text)
    with pytest.raises(ValueError, match=f"CBSERVE_GEMM_CROSSOVER.*{text!r}"):
        gemm_crossover.pinned()
