"""`cbserve bench offline`'s stack systems: a real `cbserve up` (tiny model) driven over gRPC, its
outputs held to the end (`stack`) and streamed (`stack-streamed`), beside the in-process engine."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from services.cli import main


def test_the_stack_held_and_streamed_gives_the_engines_tokens(
    tiny_models: Callable[[str], Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = tmp_path / "workload.jsonl"
    requests = [
        {"token_ids": [5 + i, 17, 33 + 2 * i, 90][: 2 + i % 3], "max_tokens": 3 + 4 * i} for i in range(4)
    ]
    workload.write_text("".join(json.dumps(r) + "\n" for r in requests))
    report_path = tmp_path / "report.json"
    code = main(
        [
            "bench",
            "offline",
            "--model",
            str(tiny_models("llama")),
            "--systems",
            "engine,stack,stack-streamed",
            "--workload",
            str(workload),
            "--num-blocks",
            "64",
            "--repeat",
            "2",
            "--json",
            str(report_path),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0, printed
    systems = json.loads(report_path.read_text())["systems"]
    expected = sum(r["max_tokens"] for r in requests)
    for name in ("stack", "stack-streamed"):
        assert systems[name]["requests_equal_to_engine"] == len(requests), printed
        assert systems[name]["output_tokens"] == systems["engine"]["output_tokens"] == expected
        assert f"{name} step profile over" in printed
