"""Reading ZMQ messages: decode into the link's typed structs or drop, never fail the reader; and the
internal key that tells this stack's peers from strangers."""

from __future__ import annotations

import hmac
import os
from typing import Any

import msgspec
import structlog

log = structlog.get_logger(__name__)


def decode_or_drop(decoder: msgspec.msgpack.Decoder[Any], payload: bytes, peer: str, version: int) -> Any:
    """The message, or None (logged) when it does not decode or speaks another protocol version:
    garbage, truncated frames or a foreign sender on an internal socket cost a log line, nothing more."""
    try:
        message = decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning(f"dropped an undecodable {peer} message", size=len(payload), error=str(exc))
        return None
    if message.version != version:
        log.warning(f"dropped a {peer} message of another version", version=message.version)
        return None
    return message


INTERNAL_KEY_ENV = "CBSERVE_INTERNAL_KEY"


def internal_key() -> str:
    """This stack's shared secret, which every connecting peer presents on the internal sockets.

    The cachemgr and the worker bind sockets that anyone who reaches the address can connect to; a
    stranger's `Attach` would be handed the KV pool. The key comes from the environment, never a flag,
    so it does not show in `ps`. `cbserve up` makes a fresh one; empty means no check (warned)."""
    key = os.environ.get(INTERNAL_KEY_ENV, "")
    if not key:
        log.warning(f"{INTERNAL_KEY_ENV} is not set: any peer that reaches the internal sockets is trusted")
    return key


def key_matches(expected: str, presented: str) -> bool:
    # Constant time, so that the key cannot be guessed byte by byte from reply timings.
    return not expected or hmac.compare_digest(expected.encode(), presented.encode())
