"""Cache-aware routing over a fleet: two stacks behind one real `smg`, a shared-prefix workload.

smg's `cache_aware` policy subscribes to each gateway's SubscribeKvEvents (the stored and removed
pages with their token ids) and indexes what each replica caches, in pages of the size the events
carry; it sends a request to the replica holding the longest run of its leading pages, and a new
prefix to the least loaded one. The same workload runs three times, each on empty caches behind a
fresh smg: on one stack (the single-stack figure), on two with `round_robin`, on two with
`cache_aware`. The prefix-cache hit rate is the stacks' own count of prompt tokens found cached
(GetLoad before and after), over the shared-prefix tokens of the requests that follow each group's
first: a replica can only hit a prefix it has seen, and one stack sees every group's first request.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from smg_grpc_proto import vllm_engine_pb2_grpc as vllm_grpc
from smg_grpc_proto.generated import common_pb2
from transformers import AutoTokenizer

from services.router import gateway_url, smg_command
from services.supervisor import die_with_parent, free_port, stop_process
from tests.conftest import TINY_STACK_SETTINGS
from tests.smg_router import client, wait_router
from tests.stack import Stack

# An odd number of groups: round robin over two replicas then sends each group's requests to both
# in turn (with an even number, every group would stay on one replica by accident).
GROUPS = 5
PER_GROUP = 4
PREFIX_WORDS = 200  # about 200 tokens: 8 prefill chunks of the tiny stack's 24-token steps
SUFFIX_WORDS = 10
CONCURRENCY = 2  # requests in flight, so that new prefixes spread over both replicas
MAX_TOKENS = 4
# What the issue asks of the fleet: at least this share of what one stack hits.
FLEET_SHARE_OF_SINGLE = 0.9


@dataclass(frozen=True)
class Workload:
    prompts: list[str]  # request i belongs to group i % GROUPS
    shared_tokens: int  # prefix tokens of the requests after each group's first


@dataclass(frozen=True)
class RunResult:
    hits: list[int]  # prompt tokens found in each stack's prefix cache
    queries: list[int]  # prompt tokens each stack looked up
    ttft_s: list[float]

    def hit_rate(self, workload: Workload) -> float:
        return sum(self.hits) / workload.shared_tokens

    def summary(self, workload: Workload) -> str:
        return (
            f"hit rate {self.hit_rate(workload):.3f} of {workload.shared_tokens} shared tokens "
            f"(hits per stack {self.hits}, looked up {self.queries}); "
            f"TTFT p50 {statistics.median(self.ttft_s) * 1e3:.0f} ms, "
            f"mean {statistics.mean(self.ttft_s) * 1e3:.0f} ms"
        )


@pytest.fixture(scope="module")
def text_model(tiny_text_model: Path) -> Path:
    return tiny_text_model


@pytest.fixture(scope="module")
def stacks(text_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Stack]]:
    started: list[Stack] = []
    try:
        for name in ("first", "second"):
            started.append(Stack(text_model, tmp_path_factory.mktemp(name), **TINY_STACK_SETTINGS))
        yield started
    finally:
        for stack in started:
            stack.stop()


def shared_prefix_workload(model_dir: Path, seed: int = 0) -> Workload:
    """Text prompts, as OpenAI clients send them: each group's prefix of random words, then a unique
    suffix. Words start with a space, so the prefix's tokens are the prompt's leading tokens."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    words = sorted(w[1:] for w in tokenizer.get_vocab() if w.startswith("Ġ") and w[1:].isalpha())
    rng = random.Random(seed)

    def text(n: int) -> str:
        return "".join(" " + rng.choice(words) for _ in range(n))

    prefixes = [text(PREFIX_WORDS).lstrip() for _ in range(GROUPS)]
    prompts = [prefixes[i % GROUPS] + text(SUFFIX_WORDS) for i in range(GROUPS * PER_GROUP)]
    prefix_tokens = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prefixes]
    return Workload(prompts, (PER_GROUP - 1) * sum(prefix_tokens))


@contextmanager
def router(stacks: Sequence[Stack], policy: str, log_path: Path) -> Iterator[int]:
    """smg in front of `stacks` with `policy`, once every stack is a healthy worker: its HTTP port."""
    http = free_port()
    argv = smg_command(
        host="127.0.0.1",
        http_port=http,
        metrics_port=free_port(),
        model_dir=str(stacks[0].model_dir),
        policy=policy,
        worker_urls=[gateway_url("127.0.0.1", s.port) for s in stacks],
    )
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=log, preexec_fn=die_with_parent)
        try:
            wait_router(http, healthy=len(stacks))
            yield http
        finally:
            stop_process(process, 20)


def flush_prefix_caches(stacks: Sequence[Stack]) -> None:
    for stack in stacks:
        reply = vllm_grpc.VllmEngineStub(stack.channel).FlushCache(common_pb2.FlushCacheRequest(), timeout=10)
        assert reply.success, reply.message


def run_workload(stacks: Sequence[Stack], http_port: int, workload: Workload) -> RunResult:
    api = client(http_port)
    model = stacks[0].info.model_id

    def ttft(prompt: str) -> float:
        start = time.perf_counter()
        first = None
        for event in api.completions.create(
            model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0, stream=True
        ):
            if first is None and any(c.text for c in event.choices):
                first = time.perf_counter() - start
        assert first is not None, "a stream without text"
        return first

    before = [s.load() for s in stacks]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        ttfts = list(pool.map(ttft, workload.prompts))
    after = [s.load() for s in stacks]
    return RunResult(
        hits=[a.prefix_cache_hits - b.prefix_cache_hits for a, b in zip(after, before, strict=True)],
        queries=[a.prefix_cache_queries - b.prefix_cache_queries for a, b in zip(after, before, strict=True)],
        ttft_s=ttfts,
    )


def learned_block_sizes(log_path: Path) -> list[int]:
    """The page sizes smg learned from KV events: each one proves it indexes a replica's events."""
    sizes = []
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"Learned block_size' in line:
            sizes.append(json.loads(line)["block_size"])
    return sizes


@pytest.mark.slow
def test_cache_aware_routing_hits_the_prefixes_one_stack_would(
    stacks: list[Stack], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = shared_prefix_workload(stacks[0].model_dir)
    results: dict[str, RunResult] = {}
    for name, fleet, policy in (
        ("single stack", stacks[:1], "round_robin"),
        ("round_robin", stacks, "round_robin"),
        ("cache_aware", stacks, "cache_aware"),
    ):
        flush_prefix_caches(stacks)
        log_path = tmp_path / f"smg-{policy}-{len(fleet)}.log"
        with router(fleet, policy, log_path) as http:
            results[name] = run_workload(fleet, http, workload)
        if policy == "cache_aware":
            sizes = learned_block_sizes(log_path)
            assert sizes and set(sizes) == {TINY_STACK_SETTINGS["page_size"]}, log_path.read_text()
    with capsys.disabled():
        for name, result in results.items():
            print(f"\nshared prefix, {name}: {result.summary(workload)}")
    single, aware, blind = (
        results[n].hit_rate(workload) for n in ("single stack", "cache_aware", "round_robin")
    )
    assert aware >= FLEET_SHARE_OF_SINGLE * single
    assert all(results["cache_aware"].queries), "cache-aware routing left a replica without work"
    # The workload tells a cache-blind router apart: round robin sends each group to both replicas.
    assert blind < FLEET_SHARE_OF_SINGLE * single
