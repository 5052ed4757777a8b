"""What `cbserve bench serve` reads from a server's Prometheus endpoint (`--metrics-url`): the worker's
step profile (cbserve's step-time histogram) and, for a server reached over HTTP (no GetLoad), the
load figures GetLoad would give, from cbserve's metric names or vLLM's.

GetLoad's fields, from the metrics:
- requests running / waiting: `*:num_requests_running`, `*:num_requests_waiting`;
- KV blocks used: `*:kv_cache_usage_perc` (a fraction) times the pool's blocks, which cbserve gives as
  `cbserve:kv_cache_total_blocks` and vLLM as the `num_gpu_blocks` label of `vllm:cache_config_info`;
  a server with several engines (vLLM's `engine` label) adds up its engines;
- prefix cache queries / hits (prompt tokens looked up / found): `*:prefix_cache_{queries,hits}_total`;
- offloads and soft resets: cbserve's own counters; vLLM preempts by freeing the request's blocks and
  recomputing it later, what cbserve calls a soft reset, so `vllm:num_preemptions_total` counts as
  soft resets and vLLM has no offloads.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

STEP_METRIC = "cbserve:step_time_seconds"

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def scrape(url: str, timeout_s: float = 10.0) -> str:
    """The endpoint's text exposition; OSError when it cannot be had."""
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return reply.read().decode()


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each sample of a Prometheus text exposition."""
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is not None:
            yield match.group(1), dict(_LABEL.findall(match.group(2) or "")), float(match.group(3))


def parse_histogram(
    text: str, name: str = STEP_METRIC, label: str = "phase"
) -> dict[str, tuple[float, float]]:
    """{label value: (sum, count)} of a Prometheus histogram in the text exposition format."""
    totals: dict[str, list[float]] = {}
    for sample, labels, value in samples(text):
        if sample in (f"{name}_sum", f"{name}_count"):
            slot = 0 if sample.endswith("_sum") else 1
            totals.setdefault(labels.get(label, ""), [0.0, 0.0])[slot] = value
    return {k: (v[0], v[1]) for k, v in totals.items()}


@dataclass(frozen=True)
class LoadNames:
    """One server's names for GetLoad's figures. `blocks`: (metric, label) giving the pool's blocks,
    the sample's value when the label is None."""

    running: str
    waiting: str
    usage: str
    blocks: tuple[str, str | None]
    queries: str
    hits: str
    offloads: str | None
    soft_resets: str


CBSERVE_NAMES = LoadNames(
    "cbserve:num_requests_running",
    "cbserve:num_requests_waiting",
    "cbserve:kv_cache_usage_perc",
    ("cbserve:kv_cache_total_blocks", None),
    "cbserve:prefix_cache_queries_total",
    "cbserve:prefix_cache_hits_total",
    "cbserve:offloads_total",
    "cbserve:soft_resets_total",
)
VLLM_NAMES = LoadNames(
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    ("vllm:cache_config_info", "num_gpu_blocks"),
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    None,
    "vllm:num_preemptions_total",
)


def parse_load(text: str) -> dict[str, int] | None:
    """GetLoad's figures that the report reads (KV blocks, requests, prefix cache, preemptions),
    from cbserve's or vLLM's metrics; None when the text has neither's (another server, a router's
    own metrics)."""
    totals: dict[str, float] = {}
    by_engine: dict[str, dict[str, float]] = {}  # metric -> engine label -> value
    for name, labels, value in samples(text):
        totals[name] = totals.get(name, 0.0) + value
        engine = labels.get("engine", "")
        for names in (CBSERVE_NAMES, VLLM_NAMES):
            metric, label = names.blocks
            if name == metric:
                block_count = value if label is None else float(labels.get(label) or 0)
                by_engine.setdefault(metric, {})[engine] = block_count
            elif name == names.usage:
                by_engine.setdefault(name, {})[engine] = value
    for names in (CBSERVE_NAMES, VLLM_NAMES):
        needed = (names.running, names.waiting, names.usage, names.blocks[0], names.queries, names.hits)
        if not all(n in totals for n in needed):
            continue
        usage, blocks = by_engine[names.usage], by_engine[names.blocks[0]]
        return {
            "kv_blocks_used": sum(round(u * blocks.get(e, 0.0)) for e, u in usage.items()),
            "kv_blocks_total": int(sum(blocks.values())),
            "requests_running": int(totals[names.running]),
            "requests_waiting": int(totals[names.waiting]),
            "prefix_cache_queries": int(totals[names.queries]),
            "prefix_cache_hits": int(totals[names.hits]),
            "offloads": int(totals.get(names.offloads, 0.0)) if names.offloads else 0,
            "soft_resets": int(totals.get(names.soft_resets, 0.0)),
        }
    return None
