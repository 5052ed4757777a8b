"""What the paged attention kernel tests share: the batches they feed the kernels (decode, prefill, the
fused rotary writer's), the plain torch attention they are compared with, and the vector paths (which
one a build here has, and a child run of a test file on a lower one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from services.worker import kernels
from tests.stack import REPO

# The vector paths, lowest first, as the module's isa() names them.
PATHS = ("portable", "avx2", "avx512")

# test_attention.py's decode grid, and contexts long enough that the prefetch runs far past its first
# distance ahead (16 and 48: rows of a head that are half a cache line, and one and a half, in bfloat16).
DECODE_SHAPES = [
    (2, 2, 16, 7, 45),
    (3, 3, 64, 7, 45),  # SmolLM2's shape
    (1, 4, 32, 7, 45),
    (1, 5, 128, 2, 45),  # few requests: one task per head; five queries exceed one register pass
    (2, 3, 24, 1, 45),  # a head size off the vector path
    (4, 1, 80, 9, 45),
    (1, 71, 64, 3, 45),  # Falcon-7B's multi-query shape: more query heads per kv head than registers
    (1, 2, 16, 3, 900),
    (3, 1, 48, 6, 700),
]


def gather_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """The fallback's math written out plainly (gathered copy, explicit softcap and mask)."""
    b, kv, _, d = q.shape
    length = slots.shape[1]
    k = k_cache[slots.reshape(-1)].view(b, length, kv, d).transpose(1, 2)
    v = v_cache[slots.reshape(-1)].view(b, length, kv, d).transpose(1, 2)
    keep = torch.arange(length)[None, :] < lengths[:, None]
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), v)


def causal_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    softcap: float,
    window: int,
) -> torch.Tensor:
    """One request's chunk, plainly: `q [n, H, D]` are the last n of the `k`/`v [L, kv, D]` positions."""
    n, heads, _ = q.shape
    length, group = k.shape[0], heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1).transpose(0, 1), v.repeat_interleave(group, 1).transpose(0, 1)
    scores = torch.matmul(q.transpose(0, 1), k.transpose(-1, -2)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    query_pos = torch.arange(length - n, length)[:, None]
    key_pos = torch.arange(length)[None, :]
    seen = key_pos <= query_pos
    if window:
        seen &= key_pos > query_pos - window
    scores = scores.masked_fill(~seen, float("-inf"))
    return torch.matmul(torch.softmax(scores, -1), v).transpose(0, 1)


def decode_batch(
    kv: int, group: int, d: int, b: int, length: int, num_slots: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode batch over float32 pools of `num_slots` slots: (k_cache, v_cache, packed, rows, slots,
    lengths). `b` requests read up to `length` keys each from random slots; their query rows are `rows`
    of the packed batch `[b + 3, kv * group, d]`, among three others, its tokens wider than their heads."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_slots, kv, d, generator=gen)
    v_cache = torch.randn(num_slots, kv, d, generator=gen)
    slots = torch.randint(0, num_slots, (b, length), generator=gen)
    lengths = torch.randint(1, length + 1, (b,), generator=gen)
    width = kv * group * d
    packed = torch.randn(b + 3, width + 8, generator=gen)[:, :width].view(b + 3, kv * group, d)
    rows = torch.randperm(b + 3, generator=gen)[:b]
    return k_cache, v_cache, packed, rows, slots, lengths


def prefill_batch(
    kv: int, group: int, d: int, window: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """A prefill batch over pools of `dtype`: (k_cache, v_cache, the kernel's arguments after out:
    q, first_rows, num_queries, slots, lengths). Chunks cross the 16-token query blocks, after earlier
    context or not, and one is a lone token; rows 0-1 are someone else's (a kernel leaves them alone)."""
    gen = torch.Generator().manual_seed(d + window)
    heads, num_slots = kv * group, 600
    k_cache = torch.randn(num_slots, kv, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_slots, kv, d, generator=gen).to(dtype)
    chunks = [(37, 0), (16, 20), (1, 9), (17, 64), (5, 0)]
    first_rows, lengths, slot_rows, row = [], [], [], 2
    for n, context in chunks:
        keys = context + n if not window else min(context + n, n + window - 1)
        first_rows.append(row)
        lengths.append(keys)
        slot_rows.append(torch.randperm(num_slots, generator=gen)[:keys])
        row += n
    width = max(lengths)
    slots = torch.stack([F.pad(s, (0, width - len(s)), value=0) for s in slot_rows])
    qkv = torch.randn(row, heads * d + 40, generator=gen)
    q = qkv[:, : heads * d].view(row, heads, d)  # strided rows, as in the fused forward
    num_queries = torch.tensor([n for n, _ in chunks])
    return k_cache, v_cache, [q, torch.tensor(first_rows), num_queries, slots, torch.tensor(lengths)]


def rotary_batch(
    t: int, heads: int, kv_heads: int, d: int, seed: int, num_slots: int = 40
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused rotary writer's inputs for `t` tokens: (qkv [t, (heads + 2 kv_heads) d], cos and sin
    tables of 50 positions, each token's position, each token's slot among `num_slots`)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d, generator=gen)
    table = torch.randn(50, d // 2, generator=gen)
    cos, sin = torch.cat([table.cos()] * 2, -1), torch.cat([table.sin()] * 2, -1)
    positions = torch.randint(0, 50, (t,), generator=gen)
    slots = torch.randperm(num_slots, generator=gen)[:t]
    return qkv, cos, sin, positions, slots


def expected_path() -> str:
    """The path a build here has: this CPU's best, or the lower one CBSERVE_CPU_ISA holds it to."""
    with open("/proc/cpuinfo") as f:
        flags = set(next((line for line in f if line.startswith("flags")), "").split())
    best = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= flags else "portable"
    held = kernels.isa()
    return best if held == "native" else min(best, held, key=PATHS.index)


def rerun_on_lower_path(test_file: Path, path: str) -> None:
    """`test_file`'s tests, but those named `lower_path`, in a child run built for `path`."""
    if os.environ.get(kernels.ISA_SWITCH, "native") != "native":
        pytest.skip(f"this run is the {os.environ[kernels.ISA_SWITCH]} path's")
    if PATHS.index(path) >= PATHS.index(expected_path()):
        pytest.skip(f"{path} is this CPU's best path: the tests above ran it")
    run_on_path(test_file, path)


def run_on_path(test_file: Path, path: str) -> None:
    """rerun_on_lower_path's child run, for a `path` that names this CPU's best but is a build of its
    own (AVX-512 held below AVX512-BF16)."""
    env = {**os.environ, kernels.ISA_SWITCH: path}
    tests = str(test_file.relative_to(REPO))
    child = [sys.executable, "-m", "pytest", tests, "-q", "-x", "-k", "not lower_path"]
    run = subprocess.run(child, env=env, cwd=REPO, capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1] and " failed" not in run.stdout.splitlines()[-1]
