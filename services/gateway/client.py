"""A small synchronous client of the public API: `cbserve generate`, `cbserve health`, benchmarks."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.api import pb, pb_grpc


@dataclass(frozen=True)
class Credentials:
    """What a client shows a gateway: TLS trust (and a certificate, for mutual TLS) and an API key.
    PEM contents, not paths; `tls` with no root certificates trusts the system's CAs."""

    tls: bool = False
    root_certificates: bytes | None = None
    certificate_chain: bytes | None = None
    private_key: bytes | None = field(default=None, repr=False)
    server_name: str | None = None  # the name the server's certificate must carry, if not the target's host
    api_key: str | None = field(default=None, repr=False)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else ()


def channel(target: str, credentials: Credentials = Credentials()) -> grpc.Channel:
    options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", 16 << 20)]
    if not credentials.tls:
        return grpc.insecure_channel(target, options=options)
    if credentials.server_name:
        options.append(("grpc.ssl_target_name_override", credentials.server_name))
    tls = grpc.ssl_channel_credentials(
        credentials.root_certificates, credentials.private_key, credentials.certificate_chain
    )
    return grpc.secure_channel(target, tls, options=options)


def health_status(
    target: str, service: str = "", timeout_s: float = 5.0, credentials: Credentials = Credentials()
) -> str:
    """The health service's status name for `service` ("" = the server as a whole)."""
    with channel(target, credentials) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        request = health_pb2.HealthCheckRequest(service=service)
        # types-grpcio-health-checking's HealthStub omits the methods the generated __init__ sets.
        reply = stub.Check(  # type: ignore[attr-defined]
            request, timeout=timeout_s, metadata=credentials.metadata()
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def generate(
    stub: Any, request: Any, *, timeout_s: float | None = None, metadata: Sequence[tuple[str, str]] = ()
) -> Iterator[Any]:
    return stub.Generate(request, timeout=timeout_s, metadata=tuple(metadata))


def completion_request(
    prompt: str,
    *,
    chat: bool = False,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    stops: Sequence[str] = (),
    ignore_eos: bool = False,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    priority: int = 0,
    cache_salt: str = "",
) -> Any:
    """A GenerateRequest for `prompt` (text, or one user message with `chat`); None leaves a field
    unset, so that the server's default applies."""
    request = pb.GenerateRequest(priority=priority, cache_salt=cache_salt)
    if chat:
        request.chat.messages.append(pb.ChatMessage(role="user", content=prompt))
    else:
        request.text = prompt
    for name, value in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("min_p", min_p),
        ("seed", seed),
    ):
        if value is not None:
            setattr(request.sampling, name, value)
    if max_tokens is not None:
        request.stopping.max_tokens = max_tokens
    request.stopping.stop.extend(stops)
    request.stopping.ignore_eos = ignore_eos
    if logprobs is not None:
        request.output.logprobs = logprobs
    if prompt_logprobs is not None:
        request.output.prompt_logprobs = prompt_logprobs
    return request


def stream_to(
    target: str, request: Any, *, out: TextIO | None = None, credentials: Credentials = Credentials()
) -> tuple[Any, list[Any], list[Any]]:
    """Stream one completion's text to `out` (default: the `sys.stdout` of the moment, not of import
    time, which a test's capture may have replaced since); returns the final message (None if the
    stream was cut short), the tokens' logprobs and the prompt's, where the request asked for them."""
    out = out if out is not None else sys.stdout
    final, logprobs, prompt_logprobs = None, [], []
    try:
        with channel(target, credentials) as ch:
            stub = pb_grpc.TextGenerationStub(ch)
            for response in generate(stub, request, metadata=credentials.metadata()):
                if response.HasField("chunk"):
                    out.write(response.chunk.text)
                    out.flush()
                    logprobs += response.chunk.logprobs
                    prompt_logprobs += response.chunk.prompt_logprobs
                else:
                    final = response.final
    finally:  # also on Ctrl-C: the shell's prompt starts on a line of its own
        out.write("\n")
        out.flush()
    return final, logprobs, prompt_logprobs


def print_logprobs(logprobs: Sequence[Any], out: TextIO) -> None:
    """One line per token (generated, or of the prompt): its logprob and text, then the most likely
    alternatives."""
    for lp in logprobs:
        top = ", ".join(f"{t.token!r} {t.logprob:.3f}" for t in lp.top)
        out.write(f"{lp.logprob:9.4f}  {lp.token!r}" + (f"  [{top}]" if top else "") + "\n")
