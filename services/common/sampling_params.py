"""Per-request sampling and stopping parameters."""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

import msgspec

MAX_TOKENS = 2**31 - 1  # bounds every token count that crosses a process boundary


class Constraint(msgspec.Struct, frozen=True):
    """Structured output: what every generated token must keep satisfiable (the worker compiles it
    with a grammar engine, services/worker/grammar.py).

    `kind` is one of `KINDS`; `text` is the schema, regex or grammar, "" for json_object, and for
    choice the JSON array of the strings (one text per kind keeps the compile cache keyed by
    (kind, text))."""

    kind: str
    text: str = ""

    KINDS: ClassVar[tuple[str, ...]] = (
        "json_schema",
        "json_object",
        "regex",
        "ebnf",
        "choice",
        "structural_tag",
    )
    MAX_CHARS: ClassVar[int] = 1 << 18  # a constraint's text; compiling is CPU time the caller spends

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> Constraint:
        return cls("choice", json.dumps(list(choices)))

    def validate(self, name: str) -> None:
        """Raise ValueError naming the field (`name`, the constraint as the caller knows it) and value.
        Whether the text compiles is the worker's to say."""
        if self.kind not in self.KINDS:
            raise ValueError(f"{name}: unknown constraint kind {self.kind!r}; one of {list(self.KINDS)}")
        if len(self.text) > self.MAX_CHARS:
            raise ValueError(
                f"{name}.{self.kind} holds {len(self.text)} characters; at most {self.MAX_CHARS}"
            )
        if self.kind == "json_object":
            if self.text:
                raise ValueError(f"{name}.json_object takes no text, got {self.text[:80]!r}")
            return
        if not self.text:
            raise ValueError(f"{name}.{self.kind} must not be empty")
        if self.kind == "choice":
            try:
                choices = json.loads(self.text)
            except ValueError as exc:
                raise ValueError(f"{name}.choice must be a JSON array of strings: {exc}") from None
            if not isinstance(choices, list) or not choices:
                raise ValueError(f"{name}.choice must hold at least one string, got {self.text[:80]!r}")
            bad = [c for c in choices if not isinstance(c, str) or not c]
            if bad:
                raise ValueError(f"{name}.choice strings must be non-empty, got {bad[:4]!r}")


# A msgspec struct that leaves its defaults off the wire: a request that sets only a few fields (most
# do) sends only those, and a field added here costs the requests that do not use it nothing.
class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """How one request picks its tokens and when it stops.

    `temperature == 0` means greedy. `top_k == 0`, `top_p == 1`, `min_p == 0` and
    `repetition_penalty == 1` switch the corresponding filter off. `logprobs=None` returns no
    logprobs; `logprobs=n` returns the sampled token's logprob plus the top-n (n may be 0).
    `prompt_logprobs=n` does the same for every prompt token after the first (vLLM's semantics);
    such a request computes the LM head on all its prompt rows and reads no prefix cache.

    `presence_penalty` and `frequency_penalty` are OpenAI's: over the tokens generated so far (the
    prompt does not count), token t's logit loses `presence_penalty * [count_t > 0] +
    frequency_penalty * count_t`; 0 switches each off. `logit_bias` holds (token id, bias) pairs,
    each bias added to that token's logit every step; ids are distinct. `generated_in_prompt` says
    that the prompt's last n ids are output the request had generated before it was re-submitted
    (a worker lost it): the penalties count them as generated, and a constraint has matched them.
    `constraint`: structured output (see `Constraint`); None: free text.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    generated_in_prompt: int = 0
    constraint: Constraint | None = None

    SEED_LIMIT: ClassVar[int] = 2**63  # seeds lie in [0, 2**63)
    MAX_LOGPROBS: ClassVar[int] = 20
    MAX_PENALTY: ClassVar[float] = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
    MAX_BIAS: ClassVar[float] = 100.0  # a logit bias lies in [-100, 100] (OpenAI's range)
    MAX_LOGIT_BIAS: ClassVar[int] = 300  # entries in one logit_bias (OpenAI's limit)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes_output(self) -> bool:
        """Whether sampling reads the counts of the tokens generated so far (presence/frequency)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

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
        if self.seed is not None and not 0 <= self.seed < self.SEED_LIMIT:
            raise ValueError(f"{n('seed')} must be in [0, 2**63), got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -self.MAX_PENALTY <= value <= self.MAX_PENALTY:
                raise ValueError(f"{n(name)} must be in [-2, 2], got {value!r}")
        self._validate_logit_bias(vocab_size, n("logit_bias"))
        if self.constraint is not None:
            self.constraint.validate(n("constraint"))
        if not 0 <= self.generated_in_prompt <= MAX_TOKENS:
            raise ValueError(
                f"{n('generated_in_prompt')} must be in [0, {MAX_TOKENS}], got {self.generated_in_prompt!r}"
            )

    def _validate_logit_bias(self, vocab_size: int, name: str) -> None:
        if len(self.logit_bias) > self.MAX_LOGIT_BIAS:
            raise ValueError(f"{name} holds {len(self.logit_bias)} entries; at most {self.MAX_LOGIT_BIAS}")
        bad = [t for t, _ in self.logit_bias if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} token ids out of vocabulary (size {vocab_size}): {bad[:8]}")
        seen: set[int] = set()
        for token, bias in self.logit_bias:
            if not -self.MAX_BIAS <= bias <= self.MAX_BIAS:
                raise ValueError(f"{name}[{token}] must be in [-100, 100], got {bias!r}")
            if token in seen:
                raise ValueError(f"{name} names token id {token} twice")
            seen.add(token)
