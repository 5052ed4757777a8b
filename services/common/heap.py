"""The memory of a process that runs forwards on the CPU: memory freed by one step stays for the next,
and large tensors sit on huge pages.

glibc hands a freed block larger than its mmap threshold back to the kernel and trims the top of its
heap beyond a threshold; both adapt to the sizes seen, but not to a forward's pattern of several
megabyte-sized activations alive at once, all freed and allocated again every step. The next step
then faults every page in again, zeroed by the kernel. Measured on the 2-core EPYC (2026-12-02): a
640-token prompt computed in one step took 770 ms with glibc's defaults (median of 6), 545 ms with
the settings below and 565 ms with tcmalloc preloaded, which is what vLLM's CPU guide does for the
same reason. Blocks up to glibc's largest mmap threshold (32 MiB) then come from the heap and the heap
never shrinks: a process keeps the peak of its transient memory (the stack's peak RSS on W1 was
2,629-2,655 MiB in four runs before, 2,649 and 2,652 in two after). Larger blocks (the weights, a KV
pool) are mapped and unmapped as before.

Huge pages: with the kernel's transparent huge pages in `madvise` mode (this machine's, and many
distributions' default) no page of ours was huge. torch's CPU allocator asks for them (2 MiB-aligned
blocks with MADV_HUGEPAGE) for tensors of 2 MiB or more where `THP_MEM_ALLOC_ENABLE` is set before
its first such allocation. In-process, a cold 640-token prompt (2026-12-04, Zen 4, 5 processes of 6
rounds each, alternating) took a median 821 ms that way against 888 without; each process's rounds
also scattered less (787-807 ms against 783-959 in one pair of processes), since which physical pages
back the panels and activations no longer varies from one process to the next.
"""

from __future__ import annotations

import ctypes
import os

import structlog

log = structlog.get_logger(__name__)

# <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc's cap on 64-bit (4 MiB x sizeof(long)); above it mallopt fails
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: the heap's top is never given back

# A user's own choice wins: glibc's variables, its tunables, or another allocator preloaded.
USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES", "LD_PRELOAD")


def keep_freed_memory() -> bool:
    """Set the thresholds above for this process; whether they were set (not where the user chose
    the allocator's settings, nor where the C library has no working `mallopt`, such as musl)."""
    chosen = [name for name in USER_SETTINGS if os.environ.get(name)]
    if chosen:
        log.info("heap settings left to the environment", variables=chosen)
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mapped = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
    return bool(mapped) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def ask_huge_pages() -> bool:
    """torch's large CPU tensors on transparent huge pages (see the top); call before the first one
    (the model's weights). False where the user set `THP_MEM_ALLOC_ENABLE` (their choice stands)."""
    if "THP_MEM_ALLOC_ENABLE" in os.environ:
        return False
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    return True


def huge_page_bytes() -> int | None:
    """This process's anonymous memory on huge pages (`/proc/self/smaps_rollup`), None where unknown."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
