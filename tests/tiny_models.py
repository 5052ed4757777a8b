"""Tiny random decoder models, one per architecture family, saved as local transformers directories.

Every family shares one geometry (hidden 64, 4 query heads, 2 KV heads, head_dim 16, intermediate 128,
vocab 256, 1024 positions, float32) so tests can reason about page sizes and memory without caring
which family they run. Families differ in how attention is laid out:

- `llama`, `qwen2`, `qwen3`: full attention on every layer (Qwen3 also normalises q and k per head).
- `mistral`: a sliding window (`MISTRAL_SLIDING_WINDOW`) on every layer, expressed the Mistral way:
  a scalar `sliding_window` and no `layer_types` (transformers 5 then builds a sliding mask and
  sliding cache layers for all layers).
- `gemma2`, `gemma3` (text only): hybrid, with explicit `layer_types` mixing `sliding_attention` and
  `full_attention` and a small `sliding_window`.

Invariants:
- The same family always produces bitwise-identical weights: the RNG is seeded right before init.
- Weights are drawn with std `INIT_STD` (far above transformers' 0.02) so greedy decoding walks through
  varied tokens instead of repeating one; tests that compare two code paths need that diversity.
- Directories hold no tokenizer: tests feed token ids. `eos_token_id` is `EOS_ID` (tests that want a
  fixed length pass ignore_eos). The exception, `tiny_text_model_dir`, borrows a real tokenizer.
- Sliding windows are shorter than the prompts tests use, so the window is actually exercised.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

try:
    from transformers import Gemma3TextConfig
except ImportError:  # older transformers: the family is simply not offered
    Gemma3TextConfig = None

BOS_ID = 0
EOS_ID = 1
PAD_ID = 2
VOCAB_SIZE = 256
INIT_STD = 0.2

MISTRAL_SLIDING_WINDOW = 24
GEMMA2_SLIDING_WINDOW = 16
GEMMA3_SLIDING_WINDOW = 16

# Gemma2 alternates like the released checkpoints (sliding first). Gemma3 follows its 1-in-N global
# pattern shrunk to 4 layers and ends on a sliding layer, so the two hybrids cover different layouts.
GEMMA2_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
GEMMA3_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "initializer_range": INIT_STD,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}


def _llama() -> PreTrainedConfig:
    return LlamaConfig(**_COMMON, num_hidden_layers=2)


def _qwen2() -> PreTrainedConfig:
    return Qwen2Config(**_COMMON, num_hidden_layers=2, use_sliding_window=False)


def _qwen3() -> PreTrainedConfig:
    # Qwen3 adds per-head RMSNorm on queries and keys before RoPE: a different attention module.
    return Qwen3Config(**_COMMON, num_hidden_layers=2, use_sliding_window=False)


def _mistral() -> PreTrainedConfig:
    return MistralConfig(**_COMMON, num_hidden_layers=2, sliding_window=MISTRAL_SLIDING_WINDOW)


def _gemma2() -> PreTrainedConfig:
    # query_pre_attn_scalar follows the real checkpoints (= head_dim); attn_logit_softcapping stays at its
    # default (50.0) so the softcap path is exercised. Gemma scales embeddings by sqrt(hidden), so with
    # tied weights the residual stream of a random model is mostly the input embedding and greedy decoding
    # just repeats the last token; untied output weights avoid that.
    return Gemma2Config(
        **_COMMON,
        tie_word_embeddings=False,
        num_hidden_layers=len(GEMMA2_LAYER_TYPES),
        sliding_window=GEMMA2_SLIDING_WINDOW,
        layer_types=GEMMA2_LAYER_TYPES,
        query_pre_attn_scalar=16,
    )


def _gemma3() -> PreTrainedConfig:
    assert Gemma3TextConfig is not None
    return Gemma3TextConfig(
        **_COMMON,
        tie_word_embeddings=False,  # see _gemma2
        num_hidden_layers=len(GEMMA3_LAYER_TYPES),
        sliding_window=GEMMA3_SLIDING_WINDOW,
        layer_types=GEMMA3_LAYER_TYPES,
        query_pre_attn_scalar=16,
    )


_BUILDERS: dict[str, Callable[[], PreTrainedConfig]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "gemma2": _gemma2,
}
if Gemma3TextConfig is not None:
    _BUILDERS["gemma3"] = _gemma3

FAMILIES: tuple[str, ...] = tuple(_BUILDERS)

# Fixed per family (not derived from hash(), which is salted per process).
_SEEDS = {"llama": 1000, "qwen2": 1001, "mistral": 1002, "gemma2": 1003, "gemma3": 1004, "qwen3": 1005}


def tiny_config(family: str) -> PreTrainedConfig:
    """A fresh config for `family`; raises ValueError naming the family if it is unknown."""
    if family not in _BUILDERS:
        raise ValueError(f"unknown tiny model family {family!r}; known: {list(FAMILIES)}")
    return _BUILDERS[family]()


def tiny_model_dir(family: str, root: Path) -> Path:
    """Return `root/family`, building and saving the seeded tiny model there on first use.

    The directory appears atomically (built beside it, then renamed), so a reader never sees a
    half-written model and a second call is just an existence check.
    """
    return _build(family, tiny_config(family), root / family)


def tiny_text_model_dir(family: str, root: Path, tokenizer_dir: Path) -> Path:
    """Return `root/<family>-text`: `family`'s geometry over the whole vocabulary of the tokenizer in
    `tokenizer_dir`, saved with that tokenizer (and its chat template) and its special token ids.
    A model that takes and gives text at a tiny model's speed, for what tokenizes outside cbserve
    (the smg router). Its output is random text, possibly special tokens too."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    config = tiny_config(family)
    config.vocab_size = len(tokenizer)
    eos = tokenizer.eos_token_id
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    config.bos_token_id, config.eos_token_id = bos, eos
    config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return _build(family, config, root / f"{family}-text", tokenizer)


def tiny_looping_model_dir(root: Path) -> Path:
    """Return `root/gemma2-tied`: the gemma2 geometry with tied embeddings, whose greedy decoding
    repeats the last token again and again (see `_gemma2`): a model that loops, for what is meant to
    break loops."""
    config = tiny_config("gemma2")
    config.tie_word_embeddings = True
    return _build("gemma2", config, root / "gemma2-tied")


def _build(family: str, config: PreTrainedConfig, target: Path, tokenizer: Any = None) -> Path:
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(_SEEDS[family])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
