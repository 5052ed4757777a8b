"""The structured-output constraint of a bench run (`--constraint`): what it names, the bundled default
schema, and how long the engine's grammar compiler takes over it, first and cached.

The constraint applies to every request of the engine systems named `engine:...+constrained`; an
unconstrained system of the same name without `+constrained` beside it gives the ratio that tells
what the grammar costs (services/bench/offline/report.py prints it)."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.sampling_params import Constraint

if TYPE_CHECKING:
    from services.worker.engine import Engine

# An array of strings held open for 128 items: every W1 request runs to its full length under it
# (the file's description says why an array, and why 128).
DEFAULT_SCHEMA = Path(__file__).parent / "data" / "strings_array.schema.json"
SPEC_FORMS = "json-schema[:PATH], json-object, regex:PATTERN, choice:A,B,..."


@dataclass(frozen=True)
class BenchConstraint:
    """A `--constraint` as given (`spec`, what the report prints) and the engine's `Constraint`."""

    spec: str
    constraint: Constraint


def bench_constraint(value: str) -> BenchConstraint:
    """Parse `--constraint` (an argparse `type`): json-schema (the bundled schema), json-schema:PATH,
    json-object, regex:PATTERN or choice:A,B,... (comma-separated strings)."""
    kind, sep, rest = value.partition(":")
    if kind == "json-schema":
        path = Path(rest) if sep else DEFAULT_SCHEMA
        try:
            text = path.read_text()
            json.loads(text)
        except (OSError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"{value!r}: {path} is no JSON schema: {exc}") from None
        made = Constraint("json_schema", text)
        spec = value if sep else f"json-schema:{DEFAULT_SCHEMA.name} (bundled)"
    elif kind == "json-object" and not sep:
        made, spec = Constraint("json_object"), value
    elif kind == "regex" and sep:
        made, spec = Constraint("regex", rest), value
    elif kind == "choice" and sep:
        made, spec = Constraint.choice(rest.split(",")), value
    else:
        raise argparse.ArgumentTypeError(f"unknown constraint {value!r}; one of {SPEC_FORMS}")
    try:
        made.validate("--constraint")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{value!r}: {exc}") from None
    return BenchConstraint(spec, made)


@dataclass(frozen=True)
class CompileTimes:
    """Seconds from the engine's `GrammarCompiler.submit` to its result: the first time (compiled)
    and again (from its cache); `compiler_s` is making the compiler (the tokenizer's vocabulary read
    once per engine, at its first constraint)."""

    compiler_s: float
    first_s: float
    cached_s: float


def compile_times(engine: Engine, constraint: Constraint, model_path: Path) -> CompileTimes:
    """Compile `constraint` in `engine` (of the model at `model_path`) twice, before any timed round
    (so that no round compiles it); SystemExit with the compiler's error when it does not compile."""
    from services.worker.grammar import GrammarError

    if engine.tokenizer is None:
        raise SystemExit(f"--constraint: grammars compile against a tokenizer, and {model_path} has none")
    t0 = time.perf_counter()
    compiler = engine.grammars()
    t1 = time.perf_counter()
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        pending = compiler.submit(constraint)
        pending.future.exception()  # waits for the compile; its error, if any, is raised below
        seconds.append(time.perf_counter() - start)
        try:
            pending.result(time.monotonic())
        except GrammarError as exc:
            raise SystemExit(f"--constraint: {exc}") from None
    return CompileTimes(t1 - t0, seconds[0], seconds[1])
