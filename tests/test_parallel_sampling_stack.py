"""n > 1 through cbserve.v1 on the three-process stacks: each chunk and final message names its choice;
greedy choices equal transformers; seeded choices repeat, each as a call of its own with seed + i; the
prompt is computed once (GetLoad's counters); a cancelled or expired call frees every choice; a choice
that fails ends the call with its error; `n` outside [1, --max-n] is INVALID_ARGUMENT.
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import pytest

from tests.stack import (
    CALL_TIMEOUT_S,
    Stack,
    assert_serves_exactly,
    cancel_after_chunks,
    greedy_request,
    tiny_prompt,
    trace,
)


def choices_of(stack: Stack, request: Any) -> tuple[dict[int, list[int]], dict[int, Any]]:
    """Each choice's token ids and final message, by index; nothing may follow the last final."""
    ids: dict[int, list[int]] = {}
    finals: dict[int, Any] = {}
    n = request.sampling.n if request.sampling.HasField("n") else 1
    for response in stack.stub.Generate(request, timeout=CALL_TIMEOUT_S, metadata=stack.metadata):
        assert len(finals) < n, "a message after the last final one"
        if response.HasField("chunk"):
            assert response.chunk.index not in finals, "a chunk after its choice's final message"
            ids.setdefault(response.chunk.index, []).extend(response.chunk.token_ids)
        else:
            assert response.final.index not in finals
            finals[response.final.index] = response.final
    assert sorted(finals) == list(range(n))
    return ids, finals


# The sync stack in the slow run: tests/test_parallel_sampling.py counts the same in a sync engine.
@pytest.mark.parametrize("stack_name", [pytest.param("tiny_stack", marks=pytest.mark.slow), "async_stack"])
def test_greedy_choices_compute_the_prompt_once(stack_name: str, request: pytest.FixtureRequest) -> None:
    stack: Stack = request.getfixturevalue(stack_name)
    prompt = tiny_prompt(70, 400)
    n, new = 8, 5
    call = greedy_request(prompt, new)
    call.sampling.n = n
    before = stack.wait_idle()
    ids, finals = choices_of(stack, call)
    after = stack.wait_idle()
    expected = stack.reference(prompt, new)
    assert [ids[i] for i in range(n)] == [expected] * n
    assert all(
        f.usage.prompt_tokens == len(prompt) and f.usage.completion_tokens == new for f in finals.values()
    )
    # The prompt's 400 tokens once, then every choice's decodes; nothing else ran meanwhile.
    assert after.computed_tokens - before.computed_tokens == len(prompt) + n * (new - 1)
    assert after.prefix_cache_queries - before.prefix_cache_queries == len(prompt)
    assert after.forks - before.forks == n - 1
    stack.assert_idle()


def test_seeded_choices_repeat_and_equal_calls_of_their_own(tiny_stack: Stack) -> None:
    prompt = tiny_prompt(71, 30)

    def call(n: int, seed: int) -> Any:
        request = greedy_request(prompt, 8)
        request.sampling.temperature, request.sampling.seed, request.sampling.n = 1.0, seed, n
        return request

    first, _ = choices_of(tiny_stack, call(4, 90))
    again, _ = choices_of(tiny_stack, call(4, 90))
    assert first == again
    assert len({tuple(c) for c in first.values()}) > 1
    for i in range(4):
        alone, _ = choices_of(tiny_stack, call(1, 90 + i))
        assert alone[0] == first[i], i
    tiny_stack.assert_idle()


def test_cancelling_a_call_frees_every_choice(async_stack: Stack) -> None:
    prompt = tiny_prompt(72, 40)
    request = greedy_request(prompt, async_stack.info.max_model_len - len(prompt))
    request.sampling.n = 4
    trace_id = trace("cancel-n")
    call = async_stack.stub.Generate(request, timeout=CALL_TIMEOUT_S, metadata=(("x-request-id", trace_id),))
    cancel_after_chunks(call)
    async_stack.wait_idle(timeout_s=10)
    async_stack.assert_idle()
    deadline = time.monotonic() + 5
    while sum(e.get("request_id") == trace_id for e in async_stack.events("request aborted by gateway")) < 4:
        assert time.monotonic() < deadline, async_stack.log_tail()
        time.sleep(0.05)
    assert_serves_exactly(async_stack, tiny_prompt(73))


def test_a_deadline_ends_every_choice(tiny_stack: Stack) -> None:
    prompt = tiny_prompt(76, 40)
    request = greedy_request(prompt, tiny_stack.info.max_model_len - len(prompt))
    request.sampling.n = 3
    with pytest.raises(grpc.RpcError) as info:
        list(tiny_stack.stub.Generate(request, timeout=1.0))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    tiny_stack.assert_idle()


def test_a_failing_choice_ends_the_call_with_its_error(tiny_stack: Stack) -> None:
    """The tiny model has no tokenizer, so the worker refuses each choice's constraint: the first
    refusal ends the call, and the other choices are aborted."""
    request = greedy_request(tiny_prompt(77), 4)
    request.sampling.n, request.sampling.regex = 3, "[ab]+"
    with pytest.raises(grpc.RpcError) as info:
        list(tiny_stack.stub.Generate(request, timeout=CALL_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tokenizer" in str(info.value.details())
    tiny_stack.assert_idle()
    assert_serves_exactly(tiny_stack, tiny_prompt(78))


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_invalid_argument(tiny_stack: Stack, n: int) -> None:
    request = greedy_request(tiny_prompt(74), 4)
    request.sampling.n = n
    with pytest.raises(grpc.RpcError) as info:
        list(tiny_stack.stub.Generate(request, timeout=CALL_TIMEOUT_S))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"sampling.n must be in [1, 16] (the server's --max-n), got {n}" in str(info.value.details())
    assert_serves_exactly(tiny_stack, tiny_prompt(75))
