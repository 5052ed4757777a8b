"""The real three-process stack for integration tests: `cbserve up` on loopback, driven over gRPC.

Each `Stack` starts one supervisor (which starts cachemgr, worker and gateway as children) with its
settings in `CBSERVE_*` environment variables, waits until the health service says SERVING, and
stops it with SIGTERM. Its children's JSON logs go to a file, kept for failure reports.

Beside it: the requests tests send a stack (greedy over token ids, chat) and what a stack must do with
them, transformers' greedy reference for its streams, and peers that pose as one of its processes.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import time
import uuid
from collections.abc import Iterator, Sequence
from functools import cache
from pathlib import Path
from typing import Any

import grpc
import msgspec
import pytest
import torch
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM

from services.common.cli_args import settings_env
from services.common.gateway_messages import GatewayMessage, WorkerMessage
from services.common.wire import INTERNAL_KEY_ENV
from services.gateway.api import pb, pb_grpc
from services.supervisor import LocalStack

Metadata = tuple[tuple[str, str], ...]
START_TIMEOUT_S = 240  # three processes importing torch on two busy cores
REPO = Path(__file__).resolve().parents[1]


class Stack(LocalStack):
    def __init__(
        self,
        model_dir: Path,
        log_dir: Path,
        *,
        up_args: Sequence[str] = (),
        credentials: grpc.ChannelCredentials | None = None,
        metadata: Metadata = (),
        start_timeout_s: float = START_TIMEOUT_S,
        **settings: Any,
    ) -> None:
        """`up_args`: more `cbserve up` flags; `credentials` (TLS) and `metadata` (an API key): what
        the stack's own calls present to a gateway that asks for them."""
        self.internal_key = secrets.token_hex(16)  # tests that pose as one of the stack's peers need it
        env = os.environ | settings_env({"worker_timeout": 30, "threads": 2} | settings)
        env[INTERNAL_KEY_ENV] = self.internal_key
        log_path = log_dir / f"stack-{secrets.token_hex(4)}.log"
        super().__init__(model_dir, log_path, env, up_args, cwd=REPO)
        self.metadata = metadata
        if credentials is None:
            self.channel = grpc.insecure_channel(self.target)
        else:
            self.channel = grpc.secure_channel(self.target, credentials)
        self.stub = pb_grpc.TextGenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        try:
            self.wait_serving(start_timeout_s)
        except BaseException:
            self.stop()  # not left running behind the caller's error
            raise
        self.info = self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10, metadata=metadata)
        self.idle = self.wait_idle()

    # ------------------------------------------------------------------------------------ lifecycle

    def health_status(self, service: str = "") -> str:
        try:
            reply = self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.RpcError as exc:
            return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def stop(self) -> int:
        self.channel.close()
        return super().stop()

    def log_events(self) -> Iterator[dict[str, Any]]:
        self._log.flush()
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue

    def events(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.log_events() if e.get("event") == name]

    def runtime_dir(self) -> Path:
        """The supervisor's private folder holding the ipc:// sockets."""
        return Path(self.events("stack starting")[-1]["runtime"])

    def child_pid(self, name: str) -> int:
        """PID of the latest start of child `name` (cachemgr, worker, gateway)."""
        starts = [e for e in self.log_events() if e.get("event") == "started" and e.get("child") == name]
        return starts[-1]["child_pid"]

    # ---------------------------------------------------------------------------------------- calls

    @property
    def vocab_size(self) -> int:
        return int(self.info.vocab_size)

    def reference(self, prompt_ids: list[int], max_new_tokens: int, eos: bool = False) -> list[int]:
        return hf_greedy(self.model_dir, prompt_ids, max_new_tokens, eos)

    def load(self) -> Any:
        return self.stub.GetLoad(pb.GetLoadRequest(), timeout=10, metadata=self.metadata)

    def wait_idle(self, timeout_s: float = 30.0) -> Any:
        """The load once nothing runs, waits or holds a block (the idle baseline)."""
        deadline = time.monotonic() + timeout_s
        while True:
            load = self.load()
            if not (load.requests_running or load.requests_waiting or load.kv_blocks_used):
                return load
            if time.monotonic() > deadline:
                raise AssertionError(f"stack not idle after {timeout_s} s: {load}")
            time.sleep(0.05)

    def assert_idle(self) -> None:
        load = self.wait_idle()
        assert load.kv_blocks_free + load.kv_blocks_cached == load.kv_blocks_total, load
        assert load.swap_slots_used == 0, load

    def generate(self, request: Any, timeout_s: float = 120.0, metadata: Metadata | None = None) -> Any:
        """Run one call to the end; returns (token ids, text, final message, chunk count). `metadata`
        replaces the stack's own (its API key, if any)."""
        ids: list[int] = []
        text, final, chunks = [], None, 0
        metadata = self.metadata if metadata is None else metadata
        for response in self.stub.Generate(request, timeout=timeout_s, metadata=metadata):
            assert final is None, "a message after the final one"
            if response.HasField("chunk"):
                chunks += 1
                ids += response.chunk.token_ids
                text.append(response.chunk.text)
            else:
                final = response.final
        assert final is not None, "stream ended without a final message"
        return ids, "".join(text), final, chunks


def greedy_request(prompt: list[int], max_tokens: int, **stopping: Any) -> Any:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt))
    request.sampling.temperature = 0.0
    request.stopping.max_tokens = max_tokens
    request.stopping.ignore_eos = stopping.pop("ignore_eos", True)
    for name, value in stopping.items():
        if isinstance(value, list):
            getattr(request.stopping, name).extend(value)
        else:
            setattr(request.stopping, name, value)
    return request


def chat_request(messages: list[dict[str, str]], max_tokens: int, **stopping: Any) -> Any:
    request = greedy_request([], max_tokens, **stopping)
    request.chat.messages.extend(pb.ChatMessage(**m) for m in messages)  # replaces the token_ids input
    return request


@cache
def hf_model(model_dir: Path) -> Any:
    """The model in `model_dir` under transformers, fp32, loaded once."""
    attn = "eager" if "gemma2" in model_dir.name else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn)
    return model.eval()


@cache
def _hf_greedy(model_dir: Path, prompt: tuple[int, ...], max_new_tokens: int, eos: bool) -> tuple[int, ...]:
    model = hf_model(model_dir)
    kwargs: dict[str, Any] = {} if eos else {"eos_token_id": None}
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kwargs
    )
    return tuple(out[0, len(prompt) :].tolist())


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int, eos: bool = False) -> list[int]:
    """transformers' greedy `generate` (fp32): the reference every stream must equal."""
    return list(_hf_greedy(model_dir, tuple(prompt), max_new_tokens, eos))


# ------------------------------------------------------------------- posing as one of the stack's peers

_encode = msgspec.msgpack.Encoder().encode


def keyed(stack: Stack, *args: Any, **fields: Any) -> bytes:
    """A `GatewayMessage` from a peer holding the stack's internal key: a buggy or rogue gateway."""
    return _encode(GatewayMessage(*args, key=stack.internal_key, **fields))


def dealer(context: zmq.Context, stack: Stack, name: str) -> zmq.Socket:
    """A DEALER on one of the stack's ipc sockets (`worker.sock`, `cachemgr.sock`)."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{stack.runtime_dir() / name}")
    return sock


def collect_finals(sock: zmq.Socket, expected: int, timeout_s: float = 30.0) -> list[Any]:
    """The final outputs a fake gateway receives (statuses and progress are skipped)."""
    decoder = msgspec.msgpack.Decoder(WorkerMessage)
    finals: list[Any] = []
    deadline = time.monotonic() + timeout_s
    while len(finals) < expected and time.monotonic() < deadline:
        if sock.poll(100):
            finals += [o for o in decoder.decode(sock.recv()).outputs if o.finish]
    return finals


def rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]


# ------------------------------------------------------------- requests to a stack, and what they leave

CALL_TIMEOUT_S = 60.0
CHAT = [{"role": "user", "content": "Name three colours of the rainbow, one per line."}]


def tiny_prompt(seed: int, length: int = 8) -> list[int]:
    """A prompt of ids in [3, 256) (no BOS/EOS/PAD), distinct per seed (no accidental prefix hits)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


def trace(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def assert_serves_exactly(stack: Stack, prompt: list[int], max_tokens: int = 4) -> None:
    ids, _, final, _ = stack.generate(greedy_request(prompt, max_tokens), timeout_s=CALL_TIMEOUT_S)
    assert ids == stack.reference(prompt, max_tokens)
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    stack.assert_idle()


def assert_aborted_in_worker(stack: Stack, trace_id: str, timeout_s: float = 5.0) -> None:
    """The worker logged that the gateway aborted this request (it did not run to its end)."""
    deadline = time.monotonic() + timeout_s
    while not any(
        e.get("event") == "request aborted by gateway" and e.get("request_id") == trace_id
        for e in stack.log_events()
    ):
        assert time.monotonic() < deadline, f"the worker never aborted {trace_id}:\n{stack.log_tail()}"
        time.sleep(0.05)


def cancel_after_chunks(call: Any, chunks: int = 3) -> None:
    """Read `chunks` chunks of a streaming call (either API's), cancel it, and see it end CANCELLED."""
    for _ in range(chunks):
        assert next(call).HasField("chunk")
    call.cancel()
    with pytest.raises(grpc.RpcError) as info:
        next(call)
    assert info.value.code() == grpc.StatusCode.CANCELLED
