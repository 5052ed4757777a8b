"""The `engine` systems of `cbserve bench offline`: cbserve's in-process `Engine`, at `--dtype` or at an
`engine:DTYPE` variant's settings.

Like the stack and the peers' servers, each engine is built once and serves every round, each round
under a cache salt of its own so that no round hits what an earlier one cached: built afresh per round,
the first touches of its pool would fall inside the timed part.

With `--n` each request is that many greedy choices: those after the first fork from it (its prompt
computed once), or with `+unforked` go as requests of their own. The result keeps each request's first
choice (every choice has its tokens) and counts them all (`SystemResult.choices`).

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
    choices: int = 1,
    forked: bool = True,
) -> SystemResult:
    held = None if constraint is None else constraint.constraint
    engine.generate([WARMUP_PROMPT], [WARMUP_NEW_TOKENS], ignore_eos=True, constraint=held)
    stats_before = dict(engine.stats())
    phases_before = dataclasses.replace(engine.phase_totals)
    start = time.perf_counter()
    salt = uuid.uuid4().hex
    outputs = _engine_closed_loop(
        engine, workload, max_in_flight or workload.num_requests, salt, held, choices, forked
    )
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
            "grammar_s": {
                name: getattr(engine.phase_totals, name) - getattr(phases_before, name)
                for name in engine.phase_totals.GRAMMAR
            },
            "output_texts": [engine.tokenizer.decode(o, skip_special_tokens=True) for o in outputs],
        }
    return SystemResult(
        name=name,
        wall_s=wall,
        outputs=outputs,
        prompt_tokens=workload.total_prompt_tokens,
        choices=choices,
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
    engine: Engine,
    workload: Workload,
    max_in_flight: int,
    cache_salt: str,
    constraint: Constraint | None,
    choices: int,
    forked: bool,
) -> list[list[int]]:
    """Each request's first choice's tokens; every choice must end as the first did."""
    from services.common.sampling_params import SamplingParams
    from services.worker.request import FinishReason

    requests: list[list[Any]] = [[] for _ in range(workload.num_requests)]
    call_of: dict[str, int] = {}  # a choice's request id -> its request's index in the workload
    left = [choices] * workload.num_requests  # choices of each request still running

    def submit(i: int) -> None:
        params = SamplingParams(
            temperature=0.0, max_new_tokens=workload.max_new_tokens[i], ignore_eos=True, constraint=constraint
        )
        first = engine.add_request(workload.prompts[i], params, cache_salt=cache_salt)
        fork_of = first.request_id if forked else None
        requests[i] = [first] + [
            engine.add_request(workload.prompts[i], params, cache_salt=cache_salt, fork_of=fork_of)
            for _ in range(choices - 1)
        ]
        call_of.update((r.request_id, i) for r in requests[i])

    def step() -> int:
        """Requests whose every choice finished in this step."""
        done = 0
        for r in engine.step():
            if not r.finished:
                continue
            if r.finish_reason is FinishReason.ERROR:
                raise RuntimeError(f"request {r.request_id} failed: {r.error}")
            i = call_of.pop(r.request_id)
            left[i] -= 1
            done += left[i] == 0
        return done

    closed_loop(workload.num_requests, max_in_flight, submit, step)
    for i, call in enumerate(requests):
        if any(c.output_ids != call[0].output_ids for c in call):
            raise RuntimeError(f"request {i}: its greedy choices generated different tokens")
    return [list(call[0].output_ids) for call in requests]
