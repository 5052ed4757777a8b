"""Structured output through OpenAI's HTTP API: the official `openai` client, smg in front of a stack
on SmolLM2 (`cbserve up --http-port`). smg turns `response_format` into the VllmEngine `constraint`
oneof, which cbserve maps to its own; the answer parses and validates against the schema.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from services.supervisor import free_port
from tests.conftest import SMOL_STACK_SETTINGS
from tests.stack import Stack

ROUTER_START_S = 60.0
CALL_TIMEOUT_S = 120.0

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
        "population_millions": {"type": "number", "minimum": 0},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
    },
    "required": ["city", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}


def _ready(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readiness", timeout=2) as reply:
            return bool(json.loads(reply.read()).get("healthy_workers") == 1)
    except OSError:
        return False


@pytest.fixture(scope="module")
def routed(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, int]]:
    http = free_port()
    up_args = ["--http-port", str(http), "--router-metrics-port", str(free_port())]
    stack = Stack(
        smollm2_dir, tmp_path_factory.mktemp("routed_grammar"), up_args=up_args, **SMOL_STACK_SETTINGS
    )
    try:
        deadline = time.monotonic() + ROUTER_START_S
        while not _ready(http):
            assert time.monotonic() < deadline, "smg not ready"
            time.sleep(0.5)
        yield stack, http
    finally:
        stack.stop()


def client(http_port: int) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    )


def ask(routed: tuple[Stack, int], stream: bool, **extra: Any) -> tuple[str, str | None]:
    """(the answer's text, its finish reason)."""
    stack, http_port = routed
    model = stack.info.model_id
    c = client(http_port)
    messages: Any = [{"role": "user", "content": "Describe Paris as JSON."}]
    if not stream:
        reply = c.chat.completions.create(
            model=model, messages=messages, max_tokens=200, temperature=0.0, **extra
        )
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason
    text, finish = [], None
    for chunk in c.chat.completions.create(
        model=model, messages=messages, max_tokens=200, temperature=0.0, stream=True, **extra
    ):
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(text), finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_response_format_json_schema(routed: tuple[Stack, int], stream: bool) -> None:
    stack, _ = routed
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": SCHEMA, "strict": True},
    }
    text, finish = ask(routed, stream, response_format=response_format)
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    stack.assert_idle()


def test_response_format_json_object(routed: tuple[Stack, int]) -> None:
    text, finish = ask(routed, False, response_format={"type": "json_object"})
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict)


def test_a_bad_schema_is_a_400_quoting_the_compiler(routed: tuple[Stack, int]) -> None:
    stack, _ = routed
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": 3}}}
    with pytest.raises(openai.BadRequestError) as info:
        ask(routed, False, response_format=bad)
    assert "json_schema" in str(info.value), info.value
    stack.assert_idle()


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
}


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_forced_tool_call_arguments_validate(routed: tuple[Stack, int], tool_choice: Any) -> None:
    stack, http_port = routed
    reply = client(http_port).chat.completions.create(
        model=stack.info.model_id,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice=tool_choice,
        max_tokens=200,
        temperature=0.0,
    )
    calls = reply.choices[0].message.tool_calls
    assert calls, reply
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    stack.assert_idle()
