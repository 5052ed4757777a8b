"""The step pipeline: one continuous-batching step from plan to tokens, and async batching's overlap
of one step's forward with the host's work on the next.

A step runs through, in this order:
1. *plan* (`Scheduler.plan`): which requests compute how many tokens;
2. *grant* (the cachemgr's `step`): their block tables and swap copies; taking the plan commits the
   KV the step before computed (its full pages enter the prefix cache), or with async batching the
   KV of the step before that;
3. *apply* (`Scheduler.apply`): the scheduler's view of the grant, a `StepBatch`;
4. *build* (`ModelRunner.build`): the `ForwardBatch`;
5. *launch*: the swap copies, the forward and the sampling (`_compute`), here and now or on the
   forward thread;
6. *finish* (`finish_running`): the sampled tokens given to their requests (`Scheduler.postprocess`).

Invariants:
- A step owns its `StepBatch` (the requests scheduled, the tables granted, the swap copies), its
  built batch and the future of its forward. Launched, it is *in flight* until it is finished;
  steps finish oldest first. Between calls none is in flight without async batching, at most one
  with it (the one computing), and during a call at most two.
- Only the host thread touches requests, the scheduler and the cache. The forward thread reads what
  the launch handed it, and writes only the KV and swap pools and the sampling state handed to it
  (seeded requests' generators, the output counts of presence and frequency penalties), in launch
  order.
- Tokens become visible only when their step finishes: then, in step order, each request gets its
  token, logprobs and prompt logprobs, and the scheduler decides whether it finished. Until then a
  step's sampled tokens are placeholders. A request finished or aborted meanwhile takes nothing.
- Without async batching a step finishes in the call that launched it, which returns its news.
- With async batching, a call launches step N+1 before it finishes step N, and returns N's news:
  the host's copy of the tokens, the logprobs and the finish checks wait one step, the cachemgr's
  commit of a step's KV one plan more (`StepPlan.overlapped`). N+1's placeholders are filled on the
  device from N's sampled tokens. A step whose sampling reads the tokens before it on the host (a
  repetition penalty; a grammar's mask while min_tokens holds its end back) finishes N first.
- A constrained request's next mask is made on the host from the token before, by its matcher: then
  N+1's forward runs while the host finishes N (its matchers take N's tokens and fill the masks), and
  N+1's sampling waits for that (`_Running.masks_ready`), as SGLang's overlap scheduler does.
- A failed forward fails every step launched behind it (they take their tokens from it); the first
  error is raised, and nothing is left in flight.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from services.common.cachemgr_messages import KvEvents, StepGrant
from services.worker.batch import BatchItem, ForwardBatch
from services.worker.cache_client import CacheClient
from services.worker.grammar import GrammarState
from services.worker.model_runner import ModelRunner
from services.worker.request import Request
from services.worker.sampler import SampleOutput, Sampler, SamplingRow, TokenLogprobs, token_logprobs
from services.worker.scheduler import Scheduler, StepBatch


@dataclass
class StepPhases:
    """Seconds one step spent in each phase; `schedule` covers the scheduler's plan, apply and
    postprocess, `cache` the cachemgr's step (a round trip when it is another process).

    With async batching `forward` and `sample` (and the counts) are those of the step that ended in
    this call, on the forward thread, overlapping the others; `wait` is how long the host then waited
    for them: the part of them the overlap did not hide. Of `schedule`, constrained requests'
    matchers took `grammar_advance` accepting the tokens sampled and `grammar_fill` filling the next
    masks; `grammar_apply` is the part of `sample` that applied the
    masks to the logits."""

    schedule: float = 0.0
    cache: float = 0.0
    build: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    wait: float = 0.0
    num_tokens: int = 0
    num_requests: int = 0
    grammar_advance: float = 0.0
    grammar_fill: float = 0.0
    grammar_apply: float = 0.0

    PHASES = ("schedule", "cache", "build", "forward", "sample", "wait")
    GRAMMAR = ("grammar_advance", "grammar_fill", "grammar_apply")

    def rest_of(self, wall_s: float, overlapped: bool) -> float:
        """The schedule phase: what of a step call's `wall_s` no other phase took. Overlapped (async
        batching), the forward and sampling ran on their own thread, outside the call's time."""
        ran_here = 0.0 if overlapped else self.forward + self.sample
        return wall_s - self.cache - self.build - self.wait - ran_here

    def add(self, other: StepPhases) -> None:
        for name in (*self.PHASES, "num_tokens", "num_requests", *self.GRAMMAR):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class _Computed:
    """What a step's forward thread hands back. `sampled.tokens` stays on the device for the next
    step's placeholders; `host_tokens` is their copy on the host, complete once `copied` has
    happened (a CUDA event; None: already)."""

    sampled: SampleOutput
    host_tokens: torch.Tensor
    copied: torch.cuda.Event | None
    prompt_logprobs: list[TokenLogprobs]
    forward_s: float
    sample_s: float


@dataclass
class _Built:
    """A step's batch, built."""

    batch: StepBatch
    items: list[BatchItem]
    forward: ForwardBatch


@dataclass
class _Running:
    """A step whose forward has started. `masks_ready`: set once its constrained rows' masks are
    filled (the host finishing the step before); its sampling waits for it."""

    built: _Built
    result: Future[_Computed]
    masks_ready: threading.Event


class StepPipeline:
    """Steps from plan to tokens over a scheduler, a cache, a model runner and a sampler (see the
    module docstring for what a step owns and when its tokens become visible).

    `overlapped`: async batching, each step's forward and sampling on one forward thread of their own.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        cache: CacheClient,
        runner: ModelRunner,
        sampler: Sampler,
        *,
        vocab_size: int,
        device: torch.device,
        overlapped: bool,
    ) -> None:
        self.scheduler = scheduler
        self.cache = cache
        self.runner = runner
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.device = device
        self.last_step_size = 0  # requests computed in the latest step (progress, for stall detection)
        self.last_step_times = StepPhases()
        self.phase_totals = StepPhases()  # since start: the step profile summed
        # Told each step's prefix-cache changes (a server forwards them to routers); None: dropped.
        self.on_kv_events: Callable[[KvEvents], None] | None = None
        # Steps whose tokens are not taken yet, oldest first: with async batching at most two, the
        # one computing and, briefly, the one launched after it.
        self._in_flight: deque[_Running] = deque()
        # One thread: the forwards run one after another, each after the swap copies it depends on.
        self._forward_thread = ThreadPoolExecutor(1, thread_name_prefix="forward") if overlapped else None

    @property
    def in_flight(self) -> int:
        """Steps launched whose tokens the host has not taken yet."""
        return len(self._in_flight)

    def step(self, on_committed: Callable[[], None] | None = None) -> list[Request]:
        """One continuous-batching step. Returns requests that got a token or finished this step.

        With async batching (`use_async_batching`) a step's forward and sampling run on a thread of
        their own while the next call plans the step after it, takes its grant and builds its batch;
        the tokens it samples are placeholders until then. A call then returns the previous step's
        news. The next step is launched before the host has them: the forward thread fills its
        placeholders from the tokens left on the device, so that forwards follow one another with
        no host round trip between them. A step that samples with a repetition penalty reads the
        tokens on the host, and waits for them; presence and frequency penalties read counts that
        the sampler keeps on the device, and do not.

        `on_committed` runs once the cache manager has taken this step's plan, which commits the KV
        the previous step computed (its full pages enter the prefix cache); with async batching, the
        step before that. A server streams the news of the previous call from there: should this
        process die, whatever a client has seen is cached, and a re-submission recomputes at most one
        partial page. It runs after this step's batch is built, just before its forward: the
        processes that news wakes (a gateway, its clients) would otherwise take the cores from the
        build and slow it several times over."""
        times = self.last_step_times = StepPhases()
        t0, accept_s, fill_s = time.perf_counter(), GrammarState.accept_s, GrammarState.fill_s
        previous = self._in_flight[-1] if self._in_flight else None
        plan = self.scheduler.plan(previous.built.batch if previous is not None else None)
        t1 = time.perf_counter()
        grant: StepGrant = self.cache.step(plan)
        t2 = time.perf_counter()
        if grant.kv_events is not None and self.on_kv_events is not None:
            self.on_kv_events(grant.kv_events)
        batch = self.scheduler.apply(grant)
        updated: list[Request] = list(batch.failed)
        self.last_step_size = len(batch.scheduled)
        for s in batch.scheduled:
            if s.request.scheduled_at is None:
                s.request.scheduled_at = t2
        t4 = time.perf_counter()
        built = self._build(batch, previous) if batch.scheduled else None
        t5 = time.perf_counter()
        if on_committed is not None:
            on_committed()  # the caller's work: no phase of this step counts it
        callers_s = time.perf_counter() - t5
        times.cache, times.build = t2 - t1, t5 - t4
        if built is None or not self._starts_before_tokens(batch):
            updated += self.finish_running()
        launched = None
        if built is None:
            self.runner.copy_swap(batch.swap_out, batch.swap_in)
        else:
            launched = self._launch(built, previous)
        try:
            updated += self.finish_running(keep=0 if self._forward_thread is None else 1)
        finally:
            if launched is not None:
                launched.masks_ready.set()  # the matchers took every token before
        times.grammar_advance = GrammarState.accept_s - accept_s
        times.grammar_fill = GrammarState.fill_s - fill_s
        times.schedule = times.rest_of(time.perf_counter() - t0 - callers_s, self._forward_thread is not None)
        self.phase_totals.add(times)
        return updated

    def _build(self, batch: StepBatch, before: _Running | None) -> _Built:
        """`before`: the step still computing. An input id not known yet is the token it samples for
        that request (it samples one per request): a placeholder the forward takes on the device."""
        items = [
            BatchItem(
                s.start,
                s.request.tokens(s.start, s.start + s.num_tokens),
                s.request.tables,
                s.sample,
                s.request.prompt_logprob_rows(s.start, s.start + s.num_tokens),
            )
            for s in batch.computed
        ]
        source = (
            {} if before is None else {id(s.request): i for i, s in enumerate(before.built.batch.sampling)}
        )
        fill = []
        row = 0
        for s in batch.computed:
            req = s.request
            if s.start + s.num_tokens > req.num_known:
                if s.start + s.num_tokens != req.num_known + 1 or id(req) not in source:
                    raise RuntimeError(
                        f"{req.request_id}: positions {s.start}..{s.start + s.num_tokens} planned, "
                        f"{req.num_known} known, and the step computing samples the next one: "
                        f"{id(req) in source}"
                    )
                fill.append((row + req.num_known - s.start, source[id(req)]))
            row += s.num_tokens
        return _Built(batch, items, self.runner.build(items, fill))

    @staticmethod
    def _starts_before_tokens(batch: StepBatch) -> bool:
        """Whether the step may start before the host has the tokens of the step before: a repetition
        penalty reads them on the host, and so does min_tokens on a constrained request (whether its
        grammar admits only its end decides what it suppresses, `Scheduler.suppressed_ids`). A grammar's
        mask alone is waited for by the sampling only."""
        return all(
            s.request.params.repetition_penalty == 1.0
            and (s.request.grammar is None or len(s.request.output_ids) >= s.request.params.min_new_tokens)
            for s in batch.sampling
        )

    def _output_counts(self, req: Request) -> torch.Tensor | None:
        """A request's generated-token counts for presence/frequency penalties (None without them).

        Made at its first sampling step, from the tokens known then (a re-submitted request's
        include the output at the end of its prompt); from there on only the sampler
        changes them, in the step order of the forward thread, so that each step reads the counts of
        every token sampled before it, known to the host or not."""
        if not req.params.penalizes_output:
            return None
        if req.output_counts is None:
            if req.num_placeholders != 1:
                raise RuntimeError(
                    f"{req.request_id}: first penalized sampling step with {req.num_placeholders} tokens "
                    "still sampling: their counts would be lost"
                )
            generated = (
                req.prompt_ids[len(req.prompt_ids) - req.params.generated_in_prompt :] + req.output_ids
            )
            req.output_counts = Sampler.make_output_counts(self.vocab_size, generated, self.device)
        return req.output_counts

    def _launch(self, step: _Built, before: _Running | None) -> _Running:
        """Start the step's forward, after its swap copies: in the forward thread with async batching,
        else here and now. `before`: the step its placeholders take their tokens from."""
        sampling = step.batch.sampling
        rows = [
            SamplingRow(
                params=s.request.params,
                generator=s.request.generator,
                token_ids=s.request.prompt_ids + s.request.output_ids
                if s.request.params.repetition_penalty != 1.0
                else (),
                suppress_ids=self.scheduler.suppressed_ids(s.request),
                output_counts=self._output_counts(s.request),
                token_bitmask=s.request.grammar.mask
                if s.request.grammar is not None and not s.request.finished
                else None,
            )
            for s in sampling
        ]
        chosen: list[int] = []  # prompt logprobs: position i's logits score token i + 1
        top_n: list[int] = []
        for s, item in zip(step.batch.computed, step.items, strict=True):
            chosen += s.request.prompt_ids[item.logit_rows.start + 1 : item.logit_rows.stop + 1]
            top_n += [min(s.request.params.prompt_logprobs or 0, self.vocab_size)] * len(item.logit_rows)
        batch = step.batch
        source = before.result if before is not None else None
        # Set at once unless the step before may still give a constrained row of this one its token.
        masks_ready = threading.Event()
        if before is None or not any(row.token_bitmask is not None for row in rows):
            masks_ready.set()
        args = (step.forward, batch, source, masks_ready, rows, batch.logits_rows(), chosen, top_n)
        if self._forward_thread is None:
            result: Future[_Computed] = Future()
            result.set_result(self._compute(*args))
        else:
            result = self._forward_thread.submit(self._compute, *args)
        running = _Running(step, result, masks_ready)
        self._in_flight.append(running)
        return running

    def _compute(
        self,
        built: ForwardBatch,
        batch: StepBatch,
        before: Future[_Computed] | None,
        masks_ready: threading.Event,
        rows: list[SamplingRow],
        logits_rows: list[int],
        chosen: list[int],
        top_n: list[int],
    ) -> _Computed:
        """The swap copies, the forward, the forks' page copies and the sampling of one step; reads of
        `batch` only its copies, and touches no request (another thread may be
        planning the next step). The swap copies wait for the step before: it may still write the KV
        of the requests moved. `before`: that step, when this one's placeholders take its tokens on
        the device; this thread computed it, so its result is there (or its error, raised again).
        The sampling waits for `masks_ready`: the host fills constrained rows' masks meanwhile."""
        t0 = time.perf_counter()
        self.runner.copy_swap(batch.swap_out, batch.swap_in)
        tokens = before.result().sampled.tokens if before is not None else None
        logits = self.runner.forward(built, tokens)
        self.runner.copy_pages(batch.page_copies)
        t1 = time.perf_counter()
        waited = 0.0
        computed_rows = len(set(logits_rows))
        prompt_logprobs = []
        if chosen:
            prompt_logprobs = token_logprobs(
                logits[computed_rows:], torch.tensor(chosen, device=logits.device), top_n
            )
        if rows:
            sample_logits = logits[:computed_rows]
            if len(logits_rows) > computed_rows:  # forks: each samples its parent's row on its own
                sample_logits = sample_logits[torch.tensor(logits_rows, device=logits.device)]
            t2 = time.perf_counter()
            masks_ready.wait()
            waited = time.perf_counter() - t2
            sampled = self.sampler.sample(sample_logits, rows)
        else:
            sampled = SampleOutput(torch.empty(0, dtype=torch.long, device=logits.device), [])
        host_tokens, copied = sampled.tokens, None
        if host_tokens.is_cuda:
            # Queued before the next step's forward, so that the host waits for this step alone.
            host_tokens = torch.empty(host_tokens.shape, dtype=host_tokens.dtype, pin_memory=True)
            host_tokens.copy_(sampled.tokens, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return _Computed(
            sampled,
            host_tokens,
            copied,
            prompt_logprobs,
            t1 - t0,
            time.perf_counter() - t1 - waited,
        )

    def finish_running(self, keep: int = 0) -> list[Request]:
        """Wait for the steps still computing, oldest first, until `keep` are left, and give their
        tokens to requests not finished meanwhile. Returns the requests that got a token or finished."""
        updated = []
        while len(self._in_flight) > keep:
            try:
                updated += self._finish_oldest()
            except Exception:
                # The steps launched behind the failed one take their tokens from it: they fail alike.
                for running in self._in_flight:
                    running.masks_ready.set()  # their masks will not be filled: let them end
                    running.result.exception()  # waited for; the first error is the one to raise
                self._in_flight.clear()
                raise
        return updated

    def _finish_oldest(self) -> list[Request]:
        running = self._in_flight[0]
        t0 = time.perf_counter()
        try:
            computed = running.result.result()
            if computed.copied is not None:
                computed.copied.synchronize()
        finally:
            if running.result.done():  # else interrupted: the forward still runs, and stays waited for
                self._in_flight.popleft()
        times = self.last_step_times
        times.wait += time.perf_counter() - t0
        times.forward, times.sample = computed.forward_s, computed.sample_s
        times.grammar_apply = computed.sampled.mask_s
        batch = running.built.batch
        times.num_tokens = sum(s.num_tokens for s in batch.scheduled)
        times.num_requests = len(batch.scheduled)
        lps = iter(computed.prompt_logprobs)
        for s, item in zip(batch.computed, running.built.items, strict=True):
            taken = list(itertools.islice(lps, len(item.logit_rows)))
            if not s.request.finished:
                s.request.prompt_logprobs += taken
        for s, lp in zip(batch.sampling, computed.sampled.logprobs, strict=True):
            if s.request.params.logprobs is not None and not s.request.finished:
                s.request.logprobs.append(lp)
        return self.scheduler.postprocess(batch, computed.host_tokens.tolist())

    def close(self) -> None:
        """Stop the forward thread; the caller has finished every step first (`finish_running`)."""
        if self._forward_thread is not None:
            self._forward_thread.shutdown()
