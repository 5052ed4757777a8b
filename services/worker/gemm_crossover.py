"""Which GEMM runs a linear of M rows on this CPU: the panel kernel (csrc/panel_linear.cpp) or torch's
(`torch_gemm`: oneDNN's matmul on weights reordered once, where torch has oneDNN).

The panel kernel wins where the weights' reads set the pace (the few rows of a decode step). Where
FMAs set it (a prefill chunk's hundreds of rows) the winner depends on the CPU, its vector units, the
BLAS torch brings and the cache it shares (docs/performance-log.md, "Measurements behind the code", has
machines where each won). So the crossover is measured, once per CPU, torch build, thread count and version of
the kernels and of this measurement (a hash of their sources), and kept in `$CBSERVE_HOME/kernels`: the
same machine always makes the same choice, and results (equal up to fp32 summation order either way)
do not change from one start to the next.

The measurement must hold on a host whose load comes and goes (other tenants): each size is timed in
15 paired rounds and judged by the median round's ratio, on weights that come from memory as a
model's do (a best-of-few on cached weights chose differently from one start to the next).

Nor may a choice be kept that was measured while other work held the cores: the threads' share of
their wall time on the cores is measured beside the timings, a measurement below QUIET is repeated,
and if none is quiet the last one serves this start only (the next start measures again). What this
does not see is other tenants' use of the shared cache and memory, which CPU time does not show: a
choice kept from a quiet hour can be wrong in another (`CBSERVE_GEMM_CROSSOVER` pins one).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from services.common.precision import dtype_name
from services.worker import torch_gemm

log = structlog.get_logger(__name__)

ROWS = (64, 128, 256, 512)  # the sizes timed; below the first, the panels always serve
MARGIN = 1.05  # torch must win by this much: a near tie keeps one kernel for every size
NEVER = 1 << 62  # torch_from_rows when the panels win everywhere
# One layer's linears of a small decoder: SmolLM2-135M's, q|k|v and gate|up fused as its forward runs them.
_LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
_LAYER_PARAMS = sum(n * k for n, k in _LAYER)
_ROUNDS = 15
QUIET = 0.85  # the least share of its threads' wall time a kept measurement had on the CPU
_ATTEMPTS = 3  # measurements tried for a quiet one
_SYSFS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
# Pins the crossover instead: `never` (the panels at every size) or N (torch's GEMM from N rows). For a
# host too noisy to measure on, and for the test suite, which must neither measure on its own busy
# cores nor write the record a user's stack reads.
SETTING = "CBSERVE_GEMM_CROSSOVER"


def pinned() -> int | None:
    """The crossover `CBSERVE_GEMM_CROSSOVER` pins, or None (unset or empty: measured)."""
    given = os.environ.get(SETTING, "")
    text = given.strip().lower()
    if not text:
        return None
    if text == "never":
        return NEVER
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{SETTING} must be 'never' or a number of rows of at least 1, got {given!r}")
    return int(text)


def choose(timings: dict[int, tuple[float, float]]) -> int:
    """`timings[m] = (panel_s, torch_s)` -> the fewest rows from which torch's GEMM serves: of every
    crossover at a timed size (torch from there up, the panels below), the one whose time summed over
    the timed sizes is least, each size's time taken relative to the panels' (so that every size
    weighs alike); NEVER unless that beats the panels alone by MARGIN. A sum, not a test at each size
    in turn, so that one size misjudged on a busy host (a narrow win between two losses) does not send
    every size below it to the slower kernel."""
    sizes = sorted(timings)

    def total(crossover: int) -> float:
        return sum(timings[m][1] / timings[m][0] if m >= crossover else 1.0 for m in sizes)

    best = min(sizes, key=total)
    return best if total(best) * MARGIN < total(NEVER) else NEVER


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size from Linux's sysfs; 32 MiB where it cannot be read."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for entry in _SYSFS_CACHES.glob("index*/size"):
        text = entry.read_text().strip()
        if text[:-1].isdigit() and text[-1] in units:
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=32 << 20)


@dataclass
class Measurement:
    """`timings[m] = (panel_s, torch_s)` at each of ROWS; `cpu_share`: the CPU time the process got
    while timing, over the wall time of the threads timed (about 1 on a quiet host)."""

    timings: dict[int, tuple[float, float]]
    cpu_share: float

    @property
    def quiet(self) -> bool:
        return self.cpu_share >= QUIET


def measure(
    pack_weight: Callable[[torch.Tensor], torch.Tensor],
    panel_linear: Callable[..., Any],
    dtype: torch.dtype = torch.float32,
) -> Measurement:
    """Seconds of both GEMMs over one layer's linears at each of ROWS, from the round whose
    panel/torch ratio is the median of _ROUNDS. `dtype`: the weights' (and torch's products'); the
    panels take float32 inputs whatever it is, torch's GEMM inputs of `dtype`. Within a round the two
    run back to back, in turns first, so that the host's load (noisy here: other tenants) weighs on
    both alike.

    Each timing reads a layer no recent one did, and the layers of both kernels together outgrow the
    last-level cache, so that the weights come from memory as a model's do: with them in cache the
    panels look faster at many rows than they run in a real step."""
    gen = torch.Generator().manual_seed(0)
    layer_bytes = _LAYER_PARAMS * dtype.itemsize
    num_layers = max(2, math.ceil(1.25 * last_level_cache_bytes() / (2 * layer_bytes)))
    weights = [[torch.randn(n, k, generator=gen).to(dtype) for n, k in _LAYER] for _ in range(num_layers)]
    panels = [[pack_weight(w) for w in layer] for layer in weights]
    prepared = [[torch_gemm.prepare(w) for w in layer] for layer in weights]

    def panel(i: int, inputs: dict[int, torch.Tensor]) -> None:
        for (n, k), w in zip(_LAYER, panels[i], strict=True):
            panel_linear(inputs[k], w, None, n)

    def torch_side(i: int, inputs: dict[int, torch.Tensor]) -> None:
        for (_, k), w in zip(_LAYER, prepared[i], strict=True):
            torch_gemm.linear(inputs[k].to(dtype), w, None)

    turn = itertools.count()
    timings = {}
    cpu_start, wall_start = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        for m in ROWS:
            inputs = {k: torch.randn(m, k, generator=gen) for _, k in _LAYER}
            rounds = []
            for r in range(_ROUNDS):
                seconds = {}
                for run in (panel, torch_side) if r % 2 == 0 else (torch_side, panel):
                    start = time.perf_counter()
                    run(next(turn) % num_layers, inputs)
                    seconds[run] = time.perf_counter() - start
                rounds.append((seconds[panel], seconds[torch_side]))
            rounds.sort(key=lambda pt: pt[0] / pt[1])
            timings[m] = rounds[len(rounds) // 2]
    cpu_s, wall_s = time.process_time() - cpu_start, time.perf_counter() - wall_start
    return Measurement(timings, cpu_s / (wall_s * torch.get_num_threads()))


def torch_from_rows(
    cache_dir: Path,
    kernel_version: str,
    pack_weight: Callable[[torch.Tensor], torch.Tensor],
    panel_linear: Callable[..., Any],
    dtype: torch.dtype = torch.float32,
) -> int:
    """This machine's crossover for this version of the panel kernel and weights of `dtype`: read from
    `cache_dir`, or measured and written there once a measurement is quiet."""
    threads = torch.get_num_threads()
    of = "" if dtype == torch.float32 else f"-{dtype_name(dtype)}"
    path = cache_dir / f"gemm-crossover{of}-{kernel_version}-torch{torch.__version__}-{threads}threads.json"
    try:
        return int(json.loads(path.read_text())["torch_from_rows"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    for attempt in range(1, _ATTEMPTS + 1):
        measured = measure(pack_weight, panel_linear, dtype)
        if measured.quiet:
            break
        log.warning(
            "the host was busy while measuring the GEMM crossover",
            cpu_share=round(measured.cpu_share, 2),
            quiet=QUIET,
            attempt=attempt,
        )
    chosen = choose(measured.timings)
    flop = 2 * _LAYER_PARAMS
    gflops = {
        m: {"panel": round(flop * m / p / 1e9, 1), "torch": round(flop * m / t / 1e9, 1)}
        for m, (p, t) in measured.timings.items()
    }
    log.info(
        "measured the GEMM crossover for this CPU"
        if measured.quiet
        else "a GEMM crossover for this start only",
        torch_from_rows=None if chosen == NEVER else chosen,
        weights=dtype_name(dtype),
        gflops=gflops,
        cpu_share=round(measured.cpu_share, 2),
        threads=threads,
    )
    if not measured.quiet:
        return chosen
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    record = {"torch_from_rows": chosen, "gflops": gflops, "cpu_share": round(measured.cpu_share, 2)}
    tmp.write_text(json.dumps(record))
    tmp.replace(path)  # atomic: a concurrent start reads the old state or the whole new one
    return chosen
