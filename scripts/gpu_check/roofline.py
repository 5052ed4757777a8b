"""roofline: a Llama-3.1-8B-shaped model on 1k- and 4k-token prompts against the device's measured rates."""

from __future__ import annotations

import dataclasses
import functools
import random
import statistics
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
    release_memory,
    rounded,
)
from scripts.gpu_check.throughput import hf_continuous_batching
from services.bench.workload import Workload
from services.common.sampling_params import SamplingParams
from services.common.switches import switched
from services.worker import attention_kernels
from services.worker.engine import Engine

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
