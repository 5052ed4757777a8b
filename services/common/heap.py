"""The memory of a process that runs forwards on the CPU: memory freed by one step stays for the next,
and large tensors sit on huge pages.

glibc hands a freed block larger than its mmap threshold back to the kernel and trims the top of its
heap beyond a threshold; both adapt to the sizes seen, but not to a forward's pattern of several
megabyte-sized activations alive at once, all freed and allocated again every step. The next step
then faults every page in again, zeroed by the kernel: a large prompt's step pays for it in full
(vLLM's CPU guide preloads tcmalloc for the same reason; the settings below do as well without it).
Blocks up to glibc's largest mmap threshold (32 MiB) then come from the heap and the heap never
shrinks: a process keeps the peak of its transient memory, which the peak RSS already counted. Larger
blocks (the weights, a KV pool) are mapped and unmapped as before.

Huge pages: with the kernel's transparent huge pages in `madvise` mode (many distributions' default)
no page of ours would be huge. torch's CPU allocator asks for them (2 MiB-aligned blocks with
MADV_HUGEPAGE) for tensors of 2 MiB or more where `THP_MEM_ALLOC_ENABLE` is set before its first such
allocation: fewer TLB misses over the panels and activations, and step times that vary less from one
process to the next, since which physical pages back them no longer does.
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
