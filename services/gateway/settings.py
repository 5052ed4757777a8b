"""The gateway's settings: admission, draining, message and connection limits, TLS and keys."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.gateway.inputs import Limits
from services.gateway.security import Access, TlsFiles


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
    ready_path: Path | None = None  # a file that exists while the gateway serves (common/ready_file.py)
    # The OpenAI HTTP endpoint in front of this gateway (`cbserve up --http-port`), or None: the
    # `serving` line waits until it lists the model, and names it.
    http_url: str | None = None
