"""docs/configuration.md against the parsers it describes: it is what the generator writes now, every
flag of every command is on it with the default its parser holds, and every variable it names is read.

The flags are walked here with argparse's own structures, not through the generator, so that a command
or flag the generator skipped is missed by the page and found by this test."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services import config_reference
from services.cli import build_parser
from services.common.cli_args import CB_SETTING_NAMES, env_name
from services.common.config import CBConfig

SERVICES = Path(config_reference.__file__).resolve().parent
DOC = config_reference.DOC
_CELL = re.compile(r"(?<!\\)\|")


@pytest.fixture(autouse=True)
def no_cbserve_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parsers take a set `CBSERVE_*` variable as a flag's default; the page holds the unset ones."""
    for name in [k for k in os.environ if k.startswith(config_reference.ENV_PREFIX)]:
        monkeypatch.delenv(name)


def parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("cbserve",)
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(command, parser) of every command that takes flags or runs something."""
    subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subcommands or flags(parser):
        yield " ".join(path), parser
    for action in subcommands:
        for name, child in action.choices.items():
            yield from parsers(child, (*path, name))


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every argument a user can give, less --help and the hidden ones (help=SUPPRESS: old names)."""
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS]
    return [a for a in shown if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]


def sections(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """The page's `## ` sections by heading, and which heading each `<a id>` anchor opens."""
    by_heading: dict[str, str] = {}
    anchors: dict[str, str] = {}
    pending: str | None = None
    heading = ""
    for line in text.splitlines():
        anchor = re.fullmatch(r'<a id="([^"]+)"></a>', line)
        if anchor:
            pending = anchor.group(1)
        elif line.startswith("## "):
            heading = line[3:]
            by_heading[heading] = ""
            if pending:
                anchors[pending], pending = heading, None
        elif heading:
            by_heading[heading] += line + "\n"
    return by_heading, anchors


def command_text(command: str, page: str) -> str:
    """A command's section with the shared sections it links to (the continuous-batching flags, ...)."""
    by_heading, anchors = sections(page)
    own = by_heading.get(f"`{command}`")
    assert own is not None, f"docs/configuration.md has no section for `{command}`"
    linked = [by_heading[anchors[a]] for a in re.findall(r"\]\(#([^)]+)\)", own) if a in anchors]
    return "\n".join([own, *linked])


def row(command: str, action: argparse.Action, text: str) -> list[str]:
    """The table row of `action`, as its cells (Flag, Type, Default, Environment, Meaning)."""
    first = action.option_strings[0] if action.option_strings else (action.metavar or action.dest)
    lines = [line for line in text.splitlines() if line.startswith(f"| `{first}`")]
    assert len(lines) == 1, (
        f"{command} {first}: {len(lines)} rows on docs/configuration.md, not 1 (regenerate: make docs)"
    )
    return [cell.strip() for cell in _CELL.split(lines[0])[1:-1]]


def shown(value: Any) -> str:
    """A default as a user types it (switches on/off, lists comma-separated)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, list | tuple):
        return ",".join(shown(v) for v in value)
    return '""' if value == "" else str(value)


def test_the_page_is_what_the_parsers_write_now() -> None:
    fresh = config_reference.render()
    committed = DOC.read_text() if DOC.exists() else ""
    if committed != fresh:
        lines = difflib.unified_diff(committed.splitlines(True), fresh.splitlines(True), "committed", "fresh")
        diff = "".join(list(lines)[:60])
        pytest.fail(
            "docs/configuration.md is out of date with the parsers: regenerate it with `make docs` "
            f"(or `python -m services.config_reference`) and commit it.\n{diff}"
        )


def test_every_flag_of_every_command_is_on_the_page_with_its_default() -> None:
    page = DOC.read_text()
    engine = {f.name: f.default for f in dataclasses.fields(CBConfig)}
    checked = 0
    for command, parser in parsers(build_parser()):
        text = command_text(command, page)
        for action in flags(parser):
            default = row(command, action, text)[2]
            name = (action.option_strings or [action.dest])[0]
            assert default, f"{command} {name}: no default shown"
            if action.default is not None and action.default != []:
                assert f"`{shown(action.default)}`" in default, f"{command} {name}: shows {default!r}"
            elif action.dest in CB_SETTING_NAMES and engine[action.dest] is not None:
                # unset: CBConfig's own default applies, and the page must show that one
                expected = shown(engine[action.dest])
                assert f"`{expected}`" in default, f"{command} {name}: shows {default!r}, CBConfig {expected}"
            checked += 1
    assert checked > 100  # the walk reached the subcommands


def test_a_default_the_help_states_is_the_parsers() -> None:
    """The page shows the parser's default and drops the help's `(default X)`: the two must agree,
    or the page would hide a help text that tells users a default the flag does not have."""
    for command, parser in parsers(build_parser()):
        for action in flags(parser):
            stated = re.search(r"\(default:? ([^()]*)\)\s*(\[[^]]*\])?$", action.help or "")
            if stated is None or action.default is None or action.default == []:
                continue
            assert stated.group(1) == shown(action.default), (
                f"{command} {action.option_strings[0]}: the help says (default {stated.group(1)}), "
                f"the parser holds {shown(action.default)}"
            )


def probe(action: argparse.Action) -> tuple[str, Any] | None:
    """A variable's text that its flag accepts and that differs from the default, with its value."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return ("0", False) if action.default else ("1", True)
    if action.choices is not None:
        other = next(c for c in action.choices if c != action.default)
        return other, other
    for text in ("7", "3"):
        try:
            value = action.type(text) if callable(action.type) else text
        except (ValueError, argparse.ArgumentTypeError):
            continue
        if value != action.default:
            return text, value
    return None


def source_text() -> str:
    own = Path(config_reference.__file__).resolve()
    return "\n".join(p.read_text() for p in sorted(SERVICES.rglob("*.py")) if p.resolve() != own)


def test_every_variable_on_the_page_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    page = DOC.read_text()
    source = source_text()
    # A flag's variable: setting it must become the flag's default (add_env_argument), or else the
    # variable must be read by name in services/ (`--api-key`'s CBSERVE_API_KEYS, which the command
    # reads itself, as `env_name("api_keys")`).
    for command, parser in parsers(build_parser()):
        for action in flags(parser):
            env_cell = row(command, action, command_text(command, page))[3]
            for variable in re.findall(r"`([A-Z][A-Z0-9_]+)`", env_cell):
                given = probe(action) if variable == env_name(action.dest) else None
                if given is not None:
                    with monkeypatch.context() as env:
                        env.setenv(variable, given[0])
                        again = dict(parsers(build_parser()))[command]
                        read = next(a.default for a in flags(again) if a.dest == action.dest)
                    if read == given[1]:
                        continue
                by_name = f'"{variable}"' in source or f'env_name("{action.dest}")' in source
                assert by_name, f"{command}: {variable} on the page, read by neither its flag nor services/"
    # The variables that are not flags: each is still read, as a name in quotes, outside the page's source.
    table = page.split("## Environment variables that are not flags", 1)[1]
    names = re.findall(r"^\| `([A-Z][A-Z0-9_]*)` \|", table, re.MULTILINE)
    assert names == [v.name for v in config_reference.OTHER_VARIABLES]
    for name in names:
        assert f'"{name}"' in source, f"{name} is on the page but no longer read in services/"


def test_every_cbserve_variable_the_services_name_is_on_the_page() -> None:
    """A new `os.environ.get("CBSERVE_X")` in services/ that nobody documented fails here."""
    page = DOC.read_text()
    own = Path(config_reference.__file__).resolve()
    named = set()
    for path in SERVICES.rglob("*.py"):
        if path.resolve() == own:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"CBSERVE_[A-Z0-9_]+", node.value):
                    named.add(node.value)
    assert named, "no CBSERVE_ variable found in services/"
    missing = sorted(name for name in named if f"`{name}`" not in page)
    assert not missing, (
        f"read in services/ but not on docs/configuration.md: {missing}; a flag's variable comes with "
        "the flag, any other goes into OTHER_VARIABLES in services/config_reference.py (then make docs)"
    )
