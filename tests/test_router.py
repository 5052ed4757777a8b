"""OpenAI's HTTP API through the smg router, driven by the official `openai` client: `cbserve up
--http-port` (smg as the stack's fourth child) and a fleet of two stacks behind one smg.

The model is the tiny Llama over SmolLM2's tokenizer (tests/tiny_models.py): smg tokenizes, renders
the chat template and detokenizes itself, so the model must carry a tokenizer; tiny keeps it fast.
What smg answers is compared with what cbserve's own API answers for the same request, greedy:
the same text and the same token counts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from services.gateway.api import pb
from services.gateway.text_generation import OPENAI_FINISH_REASONS
from services.router import gateway_url, smg_command
from services.supervisor import die_with_parent, free_port, stop_process
from tests.cli_contract import run_main
from tests.conftest import TINY_STACK_SETTINGS
from tests.interop.node_runner import needs_node, node_openai_stream
from tests.smg_router import ROUTER_START_S, client, routed_stack, wait_router
from tests.stack import CALL_TIMEOUT_S, CHAT, Stack, chat_request

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def text_model(tiny_text_model: Path) -> Path:
    return tiny_text_model


@pytest.fixture(scope="module")
def routed(text_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, int]]:
    with routed_stack(text_model, tmp_path_factory.mktemp("routed")) as started:
        yield started


# --------------------------------------------------------------------- what cbserve's API answers


def cbserve_answer(stack: Stack, kind: str, max_tokens: int) -> tuple[str, Any]:
    """(text, final message) of cbserve's own API, greedy, stopping at EOS as OpenAI requests do."""
    if kind == "chat":
        request = chat_request(CHAT, max_tokens, ignore_eos=False)
    else:
        request = pb.GenerateRequest(text=PROMPT)
        request.sampling.temperature, request.stopping.max_tokens = 0.0, max_tokens
    _, text, final, _ = stack.generate(request, timeout_s=CALL_TIMEOUT_S)
    return text, final


def openai_answer(
    api: openai.OpenAI, model: str, kind: str, max_tokens: int, stream: bool
) -> tuple[str, Any]:
    """(text, usage) of one greedy request through smg."""
    common: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}
    if stream:
        common["stream_options"] = {"include_usage": True}
    if kind == "chat":
        reply = api.chat.completions.create(messages=CHAT, **common)  # type: ignore[arg-type]
    else:
        reply = api.completions.create(prompt=PROMPT, **common)
    if not stream:
        choice = reply.choices[0]
        return (choice.message.content or "") if kind == "chat" else choice.text, reply.usage
    parts, usage = [], None
    for event in reply:
        usage = event.usage or usage
        for choice in event.choices:
            parts.append((choice.delta.content or "") if kind == "chat" else choice.text)
    return "".join(parts), usage


def assert_same_answer(stack: Stack, http_port: int, kind: str, stream: bool, max_tokens: int = 12) -> None:
    text, final = cbserve_answer(stack, kind, max_tokens)
    got, usage = openai_answer(client(http_port), stack.info.model_id, kind, max_tokens, stream)
    assert text and got == text
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        final.usage.prompt_tokens,
        final.usage.completion_tokens,
    )


# ------------------------------------------------------------------------------ cbserve up --http-port


def test_models_lists_the_served_model(routed: tuple[Stack, int]) -> None:
    stack, http = routed
    assert [m.id for m in client(http).models.list().data] == [stack.info.model_id]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_greedy_answer_equals_the_cbserve_api(routed: tuple[Stack, int], kind: str, stream: bool) -> None:
    stack, http = routed
    assert_same_answer(stack, http, kind, stream)
    stack.assert_idle()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_n_choices_repeat_with_a_seed_and_equal_the_cbserve_api(
    routed: tuple[Stack, int], stream: bool
) -> None:
    stack, http = routed
    sampling: dict[str, Any] = {"max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 4}

    def ask() -> dict[int, str]:
        reply = client(http).chat.completions.create(
            model=stack.info.model_id,
            messages=CHAT,  # type: ignore[arg-type]
            stream=stream,
            **sampling,
        )
        if not stream:
            return {c.index: c.message.content or "" for c in reply.choices}
        texts: dict[int, str] = {}
        for event in reply:
            for c in event.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        return texts

    first = ask()
    assert sorted(first) == [0, 1, 2, 3]
    assert ask() == first
    request = chat_request(CHAT, sampling["max_tokens"], ignore_eos=False)
    request.sampling.temperature, request.sampling.seed, request.sampling.n = 1.0, 11, 4
    texts: dict[int, str] = {}
    for response in stack.stub.Generate(request, timeout=CALL_TIMEOUT_S):
        if response.HasField("chunk"):
            texts[response.chunk.index] = texts.get(response.chunk.index, "") + response.chunk.text
    assert texts == first
    assert len(set(first.values())) > 1
    stack.assert_idle()


@needs_node
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_node_fetch_client_streams_the_cbserve_answer(routed: tuple[Stack, int], kind: str) -> None:
    """A Node.js application's own OpenAI client, `fetch` and an SSE reader without the SDK."""
    stack, http = routed
    max_tokens = 12
    text, final = cbserve_answer(stack, kind, max_tokens)
    body: dict[str, Any] = {"model": stack.info.model_id, "max_tokens": max_tokens, "temperature": 0.0}
    body |= {"messages": CHAT} if kind == "chat" else {"prompt": PROMPT}
    out = node_openai_stream(f"http://127.0.0.1:{http}/v1", kind, body)
    assert "error" not in out, out
    assert text and out["text"] == text
    assert out["finish_reason"] == OPENAI_FINISH_REASONS[final.finish_reason]
    assert (out["usage"]["prompt_tokens"], out["usage"]["completion_tokens"]) == (
        final.usage.prompt_tokens,
        final.usage.completion_tokens,
    )
    stack.assert_idle()


def test_a_client_that_goes_away_frees_its_request(routed: tuple[Stack, int]) -> None:
    stack, http = routed
    events = client(http).completions.create(
        model=stack.info.model_id, prompt=PROMPT, max_tokens=900, temperature=0.0, stream=True
    )
    for _, _ in zip(range(3), events, strict=False):
        pass
    assert stack.load().requests_running == 1
    events.close()  # smg cancels its call to the gateway, which aborts the request in the worker
    stack.wait_idle(timeout_s=5)
    stack.assert_idle()


def test_the_serving_line_names_the_http_port_once_it_lists_the_model(routed: tuple[Stack, int]) -> None:
    """The router starts once the gateway serves (no warm-up warnings of a gateway it cannot reach),
    and the `serving` line comes once the HTTP port lists the model, and names it."""
    stack, http = routed
    deadline = time.monotonic() + ROUTER_START_S
    while not (lines := [x for x in stack.log_tail(10_000).splitlines() if x.startswith("serving ")]):
        assert time.monotonic() < deadline, stack.log_tail()
        time.sleep(0.2)
    assert len(lines) == 1 and f", OpenAI HTTP on http://127.0.0.1:{http}," in lines[0], lines
    assert "grpc health check failed" not in stack.log_tail(10_000)  # smg's warning while it waits


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_request_is_a_400_streamed_or_not(routed: tuple[Stack, int], stream: bool) -> None:
    """A request the gateway refuses (max_tokens beyond the model's context) is HTTP 400 before any
    byte of an answer, streamed as well: the gateway refuses before it sends its headers."""
    stack, http = routed
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        reply = client(http).completions.create(
            model=stack.info.model_id, prompt=PROMPT, max_tokens=100_000, stream=stream
        )
        if stream:
            list(reply)  # type: ignore[arg-type]


def test_the_routers_logs_reach_stderr_tagged_as_the_router(routed: tuple[Stack, int]) -> None:
    stack, _ = routed
    router_records = [e for e in stack.log_events() if e.get("service") == "router"]
    assert router_records, stack.log_tail()
    # smg's own fields are kept: each record is smg's JSON with `service` added.
    assert all("level" in e or "message" in e or "fields" in e for e in router_records), router_records[:3]


def test_the_router_is_a_supervised_child(routed: tuple[Stack, int]) -> None:
    stack, http = routed
    os.kill(stack.child_pid("router"), signal.SIGKILL)
    deadline = time.monotonic() + ROUTER_START_S
    while len([e for e in stack.events("started") if e.get("child") == "router"]) < 2:
        assert time.monotonic() < deadline, stack.log_tail()
        time.sleep(0.2)
    wait_router(http)
    assert_same_answer(stack, http, "completion", stream=False)


def test_up_refuses_a_router_it_cannot_run(
    tiny_models: Callable[[str], Path],
    text_model: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def up(model: Path, *flags: str) -> str:
        ports = [
            "--port",
            str(free_port()),
            "--metrics-port",
            "0",
            "--http-port",
            str(free_port()),
            "--router-metrics-port",
            str(free_port()),
        ]
        argv = ["up", "--model", str(model), *ports, *flags]
        code, _, err = run_main(argv, capsys)
        assert code == 2, err
        return err

    assert "holds no tokenizer files" in up(tiny_models("llama"))
    assert "plaintext gRPC without a key" in up(text_model, "--api-key", "k" * 24)
    monkeypatch.setattr("services.router.smg_executable", lambda: None)
    assert "pip install 'cbserve[router]'" in up(text_model)


# ---------------------------------------------------------------------------- a fleet behind one smg


@pytest.mark.slow
def test_a_killed_gateway_is_routed_around_and_rejoins(
    routed: tuple[Stack, int], text_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two stacks behind one smg (round robin): greedy answers equal cbserve's whichever serves them.
    Then one stack's gateway is killed while streams run on both: only streams it was serving may
    fail, and every request sent after the kill is retried on the other stack by smg and completes.
    The killed gateway comes back (its supervisor restarts it) and smg routes to it again."""
    first, _ = routed
    second = Stack(text_model, tmp_path_factory.mktemp("second"), **TINY_STACK_SETTINGS)
    http = free_port()
    argv = smg_command(
        host="127.0.0.1",
        http_port=http,
        metrics_port=free_port(),
        model_dir=str(text_model),
        worker_urls=[gateway_url("127.0.0.1", s.port) for s in (first, second)],
        policy="round_robin",
    )
    log = (tmp_path_factory.mktemp("fleet_router") / "smg.log").open("wb")
    router = subprocess.Popen(argv, stdout=log, stderr=log, preexec_fn=die_with_parent)
    try:
        wait_router(http, healthy=2)
        for kind in ("chat", "completion"):
            for stream in (False, True):
                for _ in range(2):  # round robin: one on each stack
                    assert_same_answer(first, http, kind, stream)
        max_tokens = 160
        expected, _ = cbserve_answer(first, "completion", max_tokens)
        errors: dict[str, list[str | None]] = {"in flight": [], "after the kill": []}
        streaming = threading.Semaphore(0)  # released by each stream's first text

        def stream_one(phase: str) -> None:
            parts: list[str] = []
            try:
                events = client(http).completions.create(
                    model=first.info.model_id,
                    prompt=PROMPT,
                    max_tokens=max_tokens,
                    temperature=0.0,
                    stream=True,
                )
                for event in events:
                    if not parts:
                        streaming.release()
                    parts += [c.text for c in event.choices]
                text = "".join(parts)
                errors[phase].append(None if text == expected else f"text differs: {text!r}")
            except openai.APIError as exc:
                errors[phase].append(repr(exc))

        def start(phase: str, n: int) -> list[threading.Thread]:
            threads = [threading.Thread(target=stream_one, args=(phase,)) for _ in range(n)]
            for thread in threads:
                thread.start()
            return threads

        threads = start("in flight", 6)
        for _ in threads:
            assert streaming.acquire(timeout=CALL_TIMEOUT_S), "a stream never started"
        on_second = second.load().requests_running  # what the kill may fail
        os.kill(second.child_pid("gateway"), signal.SIGKILL)
        threads += start("after the kill", 6)
        for thread in threads:
            thread.join(2 * CALL_TIMEOUT_S)
        assert not any(t.is_alive() for t in threads)
        failed = [e for e in errors["in flight"] if e is not None]
        assert len(failed) <= on_second and all("text differs" not in e for e in failed), errors
        assert errors["after the kill"] == [None] * 6, errors
        second.wait_serving()  # its supervisor restarted the gateway
        wait_router(http, healthy=2, timeout_s=180)  # and smg's health checks found it again
        served = len(second.events("request finished"))
        for _ in range(4):
            assert_same_answer(first, http, "completion", stream=False)
        assert len(second.events("request finished")) > served
    finally:
        stop_process(router, 20)
        log.close()
        second.stop()
