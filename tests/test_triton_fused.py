"""The Triton element-wise passes (services/worker/triton_fused.py) against plain torch in float64 and,
in float32, against the native CPU passes (csrc/fused_ops.cpp) they stand in for: RMSNorm, add-and-norm
with the residual updated in place, rotary with the K/V writes into the pool, SiLU-times-up. Odd token
counts, widths that are not powers of two (SmolLM2-135M's 576, SmolLM2-360M's 960), MHA and GQA,
head sizes 64/80/128, scattered positions and slots, padded tokens on the padding slot, float32 and
16-bit activations and pools; and their compilation for sm_90 (H100/H200), without spills.

Without a CUDA device they run under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by
tests/conftest.py before anything imports triton, unless the environment says otherwise), on small
shapes: about 8 s on two cores, the sm_90 compile included. With a device (`pytest
tests/test_triton_fused.py` there, or `-m cuda` for the capture test alone) the same tests run the
compiled kernels on it, and the graph-capture test runs too.

Bounds, with u32 = 2^-24 float32's unit roundoff and u the 16-bit formats' (every input is exact in
float32, so the float64 reference sees the kernel's own inputs):
- a norm of width h: the sum of squares in any order is within (h - 1) u32 of itself relatively (its
  terms are non-negative), each square adds u32, the mean, +eps, sqrt, reciprocal and the two products
  a few more, and sqrt halves its input's error: within (h / 2 + 5) u32 |y|;
- a rotary output x1 c - x2 s: two products and a sum, within 2 u32 (|x1 c| + |x2 s|);
- silu(g) * up: e^-g within (|g| + 4) u32 (the exponent's argument is scaled by log2(e), rounding it
  by |g| u32, and a GPU's exp2 is approximate to 2 ulps), 1 + e one more, a GPU's division (div.full)
  2 ulps, the product one: within (|g| + 10) u32 |y|;
- a 16-bit output adds its rounding: u |y| on a GPU, under 2u |y| in the interpreter, which truncates
  float32 to bfloat16 on store; 2u here, plus, below the format's smallest normal, one spacing of its
  subnormals (float16's 2^-24);
- the native CPU pass is held to the same bound from the float64 reference, so the two agree within
  twice it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cuda_marks import cuda_only

pytest.importorskip("triton", reason="the Triton kernels need triton (xgrammar brings it on Linux x86-64)")

from services.common.kv_geometry import PADDING_SLOT
from services.worker import triton_fused
from services.worker.kernels import fused_ops
from services.worker.triton_fused import TritonFusedOps
from tests.stack import REPO
from tests.triton_sm90 import CUOBJDUMP, Launches, sm90_stack_bytes

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
pytestmark = pytest.mark.skipif(
    not INTERPRETING and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET=0 compiles the kernels, which needs a CUDA device",
)
DEVICE = torch.device("cpu" if INTERPRETING else "cuda")

U32 = 2.0**-24
# Unit roundoff of each 16-bit format: round-to-nearest puts a value within u of itself, relatively.
UNIT_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}
# Below the smallest normal the spacing is fixed: a value rounds within it (float16's matters: its
# subnormals start under 6.1e-5, where small weights put some outputs).
SUBNORMAL_SPACING = {torch.float32: 0.0, torch.bfloat16: 2.0**-133, torch.float16: 2.0**-24}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-5
SENTINEL = 7.0  # what the pool holds before a call, in slots no token writes
OPS = TritonFusedOps()


def native() -> Any:
    ops = fused_ops()
    if ops is None:
        pytest.skip("the native CPU passes are not built here")
    return ops


def assert_within(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """Every |got - ref| within its `bound` (float64, the reference's shape)."""
    excess = (got.double().cpu() - ref).abs() - bound
    worst = int(excess.argmax())
    assert excess.max() <= 0, (
        f"{what} ({got.dtype}) off by {(got.double().cpu() - ref).abs().flatten()[worst]:.3g} at flat index "
        f"{worst}, over its bound {bound.flatten()[worst]:.3g}"
    )


def rounding(dtype: torch.dtype, ref: torch.Tensor) -> torch.Tensor:
    """A 16-bit output's rounding on store, 2u |y| plus a subnormal spacing (see the top); nothing for
    float32."""
    return 2 * UNIT_ROUNDOFF[dtype] * ref.abs() + SUBNORMAL_SPACING[dtype]


def rows_of(tokens: int, width: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Random rows on DEVICE, with a row stride wider than the rows (a slice of wider ones, as the
    GPU path's views of a packed projection are)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(tokens, width + 8, generator=g) * scale
    return wide.to(DEVICE, dtype)[:, :width]


# --------------------------------------------------------------------------------------------- norms


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    x64 = x.double().cpu()
    return weight.double().cpu() * x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + EPS)


def norm_bound(ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (ref.shape[-1] / 2 + 5) * U32 * ref.abs() + rounding(dtype, ref)


@pytest.mark.parametrize("width", [576, 960, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(width: int, dtype: torch.dtype) -> None:
    x, weight = rows_of(5, width, dtype, seed=width), rows_of(1, width, dtype, seed=1)[0].contiguous()
    got = OPS.rms_norm(x, weight, EPS)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    ref = rms_norm_reference(x, weight)
    assert_within(got, ref, norm_bound(ref, dtype), "rms_norm")
    if dtype == torch.float32 and INTERPRETING:  # the native pass takes CPU tensors
        want = native().rms_norm(x, weight, EPS)
        assert_within(got, want.double(), 2 * norm_bound(ref, dtype), "rms_norm against the native pass")


@pytest.mark.parametrize("width", [576, 960])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_in_place(width: int, dtype: torch.dtype) -> None:
    x, weight = rows_of(7, width, dtype, seed=width), rows_of(1, width, dtype, seed=2)[0].contiguous()
    residual = rows_of(7, width, dtype, seed=3, scale=4.0).contiguous()
    before, storage = residual.clone(), residual.data_ptr()
    got = OPS.add_rms_norm(x, residual, weight, EPS)
    assert residual.data_ptr() == storage and got.data_ptr() != storage
    added = before.double().cpu() + x.double().cpu()
    # One addition of exact inputs, rounded once to float32 (and once more to a 16-bit residual).
    assert_within(residual, added, U32 * added.abs() + rounding(dtype, added), "the residual")
    # The result normalises the residual as stored (rounded), whatever its dtype.
    ref = rms_norm_reference(residual, weight)
    assert_within(got, ref, norm_bound(ref, dtype), "add_rms_norm")
    if dtype == torch.float32 and INTERPRETING:
        cpu_residual = before.clone()
        want = native().add_rms_norm(x, cpu_residual, weight, EPS)
        assert torch.equal(residual, cpu_residual)  # both round the same exact sum once
        assert_within(got, want.double(), 2 * norm_bound(ref, dtype), "add_rms_norm against the native pass")


# ------------------------------------------------------------------------------------ rotary + K/V


def rotary_tables(positions: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random cos/sin rows, float32: unlike a real table's, each row's two halves differ, so a kernel
    that read one half's cos/sin for both halves would show it."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(positions, head_dim, generator=g), torch.randn(positions, head_dim, generator=g)


def rotary_reference(
    qkv: torch.Tensor,
    rotated_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(qkv after the rotary, the sum of its terms' magnitudes) in float64: transformers' rotate-half,
    x cos + rotate_half(x) sin with rotate_half(x) = cat(-x2, x1), on the first `rotated_heads` heads."""
    tokens, half = qkv.shape[0], head_dim // 2
    x = qkv.double().cpu().view(tokens, -1, head_dim)
    c = cos.double().cpu()[positions.cpu()][:, None, :]
    s = sin.double().cpu()[positions.cpu()][:, None, :]
    heads = x[:, :rotated_heads]
    swapped = torch.cat([-heads[..., half:], heads[..., :half]], dim=-1)
    out, magnitude = x.clone(), torch.zeros_like(x)
    out[:, :rotated_heads] = heads * c + swapped * s
    magnitude[:, :rotated_heads] = (heads * c).abs() + (swapped * s).abs()
    return out.view(tokens, -1), magnitude.view(tokens, -1)


# Seven tokens at scattered positions (a decode row, a prompt chunk's, positions out of order); the
# last two are padding: position 0, PADDING_SLOT, as the batch builder pads a step.
POSITIONS = [17, 3, 40, 41, 9, 0, 0]
SLOTS = [5, 12, 30, 31, 2, PADDING_SLOT, PADDING_SLOT]
NUM_SLOTS = 33
# (query heads, kv heads, head size): SmolLM2-135M's 9/3 x 64, MHA x 128, Llama-3's group of 4 x 128,
# and a size whose half is not a power of two (80: masked half-head columns).
HEADS = [(9, 3, 64), (4, 4, 128), (8, 2, 128), (2, 1, 80)]


def run_rotary(
    heads: tuple[int, int, int], qkv_dtype: torch.dtype, pool_dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """(qkv before, qkv after, k pool, v pool, (cos, sin, positions, slots)) of one call on DEVICE."""
    num_heads, kv_heads, dim = heads
    qkv = rows_of(len(POSITIONS), (num_heads + 2 * kv_heads) * dim, qkv_dtype, seed=seed)
    before = qkv.clone()
    cos, sin = rotary_tables(64, dim, seed=seed + 1)
    index = [torch.tensor(v, device=DEVICE) for v in (POSITIONS, SLOTS)]
    k = torch.full((NUM_SLOTS, kv_heads, dim), SENTINEL, dtype=pool_dtype, device=DEVICE)
    v = torch.full_like(k, SENTINEL)
    tables = cos.to(DEVICE), sin.to(DEVICE), *index
    OPS.rotary_store_kv_(qkv, num_heads, kv_heads, dim, tables[0], tables[1], index[0], k, v, index[1])
    return before, qkv, k, v, tables


def stored(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What the kernels' cast stores of `src` as `dtype`: round-to-nearest-even, torch's (and the native
    pass's, so that a page holds the same bytes whichever wrote it); but Triton 3.9's interpreter
    truncates float32 to bfloat16, which dropping the low 16 bits reproduces exactly."""
    if INTERPRETING and src.dtype == torch.float32 and dtype == torch.bfloat16:
        return (src.contiguous().view(torch.int32) & -(2**16)).view(torch.float32).to(dtype)
    return src.to(dtype)


def assert_pool_holds(
    qkv: torch.Tensor,
    heads: tuple[int, int, int],
    k: torch.Tensor,
    v: torch.Tensor,
    cast: Callable[[torch.Tensor, torch.dtype], torch.Tensor] = stored,
) -> None:
    """Each real token's slot holds its K heads as `qkv` now holds them and its V heads, `cast` to the
    pool's dtype, exactly; slots no token writes keep SENTINEL."""
    num_heads, kv_heads, dim = heads
    rows = qkv.view(qkv.shape[0], -1, dim)
    for t, slot in enumerate(SLOTS):
        if slot == PADDING_SLOT:
            continue  # two padded tokens race for it: what lands there is nobody's to read
        assert torch.equal(k[slot], cast(rows[t, num_heads : num_heads + kv_heads], k.dtype)), (
            f"K of token {t}"
        )
        assert torch.equal(v[slot], cast(rows[t, num_heads + kv_heads :], v.dtype)), f"V of token {t}"
    untouched = torch.ones(NUM_SLOTS, dtype=torch.bool)
    untouched[SLOTS] = False
    assert (k[untouched.to(DEVICE)] == SENTINEL).all() and (v[untouched.to(DEVICE)] == SENTINEL).all()


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(
    ("qkv_dtype", "pool_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float32, torch.bfloat16),  # the CPU path's float32 model over a bfloat16 pool
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float16),
        (torch.bfloat16, torch.float32),
    ],
)
def test_rotary_store_kv_matches_reference(
    heads: tuple[int, int, int], qkv_dtype: torch.dtype, pool_dtype: torch.dtype
) -> None:
    num_heads, kv_heads, dim = heads
    before, qkv, k, v, (cos, sin, positions, _) = run_rotary(
        heads, qkv_dtype, pool_dtype, seed=dim + num_heads
    )
    ref, magnitude = rotary_reference(before, num_heads + kv_heads, dim, cos, sin, positions)
    assert_within(qkv, ref, 2 * U32 * magnitude + rounding(qkv_dtype, ref), "rotary")
    assert_pool_holds(qkv, heads, k, v)


@pytest.mark.parametrize("heads", HEADS[:3])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_kv_matches_the_native_pass(
    heads: tuple[int, int, int], pool_dtype: torch.dtype
) -> None:
    if not INTERPRETING:
        pytest.skip("the native pass runs on CPU tensors only")
    num_heads, kv_heads, dim = heads
    before, qkv, k, v, (cos, sin, positions, slots) = run_rotary(heads, torch.float32, pool_dtype, seed=dim)
    cpu_qkv, cpu_k, cpu_v = before.clone(), torch.full_like(k, SENTINEL), torch.full_like(v, SENTINEL)
    native().rotary_store_kv_(cpu_qkv, num_heads, kv_heads, dim, cos, sin, positions, cpu_k, cpu_v, slots)
    _, magnitude = rotary_reference(before, num_heads + kv_heads, dim, cos, sin, positions)
    assert_within(qkv, cpu_qkv.double(), 4 * U32 * magnitude, "rotary against the native pass")
    # The same layout of the pool as ours; the native pass rounds to bfloat16 as torch does.
    assert_pool_holds(cpu_qkv, heads, cpu_k, cpu_v, cast=torch.Tensor.to)


def test_rotary_pairs_each_dim_with_the_one_half_a_head_away() -> None:
    """cos 0, sin 1 turns the rotate-half rotary into an exact permutation, x1, x2 -> -x2, x1 per head:
    a kernel that paired neighbouring dims (GPT-J's interleaved convention), swapped the halves' signs or
    rotated v heads fails it exactly."""
    num_heads, kv_heads, dim = 3, 1, 64
    qkv = rows_of(3, (num_heads + 2 * kv_heads) * dim, torch.float32, seed=4)
    before = qkv.clone()
    cos, sin = torch.zeros(4, dim, device=DEVICE), torch.ones(4, dim, device=DEVICE)
    positions, slots = torch.tensor([3, 1, 2], device=DEVICE), torch.tensor([0, 1, 2], device=DEVICE)
    k = torch.zeros(3, kv_heads, dim, device=DEVICE)
    v = torch.zeros_like(k)
    OPS.rotary_store_kv_(qkv, num_heads, kv_heads, dim, cos, sin, positions, k, v, slots)
    x, got = before.view(3, -1, dim), qkv.view(3, -1, dim)
    half, rotated = dim // 2, num_heads + kv_heads
    assert torch.equal(got[:, :rotated, :half], -x[:, :rotated, half:])
    assert torch.equal(got[:, :rotated, half:], x[:, :rotated, :half])
    assert torch.equal(got[:, rotated:], x[:, rotated:])


def test_rotary_results_follow_the_positions() -> None:
    """The check can fail: every token rotated at the next position gives outputs far past the bound."""
    heads = HEADS[0]
    num_heads, kv_heads, dim = heads
    before, qkv, _, _, (cos, sin, positions, _) = run_rotary(heads, torch.float32, torch.float32, seed=6)
    ref, magnitude = rotary_reference(before, num_heads + kv_heads, dim, cos, sin, positions + 1)
    q_width = num_heads * dim
    off = (qkv.double().cpu() - ref)[:, :q_width].abs().amax(dim=1)
    assert (off > 1000 * (2 * U32 * magnitude[:, :q_width]).amax(dim=1)).all()


def test_rotary_store_kv_refuses_int8_pools_and_wrong_widths() -> None:
    qkv = torch.zeros(2, 4 * 64, device=DEVICE)
    cos = torch.zeros(8, 64, device=DEVICE)
    index = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    int8 = torch.zeros(4, 1, 64 + 4, dtype=torch.int8, device=DEVICE)
    with pytest.raises(ValueError, match=r"torch\.int8"):
        OPS.rotary_store_kv_(qkv, 2, 1, 64, cos, cos, index, int8, int8, index)
    pool = torch.zeros(4, 1, 64, device=DEVICE)
    with pytest.raises(ValueError, match="256 are not 3 \\+ 2 x 1 heads of 64"):
        OPS.rotary_store_kv_(qkv, 3, 1, 64, cos, cos, index, pool, pool, index)


# ------------------------------------------------------------------------------------------- silu_mul


@pytest.mark.parametrize("inner", [1536, 2560, 96])  # SmolLM2-135M's and -360M's FFN; one short block
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_reference(inner: int, dtype: torch.dtype) -> None:
    gate_up = rows_of(3, 2 * inner, dtype, seed=inner, scale=3.0)
    out = torch.full((3, inner), SENTINEL, dtype=dtype, device=DEVICE)
    assert OPS.silu_mul(gate_up, out) is out
    g, up = gate_up.double().cpu()[:, :inner], gate_up.double().cpu()[:, inner:]
    ref = g * torch.sigmoid(g) * up
    assert_within(out, ref, (g.abs() + 10) * U32 * ref.abs() + rounding(dtype, ref), "silu_mul")
    fresh = OPS.silu_mul(gate_up)
    assert fresh.dtype == dtype and torch.equal(fresh, out)


# The interpreter's numpy exp warns where a GPU's saturates to inf silently.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
def test_silu_mul_of_extreme_gates_is_finite() -> None:
    """e^-g overflows to inf below about -88: silu is then -0 (as torch's), never NaN. (silu(-100) is
    subnormal, which a GPU's division may flush to 0: hence the smallest normal as the absolute bound.)"""
    gate_up = torch.tensor([[-1000.0, -100.0, 100.0, 0.0, 2.0, 3.0, 4.0, 5.0]], device=DEVICE)
    got = OPS.silu_mul(gate_up)
    want = torch.nn.functional.silu(gate_up[:, :4]) * gate_up[:, 4:]
    torch.testing.assert_close(got, want, rtol=10 * U32, atol=torch.finfo(torch.float32).tiny)


# -------------------------------------------------------------------------------------- sm_90 compile

KERNELS = ("_rms_norm_kernel", "_add_rms_norm_kernel", "_rotary_store_kv_kernel", "_silu_mul_kernel")
SM90_DTYPES = ("bfloat16", "float32")  # a 16-bit GPU forward's activations and pool; the float32 path


def compile_launches_for_sm90(work: str) -> None:
    """The child process of the sm_90 compile test (TRITON_INTERPRET=0: an interpreting process cannot
    compile). Runs the passes at Llama-3.1-8B's sizes (hidden 4096, 32/8 heads of 128, FFN 14336) with
    their kernels swapped for recorders, compiles every recorded launch and prints, as JSON, each
    dtype's kernels' stack bytes."""
    kernels = {name: getattr(triton_fused, name) for name in KERNELS}
    stacks = []
    for dtype_name in SM90_DTYPES:
        launches = {name: Launches() for name in KERNELS}
        for name, recorder in launches.items():
            setattr(triton_fused, name, recorder)  # the module's globals: what its methods launch
        dtype, hidden, heads, kv_heads, dim = getattr(torch, dtype_name), 4096, 32, 8, 128
        x, weight = torch.zeros(2, hidden, dtype=dtype), torch.zeros(hidden, dtype=dtype)
        OPS.rms_norm(x, weight, EPS)
        OPS.add_rms_norm(x, x.clone(), weight, EPS)
        qkv, table = torch.zeros(2, (heads + 2 * kv_heads) * dim, dtype=dtype), torch.zeros(8, dim)
        pool, index = torch.zeros(4, kv_heads, dim, dtype=dtype), torch.zeros(2, dtype=torch.int64)
        OPS.rotary_store_kv_(qkv, heads, kv_heads, dim, table, table, index, pool, pool, index)
        OPS.silu_mul(torch.zeros(2, 2 * 14336, dtype=dtype))
        case = {}
        for name, recorder in launches.items():
            ((args, kwargs),) = recorder.calls
            case[name] = sm90_stack_bytes(kernels[name], name, args, kwargs, Path(work))
        stacks.append(case)
    print(json.dumps(stacks))


def test_kernels_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    """What the interpreter never does: the kernels, as the methods launch them, go through Triton's
    compiler and ptxas for an H100/H200, and no thread needs a stack, i.e. no registers spill."""
    if not CUOBJDUMP.exists():
        pytest.skip(f"triton ships no cuobjdump here ({CUOBJDUMP})")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    code = "import sys; from tests.test_triton_fused import compile_launches_for_sm90 as c; c(sys.argv[1])"
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
    assert stacks == [dict.fromkeys(KERNELS, 0)] * len(SM90_DTYPES), list(
        zip(SM90_DTYPES, stacks, strict=True)
    )


# --------------------------------------------------------------------------------------- graph capture


@cuda_only
@pytest.mark.skipif(INTERPRETING, reason="graph capture needs the compiled kernels (TRITON_INTERPRET=0)")
def test_passes_replay_in_a_cuda_graph_with_new_inputs() -> None:
    """Captured once, replayed after the activations, positions and slots change in place: the results
    follow the new values, so nothing the kernels read was fixed on the host at capture."""
    heads = HEADS[2]
    num_heads, kv_heads, dim = heads
    width = (num_heads + 2 * kv_heads) * dim
    x = rows_of(len(POSITIONS), width, torch.bfloat16, seed=8).contiguous()
    residual, weight = torch.zeros_like(x), torch.ones(width, dtype=torch.bfloat16, device=DEVICE)
    cos, sin = (t.to(DEVICE) for t in rotary_tables(64, dim, seed=9))
    positions, slots = torch.tensor(POSITIONS, device=DEVICE), torch.tensor(SLOTS, device=DEVICE)
    k = torch.full((NUM_SLOTS, kv_heads, dim), SENTINEL, dtype=torch.bfloat16, device=DEVICE)
    v = torch.full_like(k, SENTINEL)
    normed, qkv = torch.empty_like(x), torch.empty_like(x)
    gated = torch.empty(x.shape[0], width // 2, dtype=x.dtype, device=DEVICE)

    def run() -> None:
        residual.zero_()
        normed.copy_(OPS.add_rms_norm(x, residual, weight, EPS))
        qkv.copy_(normed)
        OPS.rotary_store_kv_(qkv, num_heads, kv_heads, dim, cos, sin, positions, k, v, slots)
        OPS.silu_mul(OPS.rms_norm(x, weight, EPS), gated)

    run()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    x.copy_(rows_of(len(POSITIONS), width, torch.bfloat16, seed=10))
    positions.copy_(positions.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(residual, x)
    ref = rms_norm_reference(x, weight)
    assert_within(normed, ref, norm_bound(ref, torch.bfloat16), "replayed norm")
    ref, magnitude = rotary_reference(normed, num_heads + kv_heads, dim, cos, sin, positions)
    assert_within(qkv, ref, 2 * U32 * magnitude + rounding(torch.bfloat16, ref), "replayed rotary")
    assert torch.equal(gated, OPS.silu_mul(OPS.rms_norm(x, weight, EPS)))
