"""Structured outputs in the engine, on the random-weights default model: whatever the
weights, every constrained output is an instance of its schema (validated by a real JSON
Schema validator), matches its regex, is one of its choices; unconstrained neighbours in
the batch are untouched."""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest
import torch

from lamina.libs.grammar import check
from lamina.schemas.v1.generate import Sampling, StructuredOutput
from lamina.services.engine_worker import wire
from lamina.services.engine_worker.engine.config import EngineConfig
from lamina.services.engine_worker.engine.engine import Engine
from lamina.services.engine_worker.engine.errors import InvalidRequestError
from lamina.services.engine_worker.engine.grammar import GrammarCompiler, apply_bitmasks
from lamina.services.engine_worker.engine.speculative import SpeculativeConfig

PROMPT = [5, 6, 7, 8]

NAME = {"type": "string", "maxLength": 12}
SCHEMAS: list[dict] = [
    {"type": "boolean"},
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "string", "maxLength": 8},
    {"enum": ["red", "green", "blue"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "maxItems": 4},
    {"type": "object", "properties": {"name": NAME}, "required": ["name"]},
    {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "score": {"type": "number", "maximum": 1}},
        "required": ["ok"],
    },
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "count": {"const": 3}},
        "required": ["color", "count"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"point": {
            "type": "object",
            "properties": {"x": {"type": "integer", "maximum": 99},
                           "y": {"type": "integer", "maximum": 99}},
            "required": ["x", "y"],
            "additionalProperties": False,
        }},
        "required": ["point"],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "null"}]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 2}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {"type": "string", "pattern": "^[a-z]{2,6}-[0-9]{2}$"},
    {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
    {
        "type": "object",
        "properties": {"id": {"type": "string", "format": "uuid"}},
        "required": ["id"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": NAME, "v": {"type": "integer", "maximum": 9, "minimum": 0}},
            "required": ["k", "v"],
            "additionalProperties": False,
        },
        "maxItems": 3,
    },
    {
        "$defs": {"leaf": {"type": "object", "properties": {"name": NAME}, "required": ["name"],
                           "additionalProperties": False}},
        "type": "object",
        "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}},
        "required": ["left", "right"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": NAME, "roles": {"type": "array", "maxItems": 2,
                                                        "items": {"enum": ["admin", "dev"]}}},
                "required": ["name", "roles"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "order": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "items": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]$"},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                            "required": ["sku", "qty"],
                            "additionalProperties": False,
                        },
                        "minItems": 1,
                        "maxItems": 2,
                    },
                    "status": {"enum": ["open", "paid", "shipped"]},
                },
                "required": ["id", "items", "status"],
                "additionalProperties": False,
            }
        },
        "required": ["order"],
        "additionalProperties": False,
    },
]  # fmt: skip


@pytest.fixture(scope="module")
def engine(tiny_model) -> Engine:
    return Engine(EngineConfig(model=tiny_model, max_model_len=1024, num_kv_blocks=512))


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_model / "tokenizer.json"))


@functools.cache
def compiler(engine: Engine) -> GrammarCompiler:
    return engine.spec.grammar_compiler()


def add(engine: Engine, request_id: str, prompt: list[int], sampling: Sampling, replayed=0):
    """Through the worker's door: the wire's sampling converted, its constraint compiled."""
    grammar = None
    if sampling.structured is not None:
        grammar = wire.constraint(compiler(engine), sampling.structured)
    params = wire.sampling_params(sampling)
    engine.add_request(request_id, prompt, params, replayed=replayed, grammar=grammar)


def run(engine: Engine, requests: dict[str, Sampling]) -> dict[str, tuple[list[int], str | None]]:
    """Run ``requests`` together; each one's output tokens and finish reason."""
    for rid, params in requests.items():
        add(engine, rid, PROMPT, params)
    reasons: dict[str, str | None] = {}
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step().outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert out.error is None, out.error
                reasons[out.request_id] = out.finish_reason and out.finish_reason.value
    return {rid: (tokens[rid], reasons[rid]) for rid in requests}


EOS = (0, 2)
"""The default model's EOS tokens (``generation_config.json``)."""


def text_of(tokenizer, tokens: list[int], reason: str | None) -> str:
    """The output's text, without the EOS a constrained request ends on."""
    assert reason == "stop", reason
    assert tokens[-1] in EOS
    return tokenizer.decode(tokens[:-1], skip_special_tokens=False)


def constrained(spec: StructuredOutput, seed: int, max_tokens: int = 600) -> Sampling:
    return Sampling(max_tokens=max_tokens, temperature=1.0, seed=seed, structured=spec)


def test_twenty_schemas_in_one_batch_all_produce_valid_instances(engine, tokenizer):
    requests = {
        f"s{i}": constrained(StructuredOutput(json=json.dumps(schema)), seed=i)
        for i, schema in enumerate(SCHEMAS)
    }
    results = run(engine, requests)
    for i, schema in enumerate(SCHEMAS):
        text = text_of(tokenizer, *results[f"s{i}"])
        jsonschema.validate(json.loads(text), schema)  # raises, naming the schema, if not


def test_compact_json_and_any_json_object(engine, tokenizer):
    schema = SCHEMAS[6]
    spec = StructuredOutput(json=json.dumps(schema), disable_any_whitespace=True)
    requests = {f"c{seed}": constrained(spec, seed) for seed in range(3)}
    for tokens, reason in run(engine, requests).values():
        text = text_of(tokenizer, tokens, reason)
        jsonschema.validate(json.loads(text), schema)
        assert not re.search(r"\s", text.replace(json.loads(text)["name"], "")), text
    # json_object: any object. Random weights may fill a string for long; enough room.
    obj = run(engine, {"o": constrained(StructuredOutput(json_object=True), 1, max_tokens=1000)})
    tokens, reason = obj["o"]
    if reason == "stop":
        assert isinstance(json.loads(text_of(tokenizer, tokens, reason)), dict)
    else:  # ran out of tokens: still a prefix of an object
        assert tokenizer.decode(tokens).lstrip().startswith("{")


@pytest.mark.parametrize("seed", range(4))
def test_regex_choice_and_grammars_hold(engine, tokenizer, seed):
    specs = {
        "regex": StructuredOutput(regex=r"[0-9]{3}-[a-z]{2,5}( [A-Z])?"),
        "choice": StructuredOutput(choice=["yes", "no", 'say "maybe"\n']),
        "ebnf": StructuredOutput(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
        "lark": StructuredOutput(
            grammar='start: "go " DIR ("," " "? DIR)*\nDIR: "n" | "s" | "e" | "w"'
        ),
    }  # fmt: skip
    texts = {
        name: text_of(tokenizer, *result)
        for name, result in run(
            engine, {name: constrained(spec, seed, 200) for name, spec in specs.items()}
        ).items()
    }
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}( [A-Z])?", texts["regex"]), texts
    assert texts["choice"] in ("yes", "no", 'say "maybe"\n'), texts
    assert re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", texts["ebnf"]), texts
    assert re.fullmatch(r"go [nsew](, ?[nsew])*", texts["lark"]), texts


def test_unconstrained_neighbours_are_untouched_and_seeds_reproduce(engine):
    plain = Sampling(max_tokens=12, temperature=0, ignore_eos=True)
    alone = run(engine, {"p": plain})["p"]
    spec = StructuredOutput(json=json.dumps(SCHEMAS[18]))
    mixed = run(engine, {"p": plain, "a": constrained(spec, 7), "b": constrained(spec, 8)})
    assert mixed["p"] == alone
    again = run(engine, {"a": constrained(spec, 7)})
    assert again["a"] == mixed["a"]  # a seed's constrained output does not depend on its batch


def test_a_moved_request_continues_its_grammar_from_the_replayed_output(engine, tokenizer):
    schema = SCHEMAS[19]
    spec = StructuredOutput(json=json.dumps(schema))
    add(engine, "m", PROMPT, constrained(spec, 3))
    produced: list[int] = []
    while len(produced) < 8:  # part way into the object, as a move finds it
        for out in engine.step().outputs:
            produced += out.new_token_ids
    engine.abort("m")
    # The new worker gets prompt + output so far, the output marked as replayed.
    rest_params = constrained(spec, 3, 600 - len(produced))
    add(engine, "m2", PROMPT + produced, rest_params, replayed=len(produced))
    rest: list[int] = []
    reason = None
    while engine.has_work():
        for out in engine.step().outputs:
            rest += out.new_token_ids
            reason = out.finish_reason and out.finish_reason.value
    jsonschema.validate(json.loads(text_of(tokenizer, produced + rest, reason)), schema)
    # Replayed output the grammar does not allow is refused, naming the field.
    bad = tokenizer.encode("[1, 2]").ids
    with pytest.raises(InvalidRequestError) as refused:
        add(engine, "m3", PROMPT + bad, constrained(spec, 3), replayed=len(bad))
    assert refused.value.param == "structured_outputs"


def test_a_completed_output_ends_even_with_ignore_eos(engine, tokenizer):
    params = Sampling(
        max_tokens=50, temperature=1.0, seed=0, ignore_eos=True,
        structured=StructuredOutput(choice=["alpha", "beta"]),
    )  # fmt: skip
    tokens, reason = run(engine, {"e": params})["e"]
    assert text_of(tokenizer, tokens, reason) in ("alpha", "beta")


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutput(json='{"type": "array", "uniqueItems": true}'), "uniqueItems"),
        (StructuredOutput(json='{"type": "nope"}'), "nope"),
        (StructuredOutput(json='{"type": '), "json"),
        (StructuredOutput(regex="[a-"), "regex"),
        (StructuredOutput(grammar="root ::= undefined_rule"), "undefined_rule"),
    ],
)
def test_a_constraint_the_engine_cannot_enforce_is_refused_naming_it(engine, spec, words):
    with pytest.raises(InvalidRequestError) as refused:
        add(engine, "bad", PROMPT, constrained(spec, 0))
    assert refused.value.param == "structured_outputs"
    assert words.lower() in refused.value.message.lower(), refused.value.message
    assert "bad" not in engine.requests


def test_a_grammar_too_slow_to_start_is_refused_when_compiled(engine, monkeypatch):
    """A hostile grammar whose first mask takes seconds (``(a{1000}){1000}`` here) would
    stall every step of its batch: it is refused where it is compiled, off the engine
    thread. (The limit is lowered here so that the test does not depend on the machine.)"""
    monkeypatch.setattr("lamina.services.engine_worker.engine.grammar._FIRST_MASK_LIMIT_S", 0.0)
    with pytest.raises(InvalidRequestError, match="too complex: its first token mask took"):
        add(engine, "slow", PROMPT, constrained(StructuredOutput(regex="x[0-9]{2,7}"), 0))
    assert "slow" not in engine.requests


def test_the_compiled_grammar_is_cached_and_each_request_starts_fresh(engine):
    spec = StructuredOutput(json=json.dumps(SCHEMAS[5]))
    grammars = engine.spec.grammar_compiler()
    first = grammars.compile(check(spec))
    assert grammars.compile(check(StructuredOutput(json=json.dumps(SCHEMAS[5])))) is first
    a, b = grammars.state(first), grammars.state(first)
    assert a.matcher is not b.matcher
    assert a.accept(an_allowed_token(a))
    assert not b.matcher.is_stopped() and b.matcher.validate_tokens([2]) == 0  # not advanced


def an_allowed_token(state) -> int:
    """Some token the state's grammar allows next."""
    masked = apply_bitmasks(torch.zeros(1, 1024), [state])
    return int(torch.nonzero(masked[0] == 0)[0])


def test_the_cpu_and_device_bitmask_unpackings_agree():
    from lamina.services.engine_worker.engine.grammar import unpack_numpy, unpack_tensor

    words = torch.randint(-(2**31), 2**31 - 1, (5, 33), dtype=torch.int32)
    vocab = 33 * 32 - 7  # a vocabulary that ends inside a word
    expected = torch.tensor(
        [[bool(int(words[r, t // 32]) >> (t % 32) & 1) for t in range(vocab)] for r in range(5)]
    )
    assert torch.equal(unpack_numpy(words, vocab), expected)
    assert torch.equal(unpack_tensor(words, vocab), expected)


# ------------------------------------------------------------------- speculative decoding
def speculating(tiny_model, method: str) -> Engine:
    spec = {
        "ngram": SpeculativeConfig(
            num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3
        ),
        "draft_model": SpeculativeConfig(
            method="draft_model", model=str(tiny_model), num_speculative_tokens=3
        ),
    }[method]
    config = EngineConfig(
        model=tiny_model, max_model_len=1024, num_kv_blocks=512, speculative_config=spec
    )
    return Engine(config)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_requests_speculate_with_the_same_greedy_output(engine, tiny_model, method):
    """A drafted constrained request's verification rows are masked as if the draft
    tokens before each were output (llguidance advances through the draft and rolls
    back): greedy output is the same token for token as without speculation, every draft
    token the grammar refuses is rejected, and the unconstrained neighbours draft too."""
    requests = {
        f"s{i}": Sampling(
            max_tokens=120, temperature=0.0, structured=StructuredOutput(json=json.dumps(s))
        )
        for i, s in enumerate(SCHEMAS)
    }
    requests["regex"] = Sampling(
        max_tokens=120, temperature=0.0, structured=StructuredOutput(regex=r"(ab|cd){3,40}")
    )
    requests["free"] = Sampling(max_tokens=120, temperature=0.0, ignore_eos=True)
    want = run(engine, requests)
    drafting = speculating(tiny_model, method)
    assert run(drafting, requests) == want
    stats = drafting.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_sampled_constrained_requests_that_speculate_produce_valid_instances(tiny_model, tokenizer):
    drafting = speculating(tiny_model, "ngram")
    requests = {
        f"s{i}": Sampling(
            max_tokens=600, temperature=1.0, structured=StructuredOutput(json=json.dumps(s))
        )
        for i, s in enumerate(SCHEMAS)
    }
    results = run(drafting, requests)
    for i, schema in enumerate(SCHEMAS):
        jsonschema.validate(json.loads(text_of(tokenizer, *results[f"s{i}"])), schema)
    assert drafting.stats().spec_decode_num_accepted_tokens > 0
