"""What `cbserve bench offline` reads off the systems' results beside their speed: whose greedy tokens
equal whose (`agreement`, against the fp32 reference or `--check`'s hf-generate), which requests did not
generate exactly what they asked, and the round-by-round ratios that a shared host's slow spells hit
alike.

A +constrained system generates other tokens than the rest, by design, and ends a request early where
its grammar completes (the report counts those apart): none of the token comparisons here takes it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.bench.offline.results import SystemResult
from services.bench.offline.systems import is_engine
from services.bench.workload import Workload


def agreement(results: dict[str, SystemResult], reference: str = "engine") -> dict[str, int]:
    """Per system other than `reference`: how many requests' greedy tokens equal the reference's."""
    if reference not in results:
        return {}
    want = results[reference].outputs
    return {
        name: sum(a == b for a, b in zip(r.outputs, want, strict=True))
        for name, r in unconstrained_results(results).items()
        if name != reference
    }


def unconstrained_results(results: dict[str, SystemResult]) -> dict[str, SystemResult]:
    """`results` but the +constrained systems'."""
    return {name: r for name, r in results.items() if "constraint" not in r.extra}


def fp32_reference(results: dict[str, SystemResult]) -> str | None:
    """The system whose greedy outputs the others are counted against: hf-generate, transformers' fp32
    `generate` one request at a time, if it ran; else the first engine system that ran at float32."""
    if "hf-generate" in results:
        return "hf-generate"
    unheld = unconstrained_results(results).items()
    engines = [n for n, r in unheld if is_engine(n) and r.extra.get("precision") == "float32"]
    return engines[0] if engines else None


def paired_ratios(by_name: Mapping[str, list[SystemResult]], peers: set[str]) -> dict[str, list[float]]:
    """Round by round, each system's tok/s over the engine's of the same round, and each of our
    engines' (`engine`, `engine:DTYPE`) over the faster peer's. A slow spell of a shared host hits
    the runs of one round alike, so these scatter less than the ratio of the medians in the table.
    Empty below two rounds."""
    engine = by_name.get("engine", [])
    if len(engine) < 2:
        return {}
    ratios = {
        name: [r.output_tok_s / e.output_tok_s for r, e in zip(runs, engine, strict=True)]
        for name, runs in by_name.items()
        if name != "engine"
    }
    present = [name for name in by_name if name in peers]
    if present:
        faster = [max(by_name[p][i].output_tok_s for p in present) for i in range(len(engine))]
        for name in filter(is_engine, by_name):
            ours = by_name[name]
            ratios[f"{name} / faster peer"] = [e.output_tok_s / f for e, f in zip(ours, faster, strict=True)]
    return ratios


def check_outputs(results: dict[str, SystemResult]) -> dict[str, Any]:
    """Compare every system's greedy outputs with hf-generate's; print and return the mismatches."""
    reference = results["hf-generate"].outputs
    report: dict[str, Any] = {}
    for name, result in unconstrained_results(results).items():
        if name == "hf-generate":
            continue
        mismatching = []
        for i, (got, want) in enumerate(zip(result.outputs, reference, strict=True)):
            if got != want:
                # Outputs of different lengths agree up to the shorter one, then differ at its end.
                pairs = zip(got, want, strict=False)
                first = next((k for k, (a, b) in enumerate(pairs) if a != b), min(len(got), len(want)))
                mismatching.append({"request": i, "first_diff": first, "len": len(got), "ref_len": len(want)})
        report[name] = {"requests": len(reference), "mismatching": mismatching}
        if mismatching:
            listed = ", ".join(f"#{m['request']}@{m['first_diff']}" for m in mismatching[:12])
            more = " ..." if len(mismatching) > 12 else ""
            print(
                f"check {name} vs hf-generate: {len(mismatching)}/{len(reference)} requests differ "
                f"(request@first differing token: {listed}{more})"
            )
        else:
            print(f"check {name} vs hf-generate: all {len(reference)} requests identical")
    return report


def short_outputs(results: dict[str, SystemResult], workload: Workload) -> dict[str, list[int]]:
    """Requests whose output length differs from their max_new_tokens, per system."""
    short: dict[str, list[int]] = {}
    for name, r in unconstrained_results(results).items():
        bad = [
            i for i, (o, n) in enumerate(zip(r.outputs, workload.max_new_tokens, strict=True)) if len(o) != n
        ]
        if bad:
            short[name] = bad
    return short
