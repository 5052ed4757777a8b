"""Lower precisions: bfloat16 weights (our own forward with float32 activations), bfloat16, float16 and
int8 KV pages (common/kv_int8.py).

Measured, not assumed exact: teacher-forced top-1 agreement with the float32 model over a fixed text
of real prose (services/bench/agreement.py), and a request's tokens must not change with the events
that change how its tokens reach the model (chunked prefill, prefix hits, offloading, soft resets).
Those feed the same bytes to kernels whose every row is computed on its own: the linears on the
panels (the suite pins the GEMM crossover to them), norms, rotary and argmax row by row, and
attention, where a soft reset recomputes through the prefill kernel the tokens the decode kernel first
computed, and the two kernels give a row the same bits (tests/test_attention_prefill_is_decode.py). In
bfloat16 a last-bit difference anywhere could flip an activation's rounding and, at a near tie, a
token.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from services.bench.agreement import agreement, engine_top1, prose_conversations, reference_top1
from services.common.model_source import load_model
from services.worker.engine import Engine
from tests.parity import SMOL_CONFIGS, assert_no_leak, chat_prompts, make_prompts, reference

NEW_TOKENS = 24


@contextlib.contextmanager
def _stack_streaming(
    smollm2_dir: Path, tmp_path: Path, up_args: list[str], prompts: list[list[int]], expected: list[list[int]]
) -> Iterator[Any]:
    """`cbserve up` with `up_args` on SmolLM2, checked to stream `expected` greedily for `prompts` and to
    hold nothing after; the stack, for its start-up events, until the block ends."""
    from tests.stack import Stack, greedy_request

    stack = Stack(smollm2_dir, tmp_path, up_args=up_args, num_blocks=64, page_size=16)
    try:
        for prompt, want in zip(prompts, expected, strict=True):
            assert stack.generate(greedy_request(prompt, NEW_TOKENS))[0] == want
        stack.assert_idle()
        yield stack
    finally:
        stack.stop()


@cache
def _prose(model_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    """The prose conversations and float32 transformers' top-1 at every position."""
    prompts = prose_conversations(AutoTokenizer.from_pretrained(model_dir))
    model, _ = load_model(model_dir)
    return prompts, reference_top1(model, prompts)


def _native_attention(engine: Engine) -> None:
    """The engine runs our own forward, and the native attention kernels read its pool in place."""
    if engine.runner.fused is None:
        pytest.skip("no native kernels here: transformers' own forward runs")
    assert engine.runner.describe()["attention"] == "native"


def _native_bf16(engine: Engine) -> None:
    """The engine runs our own forward on bfloat16 panels, not transformers' bfloat16 fallback."""
    if engine.runner.fused is None:
        pytest.skip("no native kernels here: bfloat16 runs transformers' own forward")
    assert engine.runner.fused.lm_head.packed.dtype == torch.bfloat16
    assert engine.runner.activation_dtype == torch.float32


# int8 KV (common/kv_int8.py): with each row rotated by H_64 before its per-row scale, float32 weights
# reached 3115/3147 = 0.9898 and bfloat16 weights 3098/3147 = 0.9844 (one scale per unrotated row:
# 3078/3147 = 0.9781 for both); with the queries rounded to 15 bits as well (`round_queries`, for the
# integer dots), 3109/3147 = 0.9879 and 3111/3147 = 0.9886: near ties moving either way. The floors
# sit just below, so that a change that loses the rotation's gain fails here.
@pytest.mark.parametrize(
    ("weights", "kv", "floor"),
    [
        pytest.param(torch.bfloat16, "auto", 0.99, id="bf16-weights-and-kv"),
        pytest.param(torch.float32, "int8", 0.987, id="int8-kv"),
        # Each a mix of the two above, whose bytes those already hold to their floors.
        pytest.param(torch.float32, "bfloat16", 0.99, id="bf16-kv", marks=pytest.mark.slow),
        pytest.param(torch.bfloat16, "int8", 0.984, id="bf16-weights-int8-kv", marks=pytest.mark.slow),
        # OpenVINO GenAI's default on CPUs without native bfloat16: float32 weights, float16 KV.
        pytest.param(torch.float32, "float16", 0.997, id="fp16-kv"),
    ],
)
def test_teacher_forced_top1_agreement_with_float32(
    weights: torch.dtype, kv: str, floor: float, smollm2_dir: Path, record_property: Any
) -> None:
    prompts, expected = _prose(smollm2_dir)
    with Engine.from_pretrained(smollm2_dir, dtype=weights, kv_cache_dtype=kv, num_blocks=160) as engine:
        assert engine.runner.kv_pool.dtype == (weights if kv == "auto" else getattr(torch, kv))
        if weights == torch.bfloat16:
            _native_bf16(engine)
        if kv == "float16":
            _native_attention(engine)
        same, total = agreement(expected, engine_top1(engine, prompts))
        assert_no_leak(engine)
    record_property("agreement", f"{same}/{total}")
    print(f"teacher-forced top-1 agreement ({weights}, kv {kv}): {same}/{total} = {same / total:.4f}")
    assert total > 3000
    assert same / total >= floor, (same, total)


def test_a_float16_pool_keeps_transformers_greedy_tokens(tiny_models: Any) -> None:
    """Over a float16 pool a float32 model runs our own forward, which writes the pages, and the native
    attention, which reads them in place; greedy decoding keeps float32 transformers' tokens (float16
    holds these activations' keys and values to 11 bits)."""
    model_dir = tiny_models("llama")
    prompts = make_prompts(seed=5)
    want = reference(model_dir, "sdpa", prompts)
    with Engine.from_pretrained(model_dir, kv_cache_dtype="float16", num_blocks=64, page_size=16) as engine:
        assert engine.runner.kv_pool.dtype == torch.float16
        _native_attention(engine)
        got = engine.generate(prompts, len(want[0]), ignore_eos=True)
        assert_no_leak(engine)
    assert got == want


@pytest.fixture(scope="module")
def smol_chat_prompts(smollm2_dir: Path) -> list[list[int]]:
    return chat_prompts(smollm2_dir)


# The lower precisions whose tokens must not change with the events: each one's engine settings.
PRECISIONS: dict[str, dict[str, Any]] = {
    "bf16": {"dtype": torch.bfloat16},
    "fp16-kv": {"kv_cache_dtype": "float16"},
    "int8-kv": {"kv_cache_dtype": "int8"},
}


def _runs_as_named(engine: Engine, precision: str) -> None:
    if precision == "bf16":
        _native_bf16(engine)
    else:
        _native_attention(engine)
        assert engine.runner.kv_pool.dtype == getattr(torch, PRECISIONS[precision]["kv_cache_dtype"])


@cache
def _plain(model_dir: Path, prompts: tuple[tuple[int, ...], ...], precision: str = "bf16") -> list[list[int]]:
    """The engine's tokens in `precision` with none of the events: a roomy cache, no prefix sharing,
    whole prompts in one step."""
    with Engine.from_pretrained(
        model_dir, **PRECISIONS[precision], num_blocks=64, page_size=16, allow_block_sharing=False
    ) as engine:
        _runs_as_named(engine, precision)
        return engine.generate([list(p) for p in prompts], NEW_TOKENS, ignore_eos=True)


# float16 and int8 pages in every configuration are the slow run's: the default run keeps the two whose
# events move the pages' bytes themselves (offload and restore copy the rows, int8's with their scales;
# a soft reset recomputes them through the prefill kernel). bfloat16 runs through every event.
KV_EVENTS_DEFAULT = ("swap", "soft_reset")


@pytest.mark.parametrize(
    ("config_name", "precision"),
    [
        pytest.param(
            config,
            precision,
            id=f"{config}-{precision}",
            marks=[pytest.mark.slow] * (precision != "bf16" and config not in KV_EVENTS_DEFAULT),
        )
        for precision in PRECISIONS
        for config in SMOL_CONFIGS
    ],
)
def test_tokens_do_not_change_with_chunks_prefix_hits_or_offload(
    config_name: str, precision: str, smollm2_dir: Path, smol_chat_prompts: list[list[int]]
) -> None:
    expected = _plain(smollm2_dir, tuple(map(tuple, smol_chat_prompts)), precision)
    with Engine.from_pretrained(smollm2_dir, **PRECISIONS[precision], **SMOL_CONFIGS[config_name]) as engine:
        _runs_as_named(engine, precision)
        # The shared system prompt: the second round hits the prefix cache.
        assert engine.generate(smol_chat_prompts, NEW_TOKENS, ignore_eos=True) == expected
        assert engine.generate(smol_chat_prompts, NEW_TOKENS, ignore_eos=True) == expected
        stats = engine.stats()
        if config_name == "roomy":
            assert stats["prefix_hit_tokens"] > 0, stats
        if config_name == "swap":
            assert stats["swap_restores"] > 0, stats
        if config_name == "soft_reset":
            assert stats["soft_resets"] > 0, stats
        assert_no_leak(engine)


def test_bf16_halves_the_weight_bytes_and_the_kv_bytes_per_token(smollm2_dir: Path) -> None:
    with (
        Engine.from_pretrained(smollm2_dir, num_blocks=8) as fp32,
        Engine.from_pretrained(smollm2_dir, dtype=torch.bfloat16, num_blocks=8) as bf16,
    ):
        assert bf16.geometry.bytes_per_token * 2 == fp32.geometry.bytes_per_token
        assert bf16.runner.kv_pool.nbytes * 2 == fp32.runner.kv_pool.nbytes
        # Plain and packed copies alike (what the worker's start-up line states), within the panels'
        # padding: a pair of k per lane pads an odd K, a panel of columns a partial last one.
        weights = {e.runner.describe()["weight_bytes"] for e in (fp32, bf16)}
        assert fp32.runner.weight_bytes() == pytest.approx(2 * bf16.runner.weight_bytes(), rel=1e-3), weights


def test_int8_kv_holds_nearly_four_times_the_tokens_of_float32_per_byte(smollm2_dir: Path) -> None:
    """Each (token, kv head) row: head_dim int8 values and a 4-byte scale, (64 + 4) / (4 x 64) of
    float32's bytes for SmolLM2; what the start-up line states (kv_bytes_per_token)."""
    with (
        Engine.from_pretrained(smollm2_dir, num_blocks=8) as fp32,
        Engine.from_pretrained(smollm2_dir, kv_cache_dtype="int8", num_blocks=8) as int8,
    ):
        d = fp32.geometry.head_dim
        assert int8.geometry.bytes_per_token * 4 * d == fp32.geometry.bytes_per_token * (d + 4)
        assert int8.runner.kv_pool.nbytes * 4 * d == fp32.runner.kv_pool.nbytes * (d + 4)
        assert int8.runner.describe()["kv_dtype"] == "int8"


def test_auto_dtype_is_bfloat16_only_where_the_cpu_computes_it(
    monkeypatch: pytest.MonkeyPatch, smollm2_dir: Path
) -> None:
    from services.common import precision

    native = bool(precision.NATIVE_BF16_FLAGS & precision.cpu_flags())
    auto = torch.bfloat16 if native else torch.float32
    assert precision.resolve_dtype("auto", smollm2_dir, "cpu") == auto
    assert precision.resolve_dtype("float32", smollm2_dir, "cpu") == torch.float32
    assert precision.resolve_dtype("auto", smollm2_dir, "cuda:0") == torch.bfloat16
    monkeypatch.setenv("CBSERVE_CPU_ISA", "avx2")  # kernels held below bfloat16: float32
    assert precision.resolve_dtype("auto", smollm2_dir, "cpu") == torch.float32
    with pytest.raises(ValueError, match="'int4'"):
        precision.resolve_dtype("int4", smollm2_dir, "cpu")


@pytest.mark.parametrize("isa", ["native", "avx2", "portable", "off"])
def test_auto_keeps_a_bfloat16_checkpoint_in_bfloat16_wherever_the_kernels_widen_it(
    isa: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Widening bfloat16 weights is exact, so on the AVX2 path a bfloat16 checkpoint keeps them (half
    the bytes a decode step reads); a float16 one runs float32 there, as bfloat16 would round it. The
    portable path, and no native kernels at all ("off"), have only torch's bfloat16 products: float32
    unless the CPU computes bfloat16 itself."""
    from services.common import precision

    if isa == "off":
        monkeypatch.setenv(precision.NATIVE_SWITCH, "0")
    else:
        monkeypatch.setenv(precision.ISA_SWITCH, isa)
    flags = precision.cpu_flags()
    native = isa in ("native", "off") and bool(precision.NATIVE_BF16_FLAGS & flags)
    widens = isa in ("native", "avx2") and {"avx2", "fma"} <= flags
    for stored, want in (
        ("bfloat16", torch.bfloat16 if native or widens else torch.float32),
        ("float16", torch.bfloat16 if native else torch.float32),
        ("float32", torch.bfloat16 if native else torch.float32),
    ):
        checkpoint = tmp_path / stored
        checkpoint.mkdir()
        (checkpoint / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": stored}))
        weights = precision.resolve_dtype("auto", checkpoint, "cpu")
        assert weights == want, (stored, isa)
        pages = precision.resolve_kv_cache_dtype("auto", "auto", weights, "cpu")
        assert pages == (torch.float16 if weights == torch.float32 and "f16c" in flags else weights)


def test_auto_kv_pages_are_float16_beside_float32_that_auto_chose_on_a_cpu() -> None:
    """As OpenVINO GenAI's and llama.cpp's defaults on CPUs without native bfloat16; `--dtype float32`
    (exact) keeps float32 pages, and an explicit `--kv-cache-dtype` is what it says."""
    from services.common.precision import cpu_flags, resolve_kv_cache_dtype

    f32, bf16 = torch.float32, torch.bfloat16
    half = torch.float16 if "f16c" in cpu_flags() else f32
    assert resolve_kv_cache_dtype("auto", "auto", f32, "cpu") == half
    assert resolve_kv_cache_dtype("auto", "float32", f32, "cpu") == f32
    assert resolve_kv_cache_dtype("auto", "auto", bf16, "cpu") == bf16
    assert resolve_kv_cache_dtype("auto", "auto", f32, "cuda:0") == f32
    assert resolve_kv_cache_dtype("float32", "auto", f32, "cpu") == f32
    assert resolve_kv_cache_dtype("int8", "float32", f32, "cpu") == torch.int8
    with pytest.raises(ValueError, match="'fp8'"):
        resolve_kv_cache_dtype("fp8", "auto", f32, "cpu")


# int8 layers (`--quantization`), over float32 weights elsewhere, and with int8 KV pages as well over
# bfloat16 weights (`engine:bfloat16+int8+kv-int8`, the bench's fastest engine): teacher-forced top-1
# agreement with float32. Issue 48 asks 0.97 of int8 weights. The int8 products are exact integer sums
# on every vector path, but the float32 work around them (norms, attention, the head, the reference's
# own GEMM) sums in each path's order, and rounding activations to int8 turns those last-bit
# differences into a spread of several positions between CPUs (docs/performance.md has each path's
# figures). The floors sit a few positions below the lowest path's, so that a change that loses more
# than that spread fails.
INT8_FLOORS = {"int8": 0.972, "int8-weight-only": 0.972, "bfloat16+int8+kv-int8": 0.972}


def _int8_layers(engine: Engine, dtype: torch.dtype = torch.float32) -> None:
    """Every linear of the engine's layers multiplies int8 panels; the LM head keeps the model's dtype."""
    fused = engine.runner.fused
    assert fused is not None
    panels = [w.packed for layer in fused.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert {p.dtype for p in panels} == {torch.int8}
    assert fused.lm_head.packed.dtype == dtype


@pytest.mark.parametrize(
    "quantization",
    # weight-only int8's panels are held to their sums in tests/test_panel_linear_int8.py.
    [pytest.param(q, marks=pytest.mark.slow) if q == "int8-weight-only" else q for q in INT8_FLOORS],
)
def test_int8_teacher_forced_top1_agreement_with_float32(
    quantization: str, smollm2_dir: Path, record_property: Any
) -> None:
    from services.worker import kernels
    from tests.kernel_modules import built

    built(kernels.packed_linear_ops(torch.int8), "int8 panel linears")
    prompts, expected = _prose(smollm2_dir)
    dtype, layers, kv = (
        ("float32", quantization, "auto") if "+" not in quantization else quantization.split("+")
    )
    with Engine.from_pretrained(
        smollm2_dir,
        dtype=getattr(torch, dtype),
        quantization=layers,
        kv_cache_dtype=kv.removeprefix("kv-"),
        num_blocks=160,
    ) as engine:
        _int8_layers(engine, getattr(torch, dtype))
        assert engine.runner.describe()["quantization"] == layers
        assert engine.runner.kv_pool.dtype == (torch.int8 if kv != "auto" else torch.float32)
        same, total = agreement(expected, engine_top1(engine, prompts))
        assert_no_leak(engine)
    record_property("agreement", f"{same}/{total}")
    print(f"teacher-forced top-1 agreement ({quantization}): {same}/{total} = {same / total:.4f}")
    assert total > 3000
    assert same / total >= INT8_FLOORS[quantization], (same, total)


def test_int8_quarters_the_layers_weight_bytes(smollm2_dir: Path) -> None:
    """The int8 panels are a quarter of float32's plus two lines (scales, offsets) per group of G k:
    (1/4 + 2/G) of float32's where G divides K (SmolLM2's 576 and 1536), and they are the layers'
    only copy: what the start-up line states drops by the float32 panels (and the copy that many
    rows go to, where this CPU's crossover keeps one), less the int8 ones. Neither holds the plain
    weights: the fused forward lets them go."""
    from services.worker import kernels
    from tests.kernel_modules import built, panel_linear_module

    built(kernels.packed_linear_ops(torch.int8), "int8 panel linears")
    group = panel_linear_module().int8_group()
    with (
        Engine.from_pretrained(smollm2_dir, num_blocks=8) as fp32,
        Engine.from_pretrained(smollm2_dir, quantization="int8", num_blocks=8) as int8,
    ):
        _int8_layers(int8)
        layers = [
            [w for layer in e.runner.fused.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            for e in (fp32, int8)
        ]
        many_rows = sum(
            w.many_rows.numel() * w.many_rows.element_size() for w in layers[0] if w.many_rows is not None
        )
        panels32, panels8 = (sum(w.packed.nbytes for w in ws) for ws in layers)
        assert all(w.weight.device.type == "meta" for w in layers[0])
        assert all(w.weight.device.type == "meta" and w.many_rows is None for w in layers[1])
        for w32, w8 in zip(*layers, strict=True):  # [panels, lines, 4 x panel width]: a line per 4 k
            panels, k, lanes = w32.packed.shape
            assert k % group == 0 and w8.packed.shape == (panels, k // 4 + 2 * (k // group), 4 * lanes)
        assert 4 * group * panels8 == (group + 8) * panels32, (panels8, panels32)  # 1/4 + 2/group
        assert fp32.runner.weight_bytes() - int8.runner.weight_bytes() == many_rows + panels32 - panels8
        stated = [e.runner.describe()["weight_bytes"] for e in (int8, fp32)]
        print(f"weight_bytes: int8 {stated[0]} / float32 {stated[1]} = {stated[0] / stated[1]:.3f}")


def test_int8_is_refused_where_our_forward_does_not_run(tiny_models: Any) -> None:
    """A model our own forward does not take (here Gemma 2's) would run transformers' forward in its
    dtype: the flag would be silently ignored. It is refused, naming the flag."""
    with pytest.raises(ValueError, match="--quantization int8 needs our own forward"):
        Engine.from_pretrained(tiny_models("gemma2"), quantization="int8", num_blocks=8)
    with pytest.raises(ValueError, match="one of none, int8, int8-weight-only, got 'int4'"):
        Engine.from_pretrained(tiny_models("llama"), quantization="int4", num_blocks=8)


@pytest.mark.slow  # one flag each; the default run starts the stack with all three
def test_an_int8_stack_streams_the_int8_engines_tokens(
    smollm2_dir: Path, smol_chat_prompts: list[list[int]], tmp_path: Path
) -> None:
    """`cbserve up --quantization int8`: the setting reaches the worker process (its start-up line says
    so, with the int8 products' path and the weight bytes) and its tokens are the in-process engine's."""
    from services.worker import kernels
    from tests.kernel_modules import built

    built(kernels.packed_linear_ops(torch.int8), "int8 panel linears")
    prompts = smol_chat_prompts[:2]
    with Engine.from_pretrained(smollm2_dir, quantization="int8", num_blocks=64, page_size=16) as engine:
        expected = engine.generate(prompts, NEW_TOKENS, ignore_eos=True)
        weight_bytes = engine.runner.weight_bytes()
    with _stack_streaming(smollm2_dir, tmp_path, ["--quantization", "int8"], prompts, expected) as stack:
        (ready,) = stack.events("worker ready")
        assert (ready["quantization"], ready["int8_path"]) == ("int8", kernels.int8_path()), ready
        assert ready["weight_bytes"] == weight_bytes, ready


_LOWER_PATH_SCRIPT = """
import json, sys, torch
from transformers import AutoTokenizer
from services.bench.agreement import engine_top1, prose_conversations
from services.worker.engine import Engine
model_dir, expected = sys.argv[1], json.loads(sys.stdin.read())
prompts = prose_conversations(AutoTokenizer.from_pretrained(model_dir))[: len(expected)]
with Engine.from_pretrained(model_dir, dtype=torch.bfloat16, num_blocks=64) as engine:
    print(json.dumps({"runs": engine.runner.describe(), "top1": engine_top1(engine, prompts)}))
"""


# AVX-512 without BF16 compiles all three kernels once more: the slow run's (its panels are checked
# by tests/test_panel_linear_bf16.py in the default run).
@pytest.mark.parametrize("isa", [pytest.param("avx512", marks=pytest.mark.slow), "avx2"])
def test_a_cpu_without_avx512_bf16_runs_bf16_on_the_widened_path(
    isa: str, smollm2_dir: Path, record_property: Any
) -> None:
    """Held below AVX512-BF16 (CBSERVE_CPU_ISA, as on a CPU without it), bfloat16 weights run on the
    panels' widened path: named in what the worker logs at start, and as close to float32."""
    import json
    import os
    import subprocess
    import sys

    from services.common.precision import cpu_flags
    from tests.stack import REPO

    needs = {"avx512": {"avx512f"}, "avx2": {"avx2", "fma"}}[isa]
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU has no {isa}")
    if isa == "avx2" and "avx512f" not in cpu_flags():
        pytest.skip("avx2 is this CPU's best path: the bfloat16 agreement test above ran it")
    expected = _prose(smollm2_dir)[1][:3]
    done = subprocess.run(
        [sys.executable, "-c", _LOWER_PATH_SCRIPT, str(smollm2_dir)],
        input=json.dumps(expected),
        cwd=REPO,
        env={**os.environ, "CBSERVE_CPU_ISA": isa},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    runs = result["runs"]
    assert runs["forward"] == "native" and runs["weights"] == "bfloat16", runs
    assert runs["kernel_paths"] == {"paged_attention": isa, "panel_linear": isa}, runs
    same, total = agreement(expected, result["top1"])
    record_property("agreement", f"{same}/{total}")
    assert same / total >= 0.99, (same, total)


@pytest.mark.slow  # one flag each; the default run starts the stack with all three
def test_a_bf16_stack_streams_the_bf16_engines_tokens(
    smollm2_dir: Path, smol_chat_prompts: list[list[int]], tmp_path: Path
) -> None:
    """`cbserve up --dtype bfloat16`: the cachemgr's pool in bfloat16 shared memory, the worker's own
    forward on it, the tokens the in-process engine gives, and the start-up lines say so."""
    expected = _plain(smollm2_dir, tuple(map(tuple, smol_chat_prompts)))
    up_args = ["--dtype", "bfloat16"]
    with _stack_streaming(smollm2_dir, tmp_path, up_args, smol_chat_prompts, expected) as stack:
        (ready,) = stack.events("worker ready")
        assert (ready["forward"], ready["weights"], ready["kv_dtype"]) == ("native", "bfloat16", "bfloat16")
        assert ready["activations"] == "float32", ready
        (sized,) = stack.events("kv cache sized")
        assert sized["kv_dtype"] == "bfloat16" and sized["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2, sized
        serving = [line for line in stack.log_path.read_text().splitlines() if line.startswith("serving ")]
        assert len(serving) == 1 and " in bfloat16 on " in serving[0] and "bfloat16)" in serving[0], serving


def test_the_default_stack_runs_the_precision_auto_resolves_here(
    smollm2_dir: Path, smol_chat_prompts: list[list[int]], tmp_path: Path
) -> None:
    """`cbserve up --dtype auto`, as `make serve` starts it: bfloat16 weights and pages on a CPU that
    computes bfloat16, else float32 weights over float16 pages; both processes resolve `auto` alike (the
    worker's forward and the cachemgr's pool), the stack streams the in-process engine's tokens at that
    precision, and the serving line names both dtypes."""
    from services.common.precision import dtype_name, resolve_dtype, resolve_kv_cache_dtype

    weights = resolve_dtype("auto", smollm2_dir, "cpu")
    kv = resolve_kv_cache_dtype("auto", "auto", weights, "cpu")
    prompts = smol_chat_prompts[:2]
    with Engine.from_pretrained(
        smollm2_dir, dtype=weights, kv_cache_dtype=dtype_name(kv), num_blocks=64, page_size=16
    ) as engine:
        expected = engine.generate(prompts, NEW_TOKENS, ignore_eos=True)
    with _stack_streaming(smollm2_dir, tmp_path, ["--dtype", "auto"], prompts, expected) as stack:
        (ready,) = stack.events("worker ready")
        assert (ready["forward"], ready["weights"], ready["kv_dtype"]) == (
            "native",
            *map(dtype_name, (weights, kv)),
        )
        (sized,) = stack.events("kv cache sized")
        assert sized["kv_dtype"] == dtype_name(kv) and sized["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2, (
            sized
        )
        serving = [line for line in stack.log_path.read_text().splitlines() if line.startswith("serving ")]
        assert len(serving) == 1 and f" in {dtype_name(weights)} on " in serving[0], serving
        assert f"{dtype_name(kv)})" in serving[0], serving


@pytest.mark.slow  # one flag each; the default run starts the stack with all three
def test_an_int8_kv_stack_streams_the_int8_engines_tokens(
    smollm2_dir: Path, smol_chat_prompts: list[list[int]], tmp_path: Path
) -> None:
    """`cbserve up --kv-cache-dtype int8`: the cachemgr's pool of int8 rows (values and scales) in shared
    memory, the worker's kernels on it, the tokens the in-process engine gives, and the start-up line's
    bytes per token: rows of 64 + 4 bytes, (64 + 4) / (4 x 64) of float32's."""
    expected = _plain(smollm2_dir, tuple(map(tuple, smol_chat_prompts)), "int8-kv")
    up_args = ["--kv-cache-dtype", "int8"]
    with _stack_streaming(smollm2_dir, tmp_path, up_args, smol_chat_prompts, expected) as stack:
        (ready,) = stack.events("worker ready")
        assert (ready["weights"], ready["kv_dtype"]) == ("float32", "int8"), ready
        (sized,) = stack.events("kv cache sized")
        assert sized["kv_dtype"] == "int8" and sized["kv_bytes_per_token"] == 30 * 2 * 3 * (64 + 4), sized


def test_a_stack_with_every_precision_flag_streams_its_engines_tokens(
    smollm2_dir: Path, smol_chat_prompts: list[list[int]], tmp_path: Path
) -> None:
    """`cbserve up --dtype bfloat16 --quantization int8 --kv-cache-dtype int8` (the bench's fastest
    engine): each flag reaches its process (the worker's start-up line names the weights, the int8
    products' path and the weight bytes; the cachemgr's sizes rows of 64 + 4 bytes) and the stack
    streams the in-process engine's tokens."""
    from services.worker import kernels
    from tests.kernel_modules import built

    built(kernels.packed_linear_ops(torch.int8), "int8 panel linears")
    prompts = smol_chat_prompts[:2]
    settings: dict[str, Any] = {"dtype": torch.bfloat16, "quantization": "int8", "kv_cache_dtype": "int8"}
    with Engine.from_pretrained(smollm2_dir, **settings, num_blocks=64, page_size=16) as engine:
        expected = engine.generate(prompts, NEW_TOKENS, ignore_eos=True)
        weight_bytes = engine.runner.weight_bytes()
    up_args = ["--dtype", "bfloat16", "--quantization", "int8", "--kv-cache-dtype", "int8"]
    with _stack_streaming(smollm2_dir, tmp_path, up_args, prompts, expected) as stack:
        (ready,) = stack.events("worker ready")
        assert (ready["forward"], ready["weights"], ready["kv_dtype"]) == ("native", "bfloat16", "int8"), (
            ready
        )
        assert (ready["quantization"], ready["int8_path"]) == ("int8", kernels.int8_path()), ready
        assert ready["weight_bytes"] == weight_bytes, ready
        (sized,) = stack.events("kv cache sized")
        assert sized["kv_dtype"] == "int8" and sized["kv_bytes_per_token"] == 30 * 2 * 3 * (64 + 4), sized
