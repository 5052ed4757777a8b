"""The benchmarks' wait for a quiet host (services/bench/host_quiet.py)."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from services.bench.host_quiet import busy_ticks, wait_quiet

STAT = """cpu  4705 356 584 3699176 23 0 21 7 0 0
cpu0 2363 178 292 1849588 11 0 10 3 0 0
intr 114930 0 0
"""


def test_busy_ticks_counts_user_nice_system_and_interrupts_not_idle_or_steal() -> None:
    assert busy_ticks(STAT) == 4705 + 356 + 584 + 0 + 21
    with pytest.raises(ValueError, match="no aggregate 'cpu' line"):
        busy_ticks("cpu0 1 2 3 4\n")


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat (Linux)")
def test_waits_for_a_spinning_process_to_stop() -> None:
    spinner = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 1.0\nwhile time.time() < end: pass"]
    )
    try:
        waited = wait_quiet(timeout_s=20.0)
        assert spinner.poll() is not None, f"quiet after {waited:.2f} s while a process still spun"
        assert waited >= 0.8
    finally:
        spinner.kill()
        spinner.wait()


def test_gives_up_after_the_timeout_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    always_busy = itertools.count(step=1.0).__next__  # a whole second busy per reading
    waited = wait_quiet(window_s=0.01, timeout_s=0.05, read_busy_s=lambda: float(always_busy()))
    assert 0.05 <= waited < 5.0
    assert "the host stayed busy" in capsys.readouterr().err


def test_returns_at_once_where_busy_time_is_unknown() -> None:
    assert wait_quiet(read_busy_s=lambda: None) == 0.0
