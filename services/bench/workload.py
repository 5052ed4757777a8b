"""The reference benchmark workload, W1 (docs/benchmarking.md).

Every system under comparison must see exactly the same requests, so the workload is a pure function of
its parameters and a seed. The drawing procedure is part of the contract: the published baseline figures
(3,305 output tokens, 9,443 prompt tokens for the defaults) are only comparable if it never changes.

Procedure, with one `random.Random(seed)` and `randint` bounds inclusive, for each request in turn:
  1. its prompt length from `prompt_len`,
  2. its output length (`max_new_tokens`) from `new_tokens`,
  3. its prompt ids, one `randint(*id_range)` call per token, in order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Workload:
    """Prompts as token ids and, per request, how many tokens to generate (EOS ignored)."""

    prompts: list[list[int]]
    max_new_tokens: list[int]

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.max_new_tokens):
            raise ValueError(
                f"{len(self.prompts)} prompts but {len(self.max_new_tokens)} max_new_tokens entries"
            )

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def total_output_tokens(self) -> int:
        return sum(self.max_new_tokens)

    @property
    def total_tokens(self) -> int:
        """Tokens whose forward pass the workload costs (prompt + output), for FLOP estimates."""
        return self.total_prompt_tokens + self.total_output_tokens


def reference_workload(
    num_requests: int = 48,
    prompt_len: tuple[int, int] = (32, 384),
    new_tokens: tuple[int, int] = (8, 128),
    id_range: tuple[int, int] = (100, 49052),
    seed: int = 0,
) -> Workload:
    """W1 with its defaults; see the module docstring for the exact drawing order."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    max_new_tokens: list[int] = []
    for _ in range(num_requests):
        length = rng.randint(*prompt_len)
        max_new_tokens.append(rng.randint(*new_tokens))
        prompts.append([rng.randint(*id_range) for _ in range(length)])
    return Workload(prompts=prompts, max_new_tokens=max_new_tokens)


def jsonl_workload(path: Path, num_requests: int, model_path: Path) -> Workload:
    """The first `num_requests` requests of a JSONL file (`cbserve bench serve`'s format): `token_ids`
    or `prompt` text (tokenized with the model's tokenizer, no special tokens added), and `max_tokens`,
    which an offline run needs on every line."""
    from services.bench.serve.workloads import jsonl_requests

    requests = jsonl_requests(path, num_requests, None)
    missing = [r.index for r in requests if r.max_tokens is None]
    if missing:
        raise ValueError(f"{path}: requests {missing[:8]} have no max_tokens")
    # The tokenizer is loaded only for the first request given as text (never when all carry ids).
    tokenizer: PreTrainedTokenizerBase | None = None
    prompts: list[list[int]] = []
    for r in requests:
        if r.token_ids is not None:
            prompts.append(list(r.token_ids))
            continue
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        prompts.append(tokenizer(r.text, add_special_tokens=False)["input_ids"])
    # Every request has max_tokens (checked above); the filter only tells the type checker.
    max_new_tokens = [int(r.max_tokens) for r in requests if r.max_tokens is not None]
    return Workload(prompts=prompts, max_new_tokens=max_new_tokens)
