"""Padding buckets: the few step shapes that a forward made once per shape (a CUDA graph) is made for.

A step of `n` tokens whose longest request reads `k` keys is padded to `round_up(n, q_interval)`
tokens and `round_up(k, kv_interval)` keys, the seed's `q_padding_interval_size` and
`kv_padding_interval_size`. `BatchBuilder` pads with the same rule whether or not a bucket's
forward exists (the CPU pads eagerly, the same mechanism without the second back end).

The table is bounded: `max_shapes` entries at most. Every token count up to the largest is kept
(a decode step's token count is its number of requests, which changes every step), and the key
range is cut to fit: a step beyond the largest shape has no bucket and runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass


def round_up(n: int, interval: int) -> int:
    return -(-n // interval) * interval if interval > 0 else n


@dataclass(frozen=True, order=True)
class Shape:
    tokens: int  # packed query length, padding included
    keys: int  # keys every request's attention reads, padding included


@dataclass(frozen=True)
class Buckets:
    q_interval: int
    kv_interval: int
    max_tokens: int  # a multiple of q_interval
    max_keys: int  # a multiple of kv_interval

    @classmethod
    def plan(
        cls, q_interval: int, kv_interval: int, max_tokens: int, max_keys: int, max_shapes: int
    ) -> Buckets:
        """Shapes for steps of up to `max_tokens` tokens reading up to `max_keys` keys: at most
        `max_shapes` of them."""
        if min(q_interval, kv_interval, max_tokens, max_keys, max_shapes) <= 0:
            raise ValueError(
                f"buckets need positive sizes, got q_interval={q_interval} kv_interval={kv_interval} "
                f"max_tokens={max_tokens} max_keys={max_keys} max_shapes={max_shapes}"
            )
        rows = min(round_up(max_tokens, q_interval) // q_interval, max_shapes)
        columns = min(round_up(max_keys, kv_interval) // kv_interval, max_shapes // rows)
        return cls(q_interval, kv_interval, rows * q_interval, columns * kv_interval)

    def shape_of(self, tokens: int, keys: int) -> Shape | None:
        """The bucket of a step, or None when it is larger than every bucket."""
        shape = Shape(round_up(tokens, self.q_interval), round_up(keys, self.kv_interval))
        return shape if shape.tokens <= self.max_tokens and shape.keys <= self.max_keys else None

    def shapes(self) -> list[Shape]:
        """Every bucket, largest first: the order to capture them in, so that later (smaller) graphs
        reuse the memory the first one drew."""
        return [
            Shape(q, k)
            for q in range(self.max_tokens, 0, -self.q_interval)
            for k in range(self.max_keys, 0, -self.kv_interval)
        ]
