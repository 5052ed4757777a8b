"""Piecewise CUDA graphs of prefill and mixed steps (worker/piecewise_graphs.py).

On a CPU the pieces run through `eager_capture` under the capture guard (tests/capture_guard.py):
the same buckets, phantom tokens and static buffers, each piece run eagerly. Our CPU forward
(FusedLlama, native kernels) shares the pieces with the GPU's (GpuLlama), so it runs them here in
milliseconds; tests/test_gpu_llama.py runs GpuLlama's under Triton's interpreter. The `cuda_only`
test captures real graphs; `make gpu-check` runs it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.common.kv_geometry import PADDING_SLOT
from services.worker import cuda_graphs
from services.worker.batch import BatchItem
from services.worker.engine import Engine
from services.worker.model_runner import ModelRunner
from services.worker.piecewise_graphs import piece_buckets
from tests.capture_guard import guarded_capture
from tests.cuda_marks import cuda_only
from tests.parity import NEW_TOKENS, assert_no_leak, make_prompts, reference, reference_attn
from tests.step_kinds import step_kinds


def test_buckets_are_powers_of_two_then_multiples_of_the_interval() -> None:
    assert piece_buckets(8, 512) == [512, 448, 384, 320, 256, 192, 128, 64, 32, 16, 8]
    assert piece_buckets(8, 100) == [100, 64, 32, 16, 8]  # the largest step the buffers hold
    assert piece_buckets(4, 8) == [8, 4]
    with pytest.raises(ValueError, match="smallest=0"):
        piece_buckets(0, 8)


def test_a_step_is_padded_to_its_bucket_with_phantom_tokens(tiny_models: Callable[[str], Path]) -> None:
    with Engine.from_pretrained(tiny_models("llama"), num_blocks=64, page_size=8) as engine:
        builder = engine.runner.builder
        tables = [[5, 6, 7]]
        items = [BatchItem(0, [3, 4, 5, 6, 7], tables, sample=True), BatchItem(9, [8], tables, sample=True)]
        batch = builder.build(items, tokens=16)
        with pytest.raises(ValueError, match="6 tokens does not fit a bucket of 4"):
            builder.build(items, tokens=4)
    assert batch.piecewise == 16 and batch.input_ids.shape == (1, 16)
    assert batch.input_ids[0, 6:].eq(0).all() and batch.position_ids[0, 6:].eq(0).all()
    for slots in batch.attention.write_slots.values():
        assert (slots[6:] == PADDING_SLOT).all() and (slots[:6] != PADDING_SLOT).all()
    assert batch.logits_indices.tolist() == [4, 5]


def _graphed(engine: Engine) -> ModelRunner:
    """The engine's runner with its decode and piecewise graphs captured under the capture guard; a
    skip where the native kernels are not built (transformers' layers have no pieces)."""
    runner = engine.runner
    if runner.fused is None:
        pytest.skip("the native kernels are not built: transformers' layers have no pieces")
    runner.use_graphs(guarded_capture)
    return runner


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q|k|v biases
def test_greedy_outputs_equal_generate_through_replayed_pieces(
    family: str, tiny_models: Callable[[str], Path]
) -> None:
    """Chunked prefills beside decode rows, then a round whose prompts share a prefix with the first's
    (prefix hits); transformers `generate`, token for token."""
    model_dir = tiny_models(family)
    shared = [random.Random(3).randint(3, 255) for _ in range(40)]
    rounds = [make_prompts(11, 3, shared), make_prompts(12, 3, shared)]
    cb = {"num_blocks": 256, "max_batch_tokens": 16, "long_prefill_token_threshold": 7}
    with Engine.from_pretrained(model_dir, **cb) as engine:
        runner = _graphed(engine)
        pieces = runner.pieces
        assert pieces is not None and pieces.buckets == [16, 8]
        assert pieces.count == 2 * len(runner.fused.layers)  # type: ignore[attr-defined]
        kinds = step_kinds(pieces)
        for prompts in rounds:
            expected = reference(model_dir, reference_attn(family), prompts)
            assert engine.generate(prompts, NEW_TOKENS, ignore_eos=True) == expected
        assert pieces.replays == len(kinds) > 0 and pieces.eager_steps == 0
        assert (True, True) in kinds  # a mixed step: a prompt chunk beside decode rows
        assert runner.graphs is not None and runner.graphs.replays > 0  # decode steps: whole graphs
        assert engine.runner.builder.prompt_chunks > 0
        assert engine.stats()["prefix_hit_tokens"] > 0
        assert_no_leak(engine)


def test_a_decode_step_beyond_every_decode_bucket_replays_the_pieces(
    tiny_models: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 4)  # decode buckets of 8 requests reading 64 keys at most
    model_dir = tiny_models("llama")
    prompts = make_prompts(seed=7)
    cb = {"num_blocks": 256, "kv_padding_interval_size": 16, "max_requests_per_batch": 8}
    with Engine.from_pretrained(model_dir, **cb) as engine:
        runner = _graphed(engine)
        graphs, pieces = runner.graphs, runner.pieces
        assert graphs is not None and pieces is not None
        assert engine.generate(prompts, NEW_TOKENS, ignore_eos=True) == reference(model_dir, "sdpa", prompts)
        # Each decode step beyond the decode buckets replayed the pieces (their other replays are the
        # prompts' steps), and no step was beyond every piece bucket.
        assert pieces.replays >= graphs.eager_decodes > 0 and pieces.eager_steps == 0
        assert_no_leak(engine)


@cuda_only
def test_on_cuda_a_piecewise_replay_computes_what_the_eager_forward_does(
    tiny_models: Callable[[str], Path],
) -> None:
    with Engine.from_pretrained(tiny_models("llama"), device="cuda", num_blocks=64, page_size=8) as engine:
        runner = engine.runner
        assert runner.pieces is not None and runner.describe()["forward"] == "triton"
        first, second = [[2, 3]], [[4, 5, 6]]
        runner._forward(runner.builder.build([BatchItem(0, list(range(3, 20)), second, sample=True)]))
        # A prompt chunk beside a decode row reading the 17 keys written above.
        items = [BatchItem(0, list(range(3, 10)), first, True), BatchItem(17, [7], second, True)]
        tokens = runner.pieces.bucket_for(items)
        assert tokens == 8
        batch = runner.builder.build(items, tokens=tokens)
        replayed = runner.pieces.run(batch)
        eager = runner._forward(runner.builder.build(items))  # the same K/V written again, no pieces
        torch.testing.assert_close(replayed, eager, rtol=0, atol=1e-5)
