"""Model runner: moves KV bytes the grant asks for and runs one ragged forward per step."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import structlog
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import PreTrainedModel

from services.common.config import CBConfig
from services.common.kv_geometry import KVGeometry
from services.common.precision import dtype_name
from services.worker import attention_kernels, layer_forward
from services.worker.attention import ATTENTION_NAME
from services.worker.batch import BatchBuilder, BatchItem, ForwardBatch
from services.worker.buckets import Shape, round_up
from services.worker.cuda_graphs import DEFAULT_KV_INTERVAL, Capture, CudaGraphs
from services.worker.kernels import int8_path
from services.worker.kernels import paths as kernel_paths
from services.worker.packed_linear import PackedLinear, PackedWeight, pack_linears
from services.worker.piecewise_graphs import PiecewiseGraphs
from services.worker.swap_copies import SwapCopies

log = structlog.get_logger(__name__)


# SDPA without cuDNN: torch may pick cuDNN's attention for the row groups' masked calls, and cuDNN
# builds a plan for every new shape, tens of ms each. A prefill step brings new (requests, queries,
# keys) shapes in most layers' groups, so planning would outweigh the step. The memory-efficient kernel
# takes the same masks with no plan.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class ModelRunner:
    """Owns the model and views of the pools; never decides which blocks to use.

    Swap copies run before the forward that may reuse the chunks they free, so a victim's bytes are
    saved before any new owner writes them (swap_copies.py). Where `config.cuda_graph_enabled`,
    decode steps replay CUDA graphs (cuda_graphs.py) and, with our own forward, other steps replay
    piecewise ones (piecewise_graphs.py).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        geometry: KVGeometry,
        kv_pool: torch.Tensor,
        swap_pool: torch.Tensor | None,
        config: CBConfig,
    ) -> None:
        self.model = model
        self.geometry = geometry
        self.kv_pool = kv_pool
        self.swap_pool = swap_pool
        self.device = kv_pool.device
        model.set_attn_implementation(ATTENTION_NAME)
        text = getattr(model.config, "text_config", None) or model.config
        num_chunks, page = kv_pool.shape[2], geometry.page_size
        # A request reads at most the model's positions or the whole pool, whichever are fewer.
        self.max_keys = min(getattr(text, "max_position_embeddings", num_chunks * page), num_chunks * page)
        # The decode graphs' captures put a step at its bucket's last key, up to a KV interval past
        # `max_keys` (buckets.py): the Triton forward's rotary table covers those positions too.
        positions = round_up(self.max_keys, config.kv_padding_interval_size or DEFAULT_KV_INTERVAL)
        self.fused = layer_forward.choose(model, config.quantization, kv_pool.dtype, positions)
        if config.quantization != "none" and (self.fused is None or self.fused.name != "native"):
            raise ValueError(
                f"--quantization {config.quantization} needs our own forward on the CPU's native kernels: "
                f"a Llama-family model on the CPU with the kernels built; this one is "
                f"{model.config.model_type} on {self.device}"
            )
        if self.fused is None:
            pack_linears(model)
        flat = (num_chunks * page, geometry.num_kv_heads, geometry.row_elems)
        kv_of_layer = [
            (kv_pool[p.slot, 0].view(flat), kv_pool[p.slot, 1].view(flat)) for p in geometry.placements
        ]
        # The CPU's own forward keeps its activations in float32 whatever the weights' dtype (the native
        # attention kernels take float32 queries over float32, 16-bit or int8 pages); the GPU's and
        # transformers' keep the weights' dtype.
        self.activation_dtype = (
            self.fused.activation_dtype if self.fused is not None else next(model.parameters()).dtype
        )
        self.attention = attention_kernels.choose(
            self.device, kv_pool.dtype, self.activation_dtype, geometry.head_dim
        )
        self.builder = BatchBuilder(
            geometry,
            kv_of_layer,
            max_batch_tokens=config.max_batch_tokens,
            query_group=text.num_attention_heads // geometry.num_kv_heads,
            dtype=self.activation_dtype,
            q_padding=config.q_padding_interval_size,
            kv_padding=config.kv_padding_interval_size,
            device=self.device,
            decode_kernel=self.attention.decode,
            prefill_kernel=self.attention.prefill,
            num_buffers=2 if config.use_async_batching else 1,
        )
        self.swap_copies = SwapCopies(kv_pool, swap_pool)
        # CUDA: steps are built on a stream of their own. A copy from pageable host memory waits for
        # its stream, and the forward's is busy with the step before (async batching).
        self.build_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.config = config
        self.graphs: CudaGraphs | None = None
        self.pieces: PiecewiseGraphs | None = None
        if config.cuda_graph_enabled(self.device.type):
            try:
                self.use_graphs()
            except Exception:
                if config.use_cuda_graph:  # asked for: a start without them would hide the failure
                    raise
                # Unset (automatic): serve, eagerly, and say why loudly.
                log.exception("CUDA graph capture failed: every step runs eagerly")
                self.graphs = self.pieces = None

    def describe(self) -> dict[str, object]:
        """What runs, for the start-up log: whose forward, its dtypes, the native kernels' vector paths."""
        return {
            "forward": self.fused.name if self.fused is not None else "transformers",
            "weights": dtype_name(next(self.model.parameters()).dtype),
            "activations": dtype_name(self.activation_dtype),
            "kv_dtype": dtype_name(self.kv_pool.dtype),
            "attention": self.attention.name,
            "weight_bytes": self.weight_bytes(),
            "kernel_paths": kernel_paths() if self.device.type == "cpu" else {},
            "quantization": self.config.quantization,
            **({"int8_path": int8_path()} if self.config.quantization == "int8" else {}),  # weight-only: FMAs
        }

    def packed_weights(self) -> list[PackedWeight]:
        """The packed products the forward multiplies by (the LM head's first on our forward)."""
        packed = [m.packed for m in self.model.modules() if isinstance(m, PackedLinear)]
        return packed + (self.fused.packed_weights() if self.fused is not None else [])

    def _decode_matrices(self) -> list[torch.Tensor]:
        """Where nothing is packed, the matrices a decode row multiplies by: every one but the input
        embedding (read one row a token), unless the LM head shares it."""
        embedding = cast(torch.Tensor, self.model.get_input_embeddings().weight)
        head = cast(torch.Tensor, self.model.get_output_embeddings().weight)
        tied = embedding.data_ptr() == head.data_ptr()
        return [p for p in self.model.parameters() if p.dim() == 2 and (p is not embedding or tied)]

    def decode_weight_bytes(self) -> int:
        """Bytes of weights a step of few rows must read: each packed linear's panels (the copy such
        steps multiply by), else the matrices themselves (`_decode_matrices`), and the vectors (norms,
        biases)."""
        vectors = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.dim() == 1)
        if packed := self.packed_weights():
            return sum(w.packed.numel() * w.packed.element_size() for w in packed) + vectors
        return sum(p.numel() * p.element_size() for p in self._decode_matrices()) + vectors

    def decode_multiply_adds(self) -> int:
        """Multiply-adds of one decode row's weight products: every packed product's weights, else every
        matrix of `_decode_matrices`."""
        if packed := self.packed_weights():
            return sum(w.weight.numel() for w in packed)
        return sum(p.numel() for p in self._decode_matrices())

    def weight_bytes(self) -> int:
        """Bytes the weights hold: the model's parameters and every packed or prepared copy, each
        storage once (tied and concatenated weights share theirs)."""
        packed = self.packed_weights()
        # meta: weights let go (int8 layers hold only their panels)
        tensors: list[torch.Tensor] = [p for p in self.model.parameters() if p.device.type != "meta"]
        tensors += [t for w in packed for t in (w.packed, w.many_rows) if t is not None]
        storages: dict[int, int] = {}
        for t in tensors:
            if t.is_mkldnn:  # oneDNN's opaque copy: no storage to share, its own bytes
                storages[id(t)] = t.numel() * t.element_size()
            else:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    def use_graphs(self, capture: Capture | None = None) -> None:
        """Capture the decode graphs and, with our own forward (whose step has a seam at each
        attention), the piecewise ones (again), with `capture` as the back end (default: CUDA's, one
        memory pool for all)."""
        self.graphs = self.pieces = None  # the old graphs' memory returns before the new ones draw theirs
        vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self.graphs = CudaGraphs.for_runner(
            self._forward, self.builder, self.config, self.max_keys, vocab_size, capture
        )
        if self.fused is not None:
            capture = self.graphs.capture  # one memory pool for both
            self.pieces = PiecewiseGraphs.for_runner(self.fused, self.builder, self.config, capture)

    def copy_swap(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]]) -> None:
        self.swap_copies.copy(swap_out, swap_in)

    def copy_pages(self, pairs: Sequence[tuple[int, int]]) -> None:
        """(source chunk, destination chunk) pairs of the KV pool, every layer slot, K and V: a fork's
        own copy of its parent's last page (the pool layout is
        [layers_per_chunk, 2, chunks, page, kv_heads, row_elems], int8 rows carrying their scales)."""
        if not pairs:
            return
        source = torch.tensor([a for a, _ in pairs], device=self.kv_pool.device)
        destination = torch.tensor([b for _, b in pairs], device=self.kv_pool.device)
        self.kv_pool.index_copy_(2, destination, self.kv_pool.index_select(2, source))

    def build(self, items: Sequence[BatchItem], fill: Sequence[tuple[int, int]] = ()) -> ForwardBatch:
        """`fill`: (input row, sampling row) pairs, the placeholders `forward` takes from the tokens
        the step before sampled (ForwardBatch.fill_rows)."""
        shape = self.graphs.shape_for(items) if self.graphs is not None else None
        tokens = self.pieces.bucket_for(items) if self.pieces is not None and shape is None else None
        if self.build_stream is None:
            return self._build(items, shape, tokens, fill)
        with torch.cuda.stream(self.build_stream):
            batch = self._build(items, shape, tokens, fill)
            batch.ready = torch.cuda.Event()
            batch.ready.record()
        return batch

    def _build(
        self,
        items: Sequence[BatchItem],
        shape: Shape | None,
        tokens: int | None,
        fill: Sequence[tuple[int, int]],
    ) -> ForwardBatch:
        batch = self.builder.build(items, shape, tokens)
        if fill:
            rows, sources = zip(*fill, strict=True)
            batch.fill_rows = torch.tensor(rows, device=self.device)
            batch.fill_sources = torch.tensor(sources, device=self.device)
        return batch

    def forward(self, batch: ForwardBatch, before: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `[R + P, vocab]` (float32) of the rows `batch.logits_indices` names, in order.
        `before`: the tokens the step before sampled, on the device, for `batch.fill_rows`."""
        if batch.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(batch.ready)
        if batch.fill_rows is not None:
            if before is None:
                raise ValueError("the batch has placeholders to fill, and no tokens to fill them from")
            batch.input_ids[0, batch.fill_rows] = before[batch.fill_sources].to(batch.input_ids.dtype)
        if self.graphs is not None and batch.shape is not None:
            return self.graphs.replay(batch)
        return self._forward(batch)

    @torch.inference_mode()
    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        with sdpa_kernel(SDPA_BACKENDS):
            return self._forward_model(batch)

    def _forward_model(self, batch: ForwardBatch) -> torch.Tensor:
        if self.pieces is not None and batch.piecewise is not None:
            return self.pieces.run(batch)
        if self.fused is not None:
            ids, positions = batch.input_ids[0], batch.position_ids[0]
            return self.fused(ids, positions, batch.logits_indices, batch.attention)
        out = self.model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            logits_to_keep=batch.logits_indices,
            use_cache=False,
            cb_batch=batch.attention,
        )
        return out.logits[0].float()
