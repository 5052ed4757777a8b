"""tests: the CUDA-only tests (`pytest -m cuda`), in a process of their own."""

from __future__ import annotations

import subprocess
import sys

from scripts.gpu_check.check import REPO, Check, Entry


def tests_section(check: Check) -> Entry:
    """The CUDA-only tests, in a process of their own."""
    timeout = max(30.0, check.seconds_left(keep=10))
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "cuda",
        "-p",
        "no:cacheprovider",
        "tests/test_cuda_graphs.py",
        "tests/test_swap_copies.py",
        "tests/test_gpu_llama.py",  # the GPU's own forward, compiled, under real graphs
        "tests/test_piecewise_graphs.py",  # its pieces as real graphs against its eager step
        "tests/test_triton_fused.py",  # its passes captured in a graph
    ]
    if check.device != "cuda":
        argv.append("--collect-only")  # nothing of it runs without a device: just that it collects
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    log = check.workdir / "pytest.log"
    log.write_text(done.stdout + done.stderr)
    lines = done.stdout.splitlines()
    return {
        "returncode": done.returncode,
        "summary": next((line for line in reversed(lines) if " in " in line), ""),
        "failed": [line for line in lines if line.startswith(("FAILED", "ERROR"))][:20],
        "log": str(log),
    }
