"""services/common/heap.py: a step's freed activations stay mapped for the next step, on huge pages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.heap import USER_SETTINGS, ask_huge_pages, keep_freed_memory

# A forward's pattern in small: several 8 MiB activations alive at once, all freed, again and again.
# Prints the page faults one such step costs once warm.
_STEPS = """
import resource, sys, torch
from services.common.heap import keep_freed_memory
if sys.argv[1] == "kept":
    assert keep_freed_memory()
def step():
    activations = [torch.empty(2 << 20).fill_(1.0) for _ in range(4)]
    del activations
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10)
"""


def _faults_per_step(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in USER_SETTINGS and not k.startswith("MALLOC_")}
    done = subprocess.run(
        [sys.executable, "-c", _STEPS, mode], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return float(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_step_reuses_the_pages_the_step_before_freed() -> None:
    pages_touched = 4 * (8 << 20) // 4096
    default = _faults_per_step("default")
    if default < pages_touched / 4:
        pytest.skip(f"this C library keeps freed memory by itself ({default} faults a step)")
    # Kept, a step faults almost nothing in: bounded against the default's count, not by an absolute one,
    # since the kernel's own work on a busy host (compaction, page-table scans) adds a few faults a step
    # that are no allocation of ours (a full suite on two cores once saw 103 of 8,192 pages).
    kept = _faults_per_step("kept")
    assert kept < default / 20, f"kept: {kept} faults a step; glibc's defaults: {default}"


def test_a_users_own_allocator_settings_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in USER_SETTINGS:
        with monkeypatch.context() as m:
            m.setenv(name, "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
            assert not keep_freed_memory(), name


# A worker's start in small: the heap settings and huge pages asked for before the first large
# tensor, then activations of 8 MiB (from the heap) and a 64 MiB weight (mapped). Prints the bytes
# of anonymous memory on huge pages.
_HUGE = """
import sys, torch
from services.common.heap import ask_huge_pages, huge_page_bytes, keep_freed_memory
keep_freed_memory()
if sys.argv[1] == "asked":
    assert ask_huge_pages()
tensors = [torch.empty(2 << 20).fill_(1.0) for _ in range(4)] + [torch.empty(16 << 20).fill_(1.0)]
print(huge_page_bytes())
"""
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_bytes(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    done = subprocess.run(
        [sys.executable, "-c", _HUGE, mode], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    not _THP_MODE.exists() or "[never]" in _THP_MODE.read_text(), reason="no transparent huge pages here"
)
def test_large_tensors_sit_on_huge_pages_once_asked() -> None:
    asked = _huge_bytes("asked")
    assert asked >= 64 << 20, f"{asked} bytes on huge pages (THP: {_THP_MODE.read_text().strip()})"
    if "[madvise]" in _THP_MODE.read_text():
        assert _huge_bytes("default") < asked  # only asked-for memory is huge in this mode


def test_a_users_own_huge_page_choice_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    assert not ask_huge_pages()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"
