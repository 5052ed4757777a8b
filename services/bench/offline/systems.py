"""Which systems a `cbserve bench offline` run compares, in running order: `--systems` read against
the built-in systems, the engine variants (`engine:DTYPE`) and every peer at each precision it offers,
plus what `--stack`, `--static-batch` and `--peer` add. Only names here: what runs each is elsewhere."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from services.bench.arguments import CONSTRAINED, PEER_NAMES, SYSTEMS, engine_variant, peer_system

if TYPE_CHECKING:
    from services.bench.peers import PeerSpec


def peer_variants(custom: Mapping[str, PeerSpec]) -> dict[str, tuple[PeerSpec, str | None]]:
    """Every peer system there can be, by name: (its peer, the `--precision` it is started with)."""
    from services.bench.peers import PEERS

    return {
        peer_system(spec.name, precision): (spec, precision)
        for spec in [*PEERS.values(), *custom.values()]
        for precision in spec.precisions or (None,)
    }


def parse_systems(
    value: str,
    static_batch: int | None,
    stack: bool = False,
    custom: Mapping[str, PeerSpec] | None = None,
    peer_precision: str = "fp32",
    dtype: str = "float32",
) -> list[str]:
    """The systems in running order; `--stack`, `--static-batch` and every `--peer` add theirs.

    A built-in peer named bare stands for its systems at `peer_precision` (both: fp32, then default;
    a peer with one precision runs once at it); `engine:DTYPE` at `dtype` is `engine` itself."""
    from services.bench.peers import PEERS

    custom = custom or {}
    wanted = ("fp32", "default") if peer_precision == "both" else (peer_precision,)
    systems: list[str] = []
    for name in (s.strip() for s in value.split(",") if s.strip()):
        if name == f"engine+{CONSTRAINED}":  # the engine at --dtype, as its variants name it
            name = f"engine:{CONSTRAINED}"
        base, plus, part = name.rpartition("+")
        if plus and part == CONSTRAINED and not is_engine(name):
            raise SystemExit(
                f"--systems: {name!r}: only the engine systems take --constraint (e.g. "
                f"engine:bfloat16+{CONSTRAINED}); {base} runs unconstrained or not at all"
            )
        if name in PEER_NAMES:
            spec = PEERS[name]
            chosen: list[str | None] = [p for p in spec.precisions if p in wanted]
            if not chosen:  # a peer without that choice runs once, at what it has
                chosen = [spec.precisions[0] if spec.precisions else None]
            systems += [peer_system(name, p) for p in chosen]
        else:
            systems.append("engine" if name == f"engine:{dtype}" else name)
            try:
                engine_variant(name, dtype)
            except ValueError as exc:
                raise SystemExit(f"--systems: {exc}") from None
    if stack:
        systems.append("stack")
    systems += list(custom)
    clash = sorted(set(custom) & set(SYSTEMS))
    if clash:
        raise SystemExit(f"--peer names {clash} are taken by built-in systems")
    known = [*SYSTEMS, "engine:PART[+PART...]", *peer_variants(custom)]
    unknown = sorted(s for s in set(systems) - set(known) if not s.startswith("engine:"))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(dict.fromkeys(known))}")
    if static_batch is not None and "hf-static" not in systems:
        systems.append("hf-static")
    return list(dict.fromkeys(systems))  # drop repeats, keep order


def is_engine(name: str) -> bool:
    """`engine` or one of its variants, `engine:DTYPE` (the systems that run cbserve's engine in-process)."""
    return name == "engine" or name.startswith("engine:")


def unconstrained(name: str, dtype: str) -> str:
    """The engine system that `name` (a `+constrained` one) is without its constraint, named as
    `parse_systems` names it: `engine:bfloat16+constrained` -> `engine:bfloat16`, and `engine` for
    the engine at `dtype`."""
    parts = [p for p in name.removeprefix("engine:").split("+") if p != CONSTRAINED]
    return "engine" if parts in ([], [dtype]) else "engine:" + "+".join(parts)
