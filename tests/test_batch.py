"""BatchBuilder: the decode steps' own build gives the batch the general build gives, for the native
decode kernel (no mask) and for SDPA (a mask; a GPU's, with the buckets of its graphs)."""

from __future__ import annotations

import random

import pytest
import torch

from services.common.kv_geometry import KVGeometry
from services.worker.batch import BatchBuilder, BatchItem, ForwardBatch
from services.worker.buckets import Shape, round_up

PAGE = 4
GEOMETRIES = {
    "full": KVGeometry(2, 2, 8, PAGE, 4, ("full",) * 2, None),
    # One full layer to three sliding ones: the sliding group's blocks are three chunks, three views.
    "sliding": KVGeometry(4, 2, 8, PAGE, 4, ("full", "sliding", "sliding", "sliding"), 5),
}


def _builder(geometry: KVGeometry, q_padding: int, kv_padding: int, kernel: bool = True) -> BatchBuilder:
    # With a decode kernel (the build never calls it) decode rows need no mask; without, SDPA's.
    return BatchBuilder(
        geometry,
        [],
        64,
        query_group=2,
        q_padding=q_padding,
        kv_padding=kv_padding,
        decode_kernel=print if kernel else None,
    )


def _items(rng: random.Random, geometry: KVGeometry) -> list[BatchItem]:
    items = []
    for _ in range(rng.randint(1, 6)):
        start = rng.randint(0, 40)
        tables = []
        for g, kind in enumerate(geometry.groups):
            blocks = start // PAGE + 1 + rng.randint(0, 1)  # a block ahead, at times
            table = [rng.randint(1, 500) for _ in range(blocks * geometry.chunks_per_block(g))]
            if kind == "sliding":  # pages the window has left behind are recycled: -1
                behind = max(0, (start - geometry.sliding_window) // PAGE) * geometry.chunks_per_block(g)
                table[:behind] = [-1] * behind
            tables.append(table)
        items.append(BatchItem(start, [rng.randint(0, 99)], tables, sample=rng.random() < 0.8))
    return items


def _assert_same(a: ForwardBatch, b: ForwardBatch) -> None:
    for name in ("input_ids", "position_ids", "logits_indices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    x, y = a.attention, b.attention
    assert x.num_tokens == y.num_tokens and x.prefill == y.prefill
    assert x.write_slots.keys() == y.write_slots.keys()
    for view in x.write_slots:
        assert torch.equal(x.write_slots[view], y.write_slots[view]), view
    assert x.groups.keys() == y.groups.keys()
    for g in x.groups:
        (p,), (q,) = x.groups[g], y.groups[g]
        assert (p.num_queries, p.num_keys, p.kept, q.kept) == (q.num_queries, q.num_keys, None, None)
        assert (p.bias is None) == (q.bias is None)
        if p.bias is not None:
            assert p.bias.dtype == q.bias.dtype and torch.equal(p.bias, q.bias)
        assert torch.equal(p.rows, q.rows) and torch.equal(p.lengths, q.lengths)
        assert p.slots.keys() == q.slots.keys()
        for view in p.slots:
            assert torch.equal(p.slots[view], q.slots[view]), (g, view)


@pytest.mark.parametrize("kernel", [True, False], ids=["native", "sdpa"])
@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize(("q_padding", "kv_padding"), [(0, 0), (4, 8)])
def test_decode_build_equals_the_general_build(
    name: str, q_padding: int, kv_padding: int, kernel: bool
) -> None:
    geometry = GEOMETRIES[name]
    rng = random.Random(f"{name}-{q_padding}")
    fast = _builder(geometry, q_padding, kv_padding, kernel)
    general = _builder(geometry, q_padding, kv_padding, kernel)
    for _ in range(50):
        items = _items(rng, geometry)
        _assert_same(fast.build(items), general._build_any(items))
    assert fast.padded_queries == general.padded_queries
    assert fast.padded_keys == general.padded_keys
    if kv_padding:
        assert fast.padded_keys > 0  # else the padded case proved nothing


def test_batches_with_longer_items_take_the_general_build() -> None:
    builder = _builder(GEOMETRIES["full"], 0, 0)
    batch = builder.build([BatchItem(0, [5, 6, 7], [[1]], sample=True), BatchItem(9, [8], [[2, 3, 4]], True)])
    decode, prefill = batch.attention.groups[0]
    assert (decode.num_queries, prefill.num_queries) == (1, 3)
    assert decode.bias is None and prefill.bias is not None  # the kernel reads no mask; SDPA does


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_a_bucket_build_equals_the_general_build(name: str) -> None:
    """A decode step built for a CUDA graph's bucket: phantom rows up to its tokens, its keys. The
    general build of the same items with the phantom rows appended, keys padded to the bucket's, is
    the same batch."""
    geometry = GEOMETRIES[name]
    rng = random.Random(f"bucket-{name}")
    fast = _builder(geometry, 4, 8, kernel=False)
    phantoms = 0
    for _ in range(50):
        items = _items(rng, geometry)
        shape = Shape(round_up(len(items) + rng.randint(0, 4), 4), 48 + 8 * rng.randint(0, 2))
        general = _builder(geometry, 4, shape.keys, kernel=False)
        padded = [*items, *[general.phantom] * (shape.tokens - len(items))]
        phantoms += shape.tokens - len(items)
        batch = fast.build(items, shape)
        assert batch.shape == shape
        _assert_same(batch, general._build_any(padded))
    assert fast.padded_queries == phantoms > 0
    assert fast.padded_keys > 0
    with pytest.raises(ValueError, match="bucket takes at most 4"):
        fast.build(_items(rng, geometry) * 5, Shape(4, 48))
    prompt = BatchItem(0, [5, 6, 7], [[1]] * len(geometry.groups), sample=True)
    with pytest.raises(ValueError, match="takes one-token requests only"):
        fast.build([prompt], Shape(4, 48))
