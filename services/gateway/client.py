"""A small synchronous client of the public API: `cbserve generate`, `cbserve health`, benchmarks."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.api import pb, pb_grpc


def channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target, options=[("grpc.max_receive_message_length", 16 << 20)])


def health_status(target: str, service: str = "", timeout_s: float = 5.0) -> str:
    """The health service's status name for `service` ("" = the server as a whole)."""
    with channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def generate(
    stub: Any, request: Any, *, timeout_s: float | None = None, metadata: Sequence[tuple[str, str]] = ()
) -> Iterator[Any]:
    return stub.Generate(request, timeout=timeout_s, metadata=tuple(metadata))


def stream_to(
    target: str,
    prompt: str,
    *,
    chat: bool,
    max_tokens: int | None,
    temperature: float,
    seed: int | None,
    stops: Sequence[str],
    out: TextIO = sys.stdout,
) -> Any:
    """Stream one completion's text to `out`; returns the final message."""
    request = pb.GenerateRequest()
    if chat:
        request.chat.messages.append(pb.ChatMessage(role="user", content=prompt))
    else:
        request.text = prompt
    request.sampling.temperature = temperature
    if seed is not None:
        request.sampling.seed = seed
    if max_tokens is not None:
        request.stopping.max_tokens = max_tokens
    request.stopping.stop.extend(stops)
    final = None
    with channel(target) as ch:
        for response in generate(pb_grpc.TextGenerationStub(ch), request):
            if response.HasField("chunk"):
                out.write(response.chunk.text)
                out.flush()
            else:
                final = response.final
    out.write("\n")
    return final
