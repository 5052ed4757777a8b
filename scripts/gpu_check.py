"""The device check of issue 12: CUDA graphs, the CUDA memory paths and the engine's speed on one GPU,
in one command that prints one JSON summary.

    make gpu-check                                     # on the GPU host, gpu-wheels/ carried along
    python scripts/gpu_check.py --device cpu --quick   # the same code paths on a CPU, small

With `--out-dir` the summary (rewritten after each section, so that a check cut short keeps what it
measured) and the logs of the stack and of the tests land there too.

Sections run in this order, each in its own `try`: a failure is recorded in its entry (`error` and the
end of the traceback) and the others still run; one that would start too close to `--budget-s` is
recorded as skipped. Within a section each system or phase is tried on its own too.

- env: versions, the device and its memory.
- parity: tiny models (tests/tiny_models.py), fp32: greedy tokens with graphs on and off against
  transformers `generate` on the same device, with chunked prefill, prefix hits and a swap round trip
  in the mix (and the counts that show each happened); async batching on, or why it is refused. Each
  run says which forward and attention ran (on a GPU the Llama runs ours, gpu_llama.py, and once more
  with transformers' layers, the fallback: `CBSERVE_FORWARD=transformers`).
- throughput: a Llama-shaped model of about 1B parameters (random, seeded, bf16) on a decode-heavy
  workload (256 requests, 64 running): output tokens/s with graphs on and off and async on and off,
  the default again with transformers' layers in place of ours (what the fused forward adds), and
  transformers' own continuous batching with its CUDA graphs; decode steps/s at 64 running
  requests; step time by kind: whole decode graphs, piecewise graphs (prefill and mixed steps on
  our forward), eager steps, and the share left eager; capture time, graph count and memory of each.
- serve: the throughput load (prompts of one length) through `cbserve up --device cuda` on the same
  model, its defaults (graphs and async), by `cbserve bench serve` over gRPC: output tok/s, TTFT and
  inter-token latency, what the three processes keep of the in-process rate, and which forward and
  attention the worker ran (its start-up line).
- stack: `cbserve up --device cuda` on the tiny Llama: the worker maps the KV pool by CUDA IPC handle
  and registers the swap pool as pinned memory, a swap-out/in round trip, and a worker SIGKILL
  mid-stream whose streams finish identical to `generate`, after the restarted worker attached again.
- tests: the CUDA-only tests (`pytest -m cuda`).
- roofline: a Llama-3.1-8B-shaped model (random, bf16) on 1,024- and 4,096-token prompts: per decode
  step the share of the measured copy rate its reads reach, per prefill step that of the measured bf16
  matmul rate, output tok/s and TTFT, against transformers' continuous batching and the gather path
  (`roofline_section`). Last, and saved part by part: a stop inside it loses no other figure.

On a CPU (`--device cpu`) graphs cannot be captured: the graphs-on runs use `eager_capture`, the same
buckets and static inputs run eagerly, so that every path but the capture itself is exercised.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import inspect
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# As in tests/conftest.py: the stack's children start by a plain fork while gRPC channels are open.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import torch  # noqa: E402

from services.bench.offline.transformers_cb import hf_cb_collect, started_manager  # noqa: E402
from services.bench.workload import Workload  # noqa: E402
from services.common.config import CBConfig  # noqa: E402
from services.common.sampling_params import SamplingParams  # noqa: E402
from services.common.switches import switched  # noqa: E402
from services.worker import attention_kernels, layer_forward  # noqa: E402
from services.worker.cuda_graphs import eager_capture  # noqa: E402
from services.worker.engine import Engine  # noqa: E402

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
SEED = 1234
KEEP_AFTER_THROUGHPUT_S = 180  # for serving, the stack and the tests
Entry = dict[str, Any]


def attempt(entry: Entry, key: str, fn: Callable[..., Any], *args: Any) -> None:
    """`entry[key] = fn(*args)`, or the error it raised: one failure loses no other figure."""
    try:
        entry[key] = fn(*args)
    except Exception as exc:
        entry[key] = failure(exc)


def failure(exc: BaseException) -> Entry:
    return {
        "error": f"{type(exc).__name__}: {exc}"[:600],
        "traceback": traceback.format_exc().splitlines()[-6:],
    }


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@dataclasses.dataclass
class Check:
    device: str
    quick: bool
    deadline: float
    workdir: Path
    roofline_scale: float = 1.0
    # Saves a section's entry before it ends (`main` sets it): what a long one measured survives a stop.
    save_partial: Callable[[str, Entry], None] = lambda name, entry: None

    def seconds_left(self, keep: float = 0.0) -> float:
        """Seconds of the budget left, less `keep` for what comes after."""
        return self.deadline - time.monotonic() - keep

    def stack_start_s(self) -> float:
        """How long a stack may take to start: a minute at least, four at most, a minute left after."""
        return min(240.0, max(60.0, self.seconds_left(keep=60)))

    def graphs_settings(self, on: bool) -> dict[str, Any]:
        """The engine settings for graphs on or off; on a CPU they are emulated after construction."""
        return {"use_cuda_graph": on} if self.device == "cuda" else {}

    def engine(self, model: Any, settings: dict[str, Any], graphs: bool, gpu_forward: bool = False) -> Engine:
        """An engine on `model` (a directory or a loaded model), with decode graphs or without. On a
        CPU, `gpu_forward` runs a GPU's fallback forward (transformers' modules, gather + SDPA) instead
        of the native kernels: the Triton forward a GPU runs a Llama with would run under Triton's
        interpreter here, too slow for a check (tests/test_gpu_llama.py runs it on the CPU)."""
        cb = settings | self.graphs_settings(graphs)

        def build() -> Engine:
            if isinstance(model, Path):
                return Engine.from_pretrained(model, device=self.device, **cb)
            # On a CPU our own forward takes the model it is given (it lets the plain weights go once
            # packed): each engine gets a copy, as every system on a GPU reads the same weights.
            return Engine(
                model if self.device == "cuda" else copy.deepcopy(model), CBConfig.from_kwargs(**cb)
            )

        if self.device == "cuda":
            return build()
        if gpu_forward:
            from tests.cuda_forward import cuda_like

            engine = cuda_like(build)
        else:
            engine = build()
        if graphs:
            engine.runner.use_graphs(eager_capture)
        return engine


def path_facts(engine: Engine) -> Entry:
    """Which forward and which attention kernels ran (layer_forward.py, attention_kernels.py)."""
    return {"forward": engine.runner.describe()["forward"], "attention": engine.runner.attention.name}


def graph_facts(engine: Engine) -> Entry | None:
    graphs = engine.runner.graphs
    if graphs is None:
        return None
    return {
        "graphs": graphs.count,
        "capture_s": round(graphs.cost.seconds, 2),
        "memory_mib": graphs.cost.memory_mib,
        "max_requests": graphs.buckets.max_tokens,
        "max_context": graphs.buckets.max_keys,
        "replays": graphs.replays,
        "eager_decodes": graphs.eager_decodes,
        "piecewise": piecewise_facts(engine),
    }


def piecewise_facts(engine: Engine) -> Entry | None:
    """The pieces of the steps no decode graph serves (None: transformers' layers, which have none)."""
    pieces = engine.runner.pieces
    if pieces is None:
        return None
    return {
        "graphs": pieces.count,
        "buckets": pieces.buckets,
        "capture_s": round(pieces.cost.seconds, 2),
        "memory_mib": pieces.cost.memory_mib,
        "replays": pieces.replays,
        "eager_steps": pieces.eager_steps,
    }


# ------------------------------------------------------------------------------------------------ env


def env_section(check: Check) -> Entry:
    import transformers

    entry: Entry = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_runtime": torch.version.cuda,
        "device": check.device,
    }
    if check.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info()
        entry |= {
            "gpu": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(total / 2**30, 1),
            "free_gib": round(free / 2**30, 1),
        }
    return entry


# --------------------------------------------------------------------------------------------- parity

# Chunked prefill (7 prompt tokens a request a step), a pool too small for three requests (offloads to
# the swap pool and restores), and a second round that shares a prefix with the first (prefix hits).
PARITY_SETTINGS = {
    "page_size": 8,
    "max_batch_tokens": 16,
    "long_prefill_token_threshold": 7,
    "cpu_offload_space": 0.01,
    "kv_padding_interval_size": 16,
}
PARITY_NEW_TOKENS = 20


def parity_section(check: Check) -> Entry:
    from tests.parity import SWAP_BLOCKS, generate_reference, make_prompts, reference_attn
    from tests.tiny_models import tiny_model_dir

    shared = [random.Random(3).randint(3, 255) for _ in range(40)]
    rounds = [make_prompts(11, 3, shared), make_prompts(12, 4, shared)]
    entry: Entry = {}
    for family in ("llama",) if check.quick else ("llama", "gemma2"):
        model_dir = tiny_model_dir(family, check.workdir / "models")
        attn = reference_attn(family)
        expected = [generate_reference(model_dir, r, PARITY_NEW_TOKENS, check.device, attn) for r in rounds]
        settings = PARITY_SETTINGS | {"num_blocks": SWAP_BLOCKS[family], "use_async_batching": False}
        runs: Entry = {}
        attempt(runs, "graphs", parity_run, check, model_dir, settings, rounds, expected, True)
        attempt(runs, "eager", parity_run, check, model_dir, settings, rounds, expected, False)
        async_settings = settings | {"use_async_batching": True}
        attempt(
            runs, "async", refused_or, parity_run, check, model_dir, async_settings, rounds, expected, True
        )
        if check.device == "cuda" and family == "llama":
            # The fallback too: transformers' layers where ours (the Triton forward on a GPU) would run.
            attempt(
                runs,
                "graphs_transformers_layers",
                parity_run,
                check,
                model_dir,
                settings,
                rounds,
                expected,
                True,
                "transformers",
            )
        entry[family] = runs
        release_memory()
    return entry


def parity_run(
    check: Check,
    model_dir: Path,
    settings: Entry,
    rounds: list[list[list[int]]],
    expected: Any,
    graphs: bool,
    forward: str | None = None,
) -> Entry:
    """`forward`: CBSERVE_FORWARD for the engine (None: as it is, `auto`)."""
    with switched(layer_forward.SWITCH, forward), check.engine(model_dir, settings, graphs, True) as engine:
        outputs = [engine.generate(r, PARITY_NEW_TOKENS, ignore_eos=True) for r in rounds]
        stats = engine.stats()
        builder = engine.runner.builder
        return {
            **path_facts(engine),
            "equal_generate": outputs == expected,
            "prompt_chunks": builder.prompt_chunks,
            "padded_queries": builder.padded_queries,
            "prefix_hit_tokens": stats["prefix_hit_tokens"],
            "offloads": stats["offloads"],
            "swap_restores": stats["swap_restores"],
            "soft_resets": stats["soft_resets"],
            "graphs": graph_facts(engine),
        }


def refused_or(fn: Callable[..., Entry], *args: Any) -> Entry:
    """`fn(*args)`, or the configuration's refusal (async batching, before it is built)."""
    try:
        return fn(*args)
    except ValueError as exc:
        if "not implemented" not in str(exc):
            raise
        return {"refused": str(exc)}


# ----------------------------------------------------------------------------------------- throughput


def speed_model(check: Check) -> Any:
    """Llama-shaped, about 1B parameters (Llama 3.2 1B's layers, a 32k vocabulary), random weights from
    a fixed seed, made on the device; `--quick`: a tiny one of the same shape."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape: dict[str, Any] = (
        {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": 512,
            "max_position_embeddings": 512,
        }
        if check.quick
        else {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 32000,
            "max_position_embeddings": 2048,
            "rope_theta": 500000.0,
        }
    )
    config = LlamaConfig(**shape, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    dtype = torch.bfloat16 if check.device == "cuda" else torch.float32
    torch.manual_seed(SEED)
    with torch.device(check.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.to(check.device).eval()


def speed_settings(check: Check) -> Entry:
    if check.quick:
        return {"page_size": 32, "num_blocks": 128, "max_batch_tokens": 64, "max_requests_per_batch": 4}
    return {"page_size": 32, "num_blocks": 2048, "max_batch_tokens": 512, "max_requests_per_batch": 64}


def decode_heavy(check: Check, vocab: int) -> Workload:
    """The throughput load: random prompts of 32-128 tokens, each request 256 new tokens (`--quick`:
    12 of 8-24 tokens, 8 new), drawn from `SEED` so every system and every run sees the same."""
    rng = random.Random(SEED)
    count, lengths, new_tokens = (12, (8, 24), 8) if check.quick else (256, (32, 128), 256)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(count)]
    return Workload(prompts, [new_tokens] * count)


class StepClock:
    """Wall time of each engine step, by whether its forward replayed a whole graph, piecewise ones or
    none (a step's time is its own: its sampling reads the tokens back to the host)."""

    def __init__(self, engine: Engine) -> None:
        self.seconds = {"graph": 0.0, "piecewise": 0.0, "eager": 0.0, "no_forward": 0.0}
        self.steps = dict.fromkeys(self.seconds, 0)
        self._kind = "no_forward"
        runner, forward, step = engine.runner, engine.runner.forward, engine.step

        def timed_forward(batch: Any, before: torch.Tensor | None = None) -> torch.Tensor:
            whole, pieces = batch.shape is not None, batch.piecewise is not None
            self._kind = "graph" if whole else "piecewise" if pieces else "eager"
            return forward(batch, before)

        def timed_step(*args: Any, **kwargs: Any) -> Any:
            self._kind = "no_forward"
            started = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                self.seconds[self._kind] += time.perf_counter() - started
                self.steps[self._kind] += 1

        runner.forward = timed_forward  # type: ignore[method-assign]
        engine.step = timed_step  # type: ignore[method-assign]

    def facts(self) -> Entry:
        computed = self.seconds["graph"] + self.seconds["piecewise"] + self.seconds["eager"]
        return {
            "steps": self.steps,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
            "eager_time_share": round(self.seconds["eager"] / computed, 3) if computed else None,
        }


def decode_steps_per_s(engine: Engine, check: Check, vocab: int) -> Entry:
    """Steps/s once `max_requests_per_batch` requests all decode (their prompts computed)."""
    running, steps = (4, 5) if check.quick else (64, 100)
    rng = random.Random(SEED + 1)
    params = SamplingParams(temperature=0.0, max_new_tokens=steps * 4, ignore_eos=True)
    requests = [
        engine.add_request([rng.randrange(3, vocab) for _ in range(128)], params) for _ in range(running)
    ]
    while any(not r.output_ids for r in requests):
        engine.step()
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - started
    for r in requests:
        engine.abort(r.request_id)
    engine.run_until_done()
    return {"running": running, "steps": steps, "steps_per_s": round(steps / seconds, 1)}


def engine_system(
    check: Check,
    model: Any,
    settings: Entry,
    load: Workload,
    graphs: bool,
    async_: bool,
    forward: str | None = None,
) -> Entry:
    """`forward`: CBSERVE_FORWARD for the engine (None: as it is, `auto`)."""
    cb = settings | {"use_async_batching": async_}
    started = time.perf_counter()
    with switched(layer_forward.SWITCH, forward):
        engine = check.engine(model, cb, graphs)
    entry: Entry = {"setup_s": round(time.perf_counter() - started, 2), **path_facts(engine)}
    vocab = engine.vocab_size
    with engine:
        engine.generate([load.prompts[0][:8]], 4, ignore_eos=True)  # first-use costs, untimed
        clock = None if async_ else StepClock(engine)
        started = time.perf_counter()
        outputs = engine.generate(load.prompts, load.max_new_tokens, ignore_eos=True)
        wall = time.perf_counter() - started
        entry |= {"wall_s": round(wall, 2), "output_tok_s": round(load.total_output_tokens / wall, 1)}
        if clock is not None:
            entry["steps"] = clock.facts()
        attempt(entry, "decode_at_full_batch", decode_steps_per_s, engine, check, vocab)
        entry["graphs"] = graph_facts(engine)
    entry["outputs"] = outputs
    return entry


def hf_continuous_batching(
    check: Check, model: Any, settings: Entry, load: Workload, keep_s: float = KEEP_AFTER_THROUGHPUT_S
) -> Entry:
    """transformers' continuous batching on the same model and workload, with its CUDA graphs, through
    the benchmarks' one driver of it (services/bench/offline/transformers_cb.py): the engine's settings,
    not the CPU baseline's, and every request at once. It stops waiting `keep_s` before the budget's
    end, for what runs after it."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    wanted = {
        "page_size" if "page_size" in fields else "block_size": settings["page_size"],
        "num_blocks": settings["num_blocks"],
        "max_batch_tokens": settings["max_batch_tokens"],
        "max_requests_per_batch": settings["max_requests_per_batch"],
        "use_cuda_graph": check.device == "cuda",
        "auto_switch_to_flash": False,
    }
    cb_config = ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})
    gen_config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(load.max_new_tokens))
    model.set_attn_implementation("sdpa")  # transformers makes it "paged|sdpa"; ours would not do
    started = time.perf_counter()
    # A bounded, hard stop: after a failure requests may be left, and a hung thread must not hang us.
    with started_manager(model, gen_config, cb_config, stop_timeout_s=60) as manager:
        entry: Entry = {"setup_s": round(time.perf_counter() - started, 2)}
        hf_cb_collect(manager, [load.prompts[0][:8]], [4], "warmup", 1, deadline=time.monotonic() + 60)
        timed = FirstTokens(manager)
        started = time.perf_counter()
        # Not past the time what comes after needs: a stalled baseline must not cost it.
        timeout = max(20.0, check.seconds_left(keep=keep_s))
        deadline = time.monotonic() + timeout
        outputs = hf_cb_collect(
            timed, load.prompts, load.max_new_tokens, "run", load.num_requests, deadline=deadline
        )
        wall = time.perf_counter() - started
        resolved = manager.continuous_batching_config
        entry |= {
            "wall_s": round(wall, 2),
            "output_tok_s": round(load.total_output_tokens / wall, 1),
            "ttft_ms_median": rounded(median([1e3 * t for t in timed.ttft_s]), 1),
            "settings": {
                name: str(getattr(resolved, name, None))
                for name in (
                    "use_cuda_graph",
                    "use_async_batching",
                    "q_padding_interval_size",
                    "kv_padding_interval_size",
                    "max_requests_per_batch",
                )
            },
            "attn_implementation": model.config._attn_implementation,
        }
    entry["outputs"] = outputs
    return entry


class FirstTokens:
    """transformers' manager as `hf_cb_collect` drives it, each request asked to time its tokens: keeps
    each finished request's time to first token (from its creation, on the host's clock). A
    transformers whose requests take no `record_timestamps` is driven as it is, and keeps none."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.ttft_s: list[float] = []
        self._timed = "record_timestamps" in inspect.signature(manager.add_request).parameters

    def add_request(self, *args: Any, **kwargs: Any) -> Any:
        if self._timed:
            kwargs["record_timestamps"] = True
        return self.manager.add_request(*args, **kwargs)

    def get_result(self, *args: Any, **kwargs: Any) -> Any:
        result = self.manager.get_result(*args, **kwargs)
        if result is not None and result.is_finished() and getattr(result, "timestamps", None):
            self.ttft_s.append(result.timestamps[0] - result.created_time)
        return result

    def is_running(self) -> bool:
        return bool(self.manager.is_running())


def throughput_section(check: Check) -> Entry:
    model = speed_model(check)
    vocab = model.config.vocab_size
    load = decode_heavy(check, vocab)
    settings = speed_settings(check)
    entry: Entry = {
        "model": {"parameters": sum(p.numel() for p in model.parameters()), "dtype": str(model.dtype)},
        "workload": {
            "requests": load.num_requests,
            "prompt_tokens": load.total_prompt_tokens,
            "new_tokens_each": load.max_new_tokens[0],  # decode_heavy gives every request the same
            "running_at_most": settings["max_requests_per_batch"],
        },
    }
    # Most telling first: what is cut for time (the stack and the tests keep theirs) is the least.
    # graphs_async is the engine as it runs on a GPU by default.
    runs: list[tuple[str, Callable[..., Entry], tuple[Any, ...]]] = [
        ("graphs_async", refused_or, (engine_system, check, model, settings, load, True, True)),
        ("transformers_cb", hf_continuous_batching, (check, model, settings, load)),
        # The engine's default with transformers' layers in place of ours: what the fused forward adds.
        (
            "graphs_async_transformers_layers",
            refused_or,
            (engine_system, check, model, settings, load, True, True, "transformers"),
        ),
        ("graphs", refused_or, (engine_system, check, model, settings, load, True, False)),
        ("eager", refused_or, (engine_system, check, model, settings, load, False, False)),
        ("eager_async", refused_or, (engine_system, check, model, settings, load, False, True)),
    ]
    systems: Entry = {}
    for name, fn, args in runs:
        if check.seconds_left(keep=KEEP_AFTER_THROUGHPUT_S) < 20:
            systems[name] = {"skipped": "out of time"}
            continue
        attempt(systems, name, fn, *args)
        release_memory()
    entry["systems"] = {
        name: {k: v for k, v in facts.items() if k != "outputs"} for name, facts in systems.items()
    }
    entry["ratios"] = throughput_ratios(systems)
    return entry


def throughput_ratios(systems: Entry) -> Entry:
    def figure(name: str, *path: str) -> float | None:
        value: Any = systems.get(name, {})
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value if isinstance(value, int | float) else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a and b else None

    def same(a: str, b: str) -> float | None:
        outs_a, outs_b = systems.get(a, {}).get("outputs"), systems.get(b, {}).get("outputs")
        if not outs_a or not outs_b:
            return None
        return round(sum(x == y for x, y in zip(outs_a, outs_b, strict=True)) / len(outs_a), 3)

    return {
        "engine_over_transformers_cb": ratio(
            figure("graphs_async", "output_tok_s"), figure("transformers_cb", "output_tok_s")
        ),
        "graphs_sync_over_transformers_cb": ratio(
            figure("graphs", "output_tok_s"), figure("transformers_cb", "output_tok_s")
        ),
        "graphs_over_eager_output": ratio(figure("graphs", "output_tok_s"), figure("eager", "output_tok_s")),
        "graphs_over_eager_decode_steps": ratio(
            figure("graphs", "decode_at_full_batch", "steps_per_s"),
            figure("eager", "decode_at_full_batch", "steps_per_s"),
        ),
        "async_over_sync": ratio(figure("graphs_async", "output_tok_s"), figure("graphs", "output_tok_s")),
        "own_layers_over_transformers_layers": ratio(
            figure("graphs_async", "output_tok_s"), figure("graphs_async_transformers_layers", "output_tok_s")
        ),
        "own_layers_over_transformers_layers_decode_steps": ratio(
            figure("graphs_async", "decode_at_full_batch", "steps_per_s"),
            figure("graphs_async_transformers_layers", "decode_at_full_batch", "steps_per_s"),
        ),
        # bf16: graphs and eager pad differently, so a near tie may flip; async must change nothing.
        "same_tokens_graphs_eager": same("graphs", "eager"),
        "same_tokens_async_sync": same("graphs_async", "graphs"),
        # bf16: our passes round once where transformers' layers round each op: near ties may flip.
        "same_tokens_own_transformers_layers": same("graphs_async", "graphs_async_transformers_layers"),
        "same_tokens_engine_transformers_cb": same("graphs", "transformers_cb"),
    }


# ---------------------------------------------------------------------------------------------- serve


def serve_section(check: Check) -> Entry:
    """The throughput section's load through the three processes, on the device's defaults (graphs
    and async batching on a GPU), driven over gRPC by `cbserve bench serve`: 256 requests of 80 prompt
    tokens and 256 new tokens each, 64 in flight (`--quick`: 12 of 16 and 8, 4 in flight). Output
    tok/s, time to first token and inter-token latency, what the stack keeps of the in-process rate."""
    from services.supervisor import cbserve_argv
    from tests.stack import Stack

    model_dir = check.workdir / "speed-model"
    if not (model_dir / "config.json").is_file():
        model = speed_model(check)
        model.save_pretrained(model_dir)
        del model
        release_memory()
    count, prompt, new_tokens, running = (12, 16, 8, 4) if check.quick else (256, 80, 256, 64)
    dtype = "bfloat16" if check.device == "cuda" else "float32"
    logs = check.workdir / "serve"
    logs.mkdir(exist_ok=True)
    started = time.monotonic()
    stack = Stack(
        model_dir,
        logs,
        up_args=["--device", check.device, "--dtype", dtype],
        start_timeout_s=check.stack_start_s(),
        **speed_settings(check),
    )
    entry: Entry = {"start_s": round(time.monotonic() - started, 1), "log": str(stack.log_path)}
    report = logs / "serve.json"
    try:
        argv = cbserve_argv(
            "bench",
            "serve",
            "--target",
            stack.target,
            "--workload",
            "random",
            "--ignore-eos",
            "--num-requests",
            str(count),
            "--concurrency",
            str(running),
            "--input-len",
            str(prompt),
            "--output-len",
            str(new_tokens),
            "--json",
            str(report),
            "--no-progress",
        )
        timeout = max(30.0, check.seconds_left(keep=90))
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"cbserve bench serve exited {done.returncode}: {done.stderr[-600:]}")
        phase = json.loads(report.read_text())["phases"][0]
        latency = phase["latency_s"]
        entry |= {
            "requests": phase["requests"]["completed"],
            "failed": phase["requests"]["failed"],
            "output_tok_s": round(phase["throughput"]["output_tokens_per_s"], 1),
            "ttft_ms": {k: round(latency["ttft"][k] * 1e3, 1) for k in ("p50", "p99")},
            "itl_ms": {k: round(latency["itl"][k] * 1e3, 2) for k in ("p50", "p99")},
            "worker": attach_facts(stack),
        }
    finally:
        entry["exit_code"] = stack.stop()
    attempt(entry, "paths", worker_paths, stack.log_path)
    return entry


def worker_paths(log_path: Path) -> Entry | None:
    """Which forward and attention kernels a stack's worker ran, from its JSON start-up line."""
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"worker ready"' in line:
            fields = json.loads(line)
            return {key: fields.get(key) for key in ("forward", "attention")}
    return None


# -------------------------------------------------------------------------------------------- profile

PROFILE_REQUESTS = 64
PROFILE_DECODES = 5  # steps profiled after every prompt is in


def profile_section(check: Check) -> Entry:
    """Where the time of the steps that replay no whole graph goes (prefills, mixed steps): the first steps
    of the throughput workload, timed step by step on one engine and again, same shapes, on a second
    (what the second saves is a per-shape cost), then under torch's profiler on a third (its top
    operators by host and by device time); and SDPA's first and second call per shape and backend."""
    model = speed_model(check)
    load = decode_heavy(check, model.config.vocab_size)
    prompts = load.prompts[: 4 if check.quick else PROFILE_REQUESTS]
    settings = speed_settings(check) | {"use_async_batching": False}  # each step's time its own
    entry: Entry = {"sdpa": sdpa_probe(check)}
    for name in ("first", "again"):
        attempt(entry, name, timed_steps, check, model, settings, prompts)
    attempt(entry, "profiler", profiled_steps, check, model, settings, prompts)
    return entry


def prefill_steps(engine: Engine, prompts: list[list[int]], each: Callable[[], None]) -> None:
    """Steps until every prompt has its first token, then PROFILE_DECODES more; `each` after a step."""
    params = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while any(not r.output_ids for r in requests):
        engine.step()
        each()
    for _ in range(PROFILE_DECODES):
        engine.step()
        each()


def timed_steps(check: Check, model: Any, settings: Entry, prompts: list[list[int]]) -> Entry:
    times: list[float] = []
    with check.engine(model, settings, graphs=True) as engine:
        clock = StepClock(engine)
        last = [time.perf_counter()]

        def each() -> None:
            if check.device == "cuda":
                torch.cuda.synchronize()
            now = time.perf_counter()
            times.append(round((now - last[0]) * 1e3, 1))
            last[0] = now

        prefill_steps(engine, prompts, each)
        phases = engine.phase_totals
        return {
            "step_ms": times,
            "kinds": clock.facts(),
            "phases_ms": {k: round(getattr(phases, k) * 1e3, 1) for k in phases.PHASES},
        }


def profiled_steps(check: Check, model: Any, settings: Entry, prompts: list[list[int]]) -> Entry:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if check.device == "cuda" else [])
    with check.engine(model, settings, graphs=True) as engine, profile(activities=activities) as prof:
        prefill_steps(engine, prompts, lambda: None)
    events = prof.key_averages()

    def top(key: str) -> list[str]:
        rows = sorted(events, key=lambda e: getattr(e, key, 0.0), reverse=True)[:25]
        return [
            f"{e.key[:60]} n={e.count} cpu={e.self_cpu_time_total / 1e3:.1f}ms "
            f"dev={getattr(e, 'self_device_time_total', 0.0) / 1e3:.1f}ms"
            for e in rows
        ]

    return {"top_host": top("self_cpu_time_total"), "top_device": top("self_device_time_total")}


def sdpa_once(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, backends: Any) -> Any:
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    if backends is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    with sdpa_kernel(backends):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def sdpa_probe(check: Check) -> Entry:
    """A prefill row group's SDPA (bf16, additive mask): ms of the first and the second call of each
    new shape, with torch's choice of backend and with each backend alone."""
    from torch.nn.attention import SDPBackend

    dtype = torch.bfloat16 if check.device == "cuda" else torch.float32
    shapes = [(4, 128, 256), (3, 112, 256), (5, 96, 256), (2, 128, 512)]
    backends: dict[str, list[Any] | None] = {"default": None}
    for name in ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        if hasattr(SDPBackend, name):
            backends[name.lower()] = [getattr(SDPBackend, name)]
    entry: Entry = {"priority": str(getattr(torch._C, "_get_sdp_priority_order", lambda: None)())}

    def ms(fn: Callable[[], Any]) -> float:
        if check.device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if check.device == "cuda":
            torch.cuda.synchronize()
        return round((time.perf_counter() - started) * 1e3, 2)

    for i, (name, chosen) in enumerate(backends.items()):
        rows = []
        for b, q, kv in shapes:
            b += 7 * i  # each backend sees shapes none before it saw
            query = torch.randn(b, 8, 4 * q, 64, device=check.device, dtype=dtype)
            key = torch.randn(b, 8, kv, 64, device=check.device, dtype=dtype)
            value = torch.randn_like(key)
            bias = torch.zeros(b, 1, 4 * q, kv, device=check.device, dtype=dtype)
            bias[..., kv - 8 :] = float("-inf")

            call = functools.partial(sdpa_once, query, key, value, bias, chosen)

            try:
                rows.append([b, q, kv, ms(call), ms(call)])
            except Exception as exc:
                rows.append([b, q, kv, f"{type(exc).__name__}: {exc}"[:160]])
        entry[name] = rows
    return entry


# ---------------------------------------------------------------------------------------------- stack


def attach_facts(stack: Any) -> Entry:
    """What the latest worker logged at attach: how it mapped the pools, and its graphs."""
    attached = stack.events("attached to cachemgr")
    captured = stack.events("cuda graphs captured")
    facts: Entry = {"worker_pid": stack.child_pid("worker"), "attaches": len(attached)}
    if attached:
        facts |= {
            k: attached[-1].get(k) for k in ("kv_handle", "swap_registered", "swap_slots", "num_chunks")
        }
    if captured:
        facts["graphs"] = {k: captured[-1].get(k) for k in ("graphs", "seconds", "memory_mib")}
    return facts


def stack_section(check: Check) -> Entry:
    from tests.parity import generate_reference
    from tests.stack import Stack, greedy_request
    from tests.tiny_models import tiny_model_dir

    model_dir = tiny_model_dir("llama", check.workdir / "models")
    rng = random.Random(5)
    swap_prompts = [[rng.randint(3, 255) for _ in range(rng.randint(20, 60))] for _ in range(8)]
    kill_prompts = [[rng.randint(3, 255) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    swap_tokens, kill_tokens = (24, 40) if check.quick else (24, 200)
    expected_swap = generate_reference(model_dir, swap_prompts, swap_tokens, check.device)
    expected_kill = generate_reference(model_dir, kill_prompts, kill_tokens, check.device)
    release_memory()
    # 32 blocks of 8 tokens: the longest request fits (40 + 200 tokens), but not all at once, so that
    # both phases offload to the swap pool and restore.
    settings = {"page_size": 8, "num_blocks": 32, "max_batch_tokens": 32, "cpu_offload_space": 0.01}
    logs = check.workdir / "stack"
    logs.mkdir(exist_ok=True)
    started = time.monotonic()
    try:
        # float32 as the reference: `--dtype auto` would run a float32 checkpoint in bfloat16 on a GPU
        # or on a CPU that computes it natively.
        up_args = ["--device", check.device, "--dtype", "float32"]
        stack = Stack(model_dir, logs, up_args=up_args, start_timeout_s=check.stack_start_s(), **settings)
    except Exception as exc:  # its log says why: keep it
        return failure(exc) | {"log": str(max(logs.glob("stack-*.log"), default=""))}
    entry: Entry = {"start_s": round(time.monotonic() - started, 1)}
    try:
        entry["attach"] = attach_facts(stack)
        attempt(
            entry, "swap", swap_round_trip, stack, swap_prompts, swap_tokens, expected_swap, greedy_request
        )
        attempt(
            entry, "worker_kill", worker_kill, stack, kill_prompts, kill_tokens, expected_kill, greedy_request
        )
        attempt(entry, "idle_after", idle, stack)
    finally:
        entry["exit_code"] = stack.stop()
        entry["log"] = str(stack.log_path)
    return entry


def idle(stack: Any) -> bool:
    """Nothing running, waiting or held, and every block back (else AssertionError)."""
    stack.assert_idle()
    return True


def swap_round_trip(
    stack: Any,
    prompts: list[list[int]],
    new_tokens: int,
    expected: list[list[int]],
    request: Callable[..., Any],
) -> Entry:
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(stack.generate, [request(p, new_tokens) for p in prompts]))
    load = stack.load()
    return {
        "streams_equal_generate": [r[0] for r in results] == expected,
        "offloads": load.offloads,
        "swap_restores": load.swap_restores,
        "soft_resets": load.soft_resets,
    }


def worker_kill(
    stack: Any,
    prompts: list[list[int]],
    new_tokens: int,
    expected: list[list[int]],
    request: Callable[..., Any],
) -> Entry:
    streams = [stack.stub.Generate(request(p, new_tokens), timeout=300) for p in prompts]
    outputs = [list(next(s).chunk.token_ids) for s in streams]  # every request is running
    worker = stack.child_pid("worker")
    killed = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    for output, stream in zip(outputs, streams, strict=True):
        output += [t for message in stream if message.HasField("chunk") for t in message.chunk.token_ids]
    return {
        "streams_equal_generate": outputs == expected,
        "recovery_s": round(time.monotonic() - killed, 1),
        "tokens_each": new_tokens,
        "restarted": stack.child_pid("worker") != worker,
        "reattach": attach_facts(stack),
    }


# ---------------------------------------------------------------------------------------------- tests


def tests_section(check: Check) -> Entry:
    """The CUDA-only tests, in a process of their own."""
    timeout = max(30.0, check.seconds_left(keep=10))
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "cuda",
        "-p",
        "no:cacheprovider",
        "tests/test_cuda_graphs.py",
        "tests/test_swap_copies.py",
        "tests/test_gpu_llama.py",  # the GPU's own forward, compiled, under real graphs
        "tests/test_piecewise_graphs.py",  # its pieces as real graphs against its eager step
        "tests/test_triton_fused.py",  # its passes captured in a graph
    ]
    if check.device != "cuda":
        argv.append("--collect-only")  # nothing of it runs without a device: just that it collects
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    log = check.workdir / "pytest.log"
    log.write_text(done.stdout + done.stderr)
    lines = done.stdout.splitlines()
    return {
        "returncode": done.returncode,
        "summary": next((line for line in reversed(lines) if " in " in line), ""),
        "failed": [line for line in lines if line.startswith(("FAILED", "ERROR"))][:20],
        "log": str(log),
    }


# ------------------------------------------------------------------------------------------- roofline

# Llama 3.1 8B's config.json, less its weights: what the time of a step depends on.
LLAMA_31_8B: Entry = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
}
# `--quick`: the same config shrunk (the same rope type, untied head), for a CPU.
LLAMA_TINY: Entry = LLAMA_31_8B | {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
    "rope_scaling": LLAMA_31_8B["rope_scaling"] | {"original_max_position_embeddings": 64},
}
ROOFLINE_REPEATS = 10  # timings of the copy and of the matmul; the best is the machine's rate


@dataclasses.dataclass(frozen=True)
class RooflineLoad:
    """`requests` random prompts of `prompt_tokens` tokens, `new_tokens` each, all added at once and at
    most `running` computed together (one wave when `requests == running`)."""

    name: str
    prompt_tokens: int
    new_tokens: int
    running: int
    requests: int

    def scaled(self, scale: float) -> RooflineLoad:
        """`scale` x the requests (`--roofline-scale`): fewer than `running` also run fewer together."""
        requests = max(1, round(self.requests * scale))
        return dataclasses.replace(self, requests=requests, running=min(self.running, requests))

    def prompts(self, vocab: int, seed: int = SEED) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(3, vocab) for _ in range(self.prompt_tokens)] for _ in range(self.requests)]


# The two workloads, one wave each: every decode step of the wave's middle holds all `running`
# requests, which is the steady state the decode figure is read at, and a second wave would repeat the
# same steps at the price of another prefill (a few seconds) and, for transformers, a longer run.
ROOFLINE_LOADS = (RooflineLoad("a", 1024, 256, 128, 128), RooflineLoad("b", 4096, 128, 32, 32))
ROOFLINE_QUICK_LOADS = (RooflineLoad("a", 40, 12, 4, 4), RooflineLoad("b", 72, 8, 2, 2))


@dataclasses.dataclass
class StepRecord:
    """A step the engine launched: for each request it computes, (first position, tokens, whether they
    are prompt tokens); `logit_rows`: those whose last token's logits it computes (they sample);
    `seconds`: its share of the wall time (see `drive_steps`)."""

    items: list[tuple[int, int, bool]]
    logit_rows: int
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(n for _, n, _ in self.items)

    @property
    def prompt_tokens(self) -> int:
        return sum(n for _, n, prompt in self.items if prompt)

    @property
    def keys(self) -> int:
        """K and V rows the step's attention reads: each request's context up to its last token."""
        return sum(start + n for start, n, _ in self.items)

    @property
    def attended_pairs(self) -> int:
        """(query, key) pairs of causal attention: position p attends p + 1 keys."""
        return sum(n * start + n * (n + 1) // 2 for start, n, _ in self.items)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 and not prompt for _, n, prompt in self.items)


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """What a step must read and compute, from the model's shapes alone (what attention reads of the
    pool is the model's dtype: the engine's pool holds no other here).

    - reads: `weight_bytes` every step (every parameter but the input embedding's table, which is read
      a row a token: `row_bytes`; tied to the head it is read whole, and counted there), and
      `kv_token_bytes` for each key each request attends;
    - matmul FLOPs: 2 per weight element of the decoder layers per token, 2 per head element per
      logits row, and 4 x heads x head_dim per attended (query, key) pair and layer (QK^T and PV)."""

    weight_bytes: int
    row_bytes: int
    kv_token_bytes: int
    layer_flops_per_token: int
    head_flops_per_row: int
    attention_flops_per_pair: int

    @classmethod
    def of(cls, model: Any) -> StepCosts:
        config = model.config
        embedding = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        tied = embedding.data_ptr() == head.data_ptr()
        size = embedding.element_size()
        weights = sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embedding)
        layers = model.model.layers
        matrices = sum(p.numel() for p in layers.parameters() if p.dim() == 2)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            weight_bytes=weights,
            row_bytes=0 if tied else embedding.shape[1] * size,
            kv_token_bytes=2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * size,
            layer_flops_per_token=2 * matrices,
            head_flops_per_row=2 * head.numel(),
            attention_flops_per_pair=4 * config.num_attention_heads * head_dim * config.num_hidden_layers,
        )

    def read_bytes(self, step: StepRecord) -> int:
        return self.weight_bytes + step.tokens * self.row_bytes + step.keys * self.kv_token_bytes

    def flops(self, step: StepRecord) -> int:
        return (
            step.tokens * self.layer_flops_per_token
            + step.logit_rows * self.head_flops_per_row
            + step.attended_pairs * self.attention_flops_per_pair
        )


def best_seconds(check: Check, fn: Callable[[], Any], calls: int = 5) -> float:
    """Seconds a call of `fn` takes: the fastest of ROOFLINE_REPEATS timings of `calls` calls in a row
    (a few ms in all, against the host's ~10 us a synchronisation), after one untimed call."""

    def sync() -> None:
        if check.device == "cuda":
            torch.cuda.synchronize()

    fn()
    best = float("inf")
    for _ in range(ROOFLINE_REPEATS):
        sync()
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (time.perf_counter() - started) / calls)
    return best


def copy_once(device: str, size: int) -> Callable[[], Any]:
    source = torch.ones(size, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return functools.partial(target.copy_, source)


def matmul_once(device: str, n: int, dtype: torch.dtype) -> Callable[[], Any]:
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    return functools.partial(torch.matmul, a, b)


def device_rates(check: Check) -> Entry:
    """The two ceilings, measured in this run: the copy rate of one large device-to-device copy, in
    bytes read + written per second (the memory's traffic both ways: the rate a step that only reads
    is held against), and the dense matmul rate of the model's dtype, square products of `n`."""
    dtype = torch.bfloat16 if check.device == "cuda" else torch.float32
    # 2 GiB each way: far beyond the H200's 50 MB of L2. 8192^3: the size at which cuBLAS runs near
    # its peak; a few ms a product.
    copy_bytes, n = (2 << 30, 8192) if not check.quick else (16 << 20, 256)
    copy_s = best_seconds(check, copy_once(check.device, copy_bytes))
    matmul_s = best_seconds(check, matmul_once(check.device, n, dtype))
    release_memory()
    return {
        "copy_bytes": copy_bytes,
        "copy_counts": "bytes read + written",
        "copy_bytes_per_s": 2 * copy_bytes / copy_s,
        "matmul_n": n,
        "matmul_dtype": str(dtype),
        "matmul_flops_per_s": 2 * n**3 / matmul_s,
    }


def roofline_model(check: Check) -> Any:
    """Llama 3.1 8B's shape with random weights, bf16, made on the device (`--quick`: LLAMA_TINY, fp32):
    nothing to download, and a step's time depends on the shapes alone. transformers initialises each
    weight in place where it was made, so 16 GB of them take a fraction of a second on a GPU."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = LLAMA_TINY if check.quick else LLAMA_31_8B
    config = LlamaConfig(**shape, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    dtype = torch.bfloat16 if check.device == "cuda" else torch.float32
    torch.manual_seed(SEED)
    with torch.device(check.device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def roofline_settings(check: Check, load: RooflineLoad) -> Entry:
    """The engine's settings for one workload; transformers' batching gets the same. `max_batch_tokens`
    8192 (vLLM's default on a GPU): a prefill step then computes 8192 tokens, the issue's 8k, and the
    pages attention may gather in a step, which grow with it, hold every request's context (at 512, the
    throughput section's, they would cap (a)'s decode steps near 100 of the 128 requests). The pool
    holds every request whole, and the warm-up's beside them (its pages stay in the prefix cache)."""
    page = 8 if check.quick else 32
    pages_each = -(-(load.prompt_tokens + load.new_tokens) // page)
    return {
        "page_size": page,
        "num_blocks": (load.running + roofline_warmup(check, load).requests) * pages_each,
        "max_batch_tokens": roofline_batch_tokens(check),
        "max_requests_per_batch": load.running,
        "use_async_batching": True,
    }


def roofline_batch_tokens(check: Check) -> int:
    return 64 if check.quick else 8192


def roofline_warmup(check: Check, load: RooflineLoad) -> RooflineLoad:
    """Enough of the workload's prompts (other draws) to fill a prefill step and start the next, two
    tokens each: the kernels the timed run's steps launch are built before it (Triton compiles each
    new specialization at its first launch, and the first TTFTs would carry that)."""
    count = min(load.running, roofline_batch_tokens(check) // load.prompt_tokens + 1)
    return RooflineLoad("warmup", load.prompt_tokens, 2, count, count)


def record_steps(engine: Engine) -> list[StepRecord]:
    """The steps `engine` launches from now on, in order, as the scheduler hands them to the runner."""
    records: list[StepRecord] = []
    apply = engine.scheduler.apply

    def recorded(grant: Any) -> Any:
        batch = apply(grant)
        if batch.scheduled:  # a step with nothing scheduled launches no forward
            computed = batch.computed
            items = [(s.start, s.num_tokens, s.start < len(s.request.prompt_ids)) for s in computed]
            records.append(StepRecord(items, sum(s.sample for s in computed)))
        return batch

    engine.scheduler.apply = recorded  # type: ignore[method-assign]
    return records


def drive_steps(
    engine: Engine, prompts: list[list[int]], new_tokens: int, deadline: float
) -> tuple[list[StepRecord], list[float], float]:
    """Every prompt added at once, then steps until all are done. Returns the steps launched, each
    request's time to first token (from its `arrived_at` to the step call that returned the token),
    and the wall time.

    A step's time is the wall time between the return of the call before the one that finished it and
    that one's return, split evenly where a call finishes more than one. Under async batching a call
    launches a step and then waits for the one before; in a run of steps each call thus returns when the
    device has finished one more, and the time between returns is the time a step takes as the device
    runs them back to back, the host's share included where the host is slower."""
    records = record_steps(engine)
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    started = time.perf_counter()
    requests = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    finished = 0
    last = started
    while engine.has_work:
        if time.monotonic() > deadline:
            for r in requests:
                engine.abort(r.request_id)
            engine.run_until_done()
            raise TimeoutError(f"out of time after {len(records)} steps, {len(first)} first tokens")
        news = engine.step()
        now = time.perf_counter()
        done = len(records) - engine.in_flight
        for record in records[finished:done]:
            record.seconds = (now - last) / (done - finished)
        finished, last = done, now
        arrived = time.monotonic()
        for r in news:
            if r.output_ids and r.request_id not in first:
                first[r.request_id] = arrived - r.arrived_at
    wall = time.perf_counter() - started
    if len(first) < len(requests) or any(len(r.output_ids) != new_tokens for r in requests):
        raise RuntimeError(f"{len(requests) - len(first)} requests without a first token, or short")
    return records, list(first.values()), wall


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def step_figures(
    records: list[StepRecord], costs: StepCosts, rates: Entry, running: int, prefill_tokens: int
) -> Entry:
    """Per step, the share of a ceiling it reached, as medians:
    - decode steps at steady state, where every one of the `running` requests decodes one token (no
      prompt chunk beside them; the wave's ramp-up and its tail are left out): the bytes the step must
      read / the copy rate / the step's time;
    - prefill steps of at least `prefill_tokens` tokens (the step's budget, `max_batch_tokens`): their
      matmul FLOPs / the step's time / the matmul rate. The decodes of requests whose prompt is done
      ride in the same steps and count with their FLOPs."""
    steady = [r for r in records if r.is_decode and len(r.items) == running]
    prefill = [r for r in records if r.prompt_tokens and r.tokens >= prefill_tokens]
    read = [costs.read_bytes(r) / rates["copy_bytes_per_s"] / r.seconds for r in steady]
    computed = [costs.flops(r) / r.seconds / rates["matmul_flops_per_s"] for r in prefill]
    return {
        "steps": len(records),
        "decode": {
            "steady_steps": len(steady),
            "step_ms_median": rounded(median([r.seconds * 1e3 for r in steady]), 3),
            "read_bytes_median": median([costs.read_bytes(r) for r in steady]),
            "fraction_median": rounded(median(read), 3),
            "fraction_range": [round(min(read), 3), round(max(read), 3)] if read else None,
        },
        "prefill": {
            "steps": len(prefill),
            "tokens": [r.tokens for r in prefill],
            "step_ms_median": rounded(median([r.seconds * 1e3 for r in prefill]), 2),
            "flops_median": median([costs.flops(r) for r in prefill]),
            "fraction_median": rounded(median(computed), 3),
        },
        "mixed_or_partial_steps": len(records) - len(steady) - len(prefill),
    }


def roofline_engine(
    check: Check, model: Any, costs: StepCosts, rates: Entry, load: RooflineLoad, kernels: str | None
) -> Entry:
    """cbserve's engine as a GPU runs it by default (CUDA graphs, async batching) on one workload, with
    the attention kernels attention_kernels.py chooses or those `kernels` names."""
    settings = roofline_settings(check, load)
    warmup = roofline_warmup(check, load)
    with switched(attention_kernels.SWITCH, kernels):
        started = time.perf_counter()
        engine = check.engine(model, settings, graphs=True)
        with engine:
            entry: Entry = {
                "setup_s": round(time.perf_counter() - started, 2),
                **path_facts(engine),
                "settings": settings,
            }
            engine.generate(
                warmup.prompts(model.config.vocab_size, SEED + 1), warmup.new_tokens, ignore_eos=True
            )
            records, ttft, wall = drive_steps(
                engine, load.prompts(model.config.vocab_size), load.new_tokens, check.deadline
            )
            entry["graphs"] = graph_facts(engine)
    output = load.requests * load.new_tokens
    return entry | {
        "wall_s": round(wall, 2),
        "output_tok_s": round(output / wall, 1),
        "ttft_ms_median": rounded(1e3 * statistics.median(ttft), 1),
        **step_figures(records, costs, rates, load.running, settings["max_batch_tokens"]),
    }


def roofline_transformers(check: Check, model: Any, load: RooflineLoad) -> Entry:
    prompts = load.prompts(model.config.vocab_size)
    workload = Workload(prompts, [load.new_tokens] * load.requests)
    entry = hf_continuous_batching(check, model, roofline_settings(check, load), workload, keep_s=0.0)
    del entry["outputs"]
    return entry


# Seconds each part is expected to take on an H200, most of it set-up: the engine captures its decode
# graphs (128 for (a), 16 x 8 buckets; as many for (b)) and transformers captures its own as it meets
# new shapes. The runs themselves are short: a prefill of 131k tokens is ~1.9 PFLOP (~3-4 s at
# ~600 TFLOP/s), and a decode step reads the 16 GB of weights and (a) up to 128 x 1280 x 128 KiB =
# 21 GB of KV, (b) 32 x 4224 x 128 KiB = 18 GB: 8-9 ms at ~4 TB/s, so (a)'s 256 steps take 2-3 s and
# (b)'s 128 about 1 s. transformers' batching, ~4x slower at 1B, is given the most.
ROOFLINE_NEEDS_S = {"engine": 40, "transformers_cb": 60, "engine_gather": 45}


def roofline_section(check: Check) -> Entry:
    """Llama-3.1-8B-shaped (random bf16 weights, made on the device) on the issue's two workloads, one
    wave each (ROOFLINE_LOADS, `--roofline-scale` x the requests): (a) 128 prompts of 1,024 tokens,
    256 new tokens each, 128 running; (b) 32 of 4,096, 128 new, 32 running. For cbserve's engine
    (graphs, async batching, the kernels attention_kernels.py picks: Triton on a GPU), transformers'
    continuous batching, and the engine with CBSERVE_PAGED_ATTENTION=gather (the baseline): output
    tok/s and the median time to first token; for the engine, per step the share of the measured copy
    rate (decode) or matmul rate (prefill) it reached (`step_figures`).

    Which steps count, with 8,192 tokens a step (`roofline_settings`): each workload's 131,072 prompt
    tokens fill about 16 steps of 8,192 (8 prompts a step in (a), 2 in (b), with the decodes of the
    requests already prefilled taking their share of each), and those are the prefill steps; the last
    partial one is not. The decode steps that count are those after the last prompt is in and before
    the first request finishes: about 239 in (a), 111 in (b).

    The parts run most telling first, (a) and (b) on the engine, transformers on (a) and (b), then the
    gather baseline, each only with its ROOFLINE_NEEDS_S left. On an H200: the rates ~1 s, the model
    ~5 s, the engine 20-30 s a workload, transformers 30-60 s each, gather 30-45 s each: 3-4 minutes,
    after the other sections' ~3, within the 480-s budget. The entry is saved after each part, so that a
    check stopped inside this section keeps what it measured."""
    if check.device != "cuda" and not check.quick:
        return {"skipped": "the 8B-shaped model is for a GPU; --quick runs a tiny one"}
    loads = [
        load.scaled(check.roofline_scale)
        for load in (ROOFLINE_QUICK_LOADS if check.quick else ROOFLINE_LOADS)
    ]
    entry: Entry = {"rates": device_rates(check)}
    started = time.perf_counter()
    model = roofline_model(check)
    costs = StepCosts.of(model)
    entry["model"] = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": str(model.dtype),
        "made_s": round(time.perf_counter() - started, 2),
        "costs": dataclasses.asdict(costs),
    }
    entry["loads"] = {load.name: {"workload": dataclasses.asdict(load), "systems": {}} for load in loads}
    rates = entry["rates"]
    parts: list[tuple[RooflineLoad, str, Callable[..., Entry], tuple[Any, ...]]] = [
        *((load, "engine", roofline_engine, (check, model, costs, rates, load, None)) for load in loads),
        *((load, "transformers_cb", roofline_transformers, (check, model, load)) for load in loads),
        *(
            (load, "engine_gather", roofline_engine, (check, model, costs, rates, load, "gather"))
            for load in loads
        ),
    ]
    for load, name, fn, args in parts:
        systems = entry["loads"][load.name]["systems"]
        if check.seconds_left() < ROOFLINE_NEEDS_S[name] and not check.quick:
            systems[name] = {
                "skipped": f"{check.seconds_left():.0f} s left, {ROOFLINE_NEEDS_S[name]} s needed"
            }
            continue
        attempt(systems, name, fn, *args)
        release_memory()
        check.save_partial("roofline", entry)
    for figures in entry["loads"].values():
        figures["engine_over_transformers_cb"] = tok_s_ratio(figures["systems"], "engine", "transformers_cb")
        figures["engine_over_gather"] = tok_s_ratio(figures["systems"], "engine", "engine_gather")
    return entry


def tok_s_ratio(systems: Entry, a: str, b: str) -> float | None:
    rate_a, rate_b = (systems.get(name, {}).get("output_tok_s") for name in (a, b))
    return round(rate_a / rate_b, 2) if rate_a and rate_b else None


# ----------------------------------------------------------------------------------------------- main

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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
