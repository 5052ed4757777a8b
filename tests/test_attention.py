"""The native kernels (decode attention, packed linears, the fused layer passes) agree with torch's
paths, and the engine is exact either way."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from services.common.config import CBConfig
from services.common.model_source import cbserve_home, load_model
from services.worker import gemm_crossover, kernels
from services.worker.engine import Engine
from services.worker.packed_linear import PackedLinear, PackedWeight, pack_linears
from tests.attention_cases import causal_reference, decode_batch, gather_sdpa, prefill_batch, rotary_batch
from tests.kernel_modules import built, native_kernels_off
from tests.parity import CONFIGS, NEW_TOKENS, make_prompts, reference, reference_attn
from tests.stack import REPO


@pytest.fixture
def kernels_off(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with native_kernels_off(monkeypatch):
        yield


@pytest.mark.parametrize("softcap", [0.0, 20.0])
@pytest.mark.parametrize(
    ("kv", "group", "d", "b"),
    [
        (2, 2, 16, 7),
        (3, 3, 64, 7),  # SmolLM2's shape
        (1, 4, 32, 7),
        (1, 5, 128, 2),  # few requests: one task per head; five queries exceed one register pass
        (2, 3, 24, 1),  # a head size off the vector path
        (4, 1, 80, 9),
        (1, 71, 64, 3),  # Falcon-7B's multi-query shape: more query heads per kv head than registers
    ],
)
def test_native_decode_matches_reference(kv: int, group: int, d: int, b: int, softcap: float) -> None:
    kernel = built(kernels.paged_decode_kernel(), "the engine runs the fallback path (tested below)")
    length = 45
    # The packed batch: the requests' rows among others (left alone), tokens wider than their heads.
    k_cache, v_cache, packed, rows, slots, lengths = decode_batch(
        kv, group, d, b, length, num_slots=400, seed=0
    )
    out = torch.full(packed.shape, 7.0)
    kernel(packed, out, rows, k_cache, v_cache, slots, lengths, d**-0.5, softcap)
    others = torch.ones(b + 3, dtype=torch.bool).index_fill_(0, rows, False)
    assert torch.equal(out[others], torch.full_like(out[others], 7.0))
    got = out[rows].view(b, kv, group, d)
    q = packed[rows].view(b, kv, group, d)
    want = gather_sdpa(q, k_cache, v_cache, slots, lengths, d**-0.5, softcap)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if not softcap:
        sdpa = F.scaled_dot_product_attention(
            q,
            k_cache[slots.reshape(-1)].view(b, length, kv, d).transpose(1, 2),
            v_cache[slots.reshape(-1)].view(b, length, kv, d).transpose(1, 2),
            attn_mask=torch.arange(length)[None, None, None, :] < lengths[:, None, None, None],
        )
        torch.testing.assert_close(got, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("softcap", "window"), [(0.0, 0), (20.0, 0), (0.0, 13)])
@pytest.mark.parametrize(("kv", "group", "d"), [(3, 3, 64), (2, 2, 16), (1, 5, 128), (4, 1, 32)])
def test_native_prefill_matches_reference(kv: int, group: int, d: int, softcap: float, window: int) -> None:
    kernel = kernels.paged_prefill_kernel(d)
    if kernel is None:
        built(kernels.paged_decode_kernel(), "paged attention")  # a broken build fails here
        pytest.skip(f"no prefill kernel for head size {d} here (AVX-512: 16-128 by 16, AVX2: 32-128 by 32)")
    k_cache, v_cache, (q, first_rows, num_queries, slots, lengths) = prefill_batch(
        kv, group, d, window, torch.float32
    )
    heads, row = kv * group, q.shape[0]
    out = torch.full((row, heads, d), 7.0)
    kernel(q, out, k_cache, v_cache, first_rows, num_queries, slots, lengths, d**-0.5, softcap, window)
    assert torch.equal(out[:2], torch.full((2, heads, d), 7.0))
    for first, n, keys, s in zip(first_rows, num_queries, lengths, slots, strict=True):
        k, v = k_cache[s[:keys]], v_cache[s[:keys]]
        want = causal_reference(q[first : first + n], k, v, d**-0.5, softcap, window)
        torch.testing.assert_close(out[first : first + n], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config_name", ["chunked", "padded"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_fallback_path_is_exact(
    family: str, config_name: str, tiny_models: Callable[[str], Path], kernels_off: None
) -> None:
    model_dir = tiny_models(family)
    prompts = make_prompts(seed=9)
    with Engine.from_pretrained(model_dir, **CONFIGS[config_name]) as engine:
        assert engine.runner.builder.decode_kernel is None
        assert engine.runner.builder.prefill_kernel is None
        assert engine.runner.fused is None
        assert not any(isinstance(m, PackedLinear) for m in engine.model.modules())
        assert engine.generate(prompts, 20, ignore_eos=True) == reference(
            model_dir, reference_attn(family), prompts
        )


# Rows: none, one tile (1, 5, and the tallest: 14 with AVX-512, 6 with AVX2) and uneven splits of
# several tiles (15 = 8 + 7 or 5 + 5 + 5, 38, 600); outputs: a partial last panel (200 = 6 x 32 + 8 or
# 12 x 16 + 8, 17) and whole ones (64).
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 14, 15, 38, 600])
@pytest.mark.parametrize(("in_features", "out_features"), [(96, 200), (33, 17), (64, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("torch_from_rows", [gemm_crossover.NEVER, 9], ids=["panels", "torch-from-9"])
def test_packed_linear_matches_torch(
    rows: int, in_features: int, out_features: int, bias: bool, torch_from_rows: int
) -> None:
    """Whichever GEMM this CPU's crossover picks for a size, the product is torch's."""
    ops = copy.copy(built(kernels.packed_linear_ops(), "panel linears"))
    ops.torch_from_rows = torch_from_rows
    gen = torch.Generator().manual_seed(rows)
    linear = torch.nn.Linear(in_features, out_features, bias=bias)
    torch.nn.init.normal_(linear.weight, generator=gen)
    if bias:
        torch.nn.init.normal_(linear.bias, generator=gen)
    x = torch.randn(1, rows, in_features, generator=gen)  # the engine's packed batch axis
    packed = PackedLinear(linear, ops)
    torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-4)
    # Rows with a stride (a slice of a wider activation) read the same.
    wide = torch.randn(rows, in_features + 7, generator=gen)[:, 3 : 3 + in_features]
    torch.testing.assert_close(packed(wide), linear(wide), rtol=1e-5, atol=1e-4)
    assert packed.weight is linear.weight


# Outputs: a partial last gated panel (100 = 6 x 16 + 4 or 12 x 8 + 4, 17) and whole ones (64).
@pytest.mark.parametrize("rows", [0, 1, 5, 14, 15, 600])
@pytest.mark.parametrize(("in_features", "width"), [(96, 100), (33, 17), (64, 64)])
@pytest.mark.parametrize("torch_from_rows", [gemm_crossover.NEVER, 9], ids=["panels", "torch-from-9"])
def test_gated_product_is_silu_of_gate_times_up(
    rows: int, in_features: int, width: int, torch_from_rows: int
) -> None:
    """An MLP's gate|up written as silu(gate) * up by the panels (or after torch's GEMM) equals
    transformers' `act_fn(gate_proj(x)) * up_proj(x)`."""
    ops = copy.copy(built(kernels.packed_linear_ops(), "panel linears"))
    ops.torch_from_rows = torch_from_rows
    gen = torch.Generator().manual_seed(rows + width)
    gate, up = (torch.nn.Linear(in_features, width, bias=False) for _ in range(2))
    for lin in (gate, up):
        torch.nn.init.normal_(lin.weight, generator=gen)
    x = torch.randn(rows, in_features + 5, generator=gen)[:, 2 : 2 + in_features]  # strided rows
    want = F.silu(gate(x)) * up(x)
    packed = PackedWeight.of(ops, gate, up, gated=True)
    torch.testing.assert_close(packed(x), want, rtol=1e-5, atol=1e-4)


def test_gated_product_of_far_negative_gates_is_zero_not_nan() -> None:
    """-ffast-math assumes no infinity: e^200 must never be formed (a division by it gave NaN with AVX2)."""
    ops = built(kernels.packed_linear_ops(), "panel linears")
    gate, up = (torch.nn.Linear(8, 8, bias=False) for _ in range(2))
    with torch.no_grad():
        gate.weight.copy_(torch.eye(8))
        up.weight.fill_(1.0)
    x = torch.tensor([[-200.0, -100.0, -88.0, -80.0, -30.0, 0.0, 30.0, 100.0]])
    got = PackedWeight.of(ops, gate, up, gated=True)(x)
    torch.testing.assert_close(got, F.silu(x) * x.sum(), rtol=1e-5, atol=1e-28)


def test_gated_product_refuses_biases_and_unequal_widths() -> None:
    ops = built(kernels.packed_linear_ops(), "panel linears")
    with pytest.raises(ValueError, match="one width, no bias"):
        PackedWeight.of(ops, torch.nn.Linear(8, 4), torch.nn.Linear(8, 4), gated=True)
    with pytest.raises(ValueError, match="one width, no bias"):
        PackedWeight.of(ops, torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 5, bias=False), gated=True)


def test_pack_linears_keeps_tied_weights(tiny_models: Callable[[str], Path]) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_models("llama"))
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    built(kernels.packed_linear_ops(), "panel linears")
    swapped = pack_linears(model)
    assert swapped == linears > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    if model.config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert pack_linears(model) == 0  # already packed


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_prefill_groups_bound_padding(device: str) -> None:
    from services.worker.batch import PADDING_WASTE, prefill_groups

    waste = PADDING_WASTE[device]
    queries = [300, 1, 60, 290, 64, 8]
    keys = [300, 301, 460, 290, 64, 520]
    groups = prefill_groups([0, 2, 3, 4, 5], queries, keys, waste)
    assert sorted(i for g in groups for i in g) == [0, 2, 3, 4, 5]
    assert any({0, 3} <= set(g) for g in groups)  # two prompts of nearly one shape share a group
    for g in groups:
        padded = len(g) * max(queries[i] for i in g) * max(keys[i] for i in g)
        assert padded <= waste * sum(queries[i] * keys[i] for i in g)
    # A GPU, where a group's launches cost more than padding, takes fewer and larger groups.
    assert len(groups) == {"cpu": 4, "cuda": 1}[device]
    assert prefill_groups([], queries, keys, waste) == []


def _fused_ops() -> Any:
    return built(kernels.fused_ops(), "the model runs transformers' forward (the fallback test covers it)")


def test_fused_norms_match_torch() -> None:
    ops = _fused_ops()
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(37, 700, generator=gen)
    x = wide[:, 100:676]  # strided rows, as a slice of a fused projection
    residual = torch.randn(37, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    eps = 1e-5

    def norm(t: torch.Tensor) -> torch.Tensor:
        return weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps))

    torch.testing.assert_close(ops.rms_norm(x, weight, eps), norm(x), rtol=1e-5, atol=1e-5)
    summed = residual + x
    torch.testing.assert_close(ops.add_rms_norm(x, residual, weight, eps), norm(summed), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual, summed)  # the skip connection, in place


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_rotary_matches_transformers(cache_dtype: torch.dtype) -> None:
    """Rotated keys and values land in their slots; a 16-bit pool holds them rounded to nearest even,
    byte for byte what torch's `.to(cache_dtype)` gives, whichever path wrote a page."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ops = _fused_ops()
    t, heads, kv_heads, d = 11, 9, 3, 64
    qkv, cos, sin, positions, slots = rotary_batch(t, heads, kv_heads, d, seed=4)
    q = qkv[:, : heads * d].view(t, heads, d).transpose(0, 1)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(t, kv_heads, d).transpose(0, 1)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos[positions], sin[positions], unsqueeze_dim=0)
    v_before = qkv[:, (heads + kv_heads) * d :].clone()
    k_cache, v_cache = (torch.zeros(40, kv_heads, d, dtype=cache_dtype) for _ in range(2))
    ops.rotary_store_kv_(qkv, heads, kv_heads, d, cos, sin, positions, k_cache, v_cache, slots)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)  # values are not rotated
    # Each row's rotated keys and its values land in its slot, and no other slot is touched.
    assert torch.equal(k_cache[slots], k.transpose(0, 1).to(cache_dtype))
    assert torch.equal(v_cache[slots], v_before.view(t, kv_heads, d).to(cache_dtype))
    untouched = torch.ones(40, dtype=torch.bool).index_fill_(0, slots, False)
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
    with pytest.raises(RuntimeError, match="position 50 outside the rotary table of 50"):
        ops.rotary_store_kv_(qkv, heads, kv_heads, d, cos, sin, torch.full((t,), 50), k_cache, v_cache, slots)
    past_the_end = torch.full((t,), 40)
    with pytest.raises(RuntimeError, match="slot 40 outside 40"):
        ops.rotary_store_kv_(qkv, heads, kv_heads, d, cos, sin, positions, k_cache, v_cache, past_the_end)
    with pytest.raises(RuntimeError, match=r"got \[40, 3, 64\] double"):
        wide = k_cache.double()
        ops.rotary_store_kv_(qkv, heads, kv_heads, d, cos, sin, positions, wide, wide.clone(), slots)


@pytest.mark.parametrize("n", [1, 15, 16, 49_152, 49_157])
def test_native_argmax_is_torchs(n: int) -> None:
    """First maximum wins, a NaN wins over any number (torch's rule), rows may be strided."""
    ops = _fused_ops()
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(7, n + 3, generator=gen)[:, 2 : 2 + n]
    x[1] = x[1].max()  # all tied: the first
    x[2, n // 2] = float("nan")
    x[2, -1] = float("nan")
    x[3] = float("-inf")
    x[4, -1] = float("inf")
    x[5, n // 3] = x[5, n - 1] = x[5].max() + 1  # a tie of two maxima: the first
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))
    assert ops.argmax_rows(x[:0]).shape == (0,)


FUSED_FAMILIES = [("llama", True), ("qwen2", True), ("mistral", True), ("qwen3", False), ("gemma2", False)]


@pytest.mark.parametrize(("family", "fused"), FUSED_FAMILIES)
def test_llama_shaped_families_run_the_fused_forward(
    family: str, fused: bool, tiny_models: Callable[[str], Path]
) -> None:
    """The engine parity tests run these families; this pins which forward they exercise."""
    _fused_ops()
    with Engine.from_pretrained(tiny_models(family)) as engine:
        assert (engine.runner.fused is not None) == fused
        # Fused models keep transformers' linears (the fused forward packs its own concatenations).
        assert any(isinstance(m, PackedLinear) for m in engine.model.modules()) != fused
        if fused:  # ... with their plain weights let go: the packed copies are the only ones read
            attn = engine.model.model.layers[0].self_attn
            assert attn.k_proj.weight.is_meta and engine.runner.fused.layers[0].qkv.weight.is_meta
            assert attn.k_proj.weight.shape == (attn.k_proj.out_features, attn.k_proj.in_features)


def test_a_model_taken_by_one_engine_serves_the_next_of_its_kind(tiny_models: Callable[[str], Path]) -> None:
    """Our own forward lets the plain weights go once packed, so an engine takes the model it is given.
    Another engine on the same model (the worker's, attaching to a restarted cachemgr) reuses the
    packed forward and gives the same tokens; one of another quantization is refused with the reason,
    not run on nothing."""
    _fused_ops()
    model, _ = load_model(tiny_models("llama"))
    prompts = make_prompts(seed=5)
    outputs = []
    for _ in range(2):
        with Engine(model, CBConfig.from_kwargs(num_blocks=64)) as engine:
            assert engine.runner.fused is not None
            outputs.append(engine.generate(prompts, NEW_TOKENS, ignore_eos=True))
    assert outputs[0] == outputs[1] == reference(tiny_models("llama"), "sdpa", prompts)
    with pytest.raises(ValueError, match="let go by the engine that packed them before"):
        Engine(model, CBConfig.from_kwargs(num_blocks=64, quantization="int8"))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_forward_is_exact_with_torchs_gemm_for_many_rows(
    family: str, tiny_models: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where this CPU's crossover sends prefill products to torch's GEMM (oneDNN on weights reordered
    once) and decode rows to the panels, greedy tokens are still transformers'."""
    ops = built(kernels.packed_linear_ops(), "panel linears")
    _fused_ops()
    monkeypatch.setattr(ops, "torch_from_rows", 9)
    model_dir = tiny_models(family)
    prompts = make_prompts(seed=5)
    with Engine.from_pretrained(model_dir, **CONFIGS["chunked"]) as engine:
        fused = engine.runner.fused
        assert fused is not None
        assert all(layer.gate_up.many_rows is not None for layer in fused.layers)
        assert fused.lm_head.many_rows is None  # the panels serve the LM head at every size
        assert engine.generate(prompts, 20, ignore_eos=True) == reference(
            model_dir, reference_attn(family), prompts
        )


def test_a_lock_left_by_a_killed_load_does_not_hold_up_the_next() -> None:
    """torch leaves its lock file behind when a process dies inside `load()` (a worker stopped while
    it starts); the next worker waited on it for ever and never became ready."""
    built(kernels.fused_ops(), "no native kernels here")
    lock = cbserve_home() / "kernels" / f"cbserve_fused_ops_{kernels._cpu_tag()}" / "lock"
    lock.touch()  # as the killed process left it
    load = "from services.worker.kernels import fused_ops; print(fused_ops() is not None)"
    try:
        loaded = subprocess.run(
            [sys.executable, "-c", load], capture_output=True, text=True, timeout=120, cwd=REPO
        )
    finally:
        lock.unlink(missing_ok=True)
    assert loaded.stdout.strip() == "True", loaded.stderr[-2000:]


def test_a_failed_build_is_an_error_where_a_compiler_exists(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A compile error in csrc must not pass as 'no toolchain': it is logged as an error, and the kernel
    tests above fail on it (they skip only where no compiler exists)."""
    if not kernels.compiler_available():
        pytest.skip("no C++ toolchain here")
    monkeypatch.setattr(kernels, "_CSRC", tmp_path)
    monkeypatch.setenv("CBSERVE_HOME", str(tmp_path / "home"))
    # No torch header: the compiler stops at the error at once instead of parsing torch's for 20 s.
    (tmp_path / "broken.cpp").write_text("#include <cstdint>\nthis is not C++;\n")
    logged: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(kernels.log, "error", lambda event, **kw: logged.append((event, kw)))
    assert kernels._build("broken") is None
    ((event, fields),) = logged
    assert event == "native kernel failed to build, using torch's" and fields["kernel"] == "broken"
    assert "error" in fields["error"].lower()
    with pytest.raises(pytest.fail.Exception, match="did not build"):
        built(None, "test")
