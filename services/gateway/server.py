"""The gateway process: wires the gRPC services (text_generation.py's cbserve.v1, vllm_engine.py's
VllmEngine for smg), health, reflection and metrics to one worker client, and runs them until a signal,
then drains.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import ready_file
from services.common.cli_args import CONFIG_ERROR_EXIT
from services.common.gateway_messages import WorkerFacts
from services.common.wire import internal_key
from services.gateway.api import SERVICE_NAME
from services.gateway.metrics import GatewayMetrics
from services.gateway.security import Access, AccessInterceptor
from services.gateway.settings import GatewaySettings
from services.gateway.text_generation import TextGenerationService, add_service
from services.gateway.vllm_engine import GENERATE_METHOD as VLLM_GENERATE
from services.gateway.vllm_engine import SERVICE_NAME as VLLM_SERVICE
from services.gateway.vllm_engine import VllmEngineService, add_vllm_service
from services.gateway.worker_client import WorkerClient

log = structlog.get_logger(__name__)

HEALTH_SERVICES = ("", SERVICE_NAME)
# How long the `serving` line waits for the HTTP endpoint in front (the router registers this gateway
# once it serves), and how often it asks.
HTTP_ANNOUNCE_TIMEOUT_S = 60.0
HTTP_POLL_S = 0.25
HEALTH_SERVICE: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _model_info(model_dir: str, name: str | None) -> tuple[Any, dict[str, Any]]:
    """The tokenizer (None if the model has none) and ModelInfo's static fields. The model is
    `name`, else its directory's name: clients are not told where it lies on the server."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from services.common.model_source import has_tokenizer

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    tokenizer = None
    if has_tokenizer(Path(model_dir)):
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    try:
        eos = GenerationConfig.from_pretrained(model_dir, local_files_only=True).eos_token_id
    except OSError:
        eos = None
    eos = config.eos_token_id if eos is None else eos
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, list | tuple) else [eos]
    return tokenizer, {
        "model_id": name or Path(model_dir).name,
        "architecture": (config.architectures or [""])[0],
        "eos_token_ids": eos_ids,
        "has_tokenizer": tokenizer is not None,
        "has_chat_template": getattr(tokenizer, "chat_template", None) is not None,
    }


async def _announce(
    model: str, address: str, metrics: str | None, facts: WorkerFacts, http_url: str | None
) -> None:
    """The stack serves: one line for the person who started it (stdout), and its facts in the log.
    With an HTTP endpoint in front (`http_url`), only once it lists the model: a line that names a
    port must not come before that port answers."""
    if http_url is not None:
        listed = await _http_lists_model(http_url, HTTP_ANNOUNCE_TIMEOUT_S)
        if not listed:
            log.warning(
                "the HTTP endpoint lists no model yet", url=http_url, waited_s=HTTP_ANNOUNCE_TIMEOUT_S
            )
    tokens = facts.total_blocks * facts.page_size
    pool = f"KV cache {facts.total_blocks:,} blocks = {tokens:,} tokens"
    about = [facts.kv_dtype] if facts.kv_dtype else []
    if facts.kv_bytes:
        gib = facts.kv_bytes / (1 << 30)
        about.insert(0, f"{gib:.1f} GiB" if gib >= 1 else f"{facts.kv_bytes / (1 << 20):.0f} MiB")
    pool += f" ({', '.join(about)})" if about else ""
    where = f", OpenAI HTTP on {http_url}" if http_url else ""
    where += f", metrics on http://{metrics}/metrics" if metrics else ""
    print(f"serving {model} in {facts.dtype} on {address}{where}; {pool}", flush=True)
    log.info(
        "stack serving",
        model=model,
        address=address,
        metrics=metrics,
        kv_blocks=facts.total_blocks,
        kv_tokens=tokens,
        kv_bytes=facts.kv_bytes,
        device=facts.device,
        dtype=facts.dtype,
    )


async def _http_lists_model(url: str, timeout_s: float) -> bool:
    """Whether `url`/v1/models lists a model within `timeout_s` (asked every HTTP_POLL_S)."""
    import json
    import urllib.request

    def lists() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=HTTP_POLL_S) as answer:
                return bool(json.load(answer).get("data"))
        except (OSError, ValueError):  # not listening yet, an error status, or no JSON
            return False

    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(lists):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(HTTP_POLL_S)
    return True


def _interceptors(access: Access, service: TextGenerationService) -> list[grpc.aio.ServerInterceptor]:
    if access.keys is None:
        return []
    open_services = [HEALTH_SERVICE] if access.open_health else []
    open_services += [reflection.SERVICE_NAME] if access.open_reflection else []
    return [
        AccessInterceptor(
            access,
            open_services=open_services,
            stream_methods=[f"/{SERVICE_NAME}/Generate", VLLM_GENERATE],
            on_refused=service.count_refusal,
        )
    ]


async def serve(
    model: str | None,
    worker_address: str,
    host: str,
    port: int,
    metrics_port: int | None,
    settings: GatewaySettings,
) -> None:
    from services.common.model_source import resolve_model

    model_dir = str(resolve_model(model))
    tokenizer, info = _model_info(model_dir, settings.served_model_name)
    health_servicer = health.aio.HealthServicer()
    for name in HEALTH_SERVICES:
        await health_servicer.set(name, NOT_SERVING)
    service: TextGenerationService | None = None
    announced = False
    pending: set[asyncio.Task[None]] = set()  # held until done: the loop keeps only weak references

    def spawn(work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        pending.add(task)
        task.add_done_callback(pending.discard)

    ready_file.mark(settings.ready_path, False)  # a killed predecessor's

    def serving() -> bool:
        return client.ready and not (service is not None and service.draining)

    def on_ready_change(ready: bool) -> None:
        nonlocal announced
        status = SERVING if serving() else NOT_SERVING
        for name in HEALTH_SERVICES:
            spawn(health_servicer.set(name, status))
        ready_file.mark(settings.ready_path, status == SERVING)
        if status == SERVING and not announced and client.facts is not None:
            announced = True
            metrics_address = f"{host}:{metrics_port}" if metrics_port else None
            spawn(
                _announce(
                    info["model_id"], f"{host}:{bound}", metrics_address, client.facts, settings.http_url
                )
            )

    metrics: GatewayMetrics
    client = WorkerClient(
        worker_address,
        worker_timeout_s=settings.worker_timeout_s,
        resubmit_timeout_s=settings.resubmit_timeout_s,
        key=internal_key(),
        on_ready_change=on_ready_change,
        on_step=lambda times: metrics.observe_step(times),
    )
    metrics = GatewayMetrics(
        client.load_now,
        lambda: (client.resubmitted, client.recomputed_tokens),
        lambda: client.in_flight,
        queue=lambda: (service.waiting if service is not None else 0, settings.max_queue_size),
        model={"model_name": info["model_id"], "architecture": info["architecture"]},
        serving=serving,
    )
    service = TextGenerationService(client, tokenizer, info, settings, metrics)
    server = grpc.aio.server(
        interceptors=_interceptors(settings.access, service),
        options=[
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
            ("grpc.keepalive_time_ms", int(settings.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(settings.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            # grpc shares a port with any process that also asks for SO_REUSEPORT, so a second
            # gateway on the same port would serve half the connections instead of failing.
            ("grpc.so_reuseport", 0),
        ],
    )
    add_service(service, server)
    add_vllm_service(VllmEngineService(service, Path(model_dir)), server)  # the SMG worker protocol
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, VLLM_SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), server
    )
    # Probes that cannot do TLS or present a client certificate (Kubernetes' gRPC probes, a compose
    # healthcheck) get the health service alone on a port of its own.
    health_server = grpc.aio.server() if settings.health_port is not None else None
    if health_server is not None:
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, health_server)
    try:
        address = f"{host}:{port}"
        if settings.tls is not None:
            bound = server.add_secure_port(address, settings.tls.credentials())
        else:
            bound = server.add_insecure_port(address)
        if bound == 0:
            raise OSError(f"cannot listen on {address}")
        health_address = f"{host}:{settings.health_port}"
        if health_server is not None and health_server.add_insecure_port(health_address) == 0:
            raise OSError(f"cannot listen on {health_address}")
        if metrics_port is not None:
            metrics.serve(metrics_port, host)
    except (RuntimeError, OSError) as exc:
        # A port in use (or not ours to bind) stays so: exit as a configuration error, which a
        # supervisor does not answer with a restart.
        log.error(
            "cannot listen",
            host=host,
            port=port,
            metrics_port=metrics_port,
            health_port=settings.health_port,
            error=str(exc),
        )
        raise SystemExit(CONFIG_ERROR_EXIT) from None
    await server.start()
    if health_server is not None:
        await health_server.start()
    await client.start()
    if settings.access.keys is not None and settings.tls is None:
        log.warning("API keys are checked on a plaintext port: they cross the network readable")
    log.info(
        "gateway listening",
        host=host,
        port=bound,
        metrics_port=metrics_port,
        worker=worker_address,
        tls=settings.tls.mode if settings.tls is not None else "off",
        api_keys=len(settings.access.keys or ()),
        health_port=settings.health_port,
    )

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    # Drain: health turns NOT_SERVING at once (load balancers stop routing here), new calls get
    # UNAVAILABLE, and the streams in flight may finish within the grace period.
    service.draining = True
    ready_file.mark(settings.ready_path, False)
    await health_servicer.enter_graceful_shutdown()
    log.info("gateway draining", in_flight=service.active, grace_s=settings.drain_grace_s)
    deadline = time.monotonic() + settings.drain_grace_s
    while service.active and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await server.stop(grace=1.0)
    if health_server is not None:
        await health_server.stop(grace=None)
    await client.close()
    metrics.close()
    log.info("gateway stopped", unfinished=service.active)
