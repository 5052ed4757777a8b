"""Batched token sampler: one row of logits per request in, one token (and optional logprobs) out.

Pure and I/O-free: no model, no engine state; the only state that outlives a call is what the
engine owns per request and passes in every step: a seeded request's `torch.Generator`, and a
penalized request's counts of its generated tokens, which `sample` advances like the generator.

Processing order is vLLM's, whose filters each match HF transformers' `generate`, so that a request
behaves the same here as under either: a constrained row's grammar mask first (structured output:
the tokens its grammar does not admit go to -inf, where vLLM applies it), then suppression and logit
bias, then the repetition penalty, then the frequency and presence penalties, then temperature, top-k,
top-p, min-p (HF warper semantics, `min_tokens_to_keep=1`), then the draw. Logprobs are taken from
the raw logits, before any of that (vLLM's default), so they describe the model, not the sampler
settings; `token_logprobs` computes them, for sampled rows here and for prompt rows in the engine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.common.sampling_params import SamplingParams
from services.worker.kernels import fused_ops

_NEG_INF = float("-inf")


# Temperatures this small divide fp32 logits into inf and NaN (1.4e-45 sampled suppressed ids); their
# limit is greedy, so they are sampled greedily (vLLM's _SAMPLING_EPS is the same bound).
GREEDY_BELOW = 1e-5


@dataclass
class SamplingRow:
    """One request's inputs for one sampling step.

    `generator` is set for seeded requests (the engine creates it once from `params.seed` with
    `Sampler.make_generator` and keeps it for the request's lifetime); random draws for the row come
    only from it, so a seed yields the same tokens whatever else shares the batch. `token_ids` is
    prompt + generated so far, read only when `params.repetition_penalty != 1`. `suppress_ids` are
    forbidden this step (EOS/stop ids before `min_new_tokens`); the caller must leave at least one
    token allowed.

    `token_bitmask` is set for constrained requests (structured output): an int32 `[ceil(V / 32)]`
    tensor whose bit t (bit t % 32 of word t // 32) allows token t; the others are masked to -inf
    before anything else applies, so every filter and the draw see only the tokens the grammar admits.
    The caller leaves at least one token allowed.

    `output_counts` is set for requests with presence or frequency penalties (`params.penalizes_output`):
    how often each token id occurs among the tokens generated so far, a `[V]` tensor on the logits'
    device that the engine creates once with `Sampler.make_output_counts` and keeps for the request's
    lifetime. `sample` reads it and then counts the token it picks, on the device: the host never
    needs the tokens, so a step may start before the host has the previous step's.
    """

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: Sequence[int]
    suppress_ids: Sequence[int] = ()
    output_counts: torch.Tensor | None = None
    token_bitmask: torch.Tensor | None = None


@dataclass
class TokenLogprobs:
    """Logprobs under the raw (unprocessed) distribution: the sampled token, then the top-n.

    `top` is sorted best first and has exactly `min(n, vocab_size)` entries (empty when n == 0).
    """

    token_logprob: float
    top: list[tuple[int, float]]


@dataclass
class SampleOutput:
    """`tokens[i]` and `logprobs[i]` belong to row i; `logprobs[i]` is None if row i did not ask.

    `tokens` stays on the logits' device, so that the next step can read its input ids from there
    without the host waiting for them (async batching)."""

    tokens: torch.Tensor  # [R] long
    logprobs: list[TokenLogprobs | None]
    mask_s: float = 0.0  # seconds spent applying constrained rows' grammar masks (the step profile's)

    @property
    def token_ids(self) -> list[int]:
        return self.tokens.tolist()


@dataclass
class _Plan:
    """Everything `sample` needs from the rows, gathered in one Python pass.

    Row indices are into the batch; `*_pos` indices are positions within `random_rows`, because the
    warpers run on the random rows' sub-batch only (greedy rows never need them).
    """

    greedy_rows: list[int] = field(default_factory=list)
    random_rows: list[int] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    top_k_pos: list[int] = field(default_factory=list)
    top_k: list[int] = field(default_factory=list)
    top_p_pos: list[int] = field(default_factory=list)
    top_p: list[float] = field(default_factory=list)
    min_p_pos: list[int] = field(default_factory=list)
    min_p: list[float] = field(default_factory=list)
    seeded_pos: list[tuple[int, torch.Generator]] = field(default_factory=list)
    unseeded_pos: list[int] = field(default_factory=list)
    penalty_rows: list[int] = field(default_factory=list)
    penalties: list[float] = field(default_factory=list)
    penalty_ids: list[Sequence[int]] = field(default_factory=list)
    suppress_rows: list[int] = field(default_factory=list)
    suppress_ids: list[Sequence[int]] = field(default_factory=list)
    bias_rows: list[int] = field(default_factory=list)
    biases: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    counted_rows: list[int] = field(default_factory=list)
    presence: list[float] = field(default_factory=list)
    frequency: list[float] = field(default_factory=list)
    counts: list[torch.Tensor] = field(default_factory=list)
    logprob_rows: list[int] = field(default_factory=list)
    logprob_n: list[int] = field(default_factory=list)
    masked_rows: list[int] = field(default_factory=list)
    bitmasks: list[torch.Tensor] = field(default_factory=list)
    mask_s: float = 0.0  # seconds the masks took, added by whoever applies them

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab_size: int) -> _Plan:
        plan = cls()
        for i, row in enumerate(rows):
            p = row.params
            if p.repetition_penalty != 1.0 and len(row.token_ids) > 0:
                plan.penalty_rows.append(i)
                plan.penalties.append(p.repetition_penalty)
                plan.penalty_ids.append(row.token_ids)
            if len(row.suppress_ids) > 0:
                plan.suppress_rows.append(i)
                plan.suppress_ids.append(row.suppress_ids)
            if p.logit_bias:
                plan.bias_rows.append(i)
                plan.biases.append(p.logit_bias)
            if p.penalizes_output:
                if row.output_counts is None:
                    raise ValueError(f"row {i} has presence/frequency penalties and no output_counts")
                plan.counted_rows.append(i)
                plan.presence.append(p.presence_penalty)
                plan.frequency.append(p.frequency_penalty)
                plan.counts.append(row.output_counts)
            if row.token_bitmask is not None:
                plan.masked_rows.append(i)
                plan.bitmasks.append(row.token_bitmask)
            if p.logprobs is not None:
                plan.logprob_rows.append(i)
                plan.logprob_n.append(min(p.logprobs, vocab_size))
            if p.temperature < GREEDY_BELOW:
                plan.greedy_rows.append(i)
                continue
            pos = len(plan.random_rows)
            plan.random_rows.append(i)
            plan.temperatures.append(p.temperature)
            # k >= V keeps everything under HF's rule (nothing is below the V-th value), so skip it.
            if 0 < p.top_k < vocab_size:
                plan.top_k_pos.append(pos)
                plan.top_k.append(p.top_k)
            if p.top_p < 1.0:
                plan.top_p_pos.append(pos)
                plan.top_p.append(p.top_p)
            if p.min_p > 0.0:
                plan.min_p_pos.append(pos)
                plan.min_p.append(p.min_p)
            if row.generator is not None:
                plan.seeded_pos.append((pos, row.generator))
            else:
                plan.unseeded_pos.append(pos)
        return plan

    @property
    def all_plain_greedy(self) -> bool:
        """True when every row's token is simply argmax of its raw logits."""
        return not (
            self.random_rows
            or self.penalty_rows
            or self.suppress_rows
            or self.bias_rows
            or self.counted_rows
            or self.masked_rows
        )

    @property
    def greedy_within_masks(self) -> bool:
        """True when every row's token is argmax of its raw logits among what its grammar admits."""
        return bool(self.masked_rows) and not (
            self.random_rows or self.penalty_rows or self.suppress_rows or self.bias_rows or self.counted_rows
        )


class Sampler:
    """Stateless batched sampler; one instance can serve every step of every batch.

    Invariants of `sample`: the caller's `logits` tensor is never modified; per-row Python work is
    limited to reading parameters, converting penalty/suppression/bias id lists, drawing seeded rows'
    noise (each from its own generator) and counting penalized rows' picks (each in its own counts);
    everything else runs as batched tensor ops.
    """

    def sample(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SampleOutput:
        """Pick one token per row of `logits` ([R, V], one row per entry of `rows`)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, V], got {tuple(logits.shape)}")
        if logits.dtype != torch.float32:
            logits = logits.float()
        plan = _Plan.build(rows, logits.shape[1])

        if plan.all_plain_greedy:
            tokens = _argmax_rows(logits)
        elif plan.greedy_within_masks and logits.device.type == "cpu":
            tokens = _argmax_within_masks(logits, plan)
        else:
            tokens = _sample_general(logits, plan)

        if plan.counted_rows:
            _count_picks(tokens, plan)

        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if plan.logprob_rows:
            for i, lp in zip(plan.logprob_rows, _logprobs(logits, tokens, plan), strict=True):
                logprobs[i] = lp
        return SampleOutput(tokens=tokens, logprobs=logprobs, mask_s=plan.mask_s)

    @staticmethod
    def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator for one seeded request; it must live on the device the logits are on."""
        g = torch.Generator(device=device)
        g.manual_seed(seed)
        return g

    @staticmethod
    def make_output_counts(
        vocab_size: int, generated: Sequence[int] = (), device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """The counts of one penalized request (`SamplingRow.output_counts`), of the tokens it has
        generated so far, on the device the logits are on."""
        counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if len(generated) > 0:
            ids = torch.as_tensor(generated, dtype=torch.long).to(device)
            counts.index_add_(0, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
        return counts


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def _flat_ids(
    row_idx: list[int], ids: list[Sequence[int]], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flatten per-row id lists into coordinates: (batch row, token id, position in `row_idx`).

    Ids outside [0, V) are dropped (as HF does for ids beyond the lm_head): such a token can never be
    produced, so there is nothing to penalize or suppress.
    """
    id_tensors = [torch.as_tensor(x, dtype=torch.long) for x in ids]
    counts = torch.tensor([t.numel() for t in id_tensors], dtype=torch.long, device=device)
    flat_ids = torch.cat(id_tensors).to(device)
    flat_pos = torch.repeat_interleave(torch.arange(len(row_idx), device=device), counts)
    flat_rows = _index(row_idx, device)[flat_pos]
    valid = (flat_ids >= 0) & (flat_ids < vocab_size)
    # One sync per call, and the filtering copy only happens for malformed input.
    if not bool(valid.all()):
        return flat_rows[valid], flat_ids[valid], flat_pos[valid]
    return flat_rows, flat_ids, flat_pos


def _apply_token_bitmask_(x: torch.Tensor, plan: _Plan) -> None:
    """Mask to -inf every token that a constrained row's bitmask does not allow, with xgrammar's own
    kernel (C++ on the CPU, its GPU kernel on a GPU), which reads the bits in place: unpacking them
    into a boolean mask with torch ops took several times as long. Rows without a constraint get an
    all-ones mask (the kernel pairs bitmask rows with logits rows)."""
    import xgrammar as xgr  # only constrained batches need it

    t0 = time.perf_counter()
    words = torch.full((x.shape[0], plan.bitmasks[0].shape[0]), -1, dtype=torch.int32)
    words[plan.masked_rows] = torch.stack(plan.bitmasks)
    xgr.apply_token_bitmask_inplace(
        x, words.to(x.device, non_blocking=True), vocab_size=x.shape[1], indices=plan.masked_rows
    )
    plan.mask_s += time.perf_counter() - t0


def _argmax_within_masks(logits: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """Greedy tokens of a CPU batch whose only constraint is masks: each row's raw argmax where its
    grammar admits it, and the argmax over the admitted tokens only for the rows where it does not.

    Exactly the masked argmax (the first maximum among admitted tokens: an admitted raw argmax is one),
    but a row inside a string or a number, where the grammar admits nearly every token, needs no mask
    written over its whole vocabulary: only a bit read."""
    import xgrammar as xgr  # only constrained batches need it

    tokens = _argmax_rows(logits)
    t0 = time.perf_counter()
    words = torch.stack(plan.bitmasks)
    picked = tokens[plan.masked_rows]
    bits = (words.gather(1, (picked >> 5).unsqueeze(1)).squeeze(1) >> (picked & 31)) & 1
    refused = (bits == 0).nonzero().flatten().tolist()
    if refused:
        rows = [plan.masked_rows[i] for i in refused]
        x = logits[rows]  # a copy: the caller's logits stay as they are
        xgr.apply_token_bitmask_inplace(x, words[refused], vocab_size=x.shape[1])
        tokens[rows] = _argmax_rows(x)
    plan.mask_s += time.perf_counter() - t0
    return tokens


def _process_logits(logits: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """Return logits with suppression, logit bias and the penalties applied, in vLLM's order (a copy
    if anything applies). The bias comes before the repetition penalty, which scales it with the logit."""
    if not (
        plan.penalty_rows or plan.suppress_rows or plan.bias_rows or plan.counted_rows or plan.masked_rows
    ):
        return logits
    x = logits.clone()
    device, vocab = x.device, x.shape[1]
    if plan.masked_rows:
        _apply_token_bitmask_(x, plan)
    if plan.suppress_rows:
        rows, ids, _ = _flat_ids(plan.suppress_rows, plan.suppress_ids, vocab, device)
        x[rows, ids] = _NEG_INF
    if plan.bias_rows:
        _add_logit_bias_(x, plan)
    if plan.penalty_rows:
        # Gather/scatter over the (row, id) pairs only: O(total ids), not O(rows x V). Duplicate ids
        # write identical values (all computed from the unpenalized logit), so a token repeated in the
        # history is penalized exactly once, as in HF.
        rows, ids, pos = _flat_ids(plan.penalty_rows, plan.penalty_ids, vocab, device)
        pen = torch.tensor(plan.penalties, dtype=x.dtype, device=device)[pos]
        score = x[rows, ids]
        x[rows, ids] = torch.where(score < 0, score * pen, score / pen)
    if plan.counted_rows:
        _penalize_output_(x, plan)
    return x


def _add_logit_bias_(scores: torch.Tensor, plan: _Plan) -> None:
    """Add each biased row's (token id, bias) pairs to its scores; ids are in the vocabulary and
    distinct within a row (`SamplingParams.validate`)."""
    device = scores.device
    rows = [i for i, b in zip(plan.bias_rows, plan.biases, strict=True) for _ in b]
    ids = [t for b in plan.biases for t, _ in b]
    bias = [v for b in plan.biases for _, v in b]
    scores.index_put_(
        (_index(rows, device), _index(ids, device)),
        torch.tensor(bias, dtype=scores.dtype, device=device),
        accumulate=True,
    )


def _penalize_output_(scores: torch.Tensor, plan: _Plan) -> None:
    """OpenAI's presence and frequency penalties over each counted row's generated tokens:
    `score -= presence * [count > 0] + frequency * count`.

    Row by row, in place: stacking the rows' counts would allocate and copy a [rows, V] block each
    step, more than the penalties themselves cost."""
    for i, counts, presence, frequency in zip(
        plan.counted_rows, plan.counts, plan.presence, plan.frequency, strict=True
    ):
        row = scores[i]
        if frequency != 0.0:
            row.add_(counts, alpha=-frequency)
        if presence != 0.0:
            row.add_(counts.clamp(max=1.0), alpha=-presence)  # counts are whole: clamped, [count > 0]


def _count_picks(tokens: torch.Tensor, plan: _Plan) -> None:
    """Count each penalized row's picked token in its own counts, on the device: no host sync, so the
    next step's sampling may read them before the host has the token."""
    one = torch.ones(1, dtype=torch.float32, device=tokens.device)
    for i, counts in zip(plan.counted_rows, plan.counts, strict=True):
        counts.index_add_(0, tokens[i : i + 1], one)


def _on_subset(scores: torch.Tensor, pos: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rows at `pos` as a tensor to edit in place, and the index to write them back (None: all)."""
    if len(pos) == scores.shape[0]:
        return scores, None
    idx = _index(pos, scores.device)
    return scores[idx], idx


def _top_k_(scores: torch.Tensor, pos: list[int], ks: list[int]) -> None:
    """HF TopKLogitsWarper: drop tokens strictly below the row's k-th largest score (ties survive)."""
    sub, idx = _on_subset(scores, pos)
    # One topk at the largest k serves every row; each row reads its own k-th value from it.
    values = torch.topk(sub, max(ks), dim=-1).values
    kth = values.gather(1, torch.tensor(ks, dtype=torch.long, device=sub.device).sub_(1).unsqueeze(1))
    sub.masked_fill_(sub < kth, _NEG_INF)
    if idx is not None:
        scores[idx] = sub


def _top_p_(scores: torch.Tensor, pos: list[int], ps: list[float]) -> None:
    """HF TopPLogitsWarper: drop the low tail whose cumulative probability is <= 1 - p; keep the top one."""
    sub, idx = _on_subset(scores, pos)
    # Ascending sort and `<= 1 - p` exactly as HF does, so boundary ties resolve the same way.
    sorted_logits, sorted_idx = torch.sort(sub, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    threshold = torch.tensor([1.0 - p for p in ps], dtype=sub.dtype, device=sub.device).unsqueeze(1)
    remove_sorted = cum <= threshold
    remove_sorted[:, -1] = False
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    sub.masked_fill_(remove, _NEG_INF)
    if idx is not None:
        scores[idx] = sub


def _min_p_(scores: torch.Tensor, pos: list[int], min_ps: list[float]) -> None:
    """HF MinPLogitsWarper: drop tokens with prob < min_p * (top prob); the top token always stays."""
    sub, idx = _on_subset(scores, pos)
    probs = sub.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    min_p = torch.tensor(min_ps, dtype=sub.dtype, device=sub.device).unsqueeze(1)
    remove = probs < min_p * top
    remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
    sub.masked_fill_(remove, _NEG_INF)
    if idx is not None:
        scores[idx] = sub


def _exponential_noise(shape: torch.Size, plan: _Plan, device: torch.device) -> torch.Tensor:
    """Exp(1) noise per random row: seeded rows from their own generator, the rest in one batched draw.

    A seeded row's noise depends only on its generator's state and V, never on its position or
    neighbours: that is what makes a seed reproducible across batch compositions.
    """
    q = torch.empty(shape, dtype=torch.float32, device=device)
    if len(plan.unseeded_pos) == shape[0]:
        q.exponential_()
    elif plan.unseeded_pos:
        idx = _index(plan.unseeded_pos, device)
        q[idx] = torch.empty((len(plan.unseeded_pos), shape[1]), device=device).exponential_()
    for pos, gen in plan.seeded_pos:
        q[pos].exponential_(generator=gen)
    # exponential_ can return exactly 0 on some backends; 0/0 would be NaN, which argmax prefers, and a
    # filtered (zero-probability) token could win.
    return q.clamp_min_(torch.finfo(torch.float32).tiny)


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)`, by the native kernel for CPU rows: torch's is a scalar pass, and it was the
    whole of a greedy step's sampling time."""
    ops = fused_ops() if logits.device.type == "cpu" and logits.stride(-1) == 1 else None
    return logits.argmax(dim=-1) if ops is None else ops.argmax_rows(logits)


def _sample_general(logits: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """Tokens for a batch that has random rows, penalties, biases or suppression; returns a [R] long
    tensor."""
    device = logits.device
    x = _process_logits(logits, plan)
    if not plan.random_rows:
        return _argmax_rows(x)

    tokens = torch.empty(logits.shape[0], dtype=torch.long, device=device)
    if plan.greedy_rows:
        g_idx = _index(plan.greedy_rows, device)
        tokens[g_idx] = _argmax_rows(x[g_idx])

    r_sub, r_idx = _on_subset(x, plan.random_rows)
    temps = torch.tensor(plan.temperatures, dtype=torch.float32, device=device).unsqueeze(1)
    # Division allocates, so the warpers below may edit `scores` in place without touching `logits`.
    scores = r_sub / temps
    if plan.top_k_pos:
        _top_k_(scores, plan.top_k_pos, plan.top_k)
    if plan.top_p_pos:
        _top_p_(scores, plan.top_p_pos, plan.top_p)
    if plan.min_p_pos:
        _min_p_(scores, plan.min_p_pos, plan.min_p)

    # Exponential race: argmax(p_i / q_i) with q_i ~ Exp(1) picks i with probability p_i, and needs
    # no cumulative sums or per-row torch.multinomial calls.
    probs = scores.softmax(dim=-1)
    picked = probs.div_(_exponential_noise(probs.shape, plan, device)).argmax(dim=-1)
    if r_idx is None:
        return picked
    tokens[r_idx] = picked
    return tokens


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, plan: _Plan) -> list[TokenLogprobs]:
    """Raw-logit logprobs for the rows in `plan.logprob_rows`, in that order."""
    sub, idx = _on_subset(logits, plan.logprob_rows)
    return token_logprobs(sub, tokens if idx is None else tokens[idx], plan.logprob_n)


def token_logprobs(logits: torch.Tensor, chosen: torch.Tensor, top_n: Sequence[int]) -> list[TokenLogprobs]:
    """Logprobs of token `chosen[i]` and the `top_n[i]` most likely under the raw logits of row i.

    Sampled tokens and prompt tokens alike: `logits` `[N, V]`, `chosen` `[N]`, each `top_n[i] <= V`."""
    lp = torch.log_softmax(logits, dim=-1)
    token_lp: list[float] = lp.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    n_max = max(top_n)
    top_vals: list[list[float]] = []
    top_ids: list[list[int]] = []
    if n_max > 0:
        top = torch.topk(lp, n_max, dim=-1, sorted=True)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    out: list[TokenLogprobs] = []
    for j, n in enumerate(top_n):
        pairs = list(zip(top_ids[j][:n], top_vals[j][:n], strict=True)) if n else []
        out.append(TokenLogprobs(token_logprob=token_lp[j], top=pairs))
    return out
