"""From a public `GenerateRequest` to what the worker runs: prompt ids and SamplingParams.

Pure translation and validation; every refusal is an `InvalidRequest` naming the offending field and
value, which the server turns into INVALID_ARGUMENT. Limits are explicit (see `Limits`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from services.common.gateway_messages import WorkerFacts
from services.common.sampling_params import Constraint, SamplingParams

CHAT_ROLES = frozenset({"system", "user", "assistant"})


class InvalidRequest(ValueError):
    pass


@dataclass(frozen=True)
class Limits:
    """Explicit per-request limits (documented in docs/deployment.md: Limits)."""

    max_input_chars: int = 1 << 20  # text or all chat contents together, before tokenizing
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string
    max_stop_token_ids: int = 64
    default_max_tokens: int = 256
    max_id_chars: int = 128  # request_id / x-request-id: printable ASCII (it goes back as metadata)
    max_salt_chars: int = 256  # cache_salt travels with the request in every step plan
    max_n: int = 16  # choices per request (sampling.n)


@dataclass(frozen=True)
class Prepared:
    prompt_ids: list[int]
    params: SamplingParams
    stops: tuple[str, ...]
    want_text: bool
    want_token_ids: bool
    stream: bool = True  # False: the output is held until the end (OutputOptions.stream)
    n: int = 1  # choices

    def choice_params(self, index: int) -> SamplingParams:
        """Choice `index`'s parameters: its own seed (seed + index), so that a seeded call gives the
        same choices again; the prompt's logprobs go with choice 0 alone."""
        p = self.params
        if index == 0:
            return p
        seed = None if p.seed is None else (p.seed + index) % SamplingParams.SEED_LIMIT
        return msgspec.structs.replace(p, seed=seed, prompt_logprobs=None)


def _chat_dicts(chat: Any, limits: Limits) -> list[dict[str, str]]:
    if not chat.messages:
        raise InvalidRequest("chat needs at least one message")
    messages = []
    for i, m in enumerate(chat.messages):
        if m.role not in CHAT_ROLES:
            roles = sorted(CHAT_ROLES)
            raise InvalidRequest(f"chat.messages[{i}].role must be one of {roles}, got {m.role!r}")
        messages.append({"role": m.role, "content": m.content})
    size = sum(len(m["content"]) for m in messages)
    if size > limits.max_input_chars:
        raise InvalidRequest(f"chat contents hold {size} characters; the limit is {limits.max_input_chars}")
    return messages


def request_id(given: str, metadata_id: str, limits: Limits) -> str:
    """The request's id: `request_id`, else the x-request-id metadata, else a new one."""
    value = given or metadata_id
    if not value:
        return uuid.uuid4().hex
    if len(value) > limits.max_id_chars or not (value.isascii() and value.isprintable()):
        raise InvalidRequest(
            f"request id must be 1..{limits.max_id_chars} printable ASCII characters, got {value[:40]!r}"
            f"{'...' if len(value) > 40 else ''}"
        )
    return value


def tokenize_input(request: Any, tokenizer: Any, facts: WorkerFacts, limits: Limits) -> list[int]:
    """Prompt ids of a GenerateRequest or TokenizeRequest (both have the `input` oneof)."""
    kind = request.WhichOneof("input")
    if kind is None:
        raise InvalidRequest("no input: set one of text, token_ids, chat")
    if kind == "token_ids":
        ids = list(request.token_ids.ids)
        bad = [t for t in ids if not 0 <= t < facts.vocab_size]
        if bad:
            raise InvalidRequest(f"token ids out of vocabulary [0, {facts.vocab_size}): {bad[:8]}")
    elif tokenizer is None:
        raise InvalidRequest(f"{kind} input needs a tokenizer and this model has none; send token_ids")
    elif kind == "text":
        size = len(request.text)
        if size > limits.max_input_chars:
            raise InvalidRequest(f"text holds {size} characters; the limit is {limits.max_input_chars}")
        ids = list(tokenizer(request.text, add_special_tokens=True)["input_ids"])
    else:
        if getattr(tokenizer, "chat_template", None) is None:
            raise InvalidRequest("this model's tokenizer has no chat template; send text or token_ids")
        rendered = tokenizer.apply_chat_template(
            _chat_dicts(request.chat, limits), add_generation_prompt=True, tokenize=True
        )
        ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    if not ids:
        raise InvalidRequest("empty prompt")
    return [int(t) for t in ids]


def detokenize_input(request: Any, tokenizer: Any, facts: WorkerFacts) -> list[int]:
    """The token ids of a DetokenizeRequest, checked against the vocabulary and a request's size."""
    if tokenizer is None:
        raise InvalidRequest("detokenizing needs a tokenizer and this model has none")
    ids = list(request.token_ids)
    if len(ids) > facts.max_request_tokens:
        raise InvalidRequest(
            f"{len(ids)} token ids; at most {facts.max_request_tokens} (a request's tokens) decode at once"
        )
    bad = [t for t in ids if not 0 <= t < facts.vocab_size]
    if bad:
        raise InvalidRequest(f"token ids out of vocabulary [0, {facts.vocab_size}): {bad[:8]}")
    return ids


# SamplingParams' fields under the names a client sets them by (errors name what the client sent).
API_NAMES = {
    "temperature": "sampling.temperature",
    "top_k": "sampling.top_k",
    "top_p": "sampling.top_p",
    "min_p": "sampling.min_p",
    "repetition_penalty": "sampling.repetition_penalty",
    "seed": "sampling.seed",
    "presence_penalty": "sampling.presence_penalty",
    "frequency_penalty": "sampling.frequency_penalty",
    "logit_bias": "sampling.logit_bias",
    "constraint": "sampling",  # its kinds are fields of SamplingParams' `constraint` oneof
    "max_new_tokens": "stopping.max_tokens",
    "min_new_tokens": "stopping.min_tokens",
    "stop_token_ids": "stopping.stop_token_ids",
    "logprobs": "output.logprobs",
    "prompt_logprobs": "output.prompt_logprobs",
}


def constraint_of(sampling: Any) -> Constraint | None:
    """The `constraint` oneof of a cbserve.v1 SamplingParams, as the worker takes it."""
    kind = sampling.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not sampling.json_object):
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "choice":
        return Constraint.choice(list(sampling.choice.choices))
    return Constraint(kind, getattr(sampling, kind))


def prepare(request: Any, tokenizer: Any, facts: WorkerFacts, limits: Limits) -> Prepared:
    prompt = tokenize_input(request, tokenizer, facts, limits)
    room = facts.max_request_tokens - len(prompt)
    if room < 1:
        raise InvalidRequest(
            f"prompt of {len(prompt)} tokens leaves no room to generate: a request holds at most "
            f"{facts.max_request_tokens} tokens"
        )
    if len(request.cache_salt) > limits.max_salt_chars:
        raise InvalidRequest(
            f"cache_salt holds {len(request.cache_salt)} characters; the limit is {limits.max_salt_chars}"
        )
    s, stop, out = request.sampling, request.stopping, request.output
    if stop.HasField("max_tokens"):
        max_tokens = stop.max_tokens
        if len(prompt) + max_tokens > facts.max_request_tokens:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + stopping.max_tokens ({max_tokens}) exceeds the "
                f"{facts.max_request_tokens} tokens a request may hold"
            )
    else:
        max_tokens = min(limits.default_max_tokens, room)
    if len(stop.stop) > limits.max_stop_strings:
        raise InvalidRequest(f"{len(stop.stop)} stop strings; the limit is {limits.max_stop_strings}")
    for i, text in enumerate(stop.stop):
        if not text or len(text) > limits.max_stop_chars:
            raise InvalidRequest(
                f"stopping.stop[{i}] must hold 1..{limits.max_stop_chars} characters, got {len(text)}"
            )
    if len(stop.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequest(
            f"{len(stop.stop_token_ids)} stop token ids; the limit is {limits.max_stop_token_ids}"
        )
    n = s.n if s.HasField("n") else 1
    if not 1 <= n <= limits.max_n:
        raise InvalidRequest(f"sampling.n must be in [1, {limits.max_n}] (the server's --max-n), got {n}")
    want_text = out.text if out.HasField("text") else tokenizer is not None
    if want_text and tokenizer is None:
        raise InvalidRequest("output.text needs a tokenizer and this model has none")
    if stop.stop and tokenizer is None:
        raise InvalidRequest("stop strings need a tokenizer and this model has none")
    try:
        params = SamplingParams(
            temperature=s.temperature if s.HasField("temperature") else 1.0,
            top_k=s.top_k if s.HasField("top_k") else 0,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            min_p=s.min_p if s.HasField("min_p") else 0.0,
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
            seed=s.seed if s.HasField("seed") else None,
            presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
            frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
            logit_bias=tuple(s.logit_bias.items()),
            constraint=constraint_of(s),
            max_new_tokens=max_tokens,
            min_new_tokens=stop.min_tokens if stop.HasField("min_tokens") else 0,
            ignore_eos=stop.ignore_eos,
            stop_token_ids=tuple(stop.stop_token_ids),
            logprobs=out.logprobs if out.HasField("logprobs") else None,
            prompt_logprobs=out.prompt_logprobs if out.HasField("prompt_logprobs") else None,
        )
        params.validate(facts.vocab_size, API_NAMES)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc
    return Prepared(
        prompt_ids=prompt,
        params=params,
        stops=tuple(stop.stop),
        want_text=want_text,
        want_token_ids=out.token_ids if out.HasField("token_ids") else True,
        stream=out.stream if out.HasField("stream") else True,
        n=n,
    )
