"""In-process engine: Scheduler + BlockManager + ModelRunner + Sampler in one loop.

The three-process service runs the same cores; this is what tests and `cbserve bench offline` drive.

    engine = Engine.from_pretrained(model, **cb)
    outs = engine.generate(prompts, max_new_tokens, ignore_eos=False, temperature=0.0, seed=None)
    engine.stats(); engine.close()
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any

import structlog
import torch
from transformers import PreTrainedModel

from services.cachemgr.block_manager import BlockManager
from services.cachemgr.pool_memory import PoolMemory, create_pool_memory
from services.cachemgr.sizing import CacheSizing, size_cache
from services.common.config import CBConfig
from services.common.kv_geometry import KVGeometry
from services.common.messages import StepGrant
from services.common.model_source import load_model
from services.worker.batch import BatchItem
from services.worker.model_runner import ModelRunner
from services.worker.request import FinishReason, Request
from services.worker.sampler import Sampler, SamplingRow
from services.worker.sampling_params import SamplingParams
from services.worker.scheduler import Scheduler, StepBatch

log = structlog.get_logger(__name__)

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
    def __init__(self, model: PreTrainedModel, config: CBConfig, tokenizer: Any = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.device = model.device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        dtype = next(model.parameters()).dtype
        self.geometry = KVGeometry.from_model_config(
            model.config, config.page_size, torch.tensor([], dtype=dtype).element_size()
        )
        self.sizing: CacheSizing = size_cache(self.geometry, model.config, config, self.device)
        self.memory: PoolMemory = create_pool_memory(
            self.geometry, self.sizing.num_chunks, self.sizing.swap_slots, dtype, self.device
        )
        self.block_manager = BlockManager(
            self.geometry,
            self.sizing.num_chunks,
            swap_slots=self.sizing.swap_slots,
            allow_block_sharing=config.allow_block_sharing,
            safety_margin=config.effective_safety_margin,
            max_step_tokens=config.max_batch_tokens,
        )
        self.runner = ModelRunner(model, self.geometry, self.memory.kv, self.memory.swap, config)
        self.scheduler = Scheduler(
            config, eos_ids_of(model), cache_budget_pages=self.sizing.max_pages_per_step
        )
        self.sampler = Sampler()
        self._ids = itertools.count()
        self.last_step_size = 0  # requests computed in the latest step (progress, for stall detection)
        log.info(
            "kv cache sized",
            **self.sizing.as_dict(),
            layers_per_chunk=self.geometry.layers_per_chunk,
            groups=self.geometry.groups,
            prefix_caching=self.block_manager.sharing,
        )

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
        req = Request(rid, prompt, params, arrival=0, priority=priority, cache_salt=cache_salt)
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

    def step(self) -> list[Request]:
        """One continuous-batching step. Returns requests that got a token or finished this step."""
        plan = self.scheduler.plan()
        grant: StepGrant = self.block_manager.step(plan)
        batch = self.scheduler.apply(grant)
        self.runner.copy_swap(batch.swap_out, batch.swap_in)
        updated: list[Request] = list(batch.failed)
        self.last_step_size = len(batch.scheduled)
        if batch.scheduled:
            sampled = self._run(batch)
            updated += self.scheduler.postprocess(batch, sampled)
        return updated

    def _run(self, batch: StepBatch) -> list[int]:
        items = [
            BatchItem(s.start, s.request.tokens(s.start, s.start + s.num_tokens), s.request.tables, s.sample)
            for s in batch.scheduled
        ]
        logits = self.runner.forward(items)
        sampling = batch.sampling
        if not sampling:
            return []
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
            self.block_manager.step(self.scheduler.plan())

    # ---------------------------------------------------------------------------------------- admin

    def stats(self) -> dict[str, Any]:
        return self.block_manager.stats_dict() | self.scheduler.counts()

    def close(self) -> None:
        for rid in list(self.scheduler.requests):
            self.abort(rid)
        self._flush_releases()
        self.memory.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
