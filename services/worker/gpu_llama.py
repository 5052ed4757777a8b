"""Our own forward for Llama-shaped decoders (Llama, Mistral, Qwen2) on a GPU: FusedLlama's layer
(fused_llama.py) with torch's linears (cuBLAS) for the products and Triton for the rest (issue 51).

transformers' eager layers run some forty small kernels a layer (RMSNorm as six, rotary as sixteen,
SiLU and the product, three residual adds, the K/V copies into the pool) and three projections
where one would do; in a decode step, where each product is a few rows, those launches are most of
the step. Here a layer is four products (q|k|v, o, gate|up, down: each linear group's weights
concatenated once, the model's parameters becoming views of the concatenations, so no byte is held
twice), the paged attention reading the pool in place (attention.py's `attend_stored`, with the Triton
kernels of triton_attention.py where attention_kernels.py picks them), and four Triton passes
(triton_fused.py): norm, rotary in place on the q|k|v rows with the K/V writes into the pool, SiLU(gate)
times up (a cuBLAS product cannot apply it as it writes, the CPU's panels do), add-and-norm. As on the
CPU, the last layer past its K/V writes, the final norm and the LM head run only on the rows whose
logits are asked for.

Activations, the residual stream and the products stay in the model's dtype (bfloat16 or float16:
tensor-core products; float32 in the tests), as in transformers' forward; each Triton pass computes
in float32 inside and rounds once on store, and the rotary table is float32 (transformers rounds its
cos/sin to the activations' dtype first). Logits are returned in float32. The KV pool may be any of
float32, bfloat16 and float16 apart from the activations; int8 pools are not written by these passes
(the model then runs transformers' layers).

Every shape comes from the batch's tensor shapes and nothing reads a device value on the host (the
Triton grids are shapes too), so a whole decode step is captured as one CUDA graph (cuda_graphs.py)
as transformers' forward was, and another step's stretches between two attention calls as piecewise
graphs (piecewise_graphs.py); each kernel compiles on the warm-up run before its capture.

In float32, results equal transformers' up to fp32 summation order (tests/test_gpu_llama.py, under
Triton's interpreter on the CPU).
"""

from __future__ import annotations

import os
from dataclasses import astuple, dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention import AttentionBatch
from services.worker.fused_llama import LlamaGeometry, llama_shaped, llama_step
from services.worker.packed_linear import PackedWeight, joined_weight
from services.worker.triton_fused import DTYPES, TritonFusedOps


@dataclass
class _Linear:
    """One or several linears' weights concatenated along the outputs, and their biases (None: none)."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def of(cls, *linears: nn.Linear) -> _Linear:
        """Each linear's parameter becomes a view of its rows of the concatenation: the concatenated
        copy is the only one kept (transformers' modules and a tied head still read theirs)."""
        with torch.no_grad():
            weight = joined_weight(linears)
            biases = [lin.bias for lin in linears]
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat(
                    [
                        b.detach() if b is not None else weight.new_zeros(lin.out_features)
                        for b, lin in zip(biases, linears, strict=True)
                    ]
                )
        return cls(weight, bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass
class _Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: _Linear
    o: _Linear
    gate_up: _Linear  # silu(gate) * up by `TritonFusedOps.silu_mul` after the product
    down: _Linear


def refusal(model: nn.Module, kv_dtype: torch.dtype, quantization: str) -> str | None:
    """Why this forward cannot run `model` over a pool of `kv_dtype`; None where it can."""
    first = next(model.parameters())
    dtype, device = first.dtype, first.device
    config: Any = model.config
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return (
            f"a model on the {device.type}: Triton runs there only under its interpreter, TRITON_INTERPRET=1"
        )
    if not llama_shaped(model):
        return (
            f"{config.model_type} is not a Llama-shaped decoder with a static rotary embedding, "
            "SiLU and no MLP biases"
        )
    if dtype not in DTYPES:
        return f"weights in {dtype}, not one of {DTYPES}"
    if kv_dtype not in DTYPES:
        return f"a KV pool of {kv_dtype}: the Triton passes write {DTYPES} pools"
    if quantization != "none":
        return f"--quantization {quantization}: only the CPU's native forward runs quantized linears"
    return None


class GpuLlama:
    name = "triton"  # what the runner's start-up log calls this forward

    def __init__(self, model: nn.Module, max_positions: int) -> None:
        """`max_positions`: the rotary table's rows, more than any position a step holds, graph
        captures' included: the positions are not checked (that would read the device). The runner
        sizes it by what a request can read, not by the model's positions (Llama 3.1's 131,072 would
        be 128 MiB of float32 cos/sin)."""
        # transformers' modules: their attributes are the architecture's, unknown to nn.Module's types
        inner: Any = model.model
        self.ops = TritonFusedOps()
        self.activation_dtype = next(model.parameters()).dtype
        geometry = LlamaGeometry.of(model)
        self.eps, self.head_dim, self.num_heads, self.kv_heads, self.scale = astuple(geometry)
        self.embed = inner.embed_tokens.weight.detach()
        self.final_norm = inner.norm.weight.detach()
        self.lm_head = _Linear.of(cast(nn.Linear, model.lm_head))
        self.layers = []
        for layer in geometry.layers(model):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                _Layer(
                    input_norm=layer.input_layernorm.weight.detach(),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    qkv=_Linear.of(attn.q_proj, attn.k_proj, attn.v_proj),
                    o=_Linear.of(attn.o_proj),
                    gate_up=_Linear.of(mlp.gate_proj, mlp.up_proj),
                    down=_Linear.of(mlp.down_proj),
                )
            )
        # transformers' own float32 cos/sin for every position, computed once, on the model's device.
        positions = torch.arange(max_positions, device=self.embed.device).unsqueeze(0)
        with torch.no_grad():
            cos, sin = inner.rotary_emb(self.embed[:1].float().unsqueeze(0), positions)
        self.cos, self.sin = cos[0].float().contiguous(), sin[0].float().contiguous()

    def packed_weights(self) -> list[PackedWeight]:
        """None: cuBLAS multiplies by the weights as they are (the runner counts the CPU's panels)."""
        return []

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """`input_ids`, `positions` `[T]` -> float32 logits `[len(rows), vocab]` of the packed rows
        `rows`: FusedLlama's step (fused_llama.llama_step), in the model's dtype, SiLU x up a pass of
        its own."""
        return llama_step(self, self.embedded(input_ids), positions, rows, batch)

    def embedded(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings `[T, hidden]` in the model's dtype, a new tensor."""
        return F.embedding(input_ids, self.embed)

    def mlp(self, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
        return layer.down(self.ops.silu_mul(layer.gate_up(x)))
