"""A readiness file, for probes that cannot ask a process itself (a compose healthcheck of the worker,
whose ZMQ port is bound long before the model is warm).

The file names the process that wrote it by pid and start time, so that a file left behind by a killed
process (or one whose pid a restarted container hands out again) does not read as ready.
"""

from __future__ import annotations

import os
from pathlib import Path


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat, field 22), or None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # fields after the command name, which may hold spaces


def mark(path: Path | None, ready: bool) -> None:
    """Write (ready) or remove (not ready) `path`; None: no file is kept."""
    if path is None:
        return
    if not ready:
        path.unlink(missing_ok=True)
        return
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
    staging.replace(path)  # whole or absent: a probe never reads half a line


def is_ready(path: Path) -> bool:
    """Whether `path` was written by a process that still runs."""
    try:
        pid, started = path.read_text().split()
    except (OSError, ValueError):
        return False
    return _start_time(int(pid)) == started
