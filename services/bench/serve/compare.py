"""`cbserve bench serve --baseline URL --repeat N`: two servers side by side, in one run.

On a shared machine a server's figures move from minute to minute by more than the gap between two
servers, and a p99 of a few dozen requests is nearly their slowest one. So the target and the baseline
run the same phases in alternating order (round by round, phase by phase: the one that went second
goes first next), on the same requests written the same way, and the report gives per metric each
side's median over the rounds, the ratio of the medians (target / baseline), and in how many rounds
the target was ahead: higher output tok/s, lower latencies.

Each round salts its requests anew (both sides the same salt), so that no round is served from the
prefix cache an earlier round filled on the same server (`--cache-salt ""` turns salting off); within a
round both servers see identical requests. Both servers must serve the same model (the same
vocabulary). Each one's warm-up request runs once, before the first round. Each run starts on a quiet
host (`host_quiet`): a server that keeps a core busy after its last answer does not slow the next run.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from services.bench.host_quiet import wait_quiet
from services.bench.serve.backends import BackendError, ServerInfo
from services.bench.serve.report import PhaseData, ms, summarize_phase

if TYPE_CHECKING:
    from services.bench.serve.workloads import Phase

    RunPhases = Callable[
        [argparse.Namespace, list[Phase], bool, Callable[[PhaseData], None]],
        Awaitable[tuple[ServerInfo, list[PhaseData]]],
    ]


@dataclass(frozen=True)
class Metric:
    label: str  # with its unit: values are reported in it
    path: tuple[str, ...]  # where in a phase summary
    higher_is_better: bool
    scale: float = 1.0  # summary unit -> reported unit

    def of(self, summary: dict[str, Any]) -> float | None:
        value: Any = summary
        for key in self.path:
            value = value.get(key) if isinstance(value, dict) else None
        return None if value is None else float(value) * self.scale


MS = 1000.0  # the summaries' latencies are seconds
METRICS = (
    Metric("output tok/s", ("throughput", "output_tokens_per_s"), True),
    Metric("TTFT p50 (ms)", ("latency_s", "ttft", "p50"), False, MS),
    Metric("TTFT p99 (ms)", ("latency_s", "ttft", "p99"), False, MS),
    Metric("ITL p50 (ms)", ("latency_s", "itl", "p50"), False, MS),
    Metric("ITL p99 (ms)", ("latency_s", "itl", "p99"), False, MS),
    Metric("E2E p50 (ms)", ("latency_s", "e2e", "p50"), False, MS),
)
SIDES = ("target", "baseline")


def side_args(args: argparse.Namespace, side: str, round_index: int) -> argparse.Namespace:
    """The run's settings for one side in one round: its server, its metrics, the round's salt."""
    target, metrics = (
        (args.target, args.metrics_url) if side == "target" else (args.baseline, args.baseline_metrics_url)
    )
    salt = f"{args.cache_salt}-r{round_index}" if args.cache_salt else args.cache_salt
    return argparse.Namespace(**vars(args) | {"target": target, "metrics_url": metrics, "cache_salt": salt})


def order(round_index: int, phase_index: int) -> tuple[str, str]:
    """Who goes first alternates with every run: the host's drift falls on both sides alike."""
    return SIDES if (round_index + phase_index) % 2 == 0 else SIDES[::-1]


@dataclass(frozen=True)
class MetricComparison:
    metric: Metric
    target: float | None  # median over the rounds, in the metric's unit
    baseline: float | None
    ahead: int  # rounds in which the target was better
    rounds: int  # rounds in which both sides had a value

    @property
    def ratio(self) -> float | None:
        if self.target is None or not self.baseline:
            return None
        return self.target / self.baseline

    def to_json(self) -> dict[str, Any]:
        return {
            "metric": self.metric.label,
            "target": self.target,
            "baseline": self.baseline,
            "ratio": self.ratio,
            "rounds_ahead": self.ahead,
            "rounds": self.rounds,
        }


def compare_phase(rounds: list[dict[str, dict[str, Any]]]) -> list[MetricComparison]:
    """`rounds`: per round, {"target": phase summary, "baseline": phase summary} of one phase."""
    out = []
    for metric in METRICS:
        pairs = [(metric.of(r["target"]), metric.of(r["baseline"])) for r in rounds]
        mine = [t for t, _ in pairs if t is not None]
        theirs = [b for _, b in pairs if b is not None]
        both = [(t, b) for t, b in pairs if t is not None and b is not None]
        ahead = sum((t > b) if metric.higher_is_better else (t < b) for t, b in both)
        target = statistics.median(mine) if mine else None
        baseline = statistics.median(theirs) if theirs else None
        out.append(MetricComparison(metric, target, baseline, ahead, len(both)))
    return out


def format_comparison(phase_name: str, labels: tuple[str, str], table: list[MetricComparison]) -> str:
    rounds = max((m.rounds for m in table), default=0)
    head = f"{'metric':<16}{labels[0]:>16}{labels[1]:>16}{'ratio':>9}{'rounds ahead':>15}"
    lines = [f"== {phase_name}: {labels[0]} vs {labels[1]}, medians of {rounds} rounds ==", head]

    def shown(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    for m in table:
        ratio = "-" if m.ratio is None else f"{m.ratio:.2f}x"
        lines.append(
            f"{m.metric.label:<16}{shown(m.target):>16}{shown(m.baseline):>16}{ratio:>9}"
            f"{f'{m.ahead}/{m.rounds}':>15}"
        )
    return "\n".join(lines)


def one_line(label: str, round_index: int, rounds: int, summary: dict[str, Any]) -> str:
    """A run's figures at a glance while the comparison goes on."""
    ttft, itl = summary["latency_s"]["ttft"], summary["latency_s"]["itl"]  # None: no request got one
    return (
        f"round {round_index + 1}/{rounds} {label:<14} {summary['name']}: "
        f"{summary['throughput']['output_tokens_per_s']:.1f} tok/s, TTFT p50/p99 {ms(ttft, 'p50')}/"
        f"{ms(ttft, 'p99')} ms, ITL p50 {ms(itl, 'p50')} ms"
    )


@dataclass
class Run:
    """One side's run of one phase in one round."""

    side: str
    round: int
    data: PhaseData
    summary: dict[str, Any]


async def run_comparison(
    args: argparse.Namespace, phases: list[Phase], run_phases: RunPhases
) -> tuple[dict[str, Any], list[list[Run]]]:
    """Every round's phases on both sides, one phase at a time (runner.py's `run_phases(side's args,
    [phase], warm up first, when done)`). Returns the target's model facts and, per phase, its runs
    in the order they ran."""
    runs: list[list[Run]] = [[] for _ in phases]
    model: dict[str, Any] = {}
    vocab: dict[str, int] = {}
    warm = {side: args.warmup for side in SIDES}
    for r in range(args.repeat):
        for phase in phases:
            for side in order(r, phase.index):
                await asyncio.to_thread(wait_quiet)  # the other side's leftover work is not this run's
                info, [data] = await run_phases(side_args(args, side, r), [phase], warm[side], _quiet)
                warm[side] = False
                vocab.setdefault(side, info.vocab_size)
                if len(set(vocab.values())) > 1:
                    raise BackendError(
                        f"the target and the baseline serve different models (vocabulary "
                        f"sizes {vocab['target']} and {vocab['baseline']})"
                    )
                model = info.facts if side == "target" else model
                summary = summarize_phase(data)
                runs[phase.index].append(Run(side, r, data, summary))
                print(one_line(args.labels[SIDES.index(side)], r, args.repeat, summary), flush=True)
    return model, runs


def _quiet(data: PhaseData) -> None:
    """A side's phase report is the comparison's: nothing printed as it ends (`one_line` instead)."""


def by_round(runs: list[Run]) -> list[dict[str, dict[str, Any]]]:
    """One phase's runs as [{"target": summary, "baseline": summary}] per round."""
    rounds: dict[int, dict[str, dict[str, Any]]] = {}
    for run in runs:
        rounds.setdefault(run.round, {})[run.side] = run.summary
    return [rounds[r] for r in sorted(rounds)]


def comparison_json(
    runs: list[list[Run]],
    tables: list[list[MetricComparison]],
    labels: tuple[str, str],
    phase_json: Callable[[PhaseData, dict[str, Any]], dict[str, Any]],
) -> list[dict[str, Any]]:
    """Per phase: its comparison table and every run (runner.py's `phase_json` of it), in running order."""
    return [
        {
            "name": phase_runs[0].summary["name"],
            "labels": list(labels),
            "comparison": [m.to_json() for m in table],
            "runs": [
                {"side": run.side, "round": run.round} | phase_json(run.data, run.summary)
                for run in phase_runs
            ],
        }
        for phase_runs, table in zip(runs, tables, strict=True)
    ]
