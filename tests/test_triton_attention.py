"""The Triton paged attention kernels (services/worker/triton_attention.py) against plain torch attention
in float64: decode (split-K) and varlen prefill, GQA and MHA, padded and poisoned slots, softcap,
window, float32 and 16-bit pools; and their compilation for sm_90 (H100/H200), without spills.

Without a CUDA device they run under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by
tests/conftest.py before anything imports triton, unless the environment says otherwise), on small
shapes: the interpreter runs each program in numpy, and the file takes about 35 s on two cores. With a
device (`pytest tests/test_triton_attention.py` there, or `-m cuda` for the capture test alone) the same
tests run the compiled kernels on it, and the graph-capture test runs too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.attention_cases import causal_reference, decode_batch, gather_sdpa, prefill_batch
from tests.cuda_marks import cuda_only
from tests.stack import REPO

pytest.importorskip("triton", reason="the Triton kernels need triton (xgrammar brings it on Linux x86-64)")

from services.worker import triton_attention
from tests.triton_sm90 import CUOBJDUMP, Launches, sm90_stack_bytes

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
# A mark, not a module-level skip: the sm_90 compile test's child process imports this module with the
# interpreter off and no device.
pytestmark = pytest.mark.skipif(
    not INTERPRETING and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET=0 compiles the kernels, which needs a CUDA device",
)
DEVICE = torch.device("cpu" if INTERPRETING else "cuda")

# Unit roundoff of each 16-bit format: round-to-nearest puts a value within u of itself, relatively.
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# float32 throughout: the dots, exponents and sums round in the 7th digit.
FP32_TOLERANCE = 1e-5
SENTINEL = 7.0  # what `out` holds before a call, in rows a kernel must leave alone


def assert_attention_close(got: torch.Tensor, ref: torch.Tensor, ref_abs_v: torch.Tensor) -> None:
    """`got` (the kernel's rows, any dtype) against the float64 reference `ref`, from the same q, K and V
    values. `ref_abs_v` is the same attention over |V|: the sum of each output's |p_j v_j|.

    float32 output: within FP32_TOLERANCE. 16-bit output, whose dots take 16-bit operands: the
    probabilities are rounded to the format before P @ V (each within u of itself, so the output moves
    by at most u * sum p_j |v_j| = u * ref_abs_v), and the output is rounded into the format on store
    (within u |o| on a GPU; the interpreter truncates float32 to bfloat16: under 2u |o|)."""
    got64 = got.double().cpu()
    if got.dtype == torch.float32:
        torch.testing.assert_close(got64, ref, atol=FP32_TOLERANCE, rtol=FP32_TOLERANCE)
        return
    u = UNIT_ROUNDOFF[got.dtype]
    bound = u * ref_abs_v + 2 * u * ref.abs() + FP32_TOLERANCE
    excess = (got64 - ref).abs() - bound
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"{got.dtype} output off by {(got64 - ref).abs().flatten()[worst]:.3g} at flat index {worst}, "
        f"over its bound {bound.flatten()[worst]:.3g}"
    )


# ------------------------------------------------------------------------------------------ decode


def decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention, attention over |V|) of each request's row, `[B, H, D]` in float64 on the CPU."""
    batch, (heads, dim), kv = rows.numel(), q.shape[1:], k_cache.shape[1]
    qg = q.cpu()[rows.cpu()].double().view(batch, kv, heads // kv, dim)
    k, v = k_cache.cpu().double(), v_cache.cpu().double()
    args = (slots.cpu(), lengths.cpu(), scale, softcap)
    ref = gather_sdpa(qg, k, v, *args).reshape(batch, heads, dim)
    ref_abs_v = gather_sdpa(qg, k, v.abs(), *args).reshape(batch, heads, dim)
    return ref, ref_abs_v


def run_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    rows: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    softcap: float,
    **blocks: int,
) -> torch.Tensor:
    """The kernel's output rows `[B, H, D]`, after checking that it left every other row alone."""
    out = torch.full_like(q, SENTINEL)
    triton_attention.decode(q, out, rows, k_cache, v_cache, slots, lengths, scale, softcap, **blocks)
    others = torch.ones(q.shape[0], dtype=torch.bool, device=q.device)
    others[rows] = False
    assert (out[others] == SENTINEL).all(), "decode wrote rows that are not its requests'"
    return out[rows]


def on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in tensors]


# (kv heads, query heads per kv head, head size, requests, padded context): MHA and GQA, head sizes
# 16/32/64 and 80 (a power-of-two tile, masked), contexts over several 16-key splits, and a group
# wider than 16 rows and not a power of two (Falcon-7B's 71 heads on one kv head, in small).
DECODE_CASES = [
    (2, 2, 16, 3, 70),
    (1, 4, 32, 2, 50),
    (3, 1, 64, 2, 40),
    (2, 3, 80, 3, 70),
    (1, 17, 16, 2, 40),
]
SMALL_SPLITS = {"keys_per_split": 16, "block_keys": 16}


@pytest.mark.parametrize(("kv", "group", "dim", "batch", "width"), DECODE_CASES)
@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_decode_matches_reference(
    kv: int, group: int, dim: int, batch: int, width: int, softcap: float
) -> None:
    k, v, q, rows, slots, lengths = on_device(*decode_batch(kv, group, dim, batch, width, 300, seed=dim))
    scale = dim**-0.5
    got = run_decode(q, k, v, rows, slots, lengths, scale, softcap, **SMALL_SPLITS)
    assert_attention_close(got, *decode_reference(q, k, v, rows, slots, lengths, scale, softcap))


def test_decode_splits_of_several_key_blocks() -> None:
    """Two splits of 48 keys over a 70-key context: several key blocks per split, a short last one."""
    k, v, q, rows, slots, lengths = on_device(*decode_batch(2, 2, 32, 3, 70, 300, seed=5))
    lengths[0] = 70  # one request fills the padded width
    got = run_decode(q, k, v, rows, slots, lengths, 0.2, 0.0, keys_per_split=16, max_splits=2, block_keys=16)
    assert_attention_close(got, *decode_reference(q, k, v, rows, slots, lengths, 0.2, 0.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_16_bit_pools(dtype: torch.dtype) -> None:
    k, v, q, rows, slots, lengths = decode_batch(2, 4, 64, 3, 70, 300, seed=11)
    k, v, q, rows, slots, lengths = on_device(k.to(dtype), v.to(dtype), q.to(dtype), rows, slots, lengths)
    got = run_decode(q, k, v, rows, slots, lengths, 0.125, 0.0, **SMALL_SPLITS)
    assert got.dtype == dtype
    assert_attention_close(got, *decode_reference(q, k, v, rows, slots, lengths, 0.125, 0.0))


def test_decode_float32_queries_over_a_bfloat16_pool() -> None:
    """The CPU path's mix (float32 model, bfloat16 pool): the K/V rows widen exactly, float32 bounds.
    At the default blocks: one split, whose merge only normalises."""
    k, v, q, rows, slots, lengths = decode_batch(1, 2, 32, 2, 50, 300, seed=12)
    k, v, q, rows, slots, lengths = on_device(k.bfloat16(), v.bfloat16(), q, rows, slots, lengths)
    got = run_decode(q, k, v, rows, slots, lengths, 0.2, 0.0)
    assert_attention_close(got, *decode_reference(q, k, v, rows, slots, lengths, 0.2, 0.0))


def test_decode_never_reads_slots_past_a_requests_length() -> None:
    """Padding slots point at a row of NaN: a kernel that read it, even to weigh it by 0, would show it.
    (The reference, which gathers the padding too, reads the clean slots.)"""
    k, v, q, rows, slots, lengths = on_device(*decode_batch(2, 2, 16, 3, 70, 300, seed=13))
    ref = decode_reference(q, k, v, rows, slots, lengths, 0.25, 0.0)
    nan_row = torch.full_like(k[:1], float("nan"))
    k, v = torch.cat([k, nan_row]), torch.cat([v, nan_row])
    padding = torch.arange(70, device=DEVICE)[None, :] >= lengths[:, None]
    assert padding.any()
    poisoned = slots.masked_fill(padding, k.shape[0] - 1)
    assert_attention_close(run_decode(q, k, v, rows, poisoned, lengths, 0.25, 0.0, **SMALL_SPLITS), *ref)


def test_decode_results_follow_the_slots() -> None:
    """The check can fail: every key read one slot further on gives other outputs, far past the bound."""
    k, v, q, rows, slots, lengths = on_device(*decode_batch(2, 2, 32, 3, 70, 300, seed=14))
    ref, _ = decode_reference(q, k, v, rows, slots, lengths, 0.2, 0.0)
    shifted = run_decode(q, k, v, rows, (slots + 1) % k.shape[0], lengths, 0.2, 0.0, **SMALL_SPLITS)
    assert ((shifted.double().cpu() - ref).abs().amax(dim=(1, 2)) > 100 * FP32_TOLERANCE).all()


def test_decode_request_without_keys_gets_zeros() -> None:
    """lengths[b] == 0 (a row padding a captured batch): zeros, not NaN, and the others unchanged."""
    k, v, q, rows, slots, lengths = on_device(*decode_batch(1, 2, 16, 3, 40, 300, seed=15))
    lengths[1] = 0
    got = run_decode(q, k, v, rows, slots, lengths, 0.25, 0.0, **SMALL_SPLITS)
    assert (got[1] == 0).all()
    kept = torch.tensor([0, 2], device=DEVICE)
    ref = decode_reference(q, k, v, rows[kept], slots[kept], lengths[kept], 0.25, 0.0)
    assert_attention_close(got[kept], *ref)


@pytest.mark.parametrize(("kv", "group", "dim"), [(1, 8, 128), (2, 2, 96)])
def test_decode_default_blocks_long_context(kv: int, group: int, dim: int) -> None:
    """Eight query heads a kv head (Llama-3-70B's) of 128 dims, and a 96-dim head, at the default blocks
    over 600 keys (3 splits)."""
    k, v, q, rows, slots, lengths = on_device(*decode_batch(kv, group, dim, 2, 600, 2000, seed=16))
    got = run_decode(q, k, v, rows, slots, lengths, dim**-0.5, 0.0)
    assert_attention_close(got, *decode_reference(q, k, v, rows, slots, lengths, dim**-0.5, 0.0))


# ----------------------------------------------------------------------------------------- prefill


def prefill_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    first_rows: torch.Tensor,
    num_queries: torch.Tensor,
    slots: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    softcap: float,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the chunks' packed rows, attention, attention over |V|) in float64 on the CPU."""
    k, v, q64 = k_cache.cpu().double(), v_cache.cpu().double(), q.cpu().double()
    rows, refs, abs_refs = [], [], []
    for first, n, keys, length in zip(
        first_rows.tolist(), num_queries.tolist(), slots.cpu(), lengths.tolist(), strict=True
    ):
        chunk = keys[:length]
        rows.append(torch.arange(first, first + n))
        refs.append(causal_reference(q64[first : first + n], k[chunk], v[chunk], scale, softcap, window))
        abs_refs.append(
            causal_reference(q64[first : first + n], k[chunk], v[chunk].abs(), scale, softcap, window)
        )
    return torch.cat(rows), torch.cat(refs), torch.cat(abs_refs)


def check_prefill(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    args: list[torch.Tensor],
    scale: float,
    softcap: float,
    window: int,
    **blocks: int,
) -> None:
    """Runs the kernel on prefill_batch's arguments and holds it to the reference; rows outside the
    chunks (rows 0-1) must keep the sentinel."""
    q, first_rows, num_queries, slots, lengths = args
    out = torch.full_like(q, SENTINEL)
    triton_attention.prefill(
        q, out, k_cache, v_cache, first_rows, num_queries, slots, lengths, scale, softcap, window, **blocks
    )
    rows, ref, ref_abs_v = prefill_reference(
        q, k_cache, v_cache, first_rows, num_queries, slots, lengths, scale, softcap, window
    )
    assert (out[:2] == SENTINEL).all(), "prefill wrote rows outside its chunks"
    assert_attention_close(out[rows.to(DEVICE)], ref, ref_abs_v)


# prefill_batch's chunks: 37 tokens alone, 16 after 20 in the pool, a lone token after 9, 17 after 64
# and 5 alone; the longest bounds the grid (max_queries).
SMALL_TILES = {"max_queries": 37, "block_rows": 16, "block_keys": 16}


@pytest.mark.parametrize(
    ("kv", "group", "dim", "window", "softcap"),
    [
        (2, 2, 16, 0, 0.0),
        (1, 4, 32, 0, 5.0),
        (3, 1, 64, 5, 0.0),
        (2, 3, 80, 7, 0.0),
        (1, 2, 32, 20, 5.0),
        (1, 17, 16, 0, 0.0),  # a 32-row group: one query token a block
    ],
)
def test_prefill_matches_reference(kv: int, group: int, dim: int, window: int, softcap: float) -> None:
    k, v, args = prefill_batch(kv, group, dim, window, torch.float32)
    check_prefill(*on_device(k, v), on_device(*args), dim**-0.5, softcap, window, **SMALL_TILES)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_16_bit_pools(dtype: torch.dtype) -> None:
    k, v, args = prefill_batch(2, 2, 32, 0, dtype)
    args[0] = args[0].to(dtype)
    check_prefill(*on_device(k, v), on_device(*args), 32**-0.5, 0.0, 0, **SMALL_TILES)


def test_prefill_grid_from_the_packed_tokens() -> None:
    """max_queries left out: the grid covers all T packed tokens, the blocks past each chunk idle."""
    k, v, args = prefill_batch(1, 1, 16, 0, torch.float32)
    check_prefill(*on_device(k, v), on_device(*args), 0.25, 0.0, 0, block_rows=16, block_keys=16)


def test_prefill_results_follow_the_slots() -> None:
    """The check can fail: the chunks' keys read one slot further on give other outputs."""
    k, v, args = prefill_batch(1, 2, 16, 0, torch.float32)
    k, v, (q, first_rows, num_queries, slots, lengths) = *on_device(k, v), on_device(*args)
    rows, ref, _ = prefill_reference(q, k, v, first_rows, num_queries, slots, lengths, 0.25, 0.0, 0)
    out = torch.zeros_like(q)
    shifted = (slots + 1) % k.shape[0]
    triton_attention.prefill(
        q, out, k, v, first_rows, num_queries, shifted, lengths, 0.25, 0.0, 0, **SMALL_TILES
    )
    moved = (out.cpu()[rows].double() - ref).abs().amax(dim=(1, 2))
    assert (moved > 100 * FP32_TOLERANCE).all()


def test_prefill_default_blocks_large_group() -> None:
    """Eight query heads a kv head of 128 dims at the default tiles (8 tokens x 8 heads a block)."""
    k, v, args = prefill_batch(1, 8, 128, 0, torch.float32)
    check_prefill(*on_device(k, v), on_device(*args), 128**-0.5, 0.0, 0, max_queries=37)


# -------------------------------------------------------------------------------------- arguments


def test_wrong_arguments_name_the_offending_value() -> None:
    q = torch.zeros(4, 4, 16)
    pool = torch.zeros(10, 2, 16)
    index = torch.zeros(2, dtype=torch.int64)
    slots = torch.zeros(2, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"torch\.int8"):
        triton_attention.decode(
            q, q.clone(), index, pool.to(torch.int8), pool.to(torch.int8), slots, index, 1.0, 0.0
        )
    with pytest.raises(ValueError, match="4 query heads do not share 3 kv heads"):
        triton_attention.decode(
            q,
            q.clone(),
            index,
            pool[:, :1].expand(10, 3, 16),
            pool[:, :1].expand(10, 3, 16),
            slots,
            index,
            1.0,
            0.0,
        )
    with pytest.raises(ValueError, match=r"lengths must be \[2\], got \(3,\)"):
        triton_attention.decode(q, q.clone(), index, pool, pool, slots, index.repeat(2)[:3], 1.0, 0.0)
    with pytest.raises(ValueError, match=r"lengths must hold integers, got torch\.float32"):
        triton_attention.decode(q, q.clone(), index, pool, pool, slots, index.float(), 1.0, 0.0)
    with pytest.raises(ValueError, match=r"window must be 0 .* got -1"):
        triton_attention.prefill(q, q.clone(), pool, pool, index, index, slots, index, 1.0, 0.0, -1)
    wide = torch.zeros(1, 1, 512)
    with pytest.raises(ValueError, match="head size 512"):
        triton_attention.prefill(
            wide, wide.clone(), wide, wide, index[:1], index[:1], slots[:1], index[:1], 1.0, 0.0, 0
        )


# ---------------------------------------------------------------- compiled for an H100/H200, without one

KERNELS = ("_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel")
# (pool and query dtype, query heads a kv head, head size, softcap, window): Llama-3-8B's group and head
# in bfloat16; softcap, window and a masked 80-dim head in float16; the float32 parity path.
SM90_CASES = [("bfloat16", 4, 128, 0.0, 0), ("float16", 2, 80, 30.0, 16), ("float32", 8, 128, 0.0, 0)]


def compile_launches_for_sm90(work: str) -> None:
    """The child process of the sm_90 compile test (TRITON_INTERPRET=0: the kernels, and triton's own
    library, must be defined for the compiler, which an interpreting process cannot undo). Runs the
    wrappers at their defaults with their kernels swapped for recorders, compiles every recorded launch
    and prints, as JSON, each case's kernels' stack bytes."""
    kernels = {name: getattr(triton_attention, name) for name in KERNELS}
    stacks = []
    for dtype_name, group, dim, softcap, window in SM90_CASES:
        launches = {name: Launches() for name in KERNELS}
        for name, recorder in launches.items():
            setattr(triton_attention, name, recorder)  # the module's globals: what its wrappers launch
        dtype, kv = getattr(torch, dtype_name), 2
        q, pool = torch.zeros(6, kv * group, dim, dtype=dtype), torch.zeros(40, kv, dim, dtype=dtype)
        index, slots = torch.zeros(2, dtype=torch.int64), torch.zeros(2, 600, dtype=torch.int64)
        triton_attention.decode(q, q.clone(), index, pool, pool, slots, index, 0.1, softcap)
        triton_attention.prefill(q, q.clone(), pool, pool, index, index, slots, index, 0.1, softcap, window)
        case = {}
        for name, recorder in launches.items():
            ((args, kwargs),) = recorder.calls
            case[name] = sm90_stack_bytes(kernels[name], name, args, kwargs, Path(work))
        stacks.append(case)
    print(json.dumps(stacks))


def test_kernels_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    """What the interpreter never does: the kernels, as the wrappers launch them at their defaults, go
    through Triton's compiler and ptxas for an H100/H200 (SM90_CASES), and no thread needs a stack,
    i.e. no registers spill."""
    if not CUOBJDUMP.exists():
        pytest.skip(f"triton ships no cuobjdump here ({CUOBJDUMP})")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    code = (
        "import sys; from tests.test_triton_attention import compile_launches_for_sm90 as c; c(sys.argv[1])"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    stacks = json.loads(run.stdout.splitlines()[-1])
    assert stacks == [dict.fromkeys(KERNELS, 0)] * len(SM90_CASES), list(zip(SM90_CASES, stacks, strict=True))


# ---------------------------------------------------------------------------------- graph capture


@cuda_only
@pytest.mark.skipif(INTERPRETING, reason="graph capture needs the compiled kernels (TRITON_INTERPRET=0)")
def test_kernels_replay_in_a_cuda_graph_with_new_metadata() -> None:
    """Captured once, replayed after the lengths, slots and rows change in place: the outputs follow the
    new values, so nothing the kernels read was fixed on the host at capture."""
    k, v, q, rows, slots, lengths = on_device(*decode_batch(2, 4, 64, 3, 70, 300, seed=21))
    pk, pv, args = prefill_batch(2, 4, 64, 7, torch.float32)
    pk, pv, args = *on_device(pk, pv), on_device(*args)
    dec_out, pre_out = torch.zeros_like(q), torch.zeros_like(args[0])

    def step() -> None:
        triton_attention.decode(q, dec_out, rows, k, v, slots, lengths, 0.125, 0.0)
        triton_attention.prefill(args[0], pre_out, pk, pv, *args[1:], 0.125, 0.0, 7, max_queries=37)

    step()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    lengths.copy_(torch.tensor([70, 1, 33], device=DEVICE))
    slots.copy_(torch.randint(0, 300, slots.shape, device=DEVICE))
    rows.copy_(rows.flip(0))
    args[4].sub_(torch.tensor([0, 1, 0, 2, 0], device=DEVICE))  # shorter prefixes, same chunks
    graph.replay()
    torch.cuda.synchronize()
    assert_attention_close(dec_out[rows], *decode_reference(q, k, v, rows, slots, lengths, 0.125, 0.0))
    pre_rows, ref, ref_abs_v = prefill_reference(args[0], pk, pv, *args[1:], 0.125, 0.0, 7)
    assert_attention_close(pre_out[pre_rows.to(DEVICE)], ref, ref_abs_v)
