"""What every gRPC service of the gateway registers its methods with: a message that does not parse is
the client's error (INVALID_ARGUMENT), not the server's (grpc's own deserializers make it UNKNOWN)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass


def parse_or_none(message_class: Any) -> Callable[[bytes], Any]:
    """A request deserializer that yields None instead of raising: grpc would answer UNKNOWN for a
    message that does not parse (bad wire format, invalid UTF-8); the handler answers INVALID_ARGUMENT."""

    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except DecodeError:
            return None

    return parse


def refuse_unparsed(method: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the request does not parse")
        return await method(request, context)

    return handler


def register(
    server: grpc.aio.Server, service: ServiceDescriptor, impl: Callable[[str], Callable[..., Any]]
) -> None:
    """Serve every method of `service` with `impl(method name)`, as the generated stubs would, but
    with requests parsed by `parse_or_none`: a unary method that gets an unparsed request answers
    INVALID_ARGUMENT here; a streaming one (a generator) checks for None itself."""
    handlers = {}
    for method in service.methods:
        if method.server_streaming:
            kind, handler = grpc.unary_stream_rpc_method_handler, impl(method.name)
        else:
            kind, handler = grpc.unary_unary_rpc_method_handler, refuse_unparsed(impl(method.name))
        handlers[method.name] = kind(
            handler,
            request_deserializer=parse_or_none(GetMessageClass(method.input_type)),
            response_serializer=GetMessageClass(method.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
