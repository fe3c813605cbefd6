"""Prompt-lookup speculative decoding: the drafts found, the config as vLLM takes it, and
an engine that checks drafts giving the tokens of one that does not (greedy, seeded,
penalties, log-probabilities, stops, a tight pool, the prefix cache)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from engine_testlib import BLOCK_SIZE, Reference, engine_config

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams, StructuredOutput
from halfmoon.core.speculative import SpeculativeConfig, parse_speculative_config
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.runner import LOGITS_ALL, LOGITS_NONE, ChunkInput
from halfmoon.engine.speculative import find_drafts

#: One block's bytes in the reference model (2 layers, K and V, 2 KV heads of 16, float32).
REF_BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


def drafts(tokens: list[int], min_n: int = 1, max_n: int = 3, k: int = 4) -> list[int]:
    return list(find_drafts(np.array(tokens, dtype=np.int64), min_n, max_n, k))


def test_drafts_follow_the_longest_ngram_at_its_earliest_place() -> None:
    # ... 1 2 3 ends the sequence: 3 tokens match at 0 (and 2 3 alone at 5)
    assert drafts([1, 2, 3, 7, 8, 2, 3, 9, 1, 2, 3]) == [7, 8, 2, 3]
    # the earliest of two occurrences of the same length
    assert drafts([5, 6, 1, 5, 6, 2, 5, 6], max_n=2) == [1, 5, 6, 2]
    # a longer match wins over an earlier shorter one
    assert drafts([4, 9, 0, 3, 4, 9, 7, 3, 4, 9], max_n=3) == [7, 3, 4, 9]
    assert drafts([1, 2, 3, 4, 1, 2], k=2) == [3, 4]  # at most k
    assert drafts([1, 2, 3, 1, 2], k=9) == [3, 1, 2]  # up to the end, overlapping the suffix
    assert drafts([1, 2, 3, 4]) == []  # the last token never occurred before
    assert drafts([8, 1, 2, 9, 2], min_n=2) == []  # only a 1-gram matches
    assert drafts([7]) == [] and drafts([7, 7]) == [7]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}', (4, 3, 3)),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}', (2, 2, 2)),
        ('{"num_speculative_tokens": 5}', (5, 5, 5)),
        ('{"method": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
         '"prompt_lookup_min": 1}', (3, 4, 1)),
    ],
)  # fmt: skip
def test_config_reads_as_vllm_does(text: str, expected: tuple[int, int, int]) -> None:
    config = parse_speculative_config(text)
    assert config is not None
    got = (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min)
    assert got == expected
    assert parse_speculative_config(config.to_json()) == config
    assert parse_speculative_config(json.loads(text)) == config
    assert parse_speculative_config(None) is None and parse_speculative_config(" ") is None


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("ngram", "must be a JSON object"),
        ("[1, 2]", "must be a JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "'eagle' is not served"),
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"num_speculative_tokens": 0}', r"num_speculative_tokens must be an integer in \[1, 16\]"),
        ('{"num_speculative_tokens": 2.5}', "num_speculative_tokens must be an integer"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
         "prompt_lookup_min .4. must be <= prompt_lookup_max .2."),
        ('{"num_speculative_tokens": 2, "model": "x"}', "unknown key.*'model'"),
    ],
)  # fmt: skip
def test_bad_configs_are_errors_naming_the_problem(text: str, error: str) -> None:
    with pytest.raises(HalfmoonError, match=error):
        parse_speculative_config(text)


def run(ref: Reference, prompts: list[list[int]], params, speculative=None, **overrides):
    engine = LLMEngine(engine_config(ref.path, speculative=speculative, **overrides))
    outputs = engine.generate(prompts, params)
    engine.check_integrity()
    return engine, outputs


def repeating(prompts: list[list[int]]) -> list[list[int]]:
    """Prompts that repeat themselves (what prompt lookup is for)."""
    return [p + p[: len(p) // 2] for p in prompts]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
        # (three tokens allowed: a seeded draw repeats itself often enough to test)
        SamplingParams(max_tokens=48, temperature=0.8, seed=11, ignore_eos=True,
                       allowed_token_ids=(5, 6, 7)),
        # (penalties count the accepted drafts before a row: four tokens allowed, so
        # drafts are often right and the counts decide between them)
        SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.1,
                       frequency_penalty=0.1, presence_penalty=0.1, min_tokens=10,
                       allowed_token_ids=(5, 6, 7, 8)),
    ],
    ids=["greedy", "seeded", "penalties"],
)  # fmt: skip
def test_drafts_change_no_token(llama_ref: Reference, prompts, params) -> None:
    batch = repeating(prompts(31, [12, 17, 24, 40, 9], llama_ref.vocab_size))
    _, plain = run(llama_ref, batch, params)
    engine, fast = run(llama_ref, batch, params, SPEC)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in fast] == [o.finish_reason for o in plain]
    counts = engine.stats().spec_decode
    assert counts is not None and counts.num_draft_tokens > 0
    assert counts.num_accepted_tokens > 0
    assert sum(counts.accepted_per_position) == counts.num_accepted_tokens
    assert counts.mean_tokens_per_draft == 1 + counts.num_accepted_tokens / counts.num_drafts
    # every step of a sequence gave one token plus its accepted drafts
    generated = sum(len(o.token_ids) for o in fast)
    assert counts.num_sequence_steps == generated - counts.num_accepted_tokens


def test_log_probabilities_and_stops_are_those_of_plain_decoding(
    llama_ref: Reference, prompts
) -> None:
    batch = repeating(prompts(32, [20, 26], llama_ref.vocab_size))
    params = SamplingParams(max_tokens=30, temperature=0.0, logprobs=3, ignore_eos=True)
    _, plain = run(llama_ref, batch, params)
    engine, fast = run(llama_ref, batch, params, SPEC)
    assert engine.stats().spec_decode.num_accepted_tokens > 0
    for a, b in zip(fast, plain, strict=True):
        assert a.token_ids == b.token_ids
    # streamed: each step's outputs carry one log-probability per new token
    engine = LLMEngine(engine_config(llama_ref.path, speculative=SPEC))
    engine.add_request("r", batch[0], params)
    seen: list = []
    multi = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert len(out.new_logprobs) == len(out.new_token_ids) >= 1
            multi += len(out.new_token_ids) > 1
            seen.extend(out.new_logprobs)
        for seq in engine.scheduler.running:  # accepted drafts count as computed
            assert seq.num_computed_tokens == seq.num_tokens - 1
    assert multi > 0
    reference = LLMEngine(engine_config(llama_ref.path))
    reference.add_request("r", batch[0], params)
    expected: list = []
    while reference.has_unfinished_requests():
        for out in reference.step():
            expected.extend(out.new_logprobs)
    assert len(seen) == len(expected) == len(plain[0].token_ids)
    for got, want in zip(seen, expected, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
    # a stop token inside an accepted run ends the request there
    tokens = list(plain[0].token_ids)
    stop = tokens[len(tokens) // 2]
    stop_params = SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop])
    _, (plain_stop,) = run(llama_ref, batch[:1], stop_params)
    _, (fast_stop,) = run(llama_ref, batch[:1], stop_params, SPEC)
    assert fast_stop.token_ids == plain_stop.token_ids and fast_stop.token_ids[-1] == stop
    assert fast_stop.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 13])
def test_max_tokens_and_the_context_end_are_never_passed(
    llama_ref: Reference, prompts, max_tokens
) -> None:
    batch = repeating(prompts(33, [14, 30], llama_ref.vocab_size))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    _, plain = run(llama_ref, batch, params)
    _, fast = run(llama_ref, batch, params, SPEC)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert all(len(o.token_ids) == max_tokens for o in fast)
    # a context of 50 tokens ends the 45-token prompt after 5
    (prompt,) = repeating(prompts(34, [30], llama_ref.vocab_size))
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    _, (plain_end,) = run(llama_ref, [prompt], long, max_model_len=50)
    _, (fast_end,) = run(llama_ref, [prompt], long, SPEC, max_model_len=50)
    assert fast_end.token_ids == plain_end.token_ids and len(fast_end.token_ids) == 5


def test_a_tight_pool_preempts_no_more_and_loses_nothing(llama_ref: Reference, prompts) -> None:
    batch = repeating(prompts(35, [14, 14, 16, 18], llama_ref.vocab_size))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    _, roomy = run(llama_ref, batch, params)
    mb = 10 * REF_BLOCK_BYTES / 2**20  # 10 blocks: all four start, none ends unpreempted
    plain_engine, plain = run(llama_ref, batch, params, kv_cache_mb=mb)
    engine, fast = run(llama_ref, batch, params, SPEC, kv_cache_mb=mb)
    assert [o.token_ids for o in fast] == [o.token_ids for o in roomy]
    assert [o.token_ids for o in plain] == [o.token_ids for o in roomy]
    assert engine.stats().num_preemptions <= plain_engine.stats().num_preemptions
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_accepted_drafts_fill_the_prefix_cache(llama_ref: Reference, prompts) -> None:
    (prompt,) = repeating(prompts(36, [24], llama_ref.vocab_size))
    params = SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True, allowed_token_ids=(5, 6, 7)
    )  # (greedy among three: it loops)
    engine, (first,) = run(llama_ref, [prompt], params, SPEC)
    assert engine.stats().spec_decode.num_accepted_tokens > 0
    # the whole first answer, prompt and output but its last token, was computed and
    # cached in full blocks: a follow-up that repeats it is served from them
    follow = prompt + list(first.token_ids)
    (second,) = engine.generate([follow], SamplingParams(max_tokens=4, temperature=0.0))
    assert second.num_cached_tokens == (len(follow) - 1) // BLOCK_SIZE * BLOCK_SIZE
    (cold,) = LLMEngine(engine_config(llama_ref.path)).generate(
        [follow], SamplingParams(max_tokens=4, temperature=0.0)
    )
    assert second.token_ids == cold.token_ids
    engine.check_integrity()


#: A schema whose answers are mostly keys and punctuation the grammar forces.
SCHEMA = json.dumps({
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta"]}, "maxItems": 3},
    },
    "required": ["name", "colour", "count", "tags"],
    "additionalProperties": False,
})  # fmt: skip


def test_structured_outputs_draft_what_their_grammar_forces(tiny_dir) -> None:
    """A request held to a grammar drafts the tokens it forces (and n-grams it admits);
    each row is sampled under the grammar's mask after the drafts before it: the same
    answers as without speculation, greedy and seeded."""
    outputs = {
        StructuredOutput("json", SCHEMA, compact=True): lambda t: set(json.loads(t)) == {
            "name", "colour", "count", "tags"},
        StructuredOutput("regex", r"(ab-){2,6}cd"): lambda t: re.fullmatch(r"(ab-){2,6}cd", t),
        StructuredOutput("choice", json.dumps(["alpha beta gamma delta", "alpha beta"])):
            lambda t: t in ("alpha beta gamma delta", "alpha beta"),
    }  # fmt: skip
    prompts, params = [], []
    for structured in outputs:
        for seed in range(3):
            prompts.append([5 + seed, 9, 17, 33])
            params.append(SamplingParams(max_tokens=60, temperature=0.0 if seed == 0 else 1.0,
                                         seed=seed, structured=structured))  # fmt: skip
    plain = LLMEngine(engine_config(tiny_dir)).generate(prompts, params)
    engine = LLMEngine(engine_config(tiny_dir, speculative=SPEC))
    fast = engine.generate(prompts, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    checks = [ok for ok in outputs.values() for _ in range(3)]
    for out, ok in zip(fast, checks, strict=True):
        assert out.finish_reason == "stop" and ok(out.text), out.text
    counts = engine.stats().spec_decode
    assert counts.num_accepted_tokens > 0
    engine.check_integrity()


@pytest.mark.parametrize("reverse", [False, True])
def test_decode_rows_of_one_sequence_see_each_others_kv(
    llama_ref: Reference, prompts, reverse
) -> None:
    """A token and its drafts run as decode rows of one sequence (the batched decode
    attention, compiled and fused where it can be): row j attends to the K/V rows
    0..j-1 wrote in the same step, whatever the rows' order in the batch."""
    engine = LLMEngine(engine_config(llama_ref.path, enable_prefix_caching=False))
    (prompt,) = prompts(37, [30], llama_ref.vocab_size)
    whole = engine.block_manager.allocate("whole", 30)
    (expected,) = engine.runner.execute([ChunkInput("whole", prompt, 0, whole, LOGITS_ALL)])
    table = engine.block_manager.allocate("rows", 30)
    engine.runner.execute([ChunkInput("rows", prompt[:25], 0, table, LOGITS_NONE)])
    rows = [ChunkInput("rows", (prompt[p],), p, table) for p in range(25, 30)]
    got = engine.runner.execute(rows[::-1] if reverse else rows)
    got = torch.cat(got[::-1] if reverse else got)
    torch.testing.assert_close(got, expected[25:], atol=1e-4, rtol=1e-4)


def test_a_sequence_whose_drafts_fail_gets_fewer() -> None:
    from halfmoon.engine.scheduler import Sequence
    from halfmoon.engine.speculative import NgramProposer

    proposer = NgramProposer(SpeculativeConfig(4, 2, 1), max_model_len=100)
    seq = Sequence("s", [1, 2, 3, 1, 2, 3, 1, 2], 4, SamplingParams(max_tokens=50), 0, frozenset())
    seq.num_computed_tokens = 7  # decoding: the last token is not computed yet
    assert proposer.draft_limit(seq) == 4
    assert proposer.propose(seq, 10) == (3, 1, 2, 3)
    assert proposer.propose(seq, 2) == (3, 1)  # within the step's budget
    for _ in range(4):
        proposer.observe(seq, 4, 0)
    assert proposer.draft_limit(seq) == 1 and proposer.propose(seq, 10) == (3,)
    for _ in range(4):
        proposer.observe(seq, 1, 1)
    assert proposer.draft_limit(seq) == 4
    proposer.observe(seq, 0, 0)  # a step without drafts changes nothing
    assert proposer.draft_limit(seq) == 4
    seq.num_computed_tokens = 6  # two tokens behind: not decoding one token
    assert proposer.propose(seq, 10) == ()
    seq.num_computed_tokens = 3  # still in its prompt
    assert proposer.propose(seq, 10) == ()


def test_drafts_stay_within_the_step_budget(llama_ref: Reference, prompts) -> None:
    batch = repeating(prompts(38, [16, 18, 20], llama_ref.vocab_size))
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                            allowed_token_ids=(5, 6, 7))  # fmt: skip
    engine = LLMEngine(engine_config(llama_ref.path, speculative=SPEC, max_num_batched_tokens=6))
    plans = []
    schedule = engine.scheduler.schedule

    def recorded():
        plans.append(schedule())
        return plans[-1]

    engine.scheduler.schedule = recorded
    (plain,) = LLMEngine(engine_config(llama_ref.path)).generate(batch[:1], params)
    outs = engine.generate(batch, params)
    assert outs[0].token_ids == plain.token_ids
    for plan in plans:
        assert sum(c.num_tokens + len(c.draft) for c in plan.chunks) <= 6
        assert not plan.preempted
    assert max(len(c.draft) for plan in plans for c in plan.chunks) > 0
    engine.check_integrity()


def test_speculation_can_be_suspended(llama_ref: Reference, prompts) -> None:
    """The cost profiler times one-token steps: it suspends speculation meanwhile."""
    batch = repeating(prompts(39, [16], llama_ref.vocab_size))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                            allowed_token_ids=(5, 6, 7))  # fmt: skip
    engine = LLMEngine(engine_config(llama_ref.path, speculative=SPEC))
    with engine.speculation_suspended():
        (plain,) = engine.generate(batch, params)
    assert engine.stats().spec_decode.num_draft_tokens == 0
    (fast,) = engine.generate(batch, params)
    assert fast.token_ids == plain.token_ids
    assert engine.stats().spec_decode.num_accepted_tokens > 0
