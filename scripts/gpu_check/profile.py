"""profile (on request only): the first steps timed, the profiler's top ops, an SDPA probe."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from scripts.gpu_check.check import Check, Entry, attempt
from scripts.gpu_check.throughput import StepClock, decode_heavy, speed_model, speed_settings
from services.common.sampling_params import SamplingParams
from services.worker.engine import Engine

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
