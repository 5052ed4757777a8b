"""Structured output through cbserve.v1 on the real stack (SmolLM2): each kind of the `constraint`
oneof reaches the worker and holds the output to it; a constraint that does not compile ends its call
with INVALID_ARGUMENT quoting the compiler, leaks no block, and leaves the stack serving.
"""

from __future__ import annotations

import json
import re
from typing import Any

import grpc
import jsonschema
import pytest

from services.bench.serve.metrics import parse_histogram, scrape
from services.gateway.api import pb
from tests.stack import Stack

CALL_TIMEOUT_S = 120.0

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        "capital": {"type": "boolean"},
        "climate": {"enum": ["hot", "mild", "cold"]},
    },
    "required": ["city", "population", "languages", "capital", "climate"],
}


def chat(question: str, max_tokens: int = 96, **sampling: Any) -> Any:
    request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=question)]))
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    for name, value in sampling.items():
        if name == "choice":
            request.sampling.choice.choices.extend(value)
        else:
            setattr(request.sampling, name, value)
    return request


def error_of(stack: Stack, request: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stack.generate(request, timeout_s=CALL_TIMEOUT_S)
    return info.value


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(smol_stack: Stack, temperature: float) -> None:
    request = chat("Describe Paris as JSON.", 160, json_schema=json.dumps(SCHEMA), temperature=temperature)
    request.sampling.seed = 7
    _, text, final, _ = smol_stack.generate(request, timeout_s=CALL_TIMEOUT_S)
    assert final.finish_reason == pb.FINISH_REASON_EOS, (final, text)
    jsonschema.validate(json.loads(text), SCHEMA)
    smol_stack.assert_idle()


def test_json_object(smol_stack: Stack) -> None:
    question = 'Answer in JSON with the key "capital": what is the capital of France?'
    _, text, final, _ = smol_stack.generate(chat(question, 160, json_object=True))
    assert final.finish_reason == pb.FINISH_REASON_EOS, (final, text)
    assert isinstance(json.loads(text), dict)


def test_regex_and_choice(smol_stack: Stack) -> None:
    pattern = r"(yes|no), because [a-z ]{1,40}\."
    _, text, final, _ = smol_stack.generate(chat("Is the sky blue?", 64, regex=pattern))
    assert re.fullmatch(pattern, text), text
    assert final.finish_reason == pb.FINISH_REASON_EOS
    choices = ["Paris", "London", "Berlin", "Madrid"]
    _, text, final, _ = smol_stack.generate(chat("What is the capital of France?", 16, choice=choices))
    assert text in choices and final.finish_reason == pb.FINISH_REASON_EOS, (text, final)
    # The step profile's grammar phases: observed in the steps that held constrained requests.
    phases = parse_histogram(scrape(f"http://127.0.0.1:{smol_stack.metrics_port}/metrics"))
    for phase in ("grammar_advance", "grammar_fill", "grammar_apply"):
        seconds, steps = phases[phase]
        assert steps > 0 and seconds > 0, (phase, phases)


def test_ebnf(smol_stack: Stack) -> None:
    grammar = 'root ::= "[" num ("," num)* "]"\nnum ::= [1-9] [0-9]?'
    _, text, final, _ = smol_stack.generate(chat("List some small numbers.", 48, ebnf=grammar))
    if final.finish_reason == pb.FINISH_REASON_EOS:
        assert re.fullmatch(r"\[[1-9][0-9]?(,[1-9][0-9]?)*\]", text), text
    else:  # the grammar admits endless lists: the limit may come first, on a prefix of one
        assert final.finish_reason == pb.FINISH_REASON_LENGTH
        assert re.fullmatch(r"\[([1-9][0-9]?,)*[1-9]?[0-9]?", text), text


@pytest.mark.parametrize(
    ("field", "value", "quoted"),
    [
        ("json_schema", '{"type": 3}', "sampling.json_schema does not compile: "),
        ("json_schema", '{"type": "object"', "sampling.json_schema does not compile: "),
        ("regex", "(unclosed", "sampling.regex does not compile: "),
        ("ebnf", "root ::= missing", "sampling.ebnf does not compile: "),
        ("choice", [""], "sampling.choice strings must be non-empty"),
    ],
    ids=["schema_type", "schema_syntax", "regex", "ebnf", "empty_choice"],
)
def test_bad_constraint_is_invalid_argument(smol_stack: Stack, field: str, value: Any, quoted: str) -> None:
    error = error_of(smol_stack, chat("Hi", 8, **{field: value}))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.details().startswith(quoted) and len(error.details()) > len(quoted) + 5, error.details()
    smol_stack.assert_idle()
    # Nothing else was disturbed: the next call runs.
    _, _, final, _ = smol_stack.generate(chat("Hi", 4))
    assert final.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)
