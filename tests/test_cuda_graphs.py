"""CUDA graphs of decode steps (worker/cuda_graphs.py).

On a CPU the graphs run through `eager_capture`: the same buckets, phantom rows and static inputs,
and a capture that a dispatch guard watches for what a CUDA graph cannot hold (a tensor's value read
on the host, an output sized by values). The model runs the forward a CUDA device runs
(transformers' modules, gather + SDPA attention), not the CPU's native kernels. The `cuda_only` tests
capture real graphs; `make gpu-check` runs them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.config import CBConfig
from services.common.kv_geometry import PADDING_SLOT
from services.worker import cuda_graphs
from services.worker.batch import BatchItem
from services.worker.buckets import Shape
from services.worker.cuda_graphs import CudaGraphs, eager_capture
from services.worker.engine import Engine
from tests.capture_guard import guarded_capture
from tests.cuda_forward import cuda_like
from tests.cuda_marks import CUDA_MARKS, cuda_only
from tests.parity import (
    NEW_TOKENS,
    SWAP_BLOCKS,
    assert_no_leak,
    generate_reference,
    make_prompts,
    reference,
    reference_attn,
)

FAMILIES = ("llama", "mistral", "gemma2", "qwen3")  # full, sliding, hybrid with softcap, q/k norms
# Decode steps of several sizes and contexts between chunked prefills, and a swap round trip.
CONFIGS: dict[str, dict[str, Any]] = {
    "chunked": {"num_blocks": 256, "max_batch_tokens": 16, "long_prefill_token_threshold": 7},
    "swap": {"page_size": 8, "cpu_offload_space": 0.01, "kv_padding_interval_size": 16},
}


def engine_for(model_dir: Path, family: str, config_name: str, device: str, **overrides: Any) -> Engine:
    cb = CONFIGS[config_name] | overrides
    if config_name == "swap":
        cb.setdefault("num_blocks", SWAP_BLOCKS[family])
    return Engine.from_pretrained(model_dir, device=device, **cb)


@pytest.fixture(scope="module")
def cuda_reference() -> Callable[[Path, str, list[list[int]]], list[list[int]]]:
    """`generate_reference` on the CUDA device: what the engine must match there."""
    cached: dict[tuple[Path, str, tuple[tuple[int, ...], ...]], list[list[int]]] = {}

    def generate(model_dir: Path, attn: str, prompts: list[list[int]]) -> list[list[int]]:
        key = (model_dir, attn, tuple(map(tuple, prompts)))
        if key not in cached:
            cached[key] = generate_reference(model_dir, prompts, NEW_TOKENS, "cuda", attn)
        return cached[key]

    return generate


# cpu: emulated graphs; cuda: real ones, and the eager forward beside them.
RUNS = [
    pytest.param("cpu", True, id="cpu-emulated-graphs"),
    pytest.param("cuda", True, marks=CUDA_MARKS, id="cuda-graphs"),
    pytest.param("cuda", False, marks=CUDA_MARKS, id="cuda-eager"),
]


# Gemma2's swap round trip under the CPU's emulated graphs (2 minutes of a shared 2-core host) is in
# the slow run; on a CUDA device it stays. The default run still has gemma2 (hybrid, softcap) under
# emulated graphs ([gemma2-chunked-cpu-emulated-graphs]), the swap round trip under emulated graphs
# ([llama-swap-...], [qwen3-swap-...]), and gemma2's swap round trip, sync and async, in
# tests/test_engine_parity.py (test_tiny_family_matches_generate[gemma2-swap-*]).
SLOW_CPU_CASES = {("gemma2", "swap")}
CASES = [
    pytest.param(
        family,
        config_name,
        *run.values,
        marks=(
            *run.marks,
            *(
                (pytest.mark.slow,)
                if run.values[0] == "cpu" and (family, config_name) in SLOW_CPU_CASES
                else ()
            ),
        ),
        id=f"{family}-{config_name}-{run.id}",
    )
    for family in FAMILIES
    for config_name in CONFIGS
    for run in RUNS
]


@pytest.mark.parametrize(("family", "config_name", "device", "use_cuda_graph"), CASES)
def test_greedy_outputs_equal_generate(
    family: str,
    config_name: str,
    device: str,
    use_cuda_graph: bool,
    tiny_models: Callable[[str], Path],
    cuda_reference: Callable[[Path, str, list[list[int]]], list[list[int]]],
) -> None:
    """Chunked prefills and decode steps of many sizes, prefix hits (the second round shares a
    prefix with the first) and a swap round trip; transformers `generate` on the same device."""
    if config_name == "swap" and family not in SWAP_BLOCKS:
        pytest.skip(f"{family} offloads nothing (see SWAP_BLOCKS)")
    model_dir = tiny_models(family)
    shared = [random.Random(3).randint(3, 255) for _ in range(40)]  # a full page of 32 at least
    rounds = [make_prompts(11, 3, shared), make_prompts(12, 4, shared)]
    generate = reference if device == "cpu" else cuda_reference
    if device == "cpu":  # a CPU refuses use_cuda_graph: the emulated graphs come after
        engine = cuda_like(lambda: engine_for(model_dir, family, config_name, device))
        engine.runner.use_graphs(guarded_capture)
    else:
        engine = engine_for(model_dir, family, config_name, device, use_cuda_graph=use_cuda_graph)
    with engine:
        for prompts in rounds:
            expected = generate(model_dir, reference_attn(family), prompts)
            assert engine.generate(prompts, NEW_TOKENS, ignore_eos=True) == expected
        graphs = engine.runner.graphs
        if use_cuda_graph:
            assert graphs is not None and graphs.replays > NEW_TOKENS and graphs.eager_decodes == 0
            assert engine.runner.builder.padded_queries > 0  # phantom rows
        else:
            assert graphs is None
        stats = engine.stats()
        if engine.cache.prefix_caching:
            assert stats["prefix_hit_tokens"] > 0, stats
        if config_name == "swap":
            assert stats["swap_restores"] > 0, stats
        assert_no_leak(engine)


def test_a_decode_step_is_padded_to_its_bucket_with_phantom_rows(tiny_models: Callable[[str], Path]) -> None:
    with cuda_like(
        lambda: Engine.from_pretrained(tiny_models("gemma2"), num_blocks=64, page_size=8)
    ) as engine:
        builder = engine.runner.builder
        tables = [[5, 6, 7], [9, 10, 11]]  # pages of the full and of the sliding group
        items = [BatchItem(20, [7], tables, sample=True), BatchItem(3, [8], tables, sample=False)]
        batch = builder.build(items, Shape(8, 32))
    assert batch.shape == Shape(8, 32) and batch.input_ids.shape == (1, 8)
    assert batch.logits_indices.tolist() == [0]  # phantoms and the non-sampling row are not asked for
    for slots in batch.attention.write_slots.values():
        assert (slots[2:] == PADDING_SLOT).all()  # phantom rows write the padding slot alone
    for groups in batch.attention.groups.values():
        (decode,) = groups
        assert decode.bias.shape[0] == 8 and decode.bias.shape[-1] == 32 and decode.kept is None
        for slots in decode.slots.values():
            assert (slots.view(8, 32)[2:] == PADDING_SLOT).all()  # and read it alone
        assert (decode.bias[2:, :, :, 1:] == float("-inf")).all() and (decode.bias[2:, :, :, 0] == 0).all()


def test_static_inputs_are_views_of_one_buffer_per_input(tiny_models: Callable[[str], Path]) -> None:
    with cuda_like(lambda: Engine.from_pretrained(tiny_models("llama"), num_blocks=64)) as engine:
        engine.runner.use_graphs(eager_capture)
        graphs = engine.runner.graphs
        assert graphs is not None
        inputs = [cuda_graphs._step_inputs(g.inputs) for g in graphs._graphs.values()]
        assert all(len(i) == len(inputs[0]) for i in inputs)
        for position in range(len(inputs[0])):
            assert len({i[position].data_ptr() for i in inputs}) == 1  # the fronts of one buffer
        largest = inputs[0]  # the first captured
        assert graphs._arena.nbytes == sum(t.numel() * t.element_size() for t in largest)
        builder = engine.runner.builder  # whose buffers a replay copies from, never reads
        assert inputs[0][0].data_ptr() != builder.input_buf.data_ptr()


def test_a_decode_step_beyond_every_bucket_runs_eagerly(
    tiny_models: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 4)  # 8 requests reading 64 keys at most
    model_dir = tiny_models("llama")
    prompts = make_prompts(seed=7)
    short = [prompts[0][:10]]  # alone, it fits a bucket throughout
    cb = {"num_blocks": 256, "kv_padding_interval_size": 16, "max_requests_per_batch": 8}
    with cuda_like(lambda: Engine.from_pretrained(model_dir, **cb)) as engine:
        engine.runner.use_graphs(guarded_capture)
        graphs = engine.runner.graphs
        assert graphs is not None and graphs.count == 4
        assert engine.generate(prompts, NEW_TOKENS, ignore_eos=True) == reference(model_dir, "sdpa", prompts)
        assert graphs.eager_decodes > 0
        replays = graphs.replays
        assert engine.generate(short, NEW_TOKENS, ignore_eos=True) == reference(model_dir, "sdpa", short)
        assert graphs.replays - replays == NEW_TOKENS - 1  # every decode step of the short one


@pytest.mark.parametrize("asked", [None, True], ids=["automatic", "asked-for"])
def test_a_failed_capture_serves_eagerly_unless_graphs_were_asked_for(
    asked: bool | None, tiny_models: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(CBConfig, "cuda_graph_enabled", lambda self, device_type: True)  # as on a GPU

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(CudaGraphs, "for_runner", broken)
    model_dir = tiny_models("llama")
    if asked:
        with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
            Engine.from_pretrained(model_dir, num_blocks=64, use_cuda_graph=True)
        return
    prompts = make_prompts(seed=7)
    with Engine.from_pretrained(model_dir, num_blocks=64) as engine:
        assert engine.runner.graphs is None
        assert engine.generate(prompts, NEW_TOKENS, ignore_eos=True) == reference(model_dir, "sdpa", prompts)


def test_graphs_need_a_bucket_the_step_buffers_hold(tiny_models: Callable[[str], Path]) -> None:
    with Engine.from_pretrained(tiny_models("llama"), num_blocks=64, max_batch_tokens=4) as engine:
        with pytest.raises(ValueError, match="holds no bucket of 8 tokens"):
            engine.runner.use_graphs(eager_capture)


@cuda_only
def test_on_cuda_a_replay_computes_what_the_eager_forward_does(tiny_models: Callable[[str], Path]) -> None:
    with Engine.from_pretrained(tiny_models("llama"), device="cuda", num_blocks=64, page_size=8) as engine:
        runner = engine.runner
        assert runner.graphs is not None
        tables = [[2, 3, 4, 5]]
        items = [BatchItem(17, [7], tables, sample=True), BatchItem(30, [9], tables, sample=True)]
        shape = runner.graphs.shape_for(items)
        assert shape is not None
        batch = runner.builder.build(items, shape)
        eager = runner._forward(batch)
        replayed = runner.graphs.replay(batch)
        torch.testing.assert_close(replayed, eager, rtol=0, atol=1e-5)
