"""The servers `cbserve bench serve` drives: what a backend does for the driver (`Backend`), cbserve's
own gRPC API (`--backend cbserve`, here) and OpenAI-compatible HTTP (`--backend openai`,
openai_backend.py). The driver, the workloads and the report are the same for both.

A backend sends one request and records what its stream does in the request's `RequestRecord`: the
client time of each chunk carrying tokens and their count, then what the server says at the end
(finish reason, usage, server timings). A request the server refuses or breaks off raises
`RequestFailed` with a code naming how; cancellation (the phase's time limit) closes the call.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from services.bench.serve.report import RequestRecord
from services.bench.serve.workloads import BenchRequest

if TYPE_CHECKING:
    from services.common.sampling_params import Constraint

DEFAULT_GRPC_TARGET = "127.0.0.1:50051"


class BackendError(Exception):
    """The server cannot be benchmarked: unreachable, or it refused the calls the run starts with."""


class RequestFailed(BackendError):
    """The server refused or broke off one request: `code` is a gRPC status name, or for HTTP one of
    HTTP_<status>, CONNECTION_ERROR, TRUNCATED, BAD_STREAM, STREAM_ERROR, DEADLINE_EXCEEDED."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


@dataclass(frozen=True)
class ServerInfo:
    """What the workloads need to know of the served model; `facts` go into the JSON report."""

    vocab_size: int
    max_model_len: int | None  # None: unknown, the server checks each request itself
    facts: dict[str, Any]


class Backend(Protocol):
    description: str  # which server, how reached: the report's "backend"
    load_source: str | None  # where `load` reads from; None: the server's load is unknown
    load_settle_s: float  # how stale `load` may be: 0 when it is taken at the moment it is asked

    async def info(self) -> ServerInfo: ...

    async def stream(self, req: BenchRequest, record: RequestRecord, now: Callable[[], float]) -> None:
        """Sends `req` and records its stream in `record` (times from `now`); RequestFailed."""

    async def load(self, timeout_s: float) -> dict[str, int] | None:
        """GetLoad's figures now (see metrics.py), or None when they cannot be had this time."""


def request_seed(args: argparse.Namespace, req: BenchRequest) -> int:
    """A sampled request's seed, so that its output is reproducible (below 2**63: OpenAI's is signed)."""
    return (args.seed * 1_000_003 + req.index) % 2**63


# ----------------------------------------------------------------------------------- cbserve gRPC


class GrpcBackend:
    """cbserve's TextGeneration API over one channel: token-id prompts, the run's `cache_salt`."""

    load_source: str | None = "GetLoad"  # typed as Backend's: a protocol's plain attribute is invariant
    load_settle_s = 0.0  # the worker answers GetLoad between steps, with its figures of that moment

    def __init__(self, stub: Any, args: argparse.Namespace) -> None:
        self.stub, self.args = stub, args
        self.description = f"cbserve gRPC {args.target}"

    async def info(self) -> ServerInfo:
        import grpc

        from services.gateway.api import pb

        try:
            info = await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        except grpc.aio.AioRpcError as exc:
            raise BackendError(f"{self.args.target}: {exc.code().name}: {exc.details()}") from exc
        facts = {f.name: getattr(info, f.name) for f in info.DESCRIPTOR.fields}
        facts["eos_token_ids"] = list(info.eos_token_ids)
        return ServerInfo(info.vocab_size, info.max_model_len, facts)

    async def stream(self, req: BenchRequest, record: RequestRecord, now: Callable[[], float]) -> None:
        import asyncio

        import grpc

        call = self.stub.Generate(generate_request(req, self.args), timeout=self.args.request_timeout)
        try:
            async for response in call:
                if response.HasField("chunk"):
                    if response.chunk.token_ids:
                        record.chunk_times.append(now())
                        record.chunk_tokens.append(len(response.chunk.token_ids))
                else:
                    _record_final(record, response.final)
        except asyncio.CancelledError:
            call.cancel()  # the gateway aborts the request and frees its blocks
            raise
        except grpc.aio.AioRpcError as exc:
            raise RequestFailed(exc.code().name, exc.details() or "") from exc

    async def load(self, timeout_s: float) -> dict[str, int] | None:
        import grpc

        from services.gateway.api import pb

        try:
            load = await self.stub.GetLoad(pb.GetLoadRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return None
        return {f.name: int(getattr(load, f.name)) for f in load.DESCRIPTOR.fields}


def generate_request(req: BenchRequest, args: argparse.Namespace) -> Any:
    from services.gateway.api import pb

    request = pb.GenerateRequest(request_id=f"bench-{req.kind}-{req.index}")
    if req.token_ids is not None:
        request.token_ids.ids.extend(req.token_ids)
    else:
        request.text = req.text or ""
    request.sampling.temperature = args.temperature
    if args.temperature > 0:
        request.sampling.seed = request_seed(args, req)
    if req.max_tokens is not None:
        request.stopping.max_tokens = req.max_tokens
    request.stopping.ignore_eos = args.ignore_eos
    if args.n > 1:
        request.sampling.n = args.n
    if args.constraint is not None:
        _constrain(request.sampling, args.constraint.constraint)
    request.output.token_ids = True
    request.cache_salt = args.cache_salt or ""
    return request


def _constrain(sampling: Any, constraint: Constraint) -> None:
    """Set cbserve.v1's `constraint` oneof of `sampling` (a SamplingParams message) to `constraint`."""
    if constraint.kind == "json_object":
        sampling.json_object = True
    elif constraint.kind == "choice":
        sampling.choice.choices.extend(json.loads(constraint.text))
    else:
        setattr(sampling, constraint.kind, constraint.text)


def _record_final(record: RequestRecord, final: Any) -> None:
    from services.gateway.api import pb

    record.finish_reason = pb.FinishReason.Name(final.finish_reason)
    record.prompt_tokens = final.usage.prompt_tokens
    record.cached_prompt_tokens = final.usage.cached_prompt_tokens
    record.server_ttft = final.timings.time_to_first_token_seconds
    record.server_queue = final.timings.queue_seconds
