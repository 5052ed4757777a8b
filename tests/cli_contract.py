"""The real `cbserve` command line, as the deployment files are checked against it.

docker-compose.yml (tests/test_compose.py) and the Kubernetes manifests (tests/test_k8s_manifests.py)
run `cbserve SUBCOMMAND --flag value ...` with CBSERVE_* variables; these helpers parse such a command
with the parser `cbserve` itself builds, the variables in place, and say which variables each
subcommand reads. `run_main` runs the command line itself in process, as a user's shell would.
"""

from __future__ import annotations

import argparse
import re
import shlex

import pytest


def subcommand_parsers() -> dict[str, argparse.ArgumentParser]:
    """`cbserve`'s subcommands and their parsers, from a fresh `build_parser()`."""
    from services.cli import build_parser

    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def variables_read(parsers: dict[str, argparse.ArgumentParser], subcommand: str) -> set[str]:
    """The CBSERVE_* variables that `cbserve SUBCOMMAND` reads as its flags' defaults."""
    return {"CBSERVE_" + a.dest.upper() for a in parsers[subcommand]._actions if a.option_strings}


def parse_cbserve(
    argv: list[str], env: dict[str, str | None], monkeypatch: pytest.MonkeyPatch
) -> argparse.Namespace:
    """Parse `cbserve ARGV` with the real parser, with `env` in place (flags read their variables,
    and refuse bad values, while the parser is built); a rejection fails the test."""
    from services.cli import build_parser

    with monkeypatch.context() as patch:
        for key, value in env.items():
            if value is not None:
                patch.setenv(key, value)
        try:
            return build_parser().parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"`cbserve {shlex.join(argv)}` is rejected by the CLI (exit {exc.code})")


def flags(command: list[str]) -> dict[str, str]:
    """`["sub", "--a", "1", "--b", "2"]` -> {"--a": "1", "--b": "2"} (every flag here takes a value)."""
    args = command[1:]
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[::2]), f"unexpected command {command}"
    return dict(zip(args[::2], args[1::2], strict=True))


def tcp(address: str) -> tuple[str, int]:
    match = re.fullmatch(r"tcp://([^:/]+):(\d+)", address)
    assert match, f"{address!r} is not a tcp://HOST:PORT address"
    return match[1], int(match[2])


def run_main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """`cbserve argv` in process: (exit status, stdout, stderr)."""
    from services.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
