"""The `stack` and `stack-streamed` systems of `cbserve bench offline`, as the run's other systems are
driven: one `StackSystem` (services/bench/stack.py, which starts `cbserve up` and drives it over gRPC)
serves both, and each round's run becomes a `SystemResult`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.bench.offline.results import WARMUP_NEW_TOKENS, WARMUP_PROMPT, SystemResult
from services.bench.workload import Workload

if TYPE_CHECKING:
    from services.bench.stack import StackSystem


STACK_SYSTEMS = ("stack", "stack-streamed")  # one `cbserve up` serves both


def run_stack(
    stack: StackSystem, workload: Workload, max_in_flight: int | None, streamed: bool = False
) -> SystemResult:
    run = stack.run(workload, (WARMUP_PROMPT, WARMUP_NEW_TOKENS), max_in_flight, streamed)
    return SystemResult(
        name="stack-streamed" if streamed else "stack",
        wall_s=run.wall_s,
        outputs=run.outputs,
        prompt_tokens=workload.total_prompt_tokens,
        extra={
            "load": {f.name: getattr(run.load, f.name) for f in run.load.DESCRIPTOR.fields},
            "peak_rss_bytes": run.peak_rss_bytes,
            "step_profile": run.step_profile,
        },
    )
