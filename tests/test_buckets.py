"""Padding buckets: every step within the largest shape has exactly one bucket that holds it, the
table stays within its bound, and a step beyond it has none (it runs eagerly)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.worker.buckets import Buckets, Shape, round_up


def test_round_up() -> None:
    assert [round_up(n, 8) for n in (1, 8, 9, 16)] == [8, 8, 16, 16]
    assert round_up(13, 0) == 13  # interval 0: no padding


def test_the_key_range_is_cut_to_fit_the_bound() -> None:
    buckets = Buckets.plan(8, 256, max_tokens=64, max_keys=131072, max_shapes=128)
    assert (buckets.max_tokens, buckets.max_keys) == (64, 16 * 256)
    shapes = buckets.shapes()
    assert len(shapes) == 128 and shapes[0] == Shape(64, 4096) and shapes[-1] == Shape(8, 256)
    assert shapes == sorted(shapes, reverse=True)  # largest first: later captures reuse its memory
    assert buckets.shape_of(3, 1) == Shape(8, 256)
    assert buckets.shape_of(64, 4096) == Shape(64, 4096)
    assert buckets.shape_of(65, 10) is None and buckets.shape_of(1, 4097) is None


def test_token_counts_are_cut_only_when_they_alone_exceed_the_bound() -> None:
    buckets = Buckets.plan(1, 64, max_tokens=256, max_keys=1000, max_shapes=100)
    assert (buckets.max_tokens, buckets.max_keys, len(buckets.shapes())) == (100, 64, 100)


def test_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Buckets.plan(0, 256, 64, 1024, 128)


@given(
    q=st.integers(1, 32),
    kv=st.integers(1, 512),
    max_tokens=st.integers(1, 300),
    max_keys=st.integers(1, 9000),
    max_shapes=st.integers(1, 300),
    tokens=st.integers(1, 400),
    keys=st.integers(1, 10000),
)
def test_each_step_has_the_smallest_bucket_that_holds_it(
    q: int, kv: int, max_tokens: int, max_keys: int, max_shapes: int, tokens: int, keys: int
) -> None:
    buckets = Buckets.plan(q, kv, max_tokens, max_keys, max_shapes)
    shapes = buckets.shapes()
    assert 1 <= len(shapes) <= max_shapes and len(set(shapes)) == len(shapes)
    assert buckets.max_tokens <= round_up(max_tokens, q) and buckets.max_keys <= round_up(max_keys, kv)
    shape = buckets.shape_of(tokens, keys)
    if tokens <= buckets.max_tokens and keys <= buckets.max_keys:
        assert shape in shapes
        assert shape is not None and tokens <= shape.tokens < tokens + q and keys <= shape.keys < keys + kv
    else:
        assert shape is None
