"""Session-wide fixtures (tiny random models per family, the converted default model, the stacks)
and the hypothesis profiles."""

from __future__ import annotations

import os

# Tests start stacks with Popen(preexec_fn=...), a plain fork, while gRPC channels are open; gRPC's
# fork handlers then race with its pollers. The child execs at once and needs none of them.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
# The suite pins the GEMM crossover: measured on its own busy cores it would be noise, and kept, it
# would be the record a user's stack reads. The panels at every size, as this project's machines
# measured; tests/test_attention.py and tests/test_gemm_crossover.py run torch's side and the measuring.
os.environ.setdefault("CBSERVE_GEMM_CROSSOVER", "never")
# Every stack a test starts runs exact float32 unless the test says otherwise: the parity tests compare
# with transformers' float32 `generate` token for token (`--dtype auto` is bfloat16 on some CPUs).
os.environ.setdefault("CBSERVE_DTYPE", "float32")
# OpenMP threads that wait for work sleep instead of spinning: a test and the stacks it drives (and, under
# `make test`, the other worker's) share the cores, and a spinning thread burns the core another
# process needs. Spinning saves a few microseconds a parallel region, which counts only where one
# process has the cores to itself, as a served worker does.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

# Without a GPU the Triton kernels (the GPU's attention and layer passes) run under Triton's interpreter
# on CPU tensors. Set before anything imports triton (xgrammar does): triton reads the switch as its jit
# functions are made, and kernels made in one mode cannot call helpers made in the other. Only without a
# device: there it would turn every Triton kernel of a GPU run (torch.compile's, xgrammar's) into the
# interpreter's.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase

from services.common.model_source import prepare_default_model
from tests.stack import REPO, Stack
from tests.tiny_models import tiny_model_dir, tiny_text_model_dir

# `pytest` replays the same examples on every machine and every run, so a red run is never luck.
settings.register_profile("fixed", derandomize=True, database=None)
# `make test` (and `make fuzz`) draws new ones from the seed it prints (--hypothesis-seed); a
# failing example is also kept in the git-ignored .hypothesis/, and the next fresh run tries it first.
settings.register_profile(
    "fresh", derandomize=False, database=DirectoryBasedExampleDatabase(REPO / ".hypothesis" / "examples")
)
settings.load_profile("fixed")  # --hypothesis-profile, when given, is loaded after this


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A callable family -> model directory; each family is built at most once per session."""
    root = tmp_path_factory.mktemp("tiny_models")

    def get(family: str) -> Path:
        return tiny_model_dir(family, root)

    return get


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted default model (converted on first use into $CBSERVE_HOME, then reused)."""
    return prepare_default_model()


@pytest.fixture(scope="session")
def tiny_text_model(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama over SmolLM2's whole vocabulary, saved with its tokenizer and chat template
    (`tiny_text_model_dir`): text in and out at a tiny model's speed. Built once; no test writes to it."""
    return tiny_text_model_dir("llama", tmp_path_factory.mktemp("tiny_text"), smollm2_dir)


# Stacks are session-scoped: three processes take tens of seconds to start on two cores.
TINY_STACK_SETTINGS = {
    "page_size": 8,
    "num_blocks": 256,
    "max_batch_tokens": 24,  # every prompt is chunked
    "q_padding_interval_size": 16,
    "kv_padding_interval_size": 8,
}
SMOL_STACK_SETTINGS = {"num_blocks": 96, "max_batch_tokens": 64}


@pytest.fixture(scope="session")
def tiny_stack(
    tiny_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """`cbserve up` on the tiny Llama: chunked prefill, padding, prefix caching."""
    stack = Stack(tiny_models("llama"), tmp_path_factory.mktemp("tiny_stack"), **TINY_STACK_SETTINGS)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def async_stack(
    tiny_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """The tiny stack with async batching: the worker plans each step while the one before computes."""
    stack = Stack(
        tiny_models("llama"),
        tmp_path_factory.mktemp("async_stack"),
        use_async_batching=True,
        **TINY_STACK_SETTINGS,
    )
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def smol_stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`cbserve up` on the embedded SmolLM2 (a real tokenizer and chat template)."""
    stack = Stack(smollm2_dir, tmp_path_factory.mktemp("smol_stack"), **SMOL_STACK_SETTINGS)
    yield stack
    stack.stop()
