"""What every system's turn in `cbserve bench offline` shares: the untimed warm-up request it runs
first, and the `SystemResult` its timed run returns, which the report reads whatever the system."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Token ids for the warm-up requests: fewer than one page, so a prefix cache cannot keep anything from
# them that W1 (random ids) would hit.
WARMUP_PROMPT = list(range(100, 116))
WARMUP_NEW_TOKENS = 4


@dataclass
class SystemResult:
    """One system's timed run. `outputs` holds each request's generated ids, in workload order; with
    `choices` > 1 (`--n`), its first choice's, the others' being the same (greedy)."""

    name: str
    wall_s: float
    outputs: list[list[int]]
    prompt_tokens: int
    # Tokens a system computed beyond what was asked (static batches run to their longest request).
    wasted_output_tokens: int = 0
    choices: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return self.choices * sum(len(o) for o in self.outputs)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s
