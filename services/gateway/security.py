"""Who may use the public port: TLS (optionally with client certificates) and API keys.

TLS is the port's: `TlsFiles` are checked when the command starts (a key that does not match its
certificate is a configuration error, not a handshake failure on the first call) and become the
server's credentials. API keys are the calls': `AccessInterceptor` reads `authorization: Bearer KEY`
from every call's metadata before the call's handler runs, so a call without a valid key is refused
UNAUTHENTICATED before its request is even parsed. Health and reflection may stay open to anyone
who completes the TLS handshake (probes and tools hold no key).

Keys are kept as SHA-256 digests only and compared with `hmac.compare_digest` against every
configured digest, so that neither the position of a wrong byte nor a key's length shows in the
reply time. A key is named in logs by its place in the configuration (`key#2`), never by any part
of its value.

The same interceptor bounds each key's concurrent generation streams (`max_streams_per_key`): a
key that holds that many gets RESOURCE_EXHAUSTED for the next one, while every other key is served.
"""

from __future__ import annotations

import hashlib
import hmac
import ssl
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc

# What a key may hold: visible ASCII (what gRPC metadata carries) but the comma, which separates keys
# in CBSERVE_API_KEYS, and nothing that would be trimmed away as white space.
_KEY_CHARS = frozenset(chr(c) for c in range(0x21, 0x7F)) - {","}

Refused = Callable[[grpc.StatusCode, str, str], None]  # (code, details, key label or "")


class ConfigError(ValueError):
    """A setting of the public port that cannot work; the command ends with a usage error."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of the gateway's TLS port; with `client_ca`, clients must present a certificate
    issued by it (mutual TLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    @property
    def mode(self) -> str:
        return "mutual" if self.client_ca is not None else "server"

    def check(self) -> None:
        """Raise ConfigError unless the files exist, parse, and the key belongs to the certificate."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"--tls-cert {self.cert} / --tls-key {self.key}: {exc}") from None
        if self.client_ca is not None:
            try:
                context.load_verify_locations(cafile=self.client_ca)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"--tls-client-ca {self.client_ca}: {exc}") from None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.client_ca.read_bytes() if self.client_ca is not None else None,
            require_client_auth=self.client_ca is not None,
        )


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The keys a caller may present; holds only their digests, so no repr or log can show one."""

    def __init__(self, keys: Iterable[str]) -> None:
        digests: list[bytes] = []
        for number, key in enumerate(keys, 1):
            if not key or not set(key) <= _KEY_CHARS:
                raise ConfigError(
                    f"API key #{number} is empty or holds a character other than visible ASCII "
                    "(no spaces, no commas)"
                )
            if _digest(key) not in digests:
                digests.append(_digest(key))
        if not digests:
            raise ConfigError("no API key given")
        self._digests = tuple(digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self)} keys)"

    def identify(self, presented: str) -> str | None:
        """The label (`key#N`) of the configured key equal to `presented`, or None. Every configured
        digest is compared, whichever matches, so the time taken does not tell which one did."""
        digest = _digest(presented)
        found: str | None = None
        for number, expected in enumerate(self._digests, 1):
            if hmac.compare_digest(digest, expected) and found is None:
                found = f"key#{number}"
        return found


def split_keys(text: str) -> list[str]:
    """Keys as CBSERVE_API_KEYS lists them: separated by commas, white space around them ignored."""
    return [key.strip() for key in text.split(",") if key.strip()]


def read_key_file(path: Path) -> list[str]:
    """One key per line; blank lines and lines starting with `#` are skipped."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--api-key-file {path}: {exc}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ConfigError(f"--api-key-file {path} holds no key")
    return keys


@dataclass(frozen=True)
class Access:
    """Who may call what. `keys` None: no key is asked for (and no per-key limit can apply)."""

    keys: ApiKeys | None = None
    open_health: bool = True
    open_reflection: bool = True
    max_streams_per_key: int = 0  # 0: no limit

    def __post_init__(self) -> None:
        if self.max_streams_per_key and self.keys is None:
            raise ConfigError("--max-streams-per-key needs API keys (--api-key or --api-key-file)")


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _refusal(handler: grpc.RpcMethodHandler | None, code: grpc.StatusCode, details: str) -> Any:
    """A handler of the same kind as `handler` that only ends the call with `code`. It has no request
    deserializer: the refused call's request is never parsed."""
    kind = (handler.request_streaming, handler.response_streaming) if handler is not None else (False, False)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    return _HANDLER_KINDS[kind](refuse)


class AccessInterceptor(grpc.aio.ServerInterceptor):
    def __init__(
        self,
        access: Access,
        *,
        open_services: Sequence[str],
        stream_methods: Sequence[str],
        on_refused: Refused,
    ) -> None:
        """`open_services`: full service names callable without a key. `stream_methods`: full method
        paths (`/pkg.Service/Method`, server-streaming) that count against `max_streams_per_key`."""
        self.access = access
        self.open_prefixes = tuple(f"/{name}/" for name in open_services)
        self.stream_methods = frozenset(stream_methods)
        self.on_refused = on_refused
        self.streams: Counter[str] = Counter()  # open streams per key label

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any] | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = await continuation(details)
        keys = self.access.keys
        if keys is None or details.method.startswith(self.open_prefixes):
            return handler
        label, problem = self._authenticate(keys, details.invocation_metadata or ())
        if label is None:
            self.on_refused(grpc.StatusCode.UNAUTHENTICATED, problem, "")
            return _refusal(handler, grpc.StatusCode.UNAUTHENTICATED, problem)
        if handler is not None and self.access.max_streams_per_key and details.method in self.stream_methods:
            return self._limited(handler, label)
        return handler

    @staticmethod
    def _authenticate(keys: ApiKeys, metadata: Sequence[tuple[str, Any]]) -> tuple[str | None, str]:
        """(key label, "") or (None, why the call is refused). The reason never echoes the key."""
        values = [value for name, value in metadata if name == "authorization"]
        if not values:
            return None, "missing API key: send `authorization: Bearer <key>` metadata"
        if len(values) > 1 or not isinstance(values[0], str):
            return None, "send exactly one `authorization: Bearer <key>` metadata entry"
        scheme, _, token = values[0].strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None, "the authorization metadata must read `Bearer <key>`"
        label = keys.identify(token.strip())
        return (label, "") if label is not None else (None, "invalid API key")

    def _limited(
        self, handler: grpc.RpcMethodHandler[Any, Any], label: str
    ) -> grpc.RpcMethodHandler[Any, Any]:
        """`handler` (server-streaming) counted against the key's open streams for as long as it
        runs; however the call ends, its count is returned."""
        limit = self.access.max_streams_per_key
        # grpc's stubs type a handler as the sync server's (an Iterator, grpc.ServicerContext); on the
        # aio server a server-streaming method is an async generator function of an aio context.
        behavior = cast(
            Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncGenerator[Any, None]],
            handler.unary_stream,
        )

        async def counted(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if self.streams[label] >= limit:
                details = f"this API key already has {limit} streams open (max_streams_per_key)"
                self.on_refused(grpc.StatusCode.RESOURCE_EXHAUSTED, details, label)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, details)
            self.streams[label] += 1
            try:
                # Closed here, however this generator ends, so that the stream's own clean-up (its
                # request aborted in the worker) never waits for the garbage collector.
                async with aclosing(behavior(request, context)) as responses:
                    async for response in responses:
                        yield response
            finally:
                self.streams[label] -= 1
                if not self.streams[label]:
                    del self.streams[label]

        return grpc.unary_stream_rpc_method_handler(
            counted,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
