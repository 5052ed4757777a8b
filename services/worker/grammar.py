"""Structured output: constraints compiled with xgrammar, and each constrained request's matcher.

xgrammar (the default grammar backend of vLLM and SGLang) compiles a JSON schema, regex, EBNF grammar
or structural tag against the model's tokenizer into a grammar whose per-step token mask it fills on
the CPU in microseconds; this module is the worker's only user of it, and imports it at first use
(a worker that serves no constraint never loads it).

- `GrammarCompiler` compiles off the step loop, in a bounded thread pool, and caches compiled grammars
  (and their errors) by (kind, text) in a bounded LRU: the same schema sent by every request of an
  application compiles once. A compile cannot be interrupted, so its time limit is the waiter's:
  a request whose grammar is not ready by its deadline fails, and the compile finishes in its thread
  (its result is cached for the next request).
- `GrammarState` is one request's matcher: the mask of the tokens its next sample may take, advanced
  by each token accepted, and whether the grammar has ended.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from services.common.sampling_params import Constraint

if TYPE_CHECKING:
    import xgrammar as xgr

DEFAULT_COMPILE_TIMEOUT_S = 10.0
# xgrammar's C++ errors open with a time and a source location, which tell a client nothing.
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class GrammarError(ValueError):
    """A constraint that does not compile, or a matcher that cannot go on; the message names the field."""


def _choice_grammar(text: str) -> str:
    """An EBNF grammar whose only sentences are the choice's strings (JSON string escapes are EBNF's)."""
    choices: list[str] = json.loads(text)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _compile_timed(
    compiler: xgr.GrammarCompiler, constraint: Constraint
) -> tuple[xgr.CompiledGrammar, float]:
    """The compiled grammar and when it was ready (time.monotonic()): a result that comes after a
    request's deadline fails that request as one that did not come."""
    compiled = _compile(compiler, constraint)
    return compiled, time.monotonic()


def _compile(compiler: xgr.GrammarCompiler, constraint: Constraint) -> xgr.CompiledGrammar:
    import xgrammar as xgr

    kind, text = constraint.kind, constraint.text
    if kind == "json_schema":
        return compiler.compile_json_schema(text)
    if kind == "json_object":
        # vLLM's reading of OpenAI's json_object: any JSON object (not any JSON value).
        return compiler.compile_json_schema('{"type": "object"}')
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "ebnf":
        return compiler.compile_grammar(text)
    if kind == "choice":
        return compiler.compile_grammar(_choice_grammar(text))
    if kind == "structural_tag":
        tag = json.loads(text)
        if isinstance(tag, dict) and "structures" in tag:
            # The older format (begin, schema, end per structure, and the triggers), as vLLM reads it.
            items = [
                xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                for s in tag["structures"]
            ]
            return compiler.compile_structural_tag(items, tag["triggers"])
        return compiler.compile_structural_tag(text)
    raise ValueError(f"unknown constraint kind {kind!r}")


@dataclass
class PendingGrammar:
    """A request's grammar being compiled; it fails the request if not ready by `deadline`."""

    constraint: Constraint
    future: Future[tuple[xgr.CompiledGrammar, float]]
    deadline: float  # time.monotonic()
    timeout_s: float

    def result(self, now: float) -> xgr.CompiledGrammar | None:
        """The compiled grammar, or None while it may still come; raises GrammarError when it will not."""
        name = f"sampling.{self.constraint.kind}"
        if self.future.done():
            exc = self.future.exception()
            if exc is not None:
                message = _LOG_PREFIX.sub("", str(exc).strip())
                raise GrammarError(f"{name} does not compile: {message}")
            compiled, ready_at = self.future.result()
            if ready_at <= self.deadline:
                return compiled
        elif now < self.deadline:
            return None
        raise GrammarError(f"{name} did not compile within {self.timeout_s:g} s")


class GrammarCompiler:
    """Compiles constraints against one tokenizer, `threads` at a time, keeping `cache_size` results.

    `vocab_size` is the model's logits' width, which may exceed the tokenizer's (padded embeddings):
    the masks cover it, and the ids past the tokenizer's are never allowed."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        threads: int = 2,
        cache_size: int = 256,
    ) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        # xgrammar's own cache is off: ours keeps errors too, and is bounded by entries.
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future[tuple[xgr.CompiledGrammar, float]]] = OrderedDict()

    def submit(self, constraint: Constraint) -> PendingGrammar:
        key = (constraint.kind, constraint.text)
        future = self._cache.get(key)
        if future is None:
            future = self._pool.submit(_compile_timed, self._compiler, constraint)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return PendingGrammar(constraint, future, time.monotonic() + self.timeout_s, self.timeout_s)

    @property
    def cached(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class GrammarState:
    """One constrained request's matcher and the mask of its next token (`mask`, int32 bits over the
    vocabulary, `SamplingRow.token_bitmask`).

    `generated` are tokens it generated before (a re-submitted request's, at the end of its prompt):
    the matcher accepts them first."""

    # Seconds every matcher of the process spent accepting tokens and filling next masks, host thread
    # only: the step profile's grammar phases are their growth over a step.
    accept_s: ClassVar[float] = 0.0
    fill_s: ClassVar[float] = 0.0

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, generated: Sequence[int] = ()) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.mask: torch.Tensor = self._bitmask[0]
        for token in generated:
            error = self.advance(token)
            if error:
                raise GrammarError(error)
        if not generated:
            self._fill()

    @property
    def terminated(self) -> bool:
        """The grammar has ended (its stop token accepted): the request is complete."""
        return bool(self.matcher.is_terminated())

    def advance(self, token: int) -> str:
        """Accept a sampled token and fill the next mask; an error message when the grammar cannot go
        on ("" when it can, or has ended)."""
        t0 = time.perf_counter()
        accepted = self.matcher.accept_token(token)
        GrammarState.accept_s += time.perf_counter() - t0
        if not accepted:
            return f"the constraint rejected token {token}"
        if self.terminated:
            return ""
        if not self._fill():
            return f"the constraint admits no token after token {token}"
        return ""

    def admits_only(self, ids: Sequence[int]) -> bool:
        """Whether the next token's mask allows no token but some of `ids` (e.g. only the stop ids,
        once the grammar is complete): forbidding those would leave the sample nothing to take."""
        mask = self.mask.clone()
        for token in ids:
            if 0 <= token < self.vocab_size:
                word, bit = divmod(token, 32)
                value = int(mask[word]) & ~(1 << bit) & 0xFFFFFFFF  # as unsigned, so bit 31 clears too
                mask[word] = value - (1 << 32) if value >= 1 << 31 else value  # back to int32
        return not bool(mask.any())

    def _fill(self) -> bool:
        """Fill the mask; whether it allows any token."""
        t0 = time.perf_counter()
        self.matcher.fill_next_token_bitmask(self._bitmask, 0)
        GrammarState.fill_s += time.perf_counter() - t0
        return bool(self.mask.any())
