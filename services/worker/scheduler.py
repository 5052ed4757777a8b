"""Scheduler: the worker's pure policy core (no I/O, no tensors).

Per step: `plan()` orders candidates by policy and gives each the tokens it would compute under
`max_batch_tokens`, `long_prefill_token_threshold` (per request) and `max_requests_per_batch`; the
BlockManager answers which ones got blocks; `apply(grant)` turns the answer into the step's batch;
`postprocess` appends sampled tokens and decides which requests finished. Finished and aborted
requests are released in the next plan, before anything is allocated. A request not admitted yet is
planned whole (up to the threshold): only the BlockManager knows its prefix hit, and it trims
admissions to what the step's token budget leaves, so that a hit's unneeded tokens go to the next
admission instead of idling (see `PlanEntry`).

Async batching plans step N+1 between N's `apply` and its `postprocess` (`plan(running=N)`): a request
N samples for plans its next token as a placeholder, and one N completes (length limit) is not planned
again. A request N+1 computes but that N finished (a stop id) wastes that token; `postprocess` drops
every token of a request finished (or aborted) meanwhile.

A request may *fork* from a sibling (n > 1, `Request.fork_of`): it is planned right behind its
parent in the step where the parent's prompt ends, asks for no token, and samples from the parent's
logits row; the cachemgr gives it the parent's pages (`PlanEntry.fork_of`). Should that step pass it
over, the fork is given up and it is planned as a request of its own.

Policies (higher `priority` first within each class, ties by arrival):
- `fifo`: running decodes, running prefills, offloaded (restores), then pending;
- `prefill_first`: running prefills, running decodes, offloaded, then pending.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.common.cachemgr_messages import PlanEntry, StepGrant, StepPlan
from services.common.config import CBConfig
from services.worker.request import FinishReason, Request, RequestStatus

_CLASS_ORDER = {
    "fifo": (
        RequestStatus.DECODING,
        RequestStatus.PREFILLING,
        RequestStatus.OFFLOADED,
        RequestStatus.PENDING,
    ),
    "prefill_first": (
        RequestStatus.PREFILLING,
        RequestStatus.DECODING,
        RequestStatus.OFFLOADED,
        RequestStatus.PENDING,
    ),
}


@dataclass(frozen=True)
class Scheduled:
    """Request `request` computes tokens `[start, start + num_tokens)` this step; with `sample`, that
    reaches its last token, whose logits sample the next one. A fork computes nothing and samples
    from the logits of `fork_of`, scheduled before it in the same step."""

    request: Request
    start: int
    num_tokens: int
    sample: bool
    fork_of: Request | None = None


@dataclass
class StepBatch:
    step: int
    scheduled: list[Scheduled]
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    page_copies: list[tuple[int, int]] = field(default_factory=list)  # forks' last pages, after the forward
    failed: list[Request] = field(default_factory=list)  # rejected by the cache manager

    @property
    def sampling(self) -> list[Scheduled]:
        """The rows that sample, forks included, in batch order: one token each."""
        return [s for s in self.scheduled if s.sample]

    @property
    def computed(self) -> list[Scheduled]:
        """The rows the forward computes (every one but the forks)."""
        return [s for s in self.scheduled if s.num_tokens]

    def logits_rows(self) -> list[int]:
        """For each sampling row, its row of the forward's logits (one per computed row that samples,
        in order): a fork's is its parent's."""
        row_of: dict[int, int] = {}
        rows = []
        for s in self.sampling:
            if s.fork_of is None:
                row_of[id(s.request)] = len(row_of)
            rows.append(row_of[id(s.fork_of if s.fork_of is not None else s.request)])
        return rows


class Scheduler:
    def __init__(
        self, config: CBConfig, eos_token_ids: Iterable[int] = (), cache_budget_pages: int | None = None
    ) -> None:
        """`cache_budget_pages` bounds the KV pages attention gathers in one step (None: unbounded)."""
        self.config = config
        self.cache_budget_pages = cache_budget_pages
        self.order = {status: i for i, status in enumerate(_CLASS_ORDER[config.scheduler_type])}
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._steps = itertools.count()
        self._frees: list[str] = []
        self._aborts: list[str] = []
        self._forks: dict[str, list[Request]] = {}  # by parent id: the requests waiting to fork from it

    # ------------------------------------------------------------------------------- request intake

    def add(self, request: Request) -> None:
        """A request with `fork_of` forks only from a parent here that has not sampled yet, with the
        same prompt and cache salt; otherwise it runs on its own."""
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request_id {request.request_id!r}")
        request.arrival = next(self._arrivals)
        parent = request.fork_of
        if parent is not None and not (
            self.requests.get(parent.request_id) is parent
            and parent.fork_of is None
            and not self._has_sampled(parent)
            and parent.prompt_ids == request.prompt_ids
            and parent.cache_salt == request.cache_salt
        ):
            request.fork_of = None
        self.requests[request.request_id] = request
        if request.fork_of is not None:
            self._forks.setdefault(request.fork_of.request_id, []).append(request)

    @staticmethod
    def _has_sampled(req: Request) -> bool:
        return bool(req.output_ids or req.num_placeholders or req.finished)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request in any state; its blocks are released with the next plan."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.num_sent:
            self._aborts.append(request_id)
        self._finish(req, FinishReason.ABORTED)
        return req

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    @property
    def all_pending(self) -> bool:
        """Whether no request has started (none prefilling, decoding or offloaded), so that a step put
        off for more arrivals delays nobody's next token."""
        return all(r.status is RequestStatus.PENDING for r in self.requests.values())

    @property
    def has_releases(self) -> bool:
        return bool(self._frees or self._aborts)

    def counts(self) -> dict[str, int]:
        running = sum(1 for r in self.requests.values() if r.is_active)
        return {"running": running, "waiting": len(self.requests) - running}

    # -------------------------------------------------------------------------------------- planning

    def plan(self, running: StepBatch | None = None) -> StepPlan:
        """`running`: the batch still computing (async batching), whose samples are placeholders."""
        cfg = self.config
        tokens_left = cfg.max_batch_tokens
        rows_left = cfg.max_requests_per_batch
        pages_left = self.cache_budget_pages if self.cache_budget_pages is not None else float("inf")
        busy = {s.request.request_id for s in running.scheduled} if running is not None else set()
        entries = []
        self._give_up_forks()
        for req in sorted(self.requests.values(), key=self._policy_key):
            if tokens_left == 0:
                break
            if req.fork_of is not None:
                continue  # planned behind its parent
            if (
                req.num_placeholders
                and len(req.output_ids) + req.num_placeholders >= req.params.max_new_tokens
            ):
                continue  # the running step samples its last token
            n = min(req.num_remaining, cfg.long_prefill_token_threshold or req.num_remaining)
            owed = req.prompt_logprobs_owed
            if owed and req.request_id in busy:
                continue  # its chunk's rows are taken only when the running step ends
            if owed:
                # Each prompt position it computes is a row of logits, and the logits memory was sized
                # for `max_requests_per_batch` rows: the rows left bound its chunk.
                n = min(n, rows_left)
                if n == 0:
                    continue
            if req.status is RequestStatus.PENDING and not owed and rows_left:
                # Its prefix hit, which only the cachemgr knows, may leave it far fewer tokens than
                # planned; the cachemgr trims admissions to `token_budget`, so plan it whole, hold its
                # logits row, and count only the tokens that no hit can spare.
                samples, charge = True, min(n, tokens_left, self._least_admission(req))
            else:
                n = min(n, tokens_left)
                samples = n == req.num_remaining
                if samples and rows_left == 0:
                    continue  # a chunk that stops short of sampling needs no logits row
                charge = n
            # A pending request's chunk may move forward by a prefix hit: budget its whole length.
            reach = req.num_tokens if req.status is RequestStatus.PENDING else req.num_computed + n
            pages = -(-reach // cfg.page_size)
            if pages > pages_left:
                continue
            pages_left -= pages
            tokens_left -= charge
            rows_left -= min(n, owed) + samples
            entries.append(
                PlanEntry(
                    request_id=req.request_id,
                    num_tokens=n,
                    new_token_ids=req.tokens(req.num_sent, req.num_known),
                    arrival=req.arrival,
                    cache_salt=req.cache_salt,
                    max_total_tokens=len(req.prompt_ids) + req.params.max_new_tokens,
                    num_placeholders=req.num_placeholders,
                    may_sample=samples,
                )
            )
            req.num_sent = req.num_known
            if samples:
                rows_left = self._plan_forks(req, entries, rows_left)
        plan = StepPlan(
            step=next(self._steps),
            entries=entries,
            frees=self._frees,
            aborts=self._aborts,
            overlapped=running is not None,
            token_budget=cfg.max_batch_tokens,
        )
        self._frees, self._aborts = [], []
        return plan

    def _plan_forks(self, parent: Request, entries: list[PlanEntry], rows_left: int) -> int:
        """Plan the forks of `parent`, whose entry was just planned to sample, behind it (a logits row
        each); returns the rows left."""
        for child in self._forks.get(parent.request_id, ()):
            if rows_left == 0:
                break
            rows_left -= 1
            entries.append(
                PlanEntry(
                    request_id=child.request_id,
                    num_tokens=0,
                    new_token_ids=child.prompt_ids,
                    arrival=child.arrival,
                    cache_salt=child.cache_salt,
                    max_total_tokens=len(child.prompt_ids) + child.params.max_new_tokens,
                    fork_of=parent.request_id,
                )
            )
        return rows_left

    def _give_up_forks(self) -> None:
        """Forks whose parent is gone or has sampled run on their own from now on (the cachemgr knows
        nothing of them: their fork entries were passed over)."""
        for parent_id, children in list(self._forks.items()):
            parent = self.requests.get(parent_id)
            live = [c for c in children if not c.finished]
            if parent is None or self._has_sampled(parent) or not live:
                for child in live:
                    child.fork_of = None
                del self._forks[parent_id]
            else:
                self._forks[parent_id] = live

    def _least_admission(self, req: Request) -> int:
        """The fewest tokens an admission can compute: a prefix hit is whole pages and leaves at least
        the last token (its logits are needed)."""
        if not self.config.allow_block_sharing:
            return req.num_remaining
        return req.num_tokens - (req.num_tokens - 1) // self.config.page_size * self.config.page_size

    def _policy_key(self, req: Request) -> tuple[int, int, int]:
        return (self.order[req.status], -req.priority, req.arrival)

    def apply(self, grant: StepGrant) -> StepBatch:
        batch = StepBatch(
            step=grant.step,
            scheduled=[],
            swap_out=grant.swap_out,
            swap_in=grant.swap_in,
            page_copies=grant.page_copies,
        )
        for rejected in grant.rejected:
            req = self.requests.pop(rejected.request_id, None)
            if req is not None:
                self._finish(req, FinishReason.ERROR)
                req.error = rejected.reason
                batch.failed.append(req)
        for rid in grant.offloaded:
            req = self.requests[rid]
            req.status = RequestStatus.OFFLOADED
            req.tables = []
        for rid in grant.soft_reset:
            req = self.requests[rid]
            req.status = RequestStatus.PENDING
            req.tables = []
            req.num_computed = 0
            req.num_sent = 0  # the cache manager forgot it: resend every token
        for g in grant.granted:
            req = self.requests[g.request_id]
            if g.replace:
                req.tables = [list(t) for t in g.tables]
            else:
                for table, new in zip(req.tables, g.tables, strict=True):
                    table.extend(new)
            if req.status is RequestStatus.PENDING:
                if not req.output_ids:  # a re-prefill after a soft reset is not a prompt cache hit
                    req.num_cached_tokens = g.start
                req.num_computed = g.start
            if g.start != req.num_computed:
                raise RuntimeError(f"{g.request_id}: grant starts at {g.start}, worker at {req.num_computed}")
            req.num_computed = g.start + g.num_tokens
            sample = req.num_computed == req.num_tokens
            req.num_placeholders += sample
            req.status = RequestStatus.DECODING if sample else RequestStatus.PREFILLING
            fork_of = None
            if g.num_tokens == 0:
                fork_of = req.fork_of
                if fork_of is None:
                    raise RuntimeError(f"{g.request_id}: granted as a fork of nothing: {g}")
                req.fork_of = None
                req.num_sent = req.num_known
                self._forks[fork_of.request_id].remove(req)
            batch.scheduled.append(Scheduled(req, g.start, g.num_tokens, sample, fork_of))
        return batch

    # --------------------------------------------------------------------------------- postprocess

    def postprocess(self, batch: StepBatch, sampled: list[int]) -> list[Request]:
        """Put sampled tokens (one per sampling row, in batch order) in place of their placeholders and
        finish requests that hit a stop; a constrained request's grammar takes its token, and ends it
        when complete, or with an error when it cannot go on. Returns the requests that received a token."""
        updated = []
        for s, token in zip(batch.sampling, sampled, strict=True):
            req = s.request
            if req.finished:
                continue  # aborted, or stopped by the step before, while this one computed
            req.num_placeholders -= 1
            req.output_ids.append(token)
            reason = self._stop_reason(req, token)
            if reason is None and req.grammar is not None:
                error = req.grammar.advance(token)
                if error:
                    reason, req.error = FinishReason.ERROR, error
                elif req.grammar.terminated:  # its stop token, taken past ignore_eos
                    reason = FinishReason.EOS
            if reason is not None:
                del self.requests[req.request_id]
                self._frees.append(req.request_id)
                self._finish(req, reason)
            updated.append(req)
        return updated

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        if token in self.eos_token_ids and not params.ignore_eos:
            return FinishReason.EOS
        if token in params.stop_token_ids:
            return FinishReason.STOP_TOKEN
        if len(req.output_ids) >= params.max_new_tokens:
            return FinishReason.LENGTH
        return None

    def suppressed_ids(self, req: Request) -> tuple[int, ...]:
        """Stop ids a request may not sample yet: it has fewer than `min_new_tokens` outputs before the
        one its step samples, counting those steps still computing sample (its placeholders but that
        one), whose ids the host may not know yet (async batching)."""
        params = req.params
        if len(req.output_ids) + max(req.num_placeholders - 1, 0) >= params.min_new_tokens:
            return ()
        eos = () if params.ignore_eos else tuple(self.eos_token_ids)
        suppressed = eos + params.stop_token_ids
        if req.grammar is not None and req.grammar.admits_only(suppressed):
            # The grammar is complete and allows only its end: the end wins over min_new_tokens (as in
            # vLLM), since structured output must stay valid and the sample needs a token to take.
            return ()
        return suppressed

    @staticmethod
    def _finish(req: Request, reason: FinishReason) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
