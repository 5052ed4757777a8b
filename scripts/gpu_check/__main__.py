"""`python -m scripts.gpu_check`: the sections in order, one JSON summary (the package's docstring)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import scripts.gpu_check as gpu_check
from scripts.gpu_check.check import Check, Entry, failure, release_memory
from scripts.gpu_check.cuda_tests import tests_section
from scripts.gpu_check.env import env_section
from scripts.gpu_check.parity import parity_section
from scripts.gpu_check.profile import profile_section
from scripts.gpu_check.roofline import roofline_section
from scripts.gpu_check.serve import serve_section
from scripts.gpu_check.stack import stack_section
from scripts.gpu_check.throughput import throughput_section

# The roofline last: the device call's time limit reached inside it leaves every other section saved.
SECTIONS = ("env", "parity", "throughput", "serve", "stack", "tests", "roofline")
# Run only when asked for (--sections): a diagnosis, not one of the figures.
EXTRA_SECTIONS = ("profile",)
# Seconds a section is expected to need on an H200; one is skipped with less than this left.
NEEDS_S = {
    "env": 1,
    "parity": 30,
    "throughput": 120,
    "serve": 60,
    "profile": 60,
    "stack": 90,
    "tests": 60,
    "roofline": 60,
}


RUNNERS: dict[str, Callable[[Check], Entry]] = {
    "env": env_section,
    "parity": parity_section,
    "throughput": throughput_section,
    "serve": serve_section,
    "profile": profile_section,
    "stack": stack_section,
    "tests": tests_section,
    "roofline": roofline_section,
}


def targets(sections: Entry) -> Entry:
    """The issue's targets, read off the figures (None: not measured)."""
    ratios = sections.get("throughput", {}).get("ratios", {})
    parity = sections.get("parity", {})
    runs = [run for family in parity.values() if isinstance(family, dict) for run in family.values()]
    measured = [run["equal_generate"] for run in runs if isinstance(run, dict) and "equal_generate" in run]
    stack = sections.get("stack", {})

    def at_least(value: float | None, bound: float) -> bool | None:
        return None if value is None else value >= bound

    loads = sections.get("roofline", {}).get("loads", {})

    def engine_figure(load: str, *path: str) -> Any:
        value: Any = loads.get(load, {}).get("systems", {}).get("engine", {})
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value

    prefill = [engine_figure(load, "prefill", "fraction_median") for load in loads]
    prefill = [p for p in prefill if p is not None]
    return {
        "engine_3x_transformers_cb": at_least(ratios.get("engine_over_transformers_cb"), 3.0),
        "roofline_decode_0.70_a": at_least(engine_figure("a", "decode", "fraction_median"), 0.70),
        "roofline_decode_0.70_b": at_least(engine_figure("b", "decode", "fraction_median"), 0.70),
        "roofline_prefill_0.55": at_least(min(prefill), 0.55) if prefill else None,
        "roofline_engine_5x_transformers_cb_a": at_least(
            loads.get("a", {}).get("engine_over_transformers_cb"), 5.0
        ),
        "graphs_2x_eager_decode_steps": at_least(ratios.get("graphs_over_eager_decode_steps"), 2.0),
        "greedy_identical": all(measured) if measured else None,
        "async_identical": None
        if ratios.get("same_tokens_async_sync") is None
        else ratios["same_tokens_async_sync"] == 1.0,
        "stack_streams_identical": all(
            stack.get(k, {}).get("streams_equal_generate") is True for k in ("swap", "worker_kill")
        )
        if "swap" in stack
        else None,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.gpu_check", description=(gpu_check.__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="small models and workloads (the CPU test)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"a subset of {','.join(SECTIONS)}")
    # 480 s: the sections before the roofline took ~3 minutes on an H200, the roofline 3-4 (its
    # docstring), and one device call of 9 minutes holds this, the start-up and a margin.
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall time the check may take")
    parser.add_argument(
        "--roofline-scale",
        type=float,
        default=1.0,
        help="the roofline section's requests, x this (fewer than a workload's running: fewer run together)",
    )
    parser.add_argument("--out-dir", type=Path, help="also write the summary and the logs here")
    parser.add_argument("--workdir", type=Path, help="models and logs (default: a temporary folder)")
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS) - set(EXTRA_SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {','.join(SECTIONS + EXTRA_SECTIONS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: pass --device cpu")
    if args.roofline_scale <= 0:
        parser.error("--roofline-scale must be positive")

    from services.common.logging import configure_logging, disable_progress_bars

    configure_logging(service="gpu_check")
    disable_progress_bars()
    started = time.monotonic()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="cbserve-gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results: Entry = {}

    def save_partial(name: str, entry: Entry) -> None:
        results[name] = entry | {"partial": True}
        if args.out_dir is not None:
            save(args.out_dir, summarize(args, results, time.monotonic() - started), results)

    check = Check(
        args.device, args.quick, started + args.budget_s, workdir, args.roofline_scale, save_partial
    )
    text = summarize(args, results, 0.0)
    for name in sections:
        left = check.seconds_left()
        if left < NEEDS_S[name] and not args.quick:
            results[name] = {"skipped": f"{left:.0f} s of the budget left, {NEEDS_S[name]} s needed"}
            continue
        section_started = time.monotonic()
        try:
            results[name] = RUNNERS[name](check)
        except Exception as exc:
            results[name] = failure(exc)
        results[name]["section_s"] = round(time.monotonic() - section_started, 1)
        release_memory()
        text = summarize(args, results, time.monotonic() - started)
        if args.out_dir is not None:
            save(args.out_dir, text, results)
    print(text, flush=True)
    return 0


def served_share(sections: Entry) -> float | None:
    """What the three processes keep of the engine's in-process rate (the default configuration's)."""
    served = sections.get("serve", {}).get("output_tok_s")
    in_process = sections.get("throughput", {}).get("systems", {}).get("graphs_async", {}).get("output_tok_s")
    return round(served / in_process, 2) if served and in_process else None


def summarize(args: argparse.Namespace, results: Entry, wall_s: float) -> str:
    summary = {
        "check": "cbserve gpu_check (issue 12)",
        "device": args.device,
        "quick": args.quick,
        "wall_s": round(wall_s, 1),
        "targets": targets(results),
        "served_over_in_process": served_share(results),
        "sections": results,
    }
    return json.dumps(summary, indent=1, default=str)


def save(out_dir: Path, text: str, results: Entry) -> None:
    """The summary, and the logs sections name (what the device brings back: a few flat files)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gpu_check.json").write_text(text + "\n")
    for name in ("serve", "stack", "tests"):
        log = results.get(name, {}).get("log")
        if log and Path(log).is_file():
            (out_dir / f"{name}.log").write_bytes(Path(log).read_bytes()[-8_000_000:])


if __name__ == "__main__":
    sys.exit(main())
