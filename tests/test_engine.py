"""Engine behaviour beyond greedy parity: sampling, seeds, logprobs, stops, cancellation, bad input."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.worker.engine import Engine
from services.worker.request import FinishReason, RequestStatus
from tests.test_engine_parity import assert_no_leak, make_prompts


@pytest.fixture
def engine(tiny_models: Callable[[str], Path]) -> Iterator[Engine]:
    with Engine.from_pretrained(
        tiny_models("llama"), num_blocks=24, page_size=8, max_batch_tokens=32, cpu_offload_space=0.01
    ) as e:
        yield e


def test_same_seed_same_output_whatever_the_batch(engine: Engine) -> None:
    prompts = make_prompts(seed=1, count=5)
    sampling = {"temperature": 1.0, "top_k": 50, "top_p": 0.9}
    alone = engine.generate(prompts[:1], 16, ignore_eos=True, seed=42, **sampling)
    batched = engine.generate(prompts, 16, ignore_eos=True, seed=42, **sampling)
    assert batched[0] == alone[0]
    again = engine.generate(prompts, 16, ignore_eos=True, seed=42, **sampling)
    assert again == batched
    other = engine.generate(prompts, 16, ignore_eos=True, seed=7, **sampling)
    assert other != batched
    assert_no_leak(engine)


def test_logprobs_match_the_model(engine: Engine) -> None:
    prompt = make_prompts(seed=2, count=1)[0]
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=3, ignore_eos=True, logprobs=4))
    engine.run_until_done()
    assert len(req.logprobs) == 3
    with torch.inference_mode():
        logits = engine.model.__class__.from_pretrained(engine.model.name_or_path)(
            torch.tensor([prompt + req.output_ids])
        ).logits[0]
    expected = torch.log_softmax(logits[len(prompt) - 1 :].float(), dim=-1)
    for i, lp in enumerate(req.logprobs):
        assert lp is not None
        assert lp.token_logprob == pytest.approx(expected[i, req.output_ids[i]].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == expected[i].topk(4).indices.tolist()


def test_min_new_tokens_and_stop_token_ids(engine: Engine) -> None:
    prompt = make_prompts(seed=3, count=1)[0]
    free_run = engine.generate([prompt], 12, ignore_eos=True)[0]
    stop = free_run[5]
    req = engine.add_request(prompt, SamplingParams(max_new_tokens=12, stop_token_ids=(stop,)))
    engine.run_until_done()
    assert req.finish_reason is FinishReason.STOP_TOKEN
    assert req.output_ids == free_run[: free_run.index(stop) + 1]
    held = engine.add_request(
        prompt, SamplingParams(max_new_tokens=12, min_new_tokens=12, stop_token_ids=(stop,), ignore_eos=True)
    )
    engine.run_until_done()
    assert len(held.output_ids) == 12 and stop not in held.output_ids
    assert_no_leak(engine)


@pytest.mark.parametrize("target", ["pending", "prefilling", "decoding", "offloaded"])
def test_cancel_in_any_state_releases_everything(engine: Engine, target: str) -> None:
    rng = random.Random(4)
    reqs = [
        engine.add_request(
            [rng.randint(3, 255) for _ in range(n)], SamplingParams(max_new_tokens=40, ignore_eos=True)
        )
        for n in (60, 70, 50, 65, 55)
    ]
    wanted = RequestStatus(target)
    for _ in range(400):
        found = [r for r in reqs if r.status is wanted]
        if found:
            break
        engine.step()
    else:
        pytest.fail(f"no request reached {target}")
    engine.abort(found[0].request_id)
    assert found[0].finish_reason is FinishReason.ABORTED
    engine.run_until_done()
    assert_no_leak(engine)
    assert all(r.finished for r in reqs)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "empty prompt"),
        ([5, 300], SamplingParams(), "out of vocabulary"),
        ([5, -1], SamplingParams(), "out of vocabulary"),
        ([5], SamplingParams(temperature=-1.0), "temperature"),
        ([5], SamplingParams(top_p=0.0), "top_p"),
        ([5], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([5], SamplingParams(stop_token_ids=(999,)), "stop_token_ids"),
        ([5], SamplingParams(logprobs=100), "logprobs"),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(
    engine: Engine, prompt: list[int], params: SamplingParams, message: str
) -> None:
    before = engine.stats()
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert engine.stats() == before
    assert engine.generate([[5, 6, 7]], 4, ignore_eos=True)  # still serving


def test_request_that_can_never_fit_fails_alone(engine: Engine) -> None:
    ok = make_prompts(seed=5, count=2)
    huge = engine.add_request(list(range(3, 253)), SamplingParams(max_new_tokens=8))
    outs = [engine.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in ok]
    engine.run_until_done()
    assert huge.finish_reason is FinishReason.ERROR and "chunks" in huge.error
    assert all(len(r.output_ids) == 8 for r in outs)
    assert_no_leak(engine)
