"""throughput: a 1B Llama-shaped model on a decode-heavy load, in each configuration, and
transformers' continuous batching."""

from __future__ import annotations

import dataclasses
import inspect
import random
import time
from collections.abc import Callable
from typing import Any

import torch

from scripts.gpu_check.check import (
    SEED,
    Check,
    Entry,
    attempt,
    graph_facts,
    median,
    path_facts,
    refused_or,
    release_memory,
    rounded,
)
from services.bench.offline.transformers_cb import hf_cb_collect, started_manager
from services.bench.workload import Workload
from services.common.sampling_params import SamplingParams
from services.common.switches import switched
from services.worker import layer_forward
from services.worker.engine import Engine

KEEP_AFTER_THROUGHPUT_S = 180  # for serving, the stack and the tests


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
