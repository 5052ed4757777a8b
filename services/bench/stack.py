"""The `stack` and `stack-streamed` systems of `cbserve bench offline`: the workload through the whole
gRPC service.

`cbserve up` runs as a child process with the same engine settings as the in-process `engine`
system; every request is sent at once over one channel (grpc.aio) as token ids, greedy, EOS ignored,
and the wall time runs from the first send to the last final message. `stack` asks for each output
whole at the end (`OutputOptions.stream` false), as the in-process engine hands its outputs back;
`stack-streamed` gets a message per generated token, which on a small host costs the forward the
CPU that gRPC takes to send and read each (docs/performance-log.md has the figures). Start-up and a
warm-up call are not timed. The child's logs go to a file so that they do not interleave with the
table. The worker's step profile over the timed part comes from the stack's /metrics, scraped before
and after.
"""

from __future__ import annotations

import asyncio
import os

# The stack is started with a plain fork (preexec_fn) while gRPC channels may be open in this
# process; gRPC's fork handlers would race with its pollers, and the child execs at once anyway.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.bench.memory import PeakRss
from services.bench.serve.metrics import parse_histogram, scrape
from services.bench.serve.report import step_profile
from services.bench.workload import Workload
from services.common.cli_args import settings_env
from services.supervisor import LocalStack

START_TIMEOUT_S = 300


@dataclass
class StackRun:
    wall_s: float
    outputs: list[list[int]]  # in workload order
    load: Any  # GetLoad afterwards
    peak_rss_bytes: int  # of the three processes, KV pool excluded
    step_profile: list[dict[str, Any]]  # serve.report.step_profile rows of the timed part


class StackSystem(LocalStack):
    def __init__(self, model_path: Path, settings: dict[str, Any], threads: int) -> None:
        env = os.environ | settings_env(settings | {"threads": threads})
        log_path = Path(tempfile.mkstemp(prefix="cbserve-bench-stack-", suffix=".log")[1])
        super().__init__(model_path, log_path, env)
        try:
            self.wait_serving(START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    def health_status(self) -> str:
        from services.gateway.client import health_status

        try:
            return health_status(self.target, timeout_s=2)
        except grpc.RpcError as exc:
            return exc.code().name

    def run(
        self,
        workload: Workload,
        warmup: tuple[list[int], int],
        max_in_flight: int | None = None,
        streamed: bool = False,
    ) -> StackRun:
        """The workload through the stack, at most `max_in_flight` calls open at once (None: all);
        `streamed`: a message per generated token, else each output whole at the end."""
        with PeakRss(self.process.pid) as peak:
            wall, outputs, load, profile = asyncio.run(
                self._run(workload, warmup, max_in_flight or workload.num_requests, streamed)
            )
        return StackRun(wall, outputs, load, peak.bytes, profile)

    async def _run(
        self, workload: Workload, warmup: tuple[list[int], int], max_in_flight: int, streamed: bool
    ) -> tuple[float, list[list[int]], Any, list[dict[str, Any]]]:
        from services.gateway.api import pb, pb_grpc

        async with grpc.aio.insecure_channel(self.target) as channel:
            stub = pb_grpc.TextGenerationStub(channel)

            # The stack outlives a round, its prefix cache too: a fresh salt per round keeps a later
            # round from hitting what an earlier one cached (the in-process engine starts empty).
            salt = uuid.uuid4().hex
            # Streams start in workload order (tasks start in creation order), at most this many open.
            slots = asyncio.Semaphore(max_in_flight)

            async def one(prompt: list[int], max_tokens: int) -> list[int]:
                async with slots:
                    return await stream(prompt, max_tokens)

            async def stream(prompt: list[int], max_tokens: int) -> list[int]:
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), cache_salt=salt)
                request.sampling.temperature = 0.0
                request.stopping.max_tokens = max_tokens
                request.stopping.ignore_eos = True
                request.output.text = False
                request.output.stream = streamed
                ids: list[int] = []
                async for response in stub.Generate(request, timeout=3600):
                    ids += response.chunk.token_ids
                return ids

            await one(*warmup)
            steps_before = parse_histogram(scrape(self.metrics_url))
            start = time.perf_counter()
            outputs = await asyncio.gather(
                *(one(p, n) for p, n in zip(workload.prompts, workload.max_new_tokens, strict=True))
            )
            wall = time.perf_counter() - start
            load = await stub.GetLoad(pb.GetLoadRequest(), timeout=30)
            profile = step_profile(steps_before, parse_histogram(scrape(self.metrics_url)))
        return wall, list(outputs), load, profile

    def close(self) -> None:
        self.stop()
