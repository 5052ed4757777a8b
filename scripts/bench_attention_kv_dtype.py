"""Paged attention from float32 vs bfloat16 K/V pools, in one process: decode steps and prefill chunks
of SmolLM2-135M's attention (3 kv heads, 3 queries each, head size 64) over 30 layers, each layer its
own pool (so a step reads its contexts from memory, as in serving), page-scattered slots. Rounds
alternate which dtype goes first; reported: medians, minima, and the median of the rounds' paired ratios.

    CBSERVE_HOME=... python scripts/bench_attention_kv_dtype.py [--rounds 15]

CBSERVE_CPU_ISA=avx2|portable measures a lower vector path (services/worker/kernels.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from services.worker import kernels

KV_HEADS, GROUP, HEAD_DIM, LAYERS, PAGE = 3, 3, 64, 30, 16


def scattered_slots(lengths: list[int], num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """[B, max length] slots: each request's tokens on pages drawn at random from the whole pool."""
    pages = torch.randperm(num_pages, generator=gen)
    slots = torch.zeros(len(lengths), max(lengths), dtype=torch.int64)
    used = 0
    for b, length in enumerate(lengths):
        count = (length + PAGE - 1) // PAGE
        mine = pages[used : used + count]
        used += count
        slots[b, :length] = (mine[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:length]
    return slots


def pools(num_pages: int, gen: torch.Generator) -> dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per layer (K, V) pools; the bfloat16 ones are the float32 ones rounded."""
    out: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {torch.float32: [], torch.bfloat16: []}
    for _ in range(LAYERS):
        k, v = (torch.randn(num_pages * PAGE, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
        out[torch.float32].append((k, v))
        out[torch.bfloat16].append((k.bfloat16(), v.bfloat16()))
    return out


class Timing:
    """Seconds per step (all layers) of each dtype, round by round (the two of a round ran back to back):
    wall-clock, and CPU time of the process (all threads), which waiting for a core shared with other
    processes does not count."""

    def __init__(self) -> None:
        self.wall: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}
        self.cpu: dict[torch.dtype, list[float]] = {torch.float32: [], torch.bfloat16: []}

    def summary(self) -> str:
        lines = []
        for what, times in (("wall", self.wall), ("cpu", self.cpu)):
            fp32, bf16 = times[torch.float32], times[torch.bfloat16]
            # The ratio of each round's pair: other load on the machine shifts both of a pair alike.
            paired = statistics.median(f / b for f, b in zip(fp32, bf16, strict=True))
            lines.append(
                f"  {what}: float32 {statistics.median(fp32) * 1e3:.1f} ms (min {min(fp32) * 1e3:.1f}), "
                f"bfloat16 {statistics.median(bf16) * 1e3:.1f} ms (min {min(bf16) * 1e3:.1f}); "
                f"fp32/bf16: medians {statistics.median(fp32) / statistics.median(bf16):.3f}x, "
                f"mins {min(fp32) / min(bf16):.3f}x, paired {paired:.3f}x"
            )
        return "\n".join(lines)


def measure(step: Callable[[torch.dtype], None], rounds: int) -> Timing:
    """`step(dtype)` (all layers) timed `rounds` times per dtype, rounds alternating which goes first."""
    timing = Timing()
    order = [torch.float32, torch.bfloat16]
    for dtype in order:
        step(dtype)  # warm-up
    for r in range(rounds):
        for dtype in order if r % 2 == 0 else order[::-1]:
            wall, cpu = time.perf_counter(), time.process_time()
            step(dtype)
            timing.wall[dtype].append(time.perf_counter() - wall)
            timing.cpu[dtype].append(time.process_time() - cpu)
    return timing


def decode(module: Any, requests: int, rounds: int, gen: torch.Generator) -> Timing:
    lengths = torch.randint(200, 601, (requests,), generator=gen).tolist()
    num_pages = sum((n + PAGE - 1) // PAGE for n in lengths) * 5 // 4
    layers = pools(num_pages, gen)
    slots = scattered_slots(lengths, num_pages, gen)
    q = torch.randn(requests, KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    out, rows, lens = torch.empty_like(q), torch.arange(requests), torch.tensor(lengths)

    def step(dtype: torch.dtype) -> None:
        for k, v in layers[dtype]:
            module.paged_decode(q, out, rows, k, v, slots, lens, HEAD_DIM**-0.5, 0.0)

    return measure(step, rounds)


def prefill(module: Any, requests: int, new: int, context: int, rounds: int, gen: torch.Generator) -> Timing:
    lengths = [context + new] * requests
    num_pages = sum((n + PAGE - 1) // PAGE for n in lengths) * 5 // 4
    layers = pools(num_pages, gen)
    slots = scattered_slots(lengths, num_pages, gen)
    q = torch.randn(requests * new, KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    out = torch.empty_like(q)
    first_rows = torch.arange(requests) * new
    num_queries, lens = torch.full((requests,), new), torch.tensor(lengths)

    def step(dtype: torch.dtype) -> None:
        for k, v in layers[dtype]:
            module.paged_prefill(
                q, out, k, v, first_rows, num_queries, slots, lens, HEAD_DIM**-0.5, 0.0, 0
            )  # fmt: skip

    return measure(step, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    module = kernels._build("paged_attention")
    if module is None:
        raise SystemExit("the paged attention kernel did not build")
    gen = torch.Generator().manual_seed(0)
    print(f"path {module.isa()}, {torch.get_num_threads()} threads, {LAYERS} layers, {args.rounds} rounds")
    cases: list[tuple[str, Callable[[], Timing]]] = [
        ("decode, 16 requests of 200-600 tokens", lambda: decode(module, 16, args.rounds, gen)),
        ("decode, 48 requests of 200-600 tokens", lambda: decode(module, 48, args.rounds, gen)),
    ]
    if module.prefill_supports(HEAD_DIM):
        cases.append(
            (
                "prefill, 4 requests x 128 new tokens over 400",
                lambda: prefill(module, 4, 128, 400, args.rounds, gen),
            )
        )
    for name, run in cases:
        print(f"{name}:\n{run().summary()}", flush=True)


if __name__ == "__main__":
    main()
