"""Our own forward for Llama-shaped decoders (Llama, Mistral, Qwen2) on the CPU, float32 or bfloat16.

transformers' forward spends a third of a W1 step outside the matrix products: per layer it runs
about forty small kernels (RMSNorm as six, rotary as sixteen, SiLU and the product, three residual
adds), three separate projections where one would do, and module and mask bookkeeping. Here a layer
is four packed GEMMs (q|k|v, o, gate|up writing SiLU(gate) times up, down), the paged attention, and
three fused passes (csrc/fused_ops.cpp): norm, rotary in place on the q|k|v rows with the K/V writes
to the pool, add-and-norm. Weights are the model's own, concatenated (the model's parameters become
views of the concatenations) and packed once into panels; the last layer past its K/V writes, the final
norm and the LM head run only on the rows whose logits are asked for (those that sample, and prompt
logprobs' rows).

A bfloat16 model keeps its weights in bfloat16 (the panels hold them so, halving the bytes a step
streams) while the activations, the residual stream, norms, rotary, attention and logits stay float32:
only each linear's input is rounded to bfloat16 for its products, which accumulate in float32. The
KV pool may be either dtype apart from the weights'.

`--quantization int8` packs every linear of the layers (q|k|v, o, gate|up, down) as int8 panels
instead, over either dtype: each output channel's weights in groups of 32 inputs, each on a scale of
its own, each linear's input rounded to int8 per token in the same groups as it is multiplied, each
group's exact int32 sum scaled back to float32; `int8-weight-only` the same panels with the inputs
multiplied in float32. The LM head, the embedding and the norms stay in the model's dtype
(`HEAD_QUANTIZED`).

In float32, results equal transformers' up to fp32 summation order; `FusedLlama.build` returns None (the model
then runs transformers' forward) for anything else: another architecture, a rotary embedding that
changes with the sequence length, biases on the MLP, another activation, or no native kernels.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import astuple, dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention import AttentionBatch, attend_stored
from services.worker.kernels import fused_ops, packed_linear_ops
from services.worker.packed_linear import PackedWeight

SUPPORTED_TYPES = frozenset({"llama", "mistral", "qwen2"})
WEIGHT_DTYPES = frozenset({torch.float32, torch.bfloat16})
STATIC_ROPE = frozenset({"default", "linear", "llama3"})  # inv_freq fixed at load time
# `--quantization` -> the layers' panels: their dtype, and whether each input row is rounded to it too.
QUANTIZED = {"int8": (torch.int8, True), "int8-weight-only": (torch.int8, False)}
# Whether `--quantization` takes the LM head too. It does not: the head's products pick each token,
# and int8 there alone lost SmolLM2-135M about half the top-1 agreement with float32 that int8 in every
# layer loses; `--dtype bfloat16` halves the head's bytes instead. Weight-only int8 panels there (x
# kept float32) lost as much, and are no faster: at a decode step's rows the head is bound by its
# products, which they run as fp32 FMAs, half of bf16's products an instruction (docs/performance-log.md).
HEAD_QUANTIZED = False


@dataclass
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: PackedWeight
    o: PackedWeight
    gate_up: PackedWeight
    down: PackedWeight


def llama_shaped(model: nn.Module) -> bool:
    """Whether `model`'s layers are the ones this forward computes (the GPU's forward, gpu_llama.py,
    computes the same ones)."""
    config: Any = model.config
    head = cast(nn.Linear, model.lm_head)
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    return (
        config.model_type in SUPPORTED_TYPES
        and rotary is not None
        and getattr(rotary, "rope_type", "default") in STATIC_ROPE
        and getattr(config, "hidden_act", "silu") == "silu"
        and not getattr(config, "mlp_bias", False)
        and head.bias is None
    )


def _supported(model: nn.Module) -> bool:
    return (
        llama_shaped(model)
        and next(model.parameters()).device.type == "cpu"
        and next(model.parameters()).dtype in WEIGHT_DTYPES
    )


@dataclass(frozen=True)
class LlamaGeometry:
    """What a Llama-shaped forward reads of the model's config and its first attention module."""

    eps: float
    head_dim: int
    num_heads: int
    kv_heads: int
    scale: float

    @classmethod
    def of(cls, model: nn.Module) -> LlamaGeometry:
        # transformers' modules: their attributes are the architecture's, unknown to nn.Module's types
        config: Any = model.config
        attn0: Any = cast(Any, model).model.layers[0].self_attn
        return cls(
            float(config.rms_norm_eps),
            int(attn0.head_dim),
            int(config.num_attention_heads),
            int(config.num_key_value_heads),
            float(attn0.scaling),
        )

    def layers(self, model: nn.Module) -> list[Any]:
        """The decoder layers the config counts (a checkpoint may carry more modules)."""
        config: Any = model.config
        return list(cast(Any, model).model.layers[: config.num_hidden_layers])


# Our forward lets a model's plain weights go once packed, so an engine takes the model it is given:
# another engine on the same model (the worker's, when it attaches to a restarted cachemgr) gets the
# forward already built for it, per quantization.
_BUILT: weakref.WeakKeyDictionary[nn.Module, dict[str, FusedLlama]] = weakref.WeakKeyDictionary()


class FusedLlama:
    name = "native"  # what the runner's start-up log calls this forward
    activation_dtype = torch.float32  # whatever the weights' (see the top)

    def __init__(self, model: nn.Module, ops: Any, linear_ops: Any, head_ops: Any) -> None:
        """`linear_ops`: the layers' linears' `PanelLinear`; `head_ops`: the LM head's."""
        # transformers' modules: their attributes are the architecture's, unknown to nn.Module's types
        inner: Any = model.model
        config: Any = model.config
        head = cast(nn.Linear, model.lm_head)
        self.ops = ops
        geometry = LlamaGeometry.of(model)
        self.eps, self.head_dim, self.num_heads, self.kv_heads, self.scale = astuple(geometry)
        # Only the packed copies are read (transformers' forward no longer runs): the plain weights go,
        # but for a head tied to the embedding, whose rows the embedding still reads. What stays (the
        # embedding, the norms, biases) is first copied out of the checkpoint: a tensor loaded from
        # safetensors is a view of the file's mapping, and one view kept would keep every page of the
        # file that the packing reads resident.
        linears = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
        with torch.no_grad():
            for p in model.parameters():
                if id(p) not in linears or p is inner.embed_tokens.weight:
                    p.data = p.data.clone()
        self.embed = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight.detach().float()
        tied = head.weight.data_ptr() == self.embed.data_ptr()
        self.lm_head = PackedWeight.of(head_ops, head, many_rows=False, plain=tied)  # sampled rows only
        self.layers = []
        for layer in geometry.layers(model):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    input_norm=layer.input_layernorm.weight.detach().float(),
                    post_norm=layer.post_attention_layernorm.weight.detach().float(),
                    qkv=PackedWeight.of(linear_ops, attn.q_proj, attn.k_proj, attn.v_proj, plain=False),
                    o=PackedWeight.of(linear_ops, attn.o_proj, plain=False),
                    gate_up=PackedWeight.of(linear_ops, mlp.gate_proj, mlp.up_proj, gated=True, plain=False),
                    down=PackedWeight.of(linear_ops, mlp.down_proj, plain=False),
                )
            )
        # transformers' own cos/sin for every position, computed once (the same products per position).
        positions = torch.arange(config.max_position_embeddings).unsqueeze(0)
        with torch.no_grad():
            cos, sin = inner.rotary_emb(self.embed[:1].float().unsqueeze(0), positions)
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()

    def packed_weights(self) -> list[PackedWeight]:
        return [self.lm_head, *(w for lay in self.layers for w in (lay.qkv, lay.o, lay.gate_up, lay.down))]

    @classmethod
    def build(cls, model: nn.Module, quantization: str = "none") -> FusedLlama | None:
        """Our forward for `model`, its layers' linears quantized as `quantization` says ("none" or a
        key of QUANTIZED); None where it does not run (see the top)."""
        if quantization != "none" and quantization not in QUANTIZED:
            known = ", ".join(QUANTIZED)
            raise ValueError(f"quantization must be none or one of {known}, got {quantization!r}")
        if not _supported(model):
            return None
        ops, own_ops = fused_ops(), packed_linear_ops(next(model.parameters()).dtype)
        linear_ops = own_ops if quantization == "none" else packed_linear_ops(*QUANTIZED[quantization])
        if ops is None or own_ops is None or linear_ops is None:
            return None
        built = _BUILT.setdefault(model, {})
        if quantization not in built:
            built[quantization] = cls(model, ops, linear_ops, linear_ops if HEAD_QUANTIZED else own_ops)
        return built[quantization]

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """`input_ids`, `positions` `[T]` -> logits `[len(rows), vocab]` of the packed rows `rows`."""
        return llama_step(self, self.embedded(input_ids), positions, rows, batch)

    def embedded(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings `[T, hidden]`, a new tensor, in float32 whatever the weights."""
        return F.embedding(input_ids, self.embed).float()

    def mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        return layer.down(layer.gate_up(x))  # the panels apply silu(gate) * up as they write


# A Llama-shaped step, pass for pass, of `forward` (FusedLlama here, GpuLlama on a GPU: its `ops`,
# geometry, layers, head, `embedded` and `mlp`), in pieces that meet at each layer's attention:
# `first_qkv`, then per layer `attend` and `next_qkv`, the last layer's `attend` and `last_logits`.
# `llama_step` runs them in order; piecewise CUDA graphs (piecewise_graphs.py) replay `first_qkv`
# and `next_qkv` captured per token bucket through the same loop, `llama_layers`. `residual` is the
# residual stream `[T, hidden]`, which the pieces update in place.


def llama_step(
    forward: Any, residual: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    """Float32 logits `[len(rows), vocab]` of the packed rows `rows`; `residual` the embedded tokens
    `[T, hidden]` (`forward.embedded`), a new tensor the passes update in place."""
    return llama_layers(
        forward,
        batch,
        rows,
        residual,
        first_qkv(forward, residual, positions, batch),
        lambda layer, attn: next_qkv(forward, layer, attn, residual, positions, batch),
    )


def llama_layers(
    forward: Any,
    batch: AttentionBatch,
    rows: torch.Tensor,
    residual: torch.Tensor,
    qkv: torch.Tensor,
    after_attention: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The step from the first layer's q|k|v rows `qkv` on: each layer's attention, then
    `after_attention(layer, attn)` for the next layer's q|k|v (`next_qkv`, or its graph's replay),
    and the last layer's `last_logits` on `rows`."""
    last = len(forward.layers) - 1
    for i in range(last):
        qkv = after_attention(i, attend(forward, batch, i, qkv))
    if rows.numel() == 0:  # a prompt's inner chunk: its last K/V are all it leaves
        return empty_logits(forward, residual)
    return last_logits(forward, attend(forward, batch, last, qkv), residual, rows)


def first_qkv(
    forward: Any, residual: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    """The first layer's q|k|v rows `[T, (H + 2 kv) D]`, rotated, their K/V written into the pool."""
    hidden = forward.ops.rms_norm(residual, forward.layers[0].input_norm, forward.eps)
    return _qkv(forward, 0, hidden, positions, batch)


def attend(forward: Any, batch: AttentionBatch, layer: int, qkv: torch.Tensor) -> torch.Tensor:
    """Layer `layer`'s attention `[T, H D]` of the q rows of `qkv` (its K/V already in the pool)."""
    t, hd, heads = qkv.shape[0], forward.head_dim, forward.num_heads
    q = qkv[:, : heads * hd].view(t, heads, hd)
    return attend_stored(batch, layer, q, forward.scale).view(t, heads * hd)


def next_qkv(
    forward: Any,
    layer: int,
    attn: torch.Tensor,
    residual: torch.Tensor,
    positions: torch.Tensor,
    batch: AttentionBatch,
) -> torch.Tensor:
    """Layer `layer`'s o and MLP past its attention `attn` into `residual`, and the next layer's
    q|k|v rows as `first_qkv` gives the first's."""
    ops, eps, layers = forward.ops, forward.eps, forward.layers
    current = layers[layer]
    hidden = ops.add_rms_norm(current.o(attn), residual, current.post_norm, eps)
    hidden = ops.add_rms_norm(forward.mlp(current, hidden), residual, layers[layer + 1].input_norm, eps)
    return _qkv(forward, layer + 1, hidden, positions, batch)


def last_logits(forward: Any, attn: torch.Tensor, residual: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The last layer past its attention `attn`, the final norm and the LM head, on the rows `rows`:
    float32 logits `[len(rows), vocab]`. `residual` is left as it is."""
    # Past the last layer's K/V writes only the rows whose logits are asked for matter (llama.cpp's
    # `inp_out_ids`): a prompt's other rows skip that layer's o and MLP, ~3% of a prefill's products.
    ops, eps, layer = forward.ops, forward.eps, forward.layers[-1]
    attn, residual = attn.index_select(0, rows), residual.index_select(0, rows)
    hidden = ops.add_rms_norm(layer.o(attn), residual, layer.post_norm, eps)
    residual += forward.mlp(layer, hidden)
    logits: torch.Tensor = forward.lm_head(ops.rms_norm(residual, forward.final_norm, eps))
    return logits.float()


def empty_logits(forward: Any, residual: torch.Tensor) -> torch.Tensor:
    """The logits of no row: a step whose every token is a prompt's inner chunk."""
    return residual.new_empty((0, forward.lm_head.weight.shape[0]), dtype=torch.float32)


def _qkv(
    forward: Any, layer: int, hidden: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
) -> torch.Tensor:
    qkv: torch.Tensor = forward.layers[layer].qkv(hidden)
    k_cache, v_cache, slots = batch.kv_target(layer)
    forward.ops.rotary_store_kv_(
        qkv,
        forward.num_heads,
        forward.kv_heads,
        forward.head_dim,
        forward.cos,
        forward.sin,
        positions,
        k_cache,
        v_cache,
        slots,
    )
    return qkv
