"""Structured outputs: request parameters to a StructuredOutput, grammar checks, and the engine's token masks."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from tandem.errors import APIError
from tandem.openai.chat import ChatCompletionRequest
from tandem.openai.protocol import CompletionRequest
from tandem.openai.structured_output import admits_no_value, check, grammar_text
from tandem.protocol import SamplingParams, StructuredOutput
from tandem.tokenizer import load_tokenizer
from tandem.workers.engine.grammar import GrammarMatchers
from tandem.workers.engine.sampler import History, Sampler

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
    """Malformed: when the request is read. Not compiling: when it is checked at the API edge (check)."""
    with pytest.raises(APIError) as info:
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], **fields)
        asyncio.run(check(request.sampling_params(16, VOCAB).structured, request.structured_param))
    assert info.value.status == 400 and info.value.param == param and fragment in info.value.message


def test_a_regular_expression_that_matches_nothing_is_refused_in_one_sentence():
    """Found by a new user: the refusal was about 900 characters of the grammar engine's internal state."""
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                    structured_outputs={"regex": r"[^\x00-\x{10FFFF}]"})
    with pytest.raises(APIError) as info:
        asyncio.run(check(request.sampling_params(16, VOCAB).structured, request.structured_param))
    assert info.value.status == 400 and info.value.param == "structured_outputs"
    assert info.value.message == "structured_outputs: the regular expression matches no string"


def test_a_tool_whose_parameters_refer_only_to_themselves_is_refused_naming_the_tools():
    """Found by a new user: with tool_choice "required" the answer was a fragment of the call as content,
    finish_reason stop, no tool_calls and nothing logged: the grammar broke off where it reached the reference."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}]
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools,
                                    tool_choice="required")
    with pytest.raises(APIError) as info:
        asyncio.run(check(request.sampling_params(16, VOCAB).structured, request.structured_param))
    assert info.value.status == 400 and info.value.param == "tools"
    assert "'#/$defs/a' leads only back to itself" in info.value.message
    # A schema that refers to itself through a structure is a recursive schema, and fine.
    tree = {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#"}}}}
    grammar_text(StructuredOutput(kind="json", value=json.dumps(tree)))


@pytest.mark.parametrize("parameters", [
    {"$ref": "#/$defs/a", "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}]}}},  # a review's find: behind an anyOf
    {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]},  # each object must hold another
])
def test_a_tool_that_admits_no_arguments_is_refused_beside_good_ones(parameters):
    tools = [{"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "broken", "parameters": parameters}}]
    with pytest.raises(APIError) as info:
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=tools,
                              tool_choice="required").sampling_params(16, VOCAB)
    assert info.value.status == 400 and info.value.param == "tools" and "'broken'" in info.value.message


def test_a_long_chain_of_references_is_judged_by_where_it_ends():
    """A review's find: each subschema walked its whole chain of references, a legal 64 KB schema holding the grammar
    thread for 14 s; the chain is walked once now (0.04 s on the same machine)."""
    chain = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1850)}
    chain["d1850"] = {"type": "integer"}
    assert admits_no_value({"$ref": "#/$defs/d0", "$defs": chain}) is None
    chain["d1850"] = {"$ref": "#/$defs/d0"}
    assert admits_no_value({"$ref": "#/$defs/d0", "$defs": chain}) is not None


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


def allowed_ids(grammars: GrammarMatchers, matcher) -> set[int]:
    _, mask = grammars.allowed([matcher], torch.device("cpu"))
    return set(mask[0].nonzero().flatten().tolist())


def test_the_mask_is_llguidances_own_bit_for_bit(grammars):
    digits = grammars.start(StructuredOutput(kind="regex", value="[0-9]+"), [])
    reference = torch.frombuffer(bytearray(digits.compute_bitmask()), dtype=torch.uint8)
    bits = ((reference.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[:VOCAB].bool()
    rows, mask = grammars.allowed([None, digits], torch.device("cpu"))
    assert rows == [1] and mask.shape == (1, VOCAB)  # a row without a grammar is left alone
    assert torch.equal(mask[0], bits)
    assert 0 < int(mask[0].sum()) < VOCAB


def test_a_choice_allows_only_its_beginnings_then_only_the_end(grammars, tokenizer):
    matcher = grammars.start(StructuredOutput(kind="choice", value='["yes", "no"]'), [])
    first = allowed_ids(grammars, matcher)
    assert {tokenizer.decode([t]) for t in first} <= {"y", "ye", "yes", "n", "no"}
    assert tokenizer.encode("yes", add_special_tokens=False)[0] in first
    assert matcher.consume_tokens(tokenizer.encode("no", add_special_tokens=False)) and matcher.is_stopped()
    assert allowed_ids(grammars, matcher) == set(tokenizer.eos_token_ids)


def test_a_continued_request_resumes_its_grammar_where_its_output_left_it(grammars, tokenizer):
    spec = StructuredOutput(kind="regex", value="[a-z]+-[0-9]+")
    dash = tokenizer.encode("abc-", add_special_tokens=False)
    resumed = grammars.start(spec, dash)
    assert all(tokenizer.decode([t]).isdigit() for t in allowed_ids(grammars, resumed))
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
    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[0, 7] = mask[1, [3, 5]] = True
    allowed = ([0, 1], mask)  # row 2 unconstrained
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)]
    for seed in range(20):
        out = Sampler(seed)(logits, params, [None] * 3, None, allowed)
        assert out.token_ids[0] == 7 and out.token_ids[1] in (3, 5)
        assert out.token_ids[2] == int(logits[2].argmax())
    # The logprobs still describe the model's own distribution.
    lp = Sampler()(logits, [SamplingParams(temperature=0.0, logprobs=0)] * 3, [None] * 3, None, allowed).logprobs[0]
    assert lp.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[7]))



def test_when_min_tokens_leaves_a_grammar_nothing_the_grammar_wins():
    """A grammar that admits only its end while min_tokens holds the end back: no token at all would be left, and
    argmax over -inf everywhere picks token 0, a token the grammar refuses. The grammar's end is taken instead."""
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(1))
    eos = 2
    mask = torch.zeros(1, 40, dtype=torch.bool)
    mask[0, eos] = True
    held = SamplingParams(temperature=0.0, min_tokens=5)
    history = History([11, 12, 13], output_start=3, stop_token_ids=frozenset({eos}))
    out = Sampler()(logits, [held, SamplingParams(temperature=0.0)], [None] * 2, [history, None], ([0], mask))
    assert out.token_ids == [eos, int(logits[1].argmax())]


@pytest.mark.parametrize("spec", [
    StructuredOutput(kind="json", value=json.dumps({"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(1000)}
                                                   | {"d1000": {"type": "string"}}, "$ref": "#/$defs/d0"})),
    StructuredOutput(kind="grammar", value="start: r0\n" + "\n".join(f'r{i}: "x" r{i + 1}' for i in range(4000))
                     + '\nr4000: "end"'),
])
def test_a_deeply_nested_grammar_compiles_without_taking_the_process_down(spec):
    """llguidance compiles recursively: these overflowed an 8 MiB stack (the process died). On the grammar
    thread's deep stack they compile, or are refused with a reason."""
    try:
        asyncio.run(check(spec, "structured_outputs"))
    except APIError as exc:
        assert exc.status == 400


def test_a_spec_past_the_size_bound_is_refused_before_any_compiling():
    with pytest.raises(APIError) as info:
        structured(structured_outputs={"choice": [f"option {i}" for i in range(20000)]})
    assert info.value.status == 400 and "at most" in info.value.message


def test_a_schema_that_compiles_but_cannot_start_is_refused(grammars):
    with pytest.raises(ValueError, match="admits no value"):
        grammars.start(StructuredOutput(kind="json", value='{"$ref": "#"}'), [])


def pattern_properties(count: int, nested: bool = False, objects: int = 1) -> StructuredOutput:
    def patterns(j: int) -> dict:
        return {"type": "object", "patternProperties": {f"^a{j}x{i}[a-z]*$": {"type": "integer"} for i in range(count)}}

    schema = {"type": "object", "properties": {f"o{j}": {"anyOf": [patterns(j)]} for j in range(objects)}} \
        if nested else patterns(0)
    return StructuredOutput(kind="json", value=json.dumps(schema))


def test_an_object_with_more_patternproperties_than_compile_quickly_is_refused_before_compiling():
    """640 in one object held the process's grammar thread for over a minute (found by a robustness-testing
    helper): every structured request waited behind it. Counted per object, wherever it is in the schema: objects
    each with a few compile at once (a review helper's finding: a total refused those)."""
    for spec in (pattern_properties(640), pattern_properties(65, nested=True)):
        with pytest.raises(APIError) as info:
            asyncio.run(check(spec, "response_format"))
        assert info.value.status == 400 and "patternProperties; at most 64 per object" in info.value.message
    asyncio.run(check(pattern_properties(64, nested=True), "response_format"))  # within the budget: compiled
    asyncio.run(check(pattern_properties(2, nested=True, objects=60), "response_format"))
    data = {"const": json.loads(pattern_properties(65).value)}  # a value that looks like one: data, not a schema
    asyncio.run(check(StructuredOutput(kind="json", value=json.dumps(data)), "response_format"))


def test_the_engine_thread_finds_a_prepared_grammar_compiled():
    """A worker compiles a request's grammar while the request waits on the event loop (AsyncEngine.generate
    calls prepare): the engine thread's start() must not compile it again between two steps."""
    from concurrent.futures import ThreadPoolExecutor

    from tandem.workers.engine import grammar as grammar_module

    tokenizer = load_tokenizer("smollm2")
    fresh = GrammarMatchers(tokenizer, VOCAB, tokenizer.eos_token_ids)
    spec = StructuredOutput(kind="regex", value="[0-9]{3}-[a-z]+")
    asyncio.run(fresh.prepare(spec))
    compiled_on_engine_thread = []
    compile_before = grammar_module._compiled
    grammar_module._compiled = lambda *args: compiled_on_engine_thread.append(args) or compile_before(*args)
    try:
        with ThreadPoolExecutor(1) as engine_thread:
            matcher = engine_thread.submit(fresh.start, spec, []).result()
    finally:
        grammar_module._compiled = compile_before
    assert compiled_on_engine_thread == [] and not matcher.is_error()
    with pytest.raises(ValueError, match="admits no value"):  # a bad spec is refused by prepare itself
        asyncio.run(fresh.prepare(StructuredOutput(kind="json", value='{"$ref": "#"}')))


def test_requests_that_bring_one_new_grammar_at_once_share_its_compile_and_a_leaver_keeps_it():
    from tandem.workers.engine import grammar as grammar_module

    tokenizer = load_tokenizer("smollm2")
    fresh = GrammarMatchers(tokenizer, VOCAB, tokenizer.eos_token_ids)
    spec = StructuredOutput(kind="regex", value="[a-f]{2}-[0-9]+")
    compiles = []
    compile_before = grammar_module._compiled
    grammar_module._compiled = lambda *args: compiles.append(args) or compile_before(*args)

    async def run():
        leaver = asyncio.create_task(fresh.prepare(spec))
        await asyncio.sleep(0)
        leaver.cancel()  # its client left while the compile was under way
        await asyncio.gather(*(fresh.prepare(spec) for _ in range(8)))

    try:
        asyncio.run(run())
    finally:
        grammar_module._compiled = compile_before
    assert len(compiles) == 1 and fresh._cached(spec) is not None and fresh._compiling == {}
