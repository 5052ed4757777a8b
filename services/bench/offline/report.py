"""How `cbserve bench offline` shows its results: the table per in-flight limit (each system's median
round), the paired ratios, what a constraint costs, the engine's and the stack's counters and step
profiles, and the JSON report of `--json`."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.bench.offline.compare import agreement, fp32_reference
from services.bench.offline.results import SystemResult
from services.bench.offline.systems import unconstrained
from services.bench.offline.top1 import Top1, top1_cell
from services.bench.workload import Workload


def print_table(
    results: dict[str, SystemResult],
    useful_flop: float,
    matmul_gflops: float,
    in_flight: int | None,
    top1: Mapping[str, Top1] | None = None,
) -> None:
    def ratio(result: SystemResult, base: str) -> str:
        return f"{result.output_tok_s / results[base].output_tok_s:.2f}x" if base in results else "-"

    reference = fp32_reference(results)
    same = agreement(results, reference) if reference is not None else {}
    header = ["system", "precision", "wall s", "out tok", "out tok/s", "greedy = fp32"]
    header += [] if top1 is None else ["top-1 = fp32"]
    header += ["prompt tok"]
    header += ["vs hf-cb", "vs hf-gen", "vs engine"]
    header += ["GFLOP/s", "% mm"] + ([] if in_flight is None else ["ms/tok/stream"])
    with_rss = any("peak_rss_bytes" in r.extra for r in results.values())
    header += ["peak RSS MiB"] if with_rss else []
    rows: list[tuple[str, ...]] = [tuple(header)]
    for r in results.values():
        gflops = useful_flop / r.wall_s / 1e9
        equal = (
            "ref" if r.name == reference else f"{same[r.name]}/{len(r.outputs)}" if r.name in same else "-"
        )
        row = [r.name, str(r.extra.get("precision", "-")), f"{r.wall_s:.2f}", str(r.output_tokens)]
        row += [f"{r.output_tok_s:.2f}", equal]
        row += [] if top1 is None else [top1_cell(top1.get(r.name))]
        row += [str(r.prompt_tokens)]
        row += [ratio(r, "hf-cb"), ratio(r, "hf-generate"), ratio(r, "engine")]
        row += [f"{gflops:.1f}", f"{100 * gflops / matmul_gflops:.1f}"]
        if in_flight is not None:
            row.append(f"{1000 * r.wall_s * in_flight / r.output_tokens:.1f}")
        if with_rss:
            rss = r.extra.get("peak_rss_bytes")
            row.append("-" if rss is None else f"{rss / 2**20:.0f}")
        rows.append(tuple(row))
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    for line in rows:
        cells = zip(line, widths, strict=True)
        print("  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(cells)))
    for r in results.values():
        if r.wasted_output_tokens:
            print(f"({r.name} also generated {r.wasted_output_tokens} tokens past their requests' limits)")
    if reference is None:
        print("(greedy = fp32: no fp32 reference ran; hf-generate or an engine at float32 would be one)")
    else:
        print(f"(greedy = fp32: requests whose greedy tokens all equal {reference}'s, the fp32 reference)")
    if top1 is not None:
        print(
            "(top-1 = fp32: positions of a prose text, each seeing the true text before it, where the "
            "system's top-ranked next token equals float32 transformers'; - not scored)"
        )
        for name, value in top1.items():
            if isinstance(value, str) and name in results:
                print(f"(top-1 = fp32 of {name} n/a: {value})")


def print_paired(ratios: dict[str, list[float]]) -> None:
    if not ratios:
        return
    print(
        "round by round (median): tok/s over the engine's of the same round; "
        "the engine's over the faster peer's"
    )
    for name, values in ratios.items():
        rounds = ", ".join(f"{v:.3f}" for v in values)
        print(f"  {name}: {rounds} ({statistics.median(values):.3f})")


def print_constrained(results: dict[str, SystemResult], dtype: str) -> None:
    """Each +constrained system's output tok/s over its unconstrained twin's, with the requests its
    grammar ended before their length (they generate fewer tokens, which tok/s counts) and the
    grammar's compile times."""
    for name, r in results.items():
        if "constraint" not in r.extra:
            continue
        base = unconstrained(name, dtype)
        ratio = (
            f"{r.output_tok_s / results[base].output_tok_s:.3f}x" if base in results else "- (it did not run)"
        )
        print(
            f"constrained / unconstrained output tok/s, {name} over {base}: {ratio} "
            f"({r.extra['constraint']}; {r.extra['ended_early']}/{len(r.outputs)} requests ended early, "
            f"their grammar complete; tok/s counts the {r.output_tokens} tokens generated)"
        )
        times = r.extra.get("grammar_compile_s")
        if times is not None:
            print(
                f"  grammar compile (submit to result): first {1000 * times['first_s']:.1f} ms, "
                f"cached {1000 * times['cached_s']:.3f} ms; the compiler made in {times['compiler_s']:.2f} s"
            )


def print_agreement(results: dict[str, SystemResult]) -> None:
    if fp32_reference(results) == "engine":
        return  # the table's greedy = fp32 column says it already
    for name, same in agreement(results).items():
        print(f"{name}: {same}/{len(results[name].outputs)} requests' greedy tokens equal the engine's")


def print_engine_stats(result: SystemResult) -> None:
    before, after = result.extra["stats_before"], result.extra["stats"]
    parts = []
    for key, value in after.items():
        prior = before.get(key)
        delta = ""
        if isinstance(value, int | float) and isinstance(prior, int | float) and prior and prior != value:
            delta = f" ({value - prior:+g} in the timed run)"
        parts.append(f"{key}={value}{delta}")
    print(f"{result.name} stats: " + ", ".join(parts))
    runs = result.extra.get("runs")
    if runs:
        print(f"{result.name} runs: " + ", ".join(f"{key}={value}" for key, value in runs.items()))
    profile: dict[str, float] = result.extra["step_profile_s"]
    steps = after["steps"] - before["steps"]
    total = sum(profile.values()) or 1.0
    phases = [(k, v / max(steps, 1), v / total) for k, v in profile.items()]
    print(f"{result.name} step profile over {steps} timed steps, per step: {_phases_line(phases)}")
    if "grammar_s" in result.extra:
        grammar: dict[str, float] = result.extra["grammar_s"]
        ms = {name: 1000 * seconds / max(steps, 1) for name, seconds in grammar.items()}
        print(
            f"{result.name} grammar per step: advance {ms['grammar_advance']:.2f} ms and mask fill "
            f"{ms['grammar_fill']:.2f} ms (the matchers, on the host, within schedule), mask apply "
            f"{ms['grammar_apply']:.2f} ms (within sample); "
            f"{100 * sum(grammar.values()) / total:.1f}% of the step"
        )


def print_stack_profile(result: SystemResult) -> None:
    rows = result.extra["step_profile"]
    phases = [(r["phase"], r["mean_s"], r["share"]) for r in rows if r["phase"] != "total"]
    steps = max((r["steps"] for r in rows), default=0)
    where = "the worker's, from /metrics"
    print(f"{result.name} step profile over {steps} timed steps ({where}), per step: {_phases_line(phases)}")


def _phases_line(phases: list[tuple[str, float, float]]) -> str:
    """(phase, seconds a step, share of the step) -> "schedule 0.6 ms (0%), ..."."""
    return ", ".join(f"{name} {1000 * mean_s:.1f} ms ({100 * share:.0f}%)" for name, mean_s, share in phases)


def json_report(
    args: argparse.Namespace,
    model_path: Path,
    threads: int,
    workload: Workload,
    points: dict[int | None, dict[str, SystemResult]],
    paired: dict[int | None, dict[str, list[float]]],
    useful_flop: float,
    matmul_gflops: float,
    check: dict[str, Any] | None,
    top1: Mapping[str, Top1] | None = None,
    top1_positions: int | None = None,
) -> dict[str, Any]:
    def systems(results: dict[str, SystemResult], in_flight: int | None) -> dict[str, Any]:
        same = agreement(results)
        reference = fp32_reference(results)
        same_fp32 = agreement(results, reference) if reference is not None else {}
        out: dict[str, Any] = {}
        for name, r in results.items():
            out[name] = {
                "wall_s": r.wall_s,
                "output_tokens": r.output_tokens,
                "prompt_tokens": r.prompt_tokens,
                "output_tok_s": r.output_tok_s,
                "gflop_s": useful_flop / r.wall_s / 1e9,
                "wasted_output_tokens": r.wasted_output_tokens,
                **{k: v for k, v in r.extra.items() if k != "stats_before"},
            }
            if in_flight is not None:
                out[name]["ms_per_token_per_stream"] = 1000 * r.wall_s * in_flight / r.output_tokens
            if name in same:
                out[name]["requests_equal_to_engine"] = same[name]
            if name in same_fp32:
                out[name]["requests_equal_to_fp32_reference"] = same_fp32[name]
            value = (top1 or {}).get(name)
            if isinstance(value, str):
                out[name]["top1_agreement_with_fp32"] = {"error": value}
            elif value is not None:
                same_top1, positions = value
                out[name]["top1_agreement_with_fp32"] = {
                    "same": same_top1,
                    "positions": positions,
                    "share": same_top1 / positions,
                }
            if "constraint" in r.extra and (base := unconstrained(name, args.dtype)) in results:
                out[name]["ratio_vs_unconstrained"] = r.output_tok_s / results[base].output_tok_s
            for base in ("hf-cb", "hf-generate", "engine"):
                if base in results and base != name:
                    out[name][f"ratio_vs_{base}"] = r.output_tok_s / results[base].output_tok_s
        return out

    first = next(iter(points))
    return {
        "model": str(model_path),
        "workload": {
            "source": str(args.workload) if args.workload else "W1",
            "num_requests": workload.num_requests,
            "seed": args.seed,
            "prompt_tokens": workload.total_prompt_tokens,
            "output_tokens": workload.total_output_tokens,
        },
        "threads": threads,
        "rounds": args.repeat,
        "matmul_2048_gflop_s": matmul_gflops,
        "useful_tflop": useful_flop / 1e12,
        "fp32_reference": fp32_reference(points[first]),
        "systems": systems(points[first], first),
        "paired_ratios": paired[first],
        "sweep": [
            {
                "in_flight": c,
                "fp32_reference": fp32_reference(r),
                "systems": systems(r, c),
                "paired_ratios": paired[c],
            }
            for c, r in points.items()
        ]
        if args.in_flight
        else None,
        "check": check,
        "agreement": None
        if top1_positions is None
        else {
            "reference": "transformers, float32",
            "text": "services/bench/data/prose.txt, through the chat template",
            "positions": top1_positions,
        },
    }
