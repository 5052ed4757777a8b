"""Measurements of `cbserve bench serve` and what is computed from them: per-request records, latency
statistics, the phase summary (a JSON-able dict), the printed tables, the step profile (from two
scrapes of the gateway's step histogram, metrics.py) and the plot. Nothing here talks to a server.

Conventions:
- Times are seconds from the phase start, taken on the client (`time.perf_counter`).
- TTFT: send to the first chunk carrying tokens. E2E: send to the final message.
- ITL: per token; the gap between two chunks of one stream is shared evenly by the tokens of the later
  chunk (the gateway's own histogram does the same). Tokens of the first chunk have no gap.
- Throughput counts every token received in the phase (also of cancelled or failed streams: the server
  computed them) over the phase's wall time; prompt tokens count once the request got its first token.
- A request's tokens are its chunks' (gRPC chunks carry token ids), or the server's usage count where
  one chunk is not one token (HTTP streams send no chunk for a token without text).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.bench.serve.metrics import STEP_METRIC

STEP_PHASE_ORDER = (
    *("schedule", "cache", "build", "forward", "sample", "wait", "emit"),
    *("grammar_advance", "grammar_fill", "grammar_apply", "total"),
)


# ------------------------------------------------------------------------------------------ records


@dataclass
class RequestRecord:
    """What the client saw of one request. `status`: not_sent, running, ok, failed or cancelled."""

    index: int
    kind: str
    max_tokens: int | None
    prompt_tokens: int | None
    group: int | None = None
    shared_len: int = 0
    status: str = "not_sent"
    error_code: str | None = None
    error: str | None = None
    start: float | None = None
    end: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int | None = None  # the server's count (HTTP usage), when chunks are not tokens
    cached_prompt_tokens: int | None = None
    server_ttft: float | None = None
    server_queue: float | None = None

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens) if self.completion_tokens is None else self.completion_tokens

    @property
    def ttft(self) -> float | None:
        if self.start is None or not self.chunk_times:
            return None
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float | None:
        return (
            None if self.status != "ok" or self.start is None or self.end is None else self.end - self.start
        )

    def itl_gaps(self) -> list[tuple[float, float, float]]:
        """(gap start, gap end, per-token latency) for each token after the first chunk."""
        gaps = []
        for j in range(1, len(self.chunk_times)):
            lo, hi, k = self.chunk_times[j - 1], self.chunk_times[j], self.chunk_tokens[j]
            gaps += [(lo, hi, (hi - lo) / k)] * k
        return gaps

    def itls(self) -> list[float]:
        return [g for _, _, g in self.itl_gaps()]

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["chunk_times"] = [round(t, 6) for t in self.chunk_times]
        out |= {"output_tokens": self.output_tokens, "ttft": self.ttft, "e2e": self.e2e}
        return out


@dataclass
class LoadSample:
    t: float
    kv_blocks_used: int
    kv_blocks_total: int
    requests_running: int
    requests_waiting: int


@dataclass
class PhaseData:
    """Everything one phase measured; `summarize_phase` turns it into the report."""

    name: str
    workload: str
    request_rate: float
    concurrency: int | None
    duration_s: float
    records: list[RequestRecord]
    load_before: dict[str, int] | None = None
    load_after: dict[str, int] | None = None
    load_samples: list[LoadSample] = field(default_factory=list)
    steps_before: dict[str, tuple[float, float]] | None = None
    steps_after: dict[str, tuple[float, float]] | None = None
    check_lengths: bool = True
    backend: str = ""  # which server, how reached
    load_source: str | None = "GetLoad"  # None: the server's load is unknown (HTTP, no --metrics-url)


# --------------------------------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks (numpy's default,
    `statistics.quantiles(method="inclusive")`)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float] | None:
    """count, mean, p50, p90, p99 (None without values)."""
    if not values:
        return None
    stats = {"count": len(values), "mean": sum(values) / len(values)}
    return stats | {f"p{q}": percentile(values, q) for q in (50, 90, 99)}


# ----------------------------------------------------------------------------------- step profile


def step_profile(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> list[dict[str, Any]]:
    """Per phase label: steps, mean seconds per step and share of the step total, from the deltas of
    _sum and _count between two scrapes. Empty when no step ran in between."""
    deltas = {
        k: (s - before.get(k, (0.0, 0.0))[0], c - before.get(k, (0.0, 0.0))[1]) for k, (s, c) in after.items()
    }
    total = deltas["total"][0] if "total" in deltas else sum(s for k, (s, _) in deltas.items())
    order = [p for p in STEP_PHASE_ORDER if p in deltas] + sorted(set(deltas) - set(STEP_PHASE_ORDER))
    rows = []
    for phase in order:
        dsum, dcount = deltas[phase]
        if dcount <= 0:
            continue
        share = dsum / total if total > 0 else 0.0
        rows.append({"phase": phase, "steps": int(dcount), "mean_s": dsum / dcount, "share": share})
    return rows


# ---------------------------------------------------------------------------------------- summary


def summarize_phase(data: PhaseData) -> dict[str, Any]:
    """The phase's report as a JSON-able dict (see the module docstring for the definitions)."""
    records = data.records
    timed = [r for r in records if r.kind != "long"] if data.workload == "long-prompt" else records
    started = [r for r in records if r.ttft is not None]
    output = sum(r.output_tokens for r in records)
    prompt = sum(r.prompt_tokens or 0 for r in started)
    wall = max(data.duration_s, 1e-9)
    return {
        "name": data.name,
        "backend": data.backend,
        "workload": data.workload,
        "request_rate": data.request_rate,
        "concurrency": data.concurrency,
        "duration_s": data.duration_s,
        "requests": _counts(data),
        "tokens": {"prompt": prompt, "output": output},
        "throughput": {
            "requests_per_s": sum(r.status == "ok" for r in records) / wall,
            "output_tokens_per_s": output / wall,
            "total_tokens_per_s": (prompt + output) / wall,
        },
        "latency_s": {
            "ttft": summarize([t for r in timed if (t := r.ttft) is not None]),
            "itl": summarize([g for r in timed for g in r.itls()]),
            "e2e": summarize([t for r in timed if (t := r.e2e) is not None]),
        },
        "load_source": data.load_source,
        "kv": _kv(data.load_samples),
        "load_deltas": _load_deltas(data.load_before, data.load_after),
        "prefix_cache": _prefix_usage(records) if data.workload == "shared-prefix" else None,
        "long_prompt": long_prompt_itl(records) if data.workload == "long-prompt" else None,
        "step_profile": (
            step_profile(data.steps_before, data.steps_after)
            if data.steps_before is not None and data.steps_after is not None
            else None
        ),
    }


def _counts(data: PhaseData) -> dict[str, Any]:
    records = data.records
    failed = Counter(r.error_code or "UNKNOWN" for r in records if r.status == "failed")
    mismatched = [
        r.index
        for r in records
        if data.check_lengths
        and r.status == "ok"
        and r.max_tokens is not None
        and r.output_tokens != r.max_tokens
    ]
    return {
        "total": len(records),
        "completed": sum(r.status == "ok" for r in records),
        "failed": dict(failed),
        "cancelled": sum(r.status == "cancelled" for r in records),
        "not_sent": sum(r.status == "not_sent" for r in records),
        "length_mismatch": mismatched,
    }


def _kv(samples: list[LoadSample]) -> dict[str, Any] | None:
    if not samples:
        return None
    total = max(s.kv_blocks_total for s in samples)
    peak = max(s.kv_blocks_used for s in samples)
    return {
        "samples": len(samples),
        "blocks_total": total,
        "peak_blocks_used": peak,
        "peak_usage": peak / total if total else 0.0,
        "mean_usage": sum(s.kv_blocks_used for s in samples) / len(samples) / total if total else 0.0,
        "peak_running": max(s.requests_running for s in samples),
        "peak_waiting": max(s.requests_waiting for s in samples),
    }


def _load_deltas(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, Any] | None:
    if before is None or after is None:
        return None
    names = ("prefix_cache_queries", "prefix_cache_hits", "offloads", "soft_resets")
    deltas: dict[str, Any] = {n: after[n] - before[n] for n in names}
    deltas["preemptions"] = deltas["offloads"] + deltas["soft_resets"]
    queries = deltas["prefix_cache_queries"]
    deltas["prefix_hit_rate"] = deltas["prefix_cache_hits"] / queries if queries else None
    return deltas


def _prefix_usage(records: list[RequestRecord]) -> dict[str, Any]:
    """Cached prompt tokens (usage) of completed requests that are not their group's first to be sent,
    against the shared prefix tokens those requests carry."""
    firsts: dict[int, RequestRecord] = {}
    for r in records:
        if r.group is not None and r.start is not None:
            if r.group not in firsts or r.start < (firsts[r.group].start or 0.0):
                firsts[r.group] = r
    later = [r for r in records if r.status == "ok" and r.group is not None and firsts.get(r.group) is not r]
    # A server that does not say (vLLM without --enable-prompt-tokens-details): unknown, not 0.
    told = [r for r in later if r.cached_prompt_tokens is not None]
    shared = sum(r.shared_len for r in told)
    cached = sum(r.cached_prompt_tokens or 0 for r in told)
    return {
        "requests_after_first": len(later),
        "shared_tokens": shared,
        "cached_tokens": cached if told else None,
        "hit_rate": cached / shared if shared else None,
    }


def long_prompt_itl(records: list[RequestRecord]) -> dict[str, Any] | None:
    """ITL of the short requests while the long prompt was prefilled (from its send to its first token;
    a gap counts as `during` when it overlaps that window) against the rest."""
    long = next((r for r in records if r.kind == "long"), None)
    if long is None or long.start is None:
        return None
    end = long.chunk_times[0] if long.chunk_times else long.end
    if end is None:
        return None
    during: list[float] = []
    outside: list[float] = []
    for r in records:
        if r.kind == "long":
            continue
        for lo, hi, itl in r.itl_gaps():
            (during if lo < end and hi > long.start else outside).append(itl)
    d, o = summarize(during), summarize(outside)
    return {
        "long_prompt_tokens": long.prompt_tokens,
        "status": long.status,
        "sent_at_s": long.start,
        "prefill_s": end - long.start,
        "during": d,
        "outside": o,
        # The issue's target (p99 of the running requests' ITL at most 2x their median): the tail
        # while the long prompt is prefilled, against the usual (median outside that window).
        "p99_during_over_median_outside": d["p99"] / o["p50"] if d and o and o["p50"] > 0 else None,
        "p99_over_median_during": d["p99"] / d["p50"] if d and d["p50"] > 0 else None,
    }


# --------------------------------------------------------------------------------------- printing


_RULE = 64


def _line(label: str, value: str) -> str:
    return f"{label + ':':<42}{value}"


def ms(stats: dict[str, float] | None, key: str) -> str:
    return "-" if stats is None else f"{stats[key] * 1000:.1f}"


def format_phase(s: dict[str, Any]) -> str:
    """One phase as a table, in the manner of vLLM's benchmark_serving output."""
    n, tp = s["requests"], s["throughput"]
    failed = ", ".join(f"{k} {v}" for k, v in sorted(n["failed"].items())) or "0"
    lines = [
        f" Serving benchmark: {s['name']} ".center(_RULE, "="),
        _line("Server", s["backend"]),
        _line("Workload", f"{s['workload']}, {n['total']} requests"),
        _line("Completed requests", str(n["completed"])),
        _line("Failed requests", failed),
        _line("Cancelled / not sent (time limit)", f"{n['cancelled']} / {n['not_sent']}"),
        _line("Duration (s)", f"{s['duration_s']:.2f}"),
        _line("Prompt tokens / output tokens", f"{s['tokens']['prompt']} / {s['tokens']['output']}"),
        _line("Request throughput (req/s)", f"{tp['requests_per_s']:.2f}"),
        _line("Output token throughput (tok/s)", f"{tp['output_tokens_per_s']:.2f}"),
        _line("Total token throughput (tok/s)", f"{tp['total_tokens_per_s']:.2f}"),
    ]
    if n["length_mismatch"]:
        lines.append(_line("WARNING output length != max_tokens", str(n["length_mismatch"][:10])))
    lines += _latency_lines(s["latency_s"], s["workload"] == "long-prompt")
    lines += _load_lines(s)
    if s["long_prompt"] is not None:
        lines += format_long_prompt(s["long_prompt"])
    if s["step_profile"]:
        lines += ["-" * _RULE, format_step_profile(s["step_profile"])]
    lines.append("=" * _RULE)
    return "\n".join(lines)


def _latency_lines(latency: dict[str, Any], short_only: bool) -> list[str]:
    title = "Latency (ms), short requests" if short_only else "Latency (ms)"
    lines = ["-" * _RULE, f"{title:<30}{'mean':>8}{'p50':>8}{'p90':>8}{'p99':>8}"]
    for key, label in (
        ("ttft", "Time to first token"),
        ("itl", "Inter-token latency"),
        ("e2e", "End-to-end"),
    ):
        stats = latency[key]
        lines.append(f"{label:<30}" + "".join(f"{ms(stats, k):>8}" for k in ("mean", "p50", "p90", "p99")))
    return lines


def _load_lines(s: dict[str, Any]) -> list[str]:
    lines = ["-" * _RULE]
    kv, deltas, prefix = s["kv"], s["load_deltas"], s["prefix_cache"]
    if s["load_source"] is None:
        lines.append(_line("KV usage, prefix cache, preemptions", "unknown (needs --metrics-url)"))
    if kv is not None:
        used = f"{kv['peak_blocks_used']} / {kv['blocks_total']} ({kv['peak_usage']:.1%})"
        lines += [
            _line("KV blocks used, peak", used),
            _line("KV usage, mean of samples", f"{kv['mean_usage']:.1%} ({kv['samples']} samples)"),
            _line("Running / waiting, peak", f"{kv['peak_running']} / {kv['peak_waiting']}"),
        ]
    if deltas is not None:
        rate = deltas["prefix_hit_rate"]
        hits = f"{deltas['prefix_cache_hits']} / {deltas['prefix_cache_queries']} tokens"
        lines += [
            _line("Prefix cache hits (server counters)", hits + ("" if rate is None else f" ({rate:.1%})")),
            _line(
                "Preemptions (offloads + soft resets)",
                f"{deltas['preemptions']} ({deltas['offloads']} + {deltas['soft_resets']})",
            ),
        ]
    if prefix is not None and prefix["hit_rate"] is not None:
        value = f"{prefix['cached_tokens']} / {prefix['shared_tokens']} ({prefix['hit_rate']:.1%})"
        lines.append(_line("Shared tokens cached after group's first", value))
    return lines


def format_long_prompt(lp: dict[str, Any]) -> list[str]:
    lines = [
        "-" * _RULE,
        _line(
            "Long prompt",
            f"{lp['long_prompt_tokens']} tokens, {lp['status']}, "
            f"sent at {lp['sent_at_s']:.2f} s, prefill {lp['prefill_s']:.2f} s",
        ),
        f"{'Short requests ITL (ms)':<30}{'tokens':>8}{'p50':>8}{'p99':>8}",
    ]
    for key, label in (("during", "during the long prefill"), ("outside", "otherwise")):
        stats = lp[key]
        count = "0" if stats is None else str(stats["count"])
        lines.append(f"{label:<30}{count:>8}{ms(stats, 'p50'):>8}{ms(stats, 'p99'):>8}")
    for key, label in (
        ("p99_during_over_median_outside", "p99 ITL in prefill / median otherwise"),
        ("p99_over_median_during", "p99 / median ITL, both in prefill"),
    ):
        ratio = lp[key]
        lines.append(_line(label, "-" if ratio is None else f"{ratio:.2f}"))
    return lines


def format_step_profile(rows: list[dict[str, Any]]) -> str:
    steps = max((r["steps"] for r in rows), default=0)
    lines = [f"Step profile ({STEP_METRIC}, {steps} steps)", f"{'phase':<16}{'ms/step':>10}{'share':>9}"]
    lines += [f"{r['phase']:<16}{r['mean_s'] * 1000:>10.2f}{r['share']:>9.1%}" for r in rows]
    return "\n".join(lines)


def format_sweep(summaries: list[dict[str, Any]]) -> str:
    """One line per phase: the request-rate sweep at a glance."""
    head = f"{'phase':<28}{'done':>6}{'req/s':>8}{'tok/s':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p99':>9}"
    lines = [" Sweep (latencies in ms) ".center(len(head), "="), head]
    for s in summaries:
        lat, tp = s["latency_s"], s["throughput"]
        lines.append(
            f"{s['name']:<28}{s['requests']['completed']:>6}{tp['requests_per_s']:>8.2f}"
            f"{tp['output_tokens_per_s']:>9.1f}{ms(lat['ttft'], 'p50'):>10}{ms(lat['ttft'], 'p99'):>10}"
            f"{ms(lat['itl'], 'p99'):>9}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- plot


def plot_report(phases: list[PhaseData], summaries: list[dict[str, Any]], path: Path) -> None:
    """Latency CDFs (TTFT, ITL, E2E) per phase; for a sweep, throughput and p99 TTFT against rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = len(summaries) > 1
    fig, axes = plt.subplots(2 if sweep else 1, 3, figsize=(15, 8 if sweep else 4.5), squeeze=False)
    for ax, (label, values_of) in zip(axes[0], _cdf_series(), strict=True):
        for data in phases:
            values = sorted(v * 1000 for v in values_of(data))
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=data.name)
        ax.set(title=f"{label} CDF", xlabel="ms", ylabel="fraction")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if sweep:
        _plot_sweep(axes[1], summaries)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cdf_series() -> list[tuple[str, Any]]:
    def timed(data: PhaseData) -> list[RequestRecord]:
        return [r for r in data.records if r.kind != "long"]

    return [
        ("TTFT", lambda d: [t for r in timed(d) if (t := r.ttft) is not None]),
        ("Inter-token latency", lambda d: [g for r in timed(d) for g in r.itls()]),
        ("End-to-end latency", lambda d: [t for r in timed(d) if (t := r.e2e) is not None]),
    ]


def _plot_sweep(axes: Any, summaries: list[dict[str, Any]]) -> None:
    """Finite rates as points; a rate of inf (no x position) as a dashed level."""
    series = (
        ("Output token throughput", "tok/s", lambda s: s["throughput"]["output_tokens_per_s"]),
        ("Request throughput", "req/s", lambda s: s["throughput"]["requests_per_s"]),
        (
            "p99 TTFT",
            "ms",
            lambda s: s["latency_s"]["ttft"]["p99"] * 1000 if s["latency_s"]["ttft"] else math.nan,
        ),
    )
    finite = sorted(
        (s for s in summaries if math.isfinite(s["request_rate"])), key=lambda s: s["request_rate"]
    )
    for ax, (title, unit, value) in zip(axes, series, strict=True):
        ax.plot([s["request_rate"] for s in finite], [value(s) for s in finite], "o-")
        for s in summaries:
            if not math.isfinite(s["request_rate"]):
                ax.axhline(value(s), linestyle="--", color="gray", label=s["name"])
        ax.set(title=title, xlabel="request rate (req/s)", ylabel=unit)
        ax.grid(alpha=0.3)
        if len(finite) < len(summaries):
            ax.legend(fontsize=8)
