"""`vllm.grpc.engine.VllmEngine`, the SMG worker protocol, served beside `cbserve.v1` on the gateway's port.

The `smg` model gateway fronts a fleet of such workers: it tokenizes, renders chat templates,
routes, detokenizes and trims stop strings itself, and speaks token ids to the worker. Each Generate
call is translated (vllm_requests.py) into a `cbserve.v1.GenerateRequest` and run by the
TextGenerationService itself, so that both APIs share one admission (draining, the queue limit),
validation, stop matching, metrics and logs, and the abort that frees a request's blocks however its
call ends. The messages come out as vLLM's own servicer shapes them, which is what smg reads:
- `stream` true: one chunk per worker step with its new ids (`completion_tokens` counts that
  chunk's ids), then a `complete` with the finish reason, the matched stop and the usage; its
  `output_ids` is empty (the chunks carried every id).
- `stream` false: one `complete` with every id (and logprob).
- Prompt logprobs (`prompt_logprobs`) come once, as vLLM's servicer sends them: with the first chunk
  when streaming, else with the `complete`; every prompt token is listed, the first without a logprob.
- Finish reasons: "stop" (end of sequence, a stop id or a stop string: the last two named in
  `matched_stop`), "length", "abort".
`Abort` ends the named streams with a `complete` whose finish reason is "abort"; both it and a
cancelled call abort the request in the worker.

`FlushCache` drops the cached prefixes no request holds, at once: pages in use are never touched,
so there is no idle scheduler to wait for (`timeout_s` is not needed).

`SubscribeKvEvents` streams the prefix cache's changes from the gateway's KvEventLog (see
kv_event_log.py): one batch per worker step that changed the cache, numbered from 1; a subscriber
without a usable cursor gets the live pages first as a one-chunk snapshot. Block hashes are the first
8 bytes of cbserve's 16-byte chained digests as a signed int64, a block is one page (`block_size` =
page size), consecutive pages of one chain are one `stored` event; salted pages are never announced.

Not served: `Embed` and the profiler.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import time
import zipfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import grpc
from smg_grpc_proto import vllm_engine_pb2 as vllm
from smg_grpc_proto import vllm_engine_pb2_grpc as vllm_grpc
from smg_grpc_proto.generated import common_pb2

from services.common.cachemgr_messages import StoredBlock
from services.gateway.handlers import register
from services.gateway.inputs import InvalidRequest
from services.gateway.kv_event_log import KvBatch
from services.gateway.text_generation import OPENAI_FINISH_REASONS
from services.gateway.vllm_requests import to_cbserve, vllm_field_names

if TYPE_CHECKING:
    from services.gateway.text_generation import TextGenerationService

SERVICE_NAME: str = vllm.DESCRIPTOR.services_by_name["VllmEngine"].full_name
GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"
TOKENIZER_CHUNK_BYTES = 64 << 10
# What a caller needs to build the model's tokenizer and chat template where it runs (GetTokenizer).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "config.json",
    "generation_config.json",
)
TOKENIZER_GLOBS = ("*.jinja", "*.tiktoken")
NOT_SERVED = {
    "Embed": "cbserve serves generation only, not embeddings",
    "StartProfile": "cbserve has no profiler to start over gRPC",
    "StopProfile": "cbserve has no profiler to stop over gRPC",
}


def _version() -> str:
    try:
        return metadata.version("cbserve")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return ""


class _VllmNamedContext:
    """The call's context as TextGenerationService.Generate sees it: its refusals name each field as
    the VllmEngine caller set it."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    # Spelled out (not left to __getattr__) so that the type checker sees a text_generation.CallContext.
    def invocation_metadata(self) -> grpc.aio.Metadata | None:
        return self._context.invocation_metadata()

    async def send_initial_metadata(self, initial_metadata: Sequence[tuple[str, str]]) -> None:
        await self._context.send_initial_metadata(initial_metadata)

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        await self._context.abort(code, vllm_field_names(details))


@dataclass
class _Call:
    """One Generate call's cbserve stream, run as a task of its own so that Abort can end it."""

    run: asyncio.Task[None]
    aborted: bool = False


def _top(lp: Any) -> dict[str, list[Any]]:
    return {"values": [t.logprob for t in lp.top], "token_ids": [t.token_id for t in lp.top]}


def _output_logprobs(entries: Sequence[Any], with_top: bool) -> Any:
    out = vllm.OutputLogProbs()
    for lp in entries:
        out.token_ids.append(lp.token_id)
        out.token_logprobs.append(lp.logprob)
        if with_top:  # as vLLM: alternatives only when some were asked for
            out.top_logprobs.add(**_top(lp))
    return out


class _PromptLogprobs:
    """One request's prompt logprobs on their way out. cbserve may split them over the chunks before
    its first token; vLLM sends them once, whole, with the first message that carries tokens."""

    def __init__(self, request: Any) -> None:
        s = request.sampling_params
        self._pending = s.HasField("prompt_logprobs")  # with tokenized input only (vllm_requests.py)
        self._with_top = s.prompt_logprobs > 0
        self._first_id = request.tokenized.input_ids[0] if self._pending else 0
        self._entries: list[Any] = []

    def add(self, entries: Sequence[Any]) -> None:
        self._entries += entries

    def take(self) -> Any | None:
        """The `InputLogProbs` to send now, once; None when none were asked for or they went out.
        vLLM's shape: every prompt token, the first without a logprob (nothing precedes it), while
        cbserve's start at the second."""
        if not self._pending:
            return None
        self._pending = False
        out = vllm.InputLogProbs(token_ids=[self._first_id], token_logprobs=[vllm.InputTokenLogProb()])
        if self._with_top:
            out.top_logprobs.add()
        for lp in self._entries:
            out.token_ids.append(lp.token_id)
            out.token_logprobs.add(value=lp.logprob)
            if self._with_top:
                out.top_logprobs.add(**_top(lp))
        return out


def _tokenizer_zip(model_dir: Path) -> bytes:
    names = [n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
    names += sorted({p.name for g in TOKENIZER_GLOBS for p in model_dir.glob(g) if p.is_file()})
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in dict.fromkeys(names):
            archive.write(model_dir / name, name)
    return buffer.getvalue()


class VllmEngineService(vllm_grpc.VllmEngineServicer):
    def __init__(self, text: TextGenerationService, model_dir: Path) -> None:
        from transformers import AutoConfig

        self.text = text
        self.model_dir = model_dir
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self._config_facts = {
            "model_type": str(getattr(config, "model_type", "") or ""),
            "pad_token_id": int(getattr(config, "pad_token_id", None) or 0),  # 0 when none, as vLLM
            "bos_token_id": int(getattr(config, "bos_token_id", None) or 0),
        }
        self.started = time.time()
        self.last_receive = 0.0  # when the latest Generate call arrived (epoch seconds)
        self._calls: dict[str, _Call] = {}
        self._version = _version()

    # ----------------------------------------------------------------------------------- Generate

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if request is None:
            await self.text.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "the request does not parse")
        self.last_receive = time.time()
        rid = request.request_id
        try:
            if rid in self._calls:
                raise InvalidRequest(f"request_id {rid!r} is already in flight")
            translated = to_cbserve(request)
        except InvalidRequest as exc:
            await self.text.refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        responses: asyncio.Queue[Any] = asyncio.Queue()

        async def run() -> None:
            generate = self.text.Generate(translated, _VllmNamedContext(context))
            async with contextlib.aclosing(generate) as stream:
                async for response in stream:
                    responses.put_nowait(response)

        call = _Call(asyncio.create_task(run()))
        call.run.add_done_callback(lambda _: responses.put_nowait(None))
        if rid:
            self._calls[rid] = call
        try:
            async for message in self._translate(request, responses, call):
                yield message
        finally:
            if self._calls.get(rid) is call:
                del self._calls[rid]
            # The caller cancelled or went away: the cbserve stream's own end aborts the request.
            call.run.cancel()
            await asyncio.wait([call.run])

    async def _translate(
        self, request: Any, responses: asyncio.Queue[Any], call: _Call
    ) -> AsyncIterator[Any]:
        """vLLM's messages from the cbserve stream's (`None` once it has ended); each names its choice
        (`index`), and each choice ends with its own complete message."""
        s = request.sampling_params
        prompt_tokens = len(request.tokenized.input_ids)  # a text prompt's count comes with the complete
        with_logprobs = s.HasField("logprobs")
        with_top = with_logprobs and s.logprobs > 0
        choices = max(s.n, 1)
        ids: list[list[int]] = [
            [] for _ in range(choices)
        ]  # kept for the complete messages when not streaming
        logprobs: list[list[Any]] = [[] for _ in range(choices)]
        generated = [0] * choices
        ended: set[int] = set()
        prompt = _PromptLogprobs(request)
        while (response := await responses.get()) is not None:
            if response.HasField("final"):
                i = response.final.index
                output = logprobs[i] if with_logprobs else None
                ended.add(i)
                yield self._complete(response.final, ids[i], output, with_top, prompt.take())
                continue
            chunk = response.chunk
            prompt.add(chunk.prompt_logprobs)
            if not chunk.token_ids:
                continue
            i, n = chunk.index, len(chunk.token_ids)
            generated[i] += n
            if request.stream:
                message = vllm.GenerateStreamChunk(
                    token_ids=chunk.token_ids, prompt_tokens=prompt_tokens, completion_tokens=n, index=i
                )
                if with_logprobs:
                    message.output_logprobs.CopyFrom(_output_logprobs(chunk.logprobs, with_top))
                if (input_logprobs := prompt.take()) is not None:
                    message.input_logprobs.CopyFrom(input_logprobs)
                yield vllm.GenerateResponse(chunk=message)
            else:
                ids[i] += chunk.token_ids
                logprobs[i] += chunk.logprobs
        if call.aborted:
            for i in range(choices):
                if i not in ended:
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": generated[i]}
                    complete = vllm.GenerateComplete(
                        output_ids=ids[i], finish_reason="abort", index=i, **usage
                    )
                    yield vllm.GenerateResponse(complete=complete)
            return
        error = call.run.exception()
        if error is not None:
            raise error  # the cbserve stream's status (already sent, if it was an abort)

    @staticmethod
    def _complete(
        final: Any, ids: list[int], logprobs: list[Any] | None, with_top: bool, input_logprobs: Any | None
    ) -> Any:
        usage = final.usage
        complete = vllm.GenerateComplete(
            output_ids=ids,
            finish_reason=OPENAI_FINISH_REASONS[final.finish_reason],
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_prompt_tokens,
            index=final.index,
        )
        if final.stop_sequence:
            complete.matched_stop_str = final.stop_sequence
        elif final.HasField("stop_token_id"):
            complete.matched_token_id = final.stop_token_id
        if logprobs:
            complete.output_logprobs.CopyFrom(_output_logprobs(logprobs, with_top))
        if input_logprobs is not None:
            complete.input_logprobs.CopyFrom(input_logprobs)
        return vllm.GenerateResponse(complete=complete)

    async def Abort(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        for rid in request.request_ids:  # ids not in flight (already ended) are no error, as in vLLM
            call = self._calls.get(rid)
            if call is not None and not call.run.done():
                call.aborted = True
                call.run.cancel()
        return vllm.AbortResponse()

    # ------------------------------------------------------------------------------ unary methods

    async def HealthCheck(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """Healthy, or UNAVAILABLE: smg takes a worker whose health check answers at all for a vLLM
        one and registers it at once, and one registered before it was ready would stay nameless
        (GetModelInfo is UNAVAILABLE until the worker is)."""
        # Not counted as refused requests: a router probes every second while the stack warms up.
        if self.text.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is draining")
        if not self.text.client.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker not ready")
        return vllm.HealthCheckResponse(healthy=True, message="serving")

    async def GetModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        facts = await self.text.worker_facts(context)
        info = self.text.model_info
        return vllm.GetModelInfoResponse(
            model_path=info["model_id"],  # the served name: clients are not told where it lies
            served_model_name=info["model_id"],
            is_generation=True,
            max_context_length=facts.max_request_tokens,
            max_req_input_len=max(facts.max_request_tokens - 1, 0),
            vocab_size=facts.vocab_size,
            architectures=[info["architecture"]] if info["architecture"] else [],
            eos_token_ids=info["eos_token_ids"],
            **self._config_facts,
        )

    async def GetServerInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        facts = await self.text.worker_facts(context)
        return vllm.GetServerInfoResponse(
            active_requests=self.text.active,
            is_paused=self.text.draining,
            last_receive_timestamp=self.last_receive,
            uptime_seconds=time.time() - self.started,
            server_type="cbserve",
            data_parallel_size=1,
            block_size=facts.page_size,
            model_dtype=facts.dtype,
        )

    async def GetLoads(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        """The counters GetLoad reports, for rank 0 (a stack is one rank; `dp_rank` and `include`
        select nothing else)."""
        facts = await self.text.worker_facts(context)
        try:
            load = await self.text.client.query_load()
        except TimeoutError:
            await self.text.refuse(
                context, grpc.StatusCode.UNAVAILABLE, "worker did not answer the load query"
            )
        total = load.kv_blocks_total * facts.page_size
        used = load.kv_blocks_used * facts.page_size
        queries = load.prefix_cache_queries
        return vllm.GetLoadsResponse(
            timestamp=datetime.now(UTC).isoformat(),
            version=self._version,
            dp_rank_count=1,
            loads=[
                vllm.SchedulerLoad(
                    dp_rank=0,
                    num_running_reqs=load.requests_running,
                    num_waiting_reqs=load.requests_waiting,
                    num_total_reqs=load.requests_running + load.requests_waiting,
                    num_used_tokens=used,
                    max_total_num_tokens=total,
                    token_usage=used / total if total else 0.0,
                    cache_hit_rate=load.prefix_cache_hits / queries if queries else 0.0,
                )
            ],
        )

    async def FlushCache(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self.text.worker_facts(context)
        try:
            blocks = await self.text.client.flush_cache()
        except TimeoutError:
            await self.text.refuse(context, grpc.StatusCode.UNAVAILABLE, "worker did not answer the flush")
        if blocks < 0:
            return common_pb2.FlushCacheResponse(success=False, message="the worker reached no cachemgr")
        return common_pb2.FlushCacheResponse(success=True, message=f"dropped {blocks} cached blocks")

    async def SubscribeKvEvents(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        facts = await self.text.worker_facts(context)
        log = self.text.client.kv_events
        async for batch in log.subscribe(int(request.start_sequence_number)):
            yield _kv_event_batch(batch, facts.page_size, complete=log.complete)

    async def GetTokenizer(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """The model's tokenizer files as one zip archive, in chunks; the last carries its SHA-256."""
        if not self.text.model_info["has_tokenizer"]:
            await self.text.refuse(
                context, grpc.StatusCode.FAILED_PRECONDITION, "this model has no tokenizer"
            )
        data = await asyncio.to_thread(_tokenizer_zip, self.model_dir)
        digest = hashlib.sha256(data).hexdigest()
        for start in range(0, len(data), TOKENIZER_CHUNK_BYTES):
            end = start + TOKENIZER_CHUNK_BYTES
            last = end >= len(data)
            yield common_pb2.GetTokenizerChunk(data=data[start:end], sha256=digest if last else "")


def block_hash_id(digest: bytes) -> int:
    """A page's id as routers know it: the first 8 bytes of its digest, as vLLM's int64 hashes."""
    return int.from_bytes(digest[:8], "little", signed=True)


def _chains(stored: list[StoredBlock]) -> list[list[StoredBlock]]:
    """Runs of pages where each one's parent is the page before it (one request's new pages)."""
    runs: list[list[StoredBlock]] = []
    for block in stored:
        if runs and block.parent == runs[-1][-1].digest:
            runs[-1].append(block)
        else:
            runs.append([block])
    return runs


def _kv_event_batch(batch: KvBatch, page_size: int, *, complete: bool) -> Any:
    events = batch.events
    out: list[Any] = []
    if events.cleared:
        out.append(common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared()))
    for run in _chains(events.stored):
        stored = common_pb2.KvBlocksStored(
            blocks=[
                common_pb2.KvBlock(
                    block_hash=block_hash_id(b.digest), token_ids=b.token_ids, block_size=page_size
                )
                for b in run
            ]
        )
        if run[0].parent:
            stored.parent_block_hash = block_hash_id(run[0].parent)
        out.append(common_pb2.KvCacheEvent(stored=stored))
    if events.removed:
        removed = common_pb2.KvBlocksRemoved(block_hashes=[block_hash_id(d) for d in events.removed])
        out.append(common_pb2.KvCacheEvent(removed=removed))
    if not batch.snapshot:  # live events are numbered; synthesized (snapshot) ones are 0
        for i, event in enumerate(out, 1):
            event.event_id = (batch.sequence << 16) + i
    message = common_pb2.KvEventBatch(
        sequence_number=batch.sequence, timestamp=batch.timestamp, events=out, dp_rank=0
    )
    if batch.snapshot:
        message.snapshot.CopyFrom(
            common_pb2.KvSnapshotChunk(
                index=0, count=1, blocks=len(events.stored), unknown_before=0 if complete else 1
            )
        )
    return message


def _not_served(method: str) -> Any:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{SERVICE_NAME}/{method}: {NOT_SERVED[method]}")

    return refuse


def add_vllm_service(service: VllmEngineService, server: grpc.aio.Server) -> None:
    def impl(name: str) -> Any:
        return _not_served(name) if name in NOT_SERVED else getattr(service, name)

    register(server, vllm.DESCRIPTOR.services_by_name["VllmEngine"], impl)
