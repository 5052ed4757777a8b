"""The size of the engine's and the stack's KV pool in a `cbserve bench offline` run.

Unless a pool size is given, the engine's and the stack's KV pools hold the workload twice over
(`workload_pool_blocks`) instead of a CPU host's default 4 GiB: every peer stays loaded between rounds,
and all of them at their default pool sizes outgrow a machine of a few tens of GiB. The pool's size does
not change a W1 step (it is prefaulted). The agreement measure's engines get a pool sized to the prose
instead (`prose_pool`).
"""

from __future__ import annotations

from typing import Any

from services.bench.workload import Workload
from services.common.config import CBConfig

POOL_SIZE_SETTINGS = ("num_blocks", "kv_cache_space", "max_memory_percent")
POOL_HEADROOM = 2  # beside the scheduler's safety margin, the warm-up and an earlier round's leftovers


def workload_pool_blocks(workload: Workload, page_size: int, choices: int = 1) -> int:
    """Blocks for every request of `workload` at its full length at once, each of its `choices` with
    pages of its own (an over-count where they share their prompt's), `POOL_HEADROOM` times over."""
    pages = sum(
        -(-(len(prompt) + new) // page_size)
        for prompt, new in zip(workload.prompts, workload.max_new_tokens, strict=True)
    )
    return POOL_HEADROOM * choices * pages


def sized_pool(settings: dict[str, Any], workload: Workload, choices: int = 1) -> dict[str, Any]:
    if any(settings.get(name) is not None for name in POOL_SIZE_SETTINGS):
        return settings
    page_size = settings.get("page_size", CBConfig.page_size)
    blocks = workload_pool_blocks(workload, page_size, choices)
    print(
        f"KV pool: {blocks} blocks of {page_size} tokens, the workload twice over "
        "(--num-blocks, --kv-cache-space or --max-memory-percent to choose)",
        flush=True,
    )
    return settings | {"num_blocks": blocks}


def prose_pool(settings: dict[str, Any], prose: list[list[int]]) -> dict[str, Any]:
    """`settings` with a pool that holds every prose prompt at once, `POOL_HEADROOM` times over: the
    timed engine's pool is sized to the workload, which may be smaller than the prose."""
    page_size = settings.get("page_size", CBConfig.page_size)
    pages = sum(-(-(len(p) + 1) // page_size) for p in prose)
    return {k: v for k, v in settings.items() if k not in POOL_SIZE_SETTINGS} | {
        "num_blocks": POOL_HEADROOM * pages
    }
