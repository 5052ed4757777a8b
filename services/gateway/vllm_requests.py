"""From a `vllm.grpc.engine.GenerateRequest` (the SMG worker protocol) to a `cbserve.v1.GenerateRequest`.

Pure translation; the cbserve request then goes through the same validation as any other
(`inputs.prepare`), so only what `cbserve.v1` cannot say is refused here. Every refusal is an
`InvalidRequest` naming the field as the caller set it, and its value.

Fields and their nearest behaviour:
- `tokenized.input_ids` become `token_ids` (`original_text` is only for reference); `text` is
  tokenized as cbserve's own `text` input is.
- Zero means unset where vLLM's own servicer reads it so: `top_p`, `top_k`, `min_p`,
  `repetition_penalty`, `min_tokens`; an unset `temperature` is 1, as in vLLM.
- `skip_special_tokens`, `spaces_between_special_tokens` and `include_stop_str_in_output` shape text,
  and the caller gets token ids only and detokenizes itself: they are accepted and change nothing
  here (stop strings still end generation; the caller trims its own text).
- `logprobs` and `prompt_logprobs` are cbserve's `output.logprobs` and `output.prompt_logprobs`
  (-1, vLLM's "all", is refused). Prompt logprobs need `tokenized` input: vLLM lists every prompt
  token, the first without a logprob, and cbserve gives the ones after the first, so the first id
  must be known here.
- `frequency_penalty`, `presence_penalty` and `logit_bias` are cbserve's own (zero penalties are
  unset, as in vLLM); their ranges and the vocabulary are checked there.
- The `constraint` oneof (structured outputs: what smg sends for `response_format`, its `regex` and
  `ebnf` extensions and forced tool calls) is cbserve's own `constraint`, `grammar` under the name
  `ebnf`. cbserve's grammar runs from the first generated token, which is what
  `grammar_from_first_token` asks for, so that flag changes nothing here.
- `n` is cbserve's `sampling.n` (0 is one choice, as in vLLM); each output names its choice (`index`).
- Not in cbserve, refused when set: `truncate_prompt_tokens`, multimodal inputs, KV
  transfer (disaggregated prefill), a `data_parallel_rank` other than 0 (a cbserve stack is one rank).
"""

from __future__ import annotations

import re
from typing import Any

from services.gateway.api import pb
from services.gateway.inputs import InvalidRequest

INT32_MAX = 2**31 - 1

# What `cbserve.v1` calls a field -> what a VllmEngine caller set: "stopping.max_tokens" was
# "sampling_params.max_tokens" (every sampling, stopping and output field comes from sampling_params).
_CBSERVE_FIELD = re.compile(r"\b(?:sampling|stopping|output)\.(?=\w)")


def vllm_field_names(details: str) -> str:
    """A cbserve refusal as a VllmEngine caller reads it: fields under their VllmEngine names."""
    return _CBSERVE_FIELD.sub("sampling_params.", details).replace(
        "sampling_params.ebnf", "sampling_params.grammar"
    )


def _constraint(s: Any, sampling: Any) -> None:
    """smg's `constraint` oneof onto cbserve's (the same kinds; `grammar` is cbserve's `ebnf`)."""
    kind = s.WhichOneof("constraint")
    if kind == "choice":
        sampling.choice.choices.extend(s.choice.choices)
        sampling.choice.SetInParent()  # an empty list is still this constraint (refused there)
    elif kind == "json_object":
        sampling.json_object = s.json_object
    elif kind is not None:
        setattr(sampling, "ebnf" if kind == "grammar" else kind, getattr(s, kind))


def _int32_ids(name: str, ids: Any) -> list[int]:
    values = [int(t) for t in ids]
    bad = [t for t in values if t > INT32_MAX]
    if bad:
        raise InvalidRequest(f"{name} holds ids beyond any vocabulary: {bad[:8]}")
    return values


def _refuse_unsupported(request: Any) -> None:
    s = request.sampling_params
    unsupported = {
        "sampling_params.truncate_prompt_tokens": (
            s.truncate_prompt_tokens if s.HasField("truncate_prompt_tokens") else None
        ),
        "extra_mm_inputs": len(request.extra_mm_inputs),
        "data_parallel_rank": request.data_parallel_rank,  # 0 (this stack's one rank) when unset
    }
    for name, value in unsupported.items():
        if value:
            raise InvalidRequest(f"{name} is not supported by cbserve, got {value!r}")
    for name in ("mm_inputs", "media_refs", "kv_transfer_params", "kv_transfer_params_json"):
        if request.HasField(name):
            raise InvalidRequest(f"{name} is not supported by cbserve (text-only, no disaggregated prefill)")
    for name in ("logprobs", "prompt_logprobs"):
        if s.HasField(name) and (value := getattr(s, name)) < 0:
            raise InvalidRequest(f"sampling_params.{name} must be in [0, 20] (no 'all'), got {value}")
    if s.HasField("prompt_logprobs") and request.WhichOneof("input") != "tokenized":
        raise InvalidRequest("sampling_params.prompt_logprobs needs tokenized input (the first prompt id)")
    if s.HasField("seed") and s.seed < 0:
        raise InvalidRequest(f"sampling_params.seed must be >= 0, got {s.seed}")


def to_cbserve(request: Any) -> Any:
    """The `cbserve.v1.GenerateRequest` that runs `request`; it asks for token ids only (no text)."""
    _refuse_unsupported(request)
    out = pb.GenerateRequest(request_id=request.request_id)
    kind = request.WhichOneof("input")
    if kind == "tokenized":
        out.token_ids.ids.extend(_int32_ids("tokenized.input_ids", request.tokenized.input_ids))
        out.token_ids.SetInParent()  # an empty list is still this input (refused later as an empty prompt)
    elif kind == "text":
        out.text = request.text
    else:
        raise InvalidRequest("no input: set tokenized or text")
    s, sampling, stopping = request.sampling_params, out.sampling, out.stopping
    if s.HasField("temperature"):
        sampling.temperature = s.temperature
    if s.top_p:
        sampling.top_p = s.top_p
    if s.top_k:
        sampling.top_k = min(s.top_k, INT32_MAX)  # beyond any vocabulary: the same as the whole of it
    if s.min_p:
        sampling.min_p = s.min_p
    if s.repetition_penalty:
        sampling.repetition_penalty = s.repetition_penalty
    if s.presence_penalty:
        sampling.presence_penalty = s.presence_penalty
    if s.frequency_penalty:
        sampling.frequency_penalty = s.frequency_penalty
    sampling.logit_bias.update(s.logit_bias)
    if s.HasField("seed"):
        sampling.seed = s.seed
    if s.n:
        sampling.n = s.n
    _constraint(s, sampling)
    if s.HasField("max_tokens"):
        stopping.max_tokens = s.max_tokens
    if s.min_tokens:
        stopping.min_tokens = s.min_tokens
    stopping.stop.extend(s.stop)
    stopping.stop_token_ids.extend(_int32_ids("sampling_params.stop_token_ids", s.stop_token_ids))
    stopping.ignore_eos = s.ignore_eos
    out.output.text = False
    out.output.token_ids = True
    if s.HasField("logprobs"):
        out.output.logprobs = s.logprobs
    if s.HasField("prompt_logprobs"):
        out.output.prompt_logprobs = s.prompt_logprobs
    return out
