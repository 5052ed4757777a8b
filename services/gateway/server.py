"""The gateway process: `cbserve.v1.TextGeneration` over grpc.aio, plus health, reflection, metrics.

It owns everything textual (tokenization, chat templates, incremental detokenization, stop strings)
so that the worker sees only token ids. Each Generate call becomes one worker request; the call's
end, however it ends (final message, client cancel, deadline, stop string, error), releases it, and
any end but the worker's own finish also aborts it in the worker, which frees its blocks within a
step. Errors are status codes only.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.cli_args import CONFIG_ERROR_EXIT
from services.common.gateway_messages import NewRequest, RequestOutput, TokenLogprob, WorkerFacts
from services.common.wire import internal_key
from services.gateway.api import SERVICE_NAME, pb, pb_grpc
from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.inputs import (
    InvalidRequest,
    Limits,
    Prepared,
    detokenize_input,
    prepare,
    request_id,
    tokenize_input,
)
from services.gateway.metrics import GatewayMetrics
from services.gateway.security import Access, AccessInterceptor, TlsFiles
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.vllm_engine import GENERATE_METHOD as VLLM_GENERATE
from services.gateway.vllm_engine import SERVICE_NAME as VLLM_SERVICE
from services.gateway.vllm_engine import VllmEngineService, add_vllm_service
from services.gateway.worker_client import WorkerClient

log = structlog.get_logger(__name__)

FINISH_REASONS = {
    "eos": pb.FINISH_REASON_EOS,
    "stop_token": pb.FINISH_REASON_STOP_SEQUENCE,
    "length": pb.FINISH_REASON_LENGTH,
    "aborted": pb.FINISH_REASON_ABORTED,
}
# Ends the worker reported itself: it holds nothing more of the request, so nothing to abort there.
WORKER_ENDS = frozenset(FINISH_REASONS)
# A long prompt's logprobs (up to 21 candidates with their text per token) go out in parts of this
# many tokens, and so do a held (non-streamed) output's: each far below the 4 MiB a gRPC client
# accepts by default.
LOGPROBS_PER_CHUNK = 512
# A call cancelled this close to its deadline (or past it) ended by the deadline.
DEADLINE_SLACK_S = 0.1
HEALTH_SERVICES = ("", SERVICE_NAME)
HEALTH_SERVICE: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(frozen=True)
class GatewaySettings:
    max_queue_size: int = 1024  # streams admitted but without a first token yet
    drain_grace_s: float = 30.0
    max_message_bytes: int = 16 << 20
    max_concurrent_streams: int = 1024  # per HTTP/2 connection
    keepalive_time_s: float = 30.0
    keepalive_timeout_s: float = 10.0
    worker_timeout_s: float = 10.0
    resubmit_timeout_s: float = 60.0  # how long streams of a lost worker wait for a new one
    limits: Limits = field(default_factory=Limits)
    tls: TlsFiles | None = None  # None: plaintext
    access: Access = field(default_factory=Access)
    health_port: int | None = None  # a plaintext port serving grpc.health.v1 alone, for probes
    served_model_name: str | None = None  # None: the model directory's name


@dataclass
class _Stream:
    """One Generate call's progress, for its usage and timings."""

    arrival: float
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_seconds: float = 0.0
    first_token_at: float | None = None
    last_token_at: float | None = None
    last_token: int | None = None
    end: str = ""  # how the call ended: a finish reason, cancelled, deadline or error
    code: str = ""  # the status code of an error end


class TextGenerationService(pb_grpc.TextGenerationServicer):
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

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        arrival = time.monotonic()
        if request is None:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "the request does not parse")
        metadata = dict(context.invocation_metadata() or ())
        try:
            given = str(metadata.get("x-request-id") or "")
            trace_id = request_id(request.request_id, given, self.settings.limits)
        except InvalidRequest as exc:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        await context.send_initial_metadata((("x-request-id", trace_id),))
        structlog.contextvars.bind_contextvars(request_id=trace_id)
        facts = await self._admit(context)
        try:
            prepared = prepare(request, self.tokenizer, facts, self.settings.limits)
        except InvalidRequest as exc:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        internal = f"r{next(self._ids)}"
        queue = self.client.submit(
            NewRequest(internal, prepared.prompt_ids, prepared.params, request.priority, request.cache_salt,
                       trace_id)
        )  # fmt: skip
        self.active += 1
        self.waiting += 1
        stream = _Stream(arrival, len(prepared.prompt_ids))
        try:
            async for response in self._stream(queue, prepared, stream, context, internal, trace_id):
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
            self.client.release(internal, abort=stream.end not in WORKER_ENDS)
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

    async def _admit(self, context: grpc.aio.ServicerContext) -> Any:
        facts = self.client.facts
        if self.draining:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, "server is draining")
        if not self.client.ready or facts is None:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, "worker not ready")
        if self.waiting >= self.settings.max_queue_size:
            await self._abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"queue full: {self.waiting} requests wait (max_queue_size {self.settings.max_queue_size})",
            )
        return facts

    async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str) -> None:
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
        context: grpc.aio.ServicerContext,
        internal: str,
        trace_id: str,
    ) -> AsyncIterator[Any]:
        needs_text = prepared.want_text or bool(prepared.stops)
        detok = IncrementalDetokenizer(self.tokenizer, prepared.prompt_ids) if needs_text else None
        matcher = StopStringMatcher(prepared.stops)
        # Not streamed: the output is held here and sent just before the final message.
        held: Any = None if prepared.stream else pb.GenerateChunk()
        held_text: list[str] = []
        while True:
            out = await queue.get()
            if out.code:
                stream.code = out.code
                await self._abort(context, grpc.StatusCode[out.code], out.error)
            self._observe(stream, out)
            text, matched = "", None
            if detok is not None:
                delta = detok.push(out.token_ids) + (detok.flush() if out.finish else "")
                text, matched = matcher.push(delta)
                if out.finish and matched is None:
                    text += matcher.flush()
            *leading, prompt_logprobs = self._prompt_logprob_parts(out)
            for part in leading:
                yield pb.GenerateResponse(chunk=pb.GenerateChunk(prompt_logprobs=part))
            chunk = pb.GenerateChunk(
                token_ids=out.token_ids if prepared.want_token_ids else (),
                text=text if prepared.want_text else "",
                logprobs=[self._logprobs(lp) for lp in out.logprobs or ()],
                prompt_logprobs=prompt_logprobs,
            )
            if held is not None:
                held.MergeFrom(chunk)  # appends its repeated fields; its text is joined at the send
                held_text.append(chunk.text)
                if matched is None and not out.finish and len(held.logprobs) < LOGPROBS_PER_CHUNK:
                    continue
                held.text = "".join(held_text)
                chunk, held, held_text = held, pb.GenerateChunk(), []
            if chunk.token_ids or chunk.text or chunk.logprobs or chunk.prompt_logprobs:
                yield pb.GenerateResponse(chunk=chunk)
            if matched is not None:
                self.client.release(internal, abort=True)  # the worker stops computing it now
                stream.end = "stop_sequence"
                yield self._final(stream, trace_id, pb.FINISH_REASON_STOP_SEQUENCE, stop_sequence=matched)
                return
            if out.finish:
                stop_token = stream.last_token if out.finish == "stop_token" else None
                stream.end = out.finish
                yield self._final(stream, trace_id, FINISH_REASONS[out.finish], stop_token_id=stop_token)
                return

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

    def _observe(self, stream: _Stream, out: RequestOutput) -> None:
        now = time.monotonic()
        if out.cached_tokens >= 0:
            stream.cached_tokens = out.cached_tokens
        if out.queue_seconds >= 0:
            stream.queue_seconds = out.queue_seconds
            self.metrics.queue.observe(out.queue_seconds)
        if not out.token_ids:
            return
        if stream.first_token_at is None:
            stream.first_token_at = now
            self.waiting -= 1
            self.metrics.ttft.observe(now - stream.arrival)
        elif stream.last_token_at is not None:
            self.metrics.itl.observe((now - stream.last_token_at) / len(out.token_ids))
        stream.last_token_at = now
        stream.completion_tokens += len(out.token_ids)
        stream.last_token = out.token_ids[-1]

    def _final(
        self,
        stream: _Stream,
        trace_id: str,
        reason: int,
        *,
        stop_sequence: str = "",
        stop_token_id: int | None = None,
    ) -> Any:
        now = time.monotonic()
        self.metrics.e2e.observe(now - stream.arrival)
        self.metrics.prompt_tokens.inc(stream.prompt_tokens)
        self.metrics.generation_tokens.inc(stream.completion_tokens)
        self.metrics.requests.labels(pb.FinishReason.Name(reason)).inc()
        final = pb.GenerateFinal(
            request_id=trace_id,
            finish_reason=reason,
            stop_sequence=stop_sequence,
            usage=pb.Usage(
                prompt_tokens=stream.prompt_tokens,
                completion_tokens=stream.completion_tokens,
                cached_prompt_tokens=stream.cached_tokens,
            ),
            timings=pb.Timings(
                queue_seconds=stream.queue_seconds,
                time_to_first_token_seconds=(stream.first_token_at or now) - stream.arrival,
                total_seconds=now - stream.arrival,
            ),
        )
        if stop_token_id is not None:
            final.stop_token_id = stop_token_id
        return pb.GenerateResponse(final=final)

    # ------------------------------------------------------------------------------ unary methods

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        facts = self.client.facts
        if facts is None:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, "worker not ready")
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
        if not self.client.ready:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, "worker not ready")
        try:
            load = await self.client.query_load()
        except TimeoutError:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, "worker did not answer the load query")
        fields = {f: getattr(load, f) for f in pb.Load.DESCRIPTOR.fields_by_name}
        return pb.Load(**fields)

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        facts = self.client.facts
        if facts is None:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, "worker not ready")
        try:
            ids = tokenize_input(request, self.tokenizer, facts, self.settings.limits)
        except InvalidRequest as exc:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.TokenizeResponse(token_ids=ids)

    async def Detokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        facts = self.client.facts
        if facts is None:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, "worker not ready")
        try:
            ids = detokenize_input(request, self.tokenizer, facts)
        except InvalidRequest as exc:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        text = self.tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens)
        return pb.DetokenizeResponse(text=text)


def _parse_or_none(message_class: Any) -> Callable[[bytes], Any]:
    """A request deserializer that yields None instead of raising: grpc would answer UNKNOWN for a
    message that does not parse (bad wire format, invalid UTF-8); the handler answers INVALID_ARGUMENT."""

    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError:
            return None

    return parse


def _refuse_unparsed(method: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request does not parse")
        return await method(request, context)

    return handler


def add_service(service: TextGenerationService, server: grpc.aio.Server) -> None:
    """The generated registration, with deserializers that turn parse errors into INVALID_ARGUMENT."""
    handlers = {}
    for method in pb.DESCRIPTOR.services_by_name["TextGeneration"].methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        impl = getattr(service, method.name)
        if method.server_streaming:  # Generate checks for None itself (it is a generator)
            kind, handler = grpc.unary_stream_rpc_method_handler, impl
        else:
            kind, handler = grpc.unary_unary_rpc_method_handler, _refuse_unparsed(impl)
        handlers[method.name] = kind(
            handler,
            request_deserializer=_parse_or_none(request_class),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def _model_info(model_dir: str, name: str | None) -> tuple[Any, dict[str, Any]]:
    """The tokenizer (None if the model has none) and ModelInfo's static fields. The model is
    `name`, else its directory's name: clients are not told where it lies on the server."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from services.common.model_source import has_tokenizer

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tokenizer = None
    if has_tokenizer(Path(model_dir)):
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    try:
        eos = GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
    except OSError:
        eos = None
    eos = config.eos_token_id if eos is None else eos
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, list | tuple) else [eos]
    return tokenizer, {
        "model_id": name or Path(model_dir).name,
        "architecture": (config.architectures or [""])[0],
        "eos_token_ids": eos_ids,
        "has_tokenizer": tokenizer is not None,
        "has_chat_template": getattr(tokenizer, "chat_template", None) is not None,
    }


def _announce(model: str, address: str, metrics: str | None, facts: WorkerFacts) -> None:
    """The stack serves: one line for the person who started it (stdout), and its facts in the log."""
    tokens = facts.total_blocks * facts.page_size
    pool = f"KV cache {facts.total_blocks:,} blocks = {tokens:,} tokens"
    about = [facts.kv_dtype] if facts.kv_dtype else []
    if facts.kv_bytes:
        gib = facts.kv_bytes / (1 << 30)
        about.insert(0, f"{gib:.1f} GiB" if gib >= 1 else f"{facts.kv_bytes / (1 << 20):.0f} MiB")
    pool += f" ({', '.join(about)})" if about else ""
    where = f", metrics on http://{metrics}/metrics" if metrics else ""
    print(f"serving {model} in {facts.dtype} on {address}{where}; {pool}", flush=True)
    log.info("stack serving", model=model, address=address, metrics=metrics, kv_blocks=facts.total_blocks,
             kv_tokens=tokens, kv_bytes=facts.kv_bytes, device=facts.device, dtype=facts.dtype)  # fmt: skip


def _interceptors(access: Access, service: TextGenerationService) -> list[grpc.aio.ServerInterceptor]:
    if access.keys is None:
        return []
    open_services = [HEALTH_SERVICE] if access.open_health else []
    open_services += [reflection.SERVICE_NAME] if access.open_reflection else []
    return [
        AccessInterceptor(
            access,
            open_services=open_services,
            stream_methods=[f"/{SERVICE_NAME}/Generate", VLLM_GENERATE],
            on_refused=service.count_refusal,
        )
    ]


async def serve(
    model: str | None,
    worker_address: str,
    host: str,
    port: int,
    metrics_port: int | None,
    settings: GatewaySettings,
) -> None:
    from services.common.model_source import resolve_model

    model_dir = str(resolve_model(model))
    tokenizer, info = _model_info(model_dir, settings.served_model_name)
    health_servicer = health.aio.HealthServicer()
    for name in HEALTH_SERVICES:
        await health_servicer.set(name, NOT_SERVING)
    service: TextGenerationService | None = None
    announced = False

    def serving() -> bool:
        return client.ready and not (service is not None and service.draining)

    def on_ready_change(ready: bool) -> None:
        nonlocal announced
        status = SERVING if serving() else NOT_SERVING
        for name in HEALTH_SERVICES:
            asyncio.get_running_loop().create_task(health_servicer.set(name, status))
        if status == SERVING and not announced and client.facts is not None:
            announced = True
            metrics_address = f"{host}:{metrics_port}" if metrics_port else None
            _announce(info["model_id"], f"{host}:{bound}", metrics_address, client.facts)

    metrics: GatewayMetrics
    client = WorkerClient(
        worker_address,
        worker_timeout_s=settings.worker_timeout_s,
        resubmit_timeout_s=settings.resubmit_timeout_s,
        key=internal_key(),
        on_ready_change=on_ready_change,
        on_step=lambda times: metrics.observe_step(times),
    )
    metrics = GatewayMetrics(
        lambda: client.load,
        lambda: (client.resubmitted, client.recomputed_tokens),
        lambda: client.in_flight,
        queue=lambda: (service.waiting if service is not None else 0, settings.max_queue_size),
        model={"model_name": info["model_id"], "architecture": info["architecture"]},
        serving=serving,
    )
    service = TextGenerationService(client, tokenizer, info, settings, metrics)
    server = grpc.aio.server(
        interceptors=_interceptors(settings.access, service),
        options=[
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
            ("grpc.keepalive_time_ms", int(settings.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(settings.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            # grpc shares a port with any process that also asks for SO_REUSEPORT, so a second
            # gateway on the same port would serve half the connections instead of failing.
            ("grpc.so_reuseport", 0),
        ],
    )
    add_service(service, server)
    add_vllm_service(VllmEngineService(service, Path(model_dir)), server)  # the SMG worker protocol
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, VLLM_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server
    )
    # Probes that cannot do TLS or present a client certificate (Kubernetes' gRPC probes, a compose
    # healthcheck) get the health service alone on a port of its own.
    health_server = grpc.aio.server() if settings.health_port is not None else None
    if health_server is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
    try:
        address = f"{host}:{port}"
        if settings.tls is not None:
            bound = server.add_secure_port(address, settings.tls.credentials())
        else:
            bound = server.add_insecure_port(address)
        if bound == 0:
            raise OSError(f"cannot listen on {address}")
        health_address = f"{host}:{settings.health_port}"
        if health_server is not None and health_server.add_insecure_port(health_address) == 0:
            raise OSError(f"cannot listen on {health_address}")
        if metrics_port is not None:
            metrics.serve(metrics_port, host)
    except (RuntimeError, OSError) as exc:
        # A port in use (or not ours to bind) stays so: exit as a configuration error, which a
        # supervisor does not answer with a restart.
        log.error("cannot listen", host=host, port=port, metrics_port=metrics_port,
                  health_port=settings.health_port, error=str(exc))  # fmt: skip
        raise SystemExit(CONFIG_ERROR_EXIT) from None
    await server.start()
    if health_server is not None:
        await health_server.start()
    await client.start()
    if settings.access.keys is not None and settings.tls is None:
        log.warning("API keys are checked on a plaintext port: they cross the network readable")
    log.info("gateway listening", host=host, port=bound, metrics_port=metrics_port, worker=worker_address,
             tls=settings.tls.mode if settings.tls is not None else "off",
             api_keys=len(settings.access.keys or ()), health_port=settings.health_port)  # fmt: skip

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    # Drain: health turns NOT_SERVING at once (load balancers stop routing here), new calls get
    # UNAVAILABLE, and the streams in flight may finish within the grace period.
    service.draining = True
    await health_servicer.enter_graceful_shutdown()
    log.info("gateway draining", in_flight=service.active, grace_s=settings.drain_grace_s)
    deadline = time.monotonic() + settings.drain_grace_s
    while service.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await server.stop(grace=1.0)
    if health_server is not None:
        await health_server.stop(grace=None)
    await client.close()
    metrics.close()
    log.info("gateway stopped", unfinished=service.active)
