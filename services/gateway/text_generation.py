"""`cbserve.v1.TextGeneration`: Generate, GetModelInfo, GetLoad, Tokenize, Detokenize.

The gateway owns everything textual (tokenization, chat templates, incremental detokenization, stop
strings) so that the worker sees only token ids. Each Generate call becomes one worker request per
choice (`sampling.n`; the choices after the first fork from it, sharing its prompt's KV); a choice's
end (its final message, a stop string) releases it, and so does the call's end, however it ends
(every final message sent, client cancel, deadline, error); any end but the worker's own finish also
aborts it in the worker, which frees its blocks within a step. Errors are status codes only.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, Protocol

import grpc
import structlog

from services.common.gateway_messages import NewRequest, RequestOutput, TokenLogprob
from services.gateway.api import pb, pb_grpc
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.handlers import register
from services.gateway.inputs import (
    InvalidRequest,
    Prepared,
    detokenize_input,
    prepare,
    request_id,
    tokenize_input,
)
from services.gateway.metrics import GatewayMetrics
from services.gateway.settings import GatewaySettings
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.worker_client import WorkerClient

log = structlog.get_logger(__name__)

# A worker's finish reason -> cbserve.v1's FinishReason, and what OpenAI's API calls that end (the
# VllmEngine service's `finish_reason`, which smg passes on).
FINISH_REASONS: dict[str, tuple[int, str]] = {
    "eos": (pb.FINISH_REASON_EOS, "stop"),
    "stop_token": (pb.FINISH_REASON_STOP_SEQUENCE, "stop"),
    "length": (pb.FINISH_REASON_LENGTH, "length"),
    "aborted": (pb.FINISH_REASON_ABORTED, "abort"),
}
OPENAI_FINISH_REASONS = {code: openai for code, openai in FINISH_REASONS.values()}
# Ends the worker reported itself: it holds nothing more of the request, so nothing to abort there.
WORKER_ENDS = frozenset(FINISH_REASONS)
# A long prompt's logprobs (up to 21 candidates with their text per token) go out in parts of this
# many tokens, and so do a held (non-streamed) output's: each far below the 4 MiB a gRPC client
# accepts by default.
LOGPROBS_PER_CHUNK = 512
# A call cancelled this close to its deadline (or past it) ended by the deadline.
DEADLINE_SLACK_S = 0.1


@dataclass
class _Stream:
    """One Generate call's progress, for its usage and timings."""

    arrival: float
    prompt_tokens: int
    completion_tokens: int = 0  # every choice's
    cached_tokens: int = 0
    queue_seconds: float = 0.0
    first_token_at: float | None = None
    end: str = ""  # how the call ended: its last choice's finish reason, cancelled, deadline or error
    code: str = ""  # the status code of an error end


@dataclass
class _Choice:
    """One choice of a Generate call (one worker request): its text and how it ended."""

    index: int
    internal: str  # the worker request's id
    detokenizer: IncrementalDetokenizer | None
    matcher: StopStringMatcher
    held: Any  # not streamed: the output so far (a GenerateChunk), sent just before its final message
    held_text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    last_token: int | None = None
    last_token_at: float | None = None
    end: str = ""  # a finish reason or stop_sequence, once ended


class CallContext(Protocol):
    """What Generate uses of its call's context: grpc.aio's own, or the VllmEngine servicer's wrapper
    of it (vllm_engine._VllmNamedContext), whose refusals name the fields as the vLLM caller did."""

    def invocation_metadata(self) -> grpc.aio.Metadata | None: ...

    async def send_initial_metadata(self, initial_metadata: Sequence[tuple[str, str]]) -> None: ...

    def time_remaining(self) -> float | None: ...

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn: ...


# The generated servicer base, loaded at import (api.py) and so unknown to the type checker: Any.
_TextGenerationServicer: Any = pb_grpc.TextGenerationServicer


class TextGenerationService(_TextGenerationServicer):
    def __init__(
        self,
        client: WorkerClient,
        tokenizer: Any,
        model_info: dict[str, Any],
        settings: GatewaySettings,
        metrics: GatewayMetrics,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.settings = settings
        self.metrics = metrics
        self.draining = False
        self.active = 0  # Generate calls in progress
        self.waiting = 0  # ... of which no token has arrived yet
        self._ids = itertools.count()
        # Logprobs name each token and its alternatives: the same few thousand ids, decoded once.
        self._token_text: Callable[[int], str] = functools.lru_cache(maxsize=1 << 16)(
            (lambda i: tokenizer.decode([i])) if tokenizer is not None else (lambda i: "")
        )

    # ----------------------------------------------------------------------------------- Generate

    async def Generate(self, request: Any, context: CallContext) -> AsyncGenerator[Any, None]:
        arrival = time.monotonic()
        if request is None:
            await self.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "the request does not parse")
        metadata = dict(context.invocation_metadata() or ())
        try:
            given = str(metadata.get("x-request-id") or "")
            trace_id = request_id(request.request_id, given, self.settings.limits)
        except InvalidRequest as exc:
            await self.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        structlog.contextvars.bind_contextvars(request_id=trace_id)
        facts = await self._admit(context)
        try:
            prepared = prepare(request, self.tokenizer, facts, self.settings.limits)
        except InvalidRequest as exc:
            await self.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # Headers only once the request is taken: a refusal before them is a trailers-only answer,
        # which a proxy sees before it commits its own response (smg then answers HTTP 400, not an
        # HTTP 200 stream that carries the error as an event).
        await context.send_initial_metadata((("x-request-id", trace_id),))
        internal = f"r{next(self._ids)}"
        ids = [internal] if prepared.n == 1 else [f"{internal}.{i}" for i in range(prepared.n)]
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        for i, rid in enumerate(ids):
            params = prepared.choice_params(i)
            fork_of = ids[0] if i else ""
            self.client.submit(
                NewRequest(
                    rid, prepared.prompt_ids, params, request.priority, request.cache_salt, trace_id, fork_of
                ),
                queue,
            )
        self.active += 1
        self.waiting += 1
        stream = _Stream(arrival, len(prepared.prompt_ids))
        choices = {rid: self._choice(i, rid, prepared) for i, rid in enumerate(ids)}
        try:
            async for response in self._stream(queue, prepared, stream, choices, context, trace_id):
                yield response
        except (asyncio.CancelledError, GeneratorExit):
            # A client's cancel and a deadline alike: grpc cancels the call's task, or closes this
            # generator when the call ended while it was suspended at a yield.
            if not stream.end:
                remaining = context.time_remaining()
                late = remaining is not None and remaining < DEADLINE_SLACK_S
                stream.end = "deadline" if late else "cancelled"
            raise
        finally:
            self.active -= 1
            if stream.first_token_at is None:
                self.waiting -= 1
            for choice in choices.values():
                self.client.release(choice.internal, abort=choice.end not in WORKER_ENDS)
            error = {"code": stream.code} if stream.code else {}
            log.info(
                "request finished",
                reason=stream.end or "error",
                **error,
                prompt_tokens=stream.prompt_tokens,
                completion_tokens=stream.completion_tokens,
                seconds=round(time.monotonic() - arrival, 3),
            )
            structlog.contextvars.unbind_contextvars("request_id")

    def _choice(self, index: int, internal: str, prepared: Prepared) -> _Choice:
        needs_text = prepared.want_text or bool(prepared.stops)
        return _Choice(
            index,
            internal,
            IncrementalDetokenizer(self.tokenizer, prepared.prompt_ids) if needs_text else None,
            StopStringMatcher(prepared.stops),
            None if prepared.stream else pb.GenerateChunk(index=index),
        )

    async def worker_facts(self, context: CallContext, *, ready: bool = False) -> Any:
        """The worker's facts; the call ends UNAVAILABLE (a counted refusal) while there are none
        yet, or, with `ready`, while the worker does not answer (no new work is sent to it then)."""
        facts = self.client.facts
        if facts is None or (ready and not self.client.ready):
            await self.refuse(context, grpc.StatusCode.UNAVAILABLE, "worker not ready")
        return facts

    async def _admit(self, context: CallContext) -> Any:
        if self.draining:
            await self.refuse(context, grpc.StatusCode.UNAVAILABLE, "server is draining")
        facts = await self.worker_facts(context, ready=True)
        if self.waiting >= self.settings.max_queue_size:
            await self.refuse(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"queue full: {self.waiting} requests wait (max_queue_size {self.settings.max_queue_size})",
            )
        return facts

    async def refuse(self, context: CallContext, code: grpc.StatusCode, details: str) -> NoReturn:
        """End the call with `code`, counted and logged as a refusal."""
        self.count_refusal(code, details)
        await context.abort(code, details)

    def count_refusal(self, code: grpc.StatusCode, details: str, key: str = "") -> None:
        self.metrics.errors.labels(code.name).inc()
        log.info("request refused", code=code.name, details=details, **({"key": key} if key else {}))

    async def _stream(
        self,
        queue: asyncio.Queue[RequestOutput],
        prepared: Prepared,
        stream: _Stream,
        choices: dict[str, _Choice],
        context: CallContext,
        trace_id: str,
    ) -> AsyncIterator[Any]:
        """The call's messages from its choices' outputs, as they come, until every choice has ended."""
        running = len(choices)
        while running:
            out = await queue.get()
            choice = choices[out.request_id]
            if out.code:
                stream.code = out.code
                await self.refuse(context, grpc.StatusCode[out.code], out.error)
            self._observe(stream, choice, out)
            text, matched = "", None
            if choice.detokenizer is not None:
                delta = choice.detokenizer.push(out.token_ids)
                delta += choice.detokenizer.flush() if out.finish else ""
                text, matched = choice.matcher.push(delta)
                if out.finish and matched is None:
                    text += choice.matcher.flush()
            *leading, prompt_logprobs = self._prompt_logprob_parts(out)
            for part in leading:
                yield pb.GenerateResponse(chunk=pb.GenerateChunk(prompt_logprobs=part, index=choice.index))
            chunk = pb.GenerateChunk(
                token_ids=out.token_ids if prepared.want_token_ids else (),
                text=text if prepared.want_text else "",
                logprobs=[self._logprobs(lp) for lp in out.logprobs or ()],
                prompt_logprobs=prompt_logprobs,
                index=choice.index,
            )
            held = choice.held
            if held is not None:
                held.MergeFrom(chunk)  # appends its repeated fields; its text is joined at the send
                choice.held_text.append(chunk.text)
                if matched is None and not out.finish and len(held.logprobs) < LOGPROBS_PER_CHUNK:
                    continue
                held.text = "".join(choice.held_text)
                chunk, choice.held, choice.held_text = held, pb.GenerateChunk(index=choice.index), []
            if chunk.token_ids or chunk.text or chunk.logprobs or chunk.prompt_logprobs:
                yield pb.GenerateResponse(chunk=chunk)
            if matched is not None:
                self.client.release(choice.internal, abort=True)  # the worker stops computing it now
                choice.end = "stop_sequence"
                running -= 1
                yield self._final(
                    stream,
                    choice,
                    trace_id,
                    pb.FINISH_REASON_STOP_SEQUENCE,
                    last=not running,
                    stop_sequence=matched,
                )
            elif out.finish:
                stop_token = choice.last_token if out.finish == "stop_token" else None
                choice.end = out.finish
                running -= 1
                yield self._final(
                    stream,
                    choice,
                    trace_id,
                    FINISH_REASONS[out.finish][0],
                    last=not running,
                    stop_token_id=stop_token,
                )
        stream.end = choice.end

    def _prompt_logprob_parts(self, out: RequestOutput) -> list[list[Any]]:
        """The output's prompt logprobs in parts of at most `LOGPROBS_PER_CHUNK` (one empty
        part when there are none): the last goes with the output's tokens, the others before them."""
        entries = [self._logprobs(lp) for lp in out.prompt_logprobs or ()]
        n = LOGPROBS_PER_CHUNK
        return [entries[i : i + n] for i in range(0, len(entries), n)] or [[]]

    def _logprobs(self, lp: TokenLogprob) -> Any:
        text = self._token_text
        top = [pb.TopLogprob(token_id=t, logprob=v, token=text(t)) for t, v in lp.top]
        return pb.TokenLogprobs(token_id=lp.token_id, logprob=lp.logprob, top=top, token=text(lp.token_id))

    def _observe(self, stream: _Stream, choice: _Choice, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.cached_tokens >= 0 and choice.index == 0:
            stream.cached_tokens = out.cached_tokens
        if out.queue_seconds >= 0 and choice.index == 0:
            stream.queue_seconds = out.queue_seconds
            self.metrics.queue.observe(out.queue_seconds)
        if not out.token_ids:
            return
        if stream.first_token_at is None:
            stream.first_token_at = now
            self.waiting -= 1
            self.metrics.ttft.observe(now - stream.arrival)
        if choice.last_token_at is not None:
            self.metrics.itl.observe((now - choice.last_token_at) / len(out.token_ids))
        choice.last_token_at = now
        choice.completion_tokens += len(out.token_ids)
        stream.completion_tokens += len(out.token_ids)
        choice.last_token = out.token_ids[-1]

    def _final(
        self,
        stream: _Stream,
        choice: _Choice,
        trace_id: str,
        reason: int,
        *,
        last: bool,
        stop_sequence: str = "",
        stop_token_id: int | None = None,
    ) -> Any:
        """Choice `choice`'s final message; the `last` one's also counts the call in the metrics."""
        now = time.monotonic()
        if last:
            self.metrics.e2e.observe(now - stream.arrival)
            self.metrics.prompt_tokens.inc(stream.prompt_tokens)
        self.metrics.generation_tokens.inc(choice.completion_tokens)
        self.metrics.requests.labels(pb.FinishReason.Name(reason)).inc()
        final = pb.GenerateFinal(
            request_id=trace_id,
            finish_reason=reason,
            stop_sequence=stop_sequence,
            usage=pb.Usage(
                prompt_tokens=stream.prompt_tokens,
                completion_tokens=choice.completion_tokens,
                cached_prompt_tokens=stream.cached_tokens,
            ),
            timings=pb.Timings(
                queue_seconds=stream.queue_seconds,
                time_to_first_token_seconds=(stream.first_token_at or now) - stream.arrival,
                total_seconds=now - stream.arrival,
            ),
            index=choice.index,
        )
        if stop_token_id is not None:
            final.stop_token_id = stop_token_id
        return pb.GenerateResponse(final=final)

    # ------------------------------------------------------------------------------ unary methods

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        facts = await self.worker_facts(context)
        return pb.ModelInfo(
            **self.model_info,
            vocab_size=facts.vocab_size,
            max_model_len=facts.max_request_tokens,
            max_prompt_tokens=max(facts.max_request_tokens - 1, 0),
            page_size=facts.page_size,
            total_blocks=facts.total_blocks,
            prefix_caching=facts.prefix_caching,
            dtype=facts.dtype,
            device=facts.device,
        )

    async def GetLoad(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self.worker_facts(context, ready=True)
        try:
            load = await self.client.query_load()
        except TimeoutError:
            await self.refuse(context, grpc.StatusCode.UNAVAILABLE, "worker did not answer the load query")
        fields = {f: getattr(load, f) for f in pb.Load.DESCRIPTOR.fields_by_name}
        return pb.Load(**fields)

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        facts = await self.worker_facts(context)
        try:
            ids = tokenize_input(request, self.tokenizer, facts, self.settings.limits)
        except InvalidRequest as exc:
            await self.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        facts = await self.worker_facts(context)
        try:
            ids = detokenize_input(request, self.tokenizer, facts)
        except InvalidRequest as exc:
            await self.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        text = self.tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens)
        return pb.DetokenizeResponse(text=text)


def add_service(service: TextGenerationService, server: grpc.aio.Server) -> None:
    register(server, pb.DESCRIPTOR.services_by_name["TextGeneration"], lambda name: getattr(service, name))
