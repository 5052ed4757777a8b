"""Engine behaviour beyond greedy parity: sampling, seeds, logprobs (of samples and of prompts), stops,
cancellation, bad input, presence/frequency penalties and logit bias; each with async batching off
and on, and what async batching adds: a step starts before the host has the tokens of the one before
(unless a repetition penalty needs them), a request that stops wastes at most one computed token, and
one aborted meanwhile gets no more."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from msgspec.structs import replace

from services.common.sampling_params import SamplingParams
from services.worker.batch import BatchItem
from services.worker.engine import Engine
from services.worker.request import FinishReason, Request, RequestStatus
from services.worker.scheduler import StepBatch
from tests.openai_penalties import openai_greedy
from tests.parity import assert_no_leak, make_prompts, reference, reference_prompt_logprobs
from tests.tiny_models import tiny_looping_model_dir


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def engine(request: pytest.FixtureRequest, tiny_models: Callable[[str], Path]) -> Iterator[Engine]:
    with Engine.from_pretrained(
        tiny_models("llama"),
        num_blocks=24,
        page_size=8,
        max_batch_tokens=32,
        cpu_offload_space=0.01,
        use_async_batching=request.param,
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


def assert_prompt_logprobs(req: Request, model_dir: Path) -> None:
    """Exactly one entry per prompt token after the first, each equal to the reference's."""
    n = req.params.prompt_logprobs
    assert n is not None
    expected = reference_prompt_logprobs(model_dir, req.prompt_ids)
    assert len(req.prompt_logprobs) == len(req.prompt_ids) - 1
    for i, lp in enumerate(req.prompt_logprobs):
        row = expected[i]
        assert lp.token_logprob == pytest.approx(row[req.prompt_ids[i + 1]].item(), abs=1e-4), i
        top = row.topk(n)
        assert [t for t, _ in lp.top] == top.indices.tolist(), i
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4), i


@pytest.mark.parametrize(
    ("family", "cb"),
    [
        ("llama", {"max_batch_tokens": 256}),  # one step; our fused forward
        ("qwen3", {"max_batch_tokens": 256}),  # one step; transformers' forward
        ("llama", {"max_batch_tokens": 16}),  # chunked by the token budget
        ("qwen3", {"max_batch_tokens": 16}),
        ("llama", {"max_batch_tokens": 256, "max_requests_per_batch": 6}),  # chunked by logits rows
        ("llama", {"max_batch_tokens": 16, "use_async_batching": True}),
    ],
)
def test_prompt_logprobs_match_the_model(
    family: str, cb: dict[str, int], tiny_models: Callable[[str], Path]
) -> None:
    model_dir = tiny_models(family)
    wanting, plain = make_prompts(seed=8, count=2)
    with Engine.from_pretrained(model_dir, num_blocks=64, page_size=8, **cb) as engine:
        req = engine.add_request(
            wanting, SamplingParams(max_new_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=5)
        )
        other = engine.add_request(plain, SamplingParams(max_new_tokens=4, ignore_eos=True))
        engine.run_until_done()
        assert_prompt_logprobs(req, model_dir)
        assert len(req.logprobs) == 4
        assert other.prompt_logprobs == []
        expected = reference(model_dir, "sdpa", [wanting, plain])
        assert [req.output_ids, other.output_ids] == [ids[:4] for ids in expected]
        if cb["max_batch_tokens"] == 16 or "max_requests_per_batch" in cb:
            assert engine.runner.builder.prompt_chunks > 0
        assert_no_leak(engine)


def test_prompt_logprobs_read_no_cached_prefix(tiny_models: Callable[[str], Path]) -> None:
    model_dir = tiny_models("llama")
    prompt = make_prompts(seed=9, count=1)[0] * 2  # several full pages
    with Engine.from_pretrained(model_dir, num_blocks=64, page_size=8, max_batch_tokens=32) as engine:
        engine.generate([prompt], 2, ignore_eos=True)  # the prompt's pages are now cached
        req = engine.add_request(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True, prompt_logprobs=3))
        engine.run_until_done()
        assert req.num_cached_tokens == 0
        assert_prompt_logprobs(req, model_dir)
        # The cache was there to read, and other requests still do.
        again = engine.add_request(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
        engine.run_until_done()
        assert again.num_cached_tokens >= len(prompt) // 8 * 8 - 8
        assert_no_leak(engine)


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_survive_soft_resets_once(
    async_batching: bool, tiny_models: Callable[[str], Path]
) -> None:
    """A soft reset mid-prefill re-prefills from the cache of the request's own pages: the rows
    taken before the reset are not taken again, and those after it are still computed."""
    model_dir = tiny_models("llama")
    rng = random.Random(1)
    prompts = [[rng.randint(3, 255) for _ in range(n)] for n in (60, 70, 50, 65, 55)]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, prompt_logprobs=3)
    with Engine.from_pretrained(
        model_dir, num_blocks=16, page_size=8, max_batch_tokens=32, use_async_batching=async_batching
    ) as engine:
        reqs = [engine.add_request(p, params) for p in prompts]
        reset_owing = 0  # soft resets of requests whose prompt logprobs were incomplete
        while engine.has_work:
            owing = sum(1 for r in reqs if r.prompt_logprobs_owed)
            resets = engine.stats()["soft_resets"]
            engine.step()
            if engine.stats()["soft_resets"] > resets and owing:
                reset_owing += 1
        assert reset_owing > 0
        for req in reqs:
            assert_prompt_logprobs(req, model_dir)
        assert [r.output_ids for r in reqs] == reference(model_dir, "sdpa", prompts)
        assert_no_leak(engine)


def test_only_prompt_logprob_rows_add_logits_rows(engine: Engine) -> None:
    """A request without prompt logprobs computes the LM head on its sampling row alone."""
    tables = [[3, 4]]
    plain = [BatchItem(0, [5, 6, 7], tables, True), BatchItem(0, [8, 9], tables, False)]
    assert engine.runner.build(plain).logits_indices.tolist() == [2]
    wanting = [*plain, BatchItem(4, [10, 11, 12, 13], tables, True, range(5, 7))]
    assert engine.runner.build(wanting).logits_indices.tolist() == [2, 8, 6, 7]


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
    # Allowed from exactly `min_new_tokens` outputs on, counting those whose ids are still on the
    # device when the next step starts (async batching).
    at = free_run.index(stop)
    edge = engine.add_request(
        prompt, SamplingParams(max_new_tokens=12, min_new_tokens=at, stop_token_ids=(stop,))
    )
    engine.run_until_done()
    assert edge.output_ids == free_run[: at + 1]
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


def engine_state(engine: Engine) -> dict[str, object]:
    """The engine's stats but the host's free memory, which other processes (the suite's other
    worker) move meanwhile."""
    return {k: v for k, v in engine.stats().items() if k != "host_available_bytes"}


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
        ([5], SamplingParams(prompt_logprobs=21), "prompt_logprobs must be in \\[0, 20\\], got 21"),
        ([5], SamplingParams(frequency_penalty=2.5), "frequency_penalty must be in \\[-2, 2\\], got 2.5"),
        (
            [5],
            SamplingParams(logit_bias=((256, 1.0),)),
            "logit_bias token ids out of vocabulary .*: \\[256\\]",
        ),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(
    engine: Engine, prompt: list[int], params: SamplingParams, message: str
) -> None:
    before = engine_state(engine)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert engine_state(engine) == before
    assert engine.generate([[5, 6, 7]], 4, ignore_eos=True)  # still serving


def test_request_that_can_never_fit_fails_alone(engine: Engine) -> None:
    ok = make_prompts(seed=5, count=2)
    huge = engine.add_request(list(range(3, 253)), SamplingParams(max_new_tokens=8))
    outs = [engine.add_request(p, SamplingParams(max_new_tokens=8, ignore_eos=True)) for p in ok]
    engine.run_until_done()
    assert huge.finish_reason is FinishReason.ERROR and "chunks" in huge.error
    assert all(len(r.output_ids) == 8 for r in outs)
    assert_no_leak(engine)


# ------------------------------------------------------------------------------------ async batching


@pytest.mark.parametrize("stop", ["stop_token", "length"])
def test_async_batching_wastes_at_most_one_token_of_a_stopped_request(
    stop: str, tiny_models: Callable[[str], Path]
) -> None:
    """The step planned while a stop token is sampled computes that request once more (and drops
    what it samples); a length limit is known ahead, so nothing is planned past it."""
    model_dir = tiny_models("llama")
    prompt = make_prompts(seed=6, count=1)[0]
    free_run = reference(model_dir, "sdpa", [prompt])[0]
    if stop == "stop_token":
        params = SamplingParams(max_new_tokens=20, stop_token_ids=(free_run[6],), ignore_eos=True)
    else:
        params = SamplingParams(max_new_tokens=7, ignore_eos=True)
    computed, outputs = [], []
    for async_batching in (False, True):
        with Engine.from_pretrained(
            model_dir, num_blocks=16, page_size=8, use_async_batching=async_batching
        ) as e:
            req = e.add_request(prompt, params)
            e.run_until_done()
            outputs.append(req.output_ids)
            computed.append(e.phase_totals.num_tokens)
            assert_no_leak(e)
    assert outputs[0] == outputs[1] == free_run[: free_run.index(free_run[6]) + 1]
    assert computed[1] - computed[0] == (1 if stop == "stop_token" else 0), computed


def generate_counting_steps_ahead(
    engine: Engine, prompts: list[list[int]], **sampling: Any
) -> tuple[list[list[int]], list[int]]:
    """Outputs, and for each step the host takes the tokens of, how many steps were launched then."""
    ahead: list[int] = []
    postprocess = engine.scheduler.postprocess

    def recording(batch: StepBatch, sampled: list[int]) -> list[Request]:
        ahead.append(engine.in_flight)
        return postprocess(batch, sampled)

    engine.scheduler.postprocess = recording  # type: ignore[method-assign]
    return engine.generate(prompts, 10, ignore_eos=True, **sampling), ahead


@pytest.mark.parametrize(
    "sampling",
    [
        {},
        {"repetition_penalty": 1.3},
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"logit_bias": ((7, 3.0), (200, -2.0))},
    ],
    ids=["plain", "repetition", "frequency-presence", "logit-bias"],
)
def test_async_batching_starts_a_step_before_the_host_has_the_tokens_it_reads(
    sampling: dict[str, Any], tiny_models: Callable[[str], Path]
) -> None:
    """The next step is launched before the host takes the tokens of the one computing (its
    placeholders are filled on the device), unless a repetition penalty reads them on the host:
    then it waits. Presence and frequency penalties read counts kept on the device, and a logit bias
    reads no history: neither waits. The outputs are those of sync batching either way."""
    prompts = make_prompts(seed=8, count=3)
    outputs = []
    for async_batching in (False, True):
        with Engine.from_pretrained(
            tiny_models("llama"), num_blocks=24, page_size=8, use_async_batching=async_batching
        ) as e:
            out, ahead = generate_counting_steps_ahead(e, prompts, **sampling)
            assert any(ahead) == (async_batching and "repetition_penalty" not in sampling), ahead
            assert_no_leak(e)
        outputs.append(out)
    assert outputs[0] == outputs[1]


def test_a_forward_that_fails_releases_everything(engine: Engine) -> None:
    """The error reaches the caller; the requests' blocks come back (async batching: the step launched
    behind the failed one, which takes its tokens from it, fails alike), and the engine serves on."""
    prompts = make_prompts(seed=9, count=3)
    expected = engine.generate(prompts, 8, ignore_eos=True)
    forward, calls = engine.runner.forward, itertools.count()

    def failing(*args: Any) -> torch.Tensor:
        if next(calls) == 4:
            raise RuntimeError("the device fell over")
        return forward(*args)

    engine.runner.forward = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="fell over"):
        engine.generate(prompts, 8, ignore_eos=True)
    assert not engine.has_work
    assert_no_leak(engine)
    assert engine.generate(prompts, 8, ignore_eos=True) == expected


def test_an_abort_while_its_next_token_computes_streams_no_more(tiny_models: Callable[[str], Path]) -> None:
    with Engine.from_pretrained(
        tiny_models("llama"), num_blocks=16, page_size=8, use_async_batching=True
    ) as e:
        aborted, other = (
            e.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True))
            for p in make_prompts(seed=7, count=2)
        )
        while len(aborted.output_ids) < 3:
            e.step()
        assert aborted.num_placeholders == 1  # the running step samples its next token
        seen = list(aborted.output_ids)
        e.abort(aborted.request_id)
        updated = e.step()  # ends that step, and plans the next one without it
        assert aborted not in updated and aborted.output_ids == seen
        e.run_until_done()
        assert aborted.output_ids == seen and aborted.finish_reason is FinishReason.ABORTED
        assert len(other.output_ids) == 12
        assert_no_leak(e)


# -------------------------------------------------------------- presence/frequency penalties, logit bias


@pytest.fixture(scope="module")
def looping_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_looping_model_dir(tmp_path_factory.mktemp("looping"))


def longest_run(tokens: list[int]) -> int:
    return max(len(list(run)) for _, run in itertools.groupby(tokens))


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_frequency_penalty_breaks_a_greedy_loop_as_the_reference_does(
    async_batching: bool, looping_model: Path
) -> None:
    """The looping model repeats its last token under greedy; frequency_penalty=2 ends that, token for
    token as transformers' generate does with OpenAI's formula. Requests without the penalty, batched
    with penalized ones, still loop: counts belong to their request."""
    prompts = make_prompts(seed=40, count=4)
    new_tokens = 24
    penalized = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, frequency_penalty=2.0)
    plain = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    with Engine.from_pretrained(
        looping_model, num_blocks=48, page_size=8, max_batch_tokens=64, use_async_batching=async_batching
    ) as e:
        reqs = [e.add_request(p, penalized if i % 2 else plain) for i, p in enumerate(prompts)]
        e.run_until_done()
        assert_no_leak(e)
    for i, (prompt, req) in enumerate(zip(prompts, reqs, strict=True)):
        assert req.output_ids == openai_greedy(looping_model, prompt, new_tokens, req.params), i
        if i % 2:
            assert longest_run(req.output_ids) <= 3, req.output_ids
        else:
            assert longest_run(req.output_ids) >= new_tokens // 2, req.output_ids


@pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])
def test_penalties_and_logit_bias_match_the_reference_in_a_mixed_batch(
    async_batching: bool, looping_model: Path
) -> None:
    """Presence, frequency (negative too) and logit bias, alone and together, beside plain rows: each
    request's greedy output is the reference's; a +100 bias forces its token, -100 bans the loop's."""
    prompts = make_prompts(seed=41, count=6)
    new_tokens = 16
    with Engine.from_pretrained(looping_model, num_blocks=48, page_size=8) as e:
        looped = e.generate(prompts[:1], new_tokens, ignore_eos=True)[0]
    cases = [
        SamplingParams(presence_penalty=1.5),
        SamplingParams(),
        SamplingParams(frequency_penalty=0.75, presence_penalty=-0.5, logit_bias=((looped[0], -100.0),)),
        SamplingParams(logit_bias=((17, 100.0),)),
        SamplingParams(frequency_penalty=-2.0, logit_bias=((5, 3.0), (250, 1.5))),
        SamplingParams(presence_penalty=2.0, frequency_penalty=2.0, logit_bias=((9, 4.0),)),
    ]
    cases = [replace(p, max_new_tokens=new_tokens, ignore_eos=True) for p in cases]
    with Engine.from_pretrained(
        looping_model, num_blocks=48, page_size=8, max_batch_tokens=64, use_async_batching=async_batching
    ) as e:
        reqs = [e.add_request(p, params) for p, params in zip(prompts, cases, strict=True)]
        e.run_until_done()
        assert_no_leak(e)
    for i, (prompt, req) in enumerate(zip(prompts, reqs, strict=True)):
        assert req.output_ids == openai_greedy(looping_model, prompt, new_tokens, req.params), i
    assert looped[0] not in reqs[2].output_ids
    assert reqs[3].output_ids == [17] * new_tokens


def test_a_resubmitted_request_counts_the_output_in_its_prompt(looping_model: Path) -> None:
    """A request re-submitted after a worker loss carries its output so far at the end of its prompt
    (`generated_in_prompt`): the penalties count it, and the continuation is the uninterrupted run's."""
    prompt = make_prompts(seed=42, count=1)[0]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5)
    with Engine.from_pretrained(looping_model, num_blocks=48, page_size=8) as e:
        whole = e.generate([prompt], 20, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5)[0]
        head = whole[:8]
        resumed = e.add_request(prompt + head, replace(params, max_new_tokens=12, generated_in_prompt=8))
        forgetful = e.add_request(prompt + head, replace(params, max_new_tokens=12))
        e.run_until_done()
        with pytest.raises(ValueError, match="generated_in_prompt must be at most the prompt's 3 ids, got 4"):
            e.add_request([5, 6, 7], replace(params, generated_in_prompt=4))
    assert head + resumed.output_ids == whole
    assert head + forgetful.output_ids != whole  # the test tells counting from not counting
