"""The three-process stack end to end: many concurrent gRPC streams, each equal to transformers'
greedy `generate`, under chunked prefill, padding, prefix-cache hits, offloading to the swap pool and
soft resets, with async batching off and on; and nothing held afterwards (GetLoad back at its idle
baseline)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from services.bench.serve.metrics import parse_histogram, scrape
from services.gateway.api import pb
from tests.stack import Stack, greedy_request, hf_greedy

NEW_TOKENS = 12


def prompts_with_shared_prefixes(seed: int, groups: int, per_group: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randint(3, 255) for _ in range(rng.randint(16, 40))]
        prompts += [
            prefix + [rng.randint(3, 255) for _ in range(rng.randint(1, 30))] for _ in range(per_group)
        ]
    rng.shuffle(prompts)
    return prompts


def run_concurrently(stack: Stack, requests: list[Any]) -> list[tuple[list[int], str, Any, int]]:
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(stack.generate, requests))


@pytest.mark.parametrize("stack_name", ["tiny_stack", "async_stack"])
def test_concurrent_streams_match_generate(stack_name: str, request: pytest.FixtureRequest) -> None:
    """Chunked (max_batch_tokens 24), padded, prefix-cached: 16 clients at once."""
    tiny_stack: Stack = request.getfixturevalue(stack_name)
    async_batching = stack_name == "async_stack"
    assert f'"async_batching": {str(async_batching).lower()}' in tiny_stack.log_path.read_text()
    prompts = prompts_with_shared_prefixes(seed=1, groups=4, per_group=4)
    expected = [tiny_stack.reference(p, NEW_TOKENS) for p in prompts]
    before = tiny_stack.load()
    results = run_concurrently(tiny_stack, [greedy_request(p, NEW_TOKENS) for p in prompts])
    for prompt, want, (ids, _, final, _) in zip(prompts, expected, results, strict=True):
        assert ids == want
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt), NEW_TOKENS)
    after = tiny_stack.load()
    assert after.prefix_cache_hits > before.prefix_cache_hits, after
    assert sum(r[2].usage.cached_prompt_tokens for r in results) > 0
    tiny_stack.assert_idle()
    assert_step_total_is_wall_time(tiny_stack, async_batching)


def assert_step_total_is_wall_time(stack: Stack, async_batching: bool) -> None:
    """The step profile's total is each step's wall time: the phases' sum in sync mode; with async
    batching the forward and sampling overlap the rest and are not counted twice."""
    histogram = parse_histogram(scrape(f"http://127.0.0.1:{stack.metrics_port}/metrics"))
    steps = {phase: total for phase, (total, _) in histogram.items()}
    phases = sum(t for phase, t in steps.items() if phase != "total")
    overlapped = steps["forward"] + steps["sample"] if async_batching else 0.0
    assert steps["total"] == pytest.approx(phases - overlapped, rel=0.02), steps
    assert steps["wait"] <= overlapped or not async_batching, steps


# "swap" (sync) in the slow run: "swap_async" offloads to the same swap pool through the same cachemgr,
# scripts/gpu_check's stack section (tests/test_gpu_check.py) round-trips a sync stack's streams
# through it, and tests/test_engine_parity.py swaps in sync engines of every family.
@pytest.fixture(
    scope="module", params=[pytest.param("swap", marks=pytest.mark.slow), "soft_reset", "swap_async"]
)
def pressure_stack(
    request: pytest.FixtureRequest,
    tiny_models: Callable[[str], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, Stack]]:
    """A cache of 16 blocks of 8 tokens: the clients cannot all be resident, so requests are offloaded
    (to the swap pool, or by soft reset under prefill_first), also with async batching."""
    settings: dict[str, Any] = {"page_size": 8, "num_blocks": 16, "max_batch_tokens": 32}
    if request.param.startswith("swap"):
        settings["cpu_offload_space"] = 0.01
    else:
        settings["scheduler_type"] = "prefill_first"
    settings["use_async_batching"] = request.param.endswith("async")
    stack = Stack(tiny_models("llama"), tmp_path_factory.mktemp(request.param), **settings)
    yield request.param, stack
    stack.stop()


def test_offloading_keeps_streams_exact(pressure_stack: tuple[str, Stack]) -> None:
    kind, stack = pressure_stack
    rng = random.Random(5)
    prompts = [[rng.randint(3, 255) for _ in range(rng.randint(20, 60))] for _ in range(8)]
    expected = [stack.reference(p, 20) for p in prompts]
    results = run_concurrently(stack, [greedy_request(p, 20) for p in prompts])
    assert [r[0] for r in results] == expected
    load = stack.load()
    if kind.startswith("swap"):
        # The swap pool never fills here: every request that went out came back, none recomputed.
        assert load.offloads > 0 and load.swap_restores == load.offloads and load.soft_resets == 0, load
    else:
        assert load.soft_resets > 0 and load.offloads == load.swap_restores == 0, load
    stack.assert_idle()


CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "How do plants make food?",
    "Say hello in Spanish.",
    "What is 12 times 12?",
]


def test_smollm2_chat_streams_match_generate(smol_stack: Stack) -> None:
    """Real chat prompts rendered by the gateway, EOS active: ids and text equal transformers'."""
    tokenizer = AutoTokenizer.from_pretrained(smol_stack.model_dir)
    requests, expected = [], []
    for question in CHATS:
        messages = [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompt = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        expected.append(hf_greedy(smol_stack.model_dir, prompt, 24, eos=True))
        request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=question)]))
        request.sampling.temperature = 0.0
        request.stopping.max_tokens = 24
        requests.append(request)
    for want, (ids, text, final, _) in zip(expected, run_concurrently(smol_stack, requests), strict=True):
        assert ids == want
        assert text == tokenizer.decode(want, skip_special_tokens=True)
        eos = bool(want) and want[-1] in smol_stack.info.eos_token_ids
        assert final.finish_reason == (pb.FINISH_REASON_EOS if eos else pb.FINISH_REASON_LENGTH)
    smol_stack.assert_idle()


def test_a_burst_sent_to_an_idle_stack_is_prefilled_in_one_step(
    tiny_models: Callable[[str], Path], tmp_path: Path
) -> None:
    """Calls sent together reach the worker one by one, over a few ms; while none has started it
    gathers those still coming (`arrival_gap_ms`), so one forward prefills and samples them all. A
    wave as large as the one that just finished (closed-loop clients coming back) starts once it is
    all in, without waiting out the gap."""
    gap_s = 0.5
    stack = Stack(tiny_models("llama"), tmp_path, page_size=8, num_blocks=64, arrival_gap_ms=gap_s * 1e3)
    try:

        def totals() -> tuple[float, float]:
            """(forwards, seconds requests spent queued) so far."""
            text = scrape(f"http://127.0.0.1:{stack.metrics_port}/metrics")
            forwards = parse_histogram(text).get("forward", (0.0, 0.0))[1]
            queued = parse_histogram(text, "cbserve:request_queue_time_seconds").get("", (0.0, 0.0))[0]
            return forwards, queued

        def wave(seed: int) -> tuple[float, float]:
            """(forwards, queue seconds) the wave took."""
            rng = random.Random(seed)
            prompts = [[rng.randint(3, 255) for _ in range(20)] for _ in range(4)]
            before = totals()
            results = run_concurrently(stack, [greedy_request(p, 1) for p in prompts])
            assert [r[0] for r in results] == [stack.reference(p, 1) for p in prompts]
            stack.assert_idle()
            after = totals()
            return after[0] - before[0], after[1] - before[1]

        forwards, queued = wave(9)
        assert forwards == 1
        assert queued >= gap_s, queued  # the first arrival waited the gap out at least
        forwards, queued = wave(10)
        assert forwards == 1
        assert queued < gap_s / 2, queued  # four waits, all ended by the fourth arrival
    finally:
        stack.stop()
