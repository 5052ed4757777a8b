"""Token-id prompts written as text, for servers that take prompts only as text: smg's /v1/completions
refuses a list of token ids (its `prompt` is a string or a list of strings), and a comparison must
send every server the same thing.

The workloads draw token ids (workloads.py); here each id stands for one of the tokenizer's word
tokens, those that decode to a space and lowercase ASCII letters and encode back to themselves alone
("the", " house"). Byte-level BPE tokenizers (GPT-2's, SmolLM2's, Llama 3's, Qwen's) split text
before each such word, so a prompt of N words is read back as exactly those N tokens: lengths stay
exact and a group's shared prefix stays a shared token prefix. The mapping is checked once, on a text
of every word token; a tokenizer for which it fails is refused.

The run's cache salt shuffles which word each id stands for: the same command run twice sends other
texts, so a second run is not served from the first one's prefix cache (the gRPC backend's
`cache_salt` does the same); within a run a prefix is always written the same way.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

_WORD = re.compile(r" [a-z]{2,}")


class PromptText:
    """Writes token-id prompts as text for the tokenizer in `tokenizer_dir` (a model directory)."""

    def __init__(self, tokenizer_dir: Path, salt: str) -> None:
        from transformers import AutoTokenizer  # heavy: only the openai backend needs it

        self.tokenizer: Any = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
        self.vocab_size = _vocab_size(tokenizer_dir, len(self.tokenizer))
        self.words = _word_tokens(self.tokenizer)
        if not self.words:
            raise ValueError(f"{tokenizer_dir}: its tokenizer has no word tokens (a space and letters)")
        if salt:
            random.Random(f"words:{salt}").shuffle(self.words)
        self._check_read_back(tokenizer_dir)

    def words_for(self, token_ids: list[int]) -> str:
        """The text of a drawn prompt: one word token per id (ids below `vocab_size`)."""
        return "".join(self.words[t % len(self.words)][1] for t in token_ids)

    def decode(self, token_ids: list[int]) -> str:
        """A dataset's real token ids as the text they stand for."""
        return str(self.tokenizer.decode(token_ids))

    def _check_read_back(self, tokenizer_dir: Path) -> None:
        ids = [token for token, _ in self.words]
        back = self.tokenizer.encode("".join(text for _, text in self.words), add_special_tokens=False)
        if back != ids:
            first = next((i for i, (a, b) in enumerate(zip(ids, back, strict=False)) if a != b), None)
            where = f"{len(back)} tokens for {len(ids)} words" if first is None else f"at {self.words[first]}"
            raise ValueError(
                f"{tokenizer_dir}: its tokenizer does not read a text of its word tokens back as those "
                f"tokens ({where}), so prompts cannot be written as text of exact length"
            )


def _word_tokens(tokenizer: Any) -> list[tuple[int, str]]:
    """(id, text) of the tokens that are a space and lowercase letters and encode to themselves."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    candidates = [(i, t) for i, t in enumerate(texts) if _WORD.fullmatch(t)]
    if not candidates:
        return []
    encoded = tokenizer([t for _, t in candidates], add_special_tokens=False).input_ids
    return [(i, t) for (i, t), ids in zip(candidates, encoded, strict=True) if ids == [i]]


def _vocab_size(model_dir: Path, tokenizer_len: int) -> int:
    """The model's vocabulary (its config's, what cbserve's GetModelInfo says), so that a seed draws
    the same requests as the gRPC backend's; the tokenizer's length without a config."""
    config = model_dir / "config.json"
    if config.is_file():
        size = json.loads(config.read_text()).get("vocab_size")
        if isinstance(size, int) and size > 0:
            return size
    return tokenizer_len
