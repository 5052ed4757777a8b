"""Prometheus metrics, named after vLLM's under the `cbserve:` prefix.

Per-request figures (TTFT, inter-token latency, end-to-end latency, queue time, tokens) are observed
by the gateway as streams progress; the step profile arrives with the worker's step messages; load
figures (requests, KV usage, prefix cache, offloads) are read from the worker's latest status at
scrape time, so they never go stale between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.gateway_messages import Load, StepTimes

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
STEP_PHASES = ("schedule", "cache", "build", "forward", "sample", "emit")


class _LoadCollector(Collector):
    def __init__(
        self, load: Callable[[], Load], recovery: Callable[[], tuple[int, int]], streams: Callable[[], int]
    ) -> None:
        self._load = load
        self._recovery = recovery
        self._streams = streams

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("cbserve:gateway_streams", "Generate streams the gateway holds.",
                                value=self._streams())  # fmt: skip
        resubmitted, recomputed = self._recovery()
        yield CounterMetricFamily(
            "cbserve:resubmitted_requests",
            "Requests re-submitted after their worker was lost.",
            value=resubmitted,
        )
        yield CounterMetricFamily("cbserve:resubmit_recomputed_tokens",
                                  "Prompt tokens that re-submitted requests recomputed.",
                                  value=recomputed)  # fmt: skip
        load = self._load()
        total = max(load.kv_blocks_total, 1)
        gauges = {
            "cbserve:num_requests_running": ("Requests being computed.", load.requests_running),
            "cbserve:num_requests_waiting": ("Requests queued or offloaded.", load.requests_waiting),
            "cbserve:kv_cache_usage_perc": ("Fraction of KV blocks held by requests.",
                                            load.kv_blocks_used / total),
            "cbserve:kv_cache_cached_blocks": ("KV blocks holding reclaimable cached prefixes.",
                                               load.kv_blocks_cached),
            "cbserve:kv_cache_total_blocks": ("KV blocks in the pool.", load.kv_blocks_total),
            "cbserve:worker_streams": ("Requests the worker tracks for gateways.", load.worker_streams),
            "cbserve:cache_requests": ("Requests the cachemgr holds state for.", load.cache_requests),
            "cbserve:swap_pool_usage_perc": ("Fraction of swap-pool slots in use.",
                                             load.swap_slots_used / max(load.swap_slots_total, 1)),
        }  # fmt: skip
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        counters = {
            "cbserve:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.",
                                             load.prefix_cache_queries),
            "cbserve:prefix_cache_hits": ("Prompt tokens found in the prefix cache.", load.prefix_cache_hits),
            "cbserve:num_preemptions": ("Requests preempted (offloaded or soft-reset).",
                                        load.offloads + load.soft_resets),
            "cbserve:offloads": ("Requests offloaded to the swap pool.", load.offloads),
            "cbserve:soft_resets": ("Requests soft-reset (recomputed later).", load.soft_resets),
            "cbserve:engine_steps": ("Engine steps run.", load.steps),
        }  # fmt: skip
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(name, doc, value=value)


class GatewayMetrics:
    """`load`: the worker's latest load; `recovery`: (requests re-submitted, tokens they recomputed);
    `streams`: the gateway's open streams."""

    def __init__(
        self,
        load: Callable[[], Load],
        recovery: Callable[[], tuple[int, int]] = lambda: (0, 0),
        streams: Callable[[], int] = lambda: 0,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("cbserve:time_to_first_token_seconds", "Arrival to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("cbserve:inter_token_latency_seconds", "Time between a stream's tokens.",
                             buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.e2e = Histogram("cbserve:e2e_request_latency_seconds", "Arrival to final message.",
                             buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.queue = Histogram("cbserve:request_queue_time_seconds", "Arrival at the worker to first step.",
                               buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.step = Histogram("cbserve:step_time_seconds", "Worker step time by phase.", ["phase"],
                              buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.prompt_tokens = Counter("cbserve:prompt_tokens", "Prompt tokens of requests.", registry=r)
        self.generation_tokens = Counter("cbserve:generation_tokens", "Generated tokens.", registry=r)
        self.requests = Counter("cbserve:request_success", "Finished requests by reason.",
                                ["finished_reason"], registry=r)  # fmt: skip
        self.errors = Counter("cbserve:request_errors", "Requests ended by a gRPC error status.",
                              ["code"], registry=r)  # fmt: skip
        r.register(_LoadCollector(load, recovery, streams))

    def observe_step(self, times: StepTimes) -> None:
        for phase in STEP_PHASES:
            self.step.labels(phase).observe(getattr(times, phase))
        self.step.labels("total").observe(sum(getattr(times, phase) for phase in STEP_PHASES))

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)
