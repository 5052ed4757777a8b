"""Piecewise CUDA graphs: the steps no decode graph serves (a prompt chunk's, alone or beside decode
rows, and decode steps beyond every decode bucket) replay our forward's stretches between two
attention calls, each captured once per token bucket at start: vLLM's piecewise capture, its default.

What is captured. Our own forward's step (fused_llama.py's `llama_step`, GpuLlama's on a GPU) in its
pieces: the embedding and the first layer's norm and q|k|v; then, past each layer's attention, its o,
add-and-norm, MLP, the next layer's norm, q|k|v product, and rotary with the K/V writes into the pool.
A layer's attention runs eagerly between two replays, on the step's own row groups and ragged prefill
metadata, whose shapes (not only values) change every step. The last layer past its attention (o and
MLP of the rows whose logits are asked for, the final norm, the LM head) runs eagerly too: its rows
change every step, and a graph per (tokens, rows) pair would multiply the captures to save the eight
launches that tail costs once a step. transformers' layers have no such seam: with them these steps
run eagerly.

Buckets. Powers of two from the q interval up to `PIECE_INTERVAL`, then its multiples, up to the
largest step the builder's buffers hold or `MAX_PIECE_TOKENS`, whichever is fewer (8, 16, 32, 64,
128, ..., 512 with the defaults: eleven buckets of one graph a layer). A small step is bound by its
launches, so padding it up to twice its tokens costs little; a larger one pads fewer than
`PIECE_INTERVAL` tokens. A step beyond the largest bucket runs eagerly: its products amortise its
launches (vLLM's captures stop at 512 tokens too). A step is built padded to its bucket
(`BatchBuilder.build(tokens=)`): its extra tokens are token 0 at position 0 writing the padding slot,
in no row group, as q padding's are.

Memory. The pieces use the decode graphs' `Capture`, and so their memory pool, largest bucket first.
The static inputs (token ids, positions, write slots) and what crosses from one piece to the next
(the residual stream, the q|k|v rows, the attention's output) are one buffer each, sized by the
largest bucket, each bucket's pieces reading and writing their fronts. The capture's count, time and
memory are logged once, at start.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from services.common.config import CBConfig
from services.common.kv_geometry import PADDING_SLOT
from services.worker.attention import AttentionBatch
from services.worker.batch import BatchBuilder, BatchItem, ForwardBatch
from services.worker.cuda_graphs import DEFAULT_Q_INTERVAL, Capture, CaptureCost, Step, measured
from services.worker.fused_llama import first_qkv, llama_layers, next_qkv

log = structlog.get_logger(__name__)

PIECE_INTERVAL = 64  # tokens: buckets past it are its multiples
MAX_PIECE_TOKENS = 512  # the largest bucket at most


def piece_buckets(smallest: int, largest: int) -> list[int]:
    """Token buckets up to `largest`, largest first (the capture's order: see cuda_graphs.py)."""
    if min(smallest, largest) <= 0:
        raise ValueError(f"piecewise buckets need positive sizes, got smallest={smallest} largest={largest}")
    sizes = {largest}
    size = smallest
    while size < min(PIECE_INTERVAL, largest):
        sizes.add(size)
        size *= 2
    sizes.update(range(PIECE_INTERVAL, largest, PIECE_INTERVAL))
    return sorted(sizes, reverse=True)


@dataclass
class _Statics:
    """What one bucket's pieces read and write: fronts of the shared buffers."""

    ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    attention: AttentionBatch  # its write slots `[B]` per view; the pieces read nothing else of it
    residual: torch.Tensor  # [B, hidden]
    qkv: torch.Tensor  # [B, (H + 2 kv) D]: the next layer's q|k|v rows, a piece's output
    attn: torch.Tensor  # [B, H D]: the layer's attention, a piece's input


class PiecewiseGraphs:
    """The pieces of one model runner's forward, per token bucket (its KV pool's addresses are in
    every piece)."""

    def __init__(self, forward: Any, builder: BatchBuilder, buckets: Sequence[int], capture: Capture) -> None:
        """`forward`: our own forward (`llama_step`'s pieces, `embedded`, `mlp`); `buckets` largest
        first."""
        self.forward = forward
        self.builder = builder
        self.buckets = list(buckets)
        self._capture = capture
        self._statics: dict[int, _Statics] = {}
        self._pieces: dict[int, list[Step]] = {}
        self.replays = 0  # steps whose pieces replayed
        self.eager_steps = 0  # steps for no decode graph larger than every bucket
        self.cost = CaptureCost()

    @classmethod
    def for_runner(
        cls, forward: Any, builder: BatchBuilder, config: CBConfig, capture: Capture
    ) -> PiecewiseGraphs:
        """Buckets from `config` up to what the builder's buffers hold, every one captured."""
        smallest = config.q_padding_interval_size or DEFAULT_Q_INTERVAL
        largest = min(builder.input_buf.numel(), MAX_PIECE_TOKENS)
        pieces = cls(forward, builder, piece_buckets(smallest, largest), capture)
        pieces.capture_all()
        return pieces

    @property
    def count(self) -> int:
        return sum(len(p) for p in self._pieces.values())

    @torch.inference_mode()
    def capture_all(self) -> None:
        with measured(self.builder.device) as self.cost:
            self._statics = self._place(self.buckets)
            for tokens in self.buckets:
                self._pieces[tokens] = self._capture_bucket(self._statics[tokens])
        log.info(
            "piecewise cuda graphs captured",
            graphs=self.count,
            buckets=self.buckets,
            seconds=round(self.cost.seconds, 2),
            memory_mib=self.cost.memory_mib,
        )

    def _place(self, buckets: Sequence[int]) -> dict[int, _Statics]:
        """Every bucket's statics, views of one buffer each sized by the largest: phantom tokens (token
        0 at position 0, writing the padding slot) until a step copies its own in."""
        fwd, builder, dev = self.forward, self.builder, self.builder.device
        largest, hd = max(buckets), fwd.head_dim
        ids = torch.zeros(largest, dtype=torch.long, device=dev)
        positions = torch.zeros(largest, dtype=torch.long, device=dev)
        slots = {
            view: torch.full((largest,), PADDING_SLOT, dtype=torch.long, device=dev) for view in builder.views
        }
        dtype = fwd.activation_dtype
        residual = torch.zeros(largest, fwd.embed.shape[1], dtype=dtype, device=dev)
        qkv = torch.zeros(largest, (fwd.num_heads + 2 * fwd.kv_heads) * hd, dtype=dtype, device=dev)
        attn = torch.zeros(largest, fwd.num_heads * hd, dtype=dtype, device=dev)
        return {
            b: _Statics(
                ids[:b],
                positions[:b],
                AttentionBatch(
                    num_tokens=b,
                    write_slots={view: s[:b] for view, s in slots.items()},
                    groups={},
                    views_of_layer=builder.views_of_layer,
                    kv_of_layer=builder.kv_of_layer,
                ),
                residual[:b],
                qkv[:b],
                attn[:b],
            )
            for b in buckets
        }

    def _capture_bucket(self, s: _Statics) -> list[Step]:
        fwd = self.forward

        def first() -> None:
            s.residual.copy_(fwd.embedded(s.ids))
            s.qkv.copy_(first_qkv(fwd, s.residual, s.positions, s.attention))

        def after(layer: int) -> Step:
            def piece() -> None:
                s.qkv.copy_(next_qkv(fwd, layer, s.attn, s.residual, s.positions, s.attention))

            return piece

        steps = [first, *(after(layer) for layer in range(len(fwd.layers) - 1))]
        return [self._capture(step) for step in steps]

    def bucket_for(self, items: Sequence[BatchItem]) -> int | None:
        """The bucket of a step that no decode graph serves; None for one larger than every bucket."""
        tokens = sum(len(it.token_ids) for it in items)
        fitting = [b for b in self.buckets if b >= tokens]
        if not fitting:
            self.eager_steps += 1
            return None
        return min(fitting)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits `[R + P, vocab]` of `batch` (built for a bucket): its pieces' replays, the attention
        and the last layer's tail run eagerly."""
        if batch.piecewise is None:
            raise ValueError("only a batch built for a token bucket replays piecewise graphs")
        s, pieces = self._statics[batch.piecewise], self._pieces[batch.piecewise]
        s.ids.copy_(batch.input_ids[0], non_blocking=True)
        s.positions.copy_(batch.position_ids[0], non_blocking=True)
        for view, slots in batch.attention.write_slots.items():
            s.attention.write_slots[view].copy_(slots, non_blocking=True)
        pieces[0]()

        def after_attention(layer: int, attn: torch.Tensor) -> torch.Tensor:
            s.attn.copy_(attn)
            pieces[layer + 1]()
            return s.qkv

        logits = llama_layers(
            self.forward, batch.attention, batch.logits_indices, s.residual, s.qkv, after_attention
        )
        self.replays += 1
        return logits
