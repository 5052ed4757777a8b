"""IncrementalDetokenizer: streamed deltas join to the one-shot decode and never split a character.

Most cases use the real SmolLM2 tokenizer (byte-level BPE); a tiny SentencePiece-style tokenizer
(Metaspace, byte fallback, Llama's decoder) covers the leading-space handling SmolLM2 does not have.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from services.gateway.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


@pytest.fixture(scope="module")
def sentencepiece() -> PreTrainedTokenizerBase:
    """A Llama-style tokenizer: '▁' marks spaces, unknown characters fall back to <0xNN> byte tokens."""
    specials = ["<unk>", "<s>", "</s>"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "▁Hello", "▁world", "▁caf", "é", "!", "a", "b", "▁a", "▁b", "▁世界"]
    vocab = [(piece, 0.0) for piece in specials + byte_pieces] + [(w, -1.0) for w in words]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def stream(
    tokenizer: PreTrainedTokenizerBase,
    generated: Sequence[int],
    *,
    prompt: Sequence[int] = (),
    chunks: Sequence[int] = (),
    skip_special_tokens: bool = True,
) -> list[str]:
    """Push `generated` in pieces of the given sizes (then one token at a time); return deltas + flush.

    Checks on the way that no push ends in U+FFFD and that every push emits all it can: whenever the
    output so far decodes to text not ending in U+FFFD, exactly that text has been emitted.
    """
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    sizes = itertools.chain((size for size in chunks if size > 0), itertools.repeat(1))
    deltas: list[str] = []
    done = 0
    while done < len(generated):
        piece = list(generated[done : done + next(sizes)])
        done += len(piece)
        deltas.append(detok.push(piece))
        assert not deltas[-1].endswith(FFFD)
        so_far = tokenizer.decode(list(generated[:done]), skip_special_tokens=skip_special_tokens)
        if not so_far.endswith(FFFD) and not prompt:
            assert "".join(deltas) == so_far
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "  leading and trailing spaces  \n\ttabs\n",
        "café naïve Ångström ñandú",
        "中文测试，日本語のテキスト、한국어",
        "emoji 🎉🙂👍🏽 and a family 👨\u200d👩\u200d👧 and flags 🇫🇷",
    ],
)
def test_text_round_trips_token_by_token(smollm2: PreTrainedTokenizerBase, text: str) -> None:
    ids = smollm2.encode(text, add_special_tokens=False)
    deltas = stream(smollm2, ids)
    assert "".join(deltas) == smollm2.decode(ids) == text
    assert FFFD not in "".join(deltas)


def test_ascii_is_emitted_with_every_token(smollm2: PreTrainedTokenizerBase) -> None:
    ids = smollm2.encode("Plain ASCII text, one delta per token.", add_special_tokens=False)
    deltas = stream(smollm2, ids)
    assert all(deltas[:-1]) and deltas[-1] == ""


def test_a_split_character_is_held_until_complete(smollm2: PreTrainedTokenizerBase) -> None:
    ids = smollm2.encode("ok 🎉", add_special_tokens=False)
    deltas = stream(smollm2, ids)
    pieces = [smollm2.decode(ids[: n + 1]) for n in range(len(ids))]
    assert any(piece.endswith(FFFD) for piece in pieces), "the emoji should span several tokens"
    # The space before the emoji shares its tokens, so it waits with the emoji.
    assert [d for d in deltas if d] == ["ok", " 🎉"]


def test_flush_returns_a_trailing_incomplete_character_as_decode_does(
    smollm2: PreTrainedTokenizerBase,
) -> None:
    ids = smollm2.encode("a世", add_special_tokens=False)
    truncated = ids[:-1]
    assert smollm2.decode(truncated).endswith(FFFD)
    deltas = stream(smollm2, truncated)
    assert deltas[-1].endswith(FFFD)
    assert "".join(deltas) == smollm2.decode(truncated)


def test_special_tokens(smollm2: PreTrainedTokenizerBase) -> None:
    im_end = smollm2.convert_tokens_to_ids("<|im_end|>")
    ids = [*smollm2.encode("Hi", add_special_tokens=False), im_end]
    ids += [
        *smollm2.encode(" there", add_special_tokens=False),
        smollm2.convert_tokens_to_ids("<|endoftext|>"),
    ]
    assert "".join(stream(smollm2, ids)) == smollm2.decode(ids, skip_special_tokens=True) == "Hi there"
    kept = "".join(stream(smollm2, ids, skip_special_tokens=False))
    assert kept == smollm2.decode(ids) == "Hi<|im_end|> there<|endoftext|>"


def test_prompt_is_context_not_output(smollm2: PreTrainedTokenizerBase) -> None:
    prompt = smollm2.apply_chat_template(
        [{"role": "user", "content": "Capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = smollm2.encode(prompt, add_special_tokens=False)
    ids = smollm2.encode(" Paris, of course.", add_special_tokens=False)
    assert "".join(stream(smollm2, ids, prompt=prompt_ids)) == " Paris, of course."


def test_prompt_ending_inside_a_character(smollm2: PreTrainedTokenizerBase) -> None:
    ids = smollm2.encode("x世界", add_special_tokens=False)
    cut = next(n for n in range(1, len(ids)) if smollm2.decode(ids[:n]).endswith(FFFD))
    generated = ids[cut:]
    assert "".join(stream(smollm2, generated, prompt=ids[:cut])) == smollm2.decode(generated)


def test_sentencepiece_leading_space(sentencepiece: PreTrainedTokenizerBase) -> None:
    hello = sentencepiece.encode("Hello", add_special_tokens=False)
    world = sentencepiece.encode("world 世界 café! 🎉", add_special_tokens=False)
    assert sentencepiece.convert_ids_to_tokens(world[:1]) == ["▁world"]
    # Alone, decode drops the first piece's space; after a prompt the continuation keeps it.
    assert "".join(stream(sentencepiece, world)) == sentencepiece.decode(world) == "world 世界 café! 🎉"
    assert "".join(stream(sentencepiece, world, prompt=hello)) == " world 世界 café! 🎉"
    bos_first = [sentencepiece.bos_token_id, *world]
    assert "".join(stream(sentencepiece, bos_first)) == sentencepiece.decode(
        bos_first, skip_special_tokens=True
    )


SETTINGS = settings(max_examples=150, deadline=None)


@pytest.fixture(scope="module")
def smollm2_ids(smollm2: PreTrainedTokenizerBase) -> st.SearchStrategy[int]:
    """Any id, weighted so single-byte tokens (split and invalid UTF-8) and special tokens are common."""
    byte_ids = sorted(i for token, i in smollm2.get_vocab().items() if len(token) == 1)
    return st.one_of(
        st.integers(0, len(smollm2) - 1), st.sampled_from(byte_ids), st.sampled_from(smollm2.all_special_ids)
    )


@pytest.mark.fuzz
@SETTINGS
@given(data=st.data())
def test_random_ids_stream_like_one_decode(
    smollm2: PreTrainedTokenizerBase, smollm2_ids: st.SearchStrategy[int], data: st.DataObject
) -> None:
    prompt = data.draw(st.lists(smollm2_ids, max_size=8), label="prompt")
    generated = data.draw(st.lists(smollm2_ids, max_size=40), label="generated")
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=10), label="chunks")
    skip = data.draw(st.booleans(), label="skip_special_tokens")
    deltas = stream(smollm2, generated, prompt=prompt, chunks=chunks, skip_special_tokens=skip)
    # Joining equals the one-shot decode, so every U+FFFD a delta holds is one the whole decode has.
    assert "".join(deltas) == smollm2.decode(generated, skip_special_tokens=skip)


TEXT = st.text(st.sampled_from("ab Hello world é世界🎉ñ\n"), max_size=30)


@pytest.mark.fuzz
@SETTINGS
@given(prompt=TEXT, text=TEXT, chunks=st.lists(st.integers(1, 4), max_size=10))
def test_random_text_stream_like_one_decode(
    smollm2: PreTrainedTokenizerBase,
    sentencepiece: PreTrainedTokenizerBase,
    prompt: str,
    text: str,
    chunks: list[int],
) -> None:
    for tokenizer in (smollm2, sentencepiece):
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert "".join(stream(tokenizer, ids, chunks=chunks)) == tokenizer.decode(ids)
        # After a prompt the output is what the prompt-and-output decode adds to the prompt's text.
        whole = tokenizer.decode(prompt_ids + ids)
        expected = whole[len(tokenizer.decode(prompt_ids)) :]
        assert "".join(stream(tokenizer, ids, prompt=prompt_ids, chunks=chunks)) == expected
