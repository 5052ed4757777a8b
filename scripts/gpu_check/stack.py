"""stack: `cbserve up` on a tiny Llama: CUDA IPC and pinned memory, a swap round trip, a worker
killed mid-stream."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from scripts.gpu_check.check import Check, Entry, attempt, failure, release_memory


def attach_facts(stack: Any) -> Entry:
    """What the latest worker logged at attach: how it mapped the pools, and its graphs."""
    attached = stack.events("attached to cachemgr")
    captured = stack.events("cuda graphs captured")
    facts: Entry = {"worker_pid": stack.child_pid("worker"), "attaches": len(attached)}
    if attached:
        facts |= {
            k: attached[-1].get(k) for k in ("kv_handle", "swap_registered", "swap_slots", "num_chunks")
        }
    if captured:
        facts["graphs"] = {k: captured[-1].get(k) for k in ("graphs", "seconds", "memory_mib")}
    return facts


def stack_section(check: Check) -> Entry:
    from tests.parity import generate_reference
    from tests.stack import Stack, greedy_request
    from tests.tiny_models import tiny_model_dir

    model_dir = tiny_model_dir("llama", check.workdir / "models")
    rng = random.Random(5)
    swap_prompts = [[rng.randint(3, 255) for _ in range(rng.randint(20, 60))] for _ in range(8)]
    kill_prompts = [[rng.randint(3, 255) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    swap_tokens, kill_tokens = (24, 40) if check.quick else (24, 200)
    expected_swap = generate_reference(model_dir, swap_prompts, swap_tokens, check.device)
    expected_kill = generate_reference(model_dir, kill_prompts, kill_tokens, check.device)
    release_memory()
    # 32 blocks of 8 tokens: the longest request fits (40 + 200 tokens), but not all at once, so that
    # both phases offload to the swap pool and restore.
    settings = {"page_size": 8, "num_blocks": 32, "max_batch_tokens": 32, "cpu_offload_space": 0.01}
    logs = check.workdir / "stack"
    logs.mkdir(exist_ok=True)
    started = time.monotonic()
    try:
        # float32 as the reference: `--dtype auto` would run a float32 checkpoint in bfloat16 on a GPU
        # or on a CPU that computes it natively.
        up_args = ["--device", check.device, "--dtype", "float32"]
        stack = Stack(model_dir, logs, up_args=up_args, start_timeout_s=check.stack_start_s(), **settings)
    except Exception as exc:  # its log says why: keep it
        return failure(exc) | {"log": str(max(logs.glob("stack-*.log"), default=""))}
    entry: Entry = {"start_s": round(time.monotonic() - started, 1)}
    try:
        entry["attach"] = attach_facts(stack)
        attempt(
            entry, "swap", swap_round_trip, stack, swap_prompts, swap_tokens, expected_swap, greedy_request
        )
        attempt(
            entry, "worker_kill", worker_kill, stack, kill_prompts, kill_tokens, expected_kill, greedy_request
        )
        attempt(entry, "idle_after", idle, stack)
    finally:
        entry["exit_code"] = stack.stop()
        entry["log"] = str(stack.log_path)
    return entry


def idle(stack: Any) -> bool:
    """Nothing running, waiting or held, and every block back (else AssertionError)."""
    stack.assert_idle()
    return True


def swap_round_trip(
    stack: Any,
    prompts: list[list[int]],
    new_tokens: int,
    expected: list[list[int]],
    request: Callable[..., Any],
) -> Entry:
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(stack.generate, [request(p, new_tokens) for p in prompts]))
    load = stack.load()
    return {
        "streams_equal_generate": [r[0] for r in results] == expected,
        "offloads": load.offloads,
        "swap_restores": load.swap_restores,
        "soft_resets": load.soft_resets,
    }


def worker_kill(
    stack: Any,
    prompts: list[list[int]],
    new_tokens: int,
    expected: list[list[int]],
    request: Callable[..., Any],
) -> Entry:
    streams = [stack.stub.Generate(request(p, new_tokens), timeout=300) for p in prompts]
    outputs = [list(next(s).chunk.token_ids) for s in streams]  # every request is running
    worker = stack.child_pid("worker")
    killed = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    for output, stream in zip(outputs, streams, strict=True):
        output += [t for message in stream if message.HasField("chunk") for t in message.chunk.token_ids]
    return {
        "streams_equal_generate": outputs == expected,
        "recovery_s": round(time.monotonic() - killed, 1),
        "tokens_each": new_tokens,
        "restarted": stack.child_pid("worker") != worker,
        "reattach": attach_facts(stack),
    }
