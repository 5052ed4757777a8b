"""In-process engine: Scheduler + BlockManager + ModelRunner + Sampler in one loop.

The three-process service runs the same cores; this is what tests and `cbserve bench offline` drive.
The engine is the request API and the batch API over a `StepPipeline` (step_pipeline.py), which runs
the steps, with or without async batching.

    engine = Engine.from_pretrained(model, **cb)
    outs = engine.generate(prompts, max_new_tokens, ignore_eos=False, temperature=0.0, seed=None)
    engine.stats(); engine.close()
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import structlog
import torch
from transformers import PreTrainedModel

from services.cachemgr.kv_cache import KVCache
from services.common.cachemgr_messages import KvEvents
from services.common.config import CBConfig
from services.common.kv_geometry import KVGeometry
from services.common.kv_int8 import scale_bytes
from services.common.model_source import load_model
from services.common.precision import kv_cache_dtype
from services.common.sampling_params import SamplingParams
from services.worker.cache_client import CacheClient
from services.worker.grammar import (
    DEFAULT_COMPILE_TIMEOUT_S,
    GrammarCompiler,
    GrammarError,
    GrammarState,
    PendingGrammar,
)
from services.worker.model_runner import ModelRunner
from services.worker.request import FinishReason, Request
from services.worker.sampler import Sampler
from services.worker.scheduler import Scheduler
from services.worker.step_pipeline import StepPhases, StepPipeline

log = structlog.get_logger(__name__)

# While only grammars compile, a step waits this long for one (not a spin, and not a stall either).
GRAMMAR_POLL_S = 0.005

# A step that places nothing while requests wait can only repeat if nothing will ever free memory;
# the BlockManager rejects requests that cannot fit at all, so this many idle steps means a bug.
MAX_IDLE_STEPS = 1000


def eos_ids_of(model: PreTrainedModel) -> tuple[int, ...]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


class Engine:
    """Scheduler, model runner and sampler around a KV cache; `pipeline` runs their steps.

    `cache` is the cachemgr's surface: a `KVCache` owned here (in-process, the default) or a
    `RemoteCache` speaking to the cachemgr process. The engine closes only a cache it created.

    A constrained request (structured output) needs the `tokenizer`; it waits out of the scheduler,
    holding no block, until its grammar has compiled (`grammar_compile_timeout_s` at most), and fails
    with an error naming the constraint if it does not compile.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: CBConfig,
        tokenizer: Any = None,
        cache: CacheClient | None = None,
        *,
        grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.grammar_compile_timeout_s = grammar_compile_timeout_s
        self._grammars: GrammarCompiler | None = None  # made at the first constrained request
        # Constrained requests whose grammar is compiling, by id: not in the scheduler yet.
        self._compiling: dict[str, tuple[Request, PendingGrammar]] = {}
        self.device = model.device
        # Resolved here, where the device is known: every reader below sees True or False.
        async_batching = config.async_batching_enabled(self.device.type)
        config = replace(config, use_async_batching=async_batching)
        self.config = config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        kv_dtype = kv_cache_dtype(config, next(model.parameters()).dtype)
        self._owns_cache = cache is None
        self.cache: CacheClient = cache or KVCache(model.config, config, kv_dtype, self.device)
        expected = KVGeometry.from_model_config(
            model.config, config.page_size, kv_dtype.itemsize, scale_bytes(kv_dtype)
        )
        if self.cache.geometry != expected:
            raise ValueError(
                f"the KV cache's geometry {self.cache.geometry} does not fit this model: {expected}"
            )
        self.geometry = expected
        memory = self.cache.memory
        self.runner = ModelRunner(model, self.geometry, memory.kv, memory.swap, config)
        self.scheduler = Scheduler(
            config, eos_ids_of(model), cache_budget_pages=self.cache.sizing.max_pages_per_step
        )
        self.sampler = Sampler()
        self.pipeline = StepPipeline(
            self.scheduler,
            self.cache,
            self.runner,
            self.sampler,
            vocab_size=self.vocab_size,
            device=self.device,
            overlapped=async_batching,
        )
        self._ids = itertools.count()

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike[str] | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        **cb: Any,
    ) -> Engine:
        loaded, tokenizer = load_model(model, dtype=dtype, device=device)
        return cls(
            loaded, CBConfig.from_kwargs(**cb), tokenizer, grammar_compile_timeout_s=grammar_compile_timeout_s
        )

    # ------------------------------------------------------------------------------------- requests

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str = "",
        fork_of: str | None = None,
    ) -> Request:
        """`fork_of`: a request added before, with the same prompt, whose prompt KV this one shares (a
        sibling of an n > 1 call): computed once, its full pages held once (see `Request.fork_of`).
        Where that cannot be (the other has sampled already, or is gone), this request runs alone."""
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("empty prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt ids out of vocabulary (size {self.vocab_size}): {bad[:8]}")
        if params.generated_in_prompt > len(prompt):
            raise ValueError(
                f"generated_in_prompt must be at most the prompt's {len(prompt)} ids, "
                f"got {params.generated_in_prompt}"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt row computed, so the request may read no cached block
            # (vLLM turns prefix-cache reads off for it): a salt of its own matches no block but its
            # own, which a re-prefill after a soft reset may reuse (see `prompt_logprob_rows`).
            cache_salt = f"{cache_salt}/prompt-logprobs/{uuid.uuid4().hex}"
        req = Request(
            rid,
            prompt,
            params,
            arrival=0,
            priority=priority,
            cache_salt=cache_salt,
            arrived_at=time.monotonic(),
        )
        if params.seed is not None:
            req.generator = Sampler.make_generator(params.seed, self.device)
        if fork_of is not None:
            compiling = self._compiling.get(fork_of)
            req.fork_of = compiling[0] if compiling is not None else self.scheduler.requests.get(fork_of)
        if params.constraint is not None:
            if rid in self._compiling or rid in self.scheduler.requests:
                raise ValueError(f"duplicate request_id {rid!r}")
            if self.tokenizer is None:
                raise ValueError(
                    f"sampling.{params.constraint.kind}: a constraint (structured output) needs a tokenizer "
                    "and this model has none"
                )
            self._compiling[rid] = (req, self.grammars().submit(params.constraint))
            return req
        self.scheduler.add(req)
        return req

    def grammars(self) -> GrammarCompiler:
        """The grammar compiler, made on first use (its tokenizer info takes a while to build)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer,
                self.vocab_size,
                eos_ids_of(self.model),
                timeout_s=self.grammar_compile_timeout_s,
            )
        return self._grammars

    def _admit_compiled(self) -> list[Request]:
        """Constrained requests whose grammar is ready enter the scheduler; those whose grammar will
        not come finish with its error. Returns those finished."""
        news: list[Request] = []
        if not self._compiling:
            return news
        if not (self.scheduler.has_work or self.pipeline.in_flight):
            # Nothing else to step: wait a little for a compile rather than spin.
            futures = [pending.future for _, pending in self._compiling.values()]
            concurrent.futures.wait(futures, GRAMMAR_POLL_S, concurrent.futures.FIRST_COMPLETED)
        now = time.monotonic()
        for rid, (req, pending) in list(self._compiling.items()):
            try:
                compiled = pending.result(now)
                if compiled is None:
                    continue
                generated = req.prompt_ids[len(req.prompt_ids) - req.params.generated_in_prompt :]
                req.grammar = GrammarState(compiled, self.vocab_size, generated)
            except GrammarError as exc:
                del self._compiling[rid]
                Scheduler._finish(req, FinishReason.ERROR)
                req.error = str(exc)
                news.append(req)
                continue
            del self._compiling[rid]
            self.scheduler.add(req)
        return news

    def abort(self, request_id: str) -> Request | None:
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:
            Scheduler._finish(compiling[0], FinishReason.ABORTED)
            return compiling[0]
        return self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:
        return (
            self.scheduler.has_work
            or self.scheduler.has_releases
            or bool(self.pipeline.in_flight)
            or bool(self._compiling)
        )

    @property
    def only_pending(self) -> bool:
        """Requests to compute, none started yet, and no step in flight: nobody waits on a next token."""
        return self.scheduler.has_work and self.scheduler.all_pending and not self.pipeline.in_flight

    @property
    def in_flight(self) -> int:
        """Steps launched whose tokens the host has not taken yet."""
        return self.pipeline.in_flight

    # ------------------------------------------------------------------------------------- progress

    @property
    def last_step_size(self) -> int:
        """Requests computed in the latest step (progress, for stall detection)."""
        return self.pipeline.last_step_size

    @property
    def last_step_times(self) -> StepPhases:
        """The latest step call's profile."""
        return self.pipeline.last_step_times

    @property
    def phase_totals(self) -> StepPhases:
        """The step profile summed since start."""
        return self.pipeline.phase_totals

    @property
    def on_kv_events(self) -> Callable[[KvEvents], None] | None:
        """Told each step's prefix-cache changes (a server forwards them to routers); None: dropped."""
        return self.pipeline.on_kv_events

    @on_kv_events.setter
    def on_kv_events(self, callback: Callable[[KvEvents], None] | None) -> None:
        self.pipeline.on_kv_events = callback

    # ----------------------------------------------------------------------------------------- step

    def step(self, on_committed: Callable[[], None] | None = None) -> list[Request]:
        """One continuous-batching step. Returns requests that got a token or finished this step;
        with async batching, in the step before (see `StepPipeline.step`, and `on_committed` there)."""
        news = self._admit_compiled()
        if not (self.scheduler.has_work or self.scheduler.has_releases or self.pipeline.in_flight):
            self.pipeline.last_step_size = 0
            self.pipeline.last_step_times = StepPhases()
            if on_committed is not None:
                on_committed()
            return news
        return news + self.pipeline.step(on_committed)

    def finish_running(self, keep: int = 0) -> list[Request]:
        """Wait for the steps still computing until `keep` are left; see `StepPipeline.finish_running`."""
        return self.pipeline.finish_running(keep)

    def run_until_done(self) -> None:
        idle = 0
        while self.has_work:
            progressed = self.step() or self.last_step_size
            idle = 0 if progressed or not self.scheduler.has_work else idle + 1
            if idle > MAX_IDLE_STEPS:
                raise RuntimeError(f"no progress in {MAX_IDLE_STEPS} steps: {self.stats()}")

    # ------------------------------------------------------------------------------------ batch API

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | list[int],
        *,
        ignore_eos: bool = False,
        temperature: float = 0.0,
        seed: int | None = None,
        **sampling: Any,
    ) -> list[list[int]]:
        """Generate for every prompt; returns the new tokens of each, in prompt order.

        With `seed`, request i uses seed `seed + i`, so outputs do not depend on batch composition.
        """
        limits = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        if len(limits) != len(prompts):
            raise ValueError(f"{len(limits)} max_new_tokens for {len(prompts)} prompts")
        reqs = [
            self.add_request(
                prompt,
                SamplingParams(
                    temperature=temperature,
                    seed=None if seed is None else seed + i,
                    max_new_tokens=limit,
                    ignore_eos=ignore_eos,
                    **sampling,
                ),
            )
            for i, (prompt, limit) in enumerate(zip(prompts, limits, strict=True))
        ]
        try:
            self.run_until_done()
        except BaseException:
            for req in reqs:
                self.abort(req.request_id)
            self.finish_running()
            self._flush_releases()
            raise
        failed = [r for r in reqs if r.finish_reason is FinishReason.ERROR]
        if failed:
            raise ValueError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return [r.output_ids for r in reqs]

    def _flush_releases(self) -> None:
        if self.scheduler.has_releases and not self.scheduler.has_work:
            self.cache.step(self.scheduler.plan())

    # ---------------------------------------------------------------------------------------- admin

    def stats(self) -> dict[str, Any]:
        counts = self.scheduler.counts()
        # A request whose grammar compiles waits too, outside the scheduler (it holds no block yet):
        # a load balancer reading `waiting` must see it, or a worker compiling looks idle.
        counts["waiting"] += len(self._compiling)
        return self.cache.stats() | counts | {"computed_tokens": self.phase_totals.num_tokens}

    def close(self) -> None:
        for rid in [*self._compiling, *self.scheduler.requests]:
            self.abort(rid)
        if self._grammars is not None:
            self._grammars.close()
        try:
            self.finish_running()  # its forward writes the pool: done before the pool goes
            self._flush_releases()
        finally:
            self.pipeline.close()
            if self._owns_cache:
                self.cache.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
