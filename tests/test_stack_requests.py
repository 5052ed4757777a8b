"""The public API end to end: real gRPC calls against the three-process stacks (tests/stack.py).

Covered: every kind of bad request gets its exact status code and leaves the stack serving and idle;
cancellation and deadlines free the request's blocks; stop strings and stop token ids; output options
and logprobs; x-request-id; usage and timings (prefix-cache hits); Tokenize and GetModelInfo;
Prometheus metrics.

Not here: RESOURCE_EXHAUSTED needs a stack with a tiny `max_queue_size` (these stacks keep the 1024
default and are not to be flooded); it is tested with its own stack elsewhere.
"""

from __future__ import annotations

import math
import random
import re
import threading
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch
from transformers import AutoTokenizer

from services.cachemgr.sizing import meminfo_bytes
from services.common.kv_geometry import RESERVED_CHUNKS, KVGeometry
from services.common.sampling_params import SamplingParams
from services.gateway.api import pb
from services.gateway.text_generation import LOGPROBS_PER_CHUNK
from tests.openai_penalties import openai_greedy, penalized_request
from tests.parity import reference_prompt_logprobs
from tests.stack import (
    CALL_TIMEOUT_S,
    CHAT,
    Stack,
    assert_aborted_in_worker,
    assert_serves_exactly,
    cancel_after_chunks,
    chat_request,
    greedy_request,
    tiny_prompt,
    trace,
)
from tests.tiny_models import tiny_config

SMOL_VOCAB_SIZE = 49152


def status_of(stack: Stack, request: Any, timeout_s: float = 10.0) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        list(stack.stub.Generate(request, timeout=timeout_s))
    return info.value.code()


@pytest.fixture(scope="module")
def smol_tokenizer(smol_stack: Stack) -> Any:
    return AutoTokenizer.from_pretrained(smol_stack.model_dir, local_files_only=True)


# ------------------------------------------------------------------------------------ bad requests

Build = Callable[[Stack], Any]


def _greedy(**stopping: Any) -> Build:
    return lambda s: greedy_request(tiny_prompt(1), 4, **stopping)


def _sampling(**fields: Any) -> Build:
    def build(s: Stack) -> Any:
        request = greedy_request(tiny_prompt(1), 4)
        for name, value in fields.items():
            setattr(request.sampling, name, value)
        return request

    return build


def _empty_ids(s: Stack) -> Any:
    request = greedy_request([], 4)
    request.token_ids.SetInParent()
    return request


def _logprobs(s: Stack) -> Any:
    request = greedy_request(tiny_prompt(1), 4)
    request.output.logprobs = 21
    return request


def _prompt_logprobs(s: Stack) -> Any:
    request = greedy_request(tiny_prompt(1), 4)
    request.output.prompt_logprobs = 21
    return request


def _no_messages(s: Stack) -> Any:
    request = greedy_request([], 4)
    request.chat.SetInParent()
    return request


BAD_REQUESTS: dict[str, tuple[str, Build]] = {
    "no_input": ("tiny_stack", lambda s: pb.GenerateRequest()),
    "empty_token_list": ("tiny_stack", _empty_ids),
    "out_of_vocab_id": ("tiny_stack", lambda s: greedy_request([5, s.vocab_size], 4)),
    "negative_id": ("tiny_stack", lambda s: greedy_request([5, -1], 4)),
    "temperature_negative": ("tiny_stack", _sampling(temperature=-1.0)),
    "temperature_1000": ("tiny_stack", _sampling(temperature=1000.0)),
    "top_p_0": ("tiny_stack", _sampling(top_p=0.0)),
    "top_p_1.5": ("tiny_stack", _sampling(top_p=1.5)),
    "top_k_negative": ("tiny_stack", _sampling(top_k=-1)),
    "min_p_2": ("tiny_stack", _sampling(min_p=2.0)),
    "repetition_penalty_0": ("tiny_stack", _sampling(repetition_penalty=0.0)),
    "max_tokens_0": ("tiny_stack", lambda s: greedy_request(tiny_prompt(1), 0)),
    "min_tokens_over_max": ("tiny_stack", _greedy(min_tokens=5)),
    "prompt_plus_max_tokens_over_model_len": (
        "tiny_stack",
        lambda s: greedy_request(tiny_prompt(1), s.info.max_model_len),
    ),
    "prompt_over_model_len": (
        "tiny_stack",
        lambda s: greedy_request(tiny_prompt(2, s.info.max_model_len), 1),
    ),
    "logprobs_21": ("tiny_stack", _logprobs),
    "prompt_logprobs_21": ("tiny_stack", _prompt_logprobs),
    "stop_token_id_out_of_vocab": ("tiny_stack", lambda s: greedy_request([5, 6], 4, stop_token_ids=[256])),
    "seed_2_63": ("tiny_stack", _sampling(seed=2**63)),
    "text_without_tokenizer": ("tiny_stack", lambda s: pb.GenerateRequest(text="hello")),
    "chat_unknown_role": ("smol_stack", lambda s: chat_request([{"role": "wizard", "content": "hi"}], 4)),
    "chat_no_messages": ("smol_stack", _no_messages),
    "stop_string_empty": ("smol_stack", lambda s: chat_request(CHAT, 4, stop=["ok", ""])),
    "stop_strings_17": ("smol_stack", lambda s: chat_request(CHAT, 4, stop=[f"s{i}" for i in range(17)])),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_invalid_argument_and_leaves_the_stack_serving(
    case: str, request: pytest.FixtureRequest
) -> None:
    stack_name, build = BAD_REQUESTS[case]
    stack: Stack = request.getfixturevalue(stack_name)
    assert status_of(stack, build(stack)) == grpc.StatusCode.INVALID_ARGUMENT
    prompt = tiny_prompt(3) if stack_name == "tiny_stack" else [504, 3458, 282, 4649, 314]
    assert_serves_exactly(stack, prompt)


def _logit_bias(bias: dict[int, float]) -> Build:
    def build(s: Stack) -> Any:
        request = greedy_request(tiny_prompt(1), 4)
        request.sampling.logit_bias.update(bias)
        return request

    return build


PENALTY_RANGE = "must be in [-2, 2], got"
BIAS_RANGE = "sampling.logit_bias[5] must be in [-100, 100], got"
BIAS_VOCAB = "sampling.logit_bias token ids out of vocabulary (size 256):"

# case -> (request, what the status details must say): each names the field and the value.
BAD_PENALTIES_AND_BIASES: dict[str, tuple[Build, str]] = {
    "presence_penalty_2.5": (
        _sampling(presence_penalty=2.5),
        f"sampling.presence_penalty {PENALTY_RANGE} 2.5",
    ),
    "presence_penalty_nan": (
        _sampling(presence_penalty=math.nan),
        f"sampling.presence_penalty {PENALTY_RANGE} nan",
    ),
    "frequency_penalty_-3": (
        _sampling(frequency_penalty=-3.0),
        f"sampling.frequency_penalty {PENALTY_RANGE} -3.0",
    ),
    "frequency_penalty_inf": (
        _sampling(frequency_penalty=math.inf),
        f"sampling.frequency_penalty {PENALTY_RANGE} inf",
    ),
    "logit_bias_out_of_vocab": (_logit_bias({256: 1.0}), f"{BIAS_VOCAB} [256]"),
    "logit_bias_negative_id": (_logit_bias({-1: 1.0}), f"{BIAS_VOCAB} [-1]"),
    "logit_bias_150": (_logit_bias({5: 150.0}), f"{BIAS_RANGE} 150.0"),
    "logit_bias_-101": (_logit_bias({5: -101.0}), f"{BIAS_RANGE} -101.0"),
    "logit_bias_301_entries": (
        _logit_bias(dict.fromkeys(range(301), 1.0)),
        "sampling.logit_bias holds 301 entries; at most 300",
    ),
}


@pytest.mark.parametrize("case", list(BAD_PENALTIES_AND_BIASES))
def test_bad_penalty_or_bias_is_invalid_argument_naming_field_and_value(tiny_stack: Stack, case: str) -> None:
    build, message = BAD_PENALTIES_AND_BIASES[case]
    with pytest.raises(grpc.RpcError) as info:
        list(tiny_stack.stub.Generate(build(tiny_stack), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in (info.value.details() or "")
    assert_serves_exactly(tiny_stack, tiny_prompt(3))


def test_penalties_and_logit_bias_equal_the_reference(tiny_stack: Stack) -> None:
    """Greedy with presence/frequency penalties and a logit bias (edge values included) streams what
    transformers' generate gives with OpenAI's formula; a +100 bias forces its token."""
    prompt = tiny_prompt(7, 12)
    plain = tiny_stack.reference(prompt, 16)
    params = SamplingParams(
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        logit_bias=((plain[0], -100.0), (plain[3], 2.5), (9, 0.75)),
    )
    ids, _, final, _ = tiny_stack.generate(penalized_request(prompt, 16, params), timeout_s=CALL_TIMEOUT_S)
    assert ids == openai_greedy(tiny_stack.model_dir, prompt, 16, params) != plain
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    forced = SamplingParams(logit_bias=((17, 100.0),))
    ids, _, _, _ = tiny_stack.generate(penalized_request(prompt, 6, forced), timeout_s=CALL_TIMEOUT_S)
    assert ids == [17] * 6
    tiny_stack.assert_idle()


def test_edge_values_are_accepted_and_a_seed_repeats(tiny_stack: Stack) -> None:
    request = greedy_request(tiny_prompt(4), 4, min_tokens=4)
    s = request.sampling
    s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty = 100.0, 1.0, 0, 1.0, 10.0
    s.seed = 2**63 - 1
    request.output.logprobs = 20
    runs = [tiny_stack.generate(request, timeout_s=CALL_TIMEOUT_S) for _ in range(2)]
    for ids, _, final, _ in runs:
        assert len(ids) == 4 and final.finish_reason == pb.FINISH_REASON_LENGTH
    assert runs[0][0] == runs[1][0]
    tiny_stack.assert_idle()


def test_tokenize_refuses_text_without_tokenizer(tiny_stack: Stack) -> None:
    with pytest.raises(grpc.RpcError) as info:
        tiny_stack.stub.Tokenize(pb.TokenizeRequest(text="hello"), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ------------------------------------------------------------------------------------ cancellation


def long_request(stack: Stack, seed: int) -> Any:
    prompt = tiny_prompt(seed)
    return greedy_request(prompt, stack.info.max_model_len - len(prompt))


@pytest.mark.parametrize("stack_name", ["tiny_stack", "async_stack"])
def test_cancel_mid_stream_frees_the_request(stack_name: str, request: pytest.FixtureRequest) -> None:
    tiny_stack: Stack = request.getfixturevalue(stack_name)
    trace_id = trace("cancel")
    call = tiny_stack.stub.Generate(
        long_request(tiny_stack, 10), timeout=CALL_TIMEOUT_S, metadata=(("x-request-id", trace_id),)
    )
    cancel_after_chunks(call)
    tiny_stack.wait_idle(timeout_s=5)
    assert_aborted_in_worker(tiny_stack, trace_id)
    assert_serves_exactly(tiny_stack, tiny_prompt(11))


@pytest.mark.parametrize("stack_name", ["tiny_stack", "async_stack"])
def test_deadline_exceeded_frees_the_request(stack_name: str, request: pytest.FixtureRequest) -> None:
    tiny_stack: Stack = request.getfixturevalue(stack_name)
    trace_id = trace("deadline")
    call = tiny_stack.stub.Generate(
        long_request(tiny_stack, 12), timeout=0.3, metadata=(("x-request-id", trace_id),)
    )
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    tiny_stack.wait_idle(timeout_s=5)
    assert_aborted_in_worker(tiny_stack, trace_id)
    assert_serves_exactly(tiny_stack, tiny_prompt(13))


@pytest.mark.parametrize("stack_name", ["tiny_stack", "async_stack"])
def test_many_streams_cancelled_at_random_points(stack_name: str, request: pytest.FixtureRequest) -> None:
    tiny_stack: Stack = request.getfixturevalue(stack_name)
    rng = random.Random(0)
    plans = [rng.randrange(0, 6) for _ in range(8)]  # chunks read before cancelling (0: before any)
    trace_ids = [trace(f"many{i}") for i in range(len(plans))]
    errors: list[BaseException] = []

    def run(i: int, reads: int) -> None:
        try:
            call = tiny_stack.stub.Generate(
                long_request(tiny_stack, 100 + i),
                timeout=CALL_TIMEOUT_S,
                metadata=(("x-request-id", trace_ids[i]),),
            )
            for _ in range(reads):
                assert next(call).HasField("chunk")
            call.cancel()
            assert call.code() == grpc.StatusCode.CANCELLED
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, n)) for i, n in enumerate(plans)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CALL_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    tiny_stack.wait_idle(timeout_s=10)
    for trace_id, reads in zip(trace_ids, plans, strict=True):
        if reads:  # a stream cancelled before its first message may never have reached the worker
            assert_aborted_in_worker(tiny_stack, trace_id)
    assert_serves_exactly(tiny_stack, tiny_prompt(14))


# -------------------------------------------------------------------------------------- stopping


def test_stop_string_trims_the_text_and_aborts_the_request(smol_stack: Stack) -> None:
    ids, text, final, _ = smol_stack.generate(chat_request(CHAT, 24), timeout_s=CALL_TIMEOUT_S)
    assert final.finish_reason == pb.FINISH_REASON_LENGTH and len(ids) == 24
    # A stop a few characters long starting mid-text, cut where its first occurrence starts.
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    assert stop.strip(), text
    index = text.find(stop)
    # max_tokens far beyond 24: only the abort can make the stack idle within a few seconds.
    room = min(smol_stack.info.max_model_len - final.usage.prompt_tokens, 2000)
    stopped = chat_request(CHAT, room, stop=[stop])
    trace_id = trace("stop")
    s_ids, s_text, s_final, _ = smol_stack.generate(
        stopped, timeout_s=CALL_TIMEOUT_S, metadata=(("x-request-id", trace_id),)
    )
    assert s_text == text[:index]
    assert s_final.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert s_final.stop_sequence == stop
    assert not s_final.HasField("stop_token_id")
    assert s_ids == ids[: len(s_ids)] and s_final.usage.completion_tokens == len(s_ids)
    smol_stack.wait_idle(timeout_s=5)
    assert_aborted_in_worker(smol_stack, trace_id)
    smol_stack.assert_idle()


def test_stop_token_id_ends_the_stream_and_is_returned(tiny_stack: Stack) -> None:
    prompt = tiny_prompt(20)
    reference = tiny_stack.reference(prompt, 16)
    # The first position >= 3 whose token did not appear before it: the stream must stop there.
    cut = next(i for i in range(3, 16) if reference[i] not in reference[:i])
    stop_id = reference[cut]
    request = greedy_request(prompt, 16, stop_token_ids=[stop_id])
    ids, _, final, _ = tiny_stack.generate(request, timeout_s=CALL_TIMEOUT_S)
    assert ids == reference[: cut + 1] and ids[-1] == stop_id
    assert final.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert final.HasField("stop_token_id") and final.stop_token_id == stop_id
    assert final.stop_sequence == ""
    tiny_stack.assert_idle()


# ---------------------------------------------------------------------------------- output options


def test_output_text_and_token_ids_switches(smol_stack: Stack) -> None:
    ids, text, _, _ = smol_stack.generate(chat_request(CHAT, 6), timeout_s=CALL_TIMEOUT_S)
    assert ids and text
    no_text = chat_request(CHAT, 6)
    no_text.output.text = False
    n_ids, n_text, n_final, _ = smol_stack.generate(no_text, timeout_s=CALL_TIMEOUT_S)
    assert n_ids == ids and n_text == "" and n_final.usage.completion_tokens == 6
    no_ids = chat_request(CHAT, 6)
    no_ids.output.token_ids = False
    i_ids, i_text, i_final, _ = smol_stack.generate(no_ids, timeout_s=CALL_TIMEOUT_S)
    assert i_ids == [] and i_text == text and i_final.usage.completion_tokens == 6


def test_an_output_held_to_the_end_comes_whole_before_the_final_message(smol_stack: Stack) -> None:
    ids, text, final, chunks = smol_stack.generate(chat_request(CHAT, 24), timeout_s=CALL_TIMEOUT_S)
    assert chunks > 1
    held = chat_request(CHAT, 24)
    held.output.stream = False
    h_ids, h_text, h_final, h_chunks = smol_stack.generate(held, timeout_s=CALL_TIMEOUT_S)
    assert (h_ids, h_text, h_chunks) == (ids, text, 1)
    assert h_final.finish_reason == final.finish_reason == pb.FINISH_REASON_LENGTH
    assert h_final.usage.completion_tokens == final.usage.completion_tokens == 24
    # A stop string is looked for in the held text as in a streamed one, and the text cut before it.
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    assert stop.strip(), text
    stopped = chat_request(CHAT, 200, stop=[stop])
    stopped.output.stream = False
    s_ids, s_text, s_final, s_chunks = smol_stack.generate(stopped, timeout_s=CALL_TIMEOUT_S)
    assert s_text == text[: text.find(stop)] and s_chunks == 1
    assert s_final.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE and s_final.stop_sequence == stop
    assert s_ids == ids[: len(s_ids)] and s_final.usage.completion_tokens == len(s_ids)
    smol_stack.wait_idle(timeout_s=5)
    smol_stack.assert_idle()


def test_a_held_output_sends_its_logprobs_in_parts(tiny_stack: Stack) -> None:
    prompt = tiny_prompt(31)
    n = LOGPROBS_PER_CHUNK + 8
    request = greedy_request(prompt, n)
    request.output.logprobs = 1
    request.output.stream = False
    responses = tiny_stack.stub.Generate(request, timeout=CALL_TIMEOUT_S)
    chunks = [r.chunk for r in responses if r.HasField("chunk")]
    assert [(len(c.token_ids), len(c.logprobs)) for c in chunks] == [(LOGPROBS_PER_CHUNK,) * 2, (8, 8)]
    ids = [i for c in chunks for i in c.token_ids]
    assert ids == tiny_stack.reference(prompt, n)
    assert [lp.token_id for c in chunks for lp in c.logprobs] == ids


def test_logprobs_of_greedy_tokens(tiny_stack: Stack) -> None:
    prompt = tiny_prompt(30)
    request = greedy_request(prompt, 6)
    request.output.logprobs = 3
    ids: list[int] = []
    logprobs: list[Any] = []
    for response in tiny_stack.stub.Generate(request, timeout=CALL_TIMEOUT_S):
        if response.HasField("chunk"):
            assert len(response.chunk.logprobs) == len(response.chunk.token_ids)
            ids += response.chunk.token_ids
            logprobs += response.chunk.logprobs
    assert ids == tiny_stack.reference(prompt, 6)
    assert [lp.token_id for lp in logprobs] == ids
    for lp in logprobs:
        values = [t.logprob for t in lp.top]
        assert len(lp.top) == 3 and values == sorted(values, reverse=True)
        assert all(v <= 0.0 for v in values)
        assert lp.top[0].token_id == lp.token_id
        assert lp.logprob == pytest.approx(lp.top[0].logprob, abs=1e-4)


def test_prompt_logprobs_equal_transformers_once_and_read_no_cache(tiny_stack: Stack) -> None:
    """Every prompt is chunked on the tiny stack (24 tokens a step). The prompt is served plainly
    first, so its pages are cached; the prompt-logprobs call computes it all the same. Its 599
    entries come in two chunks (512 at most each), the second with the first token."""
    prompt = tiny_prompt(60, 600)
    tiny_stack.generate(greedy_request(prompt, 1), timeout_s=CALL_TIMEOUT_S)
    request = greedy_request(prompt, 4)
    request.output.prompt_logprobs = 3
    *responses, last = tiny_stack.stub.Generate(request, timeout=CALL_TIMEOUT_S)
    chunks = [r.chunk for r in responses]
    assert [(len(c.prompt_logprobs), len(c.token_ids)) for c in chunks[:2]] == [(512, 0), (87, 1)]
    assert not any(c.prompt_logprobs for c in chunks[2:])
    assert [t for c in chunks for t in c.token_ids] == tiny_stack.reference(prompt, 4)
    entries = [lp for c in chunks for lp in c.prompt_logprobs]
    expected = reference_prompt_logprobs(tiny_stack.model_dir, prompt)
    assert [lp.token_id for lp in entries] == prompt[1:]
    got = torch.tensor([lp.logprob for lp in entries])
    assert torch.allclose(got, expected[torch.arange(len(entries)), torch.tensor(prompt[1:])], atol=1e-4)
    assert [[t.token_id for t in lp.top] for lp in entries] == expected.topk(3).indices.tolist()
    # None of it was read from the cache, which still serves everyone else.
    assert last.final.usage.cached_prompt_tokens == 0
    assert tiny_stack.generate(greedy_request(prompt, 1))[2].usage.cached_prompt_tokens >= 592
    tiny_stack.assert_idle()


# -------------------------------------------------------------------------------------- request id


def _call_ids(stack: Stack, request: Any, metadata: tuple[tuple[str, str], ...] = ()) -> tuple[str, str]:
    """(x-request-id of the initial metadata, final.request_id)."""
    call = stack.stub.Generate(request, timeout=CALL_TIMEOUT_S, metadata=metadata)
    header = dict(call.initial_metadata()).get("x-request-id", "")
    finals = [r.final for r in call if r.HasField("final")]
    assert len(finals) == 1
    return header, finals[0].request_id


def test_request_id_from_metadata_is_echoed(tiny_stack: Stack) -> None:
    request = greedy_request(tiny_prompt(40), 2)
    assert _call_ids(tiny_stack, request, (("x-request-id", "trace-abc-123"),)) == ("trace-abc-123",) * 2


def test_request_id_is_generated_when_absent(tiny_stack: Stack) -> None:
    first = _call_ids(tiny_stack, greedy_request(tiny_prompt(40), 2))
    second = _call_ids(tiny_stack, greedy_request(tiny_prompt(40), 2))
    assert first[0] and first[0] == first[1]
    assert second[0] and second[0] == second[1] and second[0] != first[0]


def test_request_id_field_wins_over_metadata(tiny_stack: Stack) -> None:
    request = greedy_request(tiny_prompt(40), 2)
    request.request_id = "from-field"
    assert _call_ids(tiny_stack, request, (("x-request-id", "from-metadata"),)) == ("from-field",) * 2


# ------------------------------------------------------------------------------- usage and timings


def test_usage_timings_and_prefix_cache_hits(tiny_stack: Stack) -> None:
    prompt = tiny_prompt(50, 40)
    finals = []
    for _ in range(2):
        ids, _, final, _ = tiny_stack.generate(greedy_request(prompt, 4), timeout_s=CALL_TIMEOUT_S)
        assert ids == tiny_stack.reference(prompt, 4)
        assert final.usage.prompt_tokens == len(prompt)
        assert final.usage.completion_tokens == len(ids)
        t = final.timings
        assert t.queue_seconds >= 0 and 0 < t.time_to_first_token_seconds <= t.total_seconds
        finals.append(final)
    assert finals[0].usage.cached_prompt_tokens == 0
    assert 32 <= finals[1].usage.cached_prompt_tokens < len(prompt)
    tiny_stack.assert_idle()


# -------------------------------------------------------------------------- Tokenize, GetModelInfo


def test_tokenize_matches_the_hf_tokenizer(smol_stack: Stack, smol_tokenizer: Any) -> None:
    text = "Continuous batching keeps the GPU busy: héllo wörld!"
    reply = smol_stack.stub.Tokenize(pb.TokenizeRequest(text=text), timeout=10)
    assert list(reply.token_ids) == smol_tokenizer(text, add_special_tokens=True)["input_ids"]
    chat = pb.Chat(messages=[pb.ChatMessage(**m) for m in CHAT])
    reply = smol_stack.stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=10)
    expected = smol_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert list(reply.token_ids) == list(expected)


def test_model_info(smol_stack: Stack) -> None:
    info = smol_stack.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert info.vocab_size == SMOL_VOCAB_SIZE
    assert info.has_tokenizer and info.has_chat_template
    assert list(info.eos_token_ids)
    assert info.max_prompt_tokens == info.max_model_len - 1
    assert info.total_blocks > 0 and info.page_size > 0


def test_model_info_total_blocks_matches_the_load(tiny_stack: Stack) -> None:
    assert tiny_stack.info.total_blocks == tiny_stack.load().kv_blocks_total == 256  # num_blocks of the stack


# ----------------------------------------------------------------------------------------- metrics


def scrape(stack: Stack) -> str:
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def metric(text: str, name: str) -> float:
    """The value of the sample `name` (labelled or not) in a scrape; fails if it is missing."""
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert found is not None, f"{name} not in the scrape"
    return float(found.group(1))


def successes(text: str) -> float:
    return sum(float(v) for v in re.findall(r"^cbserve:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def test_load_and_metrics_report_the_pool_in_bytes(tiny_stack: Stack) -> None:
    tiny_stack.generate(greedy_request(tiny_prompt(40, 31), 2), timeout_s=CALL_TIMEOUT_S)
    load = tiny_stack.load()
    geometry = KVGeometry.from_model_config(tiny_config("llama"), tiny_stack.info.page_size, 4)
    pool_chunks = load.kv_blocks_total + RESERVED_CHUNKS
    assert load.kv_pool_bytes == pool_chunks * geometry.chunk_bytes
    # Committed: the reserved chunks plus every chunk handed out so far (requests ran), never more.
    assert 2 * RESERVED_CHUNKS * geometry.chunk_bytes <= load.kv_pool_committed_bytes <= load.kv_pool_bytes
    assert 0 < load.host_available_bytes <= meminfo_bytes("MemTotal")
    text = scrape(tiny_stack)
    for name in ("cbserve:kv_pool_bytes", "cbserve:kv_pool_committed_bytes", "cbserve:host_available_bytes"):
        assert metric(text, name) > 0, name


def test_concurrent_load_queries_are_all_answered(tiny_stack: Stack) -> None:
    # The worker reads several queries of one gateway in one turn and answers the newest; each
    # earlier call used to wait out its 5 s and fail UNAVAILABLE.
    with ThreadPoolExecutor(16) as pool:
        loads = list(pool.map(lambda _: tiny_stack.load(), range(64)))
    assert all(load.kv_blocks_total == 256 for load in loads)


def test_metrics_show_the_request_that_is_running(tiny_stack: Stack) -> None:
    # A scrape asks the worker for its load: the worker's periodic status, which it used to show, can
    # be older than the whole of a short run.
    call = tiny_stack.stub.Generate(long_request(tiny_stack, 62), timeout=CALL_TIMEOUT_S)
    try:
        assert next(call).HasField("chunk")
        text = scrape(tiny_stack)
    finally:
        call.cancel()
    assert metric(text, "cbserve:num_requests_running") == 1.0
    tiny_stack.wait_idle(timeout_s=5)


def test_metrics_after_requests(tiny_stack: Stack) -> None:
    before = successes(scrape(tiny_stack))
    prompt = tiny_prompt(60, 20)
    for _ in range(2):
        tiny_stack.generate(greedy_request(prompt, 3), timeout_s=CALL_TIMEOUT_S)
    text = scrape(tiny_stack)
    for name in (
        "cbserve:time_to_first_token_seconds_count",
        "cbserve:num_requests_running",
        "cbserve:kv_cache_usage_perc",
        "cbserve:prefix_cache_hits",
        "cbserve:step_time_seconds_bucket{",
    ):
        assert name in text, name
    assert successes(text) >= before + 2
