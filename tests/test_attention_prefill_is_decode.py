"""The prefill attention kernel gives each query row, bit for bit, what the decode kernel gives that row
over the same keys (csrc/paged_common.h, "One row, one result"): a soft reset recomputes the tokens
a request generated through the prefill kernel, and in bfloat16 a last-bit difference in one row's
attention can flip an activation's rounding and, at a near tie, a token. On every KV page type and
every vector path (the lower ones rebuilt below), with grouped queries, soft-capping, chunks after
earlier context and sliding windows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.kv_int8 import quantize
from services.common.precision import cpu_flags
from tests.attention_cases import prefill_batch, rerun_on_lower_path, run_on_path
from tests.kernel_modules import attention_module

POOL_TYPES = ("float32", "bfloat16", "float16", "int8")


def as_pool(cache: torch.Tensor, pool_type: str) -> torch.Tensor:
    return quantize(cache) if pool_type == "int8" else cache.to(getattr(torch, pool_type))


def decode_rows(
    module: object,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefill_args: list[torch.Tensor],
    window: int,
    softcap: float,
    per_request: bool,
) -> torch.Tensor:
    """Every query row of the prefill batch as a decode row over its own keys (the last `window` of
    them, if any): all rows in one call (several requests: a task takes every kv head), or one call
    per request's chunk (a few rows: a task per kv head)."""
    _, first_rows, num_queries, slots, lengths = prefill_args
    d = q.shape[-1]
    out = torch.full(q.shape, 7.0)
    calls: list[list[tuple[int, torch.Tensor]]] = []
    for first, n, keys, s in zip(
        first_rows.tolist(), num_queries.tolist(), lengths.tolist(), slots, strict=True
    ):
        rows = []
        for x in range(n):
            last = keys - n + x  # the query's own key: it sees keys [lo, last]
            lo = max(0, last - window + 1) if window else 0
            rows.append((first + x, s[lo : last + 1]))
        calls.append(rows)
    if not per_request:
        calls = [[row for rows in calls for row in rows]]
    for rows in calls:
        width = max(len(keys) for _, keys in rows)
        row_slots = torch.stack([torch.cat([keys, keys.new_zeros(width - len(keys))]) for _, keys in rows])
        row_lengths = torch.tensor([len(keys) for _, keys in rows])
        packed_rows = torch.tensor([row for row, _ in rows])
        module.paged_decode(q, out, packed_rows, k_cache, v_cache, row_slots, row_lengths, d**-0.5, softcap)  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize("pool_type", POOL_TYPES)
@pytest.mark.parametrize(("softcap", "window"), [(0.0, 0), (20.0, 0), (0.0, 13), (0.0, 40), (20.0, 21)])
@pytest.mark.parametrize(
    ("kv", "group", "d"),
    [
        (3, 3, 64),  # SmolLM2's shape
        (2, 2, 16),
        (1, 5, 128),  # five queries exceed one register pass of the decode kernel
        (4, 1, 32),
        (2, 2, 48),
        (1, 9, 64),  # more query heads per kv head than the decode kernel's registers take at once
    ],
)
def test_prefill_rows_are_decode_rows(
    kv: int, group: int, d: int, softcap: float, window: int, pool_type: str
) -> None:
    module = attention_module()
    if not module.prefill_supports(d):
        pytest.skip(f"no prefill kernel for head size {d} on the {module.isa()} path")
    k_cache, v_cache, args = prefill_batch(kv, group, d, window, torch.float32)
    k_cache, v_cache = as_pool(k_cache, pool_type), as_pool(v_cache, pool_type)
    q, first_rows, num_queries, slots, lengths = args
    prefilled = torch.full(q.shape, 7.0)
    module.paged_prefill(
        q, prefilled, k_cache, v_cache, first_rows, num_queries, slots, lengths, d**-0.5, softcap, window
    )
    for per_request in (False, True):
        decoded = decode_rows(module, q, k_cache, v_cache, args, window, softcap, per_request)
        assert torch.equal(prefilled, decoded), (prefilled - decoded).abs().max()  # rows 0-1: 7.0 in both


# Every test above, again on each vector path below this CPU's best: AVX2 and the portable loops (whose
# prefill runs each row as the decode kernel's task), and AVX-512 held below AVX512-BF16 where the CPU
# has it (a build of its own, left to the slow run).
@pytest.mark.parametrize(
    "path",
    [
        "avx2",
        pytest.param("portable", marks=pytest.mark.slow),
        pytest.param("avx512", marks=pytest.mark.slow),
    ],
)
def test_lower_path_agrees(path: str) -> None:
    if path != "avx512":
        rerun_on_lower_path(Path(__file__), path)
        return
    if not {"avx512f", "avx512_bf16"} <= cpu_flags():
        pytest.skip("no AVX512-BF16 here: AVX-512 is this CPU's best path, the tests above ran it")
    run_on_path(Path(__file__), path)
