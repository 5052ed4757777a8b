"""`cbserve bench serve`: its pure parts (workloads, arrivals, statistics, Prometheus parsing, report)
and two runs of the real command against the session's tiny stack."""

from __future__ import annotations

import itertools
import json
import random
import statistics
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from services.bench.serve.metrics import parse_histogram
from services.bench.serve.report import (
    PhaseData,
    RequestRecord,
    format_phase,
    long_prompt_itl,
    percentile,
    step_profile,
    summarize,
    summarize_phase,
)
from services.bench.serve.workloads import (
    arrivals_for,
    jsonl_requests,
    length_bounds,
    long_prompt_requests,
    phase_rng,
    poisson_arrivals,
    random_requests,
    shared_prefix_requests,
)
from services.cli import main
from services.common.gateway_messages import Load, StepTimes
from services.gateway.metrics import GatewayMetrics
from tests.stack import Stack

# ---------------------------------------------------------------------------------------- workloads


def test_random_workload_is_seeded_and_within_bounds() -> None:
    def draw(seed: int) -> list:
        return random_requests(50, 100, 20, 0.5, 1000, random.Random(seed))

    requests = draw(7)
    assert requests == draw(7)
    assert requests != draw(8)
    assert all(50 <= len(r.token_ids) <= 150 and 10 <= r.max_tokens <= 30 for r in requests)
    assert all(0 <= t < 1000 for r in requests for t in r.token_ids)
    assert len({len(r.token_ids) for r in requests}) > 10  # the ratio spreads lengths
    exact = random_requests(5, 16, 8, 0.0, 256, random.Random(0))
    assert [(len(r.token_ids), r.max_tokens) for r in exact] == [(16, 8)] * 5


def test_length_bounds() -> None:
    assert length_bounds(100, 0.0) == (100, 100)
    assert length_bounds(100, 0.25) == (75, 125)
    assert length_bounds(1, 0.9) == (1, 1)
    with pytest.raises(ValueError):
        length_bounds(10, 1.0)


def test_shared_prefix_groups_share_exactly_their_prefix() -> None:
    requests = shared_prefix_requests(12, 3, 40, 10, 5, 0.0, 500, random.Random(1))
    assert [r.group for r in requests] == [0, 1, 2] * 4
    for r in requests:
        first = requests[r.group]
        assert r.token_ids[:40] == first.token_ids[:40] and len(r.token_ids) == 50 and r.shared_len == 40
    assert len({tuple(r.token_ids[:40]) for r in requests}) == 3
    assert len({tuple(r.token_ids[40:]) for r in requests}) == 12  # unique suffixes
    assert requests == shared_prefix_requests(12, 3, 40, 10, 5, 0.0, 500, random.Random(1))


def test_long_prompt_sits_after_the_warm_requests() -> None:
    requests = long_prompt_requests(8, 16, 4, 0.0, 300, 2, 3, 256, random.Random(0))
    assert [r.kind for r in requests] == ["short"] * 3 + ["long"] + ["short"] * 5
    long = requests[3]
    assert len(long.token_ids) == 300 and long.max_tokens == 2 and long.index == 8
    arrivals = arrivals_for(requests, 2.0, random.Random(0))
    assert arrivals[3] == arrivals[2]  # sent right after the third short request
    short = [a for r, a in zip(requests, arrivals, strict=True) if r.kind == "short"]
    assert short == poisson_arrivals(8, 2.0, random.Random(0))


def test_poisson_arrivals_mean_gap_is_one_over_rate() -> None:
    offsets = poisson_arrivals(20_000, 4.0, random.Random(3))
    gaps = [b - a for a, b in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.03)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.05)  # exponential: sd = mean
    assert poisson_arrivals(5, float("inf"), random.Random(0)) == [0.0] * 5
    assert phase_rng(0, 1, "a").random() == phase_rng(0, 1, "a").random() != phase_rng(0, 2, "a").random()


def test_jsonl_workload(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = ['{"prompt": "Hello there", "max_tokens": 5}', "", '{"token_ids": [1, 2, 3]}', '{"prompt": "x"}']
    path.write_text("\n".join(lines) + "\n")
    requests = jsonl_requests(path, 2, default_max_tokens=7)
    assert [(r.text, r.token_ids, r.max_tokens) for r in requests] == [
        ("Hello there", None, 5),
        (None, [1, 2, 3], 7),
    ]
    path.write_text('{"max_tokens": 3}\n')
    with pytest.raises(ValueError, match=r"prompts\.jsonl:1"):
        jsonl_requests(path, 5, None)


# --------------------------------------------------------------------------------------- statistics


def test_percentiles_match_the_statistics_module() -> None:
    rng = random.Random(5)
    for n in (2, 3, 10, 101, 1000):
        values = [rng.expovariate(1.0) for _ in range(n)]
        cuts = statistics.quantiles(values, n=100, method="inclusive")
        for q in (1, 50, 90, 99):
            assert percentile(values, q) == pytest.approx(cuts[q - 1])
        assert percentile(values, 0) == min(values) and percentile(values, 100) == max(values)
    stats = summarize([3.0, 1.0, 2.0])
    assert stats == {
        "count": 3,
        "mean": 2.0,
        "p50": 2.0,
        "p90": pytest.approx(2.8),
        "p99": pytest.approx(2.98),
    }
    assert summarize([]) is None


def test_itl_shares_a_gap_among_the_tokens_of_a_chunk() -> None:
    record = RequestRecord(0, "short", 4, 10, start=1.0, end=1.5, status="ok")
    record.chunk_times, record.chunk_tokens = [1.1, 1.2, 1.4], [1, 1, 2]
    assert record.ttft == pytest.approx(0.1) and record.e2e == pytest.approx(0.5)
    assert record.itls() == pytest.approx([0.1, 0.1, 0.1])
    assert record.output_tokens == 4


def _stream(index: int, times: list[float], kind: str = "short") -> RequestRecord:
    record = RequestRecord(index, kind, len(times), 8, start=times[0] - 0.05, end=times[-1], status="ok")
    record.chunk_times, record.chunk_tokens = times, [1] * len(times)
    return record


def test_long_prompt_itl_splits_on_the_prefill_window() -> None:
    # Two short streams at 10 ms per token; the long prompt is sent at 0.505 s and its first token comes
    # at 0.905 s; one short stream stalls 310 ms inside that window.
    steady = _stream(0, [0.1 + 0.01 * i for i in range(150)])
    stalled = _stream(1, [0.1 + 0.01 * i for i in range(50)] + [0.9 + 0.01 * i for i in range(50)])
    long = _stream(2, [0.905, 0.95], kind="long")
    long.start = 0.505
    lp = long_prompt_itl([steady, stalled, long])
    assert lp is not None and lp["prefill_s"] == pytest.approx(0.4)
    # Gaps overlapping the window: steady's [0.50, 0.51] .. [0.90, 0.91] (41); stalled's [0.50, 0.51] ..
    # [0.58, 0.59] (9), the stall [0.59, 0.90] and [0.90, 0.91].
    assert lp["during"]["count"] == 41 + 11
    assert lp["outside"]["count"] == 149 + 99 - 52
    assert lp["during"]["p99"] == pytest.approx(percentile([0.01] * 51 + [0.31], 99))
    assert lp["outside"]["p50"] == pytest.approx(0.01)
    assert lp["p99_during_over_median_outside"] == pytest.approx(lp["during"]["p99"] / 0.01)
    assert lp["p99_over_median_during"] == pytest.approx(lp["during"]["p99"] / 0.01)


def test_phase_summary_and_table() -> None:
    records = [_stream(i, [0.2 + 0.05 * i + 0.01 * k for k in range(4)]) for i in range(3)]
    failed = RequestRecord(3, "short", 4, 8, status="failed", error_code="RESOURCE_EXHAUSTED")
    unsent = RequestRecord(4, "short", 4, 8)
    load_before = dict.fromkeys(("prefix_cache_queries", "prefix_cache_hits", "offloads", "soft_resets"), 0)
    load_after = {"prefix_cache_queries": 24, "prefix_cache_hits": 8, "offloads": 1, "soft_resets": 2}
    data = PhaseData(
        "rate inf req/s",
        "random",
        float("inf"),
        None,
        2.0,
        [*records, failed, unsent],
        load_before,
        load_after,
    )
    s = summarize_phase(data)
    assert s["requests"] == {
        "total": 5,
        "completed": 3,
        "failed": {"RESOURCE_EXHAUSTED": 1},
        "cancelled": 0,
        "not_sent": 1,
        "length_mismatch": [],
    }
    assert s["tokens"] == {"prompt": 24, "output": 12}
    assert s["throughput"]["output_tokens_per_s"] == 6.0 and s["throughput"]["requests_per_s"] == 1.5
    assert s["latency_s"]["itl"]["count"] == 9
    assert s["load_deltas"]["preemptions"] == 3
    assert s["load_deltas"]["prefix_hit_rate"] == pytest.approx(1 / 3)
    table = format_phase(s)
    for needle in (
        "Time to first token",
        "Inter-token latency",
        "End-to-end",
        "RESOURCE_EXHAUSTED 1",
        "33.3%",
    ):
        assert needle in table


# ------------------------------------------------------------------------------------ step profile

CAPTURED = """\
# HELP cbserve:step_time_seconds Worker step time by phase.
# TYPE cbserve:step_time_seconds histogram
cbserve:step_time_seconds_bucket{le="0.005",phase="schedule"} 10.0
cbserve:step_time_seconds_bucket{le="+Inf",phase="schedule"} 10.0
cbserve:step_time_seconds_count{phase="schedule"} 10.0
cbserve:step_time_seconds_sum{phase="schedule"} 0.02
cbserve:step_time_seconds_count{phase="forward"} 10.0
cbserve:step_time_seconds_sum{phase="forward"} 0.18
cbserve:step_time_seconds_count{phase="total"} 10.0
cbserve:step_time_seconds_sum{phase="total"} 0.2
# HELP cbserve:step_time_seconds_created Worker step time by phase.
cbserve:step_time_seconds_created{phase="schedule"} 1.7e+09
cbserve:time_to_first_token_seconds_sum 3.5
"""


def test_parse_captured_step_histogram() -> None:
    parsed = parse_histogram(CAPTURED)
    assert parsed == {"schedule": (0.02, 10.0), "forward": (0.18, 10.0), "total": (0.2, 10.0)}
    rows = step_profile({"schedule": (0.01, 5.0), "forward": (0.08, 5.0), "total": (0.09, 5.0)}, parsed)
    assert [r["phase"] for r in rows] == ["schedule", "forward", "total"]
    assert rows[0]["mean_s"] == pytest.approx(0.002) and rows[0]["share"] == pytest.approx(0.01 / 0.11)
    assert rows[1]["mean_s"] == pytest.approx(0.02) and rows[2]["share"] == pytest.approx(1.0)
    assert step_profile(parsed, parsed) == []


def test_parse_the_gateways_own_exposition() -> None:
    metrics = GatewayMetrics(lambda: Load())
    before = parse_histogram(generate_latest(metrics.registry).decode())
    for _ in range(4):
        metrics.observe_step(StepTimes(0.001, 0.002, 0.003, 0.010, 0.001, 0.003, 16, 2, 0.0, 0.020))
    rows = step_profile(before, parse_histogram(generate_latest(metrics.registry).decode()))
    by_phase = {r["phase"]: r for r in rows}
    assert list(by_phase) == ["schedule", "cache", "build", "forward", "sample", "wait", "emit", "total"]
    assert all(r["steps"] == 4 for r in rows)
    assert by_phase["forward"]["mean_s"] == pytest.approx(0.010)
    assert by_phase["forward"]["share"] == pytest.approx(0.5)
    assert by_phase["total"]["mean_s"] == pytest.approx(0.020)


# ------------------------------------------------------------------------------- end to end (tiny)


def _bench(stack: Stack, tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    code = main(
        [
            "bench",
            "serve",
            "--target",
            stack.target,
            "--json",
            str(out),
            "--no-progress",
            "--load-interval",
            "0.1",
            *args,
        ]
    )
    return code, json.loads(out.read_text())


def test_random_workload_against_the_tiny_stack(
    tiny_stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    metrics_url = f"http://127.0.0.1:{tiny_stack.metrics_port}/metrics"
    # The load is sampled, so the run must outlast many samples: 48 requests take about 0.4 s on
    # the tiny model here, and a GetLoad 2-30 ms on two busy cores (12 requests once gave 6 samples,
    # none of them while a request ran).
    n = 48
    code, report = _bench(
        tiny_stack,
        tmp_path,
        "--workload",
        "random",
        "--num-requests",
        str(n),
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--request-rate",
        "inf",
        "--concurrency",
        "4",
        "--metrics-url",
        metrics_url,
        "--load-interval",
        "0.005",
    )
    assert code == 0
    [phase] = report["phases"]
    assert phase["requests"]["completed"] == n and phase["requests"]["failed"] == {}
    assert [r["output_tokens"] for r in phase["records"]] == [8] * n
    assert [r["prompt_tokens"] for r in phase["records"]] == [16] * n
    assert phase["tokens"] == {"prompt": n * 16, "output": n * 8}
    for name in ("ttft", "itl", "e2e"):
        stats = phase["latency_s"][name]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (name, stats)
    assert phase["latency_s"]["itl"]["count"] == n * 7
    assert phase["kv"]["peak_blocks_used"] > 0 and phase["kv"]["peak_running"] <= 4
    profile = {r["phase"]: r for r in phase["step_profile"]}
    assert set(profile) >= {"schedule", "cache", "build", "forward", "sample", "emit", "total"}
    assert profile["total"]["steps"] > 0 and profile["total"]["share"] == pytest.approx(1.0)
    assert report["settings"]["request_rate"] == "inf" and report["model"]["vocab_size"] == 256
    printed = capsys.readouterr().out
    assert "Serving benchmark: rate inf req/s, concurrency 4" in printed and "Step profile" in printed


def test_n_choices_count_every_choices_tokens(tiny_stack: Stack, tmp_path: Path) -> None:
    n = 6
    code, report = _bench(
        tiny_stack,
        tmp_path,
        "--workload",
        "random",
        "--num-requests",
        str(n),
        "--input-len",
        "40",
        "--output-len",
        "5",
        "--n",
        "3",
        "--request-rate",
        "inf",
    )
    assert code == 0
    [phase] = report["phases"]
    assert phase["requests"]["completed"] == n and phase["requests"]["failed"] == {}
    assert [r["output_tokens"] for r in phase["records"]] == [3 * 5] * n
    assert phase["tokens"] == {"prompt": n * 40, "output": n * 3 * 5}


def test_shared_prefix_reports_prefix_hits(tiny_stack: Stack, tmp_path: Path) -> None:
    # Two at a time over two groups: each group's later requests start after its first has written
    # the prefix blocks (page size 8: 32 prefix tokens are 4 full blocks).
    code, report = _bench(
        tiny_stack,
        tmp_path,
        "--workload",
        "shared-prefix",
        "--num-requests",
        "8",
        "--num-groups",
        "2",
        "--prefix-len",
        "32",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--concurrency",
        "2",
        "--seed",
        "11",
    )
    assert code == 0
    [phase] = report["phases"]
    assert phase["requests"]["completed"] == 8
    assert phase["load_deltas"]["prefix_hit_rate"] > 0
    prefix = phase["prefix_cache"]
    assert prefix["requests_after_first"] == 6 and prefix["shared_tokens"] == 6 * 32
    assert prefix["hit_rate"] > 0.5


def test_long_prompt_is_sent_once_the_warm_requests_decode(tiny_stack: Stack, tmp_path: Path) -> None:
    # max_batch_tokens 24: the 600-token prompt is prefilled in 25 chunks while short streams decode.
    code, report = _bench(
        tiny_stack,
        tmp_path,
        "--workload",
        "long-prompt",
        "--num-requests",
        "6",
        "--request-rate",
        "20",
        "--input-len",
        "8",
        "--output-len",
        "40",
        "--long-prompt-len",
        "600",
        "--long-prompt-after",
        "2",
    )
    assert code == 0
    [phase] = report["phases"]
    assert phase["requests"]["completed"] == 7
    records = phase["records"]
    long = next(r for r in records if r["kind"] == "long")
    assert long["prompt_tokens"] == 600 and long["output_tokens"] == 8
    warm = [r for r in records if r["kind"] == "short"][:2]
    assert all(r["chunk_times"][0] <= long["start"] for r in warm)
    lp = phase["long_prompt"]
    assert lp["during"]["count"] > 0 and lp["outside"]["count"] > 0
    assert lp["p99_during_over_median_outside"] > 0


def test_time_limit_cancels_requests_in_flight(tiny_stack: Stack, tmp_path: Path) -> None:
    code, report = _bench(
        tiny_stack,
        tmp_path,
        "--num-requests",
        "40",
        "--concurrency",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "1000",
        "--duration",
        "0.5",
    )
    assert code == 0  # cancelled by the time limit is not a failure
    [phase] = report["phases"]
    counts = phase["requests"]
    assert counts["cancelled"] == 2 and counts["not_sent"] == 38 and counts["failed"] == {}
    assert 0.5 <= phase["duration_s"] < 2.0
    assert phase["tokens"]["output"] > 0
    tiny_stack.assert_idle()  # the cancelled calls freed their blocks
