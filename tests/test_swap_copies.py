"""Swap copies (worker/swap_copies.py) and the pools they move bytes between (cachemgr/pool_memory.py).

The plane-by-plane copies CUDA uses give what the CPU's gather and scatter give, for any lists a grant
can hold. On a device (`cuda_only`, run by `make gpu-check`): the side stream is ordered against the
forwards around it, and a worker process maps the cachemgr's KV pool by CUDA IPC handle and registers
its swap pool as pinned memory, again after the first one was killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from services.cachemgr.pool_memory import create_pool_memory
from services.common.kv_geometry import KVGeometry
from services.worker.swap_copies import SwapCopies, slot_runs
from tests.cuda_marks import cuda_only

REPO = Path(__file__).resolve().parents[1]
GEOMETRY = KVGeometry(4, 2, 8, 4, 4, ("full",) * 4, None)  # 4 layers: two planes of K and V per chunk
CHUNKS, SLOTS = 24, 16


def pools(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    kv = torch.randn(4, 2, CHUNKS, 4, 2, 8, device=device)
    swap = (
        torch.randn(4, 2, SLOTS, 4, 2, 8).pin_memory()
        if device == "cuda"
        else torch.randn(4, 2, SLOTS, 4, 2, 8)
    )
    return kv, swap


def test_slot_runs() -> None:
    assert list(slot_runs([4, 5, 6, 9, 2, 3])) == [(0, 3, 4), (3, 1, 9), (4, 2, 2)]
    assert list(slot_runs([])) == []


grants = st.integers(0, 12).flatmap(
    lambda n_out: st.tuples(
        st.permutations(range(CHUNKS)).map(lambda c: c[: n_out + 6]),
        st.permutations(range(SLOTS)).map(lambda s: s[: n_out + 4]),
        st.just(n_out),
    )
)


@given(grants)
def test_plane_copies_equal_the_gather_and_scatter(grant: tuple[list[int], list[int], int]) -> None:
    chunks, slots, n_out = grant
    swap_out = list(zip(chunks[:n_out], slots[:n_out], strict=True))
    # Restores read other slots (the cachemgr drains a slot it reads for the whole step) into other chunks.
    swap_in = list(zip(slots[n_out:], chunks[n_out : n_out + 4], strict=True))
    expected_kv, expected_swap = pools()
    SwapCopies(expected_kv, expected_swap, by_planes=False).copy(swap_out, swap_in)
    kv, swap = pools()
    SwapCopies(kv, swap, by_planes=True).copy(swap_out, swap_in)
    assert torch.equal(kv, expected_kv) and torch.equal(swap, expected_swap)


def test_copies_without_a_swap_pool_are_refused() -> None:
    kv, _ = pools()
    SwapCopies(kv, None).copy([], [])  # nothing to move: nothing asked
    with pytest.raises(RuntimeError, match="no swap pool"):
        SwapCopies(kv, None).copy([(3, 0)], [])


@cuda_only
def test_on_cuda_the_side_stream_is_ordered_between_the_forwards() -> None:
    kv, swap = pools("cuda")
    before = kv.clone()
    copies = SwapCopies(kv, swap)
    assert copies.stream is not None and copies.by_planes and swap.is_pinned()
    victims, restored = [5, 6, 7, 11], [8, 9]
    kv[:, :, victims] += 1.0  # the forward before: the victims' last KV, queued on the main stream
    copies.copy(
        [(c, s) for c, s in zip(victims, [0, 1, 2, 9], strict=True)], [(3, restored[0]), (4, restored[1])]
    )
    written = kv[:, :, restored].clone()  # the forward after reads the restored chunks...
    kv[:, :, victims] = -7.0  # ...and overwrites the victims' chunks
    torch.cuda.synchronize()
    assert torch.equal(swap[:, :, [0, 1, 2, 9]], (before[:, :, victims] + 1.0).cpu())
    assert torch.equal(written.cpu(), swap[:, :, [3, 4]])


# A worker process in miniature: maps the pools by their handles (stdin), checks the swap pool is
# pinned, swaps chunk 2 out to slot 1 and writes a mark into chunk 3; with "hold", it then waits to
# be killed.
WORKER = """
import sys, time, msgspec, torch
from services.cachemgr.pool_memory import PoolHandles, attach_pool_memory
from services.worker.swap_copies import SwapCopies
handles = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=PoolHandles)
memory = attach_pool_memory(handles, torch.device("cuda"))
assert memory.registered and memory.kv.is_cuda and memory.swap is not None
SwapCopies(memory.kv, memory.swap).copy([(2, 1)], [])
memory.kv[:, :, 3] = float(sys.argv[1])
torch.cuda.synchronize()
print("attached", flush=True)
if sys.argv[2] == "hold":
    time.sleep(600)
memory.close()
"""


@cuda_only
def test_on_cuda_a_worker_maps_the_pools_and_so_does_its_restart() -> None:
    memory = create_pool_memory(GEOMETRY, CHUNKS, SLOTS, torch.float32, torch.device("cuda"), shared=True)
    try:
        assert memory.handles is not None and memory.handles.kv.kind == "cuda_ipc"
        assert memory.swap is not None and memory.handles.swap is not None
        memory.kv[:, :, 2] = 5.0
        torch.cuda.synchronize()
        handles = msgspec.msgpack.encode(memory.handles)
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        argv = [sys.executable, "-c", WORKER]
        first = subprocess.Popen(
            [*argv, "1.5", "hold"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
        )
        assert first.stdin is not None and first.stdout is not None
        first.stdin.write(handles)
        first.stdin.close()
        assert first.stdout.readline() == b"attached\n"
        first.send_signal(signal.SIGKILL)  # a worker crash: the pools are the cachemgr's and stay
        first.wait(30)
        torch.cuda.synchronize()
        assert (memory.kv[:, :, 3] == 1.5).all() and (memory.swap[:, :, 1] == 5.0).all()
        memory.swap[:, :, 1] = 0.0
        second = subprocess.run(
            [*argv, "2.5", "exit"], input=handles, capture_output=True, env=env, timeout=120
        )
        assert second.returncode == 0, second.stderr.decode()
        torch.cuda.synchronize()
        assert (memory.kv[:, :, 3] == 2.5).all() and (memory.swap[:, :, 1] == 5.0).all()
    finally:
        memory.close()
