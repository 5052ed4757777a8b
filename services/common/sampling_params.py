"""Per-request sampling and stopping parameters."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

MAX_TOKENS = 2**31 - 1  # bounds every token count that crosses a process boundary


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    `temperature == 0` means greedy. `top_k == 0`, `top_p == 1`, `min_p == 0` and
    `repetition_penalty == 1` switch the corresponding filter off. `logprobs=None` returns no
    logprobs; `logprobs=n` returns the sampled token's logprob plus the top-n (n may be 0).
    `prompt_logprobs=n` does the same for every prompt token after the first (vLLM's semantics);
    such a request computes the LM head on all its prompt rows and reads no prefix cache.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    MAX_LOGPROBS = 20

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int, names: Mapping[str, str] = MappingProxyType({})) -> None:
        """Raise ValueError naming the offending field and value; `names` maps fields to the names the
        caller knows them by (the gateway's API names its fields otherwise)."""

        def n(field: str) -> str:
            return names.get(field, field)

        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"{n('temperature')} must be in [0, 100], got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"{n('top_k')} must be >= 0, got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"{n('top_p')} must be in (0, 1], got {self.top_p!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"{n('min_p')} must be in [0, 1], got {self.min_p!r}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"{n('repetition_penalty')} must be in (0, 10], got {self.repetition_penalty!r}")
        if not 1 <= self.max_new_tokens <= MAX_TOKENS:
            raise ValueError(
                f"{n('max_new_tokens')} must be in [1, {MAX_TOKENS}], got {self.max_new_tokens!r}"
            )
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"{n('min_new_tokens')} must be in [0, {n('max_new_tokens')}={self.max_new_tokens}], "
                f"got {self.min_new_tokens!r}"
            )
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{n('stop_token_ids')} out of vocabulary (size {vocab_size}): {bad}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= self.MAX_LOGPROBS:
                raise ValueError(f"{n(name)} must be in [0, {self.MAX_LOGPROBS}], got {value!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"{n('seed')} must be in [0, 2**63), got {self.seed!r}")
