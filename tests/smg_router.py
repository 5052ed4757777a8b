"""smg, the router, in front of cbserve stacks: a stack that `cbserve up --http-port` starts with smg as
its fourth child, waiting until smg is ready with its workers, and the official OpenAI client on smg's
HTTP port."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai

from services.supervisor import free_port
from tests.conftest import TINY_STACK_SETTINGS
from tests.stack import CALL_TIMEOUT_S, Stack

ROUTER_START_S = 60.0


def router_status(http_port: int) -> dict[str, Any] | None:
    """smg's /readiness answer once it is ready (some worker registered and healthy), else None."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readiness", timeout=2) as reply:
            return json.loads(reply.read())
    except OSError:  # refused, or 503 while no worker is ready
        return None


def wait_router(http_port: int, healthy: int = 1, timeout_s: float = ROUTER_START_S) -> None:
    deadline = time.monotonic() + timeout_s
    while (status := router_status(http_port)) is None or status.get("healthy_workers") != healthy:
        assert time.monotonic() < deadline, f"smg on {http_port} not ready with {healthy} workers: {status}"
        time.sleep(0.5)


def client(http_port: int) -> openai.OpenAI:
    # No retries of the client's own: what must recover is smg.
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0, timeout=CALL_TIMEOUT_S
    )


@contextlib.contextmanager
def routed_stack(model: Path, log_dir: Path) -> Iterator[tuple[Stack, int]]:
    """`cbserve up --http-port` on `model`, smg ready: (the stack, smg's HTTP port)."""
    http = free_port()
    up_args = ["--http-port", str(http), "--router-metrics-port", str(free_port())]
    stack = Stack(model, log_dir, up_args=up_args, **TINY_STACK_SETTINGS)
    try:
        wait_router(http)
        yield stack, http
    finally:
        stack.stop()
