"""How big the KV pool is: which setting decides, and the CPU default that leaves a host usable."""

from __future__ import annotations

import pytest
import torch

from services.cachemgr import sizing
from services.cachemgr.pool_memory import pool_shape
from services.cachemgr.sizing import DEFAULT_CPU_KV_CACHE, GIB, meminfo_bytes, size_cache
from services.common.config import CBConfig
from services.common.kv_geometry import RESERVED_CHUNKS, KVGeometry
from services.common.kv_int8 import SCALE_BYTES
from tests.tiny_models import tiny_config

CPU = torch.device("cpu")
CONFIG = tiny_config("llama")
GEOMETRY = KVGeometry.from_model_config(CONFIG, page_size=16, dtype_bytes=4)


def sized(**settings: object) -> sizing.CacheSizing:
    return size_cache(GEOMETRY, CONFIG, CBConfig.from_kwargs(**settings), CPU)


def test_cpu_default_is_a_fixed_size_capped_at_a_quarter_of_ram() -> None:
    s = sized()
    assert s.source == "default"
    cap = min(DEFAULT_CPU_KV_CACHE, meminfo_bytes("MemTotal") // 4)
    assert cap - GEOMETRY.chunk_bytes < s.kv_bytes <= cap
    assert sized().num_chunks == s.num_chunks  # not a function of what happens to be free


@pytest.mark.parametrize(
    ("settings", "source", "expected_chunks"),
    [
        (
            {"num_blocks": 40, "kv_cache_space": 1.0, "max_memory_percent": 0.5},
            "num_blocks",
            40 + RESERVED_CHUNKS,
        ),
        (
            {"kv_cache_space": 0.01, "max_memory_percent": 0.5},
            "kv_cache_space",
            int(0.01 * GIB) // GEOMETRY.chunk_bytes,
        ),
    ],
)
def test_explicit_settings_win_in_order(settings: dict, source: str, expected_chunks: int) -> None:
    s = sized(**settings)
    assert (s.source, s.num_chunks) == (source, expected_chunks)


def test_max_memory_percent_sizes_from_free_memory() -> None:
    s = sized(max_memory_percent=0.01)
    assert s.source == "max_memory_percent"
    assert s.kv_bytes <= s.free_bytes * 0.01 - s.workspace_bytes


def test_a_pool_larger_than_dev_shm_is_refused_before_it_can_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sizing, "shm_free_bytes", lambda: 64 << 20)  # docker's default /dev/shm
    with pytest.raises(RuntimeError, match=r"do not fit the 0.06 GiB free"):
        size_cache(GEOMETRY, CONFIG, CBConfig(kv_cache_space=1.0), CPU, shm=True)


@pytest.mark.parametrize("space", [0.0, -1.0])
def test_kv_cache_space_must_be_positive(space: float) -> None:
    with pytest.raises(ValueError, match=f"kv_cache_space must be > 0 GiB, got {space}"):
        CBConfig(kv_cache_space=space)


def test_int8_rows_hold_their_scale_and_nearly_four_times_the_tokens_of_float32() -> None:
    """An int8 row is head_dim values and a 4-byte scale: (head_dim + 4) / (4 head_dim) of float32's
    bytes, in the pool's shape, its chunks, the bytes per token and the chunks a budget buys."""
    int8 = KVGeometry.from_model_config(CONFIG, page_size=16, dtype_bytes=1, scale_bytes=SCALE_BYTES)
    d = GEOMETRY.head_dim
    assert (int8.row_elems, GEOMETRY.row_elems) == (d + SCALE_BYTES, d)
    assert pool_shape(int8, 3) == (*pool_shape(GEOMETRY, 3)[:-1], d + SCALE_BYTES)
    assert int8.bytes_per_token * 4 * d == GEOMETRY.bytes_per_token * (d + SCALE_BYTES)
    assert int8.chunk_bytes * 4 * d == GEOMETRY.chunk_bytes * (d + SCALE_BYTES)
    budget = CBConfig(kv_cache_space=0.01)
    chunks = {g: size_cache(g, CONFIG, budget, CPU).num_chunks for g in (GEOMETRY, int8)}
    assert chunks[int8] == int(0.01 * GIB) // int8.chunk_bytes
    assert chunks[int8] / chunks[GEOMETRY] == pytest.approx(4 * d / (d + SCALE_BYTES), rel=1e-2)


def test_a_scale_that_is_not_whole_elements_is_refused() -> None:
    with pytest.raises(ValueError, match="scale_bytes must be whole 2-byte elements, got 3"):
        KVGeometry.from_model_config(CONFIG, page_size=16, dtype_bytes=2, scale_bytes=3)
