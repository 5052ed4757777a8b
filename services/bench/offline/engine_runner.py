"""The `engine` systems of `cbserve bench offline`: cbserve's in-process `Engine`, at `--dtype` or at an
`engine:DTYPE` variant's settings.

Like the stack and the peers' servers, each engine is built once and serves every round, each round
under a cache salt of its own so that no round hits what an earlier one cached: built afresh per round,
the first touches of its pool would fall inside the timed part.

A `+constrained` engine holds every request, the warm-up's too, to `--constraint`. Its grammar may end
a request before its length (the grammar complete): the result counts the tokens generated, and says
how many requests ended so (`ended_early`) and what they read (`output_texts`).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.bench.offline.results import WARMUP_NEW_TOKENS, WARMUP_PROMPT, SystemResult
from services.bench.peer_runners.protocol import closed_loop
from services.bench.workload import Workload

if TYPE_CHECKING:
    from services.bench.arguments import EngineVariant
    from services.bench.constraint import BenchConstraint
    from services.common.sampling_params import Constraint
    from services.worker.engine import Engine


def build_engine(model_path: Path, variant: EngineVariant, settings: dict[str, Any]) -> Engine:
    """The engine of one engine system: `settings` plus the variant's own, at its dtype."""
    from services.worker.engine import Engine

    return Engine.from_pretrained(
        model_path, dtype=getattr(torch, variant.dtype), **settings | variant.settings
    )


def run_engine(
    engine: Engine,
    settings: dict[str, Any],
    workload: Workload,
    max_in_flight: int | None,
    name: str = "engine",
    constraint: BenchConstraint | None = None,
) -> SystemResult:
    held = None if constraint is None else constraint.constraint
    engine.generate([WARMUP_PROMPT], [WARMUP_NEW_TOKENS], ignore_eos=True, constraint=held)
    stats_before = dict(engine.stats())
    phases_before = dataclasses.replace(engine.phase_totals)
    start = time.perf_counter()
    salt = uuid.uuid4().hex
    outputs = _engine_closed_loop(engine, workload, max_in_flight or workload.num_requests, salt, held)
    wall = time.perf_counter() - start
    engine.run_until_done()  # the last step's releases, so the stats below count nothing as held
    stats_after = dict(engine.stats())
    profile = {
        name: getattr(engine.phase_totals, name) - getattr(phases_before, name)
        for name in engine.phase_totals.PHASES
    }
    held_extra: dict[str, Any] = {}
    if constraint is not None:
        ended = sum(len(o) < n for o, n in zip(outputs, workload.max_new_tokens, strict=True))
        held_extra = {
            "constraint": constraint.spec,
            "ended_early": ended,
            "grammar_s": engine.phase_totals.grammar - phases_before.grammar,
            "output_texts": [engine.tokenizer.decode(o, skip_special_tokens=True) for o in outputs],
        }
    return SystemResult(
        name=name,
        wall_s=wall,
        outputs=outputs,
        prompt_tokens=workload.total_prompt_tokens,
        extra={
            "settings": settings,
            "stats_before": stats_before,
            "stats": stats_after,
            "step_profile_s": profile,
            "runs": engine.runner.describe(),
            **held_extra,
        },
    )


def _engine_closed_loop(
    engine: Engine, workload: Workload, max_in_flight: int, cache_salt: str, constraint: Constraint | None
) -> list[list[int]]:
    from services.common.sampling_params import SamplingParams
    from services.worker.request import FinishReason

    requests: list[Any] = [None] * workload.num_requests

    def submit(i: int) -> None:
        params = SamplingParams(
            temperature=0.0, max_new_tokens=workload.max_new_tokens[i], ignore_eos=True, constraint=constraint
        )
        requests[i] = engine.add_request(workload.prompts[i], params, cache_salt=cache_salt)

    def step() -> int:
        finished = [r for r in engine.step() if r.finished]
        failed = [r for r in finished if r.finish_reason is FinishReason.ERROR]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return len(finished)

    closed_loop(workload.num_requests, max_in_flight, submit, step)
    return [list(r.output_ids) for r in requests]
