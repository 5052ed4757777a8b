"""`cbserve bench roofline`: the read probe reads what it is given, and a decode point counts the
bytes its steps must read and the multiply-adds they must do from the engine it runs (no timing is
asserted)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.bench.roofline import decode_point, measure_multiply_rate
from services.worker.engine import Engine
from services.worker.kernels import memory_probe
from tests.parity import assert_no_leak


def test_read_probe_reads_every_word() -> None:
    probe = memory_probe()
    if probe is None:
        pytest.skip("native kernels unavailable")
    words = torch.arange(1, 1001, dtype=torch.int64)
    expected = 0
    for w in words.tolist():
        expected ^= w
    assert probe.read_all(words) == expected
    words[777] = 0  # one word changed anywhere changes the answer: none is skipped
    assert probe.read_all(words) != expected
    with pytest.raises(RuntimeError, match="multiple of 8 bytes"):
        probe.read_all(torch.zeros(5, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_point_counts_weights_and_kv(tiny_models: Callable[[str], Path], dtype: torch.dtype) -> None:
    with Engine.from_pretrained(tiny_models("llama"), dtype=dtype, num_blocks=32, page_size=8) as engine:
        point = decode_point(engine, in_flight=3, context=20, steps=5, read_rate=1e10, multiply_rate=1e11)
        model = engine.model
        embedding = model.get_input_embeddings().weight
        tied = embedding.data_ptr() == model.get_output_embeddings().weight.data_ptr()
        # Every matrix is read whole by each step but the input embedding (a row a token), unless the
        # LM head shares it.
        read = [p for p in model.parameters() if p.dim() == 2 and (p is not embedding or tied)]
        matrices = sum(p.numel() * p.element_size() for p in read)
        # Panels pad the last panel's columns and may add their scales, never drop a weight.
        assert matrices <= point.weight_bytes <= 1.25 * matrices
        per_token = engine.geometry.bytes_per_token
        # Each request read its 20 prompt tokens, the 4 warm-up ones and, on average, half the timed ones.
        assert point.kv_bytes == round(3 * (20 + 4 + 5 / 2) * per_token)
        # Each row multiplies by every matrix read, and each query head takes a dot with every key and
        # adds up the V rows: 2 FLOPs each per dim.
        config = model.config
        heads = config.num_attention_heads
        attention = 4 * (20 + 4 + 5 / 2) * heads * engine.geometry.head_dim * config.num_hidden_layers
        assert point.flops == round(3 * (2 * sum(p.numel() for p in read) + attention))
        assert point.step_s > 0 and point.fraction > 0 and point.multiply_fraction > 0
        assert point.roofline_fraction == max(point.fraction, point.multiply_fraction)
        assert_no_leak(engine)  # the point's requests ran to their end


def test_multiply_probe_gives_a_rate(tiny_models: Callable[[str], Path]) -> None:
    llama = tiny_models("llama")
    with Engine.from_pretrained(llama, dtype=torch.bfloat16, num_blocks=32, page_size=8) as engine:
        assert 1e6 < measure_multiply_rate(engine, repeats=1) < 1e16
