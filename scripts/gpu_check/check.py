"""What every section shares: the budget and the engines it builds (`Check`), one failure kept per
entry, the facts of a run."""

from __future__ import annotations

import copy
import dataclasses
import gc
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.common.config import CBConfig
from services.worker.cuda_graphs import eager_capture
from services.worker.engine import Engine

REPO = Path(__file__).resolve().parents[2]
SEED = 1234
Entry = dict[str, Any]


def attempt(entry: Entry, key: str, fn: Callable[..., Any], *args: Any) -> None:
    """`entry[key] = fn(*args)`, or the error it raised: one failure loses no other figure."""
    try:
        entry[key] = fn(*args)
    except Exception as exc:
        entry[key] = failure(exc)


def failure(exc: BaseException) -> Entry:
    return {
        "error": f"{type(exc).__name__}: {exc}"[:600],
        "traceback": traceback.format_exc().splitlines()[-6:],
    }


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclasses.dataclass
class Check:
    device: str
    quick: bool
    deadline: float
    workdir: Path
    roofline_scale: float = 1.0
    # Saves a section's entry before it ends (`main` sets it): what a long one measured survives a stop.
    save_partial: Callable[[str, Entry], None] = lambda name, entry: None

    def seconds_left(self, keep: float = 0.0) -> float:
        """Seconds of the budget left, less `keep` for what comes after."""
        return self.deadline - time.monotonic() - keep

    def stack_start_s(self) -> float:
        """How long a stack may take to start: a minute at least, four at most, a minute left after."""
        return min(240.0, max(60.0, self.seconds_left(keep=60)))

    def graphs_settings(self, on: bool) -> dict[str, Any]:
        """The engine settings for graphs on or off; on a CPU they are emulated after construction."""
        return {"use_cuda_graph": on} if self.device == "cuda" else {}

    def engine(self, model: Any, settings: dict[str, Any], graphs: bool, gpu_forward: bool = False) -> Engine:
        """An engine on `model` (a directory or a loaded model), with decode graphs or without. On a
        CPU, `gpu_forward` runs a GPU's fallback forward (transformers' modules, gather + SDPA) instead
        of the native kernels: the Triton forward a GPU runs a Llama with would run under Triton's
        interpreter here, too slow for a check (tests/test_gpu_llama.py runs it on the CPU)."""
        cb = settings | self.graphs_settings(graphs)

        def build() -> Engine:
            if isinstance(model, Path):
                return Engine.from_pretrained(model, device=self.device, **cb)
            # On a CPU our own forward takes the model it is given (it lets the plain weights go once
            # packed): each engine gets a copy, as every system on a GPU reads the same weights.
            return Engine(
                model if self.device == "cuda" else copy.deepcopy(model), CBConfig.from_kwargs(**cb)
            )

        if self.device == "cuda":
            return build()
        if gpu_forward:
            from tests.cuda_forward import cuda_like

            engine = cuda_like(build)
        else:
            engine = build()
        if graphs:
            engine.runner.use_graphs(eager_capture)
        return engine


def path_facts(engine: Engine) -> Entry:
    """Which forward and which attention kernels ran (layer_forward.py, attention_kernels.py)."""
    return {"forward": engine.runner.describe()["forward"], "attention": engine.runner.attention.name}


def graph_facts(engine: Engine) -> Entry | None:
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    return {
        "graphs": graphs.count,
        "capture_s": round(graphs.cost.seconds, 2),
        "memory_mib": graphs.cost.memory_mib,
        "max_requests": graphs.buckets.max_tokens,
        "max_context": graphs.buckets.max_keys,
        "replays": graphs.replays,
        "eager_decodes": graphs.eager_decodes,
        "piecewise": piecewise_facts(engine),
    }


def piecewise_facts(engine: Engine) -> Entry | None:
    """The pieces of the steps no decode graph serves (None: transformers' layers, which have none)."""
    pieces = engine.runner.pieces
    if pieces is None:
        return None
    return {
        "graphs": pieces.count,
        "buckets": pieces.buckets,
        "capture_s": round(pieces.cost.seconds, 2),
        "memory_mib": pieces.cost.memory_mib,
        "replays": pieces.replays,
        "eager_steps": pieces.eager_steps,
    }


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def refused_or(fn: Callable[..., Entry], *args: Any) -> Entry:
    """`fn(*args)`, or the configuration's refusal (async batching, before it is built)."""
    try:
        return fn(*args)
    except ValueError as exc:
        if "not implemented" not in str(exc):
            raise
        return {"refused": str(exc)}
