"""Shape of the paged KV cache, derived from a model config; shared by cachemgr and worker.

Vocabulary (docs/architecture.md): a **page** holds `page_size` tokens of K and V for one layer; a
**block** is one page per layer of one attention type; a **chunk** is the pool unit. Full and sliding
blocks must tile the same bytes, so a chunk holds `layers_per_chunk = gcd(#full layers, #sliding
layers)` pages and a block of a type with L layers is `L / layers_per_chunk` chunks. For an all-full
model a block is exactly one chunk; for Gemma2-style alternation both block kinds are one chunk each.

The pool tensor is laid out `[layers_per_chunk, 2 (K/V), num_chunks, page_size, kv_heads, row_elems]`
so that, for one layer slot, all K (or V) pages are contiguous and can be viewed as a flat
`[num_chunks * page_size, kv_heads, row_elems]` slot array that attention gathers from. A row is
`head_dim` elements, and in a format that stores a scale with each row (common/kv_int8.py) that
scale's `scale_bytes` too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

AttentionKind = Literal["full", "sliding"]
RESERVED_CHUNKS = 2  # chunks 0 and 1 are padding targets and never allocated
PADDING_SLOT = 0  # padded query tokens write here; padded KV reads come from here (masked out)


@dataclass(frozen=True)
class LayerPlacement:
    """Where layer `layer` lives: allocator `group`, chunk `sub` of that group's block, pool slot `slot`."""

    layer: int
    group: int
    sub: int
    slot: int


@dataclass(frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype_bytes: int
    layer_kinds: tuple[AttentionKind, ...]
    sliding_window: int | None
    scale_bytes: int = 0  # bytes after each (token, kv head) row's head_dim elements

    def __post_init__(self) -> None:
        if self.scale_bytes < 0 or self.scale_bytes % self.dtype_bytes:
            raise ValueError(
                f"scale_bytes must be whole {self.dtype_bytes}-byte elements, got {self.scale_bytes}"
            )
        if len(self.layer_kinds) != self.num_layers:
            raise ValueError(f"layer_kinds has {len(self.layer_kinds)} entries for {self.num_layers} layers")
        if "sliding" in self.layer_kinds and not self.sliding_window:
            raise ValueError(f"sliding layers need a positive sliding_window, got {self.sliding_window!r}")

    @property
    def groups(self) -> tuple[AttentionKind, ...]:
        """Allocator groups in a fixed order: full first, then sliding (only those present)."""
        return tuple(k for k in ("full", "sliding") if k in self.layer_kinds)

    @property
    def layers_per_chunk(self) -> int:
        counts = [self.layer_kinds.count(k) for k in self.groups]
        return math.gcd(*counts)

    def chunks_per_block(self, group: int) -> int:
        return self.layer_kinds.count(self.groups[group]) // self.layers_per_chunk

    @property
    def placements(self) -> tuple[LayerPlacement, ...]:
        seen = dict.fromkeys(self.groups, 0)
        out = []
        n = self.layers_per_chunk
        for layer, kind in enumerate(self.layer_kinds):
            i = seen[kind]
            seen[kind] += 1
            out.append(LayerPlacement(layer, self.groups.index(kind), i // n, i % n))
        return tuple(out)

    @property
    def row_elems(self) -> int:
        """Pool elements of one (token, kv head) row: its values, then its scale if the format has one."""
        return self.head_dim + self.scale_bytes // self.dtype_bytes

    @property
    def chunk_bytes(self) -> int:
        return (
            self.layers_per_chunk * 2 * self.page_size * self.num_kv_heads * self.row_elems * self.dtype_bytes
        )

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return self.num_layers * 2 * self.num_kv_heads * self.row_elems * self.dtype_bytes

    def tokens_held(self, num_chunks: int) -> int:
        """Tokens `num_chunks` chunks (reserved ones included) hold in every layer."""
        return (num_chunks - RESERVED_CHUNKS) * self.layers_per_chunk * self.page_size // self.num_layers

    @property
    def all_full(self) -> bool:
        return self.groups == ("full",)

    @classmethod
    def from_model_config(
        cls, config: Any, page_size: int, dtype_bytes: int, scale_bytes: int = 0
    ) -> KVGeometry:
        """Read layer kinds the way transformers does: `layer_types` when present, else a model-wide
        `sliding_window` (Mistral) makes every layer sliding."""
        config = getattr(config, "text_config", None) or config
        num_layers = int(config.num_hidden_layers)
        window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        every: AttentionKind = "full" if window is None else "sliding"
        kinds: tuple[AttentionKind, ...] = (every,) * num_layers
        if layer_types is not None:
            kinds = tuple("sliding" if t == "sliding_attention" else "full" for t in layer_types)
        if "sliding" not in kinds:
            window = None
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(
            num_layers=num_layers,
            num_kv_heads=int(kv_heads),
            head_dim=int(head_dim),
            page_size=page_size,
            dtype_bytes=dtype_bytes,
            scale_bytes=scale_bytes,
            layer_kinds=kinds,
            sliding_window=int(window) if window is not None else None,
        )
