"""Model sources: name resolution, the one-time GGUF conversion, and the tiny test model families."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from services.common import model_source
from services.common.model_source import (
    DEFAULT_MODEL,
    GGUF_FILE,
    STAMP_FILE,
    gguf_path,
    load_model,
    prepare_default_model,
    resolve_model,
)
from tests.tiny_models import FAMILIES, MISTRAL_SLIDING_WINDOW, PAD_ID, tiny_config

TinyModels = Callable[[str], Path]

PROMPT_LEN = 64  # longer than every tiny sliding window, so windows are exercised
NEW_TOKENS = 8


def _prompt(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (1, PROMPT_LEN), generator=generator)


def _greedy(model: torch.nn.Module, input_ids: torch.Tensor, new_tokens: int = NEW_TOKENS) -> list[int]:
    out = model.generate(
        input_ids, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=PAD_ID
    )
    return out[0, input_ids.shape[1] :].tolist()


def _greedy_without_cache(model: torch.nn.Module, input_ids: torch.Tensor) -> list[int]:
    """Reference decoding that recomputes the whole sequence each step (no KV cache involved)."""
    ids = input_ids
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            next_id = model(ids, use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, input_ids.shape[1] :].tolist()


# --- resolve_model -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt2", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-typo"])
def test_resolve_model_rejects_unknown_names(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        resolve_model(name)


def test_resolve_model_rejects_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=str(tmp_path)):
        resolve_model(str(tmp_path))


def test_resolve_model_passes_local_directories_through(tiny_models: TinyModels) -> None:
    directory = tiny_models("llama")
    assert resolve_model(str(directory)) == directory
    assert resolve_model(directory) == directory


def test_resolve_model_default_names(smollm2_dir: Path) -> None:
    assert resolve_model(None) == smollm2_dir
    assert resolve_model(DEFAULT_MODEL) == smollm2_dir


# --- conversion bookkeeping (fake converter: cheap, exercises atomicity and the stamp) -----------------


def _fake_convert(calls: list[Path]) -> Callable[[Path, Path], None]:
    def convert(source: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        (out_dir / STAMP_FILE).write_text(json.dumps(model_source._source_stamp(source)))

    return convert


def test_prepare_is_idempotent_and_force_rebuilds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CBSERVE_HOME", str(tmp_path))
    calls: list[Path] = []
    monkeypatch.setattr(model_source, "_convert", _fake_convert(calls))

    first = prepare_default_model()
    assert first == tmp_path / "models" / "smollm2-135m-instruct"
    assert prepare_default_model() == first
    assert len(calls) == 1
    assert prepare_default_model(force=True) == first
    assert len(calls) == 2
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name], "no staging dirs left behind"


def test_prepare_reconverts_when_source_changed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CBSERVE_HOME", str(tmp_path))
    calls: list[Path] = []
    monkeypatch.setattr(model_source, "_convert", _fake_convert(calls))
    target = prepare_default_model()
    (target / STAMP_FILE).write_text(json.dumps({"gguf_file": GGUF_FILE, "gguf_bytes": 1}))
    prepare_default_model()
    assert len(calls) == 2


def test_failed_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CBSERVE_HOME", str(tmp_path))

    def crash(source: Path, out_dir: Path) -> None:
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("simulated crash mid-conversion")

    monkeypatch.setattr(model_source, "_convert", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare_default_model()
    assert list((tmp_path / "models").iterdir()) == []


# --- the real default model ----------------------------------------------------------------------------


def test_default_model_is_prepared_once_and_loads_fast(smollm2_dir: Path) -> None:
    weights = smollm2_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert prepare_default_model() == smollm2_dir
    assert weights.stat().st_mtime_ns == mtime, "a second prepare must not rewrite the weights"
    for name in ("config.json", "generation_config.json", "tokenizer.json", STAMP_FILE):
        assert (smollm2_dir / name).is_file(), name

    load_model(smollm2_dir)  # warm imports and the page cache; the guard is about the steady state
    started = time.perf_counter()
    model, tokenizer = load_model(smollm2_dir)
    elapsed = time.perf_counter() - started
    # A guard against falling back to GGUF de-quantization (~30 s), not a benchmark (typically ~0.3 s).
    assert elapsed < 2.0, f"loading the converted model took {elapsed:.2f} s"
    assert not model.training
    assert model.dtype == torch.float32
    assert tokenizer is not None and tokenizer.chat_template


@pytest.mark.slow  # transformers' own GGUF loader de-quantizes for about 20 s on two cores
def test_converted_model_matches_gguf(smollm2_dir: Path) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    converted, tokenizer = load_model(smollm2_dir)
    assert tokenizer is not None
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids

    source = gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32, local_files_only=True
    ).eval()

    # Stops at the model's own EOS (<|im_end|>, within ~8 tokens) to keep this CPU test short.
    def answer(model: torch.nn.Module) -> list[int]:
        out = model.generate(input_ids, max_new_tokens=12, do_sample=False)
        return out[0, input_ids.shape[1] :].tolist()

    produced = answer(converted)
    assert produced == answer(reference)
    assert "Paris" in tokenizer.decode(produced, skip_special_tokens=True)


# --- tiny families -------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_family_generates_consistently(family: str, tiny_models: TinyModels) -> None:
    directory = tiny_models(family)
    eager, tokenizer = load_model(directory, attn_implementation="eager")
    assert tokenizer is None
    prompt = _prompt()
    tokens = _greedy(eager, prompt)
    assert len(tokens) == NEW_TOKENS
    assert len(set(tokens)) > 2, f"{family}: degenerate greedy output {tokens}"
    assert tokens == _greedy_without_cache(eager, prompt)

    if type(eager)._supports_sdpa:  # Gemma2 opts out: SDPA cannot softcap attention logits
        sdpa, _ = load_model(directory, attn_implementation="sdpa")
        assert _greedy(sdpa, prompt) == tokens


def test_tiny_models_are_deterministic(tiny_models: TinyModels, tmp_path: Path) -> None:
    from tests.tiny_models import tiny_model_dir

    again = tiny_model_dir("qwen2", tmp_path)
    first, _ = load_model(tiny_models("qwen2"))
    second, _ = load_model(again)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(("family", "windowed"), [("mistral", True), ("llama", False)])
def test_sliding_window_limits_what_generation_sees(
    family: str, windowed: bool, tiny_models: TinyModels
) -> None:
    # With every layer sliding, a token sees at most layers × (window − 1) positions back; changing
    # tokens before that horizon must not change greedy output, while a full-attention model notices.
    config = tiny_config(family)
    horizon = config.num_hidden_layers * (MISTRAL_SLIDING_WINDOW - 1)
    changed = 10
    assert PROMPT_LEN - 1 - horizon >= changed
    model, _ = load_model(tiny_models(family))
    prompt = _prompt()
    altered = prompt.clone()
    altered[0, :changed] = _prompt(seed=1)[0, :changed]
    assert (_greedy(model, prompt) == _greedy(model, altered)) is windowed


def test_hybrid_families_mix_layer_types() -> None:
    for family in ("gemma2", "gemma3"):
        if family not in FAMILIES:
            continue
        config = tiny_config(family)
        assert set(config.layer_types) == {"sliding_attention", "full_attention"}, family
        assert config.sliding_window < PROMPT_LEN, family
