"""Structured outputs: request parameters to a StructuredOutput, grammar checks, and the engine's token masks."""

from __future__ import annotations

import json

import pytest
import torch

from tandem.errors import APIError
from tandem.openai_protocol import ChatCompletionRequest, CompletionRequest
from tandem.protocol import SamplingParams, StructuredOutput
from tandem.structured_output import grammar_text
from tandem.tokenizer import load_tokenizer
from tandem.workers.engine.grammar import GrammarMatchers
from tandem.workers.engine.sampler import Sampler

VOCAB = 49152
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def structured(**fields) -> StructuredOutput | None:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                 **fields).sampling_params(16, VOCAB).structured


@pytest.mark.parametrize("fields,kind,value", [
    ({"response_format": {"type": "json_object"}}, "json", {"type": "object"}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}},
     "json", PERSON),
    ({"structured_outputs": {"json": PERSON}}, "json", PERSON),
    ({"structured_outputs": {"json_object": True}}, "json", {"type": "object"}),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, "regex", "[0-9]{3}"),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, "grammar", 'start: "a"+'),
])
def test_request_parameters_become_one_structured_output(fields, kind, value):
    spec = structured(**fields)
    assert spec.kind == kind
    assert (json.loads(spec.value) if kind in ("json", "choice") else spec.value) == value


def test_text_or_nothing_constrains_nothing():
    assert structured() is None and structured(response_format={"type": "text"}) is None


@pytest.mark.parametrize("fields,param,fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "nonsense"}}}},
     "response_format", "nonsense"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs", "undefined_rule"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs", "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs", "['json', 'regex']"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
])
def test_a_malformed_or_invalid_constraint_is_a_400_naming_its_parameter(fields, param, fragment):
    with pytest.raises(APIError) as info:
        structured(**fields)
    assert info.value.status == 400 and info.value.param == param and fragment in info.value.message


def test_completions_take_them_too():
    r = CompletionRequest(model="m", prompt="x", structured_outputs={"choice": ["a", "b"]})
    assert r.sampling_params(16, VOCAB).structured.kind == "choice"


def test_sampling_params_carry_it_to_the_workers_and_back():
    params = SamplingParams(structured=StructuredOutput(kind="regex", value="[a-z]+"))
    assert SamplingParams.model_validate(params.model_dump()) == params


def test_grammars_are_checked_once():
    spec = StructuredOutput(kind="regex", value="[a-z]{2,5}")
    grammar_text(spec)
    hits = grammar_text.cache_info().hits
    assert grammar_text(spec) == grammar_text(spec) and grammar_text.cache_info().hits == hits + 2


# -- the engine's side: masks and matcher state ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return GrammarMatchers(tokenizer, VOCAB, tokenizer.eos_token_ids)


def allowed_ids(mask_row: torch.Tensor) -> set[int]:
    return set(mask_row.nonzero().flatten().tolist())


def test_the_mask_is_llguidances_own_bit_for_bit(grammars):
    digits = grammars.start(StructuredOutput(kind="regex", value="[0-9]+"), [])
    reference = torch.frombuffer(bytearray(digits.compute_bitmask()), dtype=torch.uint8)
    bits = ((reference.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[:VOCAB].bool()
    rows = grammars.allowed([None, digits], torch.device("cpu"))
    assert rows.shape == (2, VOCAB) and rows[0].all()  # a row without a grammar keeps every token
    assert torch.equal(rows[1], bits)
    assert 0 < int(rows[1].sum()) < VOCAB


def test_a_choice_allows_only_its_beginnings_then_only_the_end(grammars, tokenizer):
    matcher = grammars.start(StructuredOutput(kind="choice", value='["yes", "no"]'), [])
    first = allowed_ids(grammars.allowed([matcher], torch.device("cpu"))[0])
    assert {tokenizer.decode([t]) for t in first} <= {"y", "ye", "yes", "n", "no"}
    assert tokenizer.encode("yes", add_special_tokens=False)[0] in first
    assert matcher.consume_tokens(tokenizer.encode("no", add_special_tokens=False)) and matcher.is_stopped()
    assert allowed_ids(grammars.allowed([matcher], torch.device("cpu"))[0]) == set(tokenizer.eos_token_ids)


def test_a_continued_request_resumes_its_grammar_where_its_output_left_it(grammars, tokenizer):
    spec = StructuredOutput(kind="regex", value="[a-z]+-[0-9]+")
    dash = tokenizer.encode("abc-", add_special_tokens=False)
    resumed = grammars.start(spec, dash)
    assert all(tokenizer.decode([t]).isdigit() for t in allowed_ids(grammars.allowed([resumed], "cpu")[0]))
    with pytest.raises(ValueError, match="does not follow"):
        grammars.start(spec, tokenizer.encode("ABC", add_special_tokens=False))


def test_a_grammar_is_compiled_once_for_all_its_requests(grammars):
    spec = StructuredOutput(kind="json", value=json.dumps(PERSON))
    a = grammars.start(spec, [])
    compiled = len(grammars._start_states)
    b = grammars.start(spec, [])
    assert len(grammars._start_states) == compiled and a is not b  # each request moves its own copy


def test_no_tokenizer_no_structured_output():
    with pytest.raises(ValueError, match="tokenizer"):
        GrammarMatchers(None, VOCAB, [2]).start(StructuredOutput(kind="regex", value="a"), [])


def test_the_sampler_never_picks_a_masked_token():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    allowed = torch.zeros(3, 40, dtype=torch.bool)
    allowed[0, 7] = allowed[1, [3, 5]] = True
    allowed[2] = True  # unconstrained
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    for seed in range(20):
        out = Sampler(seed)(logits, params, [None] * 3, None, allowed)
        assert out.token_ids[0] == 7 and out.token_ids[1] in (3, 5)
        assert out.token_ids[2] == int(logits[2].argmax())
    # The logprobs still describe the model's own distribution.
    lp = Sampler()(logits, [SamplingParams(temperature=0.0, logprobs=0)] * 3, [None] * 3, None, allowed).logprobs[0]
    assert lp.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[7]))

