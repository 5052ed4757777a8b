"""Workloads and arrival schedules of `cbserve bench serve`: pure functions of their parameters and a
seeded `random.Random`, so that two runs (two stacks, two settings) send exactly the same requests.

Drawing order, per request, with one `rng`: its prompt (or suffix) length, its output length, then its
token ids one `randrange(vocab_size)` call each. `shared-prefix` draws the group prefixes first.
Arrival times come from a separate generator, so the requests do not change with the request rate.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("random", "shared-prefix", "long-prompt", "jsonl")


@dataclass(frozen=True)
class BenchRequest:
    """One request to send. Exactly one of `token_ids` and `text` is set."""

    index: int
    max_tokens: int | None
    token_ids: list[int] | None = None
    text: str | None = None
    kind: str = "short"  # "long": the injected prompt of `long-prompt`
    group: int | None = None  # shared-prefix group
    shared_len: int = 0  # leading prompt tokens that other requests of the group share

    @property
    def prompt_len(self) -> int | None:
        """Prompt tokens when known client side (token-id prompts); text prompts are counted by the server."""
        return None if self.token_ids is None else len(self.token_ids)


def length_bounds(mean: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds of a length drawn uniformly around `mean` (±range_ratio); never below 1."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, int(mean * (1.0 - range_ratio)))
    hi = max(lo, int(mean * (1.0 + range_ratio)))
    return lo, hi


def _ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(n)]


def random_requests(
    n: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int, rng: random.Random
) -> list[BenchRequest]:
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)
    requests = []
    for i in range(n):
        length = rng.randint(in_lo, in_hi)
        max_tokens = rng.randint(out_lo, out_hi)
        requests.append(BenchRequest(i, max_tokens, token_ids=_ids(rng, length, vocab_size)))
    return requests


def shared_prefix_requests(
    n: int,
    num_groups: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    rng: random.Random,
) -> list[BenchRequest]:
    """Request i belongs to group i % num_groups (round robin, so every group starts early) and is its
    group's prefix followed by a unique suffix of about `input_len` tokens."""
    if num_groups < 1 or prefix_len < 1:
        raise ValueError("shared-prefix needs num_groups >= 1 and prefix_len >= 1")
    prefixes = [_ids(rng, prefix_len, vocab_size) for _ in range(num_groups)]
    in_lo, in_hi = length_bounds(input_len, range_ratio)
    out_lo, out_hi = length_bounds(output_len, range_ratio)
    requests = []
    for i in range(n):
        group = i % num_groups
        length = rng.randint(in_lo, in_hi)
        max_tokens = rng.randint(out_lo, out_hi)
        ids = prefixes[group] + _ids(rng, length, vocab_size)
        requests.append(BenchRequest(i, max_tokens, token_ids=ids, group=group, shared_len=prefix_len))
    return requests


def long_prompt_requests(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    long_prompt_len: int,
    long_output_len: int,
    after: int,
    vocab_size: int,
    rng: random.Random,
) -> list[BenchRequest]:
    """`n` short random requests with one long prompt placed after the first `after` of them (in send
    order); the long request's index is `n`."""
    if not 0 <= after <= n:
        raise ValueError(f"the long prompt must come after 0..{n} short requests, got {after}")
    short = random_requests(n, input_len, output_len, range_ratio, vocab_size, rng)
    long = BenchRequest(n, long_output_len, token_ids=_ids(rng, long_prompt_len, vocab_size), kind="long")
    return [*short[:after], long, *short[after:]]


def jsonl_requests(path: Path, n: int, default_max_tokens: int | None) -> list[BenchRequest]:
    """The first `n` lines of a JSONL file: each an object with `prompt` (text) or `token_ids`, and an
    optional `max_tokens`. Blank lines are skipped."""
    requests: list[BenchRequest] = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if len(requests) >= n:
            break
        if not line.strip():
            continue
        requests.append(
            _jsonl_request(json.loads(line), len(requests), default_max_tokens, f"{path}:{line_no}")
        )
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def _jsonl_request(obj: object, index: int, default_max_tokens: int | None, where: str) -> BenchRequest:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    max_tokens = obj.get("max_tokens", default_max_tokens)
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"{where}: max_tokens must be a positive integer")
    if "token_ids" in obj:
        ids = obj["token_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"{where}: token_ids must be a non-empty list of integers")
        return BenchRequest(index, max_tokens, token_ids=ids)
    if isinstance(obj.get("prompt"), str) and obj["prompt"]:
        return BenchRequest(index, max_tokens, text=obj["prompt"])
    raise ValueError(f"{where}: needs a non-empty `prompt` string or `token_ids` list")


def poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    """Send offsets (seconds from the phase start) of `n` requests arriving as a Poisson process of
    `rate` per second: the first at 0, then exponential gaps of mean 1/rate; `inf` sends all at 0."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def arrivals_for(requests: list[BenchRequest], rate: float, rng: random.Random) -> list[float]:
    """Offsets aligned with `requests`: short requests follow the Poisson process; a long request gets
    the offset of the short request before it (no slot of the process; the driver then also waits for
    the requests before it to decode)."""
    short = poisson_arrivals(sum(r.kind != "long" for r in requests), rate, rng)
    offsets, k = [], 0
    for r in requests:
        if r.kind == "long":
            offsets.append(short[k - 1] if k else 0.0)
        else:
            offsets.append(short[k])
            k += 1
    return offsets


def phase_rng(seed: int, phase: int, purpose: str) -> random.Random:
    """A generator per (seed, phase, purpose): each phase of a sweep gets fresh prompts (a repeat
    would be served from the prefix cache) and arrival times independent of the prompts."""
    return random.Random(f"{purpose}:{seed}:{phase}")


@dataclass(frozen=True)
class Phase:
    index: int
    name: str
    rate: float


def plan_phases(args: argparse.Namespace) -> list[Phase]:
    rates = args.request_rates or [args.request_rate]
    conc = f", concurrency {args.concurrency}" if args.concurrency else ""
    return [Phase(i, f"rate {r:g} req/s{conc}", r) for i, r in enumerate(rates)]
