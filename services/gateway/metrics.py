"""Prometheus metrics, named after vLLM's under the `cbserve:` prefix.

Per-request figures (TTFT, inter-token latency, end-to-end latency, queue time, tokens) are observed
by the gateway as streams progress; the step profile arrives with the worker's step messages; load
figures (requests, KV usage, prefix cache, offloads) are asked of the worker at scrape time, so
they show the step that was running when the scrape came, as vLLM's do.

The HTTP port serves `/metrics` and, for load balancers that cannot speak gRPC health, `/health`
(200 SERVING or 503 NOT_SERVING, as grpc.health.v1 says); every other path is 404. Counters carry
no `_created` twin series, which doubled every counter and histogram for a start time that
`cbserve:build_info` and the process's own start already give. `cbserve:model_info` names the model
(its `model_name` label) for dashboards that join on it.
"""

from __future__ import annotations

import platform
import socket
import threading
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from types import MappingProxyType
from typing import Any
from urllib.parse import urlsplit

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from services.common.gateway_messages import Load, StepTimes

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
STEP_PHASES = ("schedule", "cache", "build", "forward", "sample", "wait", "emit")
# Parts of schedule and sample, observed only in steps that have constrained requests.
GRAMMAR_PHASES = ("grammar_advance", "grammar_fill", "grammar_apply")


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "unknown"


def _info(name: str, doc: str, labels: Mapping[str, str]) -> GaugeMetricFamily:
    """An info metric: a constant 1 whose labels carry the facts."""
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), 1)
    return family


class _LoadCollector(Collector):
    def __init__(
        self,
        load: Callable[[], Load],
        recovery: Callable[[], tuple[int, int]],
        streams: Callable[[], int],
        queue: Callable[[], tuple[int, int]],
        model: Mapping[str, str],
    ) -> None:
        self._load = load
        self._recovery = recovery
        self._streams = streams
        self._queue = queue
        self._build = {
            "version": _version("cbserve"),
            "python": platform.python_version(),
            "torch": _version("torch"),
            "transformers": _version("transformers"),
        }
        self._model = dict(model)

    def collect(self) -> Iterable[Metric]:
        yield _info("cbserve:build_info", "Versions of cbserve and of what it runs on.", self._build)
        if self._model:
            yield _info("cbserve:model_info", "The served model.", self._model)
        yield GaugeMetricFamily(
            "cbserve:gateway_streams", "Generate streams the gateway holds.", value=self._streams()
        )
        waiting, limit = self._queue()
        yield GaugeMetricFamily(
            "cbserve:gateway_waiting_streams",
            "Generate streams waiting for their first token.",
            value=waiting,
        )
        yield GaugeMetricFamily(
            "cbserve:max_queue_size",
            "Waiting streams beyond which calls get RESOURCE_EXHAUSTED (--max-queue-size).",
            value=limit,
        )
        resubmitted, recomputed = self._recovery()
        yield CounterMetricFamily(
            "cbserve:resubmitted_requests",
            "Requests re-submitted after their worker was lost.",
            value=resubmitted,
        )
        yield CounterMetricFamily(
            "cbserve:resubmit_recomputed_tokens",
            "Prompt tokens that re-submitted requests recomputed.",
            value=recomputed,
        )
        load = self._load()
        total = max(load.kv_blocks_total, 1)
        gauges = {
            "cbserve:num_requests_running": ("Requests being computed.", load.requests_running),
            "cbserve:num_requests_waiting": ("Requests queued or offloaded.", load.requests_waiting),
            "cbserve:kv_cache_usage_perc": (
                "Fraction of KV blocks held by requests.",
                load.kv_blocks_used / total,
            ),
            "cbserve:kv_cache_cached_blocks": (
                "KV blocks holding reclaimable cached prefixes.",
                load.kv_blocks_cached,
            ),
            "cbserve:kv_cache_total_blocks": ("KV blocks in the pool.", load.kv_blocks_total),
            "cbserve:kv_pool_bytes": ("Bytes of the KV pool.", load.kv_pool_bytes),
            "cbserve:kv_pool_committed_bytes": (
                "Bytes of the KV pool committed: all of it for a device "
                "or a prefaulted host pool, else those written at least "
                "once.",
                load.kv_pool_committed_bytes,
            ),
            "cbserve:host_available_bytes": (
                "Memory the host can still give (MemAvailable).",
                load.host_available_bytes,
            ),
            "cbserve:worker_streams": ("Requests the worker tracks for gateways.", load.worker_streams),
            "cbserve:cache_requests": ("Requests the cachemgr holds state for.", load.cache_requests),
            "cbserve:swap_pool_usage_perc": (
                "Fraction of swap-pool slots in use.",
                load.swap_slots_used / max(load.swap_slots_total, 1),
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "cbserve:prefix_cache_queries": (
                "Prompt tokens looked up in the prefix cache.",
                load.prefix_cache_queries,
            ),
            "cbserve:prefix_cache_hits": ("Prompt tokens found in the prefix cache.", load.prefix_cache_hits),
            "cbserve:num_preemptions": (
                "Requests preempted (offloaded or soft-reset).",
                load.offloads + load.soft_resets,
            ),
            "cbserve:offloads": ("Requests offloaded to the swap pool.", load.offloads),
            "cbserve:soft_resets": ("Requests soft-reset (recomputed later).", load.soft_resets),
            "cbserve:engine_steps": ("Engine steps run.", load.steps),
            "cbserve:computed_tokens": ("Tokens the model computed.", load.computed_tokens),
            "cbserve:forks": ("Choices of n > 1 requests started on their first's prompt KV.", load.forks),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


class GatewayMetrics:
    """`load`: the worker's load as of the call; `recovery`: (requests re-submitted, tokens they
    recomputed); `streams`: the gateway's open streams; `queue`: (streams waiting for a first token,
    their limit); `model`: the labels of `cbserve:model_info`; `serving`: what `/health` answers."""

    def __init__(
        self,
        load: Callable[[], Load],
        recovery: Callable[[], tuple[int, int]] = lambda: (0, 0),
        streams: Callable[[], int] = lambda: 0,
        *,
        queue: Callable[[], tuple[int, int]] = lambda: (0, 0),
        model: Mapping[str, str] = MappingProxyType({}),
        serving: Callable[[], bool] = lambda: False,
    ) -> None:
        prometheus_client.disable_created_metrics()
        self.serving = serving
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "cbserve:time_to_first_token_seconds",
            "Arrival to first token.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "cbserve:inter_token_latency_seconds",
            "Time between a stream's tokens.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "cbserve:e2e_request_latency_seconds",
            "Arrival to final message.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "cbserve:request_queue_time_seconds",
            "Arrival at the worker to first step.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.step = Histogram(
            "cbserve:step_time_seconds",
            "Worker step time by phase.",
            ["phase"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("cbserve:prompt_tokens", "Prompt tokens of requests.", registry=r)
        self.generation_tokens = Counter("cbserve:generation_tokens", "Generated tokens.", registry=r)
        self.requests = Counter(
            "cbserve:request_success", "Finished requests by reason.", ["finished_reason"], registry=r
        )
        self.errors = Counter(
            "cbserve:request_errors", "Requests ended by a gRPC error status.", ["code"], registry=r
        )
        r.register(_LoadCollector(load, recovery, streams, queue, model))
        self._server: ThreadingHTTPServer | None = None

    def observe_step(self, times: StepTimes) -> None:
        for phase in STEP_PHASES:
            self.step.labels(phase).observe(getattr(times, phase))
        if times.grammar_advance or times.grammar_fill or times.grammar_apply:
            for phase in GRAMMAR_PHASES:
                self.step.labels(phase).observe(getattr(times, phase))
        self.step.labels("total").observe(times.total)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve `/metrics` and `/health` on a thread of their own; OSError if the port is taken."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server_class = type("MetricsServer", (ThreadingHTTPServer,), {"address_family": family})
        handler = type("Handler", (_Handler,), {"metrics": self})
        self._server = server_class((host, port), handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True).start()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    metrics: GatewayMetrics

    def do_GET(self) -> None:
        self._answer(with_body=True)

    def do_HEAD(self) -> None:
        self._answer(with_body=False)

    def _answer(self, with_body: bool) -> None:
        path = urlsplit(self.path).path
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            status, body = 200, encoder(self.metrics.registry)
        elif path == "/health":
            serving = self.metrics.serving()
            status, content_type = (200 if serving else 503), "text/plain; charset=utf-8"
            body = b"SERVING\n" if serving else b"NOT_SERVING\n"
        else:
            status, content_type = 404, "text/plain; charset=utf-8"
            body = b"not found: try /metrics or /health\n"
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if with_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # an access line per scrape would flood the logs, and not as JSON
