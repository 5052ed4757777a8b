"""`cbserve bench offline --constraint`: the engine held to a JSON schema beside the same engine free, on
a tiny model over SmolLM2's tokenizer; what the option accepts and refuses; the bundled schema."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import jsonschema
import pytest

from services.bench.constraint import DEFAULT_SCHEMA, bench_constraint
from services.bench.offline.systems import parse_systems, unconstrained
from services.bench.serve.backends import generate_request
from services.bench.serve.workloads import BenchRequest
from services.cli import main
from services.common.sampling_params import Constraint

# Complete within 26 tokens (at most 4 characters, an escaped one taking 6 tokens), so that every
# request's grammar ends before its length and every output is a whole document to validate. A random
# model held to an array or an object spends its tokens on the whitespace that JSON allows between
# items: that would not end.
SCHEMA = {"type": "string", "maxLength": 4}


def test_the_constrained_engine_beside_the_free_one_gives_valid_json_and_the_ratio(
    tiny_text_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_text_model
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    workload = tmp_path / "workload.jsonl"
    requests = [{"token_ids": [5 + i, 17, 33 + 2 * i, 90][: 2 + i % 3], "max_tokens": 48} for i in range(4)]
    workload.write_text("".join(json.dumps(r) + "\n" for r in requests))
    report_path = tmp_path / "report.json"
    code = main(
        [
            "bench",
            "offline",
            "--model",
            str(model),
            "--systems",
            "engine,engine+constrained",
            "--constraint",
            f"json-schema:{schema}",
            "--workload",
            str(workload),
            "--num-blocks",
            "64",
            "--json",
            str(report_path),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    systems = json.loads(report_path.read_text())["systems"]
    held = systems["engine:constrained"]
    assert held["ended_early"] == len(requests), printed
    for text in held["output_texts"]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert held["ratio_vs_unconstrained"] > 0
    assert systems["engine"]["output_tokens"] == sum(r["max_tokens"] for r in requests)
    assert "constrained / unconstrained output tok/s, engine:constrained over engine: " in printed
    assert "grammar compile (submit to result): first " in printed
    assert "engine:constrained grammar per step: advance " in printed
    grammar = held["grammar_s"]
    assert set(grammar) == {"grammar_advance", "grammar_fill", "grammar_apply"}
    assert all(seconds > 0 for seconds in grammar.values()), grammar


def test_the_bundled_schema_holds_an_array_of_strings_open_for_w1s_longest_output() -> None:
    held = bench_constraint("json-schema")
    schema = json.loads(DEFAULT_SCHEMA.read_text())
    assert held.constraint == Constraint("json_schema", DEFAULT_SCHEMA.read_text())
    assert schema["items"] == {"type": "string"} and schema["minItems"] >= 128
    jsonschema.validate(["x"] * schema["minItems"], schema)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("json-object", Constraint("json_object")),
        ("regex:[0-9]+", Constraint("regex", "[0-9]+")),
        ("choice:yes,no", Constraint.choice(["yes", "no"])),
    ],
)
def test_constraint_specs(spec: str, expected: Constraint) -> None:
    assert bench_constraint(spec).constraint == expected


@pytest.mark.parametrize("spec", ["yaml", "json-object:x", "regex", "choice:a,,b", "json-schema:/no.json"])
def test_bad_constraint_specs_are_refused_naming_them(spec: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(repr(spec))):
        bench_constraint(spec)


def test_only_engine_systems_take_the_constraint() -> None:
    assert parse_systems("engine:bfloat16,engine:bfloat16+constrained", None) == [
        "engine:bfloat16",
        "engine:bfloat16+constrained",
    ]
    assert parse_systems("engine,engine+constrained", None) == ["engine", "engine:constrained"]
    for name in ("vllm-cpu+constrained", "hf-cb+constrained", "stack+constrained"):
        refused = re.escape(f"{name!r}: only the engine systems take --constraint")
        with pytest.raises(SystemExit, match=refused):
            parse_systems(name, None)


@pytest.mark.parametrize(
    ("name", "twin"),
    [
        ("engine:constrained", "engine"),
        ("engine:float32+constrained", "engine"),
        ("engine:bfloat16+constrained", "engine:bfloat16"),
        ("engine:bfloat16+int8+constrained", "engine:bfloat16+int8"),
    ],
)
def test_a_constrained_systems_unconstrained_twin(name: str, twin: str) -> None:
    assert unconstrained(name, "float32") == twin


@pytest.mark.parametrize(
    ("spec", "field", "value"),
    [
        ("json-schema", "json_schema", DEFAULT_SCHEMA.read_text()),
        ("json-object", "json_object", True),
        ("regex:[a-z]+", "regex", "[a-z]+"),
        ("choice:yes,no", "choice", ["yes", "no"]),
    ],
)
def test_bench_serve_sends_the_constraint_in_cbserve_v1s_oneof(spec: str, field: str, value: object) -> None:
    args = argparse.Namespace(
        temperature=0.0, ignore_eos=True, cache_salt=None, constraint=bench_constraint(spec), n=1
    )
    sampling = generate_request(BenchRequest(0, 8, token_ids=[1, 2, 3]), args).sampling
    assert sampling.WhichOneof("constraint") == field
    sent = getattr(sampling, field)
    assert (list(sent.choices) if field == "choice" else sent) == value


def test_bench_serve_refuses_a_constraint_over_http() -> None:
    with pytest.raises(SystemExit, match="--constraint json-object: the openai backend"):
        main(
            [
                "bench",
                "serve",
                "--backend",
                "openai",
                "--target",
                "http://localhost:1",
                "--tokenizer",
                ".",
                "--constraint",
                "json-object",
            ]
        )
