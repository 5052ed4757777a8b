"""`vllm.grpc.engine.VllmEngine` (the SMG worker protocol) end to end, through smg-grpc-proto's own stubs,
against the real three-process stacks (tests/stack.py): its streams equal cbserve's own API token for
token, usage counts right, Abort and cancel free the request, and what cbserve cannot do is refused
with a status naming the field.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import queue
import threading
import zipfile
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as vllm
from smg_grpc_proto import vllm_engine_pb2_grpc as vllm_grpc
from smg_grpc_proto.generated import common_pb2

from services.cachemgr.prefix_cache import block_hash
from services.common.sampling_params import SamplingParams
from services.gateway.api import pb
from services.gateway.vllm_engine import SERVICE_NAME, block_hash_id
from services.gateway.vllm_requests import to_cbserve
from tests.openai_penalties import penalized_request
from tests.stack import (
    CALL_TIMEOUT_S,
    Stack,
    assert_aborted_in_worker,
    assert_serves_exactly,
    cancel_after_chunks,
    greedy_request,
    tiny_prompt,
    trace,
)


def engine(stack: Stack) -> Any:
    return vllm_grpc.VllmEngineStub(stack.channel)


def vllm_request(prompt: list[int], max_tokens: int, *, stream: bool = True, **sampling: Any) -> Any:
    """Greedy over token ids, past EOS (as `greedy_request` builds the cbserve one)."""
    request = vllm.GenerateRequest(
        request_id=trace("vllm"), tokenized=vllm.TokenizedInput(input_ids=prompt), stream=stream
    )
    s = request.sampling_params
    s.temperature, s.max_tokens, s.ignore_eos = 0.0, max_tokens, True
    for name, value in sampling.items():
        if isinstance(value, list):
            getattr(s, name).extend(value)
        else:
            setattr(s, name, value)
    return request


def run(stack: Stack, request: Any) -> tuple[list[Any], Any]:
    """(the stream's chunks, its one complete message, which must come last)."""
    chunks, complete = [], None
    for response in engine(stack).Generate(request, timeout=CALL_TIMEOUT_S):
        assert complete is None, "a message after the complete one"
        if response.HasField("chunk"):
            chunks.append(response.chunk)
        else:
            complete = response.complete
    assert complete is not None, "stream ended without a complete message"
    return chunks, complete


def streamed_ids(chunks: list[Any]) -> list[int]:
    return [t for chunk in chunks for t in chunk.token_ids]


def cbserve_entries(stack: Stack, request: Any, field: str) -> list[Any]:
    """What cbserve's own API streams for `request` in the chunks' `field`, joined."""
    responses = stack.stub.Generate(request, timeout=CALL_TIMEOUT_S)
    return [entry for r in responses if r.HasField("chunk") for entry in getattr(r.chunk, field)]


# ------------------------------------------------------------------------------------- Generate


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_greedy_tokens_and_usage_equal_the_cbserve_api(tiny_stack: Stack, stream: bool) -> None:
    prompt = tiny_prompt(60, 20)
    ids, _, _, _ = tiny_stack.generate(greedy_request(prompt, 10), timeout_s=CALL_TIMEOUT_S)
    chunks, complete = run(tiny_stack, vllm_request(prompt, 10, stream=stream))
    if stream:
        assert streamed_ids(chunks) == ids and list(complete.output_ids) == []
        assert sum(c.completion_tokens for c in chunks) == len(ids)  # each chunk counts its own ids
        assert all(c.prompt_tokens == len(prompt) for c in chunks)
    else:
        assert chunks == [] and list(complete.output_ids) == ids
    assert complete.finish_reason == "length"
    assert (complete.prompt_tokens, complete.completion_tokens) == (len(prompt), len(ids))
    # The cbserve call just ran the same prompt: its full pages (all but the last token's) are hits.
    page = tiny_stack.info.page_size
    assert complete.cached_tokens == (len(prompt) - 1) // page * page == 16
    tiny_stack.assert_idle()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_n_choices_are_indexed_and_each_seeded_like_a_call_of_its_own(
    tiny_stack: Stack, stream: bool
) -> None:
    prompt = tiny_prompt(61, 20)
    sampling = {"temperature": 1.0, "seed": 40}
    chunks, completes = run_choices(tiny_stack, vllm_request(prompt, 6, stream=stream, n=3, **sampling))
    assert sorted(completes) == [0, 1, 2]
    for i, complete in completes.items():
        ids = streamed_ids([c for c in chunks if c.index == i]) if stream else list(complete.output_ids)
        assert (complete.prompt_tokens, complete.completion_tokens) == (len(prompt), 6)
        _, alone = run(tiny_stack, vllm_request(prompt, 6, stream=False, temperature=1.0, seed=40 + i))
        assert ids == list(alone.output_ids), i
    tiny_stack.assert_idle()


def run_choices(stack: Stack, request: Any) -> tuple[list[Any], dict[int, Any]]:
    """(the stream's chunks, each choice's complete message by index); nothing follows the last."""
    chunks, completes = [], {}
    for response in engine(stack).Generate(request, timeout=CALL_TIMEOUT_S):
        assert len(completes) < request.sampling_params.n, "a message after the last complete one"
        if response.HasField("chunk"):
            assert response.chunk.index not in completes
            chunks.append(response.chunk)
        else:
            assert response.complete.index not in completes
            completes[response.complete.index] = response.complete
    return chunks, completes


def test_stop_token_id_is_the_matched_stop(tiny_stack: Stack) -> None:
    prompt = tiny_prompt(61)
    reference = tiny_stack.reference(prompt, 16)
    cut = next(i for i in range(3, 16) if reference[i] not in reference[:i])
    chunks, complete = run(tiny_stack, vllm_request(prompt, 16, stop_token_ids=[reference[cut]]))
    assert streamed_ids(chunks) == reference[: cut + 1]
    assert complete.finish_reason == "stop" and complete.WhichOneof("matched_stop") == "matched_token_id"
    assert complete.matched_token_id == reference[cut]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_logprobs_equal_the_cbserve_api(tiny_stack: Stack, stream: bool) -> None:
    prompt = tiny_prompt(63)
    request = greedy_request(prompt, 5)
    request.output.logprobs = 2
    expected = cbserve_entries(tiny_stack, request, "logprobs")
    chunks, complete = run(tiny_stack, vllm_request(prompt, 5, stream=stream, logprobs=2))
    got = [c.output_logprobs for c in chunks] if stream else [complete.output_logprobs]
    ids = [t for lp in got for t in lp.token_ids]
    values = [v for lp in got for v in lp.token_logprobs]
    tops = [top for lp in got for top in lp.top_logprobs]
    assert ids == [lp.token_id for lp in expected]
    assert values == pytest.approx([lp.logprob for lp in expected])
    assert [list(t.token_ids) for t in tops] == [[a.token_id for a in lp.top] for lp in expected]
    # logprobs 0: the sampled token's alone, with no alternatives (as vLLM).
    _, complete = run(tiny_stack, vllm_request(prompt, 5, stream=False, logprobs=0))
    assert len(complete.output_logprobs.token_ids) == 5 and not complete.output_logprobs.top_logprobs


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
def test_prompt_logprobs_equal_the_cbserve_api(tiny_stack: Stack, stream: bool) -> None:
    # Longer than the gateway's prompt-logprob chunks (512): cbserve splits them, vLLM's come whole.
    prompt = tiny_prompt(71, 600)
    request = greedy_request(prompt, 3)
    request.output.prompt_logprobs = 2
    expected = cbserve_entries(tiny_stack, request, "prompt_logprobs")
    chunks, complete = run(tiny_stack, vllm_request(prompt, 3, stream=stream, prompt_logprobs=2))
    sent = [c for c in chunks if c.HasField("input_logprobs")] + (
        [complete] if complete.HasField("input_logprobs") else []
    )
    assert sent == ([chunks[0]] if stream else [complete]), "once: the first chunk, or the complete"
    got = sent[0].input_logprobs
    # Every prompt token, the first with no logprob and no alternatives (nothing precedes it).
    assert list(got.token_ids) == prompt == [prompt[0]] + [lp.token_id for lp in expected]
    assert not got.token_logprobs[0].HasField("value") and not got.top_logprobs[0].token_ids
    assert [v.value for v in got.token_logprobs[1:]] == pytest.approx([lp.logprob for lp in expected])
    tops = [[a.token_id for a in lp.top] for lp in expected]
    assert [list(t.token_ids) for t in got.top_logprobs[1:]] == tops
    # prompt_logprobs 0: each prompt token's own logprob, with no alternatives (as vLLM).
    _, complete = run(tiny_stack, vllm_request(prompt[:20], 3, stream=False, prompt_logprobs=0))
    assert len(complete.input_logprobs.token_ids) == 20 and not complete.input_logprobs.top_logprobs
    tiny_stack.assert_idle()


def test_text_input_equals_the_cbserve_api(smol_stack: Stack) -> None:
    text = "The capital of France is"
    request = pb.GenerateRequest(text=text)
    request.sampling.temperature, request.stopping.max_tokens, request.stopping.ignore_eos = 0.0, 6, True
    ids, _, final, _ = smol_stack.generate(request, timeout_s=CALL_TIMEOUT_S)
    vllm_text = vllm_request([], 6, stream=False)
    vllm_text.text = text  # replaces the tokenized input
    _, complete = run(smol_stack, vllm_text)
    assert list(complete.output_ids) == ids and complete.prompt_tokens == final.usage.prompt_tokens


def test_stop_string_is_the_matched_stop(smol_stack: Stack) -> None:
    text = "The capital of France is"
    request = pb.GenerateRequest(text=text)
    request.sampling.temperature, request.stopping.max_tokens, request.stopping.ignore_eos = 0.0, 12, True
    _, whole, _, _ = smol_stack.generate(request, timeout_s=CALL_TIMEOUT_S)
    stop = whole.split()[1]  # a word of the greedy text after its first
    request.stopping.stop.append(stop)
    ids, _, final, _ = smol_stack.generate(request, timeout_s=CALL_TIMEOUT_S)
    assert final.stop_sequence == stop
    vllm_text = vllm_request([], 12, stream=False, stop=[stop])
    vllm_text.text = text
    _, complete = run(smol_stack, vllm_text)
    assert complete.finish_reason == "stop" and complete.matched_stop_str == stop
    assert list(complete.output_ids) == ids  # up to the token that completed the stop (smg trims text)


def test_penalties_and_logit_bias_equal_the_cbserve_api(tiny_stack: Stack) -> None:
    """frequency_penalty, presence_penalty and logit_bias (an id -> bias map, as smg sends it) run as
    cbserve's own fields: the same tokens, which the bias and penalties changed."""
    prompt = tiny_prompt(73, 12)
    plain = tiny_stack.reference(prompt, 12)
    params = SamplingParams(
        presence_penalty=0.5, frequency_penalty=1.5, logit_bias=((plain[0], -100.0), (9, 3.0))
    )
    ids, _, _, _ = tiny_stack.generate(penalized_request(prompt, 12, params), timeout_s=CALL_TIMEOUT_S)
    assert ids != plain
    request = vllm_request(prompt, 12, frequency_penalty=1.5, presence_penalty=0.5)
    request.sampling_params.logit_bias.update({plain[0]: -100.0, 9: 3.0})
    chunks, complete = run(tiny_stack, request)
    assert streamed_ids(chunks) == ids and complete.finish_reason == "length"
    tiny_stack.assert_idle()


# --------------------------------------------------------------------------------- Abort, cancel


def test_abort_ends_the_stream_and_frees_the_request(tiny_stack: Stack) -> None:
    prompt = tiny_prompt(64)
    request = vllm_request(prompt, tiny_stack.info.max_model_len - len(prompt))
    call = engine(tiny_stack).Generate(request, timeout=CALL_TIMEOUT_S)
    first = next(call)
    assert first.HasField("chunk")
    engine(tiny_stack).Abort(vllm.AbortRequest(request_ids=[request.request_id, "never-seen"]), timeout=10)
    rest = list(call)
    assert all(r.HasField("chunk") for r in rest[:-1])
    complete = rest[-1].complete
    assert complete.finish_reason == "abort"
    assert complete.completion_tokens == len(streamed_ids([first.chunk] + [r.chunk for r in rest[:-1]]))
    tiny_stack.wait_idle(timeout_s=5)
    assert_aborted_in_worker(tiny_stack, request.request_id)
    assert_serves_exactly(tiny_stack, tiny_prompt(65))


def test_cancel_frees_the_request(tiny_stack: Stack) -> None:
    prompt = tiny_prompt(66)
    request = vllm_request(prompt, tiny_stack.info.max_model_len - len(prompt))
    cancel_after_chunks(engine(tiny_stack).Generate(request, timeout=CALL_TIMEOUT_S))
    tiny_stack.wait_idle(timeout_s=5)
    assert_aborted_in_worker(tiny_stack, request.request_id)


# ----------------------------------------------------------------------------------- bad requests


def _set(**fields: Any) -> Callable[[Any], None]:
    def change(request: Any) -> None:
        for name, value in fields.items():
            setattr(request.sampling_params, name, value)

    return change


def _no_input(request: Any) -> None:
    request.ClearField("tokenized")


def _constraint(request: Any) -> None:
    request.sampling_params.json_schema = "{}"


def _logit_bias(token: int, bias: float) -> Callable[[Any], None]:
    def change(request: Any) -> None:
        request.sampling_params.logit_bias[token] = bias

    return change


def _logit_bias_301(request: Any) -> None:
    request.sampling_params.logit_bias.update({t: 1.0 for t in range(301)})


def _mm_inputs(request: Any) -> None:
    request.mm_inputs.im_token_id = 5


def _out_of_vocab(request: Any) -> None:
    request.tokenized.input_ids.append(256)


def _beyond_int32(request: Any) -> None:
    request.tokenized.input_ids.append(2**32 - 1)


def _text(request: Any) -> None:
    request.text = "no tokenizer here"


def _prompt_logprobs_of_text(request: Any) -> None:
    _text(request)
    request.sampling_params.prompt_logprobs = 1


def _too_long(request: Any) -> None:
    request.sampling_params.max_tokens = 1024


# case -> (change to a valid request, what the status details must name)
BAD_REQUESTS: dict[str, tuple[Callable[[Any], None], str]] = {
    "no_input": (_no_input, "no input"),
    "out_of_vocab_id": (_out_of_vocab, "out of vocabulary"),
    "id_beyond_int32": (_beyond_int32, "tokenized.input_ids"),
    "text_without_tokenizer": (_text, "tokenizer"),
    "temperature_500": (_set(temperature=500.0), "sampling_params.temperature"),
    "top_p_2": (_set(top_p=2.0), "sampling_params.top_p"),
    "min_tokens_over_max": (_set(min_tokens=9), "sampling_params.min_tokens"),
    "max_tokens_over_context": (_too_long, "sampling_params.max_tokens"),
    "logprobs_21": (_set(logprobs=21), "sampling_params.logprobs"),
    "logprobs_all": (_set(logprobs=-1), "sampling_params.logprobs"),
    "seed_negative": (_set(seed=-1), "sampling_params.seed"),
    "frequency_penalty_2.5": (
        _set(frequency_penalty=2.5),
        "sampling_params.frequency_penalty must be in [-2, 2], got 2.5",
    ),
    "presence_penalty_-3": (
        _set(presence_penalty=-3.0),
        "sampling_params.presence_penalty must be in [-2, 2], got -3.0",
    ),
    "prompt_logprobs_21": (_set(prompt_logprobs=21), "sampling_params.prompt_logprobs"),
    "prompt_logprobs_all": (_set(prompt_logprobs=-1), "sampling_params.prompt_logprobs"),
    "prompt_logprobs_of_text": (_prompt_logprobs_of_text, "sampling_params.prompt_logprobs"),
    "truncate_prompt_tokens": (_set(truncate_prompt_tokens=4), "sampling_params.truncate_prompt_tokens"),
    "n_17": (_set(n=17), "sampling_params.n must be in [1, 16] (the server's --max-n), got 17"),
    "logit_bias_out_of_vocab": (
        _logit_bias(256, 1.0),
        "sampling_params.logit_bias token ids out of vocabulary (size 256): [256]",
    ),
    "logit_bias_negative_id": (
        _logit_bias(-5, 1.0),
        "sampling_params.logit_bias token ids out of vocabulary (size 256): [-5]",
    ),
    "logit_bias_200": (
        _logit_bias(5, 200.0),
        "sampling_params.logit_bias[5] must be in [-100, 100], got 200.0",
    ),
    "logit_bias_301_entries": (_logit_bias_301, "sampling_params.logit_bias holds 301 entries; at most 300"),
    "json_schema": (_constraint, "sampling_params.json_schema"),
    "mm_inputs": (_mm_inputs, "mm_inputs"),
    "data_parallel_rank": (lambda r: setattr(r, "data_parallel_rank", 1), "data_parallel_rank"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_names_the_field_and_leaves_the_stack_serving(tiny_stack: Stack, case: str) -> None:
    change, named = BAD_REQUESTS[case]
    request = vllm_request(tiny_prompt(67), 8)
    change(request)
    with pytest.raises(grpc.RpcError) as info:
        run(tiny_stack, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
    assert named in info.value.details()
    assert_serves_exactly(tiny_stack, tiny_prompt(3))


def test_unparsable_request_is_invalid_argument(tiny_stack: Stack) -> None:
    generate = tiny_stack.channel.unary_stream(f"/{SERVICE_NAME}/Generate")
    with pytest.raises(grpc.RpcError) as info:
        list(generate(b"\xff\xff\xff", timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_methods_not_served_say_why(tiny_stack: Stack) -> None:
    stub = engine(tiny_stack)
    calls = {
        "Embed": lambda: stub.Embed(vllm.EmbedRequest(), timeout=10),
        "StartProfile": lambda: stub.StartProfile(common_pb2.StartProfileRequest(), timeout=10),
    }
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED, name
        assert name in info.value.details()


# ------------------------------------------------------------------------------- unary methods


def test_health_model_and_server_info(tiny_stack: Stack) -> None:
    stub = engine(tiny_stack)
    assert stub.HealthCheck(vllm.HealthCheckRequest(), timeout=10).healthy
    info = stub.GetModelInfo(vllm.GetModelInfoRequest(), timeout=10)
    cbserve = tiny_stack.info
    assert info.served_model_name == info.model_path == cbserve.model_id == "llama"
    assert info.vocab_size == cbserve.vocab_size and info.max_context_length == cbserve.max_model_len
    assert info.max_req_input_len == cbserve.max_prompt_tokens
    assert list(info.eos_token_ids) == list(cbserve.eos_token_ids) and info.is_generation
    assert list(info.architectures) == [cbserve.architecture] and info.model_type == "llama"
    server = stub.GetServerInfo(vllm.GetServerInfoRequest(), timeout=10)
    assert server.server_type == "cbserve" and server.block_size == cbserve.page_size
    assert server.model_dtype == cbserve.dtype and server.data_parallel_size == 1
    assert server.uptime_seconds > 0 and server.active_requests == 0


def test_loads_are_get_load_counters(tiny_stack: Stack) -> None:
    prompt = tiny_prompt(68, 24)
    run(tiny_stack, vllm_request(prompt, 2))
    run(tiny_stack, vllm_request(prompt, 2))  # a prefix-cache hit
    reply = engine(tiny_stack).GetLoads(vllm.GetLoadsRequest(), timeout=10)
    load = tiny_stack.load()
    assert reply.dp_rank_count == 1 and len(reply.loads) == 1 and reply.timestamp
    (rank,) = reply.loads
    page = tiny_stack.info.page_size
    assert (rank.num_running_reqs, rank.num_waiting_reqs, rank.num_used_tokens) == (0, 0, 0)
    assert rank.max_total_num_tokens == load.kv_blocks_total * page and rank.token_usage == 0.0
    assert rank.cache_hit_rate == pytest.approx(load.prefix_cache_hits / load.prefix_cache_queries)
    assert 0.0 < rank.cache_hit_rate < 1.0


def test_flush_cache_drops_the_cached_prefixes(tiny_stack: Stack) -> None:
    run(tiny_stack, vllm_request(tiny_prompt(69, 24), 2))
    assert tiny_stack.load().kv_blocks_cached > 0
    reply = engine(tiny_stack).FlushCache(common_pb2.FlushCacheRequest(), timeout=10)
    assert reply.success, reply.message
    load = tiny_stack.load()
    assert load.kv_blocks_cached == 0 and load.kv_blocks_free == load.kv_blocks_total
    assert_serves_exactly(tiny_stack, tiny_prompt(69, 24))


def test_kv_events_announce_a_prompts_pages_and_their_flush(tiny_stack: Stack) -> None:
    """A subscriber sees the pages a request cached (hashes chained as cbserve's digests, tokens,
    one page per block) and their removal when the cache is flushed; a salted request's pages never."""
    page = tiny_stack.info.page_size
    prompt, salted = tiny_prompt(71, 3 * page + 5), tiny_prompt(72, 2 * page)
    digests, parent = [], b""
    for i in range(3):
        parent = block_hash(parent, prompt[i * page : (i + 1) * page], b"")
        digests.append(parent)
    expected = [block_hash_id(d) for d in digests]
    batches: queue.Queue[Any] = queue.Queue()
    call = engine(tiny_stack).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=60)

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):  # the cancel below ends the call
            for batch in call:
                batches.put(batch)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        salted_request = greedy_request(salted, 3)
        salted_request.cache_salt = "tenant-a"
        tiny_stack.generate(salted_request, timeout_s=CALL_TIMEOUT_S)
        run(tiny_stack, vllm_request(prompt, 3))
        assert engine(tiny_stack).FlushCache(common_pb2.FlushCacheRequest(), timeout=10).success
        stored: list[Any] = []
        removed: set[int] = set()
        sequences: list[int] = []
        while not set(expected) <= removed:
            batch = batches.get(timeout=30)
            if not sequences:  # no cursor: the live pages first, complete (the worker gave them all)
                assert batch.HasField("snapshot") and batch.snapshot.unknown_before == 0, batch.snapshot
            sequences.append(batch.sequence_number)
            for event in batch.events:
                if event.HasField("stored"):
                    stored.append(event.stored)
                elif event.HasField("removed"):
                    removed.update(event.removed.block_hashes)
    finally:
        call.cancel()
    assert sequences == list(range(sequences[0], sequences[0] + len(sequences)))  # no gap, no duplicate
    mine = [s for s in stored if s.blocks and s.blocks[0].block_hash == expected[0]]
    assert len(mine) == 1 and not mine[0].HasField("parent_block_hash")
    assert [b.block_hash for b in mine[0].blocks] == expected
    assert [list(b.token_ids) for b in mine[0].blocks] == [
        prompt[i * page : (i + 1) * page] for i in range(3)
    ]
    assert all(b.block_size == page for b in mine[0].blocks)
    salted_first = [tuple(salted[:page])]
    assert not [b for s in stored for b in s.blocks if tuple(b.token_ids) in salted_first]


def test_tokenizer_is_the_model_directorys(smol_stack: Stack, tiny_stack: Stack) -> None:
    chunks = list(engine(smol_stack).GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = set(archive.namelist())
        assert {"tokenizer.json", "tokenizer_config.json"} <= names
        assert archive.read("tokenizer.json") == (smol_stack.model_dir / "tokenizer.json").read_bytes()
    with pytest.raises(grpc.RpcError) as info:
        list(engine(tiny_stack).GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=10))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_zero_means_unset_as_in_vllm() -> None:
    request = vllm.GenerateRequest(tokenized=vllm.TokenizedInput(input_ids=[5, 6]))
    out = to_cbserve(request)
    assert list(out.token_ids.ids) == [5, 6] and not out.output.text and out.output.token_ids
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed"):
        assert not out.sampling.HasField(name), name  # cbserve's defaults: those of vLLM
    assert not out.stopping.HasField("max_tokens")
    assert not out.output.HasField("logprobs") and not out.output.HasField("prompt_logprobs")
    s = request.sampling_params
    s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty, s.seed = 0.0, 0.5, 4, 0.1, 1.2, 7
    s.min_tokens, s.max_tokens, s.logprobs, s.prompt_logprobs = 2, 9, 0, 0
    out = to_cbserve(request)
    assert (out.sampling.temperature, out.sampling.top_k, out.sampling.seed) == (0.0, 4, 7)
    assert (out.stopping.min_tokens, out.stopping.max_tokens, out.output.logprobs) == (2, 9, 0)
    assert out.output.HasField("prompt_logprobs") and out.output.prompt_logprobs == 0
