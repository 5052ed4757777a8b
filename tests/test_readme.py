"""The README and docs/ say only what is true of this repository: every `cbserve` command line in their
code blocks parses with the real CLI parser, every `make` target they name exists, every relative link
(and its #anchor) points at something that exists, and the README stays a front door (at most 220
lines). Commands are parsed, never run: a doc's example may need a running stack or a GPU."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from services.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 220

# Code blocks in these languages hold no shell commands (a Python or Node snippet, a log line).
NOT_SHELL = {"python", "py", "js", "javascript", "json", "text", "yaml", "proto", "protobuf"}
_FENCE = re.compile(r"^```(\S*)\s*$")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_MAKE = re.compile(r"(?:^|[\s;(&|])make\s+((?:[A-Z_]+=\S*\s+)*)([a-z][a-z0-9-]*)")


def _rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def code_blocks(text: str) -> list[tuple[str, list[str]]]:
    """Each fenced block's language ("" when none) and lines."""
    blocks: list[tuple[str, list[str]]] = []
    lang: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        fence = _FENCE.match(line.strip())
        if fence and lang is None:
            lang, lines = fence.group(1).lower(), []
        elif line.strip() == "```" and lang is not None:
            blocks.append((lang, lines))
            lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def shell_lines(lines: list[str]) -> list[str]:
    """The block's logical lines: backslash continuations joined."""
    out: list[str] = []
    pending = ""
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(pending + line)
        pending = ""
    if pending:
        out.append(pending)
    return out


SHELL = {"sh", "bash", "shell", "console", "zsh"}
# Commands that run the command after them (and their own options first): `chrt -r 10 cbserve ...`.
WRAPPERS = {"chrt", "nice", "time", "timeout", "exec", "sudo", "env", "nohup"}
_VAR = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?")


def cbserve_argv(words: list[str]) -> list[str] | None:
    """The arguments of a shell line whose command is `cbserve` (or `.venv/bin/cbserve`, after any
    VAR=value assignments and wrappers such as `chrt -r 10`), up to the end of that command; None when
    the line's command is something else."""
    i = 0
    while i < len(words) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[i]):
        i += 1
    while i < len(words) and words[i] in WRAPPERS:
        i += 1
        while i < len(words) and (words[i].startswith("-") or words[i].isdigit()):
            i += 1
    if i == len(words) or Path(words[i]).name != "cbserve":
        return None
    argv = []
    for arg in words[i + 1 :]:
        if arg in {"&&", "||", "|", ";", "&"}:
            break
        argv.append(arg)
    return argv


def block_commands(lines: list[str]) -> list[tuple[str, list[str]]]:
    """(line, argv) for each cbserve command of a shell block. Shell variables the block sets (`X=...`,
    `for X in a b`) are replaced by their value (a loop's first); arithmetic, by 1."""
    variables: dict[str, str] = {}
    found = []
    for line in shell_lines(lines):
        loop = re.match(r"^\s*for\s+([A-Za-z_]\w*)\s+in\s+(\S+)", line)
        if loop:
            variables[loop.group(1)] = loop.group(2).rstrip(";")
        expanded = _VAR.sub(lambda m: variables.get(m.group(1), m.group(0)), line)
        try:
            words = shlex.split(expanded, comments=True)
        except ValueError:  # an unbalanced quote: no command we can read
            continue
        for word in words:
            name, eq, value = word.partition("=")
            if eq and re.match(r"^[A-Za-z_]\w*$", name):
                variables[name] = "1" if value.startswith("$((") else value
        argv = cbserve_argv(words)
        if argv is not None:
            found.append((line.strip(), argv))
    return found


SUBCOMMANDS = {
    name
    for action in build_parser()._actions
    if isinstance(action, argparse._SubParsersAction)
    for name in action.choices
}


def doc_commands() -> list[tuple[str, list[str]]]:
    """Every cbserve command in a shell block (`sh`, `bash`, ...); in an unlabelled block, the lines
    whose next word is a cbserve command's name (such a block may be a diagram: `cbserve up: ...`)."""
    found = []
    for page in PAGES:
        for lang, lines in code_blocks(page.read_text()):
            if lang not in SHELL and lang != "":
                continue
            for line, argv in block_commands(lines):
                if lang in SHELL or (argv and argv[0] in SUBCOMMANDS):
                    found.append((f"{_rel(page)}: {line}", argv))
    return found


COMMANDS = doc_commands()


def test_the_docs_have_commands_to_check() -> None:
    assert len(COMMANDS) >= 20, COMMANDS
    assert any(where.startswith("README.md") for where, _ in COMMANDS)


@pytest.mark.parametrize(("where", "argv"), COMMANDS, ids=[where[:90] for where, _ in COMMANDS])
def test_every_cbserve_command_parses(
    where: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        pytest.fail(f"{where}\n  does not parse (exit {exc.code}): {capsys.readouterr().err.strip()}")
    assert getattr(args, "handler", None) is not None, f"{where}\n  names no command that runs"


def make_targets() -> set[str]:
    targets = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        rule = re.match(r"^([A-Za-z0-9_.-]+(?:\s+[A-Za-z0-9_.-]+)*)\s*:(?!=)", line)
        if rule:
            targets.update(rule.group(1).split())
    return targets


def named_make_targets() -> list[tuple[str, str]]:
    """(page, target) for every `make X` in a code block or an inline code span."""
    named = []
    for page in PAGES:
        text = page.read_text()
        spans = [line for lang, lines in code_blocks(text) if lang not in NOT_SHELL for line in lines]
        spans += _INLINE_CODE.findall(text)
        for span in spans:
            named += [(_rel(page), m.group(2)) for m in _MAKE.finditer(span.split("#", 1)[0])]
    return named


def test_every_make_target_named_exists() -> None:
    targets = make_targets()
    named = named_make_targets()
    assert {"serve", "test"} <= {target for _, target in named}
    missing = sorted({f"{page}: make {target}" for page, target in named if target not in targets})
    assert not missing, f"make targets the Makefile does not have: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(page: Path) -> set[str]:
    text = page.read_text()
    found = set(re.findall(r'<a id="([^"]+)"', text))
    counts: dict[str, int] = {}
    in_code = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        heading = re.match(r"^#{1,6}\s+(.*)$", line)
        if heading and not in_code:
            slug = _slug(heading.group(1))
            n = counts.get(slug, 0)
            counts[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def relative_links() -> list[tuple[Path, str]]:
    links = []
    for page in PAGES:
        text = "\n".join(_outside_code(page.read_text()))  # a link in code is code, not a link
        for target in _LINK.findall(text):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                links.append((page, target))
    return links


def _outside_code(text: str) -> list[str]:
    lines, in_code = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code:
            lines.append(_INLINE_CODE.sub("", line))
    return lines


def test_every_relative_link_points_at_something_that_exists() -> None:
    links = relative_links()
    assert any(page == README for page, _ in links)
    broken = []
    for page, target in links:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{_rel(page)}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{_rel(page)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; the reference goes in docs/"
