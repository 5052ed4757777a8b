"""How closely a lower precision follows the exact float32 model: teacher-forced top-1 agreement.

Every position of a fixed text is fed to both models (teacher forcing: each sees the true tokens
before it, never its own guesses), and the share of positions where both rank the same next token
first is the agreement. Unlike comparing greedy continuations, one early difference does not decide
everything after it, so the figure measures the arithmetic, not the luck of a near tie.

The text (`data/prose.txt`) is real English prose: two sections of the Python Language Reference
(the execution model and exceptions, PSF license), split into paragraphs and put through the model's
chat template as conversations in which the user gives one paragraph and the assistant answers with
the next. A few thousand positions in all; fixed, so that every run and every engine sees the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

PROSE = Path(__file__).parent / "data" / "prose.txt"
_PARAGRAPHS_PER_CONVERSATION = 6


def _paragraphs() -> list[str]:
    return [p.strip() for p in PROSE.read_text().split("\n\n") if p.strip()]


def prose_conversations(tokenizer: Any) -> list[list[int]]:
    """The prose as token ids of chat conversations: user paragraph, assistant's next paragraph, ...
    (the last may be short). Without a chat template, the paragraphs as plain text."""
    paragraphs = _paragraphs()
    out = []
    for first in range(0, len(paragraphs), _PARAGRAPHS_PER_CONVERSATION):
        part = paragraphs[first : first + _PARAGRAPHS_PER_CONVERSATION]
        if getattr(tokenizer, "chat_template", None):
            roles = ("user", "assistant")
            messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(part)]
            ids = tokenizer.apply_chat_template(messages, tokenize=True)
            ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        else:
            ids = tokenizer("\n\n".join(part))["input_ids"]
        out.append([int(t) for t in ids])
    return out


@torch.inference_mode()
def reference_top1(model: Any, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """transformers' argmax next token at every position but the last of each prompt: entry i of a
    prompt's list is the model's top guess for its token i + 1."""
    out = []
    for prompt in prompts:
        logits = model(torch.tensor([list(prompt)])).logits[0, :-1].float()
        out.append(logits.argmax(-1).tolist())
    return out


def engine_top1(engine: Any, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The engine's top-ranked token at the same positions, from its prompt logprobs."""
    from services.common.sampling_params import SamplingParams

    requests = [
        engine.add_request(list(p), SamplingParams(max_new_tokens=1, prompt_logprobs=1, ignore_eos=True))
        for p in prompts
    ]
    engine.run_until_done()
    failed = [r for r in requests if r.error]
    if failed:
        raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
    return [[lp.top[0][0] for lp in r.prompt_logprobs] for r in requests]


def agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(positions where both rank the same token first, positions compared)."""
    if [len(r) for r in reference] != [len(o) for o in other]:
        raise ValueError("the two runs did not score the same positions")
    pairs = (zip(ref, oth, strict=True) for ref, oth in zip(reference, other, strict=True))
    same = sum(a == b for row in pairs for a, b in row)
    return same, sum(len(r) for r in reference)
