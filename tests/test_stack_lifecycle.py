"""Health follows the stack's life: NOT_SERVING until worker and cachemgr are attached and warm,
SERVING, then NOT_SERVING from SIGTERM on while the streams in flight finish. The three processes are
started by hand with tcp:// addresses, as containers run them."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.gateway_messages import NewRequest
from services.common.sampling_params import SamplingParams
from services.common.tensor_handles import SHM_PREFIX, shm_dir
from services.gateway.api import SERVICE_NAME, pb, pb_grpc
from services.supervisor import cbserve_argv, die_with_parent, free_port
from tests.openai_penalties import openai_greedy, penalized_request
from tests.stack import (
    REPO,
    START_TIMEOUT_S,
    Stack,
    collect_finals,
    dealer,
    greedy_request,
    keyed,
    rss_kib,
)

# As compose runs them: tcp:// sockets, the internal key shared through the environment.
SETTINGS = {
    "CBSERVE_PAGE_SIZE": "8",
    "CBSERVE_NUM_BLOCKS": "200",
    "CBSERVE_THREADS": "1",
    "CBSERVE_INTERNAL_KEY": "lifecycle-test-key",
}


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
            cbserve_argv(*args), env=env, cwd=REPO, stdout=log, stderr=log, preexec_fn=die_with_parent
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
    gateway = spawn(
        "gateway",
        "--model",
        model,
        "--worker-address",
        worker_address,
        "--port",
        str(port),
        "--metrics-port",
        "0",
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stub = pb_grpc.TextGenerationStub(channel)
    wait_for(lambda: health(channel) != "UNAVAILABLE", START_TIMEOUT_S, "gateway never answered")
    # Up, but no worker: not serving, and calls are refused with UNAVAILABLE.
    assert health(channel) == health(channel, SERVICE_NAME) == "NOT_SERVING"
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(greedy_request([5, 6, 7], 4), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

    cachemgr = spawn("cachemgr", "--model", model, "--cachemgr-address", cachemgr_address)
    worker = spawn(
        "worker", "--model", model, "--worker-address", worker_address, "--cachemgr-address", cachemgr_address
    )
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

    # Its own pools, not all of /dev/shm: other stacks on the machine come and go meanwhile.
    pools = shm_mapped(cachemgr.pid)
    assert pools
    for proc in (worker, cachemgr):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert not [p for p in pools if p.exists()], "the cachemgr left its pools in shared memory"


# Sync in the slow run: the async worker dies with a forward in flight, the harder case of the same
# re-submission (the gateway's, whichever mode the worker batches in); scripts/gpu_check's stack
# section (tests/test_gpu_check.py) kills a sync worker mid-stream too.
@pytest.mark.parametrize(
    "async_batching", [pytest.param(False, marks=pytest.mark.slow), True], ids=["sync", "async"]
)
def test_streams_survive_a_killed_worker(
    async_batching: bool, tiny_models: Callable[[str], Path], tmp_path: Path
) -> None:
    """SIGKILL the worker mid-stream: cbserve up restarts it, the gateway re-submits every stream as
    prompt + tokens streamed, and each stream still equals an uninterrupted greedy run; full pages
    came from the prefix cache (the re-prefill recomputes at most the last partial page + the token
    in flight); nothing is held afterwards. With async batching the worker dies with a forward running
    whose pages the cachemgr must not have cached yet. Half the streams have presence/frequency
    penalties, whose counts must go on counting the tokens streamed before the loss."""
    page = 8
    stack = Stack(
        tiny_models("llama"), tmp_path, page_size=page, num_blocks=400, use_async_batching=async_batching
    )
    try:
        rng = random.Random(4)
        prompts = [[rng.randint(3, 255) for _ in range(rng.randint(5, 40))] for _ in range(6)]
        new_tokens = 600
        penalties = SamplingParams(presence_penalty=0.25, frequency_penalty=0.05)
        penalized = [i % 2 == 1 for i in range(len(prompts))]
        expected = [
            openai_greedy(stack.model_dir, p, new_tokens, penalties)
            if pen
            else stack.reference(p, new_tokens)
            for p, pen in zip(prompts, penalized, strict=True)
        ]
        requests = [
            penalized_request(p, new_tokens, penalties) if pen else greedy_request(p, new_tokens)
            for p, pen in zip(prompts, penalized, strict=True)
        ]
        streams = [stack.stub.Generate(r, timeout=240) for r in requests]
        firsts = [next(s) for s in streams]  # every request is running
        worker = stack.child_pid("worker")
        killed = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        outputs = []
        for first, stream in zip(firsts, streams, strict=True):
            rest = list(stream)
            assert rest[-1].final.finish_reason == pb.FINISH_REASON_LENGTH
            assert rest[-1].final.usage.completion_tokens == new_tokens
            outputs.append([*first.chunk.token_ids, *(t for r in rest[:-1] for t in r.chunk.token_ids)])
        assert outputs == expected
        took = time.monotonic() - killed
        assert stack.child_pid("worker") != worker
        metrics = scrape_metrics(stack)
        resubmitted = metrics["cbserve:resubmitted_requests_total"]
        recomputed = metrics["cbserve:resubmit_recomputed_tokens_total"]
        print(
            f"\nrecovery: {len(prompts)} streams completed {took:.1f} s after the worker's SIGKILL; "
            f"{resubmitted:.0f} re-submitted, {recomputed:.0f} tokens recomputed"
        )
        assert 1 <= resubmitted <= len(prompts)
        assert recomputed <= resubmitted * (page + 1)
        stack.assert_idle()
    finally:
        stack.stop()


def test_a_gateway_on_a_port_in_use_exits_with_the_configuration_status(
    tiny_models: Callable[[str], Path],
) -> None:
    """A gateway that cannot listen exits 2, which a supervisor does not answer with a restart
    (`cbserve up` checks its ports before it starts anything: tests/test_cli.py). `--metrics-port 0`
    is off."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = cbserve_argv(
            "gateway",
            "--model",
            str(tiny_models("llama")),
            "--port",
            str(port),
            "--metrics-port",
            "0",
            "--worker-address",
            "tcp://127.0.0.1:9",
        )
        done = subprocess.run(argv, capture_output=True, timeout=START_TIMEOUT_S, preexec_fn=die_with_parent)
    log = done.stderr.decode(errors="replace")
    assert done.returncode == 2, log[-3000:]
    [cannot] = [json.loads(line) for line in log.splitlines() if '"cannot listen"' in line]
    assert cannot["port"] == port and cannot["metrics_port"] is None


def scrape_metrics(stack: Stack) -> dict[str, float]:
    url = f"http://127.0.0.1:{stack.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in lines if line and line[0] != "#")}


CACHEMGR_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def fault_stack(
    tiny_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """Short timeouts so that crashes and silences are noticed in seconds, and a queue of 4."""
    stack = Stack(
        tiny_models("llama"),
        tmp_path_factory.mktemp("faults"),
        page_size=8,
        num_blocks=400,
        cachemgr_timeout=CACHEMGR_TIMEOUT_S,
        gateway_timeout=3,
        max_queue_size=4,
        worker_timeout=4,
        resubmit_timeout=10,
    )
    yield stack
    stack.stop()


def test_queue_overflow_is_refused_at_once(fault_stack: Stack) -> None:
    calls = [fault_stack.stub.Generate(greedy_request([5, 6, 7, i + 8], 300), timeout=120) for i in range(12)]
    codes = []
    for call in calls:
        try:
            list(call)
            codes.append(grpc.StatusCode.OK)
        except grpc.RpcError as exc:
            codes.append(exc.code())
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    fault_stack.assert_idle()


FLOOD_CLIENTS = 32  # channels, each its own HTTP/2 connection
FLOOD_CALLS = 20  # concurrent calls per client


def _flood(stack: Stack, seed: int) -> tuple[Counter[str], dict[str, int]]:
    """FLOOD_CLIENTS x FLOOD_CALLS calls at once, 256-token prompts; the peak RSS of each process."""
    pids = {name: stack.child_pid(name) for name in ("cachemgr", "worker", "gateway")}
    peak = {name: rss_kib(pid) for name, pid in pids.items()}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            for name, pid in pids.items():
                peak[name] = max(peak[name], rss_kib(pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    rng = random.Random(seed)
    vocab = int(stack.info.vocab_size)
    channels = [grpc.insecure_channel(stack.target) for _ in range(FLOOD_CLIENTS)]
    calls = [
        pb_grpc.TextGenerationStub(channel).Generate(
            greedy_request([rng.randrange(vocab) for _ in range(256)], 4), timeout=120
        )
        for channel in channels
        for _ in range(FLOOD_CALLS)
    ]
    outcomes: Counter[str] = Counter()
    for call in calls:
        try:
            list(call)
            outcomes["OK"] += 1
        except grpc.RpcError as exc:
            outcomes[exc.code().name] += 1
    done.set()
    sampler.join()
    for channel in channels:
        channel.close()
    return outcomes, peak


def test_a_flood_from_many_clients_is_refused_and_memory_stays_bounded(fault_stack: Stack) -> None:
    """Beyond the queue, calls are refused at once and hold nothing: after the third flood every
    process holds what it held after the first (memory does not grow with the calls refused)."""
    names = ("cachemgr", "worker", "gateway")
    idle = {name: rss_kib(fault_stack.child_pid(name)) for name in names}
    settled = []
    for seed in range(3):
        outcomes, peak = _flood(fault_stack, seed)
        fault_stack.assert_idle()
        settled.append({name: rss_kib(fault_stack.child_pid(name)) for name in names})
        mib, idle_mib = ({k: round(v / 1024) for k, v in d.items()} for d in (peak, idle))
        print(
            f"\nflood {seed}: {FLOOD_CLIENTS} clients x {FLOOD_CALLS} calls: {dict(outcomes)}; "
            f"peak RSS MiB {mib}, idle before {idle_mib}"
        )
        assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"}, outcomes
        assert outcomes["RESOURCE_EXHAUSTED"] > 0 and outcomes["OK"] > 0, outcomes
    growth = {name: settled[2][name] / settled[0][name] - 1 for name in names}
    print(f"RSS growth from the first flood to the third: { ({k: f'{v:+.1%}' for k, v in growth.items()}) }")
    assert all(g < 0.10 for g in growth.values()), growth


def _token_ids(stream: Any) -> list[int]:
    return [t for response in stream if response.HasField("chunk") for t in response.chunk.token_ids]


def test_a_worker_silent_for_a_while_keeps_its_streams(fault_stack: Stack) -> None:
    """A worker silent past --worker-timeout (one very long step; here SIGSTOP) that speaks again with
    the same id still holds its requests: the gateway stops admitting, then carries on, with nothing
    re-submitted twice (once a bug: every stream came back INVALID_ARGUMENT "duplicate request_id")."""
    prompt = [8, 6, 7, 5, 3, 1, 9]
    stream = fault_stack.stub.Generate(greedy_request(prompt, 300), timeout=60)
    first = next(stream)
    worker = fault_stack.child_pid("worker")
    os.kill(worker, signal.SIGSTOP)
    try:
        wait_for(lambda: fault_stack.health_status() == "NOT_SERVING", 20, "a silent worker stayed SERVING")
    finally:
        os.kill(worker, signal.SIGCONT)
    ids = [*first.chunk.token_ids, *_token_ids(stream)]
    assert ids == fault_stack.reference(prompt, 300)
    fault_stack.wait_serving(30)
    assert fault_stack.child_pid("worker") == worker
    fault_stack.assert_idle()


def test_a_gateway_presumed_dead_is_told_its_requests_are_gone(fault_stack: Stack) -> None:
    """A gateway that stops sending heartbeats but still reads (a stalled event loop) gets its
    requests back as UNAVAILABLE when the worker gives up on it, rather than streams that never end."""
    # 1000 new tokens each: the pool (400 blocks of 8) runs three at a time, so the tiny model takes
    # many times --gateway-timeout 3 for all of them, and some are still there when it expires.
    params = SamplingParams(max_new_tokens=1000, ignore_eos=True)
    adds = [NewRequest(f"silent-{i}", [3, 1, 4, i], params) for i in range(24)]
    context = zmq.Context()
    sock = dealer(context, fault_stack, "worker.sock")
    try:
        sock.send(keyed(fault_stack, "silent-gateway", adds))
        finals = collect_finals(sock, len(adds), timeout_s=60)
    finally:
        sock.close(linger=0)
        context.term()
    ends = Counter((o.finish, o.code) for o in finals)
    print(f"\na silent gateway's {len(adds)} requests ended: {dict(ends)}")
    assert set(ends) <= {("length", ""), ("error", "UNAVAILABLE")}, finals
    assert ends[("error", "UNAVAILABLE")] > 0 and len(finals) == len(adds), ends
    fault_stack.assert_idle()


def test_a_hung_worker_fails_its_streams_and_frees_their_blocks(fault_stack: Stack) -> None:
    """Silent past --resubmit-timeout: the streams fail UNAVAILABLE; when the worker wakes, the
    gateway's aborts give their blocks back."""
    stream = fault_stack.stub.Generate(greedy_request([2, 4, 6, 8], 900), timeout=60)
    next(stream)
    worker = fault_stack.child_pid("worker")
    os.kill(worker, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        with pytest.raises(grpc.RpcError) as failed:
            list(stream)
        failed_after = time.monotonic() - stopped
    finally:
        os.kill(worker, signal.SIGCONT)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
    fault_stack.wait_serving(30)
    print(
        f"\nrecovery: a hung worker's stream failed UNAVAILABLE {failed_after:.1f} s after SIGSTOP "
        f"(--resubmit-timeout 10); SERVING {time.monotonic() - stopped:.1f} s after"
    )
    fault_stack.assert_idle()


def test_a_killed_gateway_loses_nothing(fault_stack: Stack) -> None:
    """The worker aborts a dead gateway's requests (its heartbeats stop) and their blocks return."""
    stream = fault_stack.stub.Generate(greedy_request([9, 9, 9], 900), timeout=60)
    next(stream)
    gateway = fault_stack.child_pid("gateway")
    os.kill(gateway, signal.SIGKILL)
    with pytest.raises(grpc.RpcError):
        list(stream)
    killed = time.monotonic()
    wait_for(lambda: fault_stack.child_pid("gateway") != gateway, 30, "the gateway was not restarted")
    fault_stack.wait_serving()
    print(f"\nrecovery: SERVING {time.monotonic() - killed:.1f} s after the gateway's SIGKILL")
    fault_stack.assert_idle()
    prompt = [4, 5, 6]
    assert fault_stack.generate(greedy_request(prompt, 8))[0] == fault_stack.reference(prompt, 8)


def shm_mapped(pid: int) -> set[Path]:
    """cbserve's shared-memory files that process `pid` maps, deleted ones included."""
    paths = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        path = Path(fields[5].removesuffix(" (deleted)")) if len(fields) == 6 else None
        if path is not None and path.parent == shm_dir() and path.name.startswith(SHM_PREFIX):
            paths.add(path)
    return paths


def test_a_killed_cachemgr_fails_streams_then_the_stack_recovers(fault_stack: Stack) -> None:
    """In-flight streams end UNAVAILABLE within the worker's cachemgr timeout, health turns
    NOT_SERVING, and once the restarted cachemgr is attached the stack serves exactly again, and the
    dead cachemgr's pools are gone from shared memory."""
    stream = fault_stack.stub.Generate(greedy_request([3, 1, 4, 1, 5], 900), timeout=60)
    next(stream)
    cachemgr = fault_stack.child_pid("cachemgr")
    pools = shm_mapped(cachemgr)
    assert pools and pools <= shm_mapped(fault_stack.child_pid("worker")), pools
    killed = time.monotonic()
    os.kill(cachemgr, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as failed:
        list(stream)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    failed_after = time.monotonic() - killed
    # The worker's one unanswered wait, plus slack for a step in flight on two busy cores.
    assert failed_after < CACHEMGR_TIMEOUT_S + 4, failed_after
    wait_for(lambda: fault_stack.health_status() == "NOT_SERVING", 20, "health never turned NOT_SERVING")
    fault_stack.wait_serving(60)
    print(
        f"\nrecovery: stream failed UNAVAILABLE {failed_after:.1f} s and SERVING again "
        f"{time.monotonic() - killed:.1f} s after the cachemgr's SIGKILL"
    )
    assert fault_stack.child_pid("cachemgr") != cachemgr
    # The new cachemgr deletes them at start; the worker, attached to the new pools, maps none of them.
    assert not [p for p in pools if p.exists()], pools
    assert not pools & shm_mapped(fault_stack.child_pid("worker"))
    prompt = [2, 7, 1, 8]
    assert fault_stack.generate(greedy_request(prompt, 8))[0] == fault_stack.reference(prompt, 8)
    fault_stack.assert_idle()
