"""n > 1 in the engine: the choices after the first *fork* from it (`Engine.add_request(fork_of=...)`).

The prompt is computed once and its full pages are held once, which the counters prove (tokens
computed, forks, blocks in use at the fork); a partly filled last page is copied per choice. Every
choice's greedy output equals transformers' `generate`, a seeded choice equals the same request run
alone, and a fork that cannot happen (its parent has sampled already) runs on its own with the same
tokens. Aborting choices frees every block. Async batching off and on; the 16-bit and int8 KV pages
give each choice the same tokens with and without the fork.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.worker.engine import Engine
from services.worker.request import Request
from tests.parity import assert_no_leak, generate_reference

PAGE = 8


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def engine(request: pytest.FixtureRequest, tiny_models: Callable[[str], Path]) -> Iterator[Engine]:
    with Engine.from_pretrained(
        tiny_models("llama"),
        num_blocks=160,
        page_size=PAGE,
        max_batch_tokens=64,
        use_async_batching=request.param,
    ) as e:
        yield e


def _prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(3, 255) for _ in range(length)]


def _add_choices(engine: Engine, prompt: list[int], params: list[SamplingParams], name: str) -> list[Request]:
    first = engine.add_request(prompt, params[0], request_id=f"{name}.0")
    rest = [
        engine.add_request(prompt, p, request_id=f"{name}.{i}", fork_of=first.request_id)
        for i, p in enumerate(params[1:], 1)
    ]
    return [first, *rest]


@pytest.mark.parametrize("length", [5 * PAGE, 5 * PAGE + 3], ids=["whole-pages", "partial-page"])
def test_greedy_choices_equal_transformers_and_the_prompt_is_computed_once(
    engine: Engine, tiny_models: Callable[[str], Path], length: int
) -> None:
    n, new = 6, 7
    prompt = _prompt(length)
    choices = _add_choices(engine, prompt, [SamplingParams(max_new_tokens=new, ignore_eos=True)] * n, "g")
    held_at_fork = None
    while engine.has_work:
        engine.step()
        if held_at_fork is None and any(c.output_ids or c.num_placeholders for c in choices[1:]):
            held_at_fork = engine.stats()["used_blocks"]
    expected = generate_reference(tiny_models("llama"), [prompt], new, "cpu")[0]
    assert [c.output_ids for c in choices] == [expected] * n
    stats = engine.stats()
    assert stats["forks"] == n - 1
    # Each choice computes its own decodes; the prompt's tokens were computed once, by the first.
    assert stats["computed_tokens"] == length + n * (new - 1)
    assert stats["prefix_queries"] == length  # the forks looked nothing up
    # At the fork: the prompt's pages once, plus each fork's own copy of a partly filled last page.
    pages = -(-length // PAGE)
    copies = (n - 1) if length % PAGE else 0
    assert held_at_fork == pages + copies
    assert_no_leak(engine)


def test_seeded_choices_equal_each_run_alone(engine: Engine) -> None:
    prompt = _prompt(3 * PAGE + 5, seed=1)
    params = [
        SamplingParams(temperature=1.0, top_k=40, seed=100 + i, max_new_tokens=10, ignore_eos=True)
        for i in range(4)
    ]
    forked = _add_choices(engine, prompt, params, "s")
    engine.run_until_done()
    assert engine.stats()["forks"] == 3
    alone = engine.generate([prompt] * 4, 10, ignore_eos=True, temperature=1.0, top_k=40, seed=100)
    assert [c.output_ids for c in forked] == alone
    assert len({tuple(c.output_ids) for c in forked}) > 1  # the choices do differ
    assert_no_leak(engine)


def test_a_fork_after_its_parent_sampled_runs_on_its_own(
    engine: Engine, tiny_models: Callable[[str], Path]
) -> None:
    prompt = _prompt(2 * PAGE + 1, seed=2)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    first = engine.add_request(prompt, params, request_id="late.0")
    while not first.output_ids:
        engine.step()
    late = engine.add_request(prompt, params, request_id="late.1", fork_of="late.0")
    engine.run_until_done()
    expected = generate_reference(tiny_models("llama"), [prompt], 5, "cpu")[0]
    assert first.output_ids == late.output_ids == expected
    assert engine.stats()["forks"] == 0
    assert_no_leak(engine)


def test_aborting_the_choices_at_any_point_frees_every_block(engine: Engine) -> None:
    prompt = _prompt(4 * PAGE + 2, seed=3)
    for steps in (0, 1, 3, 6, 9):
        choices = _add_choices(
            engine, prompt, [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 5, f"a{steps}"
        )
        for _ in range(steps):
            engine.step()
        for c in choices:
            engine.abort(c.request_id)
        engine.finish_running()
        engine.run_until_done()
        assert_no_leak(engine)
    # The parent alone aborted before the fork: its siblings go on by themselves.
    choices = _add_choices(engine, prompt, [SamplingParams(max_new_tokens=4, ignore_eos=True)] * 3, "orphans")
    engine.abort(choices[0].request_id)
    engine.run_until_done()
    assert all(len(c.output_ids) == 4 for c in choices[1:])
    assert_no_leak(engine)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "int8"])
def test_lower_precision_forks_give_the_tokens_of_separate_runs(
    tiny_models: Callable[[str], Path], kv_cache_dtype: str
) -> None:
    """The copied last page holds the same bytes (int8 rows with their scales), so each choice sees the
    KV it would have computed itself: the same tokens."""
    prompt = _prompt(3 * PAGE + 6, seed=4)
    params = [
        SamplingParams(temperature=0.8, seed=7 + i, max_new_tokens=8, ignore_eos=True) for i in range(3)
    ]
    with Engine.from_pretrained(
        tiny_models("llama"),
        dtype=torch.bfloat16,
        kv_cache_dtype=kv_cache_dtype,
        num_blocks=96,
        page_size=PAGE,
        max_batch_tokens=64,
    ) as engine:
        forked = _add_choices(engine, prompt, params, "lp")
        engine.run_until_done()
        assert engine.stats()["forks"] == 2
        alone = engine.generate([prompt] * 3, 8, ignore_eos=True, temperature=0.8, seed=7)
        assert [c.output_ids for c in forked] == alone
        assert_no_leak(engine)
