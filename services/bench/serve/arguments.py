"""`cbserve bench serve`'s command line: its flags, and the checks of their values before anything
connects."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from services.bench.constraint import SPEC_FORMS, bench_constraint
from services.bench.serve.backends import DEFAULT_GRPC_TARGET
from services.bench.serve.workloads import WORKLOADS
from services.common.cli_args import bounded


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
    parser.add_argument(
        "--backend",
        choices=("cbserve", "openai"),
        default="cbserve",
        help="cbserve: the gateway's gRPC API; openai: an OpenAI-compatible "
        "HTTP server's streaming /v1/completions (smg, vLLM)",
    )
    parser.add_argument(
        "--target",
        default=None,
        help=f"cbserve: the gateway's host:port (default {DEFAULT_GRPC_TARGET}); "
        "openai: the server's URL, http://HOST:PORT",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        metavar="MODEL_DIR",
        help="openai: the served model's directory, whose tokenizer writes token-id "
        "prompts as text of exact length (required)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="openai: the model to request (default: the one /v1/models lists)",
    )
    parser.add_argument("--workload", choices=WORKLOADS, default="random")
    parser.add_argument("--num-requests", type=int, default=64, help="requests per phase")
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second (inf: all at once; default)",
    )
    load.add_argument(
        "--request-rates",
        type=_rates,
        default=None,
        metavar="R1,R2,...",
        help="a sweep: one phase per rate, reported separately",
    )
    parser.add_argument("--concurrency", type=int, default=None, help="most requests in flight (closed loop)")
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="S",
        help="end each phase after S seconds, cancelling requests in flight",
    )
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens (shared-prefix: suffix)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens to generate (max_tokens)")
    parser.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform within ±ratio of --input-len and --output-len",
    )
    parser.add_argument("--num-groups", type=int, default=4, help="shared-prefix: groups")
    parser.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: shared prompt tokens")
    parser.add_argument("--long-prompt-len", type=int, default=4000, help="long-prompt: its prompt tokens")
    parser.add_argument("--long-output-len", type=int, default=8, help="long-prompt: its max_tokens")
    parser.add_argument(
        "--long-prompt-after",
        type=int,
        default=None,
        metavar="K",
        help="long-prompt: send it once K short requests decode (default n/4)",
    )
    parser.add_argument("--dataset", type=Path, default=None, help="jsonl: the prompts file")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly max_tokens (default on)",
    )
    parser.add_argument(
        "--constraint",
        type=bench_constraint,
        default=None,
        metavar="SPEC",
        help=f"cbserve backend: hold every request to this structured output, {SPEC_FORMS}; json-schema "
        "alone is the bundled schema (services/bench/data/strings_array.schema.json), which keeps "
        "W1-length outputs going to their max_tokens (a request its grammar ends early shows as a "
        "length mismatch). Run again without it for the unconstrained figures",
    )
    parser.add_argument(
        "--n",
        type=bounded(int, 1),
        default=1,
        help="cbserve backend: choices per request (sampling.n; the server computes each prompt once); "
        "output tokens count every choice's",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    parser.add_argument(
        "--cache-salt", default=None, help="prefix-cache salt of all requests (default: new each run)"
    )
    parser.add_argument("--request-timeout", type=float, default=600.0, help="deadline of each call (s)")
    parser.add_argument("--load-interval", type=float, default=0.5, help="seconds between load samples")
    parser.add_argument(
        "--metrics-url",
        default=None,
        help="the server's Prometheus endpoint: the step profile (cbserve) and, for "
        "openai, the load (cbserve's or vLLM's metrics)",
    )
    parser.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one short untimed request first (default on)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="live progress bar on stderr (default on)",
    )
    compare = parser.add_argument_group("side by side (compare.py)")
    compare.add_argument(
        "--baseline",
        default=None,
        metavar="TARGET",
        help="a second server of the same model and backend: both run every phase, "
        "alternating, and the report compares them",
    )
    compare.add_argument(
        "--baseline-metrics-url",
        default=None,
        metavar="URL",
        help="the baseline's Prometheus endpoint (as --metrics-url)",
    )
    compare.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="with --baseline: rounds; medians and rounds ahead are reported",
    )
    compare.add_argument(
        "--labels",
        type=_labels,
        default=("target", "baseline"),
        metavar="TARGET,BASELINE",
        help="the two servers' names in the report",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the full report here")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE", help="latency CDFs (png)")


def validate(args: argparse.Namespace) -> None:
    """Refuse bad settings before connecting; the target defaults to the local gateway's."""
    openai = args.backend == "openai"
    if args.target is None and not openai:
        args.target = DEFAULT_GRPC_TARGET
    problems = [
        (
            openai and not str(args.target).startswith(("http://", "https://")),
            f"--backend openai needs --target http://HOST:PORT, got {args.target}",
        ),
        (
            openai and args.baseline is not None and not args.baseline.startswith(("http://", "https://")),
            f"--backend openai needs --baseline http://HOST:PORT, got {args.baseline}",
        ),
        (args.repeat < 1, "--repeat must be at least 1"),
        (args.repeat > 1 and args.baseline is None, "--repeat compares rounds: it needs --baseline"),
        (args.baseline is not None and args.plot is not None, "--plot draws one server: not with --baseline"),
        (openai and args.tokenizer is None, "--backend openai needs --tokenizer MODEL_DIR"),
        (
            openai and args.constraint is not None,
            f"--constraint {args.constraint and args.constraint.spec}: the openai backend sends "
            "/v1/completions, where servers differ on how a constraint is asked for; use --backend cbserve",
        ),
        (openai and args.n > 1, f"--n {args.n}: choices go through the cbserve backend's sampling.n"),
        (args.num_requests < 1, "--num-requests must be at least 1"),
        (args.concurrency is not None and args.concurrency < 1, "--concurrency must be at least 1"),
        (args.duration is not None and args.duration <= 0, "--duration must be positive"),
        (not args.request_rate > 0, "--request-rate must be positive"),
        (not 0.0 <= args.range_ratio < 1.0, "--range-ratio must be in [0, 1)"),
        (
            min(args.input_len, args.output_len, args.long_prompt_len, args.long_output_len) < 1,
            "lengths must be at least 1",
        ),
        (args.workload == "jsonl" and args.dataset is None, "--workload jsonl needs --dataset"),
        (args.load_interval <= 0, "--load-interval must be positive"),
        (
            args.long_prompt_after is not None and not 0 <= args.long_prompt_after <= args.num_requests,
            "--long-prompt-after must be in [0, --num-requests]",
        ),
    ]
    for bad, message in problems:
        if bad:
            raise SystemExit(f"cbserve bench serve: {message}")
