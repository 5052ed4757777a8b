"""Peak resident memory of a process tree while a benchmark runs (Linux `/proc`).

Counted: anonymous and file-backed resident pages (`RssAnon + RssFile`) of the process and all its
descendants (vLLM runs its model in child processes; `cbserve up` runs three). Shared memory
(`RssShmem`) is left out: that is where cbserve's cachemgr keeps the KV pool, which the comparison
excludes. A peer's KV cache is ordinary memory, so the pages of it that the run touched are included.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

# A sample reads /proc for each process of the tree (about 1 ms for cbserve's four), on the cores
# the measured system runs on; a peak held for less than this is missed.
SAMPLE_INTERVAL_S = 0.25


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def tree_rss_bytes(pid: int) -> int:
    """RssAnon + RssFile of `pid` and its descendants now; 0 for processes that are gone."""
    total, pending = 0, [pid]
    while pending:
        current = pending.pop()
        try:
            status = Path(f"/proc/{current}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith(("RssAnon:", "RssFile:")):
                total += int(line.split()[1]) * 1024
        pending += _children(current)
    return total


class PeakRss:
    """`with PeakRss(pid) as peak: ...`, then `peak.bytes`: the highest tree RSS sampled meanwhile."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid if pid is not None else os.getpid()
        self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)

    def _sample(self) -> None:
        while True:
            self.bytes = max(self.bytes, tree_rss_bytes(self.pid))
            if self._stop.wait(SAMPLE_INTERVAL_S):
                return

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.bytes = max(self.bytes, tree_rss_bytes(self.pid))
