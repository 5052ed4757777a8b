"""A host KV pool prefaulted at start (cachemgr/pool_memory.py): neither its owner nor a process that
maps it takes a page fault when a step first writes KV into it, what was in it is kept, and the pool
reports itself committed whole. Off, pages fault in (and count as committed) as they are written."""

from __future__ import annotations

import mmap
import os
import resource
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from services.cachemgr.kv_cache import KVCache
from services.cachemgr.pool_memory import create_pool_memory
from services.common.config import CBConfig
from services.common.kv_geometry import RESERVED_CHUNKS, KVGeometry
from tests.tiny_models import tiny_config

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
# 16 tokens x 2 heads x 64 floats: two OS pages per chunk in each of the 8 K/V planes.
GEOMETRY = KVGeometry(4, 2, 64, 16, 4, ("full",) * 4, None)
CHUNKS = 256
PAGES = CHUNKS * GEOMETRY.chunk_bytes // mmap.PAGESIZE


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def first_write_faults(prefault: bool) -> int:
    memory = create_pool_memory(GEOMETRY, CHUNKS, 0, torch.float32, CPU, prefault=prefault)
    try:
        before = faults()
        memory.kv.fill_(1.0)  # every page, as steps would over time
        return faults() - before
    finally:
        memory.close()


def test_the_owners_first_writes_fault_nothing_once_prefaulted() -> None:
    lazy, prefaulted = first_write_faults(False), first_write_faults(True)
    assert prefaulted < PAGES / 100, (prefaulted, PAGES)
    assert prefaulted * 10 <= lazy, (prefaulted, lazy)  # what it saves (PAGES with 4 KiB pages)


# A worker in miniature: maps the pool by its handles (stdin), checks what the owner wrote, then
# prints the faults its own first writes into every chunk cost.
MAPPER = """
import resource, sys, msgspec, torch
from services.cachemgr.pool_memory import PoolHandles, attach_pool_memory
handles = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=PoolHandles)
memory = attach_pool_memory(handles, torch.device("cpu"))
assert bool((memory.kv[:, :, 5] == 7.0).all()), "the owner's KV was not kept"
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
memory.kv[:, :, 6:].fill_(1.0)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def mapping_process_write_faults(prefault: bool) -> int:
    memory = create_pool_memory(GEOMETRY, CHUNKS, 0, torch.float32, CPU, shared=True, prefault=prefault)
    try:
        assert memory.handles is not None and memory.handles.kv_prefaulted is prefault
        memory.kv[:, :, 5] = 7.0  # live KV, as a restarted worker finds it
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run(
            [sys.executable, "-c", MAPPER],
            input=msgspec.msgpack.encode(memory.handles),
            capture_output=True,
            env=env,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr.decode()
        return int(done.stdout.split()[-1])
    finally:
        memory.close()


def test_a_process_mapping_a_prefaulted_pool_writes_without_faults_and_keeps_its_content() -> None:
    lazy, prefaulted = mapping_process_write_faults(False), mapping_process_write_faults(True)
    assert prefaulted < PAGES / 100, (prefaulted, PAGES)
    assert prefaulted * 10 <= lazy, (prefaulted, lazy)


@pytest.mark.parametrize("prefault", [True, False])
def test_committed_bytes_say_whether_the_pool_was_prefaulted(prefault: bool) -> None:
    config = CBConfig(num_blocks=64, page_size=16, prefault_kv_pool=prefault)
    cache = KVCache(tiny_config("llama"), config, torch.float32, CPU)
    try:
        stats = cache.stats()
        expected = stats["kv_pool_bytes"] if prefault else RESERVED_CHUNKS * cache.sizing.chunk_bytes
        assert stats["kv_pool_committed_bytes"] == expected
    finally:
        cache.close()
