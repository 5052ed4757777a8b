"""The `hf-cb` system of `cbserve bench offline`, and the one driver of transformers' continuous batching
that the benchmarks share (scripts/gpu_check drives it on a GPU, with its CUDA graphs).

transformers' `generate_batch` takes one `max_new_tokens` for all requests, so the driver goes through
the manager API instead (`init_continuous_batching` + `add_request`), request by request, so that each
keeps its own length. EOS: a request's `eos_token_id=-1` is an empty stop set (RequestState keeps only
ids >= 0); the generation config gets -1 too, or `init_continuous_batching` warns and sets it anyway.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch

from services.bench.offline.results import WARMUP_NEW_TOKENS, WARMUP_PROMPT, SystemResult
from services.bench.peer_runners.protocol import closed_loop
from services.bench.workload import Workload

if TYPE_CHECKING:
    from transformers import (
        ContinuousBatchingConfig,
        GenerationConfig,
        GenerationMixin,
        PreTrainedModel,
    )
    from transformers.generation.continuous_batching.utils import WorkloadHints

# transformers' continuous batching, configured as when it was first measured as the baseline
# (docs/performance-log.md); fixed whatever engine settings are benchmarked.
HF_CB_SETTINGS: dict[str, Any] = {"page_size": 32, "num_blocks": 512, "max_batch_tokens": 512}


@torch.inference_mode()
def run_hf_cb(model: PreTrainedModel, workload: Workload, max_in_flight: int | None) -> SystemResult:
    """transformers' continuous batching at `HF_CB_SETTINGS`, on sdpa, at most `max_in_flight` requests
    in flight (all at once without)."""
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen_config = GenerationConfig(
        do_sample=False, eos_token_id=-1, max_new_tokens=max(workload.max_new_tokens)
    )
    # auto_switch_to_flash off: the baseline is sdpa, and a flash kernel installed later must not change it.
    cb_config = ContinuousBatchingConfig(**HF_CB_SETTINGS, auto_switch_to_flash=False)
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in workload.prompts),
        max_generated_length=max(workload.max_new_tokens),
        num_requests=workload.num_requests,
    )
    with started_manager(model, gen_config, cb_config, hints) as manager:
        hf_cb_collect(manager, [WARMUP_PROMPT], [WARMUP_NEW_TOKENS], "warmup", 1)
        start = time.perf_counter()
        in_flight = max_in_flight or workload.num_requests
        outputs = hf_cb_collect(manager, workload.prompts, workload.max_new_tokens, "w1", in_flight)
        wall = time.perf_counter() - start
        resolved = manager.continuous_batching_config
        extra = {
            "settings": {
                **HF_CB_SETTINGS,
                "attn_implementation": model.config._attn_implementation,
                "max_requests_per_batch": resolved.max_requests_per_batch,
            }
        }
    return SystemResult("hf-cb", wall, outputs, workload.total_prompt_tokens, extra=extra)


@contextmanager
def started_manager(
    model: PreTrainedModel,
    generation_config: GenerationConfig,
    continuous_batching_config: ContinuousBatchingConfig,
    workload_hints: WorkloadHints | None = None,
    stop_timeout_s: float | None = None,
) -> Iterator[Any]:
    """transformers' continuous-batching manager on `model`, warmed up and started; stopped and
    destroyed on the way out.

    Without `stop_timeout_s` the stop waits for the generation thread to finish what it holds. With
    it the stop is hard and bounded, and a manager whose thread is still running after it is left
    undestroyed: after a failure requests may be left, and a hung thread must not hang the caller too.
    `workload_hints` is passed on only when given, so that a transformers without them still runs.
    """
    hints = {} if workload_hints is None else {"workload_hints": workload_hints}
    manager = cast("GenerationMixin", model).init_continuous_batching(
        generation_config=generation_config, continuous_batching_config=continuous_batching_config, **hints
    )
    try:
        manager.warmup()
        manager.start()
        yield manager
    finally:
        if stop_timeout_s is None:
            manager.stop(block=True)
            manager.destroy()
        else:
            manager.stop(block=True, timeout=stop_timeout_s, hard_stop=True)
            if not manager.is_running():
                manager.destroy()


def hf_cb_collect(
    manager: Any,
    prompts: list[list[int]],
    new_tokens: list[int],
    tag: str,
    max_in_flight: int,
    deadline: float | None = None,
) -> list[list[int]]:
    """Each prompt through a started manager, `new_tokens[i]` tokens for prompt i, EOS ignored, at most
    `max_in_flight` requests at a time; returns the generated ids in prompt order.

    `deadline` (a `time.monotonic()` time) bounds the wait: a stalled baseline must not cost the time
    of what its caller runs after it. Whether its thread stopped is checked each second a result is
    awaited, and so is the deadline."""
    ids = [f"{tag}_{i}" for i in range(len(prompts))]
    done: dict[str, list[int]] = {}

    def submit(i: int) -> None:
        manager.add_request(prompts[i], request_id=ids[i], max_new_tokens=new_tokens[i], eos_token_id=-1)

    def step() -> int:
        result = manager.get_result(timeout=1.0)
        if result is None:
            stalled = deadline is not None and time.monotonic() > deadline
            if stalled or not manager.is_running():
                state = "timed out" if stalled else "generation thread stopped"
                raise RuntimeError(f"hf-cb {state} with {len(ids) - len(done)} requests left")
            return 0
        if not result.is_finished():
            return 0
        if result.error is not None:
            raise RuntimeError(f"hf-cb request {result.request_id} failed: {result.error}")
        done[result.request_id] = list(result.generated_tokens)
        return 1

    closed_loop(len(prompts), max_in_flight, submit, step)
    return [done[i] for i in ids]
