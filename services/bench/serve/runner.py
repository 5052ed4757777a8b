"""`cbserve bench serve`'s driver: phases of requests against one server (or two, side by side), the
load sampled meanwhile, and the report (the package's docstring says what it measures)."""

from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.bench.serve.arguments import validate
from services.bench.serve.backends import (
    Backend,
    BackendError,
    GrpcBackend,
    RequestFailed,
    ServerInfo,
)
from services.bench.serve.metrics import parse_histogram, scrape
from services.bench.serve.report import (
    LoadSample,
    PhaseData,
    RequestRecord,
    format_phase,
    format_sweep,
    plot_report,
    summarize_phase,
)
from services.bench.serve.workloads import (
    BenchRequest,
    Phase,
    arrivals_for,
    jsonl_requests,
    long_prompt_requests,
    phase_rng,
    plan_phases,
    random_requests,
    shared_prefix_requests,
)

if TYPE_CHECKING:
    import asyncio  # imported where it runs: `cbserve --help` builds this parser and should stay light

IDLE_TIMEOUT_S = 120.0
_WARMUP_PROMPT_LEN, _WARMUP_TOKENS = 16, 2


# -------------------------------------------------------------------------------------- workloads


def build_requests(args: argparse.Namespace, phase: int, vocab_size: int) -> list[BenchRequest]:
    rng = phase_rng(args.seed, phase, "workload")
    n, shape = args.num_requests, (args.input_len, args.output_len, args.range_ratio)
    if args.workload == "random":
        return random_requests(n, *shape, vocab_size, rng)
    if args.workload == "shared-prefix":
        return shared_prefix_requests(n, args.num_groups, args.prefix_len, *shape, vocab_size, rng)
    if args.workload == "long-prompt":
        after = n // 4 if args.long_prompt_after is None else args.long_prompt_after
        return long_prompt_requests(
            n, *shape, args.long_prompt_len, args.long_output_len, after, vocab_size, rng
        )
    return jsonl_requests(args.dataset, n, args.output_len)


def check_fits(requests: list[BenchRequest], max_model_len: int | None) -> None:
    """Token-id prompts must fit the served model with their max_tokens (text prompts, or a server that
    does not say its limit: the server checks)."""
    if max_model_len is None:
        return
    for r in requests:
        if r.prompt_len is not None and r.prompt_len + (r.max_tokens or 1) > max_model_len:
            raise SystemExit(
                f"cbserve bench serve: request {r.index} ({r.kind}) needs {r.prompt_len} prompt + "
                f"{r.max_tokens} output tokens; the server's max_model_len is {max_model_len}"
            )


@asynccontextmanager
async def open_backend(args: argparse.Namespace) -> AsyncIterator[Backend]:
    if args.backend == "openai":
        from services.bench.serve.openai_backend import OpenAIBackend

        async with OpenAIBackend.open(args) as backend:
            yield backend
        return
    import grpc

    from services.gateway.api import pb_grpc

    options = [("grpc.max_receive_message_length", 16 << 20)]
    async with grpc.aio.insecure_channel(args.target, options=options) as channel:
        yield GrpcBackend(pb_grpc.TextGenerationStub(channel), args)


# ----------------------------------------------------------------------------------------- driver


class PhaseRunner:
    """Sends one phase's requests on schedule and records what each stream does."""

    def __init__(self, backend: Backend, args: argparse.Namespace, on_done: Callable[[], object]) -> None:
        self.backend, self.args, self.on_done = backend, args, on_done
        self.t0 = time.perf_counter()  # reset when the phase starts
        self.tasks: list[asyncio.Task[None]] = []

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def drive(
        self, requests: list[BenchRequest], arrivals: list[float], records: list[RequestRecord]
    ) -> float:
        """Runs the phase; returns its wall time (to the last final message, or the time limit)."""
        import asyncio

        self.t0 = time.perf_counter()
        try:
            await asyncio.wait_for(self._all(requests, arrivals, records), self.args.duration)
        except TimeoutError:
            pass  # the time limit: requests in flight are cancelled below
        wall = self.now()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        return wall

    async def _all(
        self, requests: list[BenchRequest], arrivals: list[float], records: list[RequestRecord]
    ) -> None:
        import asyncio

        limit = asyncio.Semaphore(self.args.concurrency) if self.args.concurrency else None
        for pos, (req, at, record) in enumerate(zip(requests, arrivals, records, strict=True)):
            if (delay := at - self.now()) > 0:
                await asyncio.sleep(delay)
            if req.kind == "long":
                # On top of the steady load (no slot), and without holding up the short requests' schedule.
                self.tasks.append(asyncio.create_task(self._when_warm(records[:pos], req, record)))
                continue
            if limit is not None:
                await limit.acquire()
            self.tasks.append(asyncio.create_task(self._one(req, record, limit)))
        await asyncio.gather(*self.tasks)

    async def _when_warm(self, warm: list[RequestRecord], req: BenchRequest, record: RequestRecord) -> None:
        """Sends the long prompt once the requests sent before it are decoding (or over), so that its
        prefill meets running streams: their inter-token latency is what the workload measures."""
        import asyncio

        while not all(r.chunk_times or r.status in ("ok", "failed", "cancelled") for r in warm):
            await asyncio.sleep(0.005)
        await self._one(req, record, None)

    async def _one(self, req: BenchRequest, record: RequestRecord, slot: asyncio.Semaphore | None) -> None:
        import asyncio

        record.status, record.start = "running", self.now()
        try:
            await self.backend.stream(req, record, self.now)
            record.status = "ok"
        except asyncio.CancelledError:
            record.status = "cancelled"
            raise
        except RequestFailed as exc:
            record.status, record.error_code, record.error = "failed", exc.code, exc.message
        except Exception as exc:  # a client-side failure must not end the benchmark
            record.status, record.error_code, record.error = "failed", "CLIENT_ERROR", repr(exc)
        finally:
            record.end = self.now()
            if slot is not None:
                slot.release()
            self.on_done()


# ------------------------------------------------------------------------------------ server state


async def sample_load(
    backend: Backend, samples: list[LoadSample], now: Callable[[], float], interval: float
) -> None:
    """Runs until cancelled. A GetLoad waits for the worker's step to end, hence the generous timeout."""
    import asyncio

    while True:
        load = await backend.load(timeout_s=max(4 * interval, 5.0))
        if load is not None:
            samples.append(
                LoadSample(
                    now(),
                    load["kv_blocks_used"],
                    load["kv_blocks_total"],
                    load["requests_running"],
                    load["requests_waiting"],
                )
            )
        await asyncio.sleep(interval)


async def wait_idle(backend: Backend, timeout_s: float = IDLE_TIMEOUT_S) -> None:
    """Until nothing runs or waits and the figures have settled (unchanged over the backend's
    `load_settle_s`), so that a phase neither inherits nor leaves work and its counter deltas are its
    own. At once when the server's load is unknown."""
    import asyncio

    if backend.load_source is None:
        return
    deadline = time.monotonic() + timeout_s
    idle: dict[str, int] | None = None
    while time.monotonic() < deadline:
        load = await backend.load(timeout_s=10.0)
        if load is None or load["requests_running"] or load["requests_waiting"]:
            idle = None
            await asyncio.sleep(0.1)
        elif load == idle or not backend.load_settle_s:
            return
        else:
            idle = load
            await asyncio.sleep(backend.load_settle_s)
    print(f"warning: the server is still busy after {timeout_s:.0f} s; starting anyway", file=sys.stderr)


def scrape_steps(url: str | None) -> dict[str, tuple[float, float]] | None:
    if url is None:
        return None
    try:
        return parse_histogram(scrape(url))
    except OSError as exc:
        print(f"warning: could not scrape {url}: {exc}", file=sys.stderr)
        return None


# -------------------------------------------------------------------------------------------- run


async def run_phase(
    backend: Backend, args: argparse.Namespace, phase: Phase, requests: list[BenchRequest]
) -> PhaseData:
    import asyncio

    from tqdm import tqdm

    arrivals = arrivals_for(requests, phase.rate, phase_rng(args.seed, phase.index, "arrivals"))
    records = [
        # With --n, a request's output is every choice's: n times max_tokens when each runs to its end.
        RequestRecord(
            r.index, r.kind, _all_choices(r.max_tokens, args.n), r.prompt_len, r.group, r.shared_len
        )
        for r in requests
    ]
    await wait_idle(backend)
    steps_before = await asyncio.to_thread(scrape_steps, args.metrics_url)
    load_before = await backend.load(timeout_s=10.0)
    bar = tqdm(total=len(requests), desc=phase.name, unit="req", file=sys.stderr, disable=not args.progress)
    runner = PhaseRunner(backend, args, lambda: bar.update(1))
    samples: list[LoadSample] = []
    sampler = asyncio.create_task(sample_load(backend, samples, runner.now, args.load_interval))
    try:
        wall = await runner.drive(requests, arrivals, records)
    finally:
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        bar.close()
    await wait_idle(backend)  # cancelled requests release their blocks; counters settle
    load_after = await backend.load(timeout_s=10.0)
    steps_after = await asyncio.to_thread(scrape_steps, args.metrics_url)
    return PhaseData(
        phase.name,
        args.workload,
        phase.rate,
        args.concurrency,
        wall,
        records,
        load_before,
        load_after,
        samples,
        steps_before,
        steps_after,
        check_lengths=args.ignore_eos,
        backend=backend.description,
        load_source=backend.load_source,
    )


async def warmup(backend: Backend, args: argparse.Namespace, info: ServerInfo) -> None:
    """One untimed request; its prompt count also tells whether the server reads prompts as written."""
    rng = phase_rng(args.seed, -1, "warmup")
    prompt = [rng.randrange(info.vocab_size) for _ in range(_WARMUP_PROMPT_LEN)]
    record = RequestRecord(-1, "warmup", _WARMUP_TOKENS, len(prompt))
    try:
        await backend.stream(BenchRequest(-1, _WARMUP_TOKENS, token_ids=prompt), record, time.perf_counter)
    except RequestFailed as exc:
        raise BackendError(f"{backend.description}: the warm-up request failed: {exc}") from exc
    if record.prompt_tokens != len(prompt):
        print(
            f"warning: the server counted {record.prompt_tokens} prompt tokens for a prompt of "
            f"{len(prompt)}; over HTTP, is --tokenizer the served model's?",
            file=sys.stderr,
        )


def phase_requests(args: argparse.Namespace, phase: Phase, info: ServerInfo) -> list[BenchRequest]:
    try:
        requests = build_requests(args, phase.index, info.vocab_size)
    except (OSError, ValueError) as exc:  # a bad --dataset file
        raise SystemExit(f"cbserve bench serve: {exc}") from exc
    check_fits(requests, info.max_model_len)
    return requests


async def run_phases(
    args: argparse.Namespace, phases: list[Phase], warm: bool, done: Callable[[PhaseData], None]
) -> tuple[ServerInfo, list[PhaseData]]:
    """`phases` on the server `args` names, after its warm-up if `warm`; `done` sees each as it ends."""
    async with open_backend(args) as backend:
        info = await backend.info()
        if warm:
            await warmup(backend, args, info)
        results = []
        for phase in phases:
            results.append(await run_phase(backend, args, phase, phase_requests(args, phase, info)))
            done(results[-1])
    return info, results


def print_phase(data: PhaseData) -> None:
    print(format_phase(summarize_phase(data)), flush=True)


def run_side_by_side(args: argparse.Namespace) -> int:
    import asyncio

    from services.bench.serve.compare import (
        by_round,
        compare_phase,
        comparison_json,
        format_comparison,
        run_comparison,
    )

    try:
        model, runs = asyncio.run(run_comparison(args, plan_phases(args), run_phases))
    except BackendError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    tables = [compare_phase(by_round(phase_runs)) for phase_runs in runs]
    for phase_runs, table in zip(runs, tables, strict=True):
        print(format_comparison(phase_runs[0].summary["name"], args.labels, table), flush=True)
    if args.json is not None:
        write_json(args, model, comparison_json(runs, tables, args.labels, phase_json))
        print(f"wrote {args.json}")
    return 1 if any(_bad(run.summary) for phase_runs in runs for run in phase_runs) else 0


def _bad(summary: dict[str, Any]) -> bool:
    return bool(summary["requests"]["failed"] or summary["requests"]["length_mismatch"])


def run(args: argparse.Namespace) -> int:
    import asyncio

    validate(args)
    if args.cache_salt is None:
        args.cache_salt = secrets.token_hex(8)
    if args.baseline is not None:
        return run_side_by_side(args)
    try:
        info, phases = asyncio.run(run_phases(args, plan_phases(args), args.warmup, print_phase))
    except BackendError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    summaries = [summarize_phase(p) for p in phases]
    if len(summaries) > 1:
        print(format_sweep(summaries))
    if args.json is not None:
        write_json(args, info.facts, [phase_json(p, s) for p, s in zip(phases, summaries, strict=True)])
        print(f"wrote {args.json}")
    if args.plot is not None:
        plot_report(phases, summaries, args.plot)
        print(f"wrote {args.plot}")
    return 1 if any(_bad(s) for s in summaries) else 0


def write_json(args: argparse.Namespace, model: dict[str, Any], phases: list[dict[str, Any]]) -> None:
    settings = {k: v for k, v in vars(args).items() if not callable(v)}
    report = {"settings": settings, "model": model, "phases": phases}
    args.json.write_text(json.dumps(_jsonable(report), indent=1) + "\n")


def phase_json(data: PhaseData, summary: dict[str, Any]) -> dict[str, Any]:
    """A phase's report with its records and load samples."""
    return summary | {
        "records": [r.to_json() for r in data.records],
        "load_samples": [vars(x) for x in data.load_samples],
    }


def _jsonable(value: Any) -> Any:
    """Strict JSON: paths as strings, infinite rates as "inf" (JSON has no Infinity)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Path):
        return str(value)
    return value


def _all_choices(max_tokens: int | None, n: int) -> int | None:
    return None if max_tokens is None else n * max_tokens
