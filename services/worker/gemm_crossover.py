"""Which GEMM runs a linear of M rows on this CPU: the panel kernel (csrc/panel_linear.cpp) or torch's.

The panel kernel wins where the weights' reads set the pace (the few rows of a decode step: 2x torch's
at one row). Where FMAs set it (a prefill chunk's hundreds of rows) the winner depends on the CPU: on
an AMD machine, where torch's MKL takes no AVX-512 path, the panels measured ahead of oneDNN's brgemm
(itself ahead of MKL there) at every size tried; on an Intel one with AVX-512 MKL ran 1.2x faster at
512 rows (W1's prefill linears 12.8 s against 10.0 s). So the crossover is measured, once per CPU,
torch build, thread count and version of the panel kernel (a hash of its source), and kept in
`$CBSERVE_HOME/kernels`: the same machine always makes the same choice, and results (equal up to fp32
summation order either way) do not change from one start to the next.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F

log = structlog.get_logger(__name__)

ROWS = (64, 128, 256, 512)  # the sizes timed; below the first, the panels always serve
MARGIN = 1.05  # torch must win by this much: a near tie keeps one kernel for every size
NEVER = 1 << 62  # torch_from_rows when the panels win everywhere
_SHAPE = (1536, 576)  # a mid-sized linear of a small decoder (SmolLM2's gate or up projection)
_WEIGHTS = 8  # distinct weights per timing (28 MB), so that they do not all sit in a core's L2
_ROUNDS = 5


def choose(timings: dict[int, tuple[float, float]]) -> int:
    """`timings[m] = (panel_s, torch_s)` -> the fewest rows from which torch's GEMM serves: the
    smallest timed size at which, and at every larger one, torch was MARGIN faster; else NEVER."""
    chosen = NEVER
    for m in sorted(timings, reverse=True):
        panel_s, torch_s = timings[m]
        if torch_s * MARGIN >= panel_s:
            break
        chosen = m
    return chosen


def measure(
    pack_weight: Callable[[torch.Tensor], torch.Tensor], panel_linear: Callable[..., Any]
) -> dict[int, tuple[float, float]]:
    """Best-of-rounds seconds of both GEMMs at each of ROWS, taking turns (machines here are noisy)."""
    gen = torch.Generator().manual_seed(0)
    n, k = _SHAPE
    weights = [torch.randn(n, k, generator=gen) for _ in range(_WEIGHTS)]
    panels = [pack_weight(w) for w in weights]
    timings = {}
    with torch.inference_mode():
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            runs: dict[str, Callable[[int], Any]] = {
                "panel": lambda i, x=x: panel_linear(x, panels[i], None, n),
                "torch": lambda i, x=x: F.linear(x, weights[i]),
            }
            best = dict.fromkeys(runs, math.inf)
            for _ in range(_ROUNDS):
                for name, run in runs.items():
                    start = time.perf_counter()
                    for i in range(_WEIGHTS):
                        run(i)
                    best[name] = min(best[name], time.perf_counter() - start)
            timings[m] = (best["panel"], best["torch"])
    return timings


def torch_from_rows(
    cache_dir: Path,
    kernel_version: str,
    pack_weight: Callable[[torch.Tensor], torch.Tensor],
    panel_linear: Callable[..., Any],
) -> int:
    """This machine's crossover for this version of the panel kernel: read from `cache_dir`, or
    measured once and written there."""
    threads = torch.get_num_threads()
    path = cache_dir / f"gemm-crossover-{kernel_version}-torch{torch.__version__}-{threads}threads.json"
    try:
        return int(json.loads(path.read_text())["torch_from_rows"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    timings = measure(pack_weight, panel_linear)
    chosen = choose(timings)
    n, k = _SHAPE
    flop = 2 * n * k * _WEIGHTS
    gflops = {
        m: {"panel": round(flop * m / p / 1e9, 1), "torch": round(flop * m / t / 1e9, 1)}
        for m, (p, t) in timings.items()
    }
    log.info(
        "measured the GEMM crossover once for this CPU",
        torch_from_rows=None if chosen == NEVER else chosen,
        gflops=gflops,
        threads=threads,
    )
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"torch_from_rows": chosen, "gflops": gflops}))
    tmp.replace(path)  # atomic: a concurrent start reads the old state or the whole new one
    return chosen
