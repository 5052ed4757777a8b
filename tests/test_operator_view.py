"""What an operator and a client see of a running stack (the session's tiny and SmolLM2 stacks): the
one human line when it serves, log lines that name their process and say how each request ended,
metrics and health on the metrics port, the served model's name, logprobs with token text,
Detokenize, errors in the API's field names, and `cbserve generate`'s flags on a real call."""

from __future__ import annotations

import json
import re
import sys
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import grpc
import pytest
import structlog
from transformers import AutoTokenizer

from services.cli import main
from services.common.logging import configure_logging
from services.gateway.api import pb
from tests.stack import Stack, greedy_request

CALL_TIMEOUT_S = 60.0
STACK_SERVICES = {"supervisor", "cachemgr", "worker", "gateway"}


def trace(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def finished(stack: Stack, trace_id: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """The gateway's "request finished" line of one request."""
    deadline = time.monotonic() + timeout_s
    while True:
        for event in stack.events("request finished"):
            if event.get("service") == "gateway" and event.get("request_id") == trace_id:
                return event
        assert time.monotonic() < deadline, f"no 'request finished' for {trace_id}:\n{stack.log_tail()}"
        time.sleep(0.05)


def http_get(stack: Stack, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


# ----------------------------------------------------------------------------------- start-up, logs


def test_one_plain_line_says_what_serves_where(tiny_stack: Stack) -> None:
    lines = [line for line in tiny_stack.log_path.read_text().splitlines() if not line.startswith("{")]
    name = tiny_stack.model_dir.name
    tokens = tiny_stack.info.total_blocks * tiny_stack.info.page_size
    expected = (
        f"serving {name} in float32 on 127.0.0.1:{tiny_stack.port}, metrics on "
        f"http://127.0.0.1:{tiny_stack.metrics_port}/metrics; "
        f"KV cache {tiny_stack.info.total_blocks:,} blocks = {tokens:,} tokens ("
    )
    # That line, once, and nothing else outside the JSON lines: no progress bars among them.
    assert len(lines) == 1 and lines[0].startswith(expected), lines


def test_each_log_line_reaches_stderr_in_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """`cbserve up`'s processes share one stderr file, so a line written in two pieces (its text,
    then its newline) can merge with another process's line into one no JSON parser reads. That
    happened once in CI: a merged line and an empty one after the "serving" line."""
    writes: list[str] = []

    class Recorder:
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    before = structlog.get_config()
    try:
        configure_logging(json=True, service="probe")
        structlog.get_logger("probe").info("one line", payload="x" * 10_000)
    finally:
        structlog.configure(**before)  # the rest of the run logs where it did, not into the recorder
    assert len(writes) == 1, writes
    assert writes[0].endswith("\n") and writes[0].count("\n") == 1
    assert json.loads(writes[0])["service"] == "probe"


def test_every_log_line_names_its_process(tiny_stack: Stack) -> None:
    events = list(tiny_stack.log_events())
    assert events
    for event in events:
        assert event.get("service") in STACK_SERVICES and isinstance(event.get("pid"), int), event
    pids = {e["service"]: set() for e in events}
    for event in events:
        pids[event["service"]].add(event["pid"])
    for name in ("cachemgr", "worker", "gateway"):
        assert tiny_stack.child_pid(name) in pids[name]
    assert len(pids["supervisor"]) == 1


def test_the_log_says_how_each_request_ended(tiny_stack: Stack, smol_stack: Stack) -> None:
    prompt = [(7 * i + 5) % 250 + 3 for i in range(6)]
    long = tiny_stack.info.max_model_len - len(prompt)  # runs long after the call has ended
    done = trace("length")
    tiny_stack.generate(greedy_request(prompt, 3), metadata=(("x-request-id", done),))
    event = finished(tiny_stack, done)
    assert (event["reason"], event["completion_tokens"], event["prompt_tokens"]) == ("length", 3, 6)

    cancelled = trace("cancel")
    call = tiny_stack.stub.Generate(
        greedy_request(prompt, long), timeout=CALL_TIMEOUT_S, metadata=(("x-request-id", cancelled),)
    )
    assert next(call).HasField("chunk")
    call.cancel()
    assert finished(tiny_stack, cancelled)["reason"] == "cancelled"

    expired = trace("deadline")
    with pytest.raises(grpc.RpcError) as info:
        list(
            tiny_stack.stub.Generate(
                greedy_request(prompt, long), timeout=0.5, metadata=(("x-request-id", expired),)
            )
        )
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert finished(tiny_stack, expired)["reason"] == "deadline"

    # A stop string ends the request in the gateway: that is a finish, not an abort.
    stopped = trace("stop")
    request = chat_request("What is the capital of France?", 64)
    request.stopping.stop.append(" ")  # in any answer of a few words
    _, text, final, _ = smol_stack.generate(request, metadata=(("x-request-id", stopped),))
    assert final.finish_reason == pb.FINISH_REASON_STOP_SEQUENCE, text
    assert finished(smol_stack, stopped)["reason"] == "stop_sequence"
    tiny_stack.wait_idle()
    smol_stack.wait_idle()


# ---------------------------------------------------------------------------------------- metrics


def test_metrics_and_health_on_the_metrics_port(tiny_stack: Stack) -> None:
    status, text = http_get(tiny_stack, "/metrics")
    assert status == 200
    assert "_created" not in text
    model = re.search(r"^cbserve:model_info\{([^}]*)\} 1\.0$", text, re.M)
    assert model and f'model_name="{tiny_stack.model_dir.name}"' in model[1], text
    assert re.search(r'^cbserve:build_info\{.*version="[^"]+".*\} 1\.0$', text, re.M)
    assert re.search(r"^cbserve:max_queue_size 1024\.0$", text, re.M)
    assert http_get(tiny_stack, "/health") == (200, "SERVING\n")
    for path in ("/", "/v1/models", "/metricsx"):
        assert http_get(tiny_stack, path)[0] == 404, path


# ------------------------------------------------------------------------------------------ API


def test_model_id_is_the_served_name_not_a_path(tiny_stack: Stack) -> None:
    assert tiny_stack.info.model_id == tiny_stack.model_dir.name
    assert "/" not in tiny_stack.info.model_id


def chat_request(question: str, max_tokens: int) -> Any:
    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=question)]))
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    return request


@pytest.fixture(scope="module")
def smol_tokenizer(smol_stack: Stack) -> Any:
    return AutoTokenizer.from_pretrained(smol_stack.model_dir, local_files_only=True)


def test_logprobs_carry_the_token_text(smol_stack: Stack, smol_tokenizer: Any) -> None:
    request = chat_request("What is the capital of France?", 6)
    request.output.logprobs = 3
    logprobs = []
    for response in smol_stack.stub.Generate(request, timeout=CALL_TIMEOUT_S):
        if response.HasField("chunk"):
            logprobs += response.chunk.logprobs
    assert len(logprobs) == 6
    for lp in logprobs:
        assert lp.token == smol_tokenizer.decode([lp.token_id])
        assert [t.token for t in lp.top] == [smol_tokenizer.decode([t.token_id]) for t in lp.top]


def test_detokenize(smol_stack: Stack, smol_tokenizer: Any, tiny_stack: Stack) -> None:
    text = "Continuous batching: héllo wörld!"
    ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"]
    reply = smol_stack.stub.Detokenize(pb.DetokenizeRequest(token_ids=ids), timeout=10)
    assert reply.text == text
    eos = list(smol_stack.info.eos_token_ids)
    with_eos = [*ids, *eos]
    assert smol_stack.stub.Detokenize(pb.DetokenizeRequest(token_ids=with_eos), timeout=10).text != text
    skipped = pb.DetokenizeRequest(token_ids=with_eos, skip_special_tokens=True)
    assert smol_stack.stub.Detokenize(skipped, timeout=10).text == text
    for stack, request, message in [
        (smol_stack, pb.DetokenizeRequest(token_ids=[5, smol_stack.vocab_size]), "out of vocabulary"),
        (smol_stack, pb.DetokenizeRequest(token_ids=[5] * (smol_stack.info.max_model_len + 1)), "at most"),
        (tiny_stack, pb.DetokenizeRequest(token_ids=[5, 6]), "needs a tokenizer"),
    ]:
        with pytest.raises(grpc.RpcError) as info:
            stack.stub.Detokenize(request, timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in info.value.details()


def test_errors_use_the_apis_field_names(tiny_stack: Stack) -> None:
    with pytest.raises(grpc.RpcError) as info:
        list(tiny_stack.stub.Generate(greedy_request([5, 6, 7], 0), timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("stopping.max_tokens must be in [1, "), info.value.details()


def test_generate_command_with_every_sampling_flag(
    smol_stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "generate",
        "--target",
        smol_stack.target,
        "--chat",
        "What is the capital of France?",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--logprobs",
        "2",
        "--top-k",
        "5",
        "--top-p",
        "0.9",
        "--min-p",
        "0.01",
        "--seed",
        "1",
        "--priority",
        "4",
        "--cache-salt",
        "cli",
        "-v",
        "--prompt-logprobs",
        "0",
    ]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert out.strip()
    final = json.loads(err[err.index("{") :])
    assert final["usage"]["completionTokens"] == 5 and final["finishReason"] == "FINISH_REASON_LENGTH"
    prompt_part, generated_part = err.split("generated:\n")
    assert prompt_part.startswith("prompt (from its second token):\n")
    line = re.compile(r"^\s*-?\d+\.\d{4}  ")
    assert len([x for x in prompt_part.splitlines() if line.match(x)]) == final["usage"]["promptTokens"] - 1
    assert len([x for x in generated_part.splitlines() if line.match(x)]) == 5, err
    added = [e for e in smol_stack.events("request added") if e.get("request_id") == final["requestId"]]
    assert added and added[0]["priority"] == 4
