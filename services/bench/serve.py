"""`cbserve bench serve`: a load generator driving a running server (one process, one asyncio loop; a
coroutine per request, no thread), over cbserve's gRPC API (`--backend cbserve`, the default: one
channel to a gateway) or OpenAI's HTTP API (`--backend openai`: any OpenAI-compatible server, smg in
front of cbserve or vLLM's own server; see serve_openai.py). Workloads, schedule and report are the
same for both (serve_backends.py says what a backend does).

    cbserve bench serve --target 127.0.0.1:50051 --workload random --num-requests 64 \\
        --request-rate 4 --input-len 128 --output-len 64 --metrics-url http://127.0.0.1:9090/metrics
    cbserve bench serve --request-rates 1,2,4,8 --json sweep.json --plot sweep.png    # a sweep
    cbserve bench serve --concurrency 8 --duration 60                                 # closed loop
    cbserve bench serve --workload shared-prefix --num-groups 4 --prefix-len 512 --input-len 32
    cbserve bench serve --workload jsonl --dataset prompts.jsonl --no-ignore-eos
    cbserve bench serve --backend openai --target http://127.0.0.1:30080 --tokenizer MODEL_DIR \\
        --metrics-url http://127.0.0.1:9090/metrics                                   # over HTTP
    cbserve bench serve --backend openai --target http://127.0.0.1:30080 --tokenizer MODEL_DIR \\
        --baseline http://127.0.0.1:8000 --repeat 3          # two servers side by side (serve_compare.py)

Load: open loop with Poisson arrivals at `--request-rate` (`inf`: all at once), or one phase per rate
of `--request-rates`; `--concurrency C` caps the requests in flight (closed loop with rate `inf`). A
phase ends after `--num-requests` or at `--duration` seconds: then no more requests are sent, and those
in flight are cancelled (the server frees their blocks) and counted as cancelled. Each phase starts
once the server is idle (when its load is known), with fresh prompts (a repeat would be served from
the prefix cache). For the same reason every run salts its requests' prefix cache with a new random
value (gRPC: `cache_salt`; HTTP: the words the prompts are written in): the same command run twice
against one stack sends the same requests, and the second run must not be served from the first
run's blocks (`--cache-salt ""` lets it).

Workloads: `random` (token-id prompts of random ids below the vocabulary size, GetModelInfo's or
`--tokenizer`'s model's; lengths uniform within ±`--range-ratio` of `--input-len` / `--output-len`;
EOS ignored so lengths are exact), `shared-prefix` (`--num-groups` long prefixes of `--prefix-len`,
each request one prefix plus a unique suffix of about `--input-len`; the prefix-cache hit rate comes
from the load's deltas and from the requests' cached prompt tokens (usage) against the shared tokens
after each group's first request),
`long-prompt` (short random requests plus ONE `--long-prompt-len` prompt, sent once the first
`--long-prompt-after` of them, a quarter by default, have their first token: a warm period, so that
its prefill meets decoding streams), and `jsonl` (`--dataset`, one object a line with `prompt` text
or `token_ids`, optional `max_tokens`).

long-prompt, with and without chunked prefill: the report gives the short requests' inter-token
latency while the long prompt is prefilled (from its send to its first token) and otherwise, median
and p99, and the ratio of the p99 during the prefill to the median otherwise (the issue's target: at
most 2 with chunking). Chunking is a server setting, so the contrast takes two stacks and two runs of
the same command (same seed, so the same requests):

    cbserve up --port 50777 --metrics-port 9777 --max-batch-tokens 32     # small steps: decodes + a chunk
    cbserve bench serve --target 127.0.0.1:50777 --workload long-prompt --request-rate 2 \\
        --num-requests 24 --input-len 64 --output-len 64 --long-prompt-len 4000
    cbserve up --port 50777 --metrics-port 9777 --max-batch-tokens 4096   # the long prompt in one step
    (the same bench command)

On a 2-core CPU a step's time follows its tokens, so the budget is the latency knob: 32 tokens (about
18 decodes plus a 14-token chunk) keep a chunked step within 2x a decode step. Adding
`--long-prefill-token-threshold` lets prompts that arrive behind the long one start sooner.

Reported per phase: request, output-token and total-token throughput; TTFT, ITL and E2E latency (mean,
p50, p90, p99); completed, failed (by status code) and cancelled counts; peak KV usage (the load sampled
every `--load-interval` s); prefix-cache hits, offloads and soft resets (load deltas); with
`--metrics-url`, the step profile (`cbserve:step_time_seconds` by phase, _sum/_count deltas of the
gateway's Prometheus endpoint around the phase). The load is GetLoad's over gRPC; over HTTP it is read
from `--metrics-url` (cbserve's or vLLM's metrics), and unknown without it. Definitions are in
`serve_report`. Exit status 1 when a request failed or a completed one did not get exactly its
max_tokens (with EOS ignored).
"""

from __future__ import annotations

import argparse
import json
import math
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.bench.serve_backends import (
    DEFAULT_GRPC_TARGET,
    Backend,
    BackendError,
    RequestFailed,
    ServerInfo,
    open_backend,
)
from services.bench.serve_metrics import parse_histogram, scrape
from services.bench.serve_report import (
    LoadSample,
    PhaseData,
    RequestRecord,
    format_phase,
    format_sweep,
    plot_report,
    summarize_phase,
)
from services.bench.serve_workloads import (
    WORKLOADS,
    BenchRequest,
    arrivals_for,
    jsonl_requests,
    long_prompt_requests,
    phase_rng,
    random_requests,
    shared_prefix_requests,
)

if TYPE_CHECKING:
    import asyncio  # imported where it runs: `cbserve --help` builds this parser and should stay light

IDLE_TIMEOUT_S = 120.0
_WARMUP_PROMPT_LEN, _WARMUP_TOKENS = 16, 2


# -------------------------------------------------------------------------------------- arguments


def _rates(text: str) -> list[float]:
    rates = [float(x) for x in text.split(",") if x.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"rates must be positive numbers (or inf), got {text!r}")
    return rates


def _labels(text: str) -> tuple[str, str]:
    labels = tuple(x.strip() for x in text.split(","))
    if len(labels) != 2 or not all(labels):
        raise argparse.ArgumentTypeError(f"two names, TARGET,BASELINE, got {text!r}")
    return labels[0], labels[1]


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=("cbserve", "openai"), default="cbserve",
                        help="cbserve: the gateway's gRPC API; openai: an OpenAI-compatible "
                             "HTTP server's streaming /v1/completions (smg, vLLM)")  # fmt: skip
    parser.add_argument("--target", default=None,
                        help=f"cbserve: the gateway's host:port (default {DEFAULT_GRPC_TARGET}); "
                             "openai: the server's URL, http://HOST:PORT")  # fmt: skip
    parser.add_argument("--tokenizer", type=Path, default=None, metavar="MODEL_DIR",
                        help="openai: the served model's directory, whose tokenizer writes token-id "
                             "prompts as text of exact length (required)")  # fmt: skip
    parser.add_argument("--served-model-name", default=None, metavar="NAME",
                        help="openai: the model to request (default: the one /v1/models lists)")  # fmt: skip
    parser.add_argument("--workload", choices=WORKLOADS, default="random")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per phase")
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="Poisson arrivals per second (inf: all at once; default)")  # fmt: skip
    load.add_argument("--request-rates", type=_rates, default=None, metavar="R1,R2,...",
                      help="a sweep: one phase per rate, reported separately")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=None, help="most requests in flight (closed loop)")
    parser.add_argument("--duration", type=float, default=None, metavar="S",
                        help="end each phase after S seconds, cancelling requests in flight")  # fmt: skip
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (shared-prefix: suffix)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens to generate (max_tokens)")
    parser.add_argument("--range-ratio", type=float, default=0.0,
                        help="lengths uniform within ±ratio of --input-len and --output-len")  # fmt: skip
    parser.add_argument("--num-groups", type=int, default=4, help="shared-prefix: groups")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: shared prompt tokens")
    parser.add_argument("--long-prompt-len", type=int, default=4000, help="long-prompt: its prompt tokens")
    parser.add_argument("--long-output-len", type=int, default=8, help="long-prompt: its max_tokens")
    parser.add_argument("--long-prompt-after", type=int, default=None, metavar="K",
                        help="long-prompt: send it once K short requests decode (default n/4)")  # fmt: skip
    parser.add_argument("--dataset", type=Path, default=None, help="jsonl: the prompts file")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="generate exactly max_tokens (default on)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    parser.add_argument("--cache-salt", default=None,
                        help="prefix-cache salt of all requests (default: new each run)")  # fmt: skip
    parser.add_argument("--request-timeout", type=float, default=600.0, help="deadline of each call (s)")
    parser.add_argument("--load-interval", type=float, default=0.5, help="seconds between load samples")
    parser.add_argument("--metrics-url", default=None,
                        help="the server's Prometheus endpoint: the step profile (cbserve) and, for "
                             "openai, the load (cbserve's or vLLM's metrics)")  # fmt: skip
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="one short untimed request first (default on)")  # fmt: skip
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="live progress bar on stderr (default on)")  # fmt: skip
    compare = parser.add_argument_group("side by side (serve_compare.py)")
    compare.add_argument("--baseline", default=None, metavar="TARGET",
                         help="a second server of the same model and backend: both run every phase, "
                              "alternating, and the report compares them")  # fmt: skip
    compare.add_argument("--baseline-metrics-url", default=None, metavar="URL",
                         help="the baseline's Prometheus endpoint (as --metrics-url)")  # fmt: skip
    compare.add_argument("--repeat", type=int, default=1, metavar="N",
                         help="with --baseline: rounds; medians and rounds ahead are reported")  # fmt: skip
    compare.add_argument("--labels", type=_labels, default=("target", "baseline"), metavar="TARGET,BASELINE",
                         help="the two servers' names in the report")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the full report here")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE", help="latency CDFs (png)")


@dataclass(frozen=True)
class Phase:
    index: int
    name: str
    rate: float


def plan_phases(args: argparse.Namespace) -> list[Phase]:
    rates = args.request_rates or [args.request_rate]
    conc = f", concurrency {args.concurrency}" if args.concurrency else ""
    return [Phase(i, f"rate {r:g} req/s{conc}", r) for i, r in enumerate(rates)]


def validate(args: argparse.Namespace) -> None:
    """Refuse bad settings before connecting; the target defaults to the local gateway's."""
    openai = args.backend == "openai"
    if args.target is None and not openai:
        args.target = DEFAULT_GRPC_TARGET
    problems = [
        (openai and not str(args.target).startswith(("http://", "https://")),
         f"--backend openai needs --target http://HOST:PORT, got {args.target}"),
        (openai and args.baseline is not None and not args.baseline.startswith(("http://", "https://")),
         f"--backend openai needs --baseline http://HOST:PORT, got {args.baseline}"),
        (args.repeat < 1, "--repeat must be at least 1"),
        (args.repeat > 1 and args.baseline is None, "--repeat compares rounds: it needs --baseline"),
        (args.baseline is not None and args.plot is not None, "--plot draws one server: not with --baseline"),
        (openai and args.tokenizer is None, "--backend openai needs --tokenizer MODEL_DIR"),
        (args.num_requests < 1, "--num-requests must be at least 1"),
        (args.concurrency is not None and args.concurrency < 1, "--concurrency must be at least 1"),
        (args.duration is not None and args.duration <= 0, "--duration must be positive"),
        (not args.request_rate > 0, "--request-rate must be positive"),
        (not 0.0 <= args.range_ratio < 1.0, "--range-ratio must be in [0, 1)"),
        (min(args.input_len, args.output_len, args.long_prompt_len, args.long_output_len) < 1,
         "lengths must be at least 1"),
        (args.workload == "jsonl" and args.dataset is None, "--workload jsonl needs --dataset"),
        (args.load_interval <= 0, "--load-interval must be positive"),
        (args.long_prompt_after is not None and not 0 <= args.long_prompt_after <= args.num_requests,
         "--long-prompt-after must be in [0, --num-requests]"),
    ]  # fmt: skip
    for bad, message in problems:
        if bad:
            raise SystemExit(f"cbserve bench serve: {message}")


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


# ----------------------------------------------------------------------------------------- driver


class PhaseRunner:
    """Sends one phase's requests on schedule and records what each stream does."""

    def __init__(self, backend: Backend, args: argparse.Namespace, on_done: Callable[[], None]) -> None:
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
            samples.append(LoadSample(now(), load["kv_blocks_used"], load["kv_blocks_total"],
                                      load["requests_running"], load["requests_waiting"]))  # fmt: skip
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
        RequestRecord(r.index, r.kind, r.max_tokens, r.prompt_len, r.group, r.shared_len) for r in requests
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
        phase.name, args.workload, phase.rate, args.concurrency, wall, records, load_before, load_after,
        samples, steps_before, steps_after, check_lengths=args.ignore_eos, backend=backend.description,
        load_source=backend.load_source,
    )  # fmt: skip


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
        print(f"warning: the server counted {record.prompt_tokens} prompt tokens for a prompt of "
              f"{len(prompt)}; over HTTP, is --tokenizer the served model's?", file=sys.stderr)  # fmt: skip


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

    from services.bench.serve_compare import (
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
