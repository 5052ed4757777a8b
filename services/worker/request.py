"""A generation request as the worker sees it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

import torch

from services.common.sampling_params import SamplingParams
from services.worker.sampler import TokenLogprobs

if TYPE_CHECKING:
    from services.worker.grammar import GrammarState


class RequestStatus(Enum):
    PENDING = "pending"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    OFFLOADED = "offloaded"
    FINISHED = "finished"


# Stands for a token the running step has not sampled yet (async batching); the engine writes the
# sampled id over it before the forward that reads it starts.
PLACEHOLDER_ID = 0


class FinishReason(Enum):
    EOS = "eos"
    STOP_TOKEN = "stop_token"
    LENGTH = "length"
    ABORTED = "aborted"
    ERROR = "error"


@dataclass
class Request:
    """Tokens are `prompt_ids + output_ids`; KV exists for the first `num_computed` of them.

    A step computes `tokens[num_computed : num_computed + n]`; when that reaches the last token, the
    logits of that row sample the next token. This one rule covers prefill, chunked prefill, decode
    and the re-prefill after a soft reset (which only sets `num_computed = 0`).

    `num_computed` counts a step's tokens from when it is scheduled, and the token it samples is a
    placeholder until the step ends (`num_placeholders`), so that with async batching the next step is
    planned while this one computes.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int
    priority: int = 0
    cache_salt: str = ""
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.PENDING
    num_computed: int = 0
    num_placeholders: int = 0  # tokens that steps still computing sample; they follow `output_ids`
    num_sent: int = 0  # token ids the cache manager has been sent
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    tables: list[list[int]] = field(default_factory=list)  # mirror of the cachemgr's block tables
    generator: torch.Generator | None = None
    # With presence/frequency penalties: its generated tokens' counts on the device, which the
    # sampler advances (`SamplingRow.output_counts`); made at its first sampling step.
    output_counts: torch.Tensor | None = None
    # With a constraint: its grammar's matcher, made once the grammar has compiled (the request
    # enters the scheduler then); the host advances it as each step's tokens are taken.
    grammar: GrammarState | None = None
    # A sibling of the same n > 1 call whose prompt KV it is to share: until that request's prompt
    # is computed, this one waits without computing anything, then starts at its prompt's end from
    # the same logits row (a *fork*). Cleared once forked, or when the fork is given up (it then
    # runs on its own, its prompt's full pages hit in the prefix cache).
    fork_of: Request | None = None
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # With `params.prompt_logprobs`: entry i is prompt token i + 1's (the first token has none),
    # from the logits at position i. Filled as prompt chunks compute; complete at the first sample.
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str = ""
    arrived_at: float = 0.0  # time.monotonic() when added
    scheduled_at: float | None = None  # when first computed: the end of its queue time

    @property
    def num_known(self) -> int:
        """Tokens whose ids are known."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_known + self.num_placeholders

    def tokens(self, start: int, end: int) -> list[int]:
        """Ids of positions `[start, end)`, PLACEHOLDER_ID for those not sampled yet."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        known = (self.prompt_ids + self.output_ids)[start:end]
        return known + [PLACEHOLDER_ID] * (end - start - len(known))

    @property
    def prompt_logprobs_owed(self) -> int:
        """Prompt logprobs still to take (0 when the request asks for none)."""
        if self.params.prompt_logprobs is None:
            return 0
        return len(self.prompt_ids) - 1 - len(self.prompt_logprobs)

    def prompt_logprob_rows(self, start: int, end: int) -> range:
        """Positions in `[start, end)` whose logits give prompt logprobs not yet taken.

        A re-prefill after a soft reset starts no later than the logprobs taken (its prefix hits are
        pages it computed itself: see `Engine.add_request`), so no row is taken twice."""
        if not self.prompt_logprobs_owed:
            return range(0)
        taken = len(self.prompt_logprobs)
        if start > taken:
            raise RuntimeError(
                f"{self.request_id}: computing from position {start} skips the prompt logprobs of positions "
                f"{taken}..{start - 1}"
            )
        return range(max(start, taken), min(end, len(self.prompt_ids) - 1))

    @property
    def num_remaining(self) -> int:
        """Tokens to compute before the next sample."""
        return self.num_tokens - self.num_computed

    @property
    def is_active(self) -> bool:
        return self.status in (RequestStatus.PREFILLING, RequestStatus.DECODING)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
