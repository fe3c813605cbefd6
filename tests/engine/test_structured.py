"""Structured outputs in the engine (halfmoon/engine/structured.py): what a request's
grammar admits is all it generates, whether it runs alone, batched, sampled, continued in
another engine after a handoff, or started by a pipeline's last stage."""

from __future__ import annotations

import json
import re

import pytest
import torch
from engine_testlib import engine_config

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams, StructuredOutput
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.sampling import row_for, sample
from halfmoon.engine.structured import (
    Constraint,
    after_reasoning,
    check,
    closed_objects,
    grammar_text,
    grammar_tokenizer,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
JSON = StructuredOutput("json", json.dumps(SCHEMA), compact=True)


def _valid(text: str) -> bool:
    value = json.loads(text)
    return (
        set(value) == {"ok", "n", "tag"}
        and isinstance(value["ok"], bool)
        and type(value["n"]) is int
        and 0 <= value["n"] <= 99
        and value["tag"] in ("red", "green")
    )


@pytest.fixture(scope="module")
def engine(tiny_dir) -> LLMEngine:
    return LLMEngine(engine_config(tiny_dir))


@pytest.mark.parametrize(
    ("structured", "error"),
    [
        (StructuredOutput("json", "{bad"), "json"),
        (StructuredOutput("json", "[1, 2]"), "a JSON schema is an object"),
        (StructuredOutput("regex", "a(b"), "unclosed group"),
        (StructuredOutput("choice", "[]"), "non-empty list"),
        (StructuredOutput("choice", '["a", ""]'), "non-empty list"),
        (StructuredOutput("grammar", "root ::= missing_rule"), "grammar"),
        (StructuredOutput("structural_tag", '{"structures": [], "triggers": ["<"]}'),
         "structures takes"),
        (StructuredOutput("structural_tag", json.dumps(
            {"triggers": ["<f"], "structures": [{"begin": "<g", "schema": {}, "end": ">"}]})),
         "none of the triggers"),
    ],
)  # fmt: skip
def test_bad_specs_are_errors_naming_them(engine: LLMEngine, structured, error: str) -> None:
    tok = grammar_tokenizer(engine.tokenizer, engine.model_config.vocab_size, [1])
    with pytest.raises(HalfmoonError, match=error):
        check(structured, tok)
    params = SamplingParams(max_tokens=4, structured=structured)
    with pytest.raises(HalfmoonError):
        engine.add_request("bad", [5, 6, 7], params)
    assert not engine.has_unfinished_requests()


def test_kinds_need_their_spec() -> None:
    with pytest.raises(ValueError, match="needs a spec"):
        StructuredOutput("regex")
    with pytest.raises(ValueError, match="takes no spec"):
        StructuredOutput("json_object", "{}")
    with pytest.raises(ValueError, match="must be one of"):
        StructuredOutput("xml", "<a/>")
    assert grammar_text(StructuredOutput("json_object"))  # compiles to a grammar text


def test_a_random_model_writes_only_what_its_grammar_admits(engine: LLMEngine) -> None:
    """A random-weight model left alone writes noise; held to a schema, a regex, choices
    or a GBNF grammar it writes only what they admit, greedy and sampled, batched."""
    cases = {
        "json": (JSON, _valid),
        "regex": (
            StructuredOutput("regex", r"[ab]{3}-\d{2}"),
            lambda t: re.fullmatch(r"[ab]{3}-\d{2}", t),
        ),
        "choice": (
            StructuredOutput("choice", json.dumps(["alpha", "beta", "gamma"])),
            lambda t: t in ("alpha", "beta", "gamma"),
        ),
        "grammar": (
            StructuredOutput("grammar", 'root ::= ("x" | "y")+ "."'),
            lambda t: re.fullmatch(r"[xy]+\.", t),
        ),
    }
    prompts, params, expect = [], [], []
    for kind, (structured, ok) in cases.items():
        for seed in range(4):
            temperature = 0.0 if seed == 0 else 1.0
            prompts.append([5 + seed, 9, 17, 33])
            params.append(SamplingParams(max_tokens=40, temperature=temperature, seed=seed,
                                         structured=structured))  # fmt: skip
            expect.append((kind, ok))
    outs = engine.generate(prompts, params)
    for out, (kind, ok) in zip(outs, expect, strict=True):
        assert out.finish_reason == "stop", (kind, out.text)
        assert ok(out.text), (kind, out.text)
    unconstrained = engine.generate([[5, 9, 17, 33]], SamplingParams(max_tokens=12, seed=1))
    assert not re.fullmatch(r"[ab]{3}-\d{2}|[xy]+\.", unconstrained[0].text)


def test_a_structural_tag_holds_what_follows_its_trigger(engine: LLMEngine) -> None:
    """vLLM's structural tag: free text, but wherever the trigger ("a") comes out, its
    structure follows: the rest of its begin ("a("), JSON of its schema, its end (")").
    A random model writes "a" often; left alone, it writes no such structures."""
    tag = {"triggers": ["a"],
           "structures": [{"begin": "a(", "schema": {"enum": [1, 2]}, "end": ")"}]}  # fmt: skip
    structured = StructuredOutput("structural_tag", json.dumps(tag), compact=True)
    prompts = [[5 + i, 9, 17, 33] for i in range(6)]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured=structured)
              for i in range(6)]  # fmt: skip
    outs = engine.generate(prompts, params)
    assert sum(o.text.count("a") for o in outs) > 0  # the trigger came out ...
    for out in outs:  # ... and every time its structure followed (or the output ended)
        text = (
            re.sub(r"a(\(([12]\)?)?)?$", "", out.text)
            if out.finish_reason == "length"
            else out.text
        )
        assert text.count("a") == len(re.findall(r"a\([12]\)", text)), out.text
    free = engine.generate(prompts, [SamplingParams(max_tokens=40, temperature=1.0, seed=i)
                                     for i in range(6)])  # fmt: skip
    assert any(o.text.count("a") > len(re.findall(r"a\([12]\)", o.text)) for o in free)


def test_closed_objects_and_a_whitespace_pattern(engine: LLMEngine) -> None:
    """vLLM's ``disable_additional_properties`` and ``whitespace_pattern``: a random
    model left to an open schema adds keys of its own; closed, it writes only the listed
    ones; with a pattern of one optional space, no other whitespace between items."""
    schema = json.dumps({"type": "object", "required": ["a", "b"],
                         "properties": {"a": {"type": "boolean"}, "b": {"enum": [1, 2]}}})  # fmt: skip
    prompts = [[5, 9, 17]] * 4

    def run(structured: StructuredOutput) -> list:
        return engine.generate(prompts, [
            SamplingParams(max_tokens=40, temperature=1.0, seed=i, structured=structured)
            for i in range(4)
        ])  # fmt: skip

    open_run = run(StructuredOutput("json", schema, compact=True))
    assert any(o.finish_reason == "length" or set(json.loads(o.text)) != {"a", "b"}
               for o in open_run)  # fmt: skip
    for out in run(StructuredOutput("json", schema, compact=True, closed=True)):
        assert out.finish_reason == "stop" and set(json.loads(out.text)) == {"a", "b"}
    spaced = run(StructuredOutput("json", schema, closed=True, whitespace="[ ]"))
    for out in spaced:
        assert out.finish_reason == "stop" and set(json.loads(out.text)) == {"a", "b"}
        assert not re.search(r"[\n\t\r]|  ", out.text)


def test_closed_objects_closes_every_object_schema_it_reaches() -> None:
    schema = {
        "type": "object",
        "properties": {"properties": {"type": "object", "properties": {"x": {}}},
                       "list": {"type": "array", "items": {"properties": {"y": {}}}}},
        "$defs": {"d": {"anyOf": [{"properties": {"z": {}}}, {"type": "string"}]}},
        "patternProperties": {"^p": {"properties": {"w": {}}, "additionalProperties": True}},
    }  # fmt: skip
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]  # a map of names, not a schema
    assert out["properties"]["list"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["anyOf"][0]["additionalProperties"] is False
    assert out["patternProperties"]["^p"]["additionalProperties"] is True  # as it said
    assert "additionalProperties" not in schema  # a copy
    assert closed_objects(True) is True


def test_the_request_ends_when_the_grammar_does(engine: LLMEngine) -> None:
    """No EOS needed: the step that completes the grammar ends the request (``stop``),
    even with ``ignore_eos``; an unbounded pattern runs to its ``max_tokens``."""
    choice = StructuredOutput("choice", json.dumps(["alpha"]))
    (out,) = engine.generate([[5, 6]], SamplingParams(max_tokens=30, temperature=0.0,
                                                       ignore_eos=True, structured=choice))  # fmt: skip
    assert out.text == "alpha" and out.finish_reason == "stop"
    digits = StructuredOutput("regex", r"\d+")
    (out,) = engine.generate([[5, 6]], SamplingParams(max_tokens=7, temperature=0.0,
                                                       ignore_eos=True, structured=digits))  # fmt: skip
    assert out.finish_reason == "length" and len(out.token_ids) == 7
    assert re.fullmatch(r"\d+", out.text)


def test_a_handoff_continues_the_grammar(tiny_dir) -> None:
    """The prefill engine samples the first token held to the grammar; the decode engine
    follows the tokens it gets and continues exactly as one engine would."""
    prompt = [7, 11, 13, 17, 19]
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured=JSON)
    (whole,) = LLMEngine(engine_config(tiny_dir)).generate([prompt], params)
    assert _valid(whole.text)

    prefill = LLMEngine(engine_config(tiny_dir))
    prefill.add_request("r", prompt, SamplingParams(**{**params.__dict__, "max_tokens": 1}),
                        keep_kv=True)  # fmt: skip
    (first,) = prefill.step()
    handoff = prefill.export_kv("r")
    decode = LLMEngine(engine_config(tiny_dir))
    decode.import_request(handoff, params)
    final = None
    while decode.has_unfinished_requests():
        for out in decode.step():
            final = out
    assert final.token_ids == whole.token_ids and final.text == whole.text
    assert first.token_ids == whole.token_ids[:1]

    # A continued request whose tokens break its grammar is refused, not decoded.
    broken = type(handoff)(**{**handoff.__dict__, "token_ids": [*prompt, 0]})
    with pytest.raises(HalfmoonError, match="do not follow"):
        LLMEngine(engine_config(tiny_dir)).import_request(broken, params)


def test_the_grammar_outranks_allowed_tokens_and_min_tokens() -> None:
    """Masks combine; when they leave nothing, the grammar wins over
    ``allowed_token_ids``, and either over ``min_tokens`` (stop tokens then allowed)."""
    logits = torch.zeros(1, 8)
    logits[0, 5] = 3.0
    grammar = torch.tensor([False, True, True, False, False, False, False, False])
    base = SamplingParams(max_tokens=4, temperature=0.0)
    assert sample(logits.clone(), [row_for(base, 0, 0, (), grammar_mask=grammar)]) in ([1], [2])
    listed = SamplingParams(max_tokens=4, temperature=0.0, allowed_token_ids=(2, 5))
    assert sample(logits.clone(), [row_for(listed, 0, 0, (), grammar_mask=grammar)]) == [2]
    disjoint = SamplingParams(max_tokens=4, temperature=0.0, allowed_token_ids=(5, 6))
    assert sample(logits.clone(), [row_for(disjoint, 0, 0, (), grammar_mask=grammar)]) in (
        [1],
        [2],
    )
    only_stop = torch.zeros(8, dtype=torch.bool)
    only_stop[1] = True  # the grammar may only end here; the stop id is banned till min_tokens
    waiting = SamplingParams(max_tokens=4, temperature=1.0, min_tokens=3)
    row = row_for(waiting, 7, 0, (1,), grammar_mask=only_stop)
    assert row.banned_token_ids == (1,)
    assert sample(logits.clone(), [row]) == [1]


@pytest.mark.parametrize("masked", ["grammar", "bias and min_tokens"])
def test_a_pipeline_stage_samples_the_first_token_under_the_grammar(tiny_dir, masked) -> None:
    """A CPP group's last stage samples as the engine does, masks and all (its logits
    are inference tensors: the sampler must not write into them)."""
    from halfmoon.engine.config import EngineConfig
    from halfmoon.engine.connector import LocalConnector

    config = EngineConfig(model=str(tiny_dir), kv_cache_mb=16, num_threads=1)
    connector = LocalConnector.create(config)
    prompt = [(i * 29) % 4000 + 5 for i in range(40)]
    if masked == "grammar":
        choice = StructuredOutput("choice", json.dumps(["gamma ray", "delta"]))
        params = SamplingParams(max_tokens=8, temperature=0.0, structured=choice)
    else:
        params = SamplingParams(max_tokens=8, temperature=0.0, min_tokens=2,
                                logit_bias=((7, 5.0),))  # fmt: skip
    reference = connector.engine.generate([prompt], params)[0]
    stages = [connector.pipeline_stage(2, s) for s in range(2)]
    for stage in stages:
        assert stage.start("p", prompt, 0) == 0
    hidden = None
    for stage in stages:
        hidden = stage.run_chunk("p", prompt, 0, len(prompt), hidden, len(prompt))
    token, _, _, finish = stages[-1].sample_first("p", prompt, params)
    for stage in stages:
        stage.release("p")
    assert token == reference.token_ids[0]
    assert finish == (reference.finish_reason if len(reference.token_ids) == 1 else None)


def _allowed_text(constraint: Constraint, tokenizer) -> set[str]:
    """The texts of the tokens ``constraint`` allows next."""
    allowed = constraint.allowed().nonzero().flatten().tolist()
    return {tokenizer.decode([t]) for t in allowed}


def test_a_constraint_held_after_the_reasoning_leaves_the_reasoning_free(engine) -> None:
    """Under a reasoning parser (``reasoning``): anything until ``</think>`` (the first
    one ends it), then the constraint; ``optional``: a reasoning block may come first,
    else the constraint holds from the start. The compiled grammar is Lark, as a vLLM
    server is sent it."""
    tok = grammar_tokenizer(engine.tokenizer, engine.model_config.vocab_size, [1])
    encode = engine.tokenizer.encode
    first = StructuredOutput("json", json.dumps(SCHEMA), compact=True, reasoning="first")
    assert after_reasoning(first).startswith('start: "<think>"? think body')
    check(first, tok)
    held = Constraint(first, tok)
    assert len(_allowed_text(held, engine.tokenizer)) > 200  # the reasoning: free
    held.consume(encode('Hm, {"ok": </thin', add_special_tokens=False))
    assert not held.done
    held.consume(encode("g></think>", add_special_tokens=False))  # ("</thing>": not it)
    after = _allowed_text(held, engine.tokenizer)  # then the schema, compact
    assert after and all(text.startswith("{") for text in after), after
    held.consume(encode('{"ok":true,"n":5,"tag":"red"}', add_special_tokens=False))
    assert held.done
    with pytest.raises(HalfmoonError, match="do not follow"):
        Constraint(first, tok).consume(encode("x</think>nope", add_special_tokens=False))
    choice = StructuredOutput("choice", '["yes", "no"]', reasoning="optional")
    starts = {text[0] for text in _allowed_text(Constraint(choice, tok), engine.tokenizer)}
    assert starts == {"<", "y", "n"}
    held = Constraint(choice, tok)
    held.consume(encode("<think>why?</think>", add_special_tokens=False))
    assert {text[0] for text in _allowed_text(held, engine.tokenizer)} == {"y", "n"}
    regex = StructuredOutput("regex", r"a/\d+", reasoning="first")
    held = Constraint(regex, tok)
    held.consume(encode("so</think>a/12", add_special_tokens=False))
    assert not held.done  # (\d+ may go on)
    with pytest.raises(ValueError, match="cannot follow a reasoning"):
        StructuredOutput("grammar", 'root ::= "x"', reasoning="first")
    with pytest.raises(ValueError, match="reasoning must be one of"):
        StructuredOutput("regex", "x", reasoning="later")


def test_a_random_model_reasons_freely_then_keeps_to_the_grammar(engine: LLMEngine) -> None:
    """In the engine: held after a reasoning the model first writes what it would alone
    (a random model never closes the reasoning here); a reasoning that may come first,
    and does not, leaves the grammar holding from the start."""
    prompt = [5, 9, 17, 33]
    free = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    (alone,) = engine.generate([prompt], free)
    first = StructuredOutput("json", json.dumps(SCHEMA), compact=True, reasoning="first")
    (held,) = engine.generate([prompt], SamplingParams(**{**free.__dict__, "structured": first}))
    assert "</think>" not in alone.text and held.token_ids == alone.token_ids
    optional = StructuredOutput("choice", json.dumps(["alpha", "beta"]), reasoning="optional")
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0,
                                                       structured=optional))  # fmt: skip
    assert out.text in ("alpha", "beta") and out.finish_reason == "stop"
