"""Health follows the stack's life: NOT_SERVING until worker and cachemgr are attached and warm,
SERVING, then NOT_SERVING from SIGTERM on while the streams in flight finish. The three processes are
started by hand with tcp:// addresses, as containers run them."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.tensor_handles import SHM_PREFIX, shm_dir
from services.gateway.api import SERVICE_NAME, pb, pb_grpc
from services.supervisor import die_with_parent
from tests.stack import REPO, START_TIMEOUT_S, Stack, cbserve, free_port, greedy_request

SETTINGS = {"CBSERVE_PAGE_SIZE": "8", "CBSERVE_NUM_BLOCKS": "200", "CBSERVE_THREADS": "1"}


def health(channel: grpc.Channel, service: str = "") -> str:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2
        )
    except grpc.RpcError as exc:
        return exc.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.1)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> subprocess.Popen[bytes]:
        log = (tmp_path / f"{args[0]}.log").open("wb")
        env = os.environ | SETTINGS
        proc = subprocess.Popen(
            cbserve(*args), env=env, cwd=REPO, stdout=log, stderr=log, preexec_fn=die_with_parent
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_health_follows_readiness_and_drain(
    tiny_models: Callable[[str], Path], spawn: Callable[..., subprocess.Popen[bytes]]
) -> None:
    model = str(tiny_models("llama"))
    cachemgr_address = f"tcp://127.0.0.1:{free_port()}"
    worker_address = f"tcp://127.0.0.1:{free_port()}"
    port = free_port()
    gateway = spawn("gateway", "--model", model, "--worker-address", worker_address, "--port", str(port),
                    "--metrics-port", "0")  # fmt: skip
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.TextGenerationStub(channel)
    wait_for(lambda: health(channel) != "UNAVAILABLE", START_TIMEOUT_S, "gateway never answered")
    # Up, but no worker: not serving, and calls are refused with UNAVAILABLE.
    assert health(channel) == health(channel, SERVICE_NAME) == "NOT_SERVING"
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(greedy_request([5, 6, 7], 4), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    shm_before = set(shm_dir().glob(f"{SHM_PREFIX}*"))
    cachemgr = spawn("cachemgr", "--model", model, "--cachemgr-address", cachemgr_address)
    worker = spawn("worker", "--model", model, "--worker-address", worker_address,
                   "--cachemgr-address", cachemgr_address)  # fmt: skip
    wait_for(lambda: health(channel) == "SERVING", START_TIMEOUT_S, "stack never became SERVING")
    assert health(channel, SERVICE_NAME) == "SERVING"

    # A long stream is in flight when SIGTERM arrives: it finishes; new calls are refused.
    stream = stub.Generate(greedy_request([5, 6, 7], 900), timeout=120)
    first = next(stream)
    assert first.HasField("chunk")
    gateway.send_signal(signal.SIGTERM)
    wait_for(lambda: health(channel) == "NOT_SERVING", 10, "health did not turn NOT_SERVING on SIGTERM")
    with pytest.raises(grpc.RpcError) as draining:
        list(stub.Generate(greedy_request([5, 6, 7], 4), timeout=10))
    assert draining.value.code() == grpc.StatusCode.UNAVAILABLE
    rest = list(stream)
    assert rest[-1].final.finish_reason == pb.FINISH_REASON_LENGTH
    assert len(first.chunk.token_ids) + sum(len(r.chunk.token_ids) for r in rest) == 900
    assert gateway.wait(30) == 0
    channel.close()

    for proc in (worker, cachemgr):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert set(shm_dir().glob(f"{SHM_PREFIX}*")) <= shm_before, "the cachemgr left its pools in shared memory"


def test_a_killed_worker_is_restarted_and_the_stack_serves_again(
    tiny_models: Callable[[str], Path], tmp_path: Path
) -> None:
    stack = Stack(tiny_models("llama"), tmp_path, page_size=8, num_blocks=200)
    try:
        prompt = [9, 8, 7, 6, 5, 4, 3]
        stream = stack.stub.Generate(greedy_request(prompt, 900), timeout=120)
        assert next(stream).HasField("chunk")
        worker = stack.child_pid("worker")
        os.kill(worker, signal.SIGKILL)
        # The stream in flight ends UNAVAILABLE once the gateway sees the worker replaced.
        with pytest.raises(grpc.RpcError) as lost:
            list(stream)
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        wait_for(lambda: stack.child_pid("worker") != worker, 30, "the supervisor did not restart the worker")
        stack.wait_serving()
        ids, *_ = stack.generate(greedy_request(prompt, 8))
        assert ids == stack.reference(prompt, 8)
        # The new worker's attach made the cachemgr drop the dead worker's request: nothing is held.
        stack.assert_idle()
    finally:
        stack.stop()
