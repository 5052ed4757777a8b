"""Hostile input never crashes a process, leaks a block, hangs a stream or executes anything.

1. Property-based fuzzing (hypothesis: fixed examples, then fresh ones in `make fuzz`) of
   `GenerateRequest` over real gRPC, on the tiny stack (no tokenizer) and the SmolLM2 stack (tokenizer
   and chat template). Every field is unset, valid or definitely invalid; a request whose fields are
   all valid must succeed, one with an invalid field must get INVALID_ARGUMENT, and no other code
   comes back (RESOURCE_EXHAUSTED only for gRPC's metadata size limit). Afterwards the stack is
   SERVING, idle, and exact for a normal request.
2. Garbage and foreign messages on the internal ZMQ sockets (the cachemgr's and the worker's ROUTER)
   are dropped with a "dropped ..." warning; a peer without the stack's internal key is refused;
   well-formed but bad requests from a fake gateway that holds the key (a buggy or compromised
   one) are refused one by one; no process dies. Nothing received is ever executed: no pickle.
3. The bugs this module found are fixed; each test below that names one guards against its return.

Valid requests generate at most 4 tokens by construction, so the module stays fast.
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from services.cachemgr.block_manager import BlockManager
from services.cachemgr.cache_request import CacheState
from services.cachemgr.kv_cache import KVCache
from services.cachemgr.server import CacheServer
from services.common.cachemgr_messages import (
    Attach,
    Attached,
    Failure,
    FromCachemgr,
    PlanEntry,
    StatsQuery,
    StepGrant,
    StepPlan,
)
from services.common.config import CBConfig
from services.common.gateway_messages import GatewayMessage, NewRequest
from services.common.sampling_params import SamplingParams
from services.gateway.api import pb
from tests.block_manager_state import state_of
from tests.stack import REPO, Stack, collect_finals, dealer, greedy_request, keyed

CALL_TIMEOUT_S = 30.0
OK, INVALID, EXHAUSTED = (
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)
ALLOWED = {OK, INVALID, EXHAUSTED}
SOUND_PROMPT = [5, 17, 42, 99, 3, 64, 7, 200]  # in both vocabularies
MAX_VALID_TOKENS = 4
FAKE = "hostile"  # prefix of every id this module makes up (fake gateways, fake workers)
CHILDREN = ("cachemgr", "worker", "gateway")

CHARS = st.characters(exclude_categories=("Cs",))  # any code point a proto string can hold
PRINTABLE = st.characters(min_codepoint=0x20, max_codepoint=0x7E)  # what a gRPC header value can hold
NASTY_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, 1e30, -1e30, 1e-45, -1e-45, 5e-324, 1e300]

encode = msgspec.msgpack.Encoder().encode


# ---------------------------------------------------------------------------------- stack helpers


@dataclass(frozen=True)
class Baseline:
    pids: dict[str, int]
    deaths: int


def baseline(stack: Stack) -> Baseline:
    return Baseline({n: stack.child_pid(n) for n in CHILDREN}, len(stack.events("child died; restarting")))


def wait_events(stack: Stack, name: str, at_least: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(stack.events(name)) < at_least:
        assert time.monotonic() < deadline, f"fewer than {at_least} {name!r} events:\n{stack.log_tail()}"
        time.sleep(0.05)


def assert_exact(stack: Stack) -> None:
    ids, _, final, _ = stack.generate(greedy_request(SOUND_PROMPT, MAX_VALID_TOKENS), timeout_s=60)
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert ids == stack.reference(SOUND_PROMPT, MAX_VALID_TOKENS)


def assert_sound(stack: Stack, before: Baseline) -> None:
    """No process died or restarted, SERVING, every block back, and a normal request exact."""
    assert len(stack.events("child died; restarting")) == before.deaths, stack.log_tail()
    assert {n: stack.child_pid(n) for n in CHILDREN} == before.pids
    assert stack.health_status() == "SERVING"
    stack.assert_idle()
    assert_exact(stack)


def _restart_pending(stack: Stack) -> bool:
    """A child died and the worker has not been ready since (any death restarts the worker's work)."""
    pending = False
    for event in stack.log_events():
        if event.get("event") == "child died; restarting":
            pending = True
        elif event.get("event") == "worker ready":
            pending = False
    return pending


def recover(stack: Stack, before: Baseline, timeout_s: float = 120.0) -> None:
    """After a test that may have killed a child: wait until the stack serves exactly again."""
    deadline = time.monotonic() + timeout_s
    while _restart_pending(stack) and time.monotonic() < deadline:
        time.sleep(0.2)
    stack.wait_serving(max(deadline - time.monotonic(), 1.0))
    while True:
        try:
            stack.wait_idle()
            assert_exact(stack)
            return
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@pytest.fixture
def zmq_context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


# ------------------------------------------------------------------------------- gRPC fuzz: cases


@dataclass
class Case:
    request: Any = field(default_factory=pb.GenerateRequest)
    metadata: list[tuple[str, str | bytes]] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)  # why it must be refused (empty: it must succeed)
    big_metadata: bool = False  # over gRPC's 8 KiB soft limit: RESOURCE_EXHAUSTED is allowed too


def _repeat(piece: str, size: int) -> str:
    return (piece * (size // len(piece) + 1))[:size]


def _mode(draw: st.DrawFn, wild: bool, unset: bool = True) -> str:
    options = ["valid", "invalid"] if wild else ["valid"]
    return draw(st.sampled_from((["unset"] if unset else []) + options))


VALID_SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.one_of(st.sampled_from([0.0, -0.0, 1e-45, 1.0, 100.0]), st.floats(0, 100, width=32)),
    "top_p": st.one_of(st.sampled_from([1e-45, 1.0]), st.floats(0, 1, exclude_min=True, width=32)),
    "min_p": st.one_of(st.sampled_from([0.0, -0.0, 1e-45, 1.0]), st.floats(0, 1, width=32)),
    "repetition_penalty": st.one_of(
        st.sampled_from([1e-45, 1.0, 10.0]), st.floats(0, 10, exclude_min=True, width=32)
    ),
    "top_k": st.integers(0, 2**31 - 1),
    "seed": st.integers(0, 2**63 - 1),
    "presence_penalty": st.one_of(st.sampled_from([-2.0, -0.0, 2.0]), st.floats(-2, 2, width=32)),
    "frequency_penalty": st.one_of(st.sampled_from([-2.0, -0.0, 2.0]), st.floats(-2, 2, width=32)),
}
INVALID_SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.sampled_from([math.nan, math.inf, -math.inf, -1e-45, -1.0, 100.01, 1e30, -1e30]),
    "top_p": st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1.0001, 1e30]),
    "min_p": st.sampled_from([math.nan, math.inf, -math.inf, -1e-45, -1.0, 1.0001, 1e30]),
    "repetition_penalty": st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 10.001, 1e30]),
    "top_k": st.integers(-(2**31), -1),
    "seed": st.integers(2**63, 2**64 - 1),
    "presence_penalty": st.sampled_from([math.nan, math.inf, -math.inf, -2.0001, 2.0001, 1e30]),
    "frequency_penalty": st.sampled_from([math.nan, math.inf, -math.inf, -2.0001, 2.0001, -1e30]),
}


def _draw_input(draw: st.DrawFn, case: Case, wild: bool, info: Any) -> None:
    request, vocab = case.request, int(info.vocab_size)
    kinds = ["token_ids"] + (["text", "chat"] if info.has_chat_template else [])
    if wild:
        kinds += ["none", "text", "chat"] if not info.has_chat_template else ["none"]
    kind = draw(st.sampled_from(kinds))
    if kind == "none":
        case.invalid.append("no input")
        return
    if not info.has_tokenizer and kind != "token_ids":
        case.invalid.append(f"{kind} without a tokenizer")
    bad = wild and draw(st.booleans())
    if kind == "token_ids":
        request.token_ids.SetInParent()
        if not bad:
            request.token_ids.ids.extend(draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=32)))
            return
        how = draw(st.sampled_from(["empty", "out_of_vocab", "huge"]))
        if how == "out_of_vocab":
            ids = draw(st.lists(st.integers(0, vocab - 1), max_size=16))
            wrong = draw(st.one_of(st.integers(-(2**31), -1), st.integers(vocab, 2**31 - 1)))
            ids.insert(draw(st.integers(0, len(ids))), wrong)
            request.token_ids.ids.extend(ids)
        elif how == "huge":  # valid ids, too many of them (up to ~4 MB on the wire)
            size = draw(st.sampled_from([int(info.max_model_len), 5_000, 300_000, 1_500_000]))
            request.token_ids.ids.extend(k % vocab for k in range(size))
        case.invalid.append(f"token_ids {how}")
        return
    if kind == "text":
        if not bad:
            request.text = draw(st.text(CHARS, min_size=1, max_size=24))
            return
        how = draw(st.sampled_from(["empty", "huge"]))
        # 200k characters tokenize to far more than the 3072 tokens a request may hold; the other
        # sizes are over the 1 Mi character limit and refused before tokenizing.
        size = 0 if how == "empty" else draw(st.sampled_from([200_000, (1 << 20) + 1, 2_000_000]))
        request.text = _repeat(draw(st.text(CHARS, min_size=1, max_size=8)), size) if size else ""
        case.invalid.append(f"text {how} ({size} characters)")
        return
    request.chat.SetInParent()
    roles = st.sampled_from(["system", "user", "assistant"])
    messages = draw(st.lists(st.tuples(roles, st.text(CHARS, max_size=16)), min_size=1, max_size=3))
    if bad:
        how = draw(st.sampled_from(["empty", "role", "huge", "many"]))
        if how == "empty":
            messages = []
        elif how == "role":
            role = draw(
                st.text(CHARS, max_size=12).filter(lambda r: r not in ("system", "user", "assistant"))
            )
            messages.insert(draw(st.integers(0, len(messages))), (role, "hi"))
        elif how == "huge":
            size = draw(st.sampled_from([200_000, (1 << 20) + 1, 2_000_000]))
            messages.append(("user", _repeat(draw(st.text(CHARS, min_size=1, max_size=8)), size)))
        else:
            messages = messages * draw(st.sampled_from([2_000, 20_000]))
        case.invalid.append(f"chat {how}")
    request.chat.messages.extend(pb.ChatMessage(role=r, content=c) for r, c in messages)


def _draw_stopping(draw: st.DrawFn, case: Case, wild: bool, info: Any) -> None:
    stopping, vocab = case.request.stopping, int(info.vocab_size)
    # max_tokens is always set: valid ones are tiny (the stream stays short), invalid ones are 0 or far
    # beyond what a request may hold (never capped silently: refused).
    if _mode(draw, wild, unset=False) == "valid":
        stopping.max_tokens = draw(st.integers(1, MAX_VALID_TOKENS))
    else:
        stopping.max_tokens = draw(st.one_of(st.just(0), st.integers(2**16, 2**32 - 1)))
        case.invalid.append(f"max_tokens {stopping.max_tokens}")
    mode = _mode(draw, wild)
    if mode == "valid":
        stopping.min_tokens = draw(st.integers(0, stopping.max_tokens))
    elif mode == "invalid" and stopping.max_tokens < 2**32 - 1:
        stopping.min_tokens = draw(st.integers(stopping.max_tokens + 1, 2**32 - 1))
        case.invalid.append(f"min_tokens {stopping.min_tokens} > max_tokens")
    stopping.ignore_eos = draw(st.booleans())

    mode = _mode(draw, wild)
    if mode == "valid" and info.has_tokenizer:
        one = st.one_of(st.text(CHARS, min_size=1, max_size=6), st.text(CHARS, min_size=250, max_size=256))
        stopping.stop.extend(draw(st.lists(one, max_size=16)))
    elif mode == "invalid":
        how = draw(st.sampled_from(["many", "empty", "long"]))
        stops = draw(st.lists(st.text(CHARS, min_size=1, max_size=6), min_size=1, max_size=15))
        if how == "many":
            stops = stops * draw(st.integers(17 // len(stops) + 1, 40))
        else:
            stops.insert(0, "" if how == "empty" else draw(st.text(CHARS, min_size=257, max_size=400)))
        stopping.stop.extend(stops)
        case.invalid.append(f"stop strings: {how}")

    mode = _mode(draw, wild)
    if mode == "valid":
        stopping.stop_token_ids.extend(draw(st.lists(st.integers(0, vocab - 1), max_size=64)))
    elif mode == "invalid":
        if draw(st.booleans()):
            ids = draw(st.lists(st.integers(0, vocab - 1), min_size=65, max_size=100))
        else:
            ids = draw(st.lists(st.integers(0, vocab - 1), max_size=8))
            ids.append(draw(st.one_of(st.integers(-(2**31), -1), st.integers(vocab, 2**31 - 1))))
        stopping.stop_token_ids.extend(ids)
        case.invalid.append("stop_token_ids")


def _draw_output_and_rest(draw: st.DrawFn, case: Case, wild: bool, info: Any) -> None:
    request = case.request
    mode = _mode(draw, wild)
    if mode == "valid":
        request.output.text = draw(st.booleans()) if info.has_tokenizer else False
    elif mode == "invalid" and not info.has_tokenizer:
        request.output.text = True
        case.invalid.append("output.text without a tokenizer")
    if draw(st.booleans()):
        request.output.token_ids = draw(st.booleans())
    mode = _mode(draw, wild)
    if mode == "valid":
        request.output.logprobs = draw(st.integers(0, 20))
    elif mode == "invalid":
        request.output.logprobs = draw(st.integers(21, 2**32 - 1))
        case.invalid.append(f"logprobs {request.output.logprobs}")
    for name in VALID_SAMPLING:
        mode = _mode(draw, wild)
        if mode == "valid":
            setattr(request.sampling, name, draw(VALID_SAMPLING[name]))
        elif mode == "invalid":
            setattr(request.sampling, name, draw(INVALID_SAMPLING[name]))
            case.invalid.append(f"{name} {getattr(request.sampling, name)!r}")
    _draw_logit_bias(draw, case, wild, info)
    request.priority = draw(
        st.one_of(st.sampled_from([-(2**31), 2**31 - 1, 0]), st.integers(-(2**31), 2**31 - 1))
    )
    request.cache_salt = draw(st.one_of(st.text(CHARS, max_size=24), st.just("s" * 100_000)))
    if len(request.cache_salt) > 256:  # the gateway's limit (Limits.max_salt_chars)
        case.invalid.append("cache_salt over 256 characters")
    # A request_id is echoed as a response header: printable ASCII here (anything else is the bug in
    # test_a_request_id_that_is_no_header_value_is_refused_not_internal).
    request.request_id = draw(st.one_of(st.just(""), st.text(PRINTABLE, max_size=64)))


def _draw_logit_bias(draw: st.DrawFn, case: Case, wild: bool, info: Any) -> None:
    bias, vocab = case.request.sampling.logit_bias, int(info.vocab_size)
    valid_bias = st.one_of(st.sampled_from([-100.0, 100.0]), st.floats(-100, 100, width=32))
    mode = _mode(draw, wild)
    if mode == "valid":
        bias.update(draw(st.dictionaries(st.integers(0, vocab - 1), valid_bias, max_size=300)))
    elif mode == "invalid":
        how = draw(st.sampled_from(["many", "out_of_vocab", "bias"]))
        bias.update(draw(st.dictionaries(st.integers(0, vocab - 1), valid_bias, max_size=8)))
        if how == "many":
            bias.update(dict.fromkeys(range(-400, -99), 1.0))  # 301 more ids than fit, none valid
        elif how == "out_of_vocab":
            wrong = draw(st.one_of(st.integers(-(2**31), -1), st.integers(vocab, 2**31 - 1)))
            bias[wrong] = draw(valid_bias)
        else:
            wrong_bias = [math.nan, math.inf, -math.inf, 100.01, -101.0, 1e30]
            bias[draw(st.integers(0, vocab - 1))] = draw(st.sampled_from(wrong_bias))
        case.invalid.append(f"logit_bias {how}")


@st.composite
def metadata(draw: st.DrawFn) -> tuple[list[tuple[str, str | bytes]], bool]:
    pairs: list[tuple[str, str | bytes]] = []
    big = False
    choice = draw(st.sampled_from(["none", "short", "long"]))
    if choice == "short":
        pairs.append(("x-request-id", draw(st.text(PRINTABLE, max_size=128))))
    elif choice == "long":
        size = draw(st.sampled_from([1_000, 8_000, 16_000, 20_000]))
        pairs.append(("x-request-id", _repeat(draw(st.text(PRINTABLE, min_size=1, max_size=8)), size)))
        big = size > 7_000
    keys = st.from_regex(r"x-[a-z0-9_.\-]{1,16}", fullmatch=True).filter(lambda k: not k.endswith("-bin"))
    pairs += draw(st.lists(st.tuples(keys, st.text(PRINTABLE, max_size=100)), max_size=4))
    if draw(st.booleans()):
        pairs.append(("x-junk-bin", draw(st.binary(max_size=64))))
    return pairs, big


@st.composite
def cases(draw: st.DrawFn, info: Any) -> Case:
    case = Case()
    wild = draw(st.integers(0, 2)) == 0  # a third of the cases draw invalid values too
    _draw_input(draw, case, wild, info)
    _draw_stopping(draw, case, wild, info)
    _draw_output_and_rest(draw, case, wild, info)
    case.metadata, case.big_metadata = draw(metadata())
    ids = [v for k, v in case.metadata if k == "x-request-id"]
    if ids and len(ids[0]) > 128 and not case.request.request_id:  # the gateway's id limit (Limits)
        case.invalid.append("x-request-id over 128 characters")
    return case


def describe(case: Case) -> str:
    request = pb.GenerateRequest()
    request.CopyFrom(case.request)
    kind = request.WhichOneof("input")
    size = {
        "text": len(request.text),
        "token_ids": len(request.token_ids.ids),
        "chat": len(request.chat.messages),
    }.get(kind or "", 0)
    if kind:
        request.ClearField(kind)
    text = f"input={kind}[{size}] {str(request)[:600]!r} metadata={[(k, len(v)) for k, v in case.metadata]}"
    return f"{text} invalid={case.invalid}"


def call(stack: Stack, case: Case) -> tuple[grpc.StatusCode, list[int], Any, str]:
    ids: list[int] = []
    final = None
    try:
        for response in stack.stub.Generate(case.request, timeout=CALL_TIMEOUT_S, metadata=case.metadata):
            assert final is None, "a message after the final one"
            if response.HasField("chunk"):
                ids += response.chunk.token_ids
            else:
                final = response.final
    except grpc.RpcError as exc:
        return exc.code(), ids, None, exc.details() or ""
    return OK, ids, final, ""


def check_case(stack: Stack, case: Case) -> None:
    note(describe(case))
    code, ids, final, details = call(stack, case)
    note(f"-> {code.name} {details[:300]}")
    assert code in ALLOWED, f"{code.name}: {details}"
    if case.invalid:
        expected = {INVALID, EXHAUSTED} if case.big_metadata else {INVALID}
    else:
        expected = {OK, EXHAUSTED} if case.big_metadata else {OK}
    assert code in expected, f"{code.name} ({details}) for a request that is {case.invalid or 'valid'}"
    if code != OK:
        return
    assert final is not None, "stream ended without a final message"
    stopping, output, usage = case.request.stopping, case.request.output, final.usage
    assert usage.completion_tokens <= stopping.max_tokens
    if output.token_ids or not output.HasField("token_ids"):  # ids are streamed unless turned off
        assert usage.completion_tokens == len(ids)
    assert all(0 <= t < stack.vocab_size for t in ids)
    # Before min_tokens, EOS and stop token ids are held back; only a stop string ends a stream sooner.
    if not final.stop_sequence:
        assert usage.completion_tokens >= stopping.min_tokens, final
    if case.request.request_id:
        assert final.request_id == case.request.request_id


FUZZ = {
    "deadline": None,
    "print_blob": False,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}


def fuzz(stack: Stack, max_examples: int) -> None:
    assert stack.info.max_model_len < 2**16  # so every max_tokens >= 2**16 must be refused
    before = baseline(stack)

    @settings(max_examples=max_examples, **FUZZ)
    @given(case=cases(stack.info))
    def run(case: Case) -> None:
        check_case(stack, case)

    run()
    assert_sound(stack, before)


@pytest.mark.fuzz
def test_fuzzed_generate_requests_on_the_tiny_stack(tiny_stack: Stack) -> None:
    fuzz(tiny_stack, max_examples=60)


# Its fixed examples only: `make fuzz`'s fresh ones go to the tiny stack above, the same cases over the
# same gateway and worker, without a second start of SmolLM2's stack in that pass.
def test_fuzzed_generate_requests_on_the_smol_stack(smol_stack: Stack) -> None:
    fuzz(smol_stack, max_examples=45)


@pytest.mark.parametrize("request_id", ["é", "line\nbreak", "nul\x00", "tab\there"])
def test_a_request_id_that_is_no_header_value_is_refused_not_internal(
    tiny_stack: Stack, request_id: str
) -> None:
    case = Case(request=greedy_request(SOUND_PROMPT, 2))
    case.request.request_id = request_id
    code, _, final, details = call(tiny_stack, case)
    assert code in {OK, INVALID}, f"{code.name}: {details}"
    if code == OK:
        assert final.request_id == request_id


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field, written by hand (the client library refuses bad UTF-8)."""
    size, varint = len(payload), b""
    while True:
        varint += bytes([(size & 0x7F) | (0x80 if size >> 7 else 0)])
        size >>= 7
        if not size:
            return bytes([number << 3 | 2]) + varint + payload


def _raw_requests() -> dict[str, bytes]:
    good = greedy_request(SOUND_PROMPT, 2).SerializeToString()
    chat = _field(4, _field(1, _field(1, b"user") + _field(2, b"caf\xc3")))
    return {
        "stop_invalid_utf8": good + _field(6, _field(3, b"\xff\xfe")),
        "text_invalid_utf8": good + _field(2, b"hi\xff"),
        "chat_invalid_utf8": good + chat,
        "request_id_surrogate": good + _field(1, b"\xed\xa0\x80"),
        "cache_salt_overlong": good + _field(9, b"\xc0\xaf"),
        "corrupt_wire": b"\xff\xff\xff\xff",
        "truncated": good[:-1],
    }


@pytest.mark.parametrize("case", list(_raw_requests()))
def test_a_request_that_does_not_parse_is_invalid_argument(tiny_stack: Stack, case: str) -> None:
    generate = tiny_stack.channel.unary_stream(
        "/cbserve.v1.TextGeneration/Generate",
        request_serializer=None,  # bytes as they are
        response_deserializer=pb.GenerateResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as refused:
        list(generate(_raw_requests()[case], timeout=CALL_TIMEOUT_S))
    assert refused.value.code() == INVALID, refused.value.details()


# ------------------------------------------------------------------------------ the internal sockets


def _truncations(payload: bytes) -> list[bytes]:
    return [payload[:cut] for cut in sorted({1, 2, len(payload) // 3, len(payload) // 2, len(payload) - 1})]


def _undecodable(real: bytes, executable: Path) -> list[bytes]:
    """Payloads no decoder of either link accepts (each must be logged and dropped)."""
    return [
        b"\xc1 is never valid msgpack",
        b"",
        msgspec.msgpack.encode({"hello": "world", "n": [1, 2, 3]}),
        msgspec.msgpack.encode([1, 2, 3]),
        msgspec.msgpack.encode({"type": "exec", "cmd": f"touch {executable}"}),  # an unknown tag
        msgspec.msgpack.encode({"type": "plan", "gateway_id": 7}),  # known tag, fields missing/wrong
        b"\x91" * 200_000 + b"\xc0",  # 200k nested arrays
        *_truncations(real),
        bytes(range(256)) * (24 << 12),  # 6 MiB of noise
    ]


def test_garbage_on_the_cachemgr_socket_is_dropped(
    tiny_stack: Stack, zmq_context: zmq.Context, tmp_path: Path
) -> None:
    stack, before = tiny_stack, baseline(tiny_stack)
    dropped = len(stack.events("dropped an undecodable message"))
    frames = len(stack.events("dropped a message with a wrong frame count"))
    attached = len(stack.events("worker attached"))
    executable = tmp_path / "executed"
    plan = encode(StepPlan(7, [PlanEntry(f"{FAKE}-a", 8, list(range(8)), 0, "", 16)], ["x"], ["y"]))
    junk = _undecodable(plan, executable)
    answered = [
        encode(Attach(f"{FAKE}-v2", version=2)),  # a wrong version must not attach
        encode(StatsQuery(version=0)),
        encode(StepPlan(1, [], version=99)),
        plan,  # from a peer that never attached
        encode(StatsQuery()),
    ]
    sock = dealer(zmq_context, stack, "cachemgr.sock")
    for payload in junk + answered:
        sock.send(payload)
    sock.send_multipart([b"one", b"two", b"three"])
    sock.send_multipart([b"", b""])

    decoder = msgspec.msgpack.Decoder(FromCachemgr)
    replies = []
    deadline = time.monotonic() + 10
    while len(replies) < len(answered) and time.monotonic() < deadline:
        if sock.poll(100):
            replies.append(decoder.decode(sock.recv()))
    assert len(replies) == len(answered) and all(isinstance(r, Failure) for r in replies), replies
    assert not sock.poll(300), "a reply to something that should have been dropped"
    wait_events(stack, "dropped an undecodable message", dropped + len(junk))
    wait_events(stack, "dropped a message with a wrong frame count", frames + 2)
    assert len(stack.events("worker attached")) == attached
    assert not executable.exists()
    assert_sound(stack, before)


def test_garbage_and_bad_requests_on_the_worker_socket(
    tiny_stack: Stack, zmq_context: zmq.Context, tmp_path: Path
) -> None:
    stack, before = tiny_stack, baseline(tiny_stack)
    counts = {
        name: len(stack.events(name))
        for name in (
            "dropped an undecodable gateway message",
            "dropped a gateway message with a wrong frame count",
            "dropped a gateway message of another version",
        )
    }
    gateway_id = f"{FAKE}-gw-{time.monotonic_ns()}"
    ok = SamplingParams(max_new_tokens=2, ignore_eos=True)
    real = keyed(stack, gateway_id, [NewRequest("t", [3, 4, 5], ok)])
    wrong_type = msgspec.to_builtins(GatewayMessage(gateway_id, [NewRequest("w", [3, 4, 5], ok)]))
    wrong_type["adds"][0]["params"]["temperature"] = "hot"
    junk = [
        *_undecodable(real, tmp_path / "executed"),
        encode(StepPlan(1, [PlanEntry("p", 1, [1], 0)])),  # the other link's message
        msgspec.msgpack.encode(wrong_type),
    ]
    sock = dealer(zmq_context, stack, "worker.sock")
    for payload in junk:
        sock.send(payload)
    sock.send_multipart([b"one", b"two", b"three"])
    sock.send_multipart([b"", b""])
    sock.send(keyed(stack, gateway_id, [NewRequest("v2", [3, 4, 5], ok)], version=2))

    # Well-formed messages of a fake gateway with requests the worker must refuse one by one.
    nan = SamplingParams(temperature=math.nan, max_new_tokens=2)
    adds = [
        NewRequest("out-of-vocab", [3, stack.vocab_size, 1 << 40], ok),
        NewRequest("negative", [3, -1], ok),
        NewRequest("empty", [], ok),
        NewRequest("nan", [3, 4], nan),
        NewRequest("max-tokens-negative", [3, 4], SamplingParams(max_new_tokens=-5)),
        NewRequest("max-tokens-huge", [3, 4], SamplingParams(max_new_tokens=2**63)),
        NewRequest("stop-id", [3, 4], SamplingParams(stop_token_ids=(-1, 2**62))),
        NewRequest("seed", [3, 4], SamplingParams(seed=2**64 - 1)),
        NewRequest("never-fits", [5] * 1_000, SamplingParams(max_new_tokens=5_000)),
        NewRequest("dup", [3, 4, 5], ok, priority=-(2**63), cache_salt="\U0010ffff" * 1000),
        NewRequest("dup", [3, 4, 5], ok, priority=2**63 - 1),
        NewRequest("fine", [3, 4, 5], ok, trace_id="\x00" * 100),
    ]
    sock.send(keyed(stack, gateway_id, adds, aborts=["nobody", "", "x" * 10_000]))
    finals = collect_finals(sock, len(adds))
    by_id: dict[str, list[Any]] = {}
    for out in finals:
        by_id.setdefault(out.request_id, []).append(out)
    assert sorted(by_id) == sorted({a.request_id for a in adds}), by_id.keys()
    for rid, outs in by_id.items():
        if rid in ("fine", "dup"):
            continue
        assert [(o.finish, o.code) for o in outs] == [("error", "INVALID_ARGUMENT")], (rid, outs)
    assert [(o.finish, len(o.token_ids) <= 2) for o in by_id["fine"]] == [("length", True)]
    assert sorted(o.finish for o in by_id["dup"]) == ["error", "length"]
    assert not {"t", "w", "v2"} & {o.request_id for o in finals}

    wait_events(
        stack,
        "dropped an undecodable gateway message",
        counts["dropped an undecodable gateway message"] + len(junk),
    )
    wait_events(
        stack,
        "dropped a gateway message with a wrong frame count",
        counts["dropped a gateway message with a wrong frame count"] + 2,
    )
    wait_events(
        stack,
        "dropped a gateway message of another version",
        counts["dropped a gateway message of another version"] + 1,
    )
    sock.close(linger=0)
    assert_sound(stack, before)


I64 = st.integers(-(2**63), 2**63 - 1)
ANY_FLOAT = st.one_of(st.sampled_from(NASTY_FLOATS), st.floats())


@st.composite
def fake_requests(draw: st.DrawFn, vocab: int) -> NewRequest:
    params = SamplingParams(
        temperature=draw(st.one_of(ANY_FLOAT, st.sampled_from([0.0, 0.7]))),
        top_k=draw(st.one_of(I64, st.integers(0, 300))),
        top_p=draw(st.one_of(ANY_FLOAT, st.just(1.0))),
        min_p=draw(st.one_of(ANY_FLOAT, st.just(0.0))),
        repetition_penalty=draw(st.one_of(ANY_FLOAT, st.just(1.0))),
        seed=draw(st.one_of(st.none(), I64, st.integers(0, 2**64 - 1))),
        # Small (runs a few steps) or far beyond the pool (refused); never near 2**64 (the overflow
        # bug of test_a_fake_gateways_huge_max_tokens_does_not_crash_the_worker).
        max_new_tokens=draw(st.one_of(st.integers(-5, 3), st.integers(2_000, 2**63))),
        min_new_tokens=draw(st.one_of(st.integers(0, 3), I64)),
        ignore_eos=draw(st.booleans()),
        stop_token_ids=tuple(draw(st.lists(st.one_of(st.integers(0, vocab - 1), I64), max_size=4))),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 20), I64)),
        presence_penalty=draw(st.one_of(ANY_FLOAT, st.just(0.0))),
        frequency_penalty=draw(st.one_of(ANY_FLOAT, st.just(0.0))),
        logit_bias=tuple(
            draw(st.lists(st.tuples(st.one_of(st.integers(0, vocab - 1), I64), ANY_FLOAT), max_size=4))
        ),
        generated_in_prompt=draw(st.one_of(st.integers(0, 3), I64)),
    )
    prompt = draw(
        st.one_of(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=16), st.lists(I64, max_size=6))
    )
    return NewRequest(
        request_id=draw(st.text(CHARS, max_size=12)),
        prompt_ids=prompt,
        params=params,
        priority=draw(I64),
        cache_salt=draw(st.text(CHARS, max_size=12)),
        trace_id=draw(st.text(CHARS, max_size=12)),
    )


@pytest.mark.fuzz
def test_fuzzed_requests_of_a_fake_gateway_are_refused_or_served(
    tiny_stack: Stack, zmq_context: zmq.Context
) -> None:
    """A fake gateway speaking the protocol, with random field values: each request ends exactly once
    (served, or refused with INVALID_ARGUMENT), and the worker survives."""
    stack, before = tiny_stack, baseline(tiny_stack)
    sock = dealer(zmq_context, stack, "worker.sock")
    gateway_id = f"{FAKE}-fuzz-{time.monotonic_ns()}"
    counter = iter(range(1 << 30))

    @settings(max_examples=50, **FUZZ)
    @given(adds=st.lists(fake_requests(stack.vocab_size), min_size=1, max_size=4))
    def run(adds: list[NewRequest]) -> None:
        n = next(counter)
        adds = [msgspec.structs.replace(a, request_id=f"{n}.{i}.{a.request_id}") for i, a in enumerate(adds)]
        sock.send(keyed(stack, gateway_id, adds))
        finals = collect_finals(sock, len(adds))
        assert sorted(o.request_id for o in finals) == sorted(a.request_id for a in adds), finals
        for out in finals:
            assert (out.finish, out.code) in {
                ("error", "INVALID_ARGUMENT"),
                ("length", ""),
                ("eos", ""),
                ("stop_token", ""),
            }, out
            assert all(0 <= t < stack.vocab_size for t in out.token_ids)

    run()
    sock.close(linger=0)
    assert_sound(stack, before)


def test_no_pickle_or_eval_in_the_services() -> None:
    """msgspec never unpickles; nothing else in the services may deserialize executable data."""
    banned = re.compile(
        r"\bimport (c?pickle|dill|marshal|shelve)\b|\bfrom (c?pickle|dill|marshal|shelve) import"
        r"|(recv|send)_pyobj|\bcloudpickle\b|(?<![.\w])(eval|exec)\(|\btorch\.load\((?!.*weights_only=True)"
        r"|\bpickle\.loads?\("
    )
    hits = [
        f"{path.relative_to(REPO)}:{n}: {line.strip()}"
        for path in sorted((REPO / "services").rglob("*.py"))
        if "_generated" not in path.parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if banned.search(line)
    ]
    assert not hits, hits


# ------------------------------------------------------------------ the cachemgr, fuzzed in-process


CACHE_KEY = "in-process"


@pytest.fixture(scope="module")
def cache_servers(tiny_models: Callable[[str], Path]) -> Callable[[], AbstractContextManager[CacheServer]]:
    """New CacheServers exactly as the cachemgr runs them (shared memory), without the socket loop.
    Their pool is small (8 chunks of 4 tokens, 5 swap slots) so fuzzed plans block, offload and
    restore; each fuzzed example gets its own, so that replaying an example replays its states."""
    model_config = AutoConfig.from_pretrained(tiny_models("llama"))
    config = CBConfig(page_size=4, num_blocks=8, max_batch_tokens=24, cpu_offload_space=1e-5)

    @contextmanager
    def make() -> Iterator[CacheServer]:
        cache = KVCache(model_config, config, torch.float32, torch.device("cpu"), shared=True)
        try:
            yield CacheServer(cache, key=CACHE_KEY)
        finally:
            cache.close()

    return make


RIDS = st.sampled_from(["a", "b", "c", ""])
ENTRY_INTS = st.one_of(st.integers(-3, 40), I64, st.integers(2**63, 2**64 - 1))
PLANS = st.builds(
    StepPlan,
    ENTRY_INTS,
    st.lists(
        st.builds(
            PlanEntry,
            RIDS,
            ENTRY_INTS,
            # Token ids >= 2**63 are the bug of test_an_attached_peer_cannot_crash_the_cachemgr.
            st.lists(st.one_of(st.integers(0, 300), I64), max_size=50),
            ENTRY_INTS,
            st.sampled_from(["", "salt"]),
            ENTRY_INTS,
        ),
        max_size=5,
    ),
    st.lists(RIDS, max_size=3),
    st.lists(RIDS, max_size=3),
)


NAMES = st.sampled_from(["a", "b", "c", "d"])
SOMETIMES = st.one_of(st.just([]), st.just([]), st.lists(NAMES, max_size=1))


def likely_plan(data: st.DataObject, bm: BlockManager, step: int) -> StepPlan:
    """A plan a worker could send, give or take a bug. Counts are drawn from what each request has
    left to compute, so requests grow past the pool (8 chunks), block, are offloaded and come back;
    one entry in eight asks a count out of range, and one plan in eight names a request twice."""
    names = data.draw(st.lists(NAMES, min_size=1, max_size=4, unique=True), label="names")
    if data.draw(st.integers(0, 7), label="twice") == 0:
        names.append(data.draw(st.sampled_from(names), label="again"))
    entries = []
    for name in names:
        req = bm.requests.get(name)
        left = len(req.token_ids) - req.num_computed - req.in_flight if req else 0
        new = data.draw(st.lists(st.integers(0, 300), min_size=0 if left else 1, max_size=8 if req else 24))
        in_range = st.integers(1, max(left + len(new), 1))
        n = data.draw(in_range if data.draw(st.integers(0, 7)) else st.integers(-2, 30), label=name)
        arrival, salt = data.draw(st.integers(0, 3)), data.draw(st.sampled_from(["", "salt"]))
        max_total = data.draw(st.sampled_from([0] * 8 + [48, 10_000]))  # 10_000 never fits
        entries.append(PlanEntry(name, n, new, arrival, salt, max_total))
    return StepPlan(step, entries, data.draw(SOMETIMES), data.draw(SOMETIMES))


def assert_accounted(bm: BlockManager) -> None:
    """Every chunk is free, evictable or named by a table (counted from the tables, not from the
    pool's own tally), and no swap slot is left draining past the end of a step."""
    bm.check()
    named = {c for a in bm.allocators for t in a.tables.values() for c in t if c >= 0}
    assert bm.pool.num_free + len(named) == bm.pool.capacity
    assert not bm.swap.draining, bm.swap.draining


@pytest.mark.fuzz
def test_fuzzed_step_plans_are_served_whole_or_refused_whole(
    cache_servers: Callable[[], AbstractContextManager[CacheServer]],
) -> None:
    """`CacheServer.handle` is what the cachemgr's loop calls with each message; an exception from it
    ends the process. Whatever an attached peer plans, it answers a grant that names each request at
    most once, or a Failure after which the BlockManager is exactly as before the plan."""
    seen: Counter[str] = Counter()

    @settings(max_examples=200, **FUZZ)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        with cache_servers() as server:
            bm = server.cache.block_manager
            assert isinstance(server.handle(b"peer", encode(Attach(f"{FAKE}-fuzz", CACHE_KEY))), Attached)
            for step in range(data.draw(st.integers(2, 12), label="plans")):
                wild = data.draw(st.integers(0, 7), label="wild") == 0
                plan = data.draw(PLANS, label="plan") if wild else likely_plan(data, bm, step)
                before = state_of(bm)
                reply = server.handle(b"peer", encode(plan))
                note(f"{plan} -> {reply}")
                if isinstance(reply, StepGrant):
                    named = [g.request_id for g in reply.granted]
                    assert len(set(named)) == len(named), named
                else:
                    seen["refused"] += isinstance(reply, Failure)
                    assert state_of(bm) == before, reply
                assert_accounted(bm)
            # The others finish and the offloaded requests come back, as a worker would have them.
            back = [r for r in bm.requests.values() if r.state is CacheState.OFFLOADED]
            if back:
                entries = [
                    PlanEntry(r.request_id, 1, [] if r.num_computed < len(r.token_ids) else [0], 0)
                    for r in back
                ]
                others = [rid for rid, r in bm.requests.items() if r.state is not CacheState.OFFLOADED]
                assert isinstance(server.handle(b"peer", encode(StepPlan(99, entries, others))), StepGrant)
                assert_accounted(bm)
            seen.update(offloads=bm.stats.offloads, restores=bm.stats.swap_restores)

    run()
    # Else the fuzz never reached what it is here for.
    assert seen["refused"] and seen["offloads"] and seen["restores"], seen


def test_an_attached_peer_cannot_crash_the_cachemgr(
    cache_servers: Callable[[], AbstractContextManager[CacheServer]],
) -> None:
    with cache_servers() as server:
        assert isinstance(server.handle(b"peer", encode(Attach(f"{FAKE}-overflow", CACHE_KEY))), Attached)
        plan = StepPlan(1, [PlanEntry("big-ids", 16, [2**64 - 1] * 16, 0, "", 17)])
        reply = server.handle(b"peer", encode(plan))
        assert reply is None or isinstance(reply, Failure), reply


# ----------------------------------------------------------------- findings on the running stack


def _stream_in_background(stack: Stack, max_tokens: int, timeout_s: float) -> tuple[threading.Thread, dict]:
    """A long greedy stream; `result["first"]` is set once its first token arrived."""
    result: dict[str, Any] = {"first": threading.Event(), "ids": []}

    def run() -> None:
        request = greedy_request(SOUND_PROMPT, max_tokens)
        try:
            for response in stack.stub.Generate(request, timeout=timeout_s):
                result["ids"] += response.chunk.token_ids
                result["first"].set()
            result["code"] = OK
        except grpc.RpcError as exc:
            result["code"], result["details"] = exc.code(), exc.details()
        result["first"].set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert result["first"].wait(30), "the stream never started"
    return thread, result


def test_a_foreign_attach_does_not_disturb_the_worker(tiny_stack: Stack, zmq_context: zmq.Context) -> None:
    """Once a bug: any peer's Attach was handed the pool handles and dropped the worker's requests."""
    stack, before = tiny_stack, baseline(tiny_stack)
    attached = len(stack.events("worker attached"))
    thread, result = _stream_in_background(stack, max_tokens=60, timeout_s=60)
    sock = dealer(zmq_context, stack, "cachemgr.sock")
    decoder = msgspec.msgpack.Decoder(FromCachemgr)
    replies = []
    for key in ("", "guess", stack.internal_key[:-1], stack.internal_key + "0"):
        sock.send(encode(Attach(f"{FAKE}-intruder", key)))
        replies.append(decoder.decode(sock.recv()) if sock.poll(5000) else None)
    thread.join(60)
    sock.close(linger=0)
    try:
        assert all(isinstance(r, Failure) and "internal key" in r.reason for r in replies), replies
        assert len(stack.events("worker attached")) == attached
        assert result.get("code") == OK, result.get("details")
        assert len(result["ids"]) == 60
    finally:
        recover(stack, before)


def test_gateway_messages_without_the_key_are_dropped(tiny_stack: Stack, zmq_context: zmq.Context) -> None:
    stack, before = tiny_stack, baseline(tiny_stack)
    dropped = len(stack.events("dropped a gateway message without the internal key"))
    sock = dealer(zmq_context, stack, "worker.sock")
    ok = SamplingParams(max_new_tokens=2, ignore_eos=True)
    for n, key in enumerate(("", "guess", stack.internal_key.upper())):
        sock.send(
            encode(
                GatewayMessage(f"{FAKE}-keyless-{n}", [NewRequest("r", [3, 4, 5], ok)], load_query=1, key=key)
            )
        )
    wait_events(stack, "dropped a gateway message without the internal key", dropped + 3)
    assert not sock.poll(1000), "a peer without the key was answered"
    assert stack.load().requests_running + stack.load().requests_waiting == 0
    sock.close(linger=0)
    assert_sound(stack, before)


def _real_gateway_id(stack: Stack) -> str:
    """The id the running gateway announced: the first worker greeting after the gateway started."""
    found = ""
    for event in stack.log_events():
        if event.get("event") == "started" and event.get("child") == "gateway":
            found = ""
        elif event.get("event") == "gateway connected" and not found:
            found = event["gateway_id"] if not event["gateway_id"].startswith(FAKE) else ""
    assert found, "the gateway never connected"
    return found


def test_a_stranger_cannot_abort_the_gateways_requests(tiny_stack: Stack, zmq_context: zmq.Context) -> None:
    stack, before = tiny_stack, baseline(tiny_stack)
    thread, result = _stream_in_background(stack, max_tokens=30, timeout_s=5)
    sock = dealer(zmq_context, stack, "worker.sock")
    # The gateway names its requests r0, r1, ... (one per admitted call): abort more than were admitted.
    admitted = len(stack.events("request added"))
    aborts = [f"r{i}" for i in range(2 * admitted + 1_000)]
    sock.send(keyed(stack, _real_gateway_id(stack), aborts=aborts))
    thread.join(30)
    sock.close(linger=0)
    try:
        assert result.get("code") == OK, (result.get("code"), result.get("details"), len(result["ids"]))
        assert len(result["ids"]) == 30
    finally:
        recover(stack, before)


def test_a_prompt_over_the_step_cache_budget_is_refused_not_queued_forever(
    tiny_stack: Stack, zmq_context: zmq.Context
) -> None:
    stack, before = tiny_stack, baseline(tiny_stack)
    sizing = stack.events("kv cache sized")[-1]
    prompt_len = sizing["max_pages_per_step"] * int(stack.info.page_size) + 8  # over the budget
    sock = dealer(zmq_context, stack, "worker.sock")
    gateway_id = f"{FAKE}-budget-{time.monotonic_ns()}"
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    sock.send(keyed(stack, gateway_id, [NewRequest("long", [5] * prompt_len, params)]))
    finals = collect_finals(sock, 1, timeout_s=3)
    load = stack.load()
    sock.send(keyed(stack, gateway_id, aborts=["long"]))  # clean up what never ended
    time.sleep(0.5)
    sock.close(linger=0)
    try:
        assert len(finals) == 1, f"a {prompt_len}-token prompt never ended; load: {load}"
    finally:
        recover(stack, before)


# Last: when it fails, the worker dies and the supervisor restarts it (several seconds).
def test_a_fake_gateways_huge_max_tokens_does_not_crash_the_worker(
    tiny_stack: Stack, zmq_context: zmq.Context
) -> None:
    stack, before = tiny_stack, baseline(tiny_stack)
    sock = dealer(zmq_context, stack, "worker.sock")
    params = SamplingParams(max_new_tokens=2**64 - 1)
    sock.send(keyed(stack, f"{FAKE}-overflow", [NewRequest("huge", [3, 4, 5], params)]))
    finals = collect_finals(sock, 1, timeout_s=10)
    sock.close(linger=0)
    time.sleep(1.0)  # the supervisor notices a death within 0.2 s
    try:
        assert [(o.finish, o.code) for o in finals] == [("error", "INVALID_ARGUMENT")], finals
        assert len(stack.events("child died; restarting")) == before.deaths, "the worker died"
    finally:
        recover(stack, before)
