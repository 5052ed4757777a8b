"""OpenAI's logit_bias, presence and frequency penalties written from their definitions as a
transformers `LogitsProcessor` (transformers has none): the reference cbserve's are compared with,
token for token, under greedy `model.generate` in fp32; and the cbserve request that asks for them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from services.common.sampling_params import SamplingParams
from tests.stack import greedy_request, hf_model


class OpenAIPenalties(LogitsProcessor):
    """Each step: every (id, bias) added, then for every token the request generated after its first
    `prompt_len` ids (the prompt does not count) `presence * [count > 0] + frequency * count`
    subtracted."""

    def __init__(self, prompt_len: int, params: SamplingParams) -> None:
        self.prompt_len = prompt_len
        self.presence, self.frequency = params.presence_penalty, params.frequency_penalty
        self.logit_bias = params.logit_bias

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for token, bias in self.logit_bias:
            scores[:, token] += bias
        for row, generated in enumerate(input_ids[:, self.prompt_len :]):
            counts = torch.bincount(generated, minlength=scores.shape[1]).to(scores.dtype)
            scores[row] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


def openai_greedy(
    model_dir: Path, prompt: list[int], max_new_tokens: int, params: SamplingParams
) -> list[int]:
    """transformers' greedy `generate` of `prompt` under `params`' bias and penalties, past EOS."""
    processors = LogitsProcessorList([OpenAIPenalties(len(prompt), params)])
    with torch.inference_mode():
        out = hf_model(model_dir).generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            logits_processor=processors,
        )
    return out[0, len(prompt) :].tolist()


def penalized_request(prompt: list[int], max_tokens: int, params: SamplingParams) -> Any:
    """A greedy cbserve.v1 request with `params`' presence/frequency penalties and logit bias."""
    request = greedy_request(prompt, max_tokens)
    if params.presence_penalty:
        request.sampling.presence_penalty = params.presence_penalty
    if params.frequency_penalty:
        request.sampling.frequency_penalty = params.frequency_penalty
    request.sampling.logit_bias.update(dict(params.logit_bias))
    return request
