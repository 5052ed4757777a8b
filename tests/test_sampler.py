"""Sampler semantics against HF transformers' own logits processors, plus seeding and logprobs.

Real torch throughout; HF's processors are the reference for every filter, so a divergence in
order or tie handling shows up here rather than as a subtle quality difference in production.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from services.common.sampling_params import SamplingParams
from services.worker.sampler import (
    SampleOutput,
    Sampler,
    SamplingRow,
    _min_p_,
    _Plan,
    _process_logits,
    _top_k_,
    _top_p_,
)

SAMPLER = Sampler()


def _logits(rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def _row(
    token_ids: Sequence[int] = (),
    suppress_ids: Sequence[int] = (),
    generator: torch.Generator | None = None,
    **params: object,
) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(**params),  # type: ignore[arg-type]
        generator=generator,
        token_ids=token_ids,
        suppress_ids=suppress_ids,
    )


def _hf_warp(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """HF's warper chain for one request's params, in generate()'s order."""
    chain = LogitsProcessorList()
    if p.temperature not in (0.0, 1.0):
        chain.append(TemperatureLogitsWarper(p.temperature))
    if p.top_k > 0:
        chain.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1.0:
        chain.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0.0:
        chain.append(MinPLogitsWarper(p.min_p))
    dummy_ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    return chain(dummy_ids, logits.clone())


def _sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleOutput:
    before = logits.clone()
    out = SAMPLER.sample(logits, rows)
    assert torch.equal(logits, before), "sampler must not modify the caller's logits"
    assert len(out.token_ids) == len(rows) == len(out.logprobs)
    return out


# --- greedy ---------------------------------------------------------------------------------------


def test_greedy_equals_argmax() -> None:
    logits = _logits(16, 300)
    out = _sample(logits, [_row() for _ in range(16)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16


def test_empty_batch() -> None:
    out = SAMPLER.sample(torch.empty(0, 50), [])
    assert out.token_ids == [] and out.logprobs == []


def test_shape_mismatch_rejected() -> None:
    with pytest.raises(ValueError, match="logits must be"):
        SAMPLER.sample(torch.zeros(2, 10), [_row()])


@pytest.mark.parametrize("penalty", [1.3, 2.0, 0.7])
def test_repetition_penalty_matches_hf_on_greedy(penalty: float) -> None:
    vocab = 64
    logits = _logits(12, vocab, seed=1)
    gen = torch.Generator().manual_seed(5)
    histories = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in range(1, 25, 2)]
    # Rows alternate penalty on/off so the batched scatter must keep rows apart.
    rows = [
        _row(token_ids=h, repetition_penalty=penalty if i % 2 == 0 else 1.0) for i, h in enumerate(histories)
    ]
    out = _sample(logits, rows)
    for i, h in enumerate(histories):
        ref = logits[i : i + 1]
        if i % 2 == 0:
            ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([h]), ref.clone())
        assert out.token_ids[i] == int(ref.argmax())


def test_repetition_penalty_flips_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.0, -1.0, 0.0]])
    assert _sample(logits, [_row(token_ids=[0, 0, 0])]).token_ids == [0]
    # 5/2 = 2.5 < 4: the repeated token loses its lead; negative logits are multiplied, not divided.
    assert _sample(logits, [_row(token_ids=[0], repetition_penalty=2.0)]).token_ids == [1]
    out = _sample(torch.tensor([[-1.0, -1.5]]), [_row(token_ids=[0], repetition_penalty=2.0)])
    assert out.token_ids == [1]


def test_repetition_penalty_ignores_out_of_vocab_ids_like_hf() -> None:
    logits = _logits(1, 10, seed=2)
    history = [3, 12, int(logits.argmax()), 99]
    ref = RepetitionPenaltyLogitsProcessor(3.0)(torch.tensor([history]), logits.clone())
    out = _sample(logits, [_row(token_ids=history, repetition_penalty=3.0)])
    assert out.token_ids == [int(ref.argmax())]


# --- suppression ----------------------------------------------------------------------------------


def test_suppressed_ids_never_sampled() -> None:
    vocab, n = 40, 400
    logits = _logits(1, vocab, seed=3).repeat(n, 1)
    banned = [0, 7, 39]
    logits[:, banned] = 50.0  # would win every draw if not suppressed
    rows = [
        _row(suppress_ids=banned, temperature=0.0 if i % 4 == 0 else 1.5, top_k=5 if i % 3 == 0 else 0)
        for i in range(n)
    ]
    out = _sample(logits, rows)
    assert not set(out.token_ids) & set(banned)
    assert len(set(out.token_ids)) > 3  # random rows really did sample


def test_suppression_combined_with_penalty() -> None:
    # A suppressed id that is also in the history must stay forbidden (the penalty may not turn -inf
    # back into a finite score), while the unsuppressed repeated id is still penalized.
    logits = torch.tensor([[10.0, 9.0, 8.0]])
    out = _sample(logits, [_row(token_ids=[0, 1], suppress_ids=[0], repetition_penalty=1.5)])
    assert out.token_ids == [2]


# --- filters vs HF --------------------------------------------------------------------------------

FILTER_CASES = [
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 0.8, "top_k": 5},
    {"temperature": 1.3, "top_p": 0.5},
    {"temperature": 1.0, "top_p": 0.9},
    {"temperature": 2.0, "min_p": 0.2},
    {"temperature": 0.5, "top_k": 10, "top_p": 0.8, "min_p": 0.05},
    {"temperature": 1.5, "top_k": 4, "min_p": 0.5},
    {"temperature": 1.0, "top_k": 10_000},  # k >= V: no-op
]


@pytest.mark.parametrize("case", FILTER_CASES, ids=[str(c) for c in FILTER_CASES])
def test_filters_never_pick_what_hf_filters(case: dict[str, float]) -> None:
    vocab, n = 200, 300
    base = _logits(1, vocab, seed=4)
    params = SamplingParams(**case)  # type: ignore[arg-type]
    allowed = torch.isfinite(_hf_warp(base, params))[0]
    torch.manual_seed(0)
    out = _sample(base.repeat(n, 1), [SamplingRow(params, None, ()) for _ in range(n)])
    assert all(bool(allowed[t]) for t in out.token_ids)
    # The filter must not over-prune either: with 300 draws, a handful of allowed tokens all show up
    # often enough that we should see more than one distinct token whenever HF allows more than one.
    if int(allowed.sum()) > 1:
        assert len(set(out.token_ids)) > 1


def test_batched_warpers_match_hf_masks_exactly_per_row() -> None:
    # Every row has its own k/p/min_p, applied to subsets of the batch: the -inf masks must equal HF's
    # row by row, i.e. per-row parameters never leak across rows.
    vocab, n = 128, 24
    logits = _logits(n, vocab, seed=6)
    gen = torch.Generator().manual_seed(7)
    ks = torch.randint(0, 30, (n,), generator=gen).tolist()
    ps = [1.0 if i % 3 == 0 else 0.3 + 0.6 * float(torch.rand((), generator=gen)) for i in range(n)]
    mps = [0.0 if i % 4 == 1 else 0.3 * float(torch.rand((), generator=gen)) for i in range(n)]
    temps = [0.4 + 1.5 * float(torch.rand((), generator=gen)) for _ in range(n)]
    scores = logits / torch.tensor(temps).unsqueeze(1)
    k_pos = [i for i in range(n) if ks[i] > 0]
    p_pos = [i for i in range(n) if ps[i] < 1.0]
    m_pos = [i for i in range(n) if mps[i] > 0.0]
    _top_k_(scores, k_pos, [ks[i] for i in k_pos])
    _top_p_(scores, p_pos, [ps[i] for i in p_pos])
    _min_p_(scores, m_pos, [mps[i] for i in m_pos])
    for i in range(n):
        p = SamplingParams(temperature=temps[i], top_k=ks[i], top_p=ps[i], min_p=mps[i])
        ref = _hf_warp(logits[i : i + 1], p)[0]
        assert torch.equal(torch.isfinite(scores[i]), torch.isfinite(ref)), f"row {i}: {p}"
        finite = torch.isfinite(ref)
        torch.testing.assert_close(scores[i][finite], ref[finite])


@pytest.mark.parametrize("top_p", [0.25, 0.5, 0.75])
def test_top_p_exact_boundary_like_hf(top_p: float) -> None:
    # Uniform probs over 4 tokens make the cumulative sums exactly 0.25/0.5/0.75/1.0: a token whose
    # cumulative mass equals 1 - p is removed under HF's `<=`, so exactly round(4 * p) survive.
    logits = torch.zeros(1, 4)
    params = SamplingParams(temperature=1.0, top_p=top_p)
    allowed = torch.isfinite(_hf_warp(logits, params))[0]
    assert int(allowed.sum()) == round(4 * top_p)
    scores = logits.clone()
    _top_p_(scores, [0], [top_p])
    assert torch.equal(torch.isfinite(scores[0]), allowed)
    torch.manual_seed(3)
    out = _sample(logits.repeat(200, 1), [SamplingRow(params, None, ()) for _ in range(200)])
    assert set(out.token_ids) == set(allowed.nonzero().squeeze(1).tolist())


# --- distribution ---------------------------------------------------------------------------------


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    support = probs > 0
    assert int(counts[~support].sum()) == 0, "sampled a zero-probability token"
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


def test_temperature_distribution_unseeded_batch() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    params = SamplingParams(temperature=0.7)
    n = 4000
    torch.manual_seed(1)
    out = _sample(logits.repeat(n, 1), [SamplingRow(params, None, ()) for _ in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).double()
    probs = torch.softmax(logits[0].double() / 0.7, dim=-1)
    # df = 4; 30 is far beyond p = 1e-5, so this only fails for a genuinely wrong distribution.
    assert _chi_square(counts, probs) < 30.0


def test_filtered_distribution_seeded_row() -> None:
    # Seeded path (one generator, one row per call) plus top-k/top-p: the frequencies must follow HF's
    # renormalized distribution over the surviving tokens.
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.0, -0.5, -2.0, -3.0]])
    params = SamplingParams(temperature=1.2, top_k=6, top_p=0.9, seed=11)
    g = Sampler.make_generator(11)
    row = SamplingRow(params, g, ())
    tokens = [SAMPLER.sample(logits, [row]).token_ids[0] for _ in range(2000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=8).double()
    probs = torch.softmax(_hf_warp(logits, params)[0].double(), dim=-1)
    assert _chi_square(counts, probs) < 35.0


# --- seeding --------------------------------------------------------------------------------------


def _seeded_run(seed: int, steps: int, logits: torch.Tensor, neighbours: int, position: int) -> list[int]:
    """Tokens drawn by one seeded row over `steps` calls, sharing each call with other rows."""
    vocab = logits.shape[1]
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    g = Sampler.make_generator(seed)
    others = [
        _row(temperature=0.9, generator=Sampler.make_generator(1000 + j)) if j % 2 else _row(temperature=1.1)
        for j in range(neighbours)
    ]
    tokens = []
    for step in range(steps):
        rows = list(others)
        rows.insert(position, SamplingRow(params, g, ()))
        batch = _logits(len(rows), vocab, seed=50 + step, scale=1.0)
        batch[position] = logits[step]
        tokens.append(SAMPLER.sample(batch, rows).token_ids[position])
    return tokens


def test_same_seed_same_tokens_regardless_of_batch() -> None:
    steps, vocab = 20, 500
    logits = _logits(steps, vocab, seed=8, scale=1.0)
    alone = _seeded_run(42, steps, logits, neighbours=0, position=0)
    assert alone == _seeded_run(42, steps, logits, neighbours=5, position=3)
    assert alone == _seeded_run(42, steps, logits, neighbours=6, position=6)
    assert alone == _seeded_run(42, steps, logits, neighbours=0, position=0)


def test_different_seeds_differ() -> None:
    steps, vocab = 30, 500
    logits = _logits(steps, vocab, seed=9, scale=1.0)
    a = _seeded_run(1, steps, logits, neighbours=0, position=0)
    b = _seeded_run(2, steps, logits, neighbours=0, position=0)
    # Near-flat logits over 500 tokens: agreeing on most of 30 draws would mean the seed is ignored.
    assert sum(x == y for x, y in zip(a, b, strict=True)) < 5


def test_greedy_seeded_row_does_not_consume_noise() -> None:
    logits = _logits(1, 50, seed=10)
    g = Sampler.make_generator(3)
    state = g.get_state()
    assert _sample(logits, [_row(generator=g, seed=3)]).token_ids == [int(logits.argmax())]
    assert torch.equal(g.get_state(), state)


# --- logprobs -------------------------------------------------------------------------------------


def test_logprobs_from_raw_logits() -> None:
    vocab = 100
    logits = _logits(5, vocab, seed=11)
    rows = [
        _row(logprobs=5),
        _row(logprobs=0, temperature=1.0),
        _row(),
        _row(logprobs=20, temperature=0.5, top_k=3, token_ids=[1, 2, 3], repetition_penalty=1.8),
        _row(logprobs=1, suppress_ids=[int(logits[4].argmax())]),
    ]
    out = _sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for i, n in [(0, 5), (1, 0), (3, 20), (4, 1)]:
        lp = out.logprobs[i]
        assert lp is not None
        assert lp.token_logprob == pytest.approx(float(raw[i, out.token_ids[i]]), abs=1e-5)
        assert len(lp.top) == n
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True)
        if n:
            ref = torch.topk(raw[i], n)
            assert [t for t, _ in lp.top] == ref.indices.tolist()
            assert vals == pytest.approx(ref.values.tolist(), abs=1e-5)
    # Row 4 suppressed its argmax: its sampled token is not the raw top-1, yet logprobs stay raw.
    assert out.logprobs[4] is not None and out.logprobs[4].top[0][0] == int(logits[4].argmax())
    assert out.token_ids[4] != int(logits[4].argmax())


def test_logprobs_n_larger_than_vocab_is_clamped() -> None:
    out = _sample(_logits(1, 8, seed=12), [_row(logprobs=20)])
    assert out.logprobs[0] is not None and len(out.logprobs[0].top) == 8


# --- mixed batch ----------------------------------------------------------------------------------


def test_mixed_batch() -> None:
    vocab = 256
    logits = _logits(8, vocab, seed=13)
    history = [int(logits[2].argmax()), 5, 6]
    rows = [
        _row(),  # plain greedy
        _row(temperature=1.0, top_k=1),  # random but deterministic: top-1
        _row(token_ids=history, repetition_penalty=1.7),  # greedy + penalty
        _row(temperature=0.9, top_p=0.7, logprobs=3, generator=Sampler.make_generator(4)),
        _row(temperature=1.2, min_p=0.1),
        _row(logprobs=2),  # greedy + logprobs
        _row(temperature=1.0, suppress_ids=list(range(vocab - 1))),  # only the last id allowed
        _row(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05, generator=Sampler.make_generator(9)),
    ]
    torch.manual_seed(2)
    out = _sample(logits, rows)
    t = out.token_ids
    assert t[0] == int(logits[0].argmax())
    assert t[1] == int(logits[1].argmax())
    penalized = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([history]), logits[2:3].clone())
    assert t[2] == int(penalized.argmax())
    for i in (3, 4, 7):
        assert bool(torch.isfinite(_hf_warp(logits[i : i + 1], rows[i].params)[0, t[i]]))
    assert t[5] == int(logits[5].argmax())
    assert t[6] == vocab - 1
    assert [lp is not None for lp in out.logprobs] == [False, False, False, True, False, True, False, False]
    assert all(0 <= x < vocab for x in t)


def test_non_float32_logits_accepted() -> None:
    logits = _logits(3, 64, seed=14).to(torch.bfloat16)
    out = _sample(logits, [_row(), _row(temperature=1.0, top_k=1), _row(logprobs=2)])
    assert out.token_ids[:2] == logits[:2].float().argmax(dim=-1).tolist()


def test_a_vanishing_temperature_samples_greedily_and_keeps_suppression() -> None:
    """A fuzz seed found 1.4e-45: logits / temperature overflowed and a suppressed id was sampled."""
    logits = torch.randn(1, 256, generator=torch.Generator().manual_seed(0))
    logits[0, 0] = 50.0  # the suppressed id would win
    params = SamplingParams(temperature=1.4013e-45, min_new_tokens=2, stop_token_ids=(0,))
    row = SamplingRow(params, None, (), suppress_ids=(0,))
    out = Sampler().sample(logits, [row])
    assert out.token_ids == [int(logits[0, 1:].argmax()) + 1]


# --- presence / frequency penalties and logit bias ------------------------------------------------


def _openai_reference(
    logits: torch.Tensor,
    generated: Sequence[int],
    presence: float = 0.0,
    frequency: float = 0.0,
    logit_bias: Sequence[tuple[int, float]] = (),
) -> torch.Tensor:
    """One row's logits under OpenAI's definitions, in plain torch: the bias added, then each token
    generated so far (the prompt does not count) penalized by presence * [count > 0] + frequency * count."""
    x = logits.clone()
    for token, bias in logit_bias:
        x[token] += bias
    counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=x.shape[0]).float()
    return x - frequency * counts - presence * (counts > 0).float()


def _counted_row(
    generated: Sequence[int], vocab: int, prompt: Sequence[int] = (), **params: object
) -> SamplingRow:
    """A row as the engine builds it: `token_ids` is prompt + generated, the counts hold only the
    generated tokens."""
    return SamplingRow(
        params=SamplingParams(**params),  # type: ignore[arg-type]
        generator=None,
        token_ids=[*prompt, *generated],
        output_counts=Sampler.make_output_counts(vocab, generated),
    )


def test_output_penalties_match_openai_formula_per_row() -> None:
    vocab = 96
    logits = _logits(10, vocab, seed=21, scale=2.0)
    gen = torch.Generator().manual_seed(8)
    cases = [(0.0, 0.0), (2.0, 0.0), (0.0, 2.0), (0.5, 1.5), (-2.0, 0.0), (0.0, -1.0), (1.0, 0.3)]
    rows, refs = [], []
    for i in range(10):
        presence, frequency = cases[i % len(cases)]
        # Repeats, so that frequency and presence differ; the history's top tokens are the likely ones.
        generated = torch.randint(0, 12, (3 + 4 * i,), generator=gen).tolist()
        prompt = list(range(vocab - 8, vocab))  # never generated: must not be penalized
        rows.append(
            _counted_row(generated, vocab, prompt, presence_penalty=presence, frequency_penalty=frequency)
        )
        refs.append(_openai_reference(logits[i], generated, presence, frequency))
    plan = _Plan.build(rows, vocab)
    processed = _process_logits(logits, plan)
    torch.testing.assert_close(processed, torch.stack(refs), rtol=0, atol=1e-5)
    assert _sample(logits, rows).token_ids == [int(r.argmax()) for r in refs]


def test_frequency_penalty_flips_greedy_choice_and_presence_counts_once() -> None:
    logits = torch.tensor([[5.0, 4.5, 0.0, -1.0]])
    assert _sample(logits, [_counted_row([0, 0], 4, frequency_penalty=0.2)]).token_ids == [0]  # 5 - 0.4 > 4.5
    assert _sample(logits, [_counted_row([0, 0], 4, frequency_penalty=0.3)]).token_ids == [1]  # 5 - 0.6 < 4.5
    # Presence does not grow with the count: three zeros cost what one does.
    assert _sample(logits, [_counted_row([0, 0, 0], 4, presence_penalty=0.4)]).token_ids == [0]
    assert _sample(logits, [_counted_row([0], 4, presence_penalty=0.6)]).token_ids == [1]
    # Negative penalties favour what was generated.
    assert _sample(
        logits, [_counted_row([2], 4, presence_penalty=-2.0, frequency_penalty=-2.0)]
    ).token_ids == [0]
    assert _sample(logits, [_counted_row([2, 2, 2], 4, frequency_penalty=-2.0)]).token_ids == [2]


def test_sample_counts_its_picks_in_the_rows_counts() -> None:
    """The counts are the request's state between steps: each pick is counted by the sampler, on the
    device, and the next step reads them; every step equals the formula over the history so far."""
    vocab = 32
    gen = torch.Generator().manual_seed(3)
    penalized = [
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=1.5, frequency_penalty=0.1),
    ]
    counts = [Sampler.make_output_counts(vocab) for _ in penalized]
    histories: list[list[int]] = [[] for _ in penalized]
    for _ in range(12):
        logits = torch.randn(3, vocab, generator=gen)
        logits[:, 5] += 4.0  # a favourite, which the penalties push away once it repeats
        rows = [SamplingRow(p, None, (), output_counts=c) for p, c in zip(penalized, counts, strict=True)]
        rows.append(_row())  # not penalized: no counts
        picked = _sample(logits, rows).token_ids
        for i, p in enumerate(penalized):
            ref = _openai_reference(logits[i], histories[i], p.presence_penalty, p.frequency_penalty)
            assert picked[i] == int(ref.argmax())
            histories[i].append(picked[i])
        assert picked[2] == int(logits[2].argmax())
    for c, h in zip(counts, histories, strict=True):
        assert torch.equal(c, torch.bincount(torch.tensor(h), minlength=vocab).float())
    assert all(len(set(h)) > 1 for h in histories), "the penalties never moved greedy off its favourite"


def test_penalized_row_without_counts_is_refused() -> None:
    with pytest.raises(ValueError, match="row 1 has presence/frequency penalties and no output_counts"):
        _sample(_logits(2, 16), [_row(), _row(frequency_penalty=1.0)])


def test_logit_bias_forces_and_bans_tokens_under_greedy() -> None:
    vocab = 128
    logits = _logits(4, vocab, seed=31)
    top = logits.argmax(dim=-1).tolist()
    low = logits.argmin(dim=-1).tolist()
    rows = [
        _row(logit_bias=((low[0], 100.0),)),  # the least likely token forced
        _row(logit_bias=((top[1], -100.0),)),  # the most likely banned: the runner-up wins
        _row(),
        _row(logit_bias=((top[3], -100.0), (low[3], 100.0), (7, 0.5))),
    ]
    out = _sample(logits, rows)
    assert out.token_ids[0] == low[0]
    assert out.token_ids[1] == int(logits[1].topk(2).indices[1])
    assert out.token_ids[2] == top[2]
    assert out.token_ids[3] == low[3]


def test_logit_bias_matches_the_reference_and_keeps_logprobs_raw() -> None:
    vocab = 64
    logits = _logits(3, vocab, seed=32)
    bias = ((3, 2.5), (10, -1.25), (63, 7.0))
    rows = [_row(logit_bias=bias, logprobs=1), _row(), _row(logit_bias=((0, -0.5),))]
    processed = _process_logits(logits, _Plan.build(rows, vocab))
    torch.testing.assert_close(
        processed[0], _openai_reference(logits[0], [], logit_bias=bias), rtol=0, atol=0
    )
    assert torch.equal(processed[1], logits[1])
    torch.testing.assert_close(processed[2], _openai_reference(logits[2], [], logit_bias=((0, -0.5),)))
    out = _sample(logits, rows)
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs[0] is not None
    assert out.logprobs[0].token_logprob == pytest.approx(float(raw[out.token_ids[0]]))


def test_logit_bias_applies_before_temperature_and_filters() -> None:
    """A +100 bias wins under any temperature and top-k/top-p/min-p: it is added to the logits first."""
    vocab = 200
    logits = _logits(3, vocab, seed=33)
    forced = int(logits[0].argmin())
    rows = [
        _row(temperature=1.5, top_k=5, logit_bias=((forced, 100.0),), generator=Sampler.make_generator(1)),
        _row(temperature=0.8, top_p=0.5, logit_bias=((forced, 100.0),), generator=Sampler.make_generator(2)),
        _row(temperature=2.0, min_p=0.3, logit_bias=((forced, 100.0),), generator=Sampler.make_generator(3)),
    ]
    assert _sample(logits[[0, 0, 0]], rows).token_ids == [forced] * 3


def test_order_is_vllms_bias_then_repetition_then_frequency_and_presence() -> None:
    """vLLM adds the bias before its penalties, so the repetition penalty scales the biased logit."""
    logits = torch.tensor([[1.0, -1.0, 0.5, 0.0]])
    row = _counted_row(
        [0, 0, 1],
        4,
        repetition_penalty=2.0,
        frequency_penalty=0.25,
        presence_penalty=0.125,
        logit_bias=((0, 1.0), (1, -1.0)),
    )
    processed = _process_logits(logits, _Plan.build([row], 4))
    # token 0: (1 + 1) / 2 - 2 * 0.25 - 0.125; token 1: (-1 - 1) * 2 - 0.25 - 0.125; 2, 3: untouched.
    assert processed.tolist() == [[0.375, -4.375, 0.5, 0.0]]


def test_mixed_batch_with_penalties_and_biases() -> None:
    """Only some rows have them: the others are sampled as if alone (greedy ones by argmax, seeded
    ones exactly as in a batch of their own)."""
    vocab = 160
    logits = _logits(6, vocab, seed=34)
    generated = [int(logits[1].argmax())] * 3 + [4]

    def rows() -> list[SamplingRow]:
        return [
            _row(),
            _counted_row(generated, vocab, frequency_penalty=1.5, presence_penalty=0.5),
            _row(temperature=0.9, top_k=20, generator=Sampler.make_generator(11)),
            _row(logit_bias=((9, 100.0),)),
            _row(repetition_penalty=1.3, token_ids=[1, 2, 3]),
            _row(temperature=1.0, generator=Sampler.make_generator(12), logit_bias=((2, -100.0),)),
        ]

    out = _sample(logits, rows()).token_ids
    assert out[0] == int(logits[0].argmax())
    assert out[1] == int(_openai_reference(logits[1], generated, 0.5, 1.5).argmax())
    assert out[1] != int(logits[1].argmax())
    alone = _sample(logits[2:3], [rows()[2]]).token_ids
    assert out[2] == alone[0]
    assert out[3] == 9
    penalized = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([[1, 2, 3]]), logits[4:5].clone())
    assert out[4] == int(penalized.argmax())
    assert out[5] == _sample(logits[5:6], [rows()[5]]).token_ids[0] != 2


def test_rows_without_penalties_or_bias_keep_the_greedy_fast_path() -> None:
    rows = [_row(), _row(logprobs=1), _row(presence_penalty=0.0, frequency_penalty=0.0, logit_bias=())]
    assert _Plan.build(rows, 10).all_plain_greedy
    assert not _Plan.build([_row(logit_bias=((1, 0.5),))], 10).all_plain_greedy
    assert not _Plan.build([_counted_row([], 10, presence_penalty=0.1)], 10).all_plain_greedy
