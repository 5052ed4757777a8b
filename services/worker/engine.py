"""In-process engine: Scheduler + BlockManager + ModelRunner + Sampler in one loop.

The three-process service runs the same cores; this is what tests and `cbserve bench offline` drive.

    engine = Engine.from_pretrained(model, **cb)
    outs = engine.generate(prompts, max_new_tokens, ignore_eos=False, temperature=0.0, seed=None)
    engine.stats(); engine.close()
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch
from transformers import PreTrainedModel

from services.cachemgr.kv_cache import KVCache
from services.common.config import CBConfig
from services.common.kv_geometry import KVGeometry
from services.common.messages import KvEvents, StepGrant
from services.common.model_source import load_model
from services.common.sampling_params import SamplingParams
from services.worker.batch import BatchItem
from services.worker.cache_client import CacheClient
from services.worker.model_runner import ModelRunner
from services.worker.request import FinishReason, Request
from services.worker.sampler import Sampler, SamplingRow, token_logprobs
from services.worker.scheduler import Scheduled, Scheduler, StepBatch

log = structlog.get_logger(__name__)

# A step that places nothing while requests wait can only repeat if nothing will ever free memory;
# the BlockManager rejects requests that cannot fit at all, so this many idle steps means a bug.
MAX_IDLE_STEPS = 1000


@dataclass
class StepPhases:
    """Seconds one step spent in each phase; `schedule` covers the scheduler's plan, apply and
    postprocess, `cache` the cachemgr's step (a round trip when it is another process)."""

    schedule: float = 0.0
    cache: float = 0.0
    build: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    num_tokens: int = 0
    num_requests: int = 0

    PHASES = ("schedule", "cache", "build", "forward", "sample")

    def add(self, other: StepPhases) -> None:
        for name in (*self.PHASES, "num_tokens", "num_requests"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


def eos_ids_of(model: PreTrainedModel) -> tuple[int, ...]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


class Engine:
    """Scheduler, model runner and sampler around a KV cache.

    `cache` is the cachemgr's surface: a `KVCache` owned here (in-process, the default) or a
    `RemoteCache` speaking to the cachemgr process. The engine closes only a cache it created.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        config: CBConfig,
        tokenizer: Any = None,
        cache: CacheClient | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = model.device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        dtype = next(model.parameters()).dtype
        self._owns_cache = cache is None
        self.cache: CacheClient = cache or KVCache(model.config, config, dtype, self.device)
        expected = KVGeometry.from_model_config(model.config, config.page_size, dtype.itemsize)
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
        self._ids = itertools.count()
        self.last_step_size = 0  # requests computed in the latest step (progress, for stall detection)
        self.last_step_times = StepPhases()
        self.phase_totals = StepPhases()  # since start: the step profile summed
        # Told each step's prefix-cache changes (a server forwards them to routers); None: dropped.
        self.on_kv_events: Callable[[KvEvents], None] | None = None

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike[str] | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        **cb: Any,
    ) -> Engine:
        loaded, tokenizer = load_model(model, dtype=dtype, device=device)
        return cls(loaded, CBConfig.from_kwargs(**cb), tokenizer)

    # ------------------------------------------------------------------------------------- requests

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str = "",
    ) -> Request:
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("empty prompt")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt ids out of vocabulary (size {self.vocab_size}): {bad[:8]}")
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
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> Request | None:
        return self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self.scheduler.has_releases

    # ----------------------------------------------------------------------------------------- step

    def step(self, on_committed: Callable[[], None] | None = None) -> list[Request]:
        """One continuous-batching step. Returns requests that got a token or finished this step.

        `on_committed` runs once the cache manager has taken this step's plan, which commits the KV
        the previous step computed (its full pages enter the prefix cache). A server streams the
        previous step's tokens from there: should this process die, whatever a client has seen is
        cached, and a re-submission recomputes at most one partial page."""
        times = self.last_step_times = StepPhases()
        t0 = time.perf_counter()
        plan = self.scheduler.plan()
        t1 = time.perf_counter()
        grant: StepGrant = self.cache.step(plan)
        t2 = time.perf_counter()
        if grant.kv_events is not None and self.on_kv_events is not None:
            self.on_kv_events(grant.kv_events)
        if on_committed is not None:
            on_committed()  # the caller's work: no phase of this step counts it
        t3 = time.perf_counter()
        batch = self.scheduler.apply(grant)
        self.runner.copy_swap(batch.swap_out, batch.swap_in)
        times.schedule, times.cache = t1 - t0, t2 - t1
        updated: list[Request] = list(batch.failed)
        self.last_step_size = len(batch.scheduled)
        for s in batch.scheduled:
            if s.request.scheduled_at is None:
                s.request.scheduled_at = t2
        if batch.scheduled:
            sampled = self._run(batch, times)
            updated += self.scheduler.postprocess(batch, sampled)
            times.num_tokens = sum(s.num_tokens for s in batch.scheduled)
            times.num_requests = len(batch.scheduled)
        times.schedule += time.perf_counter() - t3 - times.build - times.forward - times.sample
        self.phase_totals.add(times)
        return updated

    def _run(self, batch: StepBatch, times: StepPhases) -> list[int]:
        t0 = time.perf_counter()
        items = [
            BatchItem(
                s.start,
                s.request.tokens(s.start, s.start + s.num_tokens),
                s.request.tables,
                s.sample,
                s.request.prompt_logprob_rows(s.start, s.start + s.num_tokens),
            )
            for s in batch.scheduled
        ]
        built = self.runner.build(items)
        t1 = time.perf_counter()
        logits = self.runner.forward(built)
        t2 = time.perf_counter()
        times.build, times.forward = t1 - t0, t2 - t1
        sampling = batch.sampling
        self._take_prompt_logprobs(logits[len(sampling) :], batch.scheduled, items)
        token_ids: list[int] = []
        if sampling:
            token_ids = self._sample(logits[: len(sampling)], sampling)
        times.sample = time.perf_counter() - t2
        return token_ids

    def _sample(self, logits: torch.Tensor, sampling: list[Scheduled]) -> list[int]:
        rows = [
            SamplingRow(
                params=s.request.params,
                generator=s.request.generator,
                token_ids=s.request.prompt_ids + s.request.output_ids
                if s.request.params.repetition_penalty != 1.0
                else (),
                suppress_ids=self.scheduler.suppressed_ids(s.request),
            )
            for s in sampling
        ]
        out = self.sampler.sample(logits, rows)
        for s, lp in zip(sampling, out.logprobs, strict=True):
            if s.request.params.logprobs is not None:
                s.request.logprobs.append(lp)
        return out.token_ids

    def _take_prompt_logprobs(
        self, logits: torch.Tensor, scheduled: list[Scheduled], items: list[BatchItem]
    ) -> None:
        """Append the prompt logprobs of the rows past the sampling ones (`items`' `logit_rows`)."""
        if not logits.shape[0]:
            return
        chosen: list[int] = []
        top_n: list[int] = []
        for s, item in zip(scheduled, items, strict=True):
            rows = item.logit_rows  # position i's logits score token i + 1
            chosen += s.request.prompt_ids[rows.start + 1 : rows.stop + 1]
            top_n += [min(s.request.params.prompt_logprobs or 0, self.vocab_size)] * len(item.logit_rows)
        lps = iter(token_logprobs(logits, torch.tensor(chosen, device=logits.device), top_n))
        for s, item in zip(scheduled, items, strict=True):
            s.request.prompt_logprobs += itertools.islice(lps, len(item.logit_rows))

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
        return self.cache.stats() | self.scheduler.counts()

    def close(self) -> None:
        for rid in list(self.scheduler.requests):
            self.abort(rid)
        self._flush_releases()
        if self._owns_cache:
            self.cache.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
