"""docs/configuration.md, written from the `cbserve` argument parsers themselves.

Every command's flags, their types, defaults and environment variables are read from the parsers that
`services.cli.build_parser` builds, so that a flag added, renamed or given another default shows up
here on the next run, with no list to keep in step. Only the variables that are not flags (read with
`os.environ` deep inside a service) are listed by hand, in `OTHER_VARIABLES`; tests/
test_configuration_doc.py checks that each is still read somewhere in services/ and that the committed
page equals a fresh one.

    python -m services.config_reference            # rewrite docs/configuration.md
    python -m services.config_reference --check    # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
REGENERATE = "make docs"  # which runs `python -m services.config_reference`
ENV_PREFIX = "CBSERVE_"

# add_env_argument (services/common/cli_args.py) ends a flag's help with the variable it reads,
# `[CBSERVE_X]`; a flag that reads its variable itself writes the same mark, with a note after a comma.
_ENV_MARK = re.compile(r"\s*\[(" + ENV_PREFIX + r"[A-Z0-9_]+)(?:, ([^\]]+))?\]\s*$")
# What a help text says an unset flag means, `(default: X)` or `(default X)`, when the parser's own
# default is None: the value the command then chooses (CBConfig's, usable cores, ...).
_HELP_DEFAULT = re.compile(r"\s*\(default:? ([^()]*(?:\([^()]*\)[^()]*)*)\)\s*$")
# A help text that opens by saying what the number counts ("tokens per KV page", "long-prompt: its
# prompt tokens"); a later "tokens" ("drop tokens below min_p") says nothing of the flag's unit.
_COUNTS_TOKENS = re.compile(r"^(?:[\w-]+: )?(?:(?:its|most|shared) )?(?:prompt )?tokens\b")


@dataclass(frozen=True)
class OtherVariable:
    name: str
    default: str
    meaning: str


# Variables read by the services that no flag sets. Hand-kept: each is read by a plain
# `os.environ.get` somewhere, which no parser can show; the test checks every name still occurs in
# services/, so one that is dropped there fails here.
OTHER_VARIABLES: tuple[OtherVariable, ...] = (
    OtherVariable(
        "CBSERVE_HOME",
        "`~/.cache/cbserve`",
        "The cache root: converted models under `models/`, compiled kernels and the measured GEMM "
        "crossover under `kernels/`, the benchmark peers' virtual environments under `peers/`.",
    ),
    OtherVariable(
        "CBSERVE_NATIVE_KERNELS",
        "`1` (on)",
        "`0` turns the native CPU kernels off: attention falls back to gather + SDPA and the linears "
        "to torch's GEMM (the same results up to float32 rounding).",
    ),
    OtherVariable(
        "CBSERVE_CPU_ISA",
        "`native`",
        "The vector path the native kernels are compiled for: `native` (the CPU's best), `avx512`, "
        "`avx2` or `portable`, to run a lower path on a CPU that has a higher one. Any value but "
        "`native` also means no native bfloat16, so `--dtype auto` picks float32 on a CPU.",
    ),
    OtherVariable(
        "CBSERVE_PAGED_ATTENTION",
        "`auto`",
        "Which kernels read the KV pages in place: `auto` (the native ones on the CPU, Triton's on a "
        "GPU), `triton` (Triton's anywhere; on a CPU only under `TRITON_INTERPRET=1`, for tests) or "
        "`gather` (none: each context is gathered for SDPA, the GPU check's baseline).",
    ),
    OtherVariable(
        "CBSERVE_FORWARD",
        "`auto`",
        "Whose forward runs the model's layers: `auto` (ours for a Llama, Mistral or Qwen2 model: the "
        "native one on the CPU, the Triton one on a GPU over a float pool; transformers' elsewhere), "
        "`triton` (the Triton forward anywhere, an error where it cannot run; on a CPU only under "
        "`TRITON_INTERPRET=1`, for tests) or `transformers` (transformers' layers everywhere: the "
        "fallback, and the GPU check's baseline; `--quantization` then refuses to start).",
    ),
    OtherVariable(
        "CBSERVE_GEMM_CROSSOVER",
        "unset (measured once per machine and kept under `$CBSERVE_HOME/kernels`)",
        "Pins the number of rows from which the linears use torch's GEMM instead of the panel "
        "kernel: a number of at least 1, or `never` (the panel kernel at every size). A bad value "
        "is a usage error at start.",
    ),
    OtherVariable(
        "CBSERVE_INTERNAL_KEY",
        "unset (`cbserve up` makes a fresh one for each stack)",
        "The shared secret every process presents on the internal cachemgr and worker sockets, so "
        "that nothing else that reaches them can attach or submit. Empty: no check (logged as a "
        "warning). Set it to the same value for processes started one by one.",
    ),
    OtherVariable(
        "THP_MEM_ALLOC_ENABLE",
        "set to `1` by cbserve unless already set",
        "torch's large CPU tensors (the weights) on transparent huge pages; a value the user set "
        "is left as it is.",
    ),
    OtherVariable(
        "MALLOC_MMAP_THRESHOLD_",
        "unset",
        "When this, `MALLOC_TRIM_THRESHOLD_`, `GLIBC_TUNABLES` or `LD_PRELOAD` is set, cbserve leaves "
        "the C library's heap thresholds as the user chose instead of keeping freed memory.",
    ),
    OtherVariable("MALLOC_TRIM_THRESHOLD_", "unset", "As `MALLOC_MMAP_THRESHOLD_`."),
    OtherVariable("GLIBC_TUNABLES", "unset", "As `MALLOC_MMAP_THRESHOLD_`."),
    OtherVariable("LD_PRELOAD", "unset", "As `MALLOC_MMAP_THRESHOLD_` (another allocator preloaded)."),
    OtherVariable("CXX", "`c++`", "The C++ compiler of the native kernels; without one the fallbacks serve."),
    OtherVariable(
        "TMPDIR",
        "`/tmp`",
        "Where tensors shared between processes are placed when `/dev/shm` does not exist.",
    ),
    OtherVariable(
        "TORCH_PIN",
        "the torch the project pins",
        "`cbserve bench setup-peers`: the torch requirement installed into the peers' environments "
        "(point it at a CPU wheel where the package index serves the CUDA build).",
    ),
)


@dataclass(frozen=True)
class Flag:
    """One argument of one parser, as the page shows it."""

    names: str  # `--port`, `--x` / `--no-x`, or a positional's name
    kind: str
    default: str
    env: str  # the variable it reads, "" for none
    help: str


@dataclass(frozen=True)
class Group:
    title: str  # "" for the command's own flags
    flags: tuple[Flag, ...]


@dataclass(frozen=True)
class Command:
    path: tuple[str, ...]  # ("cbserve", "bench", "serve")
    summary: str
    groups: tuple[Group, ...]

    @property
    def name(self) -> str:
        return " ".join(self.path)


@contextlib.contextmanager
def clean_environment() -> Iterator[None]:
    """The parsers read `CBSERVE_*` when they are built (a variable replaces a flag's default): the page
    must show the defaults of an empty environment, whatever the shell that regenerates it holds."""
    held = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}
    for name in held:
        del os.environ[name]
    try:
        yield
    finally:
        os.environ.update(held)


def build_parser() -> argparse.ArgumentParser:
    from services.cli import build_parser as cli_parser

    with clean_environment():
        return cli_parser()


def subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand of `parser`, in the order they were added."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            found += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return found


def documented(action: argparse.Action) -> bool:
    """Hidden flags (help=SUPPRESS: an old name still read) and --help stay off the page."""
    hidden = action.help == argparse.SUPPRESS
    return not (hidden or isinstance(action, argparse._HelpAction | argparse._SubParsersAction))


def walk(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("cbserve",), summary: str = ""
) -> Iterator[tuple[tuple[str, ...], str, argparse.ArgumentParser]]:
    """Every command that takes flags or runs something, depth first: a parser without subcommands,
    and one with subcommands that has flags of its own (none has yet; one that did would be missed)."""
    children = subparsers(parser)
    if not children or any(documented(a) for a in parser._actions):
        yield path, summary, parser
    for name, help_text, child in children:
        yield from walk(child, (*path, name), help_text)


def env_mark(action: argparse.Action) -> tuple[str, str, str]:
    """(help without the mark, variable, note) of an action's help."""
    text = action.help or ""
    found = _ENV_MARK.search(text)
    if found is None:
        return text, "", ""
    return text[: found.start()], found.group(1), found.group(2) or ""


def type_name(action: argparse.Action) -> str:
    if isinstance(
        action, argparse.BooleanOptionalAction | argparse._StoreTrueAction | argparse._StoreFalseAction
    ):
        return "switch"
    if action.choices is not None:
        return "one of " + ", ".join(f"`{c}`" for c in action.choices)
    kind = action.type
    # argparse allows a tuple metavar (a name for each of nargs' values) and shows it space-separated.
    metavar = " ".join(action.metavar) if isinstance(action.metavar, tuple) else action.metavar
    if kind is None or kind is str:
        name = metavar or "text"
    elif kind is int:
        name = "int"
    elif kind is float:
        name = "float"
    elif kind is Path:
        name = "path"
    else:
        # A type may also be a registry name (str) or an argparse.FileType, neither with a __name__.
        fallback = getattr(kind, "__name__", "value").strip("_")
        name = _bounds(kind) or (f"`{metavar}`" if metavar else fallback)
    if isinstance(action, argparse._AppendAction):
        return f"{name}, repeatable"
    if action.nargs in ("*", "+"):
        return f"{name} ..."
    return name


def _bounds(kind: object) -> str:
    """`bounded(int, 1)` (cli_args.py) as `int >= 1`: the limits live in the closure it returns."""
    if not callable(kind):
        return ""
    try:
        seen = inspect.getclosurevars(kind).nonlocals
    except TypeError:
        return ""
    if not {"kind", "low", "high", "strict"} <= seen.keys():
        return ""
    base = getattr(seen["kind"], "__name__", "value")
    if seen["high"] is not None:
        return f"{base} in [{seen['low']}, {seen['high']}]"
    return f"{base} {'>' if seen['strict'] else '>='} {seen['low']}"


def unit(action: argparse.Action, help_text: str) -> str:
    """The unit a number is in, where the flag's name or help states one; "" where neither does."""
    dest = action.dest
    if dest.endswith("_ms") or re.search(r"\bms\b", help_text):
        return "ms"
    if dest.endswith("_s") or re.search(r"\bseconds\b|\(s\)", help_text):
        return "s"
    if re.search(r"\bGiB\b", help_text):
        return "GiB"
    if dest.endswith("_bytes"):
        return "bytes"
    if _COUNTS_TOKENS.match(help_text):
        return "tokens"
    return ""


def show_value(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, list | tuple):
        return ",".join(show_value(v) for v in value)
    return str(value)


def with_unit(text: str, unit_name: str) -> str:
    """`30.0` -> `30.0 s`; a byte count that is whole MiB says so too."""
    if not unit_name or not re.fullmatch(r"-?\d+(\.\d+)?", text):
        return f"`{text}`"
    shown = f"`{text}` {unit_name}"
    if unit_name == "bytes" and int(float(text)) % (1 << 20) == 0 and float(text) > 0:
        shown += f" ({int(float(text)) >> 20} MiB)"
    return shown


def describe(action: argparse.Action) -> Flag:
    help_text, env, note = env_mark(action)
    default = action.default
    stated = _HELP_DEFAULT.search(help_text)
    if stated is not None:  # shown in the default column, not twice
        help_text = help_text[: stated.start()]
    if default is None or default == []:
        if stated is not None:  # what the help says unset means is the default the command applies
            shown = stated.group(1).strip()
            if re.fullmatch(r"[\w.-]+", shown):  # one value, not a phrase
                shown = with_unit(shown, unit(action, help_text))
        elif action.required:
            shown = "required"
        else:
            shown = "unset" if default is None else "none"
    elif default == "":
        shown = '`""`'
    else:
        shown = with_unit(show_value(default), unit(action, help_text))
    if action.option_strings:
        names = " / ".join(f"`{name}`" for name in action.option_strings)
    else:
        names = f"`{action.metavar or action.dest}` (positional)"
    if env:
        env = f"`{env}`" + (f" ({note})" if note else "")
    return Flag(names, type_name(action), shown, env, help_text.strip() or "—")


def command(path: tuple[str, ...], summary: str, parser: argparse.ArgumentParser) -> Command:
    groups = []
    for group in parser._action_groups:
        flags = tuple(describe(a) for a in group._group_actions if documented(a))
        if not flags:
            continue
        own = group.title in ("positional arguments", "options", "optional arguments")
        groups.append(Group("" if own else group.title or "", flags))
    # argparse's own two groups first (positionals, then options), as one table
    own_flags = tuple(f for g in groups if not g.title for f in g.flags)
    rest = tuple(g for g in groups if g.title)
    return Command(path, summary, ((Group("", own_flags),) if own_flags else ()) + rest)


def commands(parser: argparse.ArgumentParser | None = None) -> list[Command]:
    parser = parser or build_parser()
    return [command(path, summary, sub) for path, summary, sub in walk(parser)]


def anchor(title: str) -> str:
    return "group-" + re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(flags: tuple[Flag, ...]) -> list[str]:
    lines = ["| Flag | Type | Default | Environment | Meaning |", "|---|---|---|---|---|"]
    for f in flags:
        cells = (f.names, f.kind, f.default, f.env or "—", f.help)
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def shared_groups(cmds: list[Command]) -> dict[str, Group]:
    """Groups that several commands carry unchanged (the continuous-batching settings, the public
    port's security, ...), shown once and linked, so that four copies cannot be read as four sets."""
    seen: dict[str, list[Group]] = {}
    for cmd in cmds:
        for group in cmd.groups:
            if group.title:
                seen.setdefault(group.title, []).append(group)
    return {t: gs[0] for t, gs in seen.items() if len(gs) > 1 and all(g == gs[0] for g in gs)}


def _service_settings() -> tuple[str, ...]:
    from services.cli import SERVICE_SETTINGS
    from services.common.cli_args import CB_SETTING_NAMES

    return (*SERVICE_SETTINGS, *CB_SETTING_NAMES)


def preamble() -> list[str]:
    from services.common.cli_args import env_name

    passed = ", ".join(f"`--{name.replace('_', '-')}`" for name in _service_settings())
    return [
        "# Configuration",
        "",
        f"<!-- Generated by services/config_reference.py from the command-line parsers: do not edit. "
        f"Regenerate with `{REGENERATE}` (python -m services.config_reference). -->",
        "",
        "Every `cbserve` command is configured by its flags; most flags also read an environment "
        "variable, named in the tables below (`CBSERVE_` and the flag's name in capitals, dashes as "
        "underscores). A flag given on the command line wins over its variable, and the variable over "
        "the default. The variables are read when the parsers are built, before the command line is "
        "parsed: `--help` shows a variable's value as the default, and a value its flag would refuse "
        "is a usage error (exit status 2) for every `cbserve` command, even one without that flag. "
        "Switches (`--x` / `--no-x`) read "
        "`1`, `true`, `yes` or `on` and `0`, `false`, `no` or `off` from their variables.",
        "",
        "The continuous-batching settings left unset are not passed on: the engine's own defaults "
        "(`CBConfig`, services/common/config.py) apply, and the tables show those.",
        "",
        "`cbserve up` runs `cbserve cachemgr`, `cbserve worker` and `cbserve gateway` (and the smg "
        "router with `--http-port`) as child processes, each with `up`'s own environment and, on top "
        "of it, `up`'s settings as variables: each of "
        f"{passed} that has a value, as its `CBSERVE_*` variable (switches as `true` or `false`); "
        f"`--device` and `--dtype` as `{env_name('device')}` and `{env_name('dtype')}`, `--model` as "
        f"`{env_name('model')}` when given; the `--api-key` keys as `{env_name('api_keys')}`, "
        "comma-separated, so that they do not show on a command line; and a fresh "
        "`CBSERVE_INTERNAL_KEY` unless one is set. The children's addresses (sockets in a private "
        "folder), `--host`, `--port` and `--metrics-port` go on their command lines instead. A "
        "variable set for `cbserve up` that `up` itself does not read (`CBSERVE_READY_FILE`, say) "
        "still reaches the child that does.",
        "",
    ]


def render(cmds: list[Command] | None = None) -> str:
    cmds = commands() if cmds is None else cmds
    shared = shared_groups(cmds)
    lines = preamble()
    lines += ["## Contents", ""]
    lines += [f"- [`{c.name}`](#{c.name.replace(' ', '-')})" for c in cmds]
    lines += [f"- [{title}](#{anchor(title)})" for title in shared]
    lines += ["- [Environment variables that are not flags](#environment-variables-that-are-not-flags)", ""]
    for cmd in cmds:
        lines += [f'<a id="{cmd.name.replace(" ", "-")}"></a>', "", f"## `{cmd.name}`", ""]
        if cmd.summary:
            lines += [cmd.summary[0].upper() + cmd.summary[1:] + ".", ""]
        if not cmd.groups:
            lines += ["No flags.", ""]
        for group in cmd.groups:
            if group.title in shared:
                lines += [f"With the flags of [{group.title}](#{anchor(group.title)}).", ""]
                continue
            if group.title:
                lines += [f"### {group.title[0].upper()}{group.title[1:]}", ""]
            lines += [*table(group.flags), ""]
    for title, group in shared.items():
        users = [f"`{c.name}`" for c in cmds if any(g.title == title for g in c.groups)]
        lines += [f'<a id="{anchor(title)}"></a>', "", f"## {title[0].upper()}{title[1:]}", ""]
        lines += [f"Flags of {', '.join(users)}.", "", *table(group.flags), ""]
    lines += [
        "## Environment variables that are not flags",
        "",
        "Read by the services directly; no flag sets them.",
        "",
        "| Variable | Default | Meaning |",
        "|---|---|---|",
    ]
    lines += [f"| `{v.name}` | {_cell(v.default)} | {_cell(v.meaning)} |" for v in OTHER_VARIABLES]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/configuration.md from the cbserve parsers.")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = DOC.read_text() if DOC.exists() else ""
        if current != text:
            print(f"{DOC} is out of date: regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
