"""Structured output at its edges in the engine (issue 50), on a tiny model over SmolLM2's tokenizer:

- a request whose grammar is still compiling counts as waiting (it sits outside the scheduler, and a
  worker whose requests all compile must not look idle to whoever balances load on `waiting`);
- `min_new_tokens` past the grammar's end: the grammar's end wins (vLLM's choice), so the output stays
  valid and finishes at its stop token, where forbidding EOS used to leave no token to sample and the
  request ended in an error after a token the grammar rejects; `min_new_tokens` still holds where the
  grammar allows going on.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from services.common.sampling_params import Constraint, SamplingParams
from services.worker.engine import Engine
from services.worker.request import FinishReason

ASYNC = pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
PROMPT = "Is the sky blue? Answer:"


@pytest.fixture(scope="module")
def tiny_text(tiny_text_model: Path) -> Path:
    """A tiny random Llama over SmolLM2's tokenizer: constrained text at a tiny model's speed."""
    return tiny_text_model


@pytest.fixture(scope="module")
def tokenizer(tiny_text: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_text)


@pytest.fixture(scope="module")
def engines(tiny_text: Path) -> Iterator[dict[bool, Engine]]:
    engines = {
        a: Engine.from_pretrained(tiny_text, num_blocks=64, use_async_batching=a) for a in (False, True)
    }
    yield engines
    for engine in engines.values():
        engine.close()


def prompt_ids(tokenizer: Any) -> list[int]:
    return list(tokenizer(PROMPT).input_ids)


def assert_idle(engine: Engine) -> None:
    stats = engine.stats()
    assert (stats["running"], stats["waiting"], stats["used_blocks"]) == (0, 0, 0), stats
    assert not engine.has_work


def test_compiling_request_counts_as_waiting(tiny_text: Path, tokenizer: Any) -> None:
    """The compile pool is kept busy, so the grammar cannot compile until the test lets it: the
    constrained request waits across steps while a free one runs, and is counted all along."""
    with Engine.from_pretrained(tiny_text, num_blocks=64) as engine:
        release = threading.Event()
        pool = engine.grammars()._pool
        blockers = [pool.submit(release.wait, 30) for _ in range(pool._max_workers)]
        try:
            constrained = engine.add_request(
                prompt_ids(tokenizer),
                SamplingParams(max_new_tokens=8, constraint=Constraint("regex", "[a-z]{1,8}")),
            )
            free = engine.add_request(
                prompt_ids(tokenizer), SamplingParams(max_new_tokens=8, ignore_eos=True)
            )
            stats = engine.stats()
            assert (stats["running"], stats["waiting"]) == (0, 2), stats
            for _ in range(3):
                engine.step()
                stats = engine.stats()
                assert (stats["running"], stats["waiting"]) == (1, 1), stats
            assert free.output_ids and not constrained.output_ids and not constrained.finished
        finally:
            release.set()
        assert all(b.result(timeout=30) for b in blockers)
        engine.run_until_done()
        assert constrained.finish_reason in (FinishReason.EOS, FinishReason.LENGTH), constrained.error
        assert re.fullmatch("[a-z]{1,8}", tokenizer.decode(constrained.output_ids, skip_special_tokens=True))
        assert_idle(engine)


@ASYNC
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_past_the_grammars_end_stops_at_its_end(
    engines: dict[bool, Engine], tokenizer: Any, async_batching: bool, temperature: float
) -> None:
    engine = engines[async_batching]
    eos = engine.scheduler.eos_token_ids
    params = SamplingParams(
        max_new_tokens=16,
        min_new_tokens=10,
        temperature=temperature,
        seed=3,
        constraint=Constraint.choice(["yes", "no"]),
    )
    reqs = [engine.add_request(prompt_ids(tokenizer), params) for _ in range(2)]
    engine.run_until_done()
    for req in reqs:
        assert req.finish_reason is FinishReason.EOS, (req.finish_reason, req.error, req.output_ids)
        assert req.output_ids[-1] in eos and len(req.output_ids) < params.min_new_tokens, req.output_ids
        assert tokenizer.decode(req.output_ids[:-1]) in ("yes", "no"), req.output_ids
    assert_idle(engine)


@ASYNC
def test_min_tokens_holds_while_the_grammar_may_go_on(
    engines: dict[bool, Engine], tokenizer: Any, async_batching: bool
) -> None:
    """The grammar may end after any letter and may go on without end: EOS stays forbidden for the
    first `min_new_tokens` tokens. A +100 bias on EOS makes it the greedy pick as soon as it
    is allowed, so the output is exactly `min_new_tokens` letters' tokens and EOS."""
    engine = engines[async_batching]
    eos = tokenizer.eos_token_id
    assert eos in engine.scheduler.eos_token_ids
    params = SamplingParams(
        max_new_tokens=12,
        min_new_tokens=5,
        logit_bias=((eos, 100.0),),
        constraint=Constraint("regex", "[a-z]+"),
    )
    req = engine.add_request(prompt_ids(tokenizer), params)
    engine.run_until_done()
    assert req.finish_reason is FinishReason.EOS, (req.finish_reason, req.error, req.output_ids)
    assert len(req.output_ids) == params.min_new_tokens + 1 and req.output_ids[-1] == eos, req.output_ids
    text = tokenizer.decode(req.output_ids[:-1])
    assert re.fullmatch("[a-z]+", text), text
    assert_idle(engine)
