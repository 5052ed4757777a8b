"""Structured output in the engine: greedy constrained output equals transformers `generate` with the
same grammar's bitmask applied by a logits processor written here (xgrammar's own matcher driving it),
token for token, on a tiny model over SmolLM2's vocabulary and on SmolLM2 itself, with async batching
off and on; JSON-schema outputs parse and validate; a constraint that does not compile fails its
request with the compiler's error and disturbs nothing else; nothing leaks.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from services.common.sampling_params import Constraint, SamplingParams
from services.worker.engine import Engine
from services.worker.request import FinishReason
from services.worker.sampler import Sampler, SamplingRow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}

CONSTRAINTS = {
    "json_schema": Constraint("json_schema", json.dumps(SCHEMA)),
    "json_object": Constraint("json_object"),
    "regex": Constraint("regex", r"(yes|no|maybe), [0-9]{1,3}!"),
    "choice": Constraint.choice(["red", "green", "blue jeans"]),
    "ebnf": Constraint("ebnf", 'root ::= "(" item ("," item)* ")"\nitem ::= [a-z]+ | [0-9]+'),
    # xgrammar's structural-tag format (what smg sends for tool calls): free text, then a tagged call.
    "structural_tag": Constraint(
        "structural_tag",
        json.dumps(
            {
                "type": "structural_tag",
                "format": {
                    "type": "sequence",
                    "elements": [
                        {"type": "const_string", "value": "Call: "},
                        {
                            "type": "tag",
                            "begin": "<tool_call>",
                            "content": {"type": "json_schema", "json_schema": SCHEMA},
                            "end": "</tool_call>",
                        },
                    ],
                },
            }
        ),
    ),
}

PROMPTS = [
    "Describe a person as JSON:",
    "Is the sky blue? Answer:",
    "My favourite colour is",
]
NEW_TOKENS = 48
ASYNC = pytest.mark.parametrize("async_batching", [False, True], ids=["sync", "async"])


@pytest.fixture(scope="module")
def tiny_text(tiny_text_model: Path) -> Path:
    """A tiny random Llama over SmolLM2's tokenizer: constrained text at a tiny model's speed."""
    return tiny_text_model


# SmolLM2 itself runs this module's whole matrix in the slow run. The default run has every test on
# the tiny model over SmolLM2's tokenizer (the same vocabulary, so the same grammars and bitmasks), one
# greedy case on SmolLM2 (test_smollm2_json_schema_matches_generate below) and SmolLM2's constrained
# answers through the stack (tests/test_structured_output_stack.py: they parse, validate and end).
@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def model_dir(request: pytest.FixtureRequest, tiny_text: Path, smollm2_dir: Path) -> Path:
    return tiny_text if request.param == "tiny" else smollm2_dir


class GrammarProcessor(LogitsProcessor):
    """The reference: xgrammar's matcher masks each step's logits of one sequence (batch of one), and
    takes each token generated (the one at the end of `input_ids` from the second call on)."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, prompt_len: int) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.accept_token(int(input_ids[0, -1]))
        self.matcher.fill_next_token_bitmask(self.bitmask)
        xgr.apply_token_bitmask_inplace(scores, self.bitmask.to(scores.device))
        return scores


def compile_reference(
    tokenizer: object, vocab_size: int, stop_ids: list[int], constraint: Constraint
) -> xgr.CompiledGrammar:
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_ids)
    compiler = xgr.GrammarCompiler(info)
    if constraint.kind == "json_schema":
        return compiler.compile_json_schema(constraint.text)
    if constraint.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}')
    if constraint.kind == "regex":
        return compiler.compile_regex(constraint.text)
    if constraint.kind == "structural_tag":
        return compiler.compile_structural_tag(constraint.text)
    if constraint.kind == "choice":  # written out here, not taken from the module under test
        choices = json.loads(constraint.text)
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
    return compiler.compile_grammar(constraint.text)


@cache
def reference(model_dir: Path, kind: str) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    eos = model.generation_config.eos_token_id
    stop_ids = list(eos) if isinstance(eos, list) else [eos]  # generate stops at these, as the engine
    compiled = compile_reference(tokenizer, vocab, stop_ids, CONSTRAINTS[kind])
    outs = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        processor = GrammarProcessor(compiled, vocab, ids.shape[1])
        out = model.generate(
            ids,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            logits_processor=LogitsProcessorList([processor]),
            pad_token_id=tokenizer.eos_token_id,
        )
        outs.append(out[0, ids.shape[1] :].tolist())
    return outs


def prompt_ids(model_dir: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def engines(model_dir: Path) -> Iterator[dict[bool, Engine]]:
    engines = {
        a: Engine.from_pretrained(model_dir, num_blocks=256, use_async_batching=a) for a in (False, True)
    }
    yield engines
    for engine in engines.values():
        engine.close()


def assert_no_leak(engine: Engine) -> None:
    stats = engine.stats()
    assert stats["used_blocks"] == 0, stats
    assert stats["free_blocks"] + stats["evictable_blocks"] == stats["total_blocks"], stats
    assert stats["swap_slots_used"] == 0, stats
    assert not engine.has_work


@ASYNC
@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_constrained_greedy_matches_generate(
    engines: dict[bool, Engine], model_dir: Path, kind: str, async_batching: bool
) -> None:
    engine = engines[async_batching]
    outs = engine.generate(prompt_ids(model_dir), NEW_TOKENS, constraint=CONSTRAINTS[kind])
    assert outs == reference(model_dir, kind)
    assert_no_leak(engine)


@pytest.fixture(scope="module")
def smol_engine(smollm2_dir: Path) -> Iterator[Engine]:
    with Engine.from_pretrained(smollm2_dir, num_blocks=256, use_async_batching=True) as engine:
        yield engine


def test_smollm2_json_schema_matches_generate(smol_engine: Engine, smollm2_dir: Path) -> None:
    """The default run's case on SmolLM2 itself (its matrix is in the slow run): a JSON schema, async."""
    outs = smol_engine.generate(prompt_ids(smollm2_dir), NEW_TOKENS, constraint=CONSTRAINTS["json_schema"])
    assert outs == reference(smollm2_dir, "json_schema")
    assert_no_leak(smol_engine)


def test_json_schema_output_validates(engines: dict[bool, Engine], model_dir: Path) -> None:
    engine = engines[True]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = tokenizer.eos_token_id
    # Room enough for the grammar to end; each output ends with EOS and is a valid instance.
    reqs = [
        engine.add_request(
            ids,
            SamplingParams(
                max_new_tokens=400,
                constraint=CONSTRAINTS["json_schema"],
                temperature=1.0 if i % 2 else 0.0,
                seed=i,
            ),
        )
        for i, ids in enumerate(prompt_ids(model_dir) * 2)
    ]
    engine.run_until_done()
    for req in reqs:
        assert req.finish_reason in (FinishReason.EOS, FinishReason.LENGTH), (req.finish_reason, req.error)
        if req.finish_reason is FinishReason.EOS:
            assert req.output_ids[-1] == eos
            # strict=False: xgrammar's JSON strings admit raw control characters (a random model
            # finds them), which Python's strict parser refuses; the structure is what is checked.
            value = json.loads(tokenizer.decode(req.output_ids[:-1]), strict=False)
            jsonschema.validate(value, SCHEMA)
    # A random model, or sampling at temperature 1, may wander in the whitespace JSON admits until the
    # limit; SmolLM2's greedy answers end.
    if model_dir.name != "llama-text":
        greedy = reqs[::2]
        assert all(r.finish_reason is FinishReason.EOS for r in greedy), [r.finish_reason for r in greedy]
    assert_no_leak(engine)


def test_max_tokens_first_gives_length(engines: dict[bool, Engine], model_dir: Path) -> None:
    engine = engines[True]
    req = engine.add_request(
        prompt_ids(model_dir)[0], SamplingParams(max_new_tokens=3, constraint=CONSTRAINTS["json_schema"])
    )
    engine.run_until_done()
    assert req.finish_reason is FinishReason.LENGTH and len(req.output_ids) == 3
    assert_no_leak(engine)


@pytest.mark.parametrize(
    ("constraint", "quoted"),
    [
        (Constraint("json_schema", '{"type": 3}'), "sampling.json_schema does not compile: "),
        (Constraint("json_schema", "{not json"), "sampling.json_schema does not compile: "),
        (Constraint("regex", "[a-"), "sampling.regex does not compile: "),
        (Constraint("ebnf", "root ::= undefined_rule"), "sampling.ebnf does not compile: "),
        (Constraint("structural_tag", '{"bad": 1}'), "sampling.structural_tag does not compile: "),
    ],
    ids=["schema_type", "schema_syntax", "regex", "ebnf", "structural_tag"],
)
def test_bad_constraint_fails_alone(
    engines: dict[bool, Engine], model_dir: Path, constraint: Constraint, quoted: str
) -> None:
    engine = engines[True]
    prompts = prompt_ids(model_dir)
    good = engine.add_request(prompts[0], SamplingParams(max_new_tokens=8, ignore_eos=True))
    bad = engine.add_request(prompts[1], SamplingParams(max_new_tokens=8, constraint=constraint))
    engine.run_until_done()
    assert bad.finish_reason is FinishReason.ERROR
    assert bad.error.startswith(quoted) and len(bad.error) > len(quoted) + 5, bad.error
    assert "/project/" not in bad.error  # the C++ source location is stripped
    assert not bad.output_ids
    assert good.finish_reason is FinishReason.LENGTH and len(good.output_ids) == 8
    assert_no_leak(engine)


def test_compile_timeout_fails_the_request(model_dir: Path) -> None:
    """A limit no compile meets: the request fails naming the limit; the engine goes on."""
    with Engine.from_pretrained(model_dir, num_blocks=64, grammar_compile_timeout_s=1e-9) as engine:
        schema = Constraint("json_schema", json.dumps(SCHEMA | {"title": "timeout"}))
        bad = engine.add_request(
            prompt_ids(model_dir)[0], SamplingParams(max_new_tokens=4, constraint=schema)
        )
        good = engine.add_request(prompt_ids(model_dir)[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
        engine.run_until_done()
        assert bad.finish_reason is FinishReason.ERROR
        assert bad.error == "sampling.json_schema did not compile within 1e-09 s", bad.error
        assert len(good.output_ids) == 4
        assert_no_leak(engine)


def test_abort_while_compiling(engines: dict[bool, Engine], model_dir: Path) -> None:
    engine = engines[False]
    schema = Constraint("json_schema", json.dumps(SCHEMA | {"title": "aborted"}))
    req = engine.add_request(prompt_ids(model_dir)[0], SamplingParams(max_new_tokens=4, constraint=schema))
    assert engine.abort(req.request_id) is req
    assert req.finish_reason is FinishReason.ABORTED
    engine.run_until_done()
    assert_no_leak(engine)


def test_invalid_constraint_refused_at_once(engines: dict[bool, Engine], model_dir: Path) -> None:
    engine = engines[False]
    with pytest.raises(ValueError, match=r"constraint.choice must hold at least one string"):
        engine.add_request([1, 2], SamplingParams(constraint=Constraint("choice", "[]")))
    with pytest.raises(ValueError, match=r"unknown constraint kind 'yaml'"):
        engine.add_request([1, 2], SamplingParams(constraint=Constraint("yaml", "a: b")))


def _bitmask(allowed: list[int], vocab_size: int) -> torch.Tensor:
    words = [0] * ((vocab_size + 31) // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


def test_sampler_applies_the_bitmask_before_everything() -> None:
    """Only allowed tokens come out, greedy or sampled with any filter, and the mask comes before the
    logit bias (a +100 bias does not revive a masked token); unmasked rows are untouched."""
    vocab = 70  # not a multiple of 32: the last word's high bits lie past the vocabulary
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    allowed = [[3, 33, 69], [31, 32], [5]]
    rows = [
        SamplingRow(SamplingParams(), None, (), token_bitmask=_bitmask(allowed[0], vocab)),
        SamplingRow(
            SamplingParams(temperature=1.0, top_k=1), None, (), token_bitmask=_bitmask(allowed[1], vocab)
        ),
        SamplingRow(
            SamplingParams(logit_bias=((6, 100.0),)), None, (), token_bitmask=_bitmask(allowed[2], vocab)
        ),
        SamplingRow(SamplingParams(), None, ()),
    ]
    for _ in range(5):
        tokens = Sampler().sample(logits, rows).token_ids
        assert tokens[0] == max(allowed[0], key=lambda t: float(logits[0, t]))
        assert tokens[1] == max(allowed[1], key=lambda t: float(logits[1, t]))
        assert tokens[2] == 5
        assert tokens[3] == int(logits[3].argmax())


def test_greedy_masked_rows_take_the_first_maximum_among_admitted_tokens() -> None:
    """A greedy batch held only by masks reads one bit where the raw argmax is admitted and masks the
    row where it is not: either way the token is the first maximum among the admitted tokens (ties
    included), with logprobs from the raw logits, and the caller's logits stay untouched."""
    vocab = 70
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(1))
    logits[4, [7, 40, 41]] = 9.0  # a tie: 7 is the raw argmax, 40 the first admitted maximum
    top = [int(t) for t in logits.argmax(-1)]
    allowed = [
        list(range(vocab)),  # everything: the raw argmax, no mask written
        [top[1], (top[1] + 1) % vocab],  # the raw argmax among others
        [t for t in range(vocab) if t != top[2]],  # all but the raw argmax
        [69],  # one token, in the last word past a multiple of 32
        [40, 41],
    ]
    rows = [
        SamplingRow(SamplingParams(logprobs=2), None, (), token_bitmask=_bitmask(a, vocab)) for a in allowed
    ]
    before = logits.clone()
    out = Sampler().sample(logits, rows)
    assert torch.equal(logits, before)
    expected = [max(a, key=lambda t: (float(logits[i, t]), -t)) for i, a in enumerate(allowed)]
    assert out.token_ids == expected == [top[0], top[1], expected[2], 69, 40]
    assert expected[2] != top[2]
    raw = torch.log_softmax(logits, -1)
    for i, lp in enumerate(out.logprobs):
        assert lp is not None and lp.token_logprob == pytest.approx(float(raw[i, expected[i]]))
    assert out.mask_s > 0


@ASYNC
def test_chunked_prefill_with_constraints_matches_generate(tiny_text: Path, async_batching: bool) -> None:
    """Prompts chunked across steps, several constrained requests and a free one batched together."""
    prompts = prompt_ids(tiny_text)
    with Engine.from_pretrained(
        tiny_text,
        num_blocks=256,
        max_batch_tokens=16,
        long_prefill_token_threshold=7,
        use_async_batching=async_batching,
    ) as engine:
        reqs = {
            kind: [
                engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS, constraint=CONSTRAINTS[kind]))
                for p in prompts
            ]
            for kind in ("json_schema", "regex", "choice")
        }
        free = engine.add_request(prompts[0], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        engine.run_until_done()
        assert engine.runner.builder.prompt_chunks > 0
        for kind, rs in reqs.items():
            assert [r.output_ids for r in rs] == reference(tiny_text, kind), kind
        assert len(free.output_ids) == NEW_TOKENS
        assert_no_leak(engine)
