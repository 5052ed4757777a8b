"""Incremental detokenization: generated token ids in, text deltas out, never half a character.

The technique is the prefix/read offset window of vLLM and TGI. `_prefix_offset.._read_offset` are
tokens whose text was already emitted (kept as context), `_read_offset..` are tokens not yet emitted.
Each push decodes the window with and without the new tokens and emits the difference, so a token
costs two decodes of a few tokens, whatever the length of the output. The window grows only while
nothing can be emitted: an incomplete character is held back or the tokens add no text (skipped
special tokens). A model emitting an endless run of stray bytes keeps it growing, as in vLLM.

Invariants:
- `"".join(push deltas) + flush()` is the generated text decoded in the context of the prompt. For a
  byte-level BPE tokenizer (SmolLM2, GPT-2, Llama 3, Qwen) that is exactly
  `tokenizer.decode(generated_ids, skip_special_tokens=...)`. SentencePiece-style decoders drop the
  space of the first piece of a text; with an empty prompt the result is again exactly `decode` of
  the output, and after a non-empty prompt the output keeps that leading space (" Paris", not "Paris").
- A `push` delta never ends in U+FFFD: while the window decodes to text ending in an incomplete byte
  sequence, nothing is emitted. A U+FFFD inside a delta is one that `decode` of the whole output has
  too (bytes that no later token can complete). `flush` returns the rest as `decode` renders it.
  One exception, as in vLLM: SentencePiece byte fallback renders a whole run of byte tokens as
  U+FFFD when any byte of it is invalid, so garbage bytes can re-render a character already emitted;
  a stream cannot retract text, so there the deltas keep the text as it was when emitted.
- Windows are decoded with `clean_up_tokenization_spaces=False`: that clean-up rewrites text across
  token boundaries, so it cannot be streamed (byte-level and SentencePiece tokenizers ship with it off).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Enough prompt tokens to decode the first output token as a continuation, as vLLM does.
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Streams the text of one request's generated tokens.

    `flush` ends the stream: a second `flush` returns "", a `push` after it raises RuntimeError.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = self._context(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._flushed = False

    def push(self, token_ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text that is now complete ("" while it is not)."""
        if self._flushed:
            raise RuntimeError("IncrementalDetokenizer.push after flush")
        self._ids.extend(token_ids)
        prefix_text, new_text = self._window_texts()
        # No longer text: the new tokens add nothing yet (e.g. a skipped special token).
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """End the stream: return the held-back text (an incomplete character as `decode` renders it)."""
        if self._flushed:
            return ""
        self._flushed = True
        prefix_text, new_text = self._window_texts()
        return new_text[len(prefix_text) :]

    def _context(self, tail: Sequence[int]) -> list[int]:
        """The slice of `tail` ending furthest right, then longest, whose text ends in a complete character.

        Context text ending in U+FFFD would be rewritten by the output and break the diff. The cut
        points are tried right end first: bytes of a character the prompt leaves unfinished belong to
        no output character, so they go; a window that starts inside a character only needs its
        start moved (byte fallback turns a whole byte run into U+FFFD if its first byte is stray).
        """
        for end in range(len(tail), 0, -1):
            for start in range(end):
                if not self._decode(list(tail[start:end])).endswith(_REPLACEMENT_CHAR):
                    return list(tail[start:end])
        return []

    def _window_texts(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset :]
        return self._decode(window[: self._read_offset - self._prefix_offset]), self._decode(window)

    def _decode(self, ids: list[int]) -> str:
        text = self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special_tokens, clean_up_tokenization_spaces=False
        )
        # decode returns a list only for a batch of sequences; one sequence of ids is one str.
        if not isinstance(text, str):
            raise TypeError(f"the tokenizer decoded one sequence to {type(text).__name__}, not str")
        return text
