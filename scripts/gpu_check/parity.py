"""parity: tiny models, fp32, greedy tokens with graphs on and off against transformers `generate`."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from scripts.gpu_check.check import Check, Entry, attempt, graph_facts, path_facts, refused_or, release_memory
from services.common.switches import switched
from services.worker import layer_forward

# Chunked prefill (7 prompt tokens a request a step), a pool too small for three requests (offloads to
# the swap pool and restores), and a second round that shares a prefix with the first (prefix hits).
PARITY_SETTINGS = {
    "page_size": 8,
    "max_batch_tokens": 16,
    "long_prefill_token_threshold": 7,
    "cpu_offload_space": 0.01,
    "kv_padding_interval_size": 16,
}
PARITY_NEW_TOKENS = 20


def parity_section(check: Check) -> Entry:
    from tests.parity import SWAP_BLOCKS, generate_reference, make_prompts, reference_attn
    from tests.tiny_models import tiny_model_dir

    shared = [random.Random(3).randint(3, 255) for _ in range(40)]
    rounds = [make_prompts(11, 3, shared), make_prompts(12, 4, shared)]
    entry: Entry = {}
    for family in ("llama",) if check.quick else ("llama", "gemma2"):
        model_dir = tiny_model_dir(family, check.workdir / "models")
        attn = reference_attn(family)
        expected = [generate_reference(model_dir, r, PARITY_NEW_TOKENS, check.device, attn) for r in rounds]
        settings = PARITY_SETTINGS | {"num_blocks": SWAP_BLOCKS[family], "use_async_batching": False}
        runs: Entry = {}
        attempt(runs, "graphs", parity_run, check, model_dir, settings, rounds, expected, True)
        attempt(runs, "eager", parity_run, check, model_dir, settings, rounds, expected, False)
        async_settings = settings | {"use_async_batching": True}
        attempt(
            runs, "async", refused_or, parity_run, check, model_dir, async_settings, rounds, expected, True
        )
        if check.device == "cuda" and family == "llama":
            # The fallback too: transformers' layers where ours (the Triton forward on a GPU) would run.
            attempt(
                runs,
                "graphs_transformers_layers",
                parity_run,
                check,
                model_dir,
                settings,
                rounds,
                expected,
                True,
                "transformers",
            )
        entry[family] = runs
        release_memory()
    return entry


def parity_run(
    check: Check,
    model_dir: Path,
    settings: Entry,
    rounds: list[list[list[int]]],
    expected: Any,
    graphs: bool,
    forward: str | None = None,
) -> Entry:
    """`forward`: CBSERVE_FORWARD for the engine (None: as it is, `auto`)."""
    with switched(layer_forward.SWITCH, forward), check.engine(model_dir, settings, graphs, True) as engine:
        outputs = [engine.generate(r, PARITY_NEW_TOKENS, ignore_eos=True) for r in rounds]
        stats = engine.stats()
        builder = engine.runner.builder
        return {
            **path_facts(engine),
            "equal_generate": outputs == expected,
            "prompt_chunks": builder.prompt_chunks,
            "padded_queries": builder.padded_queries,
            "prefix_hit_tokens": stats["prefix_hit_tokens"],
            "offloads": stats["offloads"],
            "swap_restores": stats["swap_restores"],
            "soft_resets": stats["soft_resets"],
            "graphs": graph_facts(engine),
        }
