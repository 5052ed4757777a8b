"""The GPU's forward for the Llama family (services/worker/gpu_llama.py) in the engine, run on the CPU:
`CBSERVE_FORWARD=triton` builds it (cuBLAS's products become torch's CPU ones) and
`CBSERVE_PAGED_ATTENTION=triton` gives it the Triton attention, every Triton kernel under Triton's
interpreter here. Greedy outputs equal transformers `generate` (fp32) token for token, and prompt
log-probabilities its logits, through chunked prefill, a prefix hit and decode steps replayed from
(emulated) CUDA graphs whose capture a guard watches for what a graph cannot hold; the rotary table
covers the graphs' padded positions. The kernels themselves are checked against torch one by one in
tests/test_triton_fused.py and tests/test_triton_attention.py.

On a GPU `auto` picks this forward: the cuda test (`pytest -m cuda`, the device check's tests
section) runs it compiled under real CUDA graphs, float32 tokens against `generate` on the device and
bfloat16 log-probabilities against transformers' bfloat16 layers. The interpreter runs each Triton
program in numpy, milliseconds each on two cores: the default tests keep to a few short prompts (about
15 s); other families (Qwen2's q|k|v biases, Mistral's window) and bfloat16 are in the slow run.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

pytest.importorskip("triton", reason="the Triton kernels need triton (xgrammar brings it on Linux x86-64)")

from services.worker import attention_kernels, layer_forward
from services.worker.engine import Engine
from services.worker.request import SamplingParams
from tests.capture_guard import guarded_capture
from tests.cuda_marks import cuda_only
from tests.parity import assert_no_leak, generate_reference, reference_prompt_logprobs
from tests.step_kinds import step_kinds

NEW_TOKENS = 4


@pytest.fixture
def triton_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(layer_forward.SWITCH, "triton")
    monkeypatch.setenv(attention_kernels.SWITCH, "triton")


# The CPU's tests: the GPU's forward forced, its kernels interpreted.
interpreted = (
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1", reason="on a GPU the cuda tests run this path compiled"
    ),
    pytest.mark.usefixtures("triton_everywhere"),
)


def on_the_cpu(test: Callable[..., None]) -> Callable[..., None]:
    for mark in interpreted:
        test = mark(test)
    return test


def prompts(seed: int) -> tuple[list[list[int]], list[int]]:
    """Two prompts, then a third that shares the first's first two pages of 8 (a prefix hit)."""
    rng = random.Random(seed)
    first, second = ([rng.randint(3, 255) for _ in range(n)] for n in (19, 13))
    return [first, second], first[:16] + [rng.randint(3, 255) for _ in range(5)]


def run(engine: Engine, together: list[list[int]], after: list[int]) -> tuple[list[list[int]], Any]:
    """`together` at once (the last asks for its prompt's log-probabilities, which no prefix hit may
    skip), then `after` alone: its prefix hit, on the first's pages."""
    reqs = [
        engine.add_request(
            prompt,
            SamplingParams(
                max_new_tokens=NEW_TOKENS,
                ignore_eos=True,
                prompt_logprobs=2 if prompt is together[-1] else None,
            ),
        )
        for prompt in together
    ]
    engine.run_until_done()
    outputs = [r.output_ids for r in reqs] + engine.generate([after], NEW_TOKENS, ignore_eos=True)
    return outputs, reqs[-1]


def assert_prompt_logprobs(req: Any, expected: torch.Tensor, tolerance: float) -> None:
    assert len(req.prompt_logprobs) == len(req.prompt_ids) - 1
    for i, lp in enumerate(req.prompt_logprobs):
        assert lp.token_logprob == pytest.approx(expected[i, req.prompt_ids[i + 1]].item(), abs=tolerance), i


def prompt_logprob_error(engine: Engine, prompt: list[int], exact: torch.Tensor) -> float:
    """The mean distance of the engine's prompt log-probabilities from `exact`'s (float32's)."""
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True, prompt_logprobs=1))
    engine.run_until_done()
    gaps = [
        abs(lp.token_logprob - exact[i, prompt[i + 1]].item()) for i, lp in enumerate(req.prompt_logprobs)
    ]
    return sum(gaps) / len(gaps)


# Pages of 8 and a pool of 14 chunks: requests read at most 112 keys, and the graphs' buckets
# (4 requests; 64 and 128 keys) put their captures' positions up to 127, past the pool.
GRAPHED = {
    "page_size": 8,
    "num_blocks": 12,
    "max_batch_tokens": 8,
    "max_requests_per_batch": 4,
    "q_padding_interval_size": 4,
    "kv_padding_interval_size": 64,
}


@on_the_cpu
def test_greedy_tokens_and_prompt_logprobs_equal_transformers(tiny_models: Callable[[str], Path]) -> None:
    model_dir = tiny_models("llama")
    together, after = prompts(seed=5)
    expected = generate_reference(model_dir, [*together, after], NEW_TOKENS, "cpu")
    with Engine.from_pretrained(model_dir, **GRAPHED) as engine:
        runner = engine.runner
        assert runner.describe()["forward"] == "triton" and runner.attention.name == "triton"
        assert runner.max_keys == 112 and runner.fused is not None and runner.fused.cos.shape[0] == 128
        runner.use_graphs(guarded_capture)
        assert runner.graphs is not None and runner.graphs.count == 2
        assert runner.pieces is not None and runner.pieces.buckets == [8, 4]  # a graph a layer each
        kinds = step_kinds(runner.pieces)
        outputs, req = run(engine, together, after)
        assert outputs == expected
        assert_prompt_logprobs(req, reference_prompt_logprobs(model_dir, together[-1]), 1e-4)
        assert runner.builder.prompt_chunks > 0
        assert runner.graphs.replays > 0  # decode steps, whole
        assert runner.pieces.replays == len(kinds) and (True, True) in kinds  # mixed steps, piecewise
        assert engine.stats()["prefix_hit_tokens"] == 16
        assert_no_leak(engine)


@on_the_cpu
def test_the_switch_picks_the_forward(
    monkeypatch: pytest.MonkeyPatch, tiny_models: Callable[[str], Path]
) -> None:
    llama = AutoModelForCausalLM.from_pretrained(tiny_models("llama"), dtype=torch.float32)
    gemma2 = AutoModelForCausalLM.from_pretrained(tiny_models("gemma2"), dtype=torch.float32)
    monkeypatch.setenv(layer_forward.SWITCH, "flash")
    with pytest.raises(ValueError, match="CBSERVE_FORWARD must be one of"):
        layer_forward.choose(llama, "none", torch.float32, 64)
    monkeypatch.setenv(layer_forward.SWITCH, "transformers")
    assert layer_forward.choose(llama, "none", torch.float32, 64) is None
    monkeypatch.setenv(layer_forward.SWITCH, "auto")  # a CPU: the native forward, where it is built
    chosen = layer_forward.choose(llama, "none", torch.float32, 64)
    assert chosen is None or chosen.name == "native"
    assert layer_forward.choose(gemma2, "none", torch.float32, 64) is None
    monkeypatch.setenv(layer_forward.SWITCH, "triton")  # asked for: an error where it cannot run
    with pytest.raises(ValueError, match="not a Llama-shaped decoder"):
        layer_forward.choose(gemma2, "none", torch.float32, 64)
    with pytest.raises(ValueError, match=r"KV pool of torch\.int8"):
        layer_forward.choose(llama, "none", torch.int8, 64)
    with pytest.raises(ValueError, match="--quantization int8"):
        layer_forward.choose(llama, "int8", torch.float32, 64)
    with monkeypatch.context() as compiled:
        compiled.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="a model on the cpu"):
            layer_forward.choose(llama, "none", torch.float32, 64)
    gpu = layer_forward.choose(llama, "none", torch.bfloat16, 64)
    assert gpu is not None and gpu.name == "triton" and gpu.activation_dtype == torch.float32
    assert gpu.packed_weights() == []
    # q, k and v's parameters are views of the one concatenated weight: no byte is held twice.
    attn = llama.model.layers[0].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == attn.q_proj.weight.untyped_storage().data_ptr()


@pytest.mark.slow
@on_the_cpu
@pytest.mark.parametrize(
    ("family", "cb"),
    [
        ("qwen2", {"num_blocks": 64, "page_size": 8, "max_batch_tokens": 8}),  # q|k|v biases
        ("mistral", {"num_blocks": 64, "page_size": 8, "max_batch_tokens": 8}),  # a sliding window
    ],
)
def test_other_families_equal_generate(
    family: str, cb: dict[str, int], tiny_models: Callable[[str], Path]
) -> None:
    model_dir = tiny_models(family)
    rng = random.Random(11)
    together = [[rng.randint(3, 255) for _ in range(n)] for n in (30, 17)]
    after = together[0][:24] + [rng.randint(3, 255) for _ in range(9)]
    expected = generate_reference(model_dir, [*together, after], NEW_TOKENS, "cpu")
    with Engine.from_pretrained(model_dir, **cb) as engine:
        assert engine.runner.describe()["forward"] == "triton"
        outputs, req = run(engine, together, after)
        assert outputs == expected
        assert_prompt_logprobs(req, reference_prompt_logprobs(model_dir, together[-1]), 1e-4)
        assert_no_leak(engine)


@pytest.mark.slow
@on_the_cpu
def test_bfloat16_is_as_close_to_float32_as_transformers_layers(
    monkeypatch: pytest.MonkeyPatch, tiny_models: Callable[[str], Path]
) -> None:
    """16-bit activations with float32 inside each pass: a 40-token prompt's log-probabilities are on
    average no further from float32's than with transformers' own bfloat16 layers (over the same
    Triton attention), give or take a half: the interpreter truncates to bfloat16 where a GPU rounds."""
    errors = _bfloat16_errors(monkeypatch, tiny_models("llama"), page_size=8)
    assert 0 < errors["triton"] <= 1.5 * errors["transformers"], errors


def _bfloat16_errors(monkeypatch: pytest.MonkeyPatch, model_dir: Path, **settings: Any) -> dict[str, float]:
    """A 40-token prompt's log-probabilities' error against float32's, in bfloat16, with this forward
    and with transformers' layers."""
    rng = random.Random(9)
    prompt = [rng.randint(3, 255) for _ in range(40)]
    exact = reference_prompt_logprobs(model_dir, prompt)
    errors = {}
    for forward in ("triton", "transformers"):
        monkeypatch.setenv(layer_forward.SWITCH, forward)
        with Engine.from_pretrained(model_dir, dtype="bfloat16", num_blocks=64, **settings) as engine:
            assert engine.runner.describe()["forward"] == forward
            assert engine.runner.activation_dtype == torch.bfloat16
            errors[forward] = prompt_logprob_error(engine, prompt, exact)
    return errors


@cuda_only
def test_on_cuda_auto_runs_this_forward_and_graphs_replay_it(
    monkeypatch: pytest.MonkeyPatch, tiny_models: Callable[[str], Path]
) -> None:
    """The default on a GPU: this forward and the Triton attention, compiled, decode steps replayed
    from real CUDA graphs: float32 tokens equal `generate` on the device; bfloat16 log-probabilities
    no further from float32's than transformers' bfloat16 layers are."""
    monkeypatch.delenv(layer_forward.SWITCH, raising=False)
    monkeypatch.delenv(attention_kernels.SWITCH, raising=False)
    model_dir = tiny_models("llama")
    together, after = prompts(seed=5)
    expected = generate_reference(model_dir, [*together, after], NEW_TOKENS, "cuda")
    cb = GRAPHED | {"use_cuda_graph": True}
    with Engine.from_pretrained(model_dir, device="cuda", **cb) as engine:
        runner = engine.runner
        assert (runner.describe()["forward"], runner.attention.name) == ("triton", "triton")
        assert runner.graphs is not None and runner.graphs.count == 2
        outputs, _ = run(engine, together, after)
        assert outputs == expected
        assert runner.graphs.replays > 0 and engine.stats()["prefix_hit_tokens"] == 16
    errors = _bfloat16_errors(monkeypatch, model_dir, device="cuda")
    assert 0 < errors["triton"] <= 1.5 * errors["transformers"], errors
