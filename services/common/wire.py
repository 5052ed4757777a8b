"""Reading ZMQ messages: decode into the link's typed structs or drop, never fail the reader."""

from __future__ import annotations

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
