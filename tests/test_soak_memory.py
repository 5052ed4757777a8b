"""Memory soak: many distinct long prompts through `cbserve up` with its default settings (the
embedded SmolLM2, the default KV pool). Throughout, the stack's memory (resident anonymous and file
pages of the supervisor and its three children, plus the /dev/shm files the cachemgr maps) stays
under a stated budget: the KV and swap pools' sizes plus `PROCESS_BUDGET` for everything else.
Afterwards no block, swap slot or request state is held.

The pool is committed whole at start (prefaulted, the default). With `CBSERVE_PREFAULT_KV_POOL=off`
distinct prompts, which never hit the prefix cache but each leave their full pages cached, make the
committed pool grow until it reaches the pool's size and then stay there: the curve this writes (CSV
and SVG, under `CBSERVE_SOAK_MEMORY_OUT`) shows where. Not in `make test`: `make soak-memory` runs 20,000
requests (about an hour on two cores).
"""

from __future__ import annotations

import csv
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from services.bench.memory import tree_rss_bytes
from services.common.kv_geometry import RESERVED_CHUNKS
from tests.stack import Stack, greedy_request

REQUESTS = int(os.environ.get("CBSERVE_SOAK_MEMORY_REQUESTS", "20000"))
PROMPT_TOKENS = int(os.environ.get("CBSERVE_SOAK_MEMORY_PROMPT_TOKENS", "64"))
OUT = Path(os.environ.get("CBSERVE_SOAK_MEMORY_OUT", "soak-memory"))
CONCURRENCY = 16
NEW_TOKENS = 2
GIB = 1 << 30
# The stack's processes without the pools: SmolLM2's fp32 weights (0.5 GiB) in the worker, torch and
# the tokenizer in each process, the step's activations. Measured about 2.4 GiB under load.
PROCESS_BUDGET = 3 * GIB
SAMPLE_INTERVAL_S = 1.0
FIELDS = [
    "seconds",
    "requests_done",
    "rss_bytes",
    "shm_bytes",
    "stack_bytes",
    "committed_bytes",
    "cached_blocks",
    "host_available_bytes",
]

pytestmark = pytest.mark.soak_memory


def mapped_shm_bytes(pid: int) -> int:
    """Committed bytes of the cbserve shm files `pid` maps (a sparse file's blocks are its commit)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return 0
    paths = {line.split(maxsplit=5)[5] for line in maps if "/cbserve-" in line and line.count(" ") >= 5}
    total = 0
    for path in paths:
        try:
            total += os.stat(path.removesuffix(" (deleted)")).st_blocks * 512
        except OSError:
            continue
    return total


def swap_pool_bytes(load: Any) -> int:
    """Swap slots are chunk-sized; the KV pool's chunks include the reserved ones."""
    return load.swap_slots_total * load.kv_pool_bytes // (load.kv_blocks_total + RESERVED_CHUNKS)


def write_svg(path: Path, samples: list[dict[str, float]], budget: float) -> None:
    """RSS + shm and the committed pool (GiB) against requests done, with the budget line."""
    width, height, pad = 720, 360, 48
    x_max = max(s["requests_done"] for s in samples) or 1
    y_max = budget * 1.15 / GIB

    def point(x: float, y: float) -> str:
        return (
            f"{pad + x / x_max * (width - 2 * pad):.1f},{height - pad - y / y_max * (height - 2 * pad):.1f}"
        )

    def line(key: str, color: str) -> str:
        pts = " ".join(point(s["requests_done"], s[key] / GIB) for s in samples)
        return f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{pts}"/>'

    budget_y = point(0, budget / GIB).split(",")[1]
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="12">'
        f'<rect width="100%" height="100%" fill="white"/>'
        f'<line x1="{pad}" x2="{width - pad}" y1="{budget_y}" y2="{budget_y}" stroke="red" '
        f'stroke-dasharray="6"/>'
        f'<text x="{pad + 4}" y="{float(budget_y) - 4}" fill="red">budget {budget / GIB:.1f} GiB</text>'
        f"{line('stack_bytes', 'black')}{line('committed_bytes', 'steelblue')}"
        f'<text x="{pad}" y="20">stack RSS + shm (black), committed KV pool (blue), GiB; x: requests done '
        f"(0 to {x_max:,})</text>"
        f'<text x="{pad}" y="{height - 12}">0</text>'
        f'<text x="{width - pad - 40}" y="{height - 12}">{x_max:,}</text>'
        f'<text x="8" y="{pad + 4}">{y_max:.1f}</text></svg>'
    )


@pytest.mark.timeout(REQUESTS * 2 + 600)
def test_memory_stays_bounded(smollm2_dir: Path, tmp_path: Path) -> None:
    # cbserve up's defaults: nothing about the pool is set. One compute thread: the soak shares the
    # machine with whatever else runs, where two OpenMP threads on two busy cores stall at every barrier.
    stack = Stack(smollm2_dir, tmp_path, threads=int(os.environ.get("CBSERVE_SOAK_MEMORY_THREADS", "1")))
    try:
        idle = stack.load()
        budget = idle.kv_pool_bytes + swap_pool_bytes(idle) + PROCESS_BUDGET
        cachemgr = stack.child_pid("cachemgr")
        rng = random.Random(20_000)
        vocab = stack.vocab_size
        done = 0
        done_lock = threading.Lock()
        samples: list[dict[str, float]] = []
        stop = threading.Event()
        t0 = time.monotonic()

        OUT.mkdir(parents=True, exist_ok=True)
        curve = (OUT / "soak-memory.csv").open("w", newline="")  # written as it goes: a cut run still shows
        writer = csv.DictWriter(curve, fieldnames=FIELDS)
        writer.writeheader()

        def sample() -> None:
            load = stack.load()
            rss, shm = tree_rss_bytes(stack.process.pid), mapped_shm_bytes(cachemgr)
            samples.append(
                {
                    "seconds": round(time.monotonic() - t0, 1),
                    "requests_done": done,
                    "rss_bytes": rss,
                    "shm_bytes": shm,
                    "stack_bytes": rss + shm,
                    "committed_bytes": load.kv_pool_committed_bytes,
                    "cached_blocks": load.kv_blocks_cached,
                    "host_available_bytes": load.host_available_bytes,
                }
            )
            writer.writerow(samples[-1])
            curve.flush()

        def sampler() -> None:
            while not stop.wait(SAMPLE_INTERVAL_S):
                sample()

        def run(i: int) -> None:
            nonlocal done
            # Distinct by construction: the first tokens spell the request's index.
            prompt = [i % vocab, i // vocab % vocab] + [
                rng.randrange(vocab) for _ in range(PROMPT_TOKENS - 2)
            ]
            ids, _, final, _ = stack.generate(greedy_request(prompt, NEW_TOKENS), timeout_s=600)
            assert len(ids) == NEW_TOKENS and final.usage.prompt_tokens == PROMPT_TOKENS, (i, final)
            with done_lock:
                done += 1

        sample()
        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(run, range(REQUESTS)))
        stop.set()
        thread.join()
        sample()
        stack.assert_idle()
        final = stack.load()
        curve.close()
    finally:
        stack.stop()

    write_svg(OUT / "soak-memory.svg", samples, budget)
    peak = max(samples, key=lambda s: s["stack_bytes"])
    print(
        f"\nsoak-memory: {REQUESTS:,} requests of {PROMPT_TOKENS} prompt tokens in "
        f"{samples[-1]['seconds']:.0f} s; pool {idle.kv_pool_bytes / GIB:.2f} GiB ({idle.kv_blocks_total:,} "
        f"blocks); budget {budget / GIB:.2f} GiB; "
        f"peak RSS+shm {peak['stack_bytes'] / GIB:.2f} GiB at request {peak['requests_done']:,} "
        f"(RSS {peak['rss_bytes'] / GIB:.2f}, shm {peak['shm_bytes'] / GIB:.2f}); final committed pool "
        f"{final.kv_pool_committed_bytes / GIB:.2f} GiB; blocks used after {final.kv_blocks_used}, "
        f"swap slots used {final.swap_slots_used}; curve in {OUT}/soak-memory.{{csv,svg}}"
    )
    assert peak["stack_bytes"] <= budget, peak
    assert final.kv_blocks_used == 0 and final.swap_slots_used == 0, final
