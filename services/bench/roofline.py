"""`cbserve bench roofline`: how close the engine's decode steps come to what the machine allows.

A decode step must read every weight its products multiply by and every context's K and V once, so it
can take no less than (those bytes) / (the rate this machine reads memory); and it must do each row's
multiply-adds, so no less than (those FLOPs) / (the rate this machine multiplies at) either. At a few
rows the reads bound the step; with more rows on few cores the multiplies can (a 1B model's step of 16
rows on two cores). The benchmark measures the read rate with a probe that streams a buffer much
larger than the caches on every thread (csrc/memory_probe.cpp) and the multiply rate with a product
whose weight stays in cache, in the engine's own weight format and in torch's matmul (the faster
counts), then runs decode steps of `N` requests at a fixed context length and reports each point's
step time against both: the read fraction, the multiply fraction, and the roofline fraction (the
larger bound over the step time). Rates and steps are measured in the same run, so the fractions
hold whatever the machine.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from services.bench.arguments import ENGINE_DTYPES, in_flight_list
from services.bench.host_quiet import usable_cores
from services.common.cli_args import add_cb_arguments, bounded, cb_config, cb_settings, model_dir
from services.common.heap import ask_huge_pages, keep_freed_memory
from services.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.worker.engine import Engine

PROBE_BYTES = 1 << 30  # far beyond any cache, so that the probe reads memory, not cache
# The multiply probe's product: a weight of a few MB, which stays in cache while its rows reuse it.
MULTIPLY_ROWS, MULTIPLY_IN, MULTIPLY_OUT = 256, 2048, 2048


@dataclass(frozen=True)
class RooflinePoint:
    in_flight: int
    context: int  # prompt tokens of each request; the timed steps read this many and a few more
    step_s: float  # the timed steps' wall time per token of every request
    weight_bytes: int
    kv_bytes: int  # K and V the timed steps read, per step on average
    read_rate: float  # bytes/s of the probe
    flops: int  # the step's multiplies and adds: the weights' products and the attention's dots
    multiply_rate: float  # FLOP/s of the multiply probe

    @property
    def bytes_per_step(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def fraction(self) -> float:
        """The share of the read rate the step reaches: 1.0 means it only reads, at the machine's rate."""
        return self.bytes_per_step / self.step_s / self.read_rate

    @property
    def multiply_fraction(self) -> float:
        """The share of the multiply rate the step reaches."""
        return self.flops / self.step_s / self.multiply_rate

    @property
    def roofline_fraction(self) -> float:
        """The larger of the two bounds over the step time: 1.0 means the step takes only what the
        machine's reads or its multiplies, whichever is slower, allow."""
        return max(self.fraction, self.multiply_fraction)

    @property
    def output_tok_s(self) -> float:
        return self.in_flight / self.step_s


def measure_read_rate(repeats: int = 7) -> float:
    """Bytes per second that every thread of this process together reads memory at (best of `repeats`)."""
    import torch

    from services.worker.kernels import memory_probe

    probe = memory_probe()
    if probe is None:
        raise SystemExit("the read probe needs the native kernels (a C++ compiler, CBSERVE_NATIVE_KERNELS=1)")
    buffer = torch.ones(PROBE_BYTES, dtype=torch.uint8)  # written, so every page is committed
    probe.read_all(buffer)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        probe.read_all(buffer)
        best = min(best, time.perf_counter() - started)
    return PROBE_BYTES / best


def measure_multiply_rate(engine: Engine, repeats: int = 7) -> float:
    """FLOP/s this process multiplies at when the reads do not bound it: a product of MULTIPLY_ROWS rows by
    a MULTIPLY_OUT x MULTIPLY_IN weight, in the format of the engine's layers (its packed products, where
    it has them) and in torch's matmul in the weights' dtype, the faster of the two (best of `repeats`)."""
    import torch
    from torch import nn

    from services.worker.packed_linear import PackedWeight

    dtype = next(engine.model.parameters()).dtype
    linear = nn.Linear(MULTIPLY_IN, MULTIPLY_OUT, bias=False, dtype=dtype)
    x = torch.randn(MULTIPLY_ROWS, MULTIPLY_IN)
    x_in_dtype, weight = x.to(dtype), linear.weight.detach()
    products = [lambda: x_in_dtype @ weight.T]
    packed = engine.runner.packed_weights()
    if packed:  # the last is a layer's (our forward packs the LM head first, maybe in another format)
        layer_product = PackedWeight.of(packed[-1].ops, linear)
        products.append(lambda: layer_product(x))
    flops = 2 * MULTIPLY_ROWS * MULTIPLY_IN * MULTIPLY_OUT
    best = float("inf")
    with torch.inference_mode():
        for product in products:
            product()  # warm: any one-time preparation out of the timing
            for _ in range(repeats):
                started = time.perf_counter()
                product()
                best = min(best, time.perf_counter() - started)
    return flops / best


def decode_point(
    engine: Engine,
    in_flight: int,
    context: int,
    steps: int,
    read_rate: float,
    multiply_rate: float,
    seed: int = 0,
) -> RooflinePoint:
    """Time `steps` decode steps of `in_flight` requests of `context` random prompt tokens each."""
    rng = random.Random(seed)
    warmup = 4
    params = SamplingParams(max_new_tokens=warmup + steps + 2, ignore_eos=True)
    requests = [
        engine.add_request([rng.randrange(engine.vocab_size) for _ in range(context)], params)
        for _ in range(in_flight)
    ]
    # Until every request has decoded a few tokens: the prefills are done and the steps are pure decode.
    while min(len(r.output_ids) for r in requests) < warmup:
        engine.step()
    # Steps overlap under async batching (one builds while the other computes), and a step may hand
    # back the tokens of the one before: time the steps' tokens as they come, not each call.
    generated_before = sum(len(r.output_ids) for r in requests)
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - started
    generated = sum(len(r.output_ids) for r in requests) - generated_before
    engine.run_until_done()
    # Each request's keys during the timed steps: its prompt, the tokens before, and one more a step.
    mean_keys = context + warmup + generated / in_flight / 2
    geometry = engine.geometry
    kv_bytes = round(in_flight * mean_keys * geometry.bytes_per_token)
    # Each query head's dots with every key, and its sum of the V rows by their weights.
    query_heads = geometry.num_kv_heads * engine.runner.builder.query_group
    attention = 4 * mean_keys * query_heads * geometry.head_dim * geometry.num_layers
    return RooflinePoint(
        in_flight=in_flight,
        context=context,
        step_s=elapsed * in_flight / generated,
        weight_bytes=engine.runner.decode_weight_bytes(),
        kv_bytes=kv_bytes,
        read_rate=read_rate,
        flops=round(in_flight * (2 * engine.runner.decode_multiply_adds() + attention)),
        multiply_rate=multiply_rate,
    )


def _line(p: RooflinePoint) -> str:
    return (
        f"{p.in_flight} in flight, {p.context}-token contexts: decode step {p.step_s * 1e3:.2f} ms "
        f"({p.output_tok_s:.1f} tok/s), reads {p.weight_bytes / 1e6:.1f} MB of weights + "
        f"{p.kv_bytes / 1e6:.1f} MB of KV: {p.bytes_per_step / p.step_s / 1e9:.1f} GB/s, "
        f"{p.fraction:.2f} of the read rate; {p.flops / 1e9:.2f} GFLOP: {p.multiply_fraction:.2f} of the "
        f"multiply rate; {p.roofline_fraction:.2f} of the roofline"
    )


def add_roofline_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--dtype", choices=ENGINE_DTYPES, default="bfloat16", help="the weights' dtype")
    parser.add_argument(
        "--in-flight",
        type=in_flight_list,
        default=[1, 16],
        metavar="N,N,...",
        help="requests decoding together, one point each (default 1,16)",
    )
    parser.add_argument(
        "--context", type=bounded(int, 1), default=512, help="prompt tokens of each request (default 512)"
    )
    parser.add_argument("--steps", type=bounded(int, 2), default=32, help="timed decode steps a point")
    parser.add_argument(
        "--threads", type=bounded(int, 1), default=None, help="torch threads (default: usable cores)"
    )
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the points here")
    add_cb_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import torch

    from services.worker.engine import Engine

    cb_config(args)  # a bad setting is a usage error before the model loads
    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    keep_freed_memory()  # as the worker process does
    ask_huge_pages()
    model_path = Path(model_dir(args.model))
    read_rate = measure_read_rate()
    print(
        f"memory read rate: {read_rate / 1e9:.1f} GB/s ({PROBE_BYTES >> 20} MiB read by {threads} threads, "
        "best of 7)",
        flush=True,
    )
    settings = cb_settings(args)
    points = []
    with Engine.from_pretrained(model_path, dtype=getattr(torch, args.dtype), **settings) as engine:
        described = engine.runner.describe()
        print(f"engine: {model_path.name}, {', '.join(f'{k} {v}' for k, v in described.items())}", flush=True)
        multiply_rate = measure_multiply_rate(engine)
        print(
            f"multiply rate: {multiply_rate / 1e9:.0f} GFLOP/s ({MULTIPLY_ROWS} x {MULTIPLY_IN} rows by "
            f"{MULTIPLY_IN} x {MULTIPLY_OUT}, the faster of the layers' format and torch's, best of 7)",
            flush=True,
        )
        for in_flight in args.in_flight:
            point = decode_point(engine, in_flight, args.context, args.steps, read_rate, multiply_rate)
            points.append(point)
            print(_line(point), flush=True)
    if args.json is not None:
        rows = [
            asdict(p)
            | {
                "fraction": p.fraction,
                "multiply_fraction": p.multiply_fraction,
                "roofline_fraction": p.roofline_fraction,
                "output_tok_s": p.output_tok_s,
            }
            for p in points
        ]
        report = {"model": str(model_path), "dtype": args.dtype, "engine": described, "points": rows}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
