"""BatchBuilder: the decode steps' own build gives the batch the general build gives."""

from __future__ import annotations

import random

import pytest
import torch

from services.common.kv_geometry import KVGeometry
from services.worker.batch import BatchBuilder, BatchItem, ForwardBatch

PAGE = 4
GEOMETRIES = {
    "full": KVGeometry(2, 2, 8, PAGE, 4, ("full",) * 2, None),
    # One full layer to three sliding ones: the sliding group's blocks are three chunks, three views.
    "sliding": KVGeometry(4, 2, 8, PAGE, 4, ("full", "sliding", "sliding", "sliding"), 5),
}


def _builder(geometry: KVGeometry, q_padding: int, kv_padding: int) -> BatchBuilder:
    # The decode path needs a decode kernel to be present; the build never calls it.
    return BatchBuilder(
        geometry, [], 64, query_group=2, q_padding=q_padding, kv_padding=kv_padding, decode_kernel=print
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
        assert (p.num_queries, p.num_keys, p.kept, p.bias) == (q.num_queries, q.num_keys, None, None)
        assert torch.equal(p.rows, q.rows) and torch.equal(p.lengths, q.lengths)
        assert p.slots.keys() == q.slots.keys()
        for view in p.slots:
            assert torch.equal(p.slots[view], q.slots[view]), (g, view)


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
@pytest.mark.parametrize(("q_padding", "kv_padding"), [(0, 0), (4, 8)])
def test_decode_build_equals_the_general_build(name: str, q_padding: int, kv_padding: int) -> None:
    geometry = GEOMETRIES[name]
    rng = random.Random(f"{name}-{q_padding}")
    fast, general = _builder(geometry, q_padding, kv_padding), _builder(geometry, q_padding, kv_padding)
    for _ in range(50):
        items = _items(rng, geometry)
        _assert_same(fast.build(items), general._build_any(items, None))
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
