"""vLLM's ``thinking_token_budget`` in the engine (halfmoon/engine/sampling.py,
:func:`thinking_forced`): once a reasoning has had its budget of tokens since its start
tag (in the prompt or the output), the sampler forces the end tag, token by token; each
reasoning has a budget of its own, and a request outside any reasoning is unchanged."""

from __future__ import annotations

import pytest
from engine_testlib import engine_config

from halfmoon.core.request import SamplingParams
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.sampling import row_for, sample, thinking_forced

START, END = (1, 2), (3, 4, 5)
TAGS = (START, END)


@pytest.mark.parametrize(
    ("token_ids", "budget", "forced"),
    [
        ([9, 9, 9], 0, None),  # no reasoning
        ([9, 1, 2, 7, 7], 3, None),  # two tokens of three
        ([9, 1, 2, 7, 7, 7], 3, 3),  # spent: the end tag's first token
        ([9, 1, 2, 7, 7, 7, 3], 3, 4),  # then its next ones
        ([9, 1, 2, 7, 7, 7, 3, 4], 3, 5),
        ([9, 1, 2, 7, 7, 7, 3, 4, 5], 3, None),  # closed
        ([1, 2, 7, 3, 4, 5, 8, 8, 8], 1, None),  # closed before the budget: free after it
        ([1, 2, 7, 3, 4, 5, 1, 2, 7], 1, 3),  # a second reasoning: a budget of its own
        ([1, 2], 0, 3),  # a budget of 0: the end tag at once
        ([1, 2, 7, 3, 4], 10, None),  # the model ended it itself, part-way: its own business
        ([1, 2, 7, 7, 7], 1, 3),  # the prompt ran past the budget: the whole tag still
        ([1, 2, 7, 7, 7, 3], 1, 4),
        ([1, 2, 7, 7, 7, 3, 4, 7], 1, 3),  # (a tag cut short: started again)
    ],
)
def test_the_end_tag_is_forced_once_the_budget_is_spent(token_ids, budget, forced) -> None:
    assert thinking_forced(token_ids, TAGS, budget) == forced


def test_a_forced_token_wins_over_every_other_option() -> None:
    import torch

    params = SamplingParams(max_tokens=8, temperature=1.0, thinking_token_budget=0,
                            allowed_token_ids=(7,), logit_bias=((3, -100.0),))  # fmt: skip
    row = row_for(params, seed=1, num_output_tokens=0, stop_ids=(), token_ids=[1, 2],
                  thinking=TAGS)  # fmt: skip
    assert row.forced_token == 3
    assert sample(torch.randn(1, 16), [row]) == [3]
    unbudgeted = row_for(SamplingParams(max_tokens=8), 1, 0, (), [1, 2], thinking=TAGS)
    assert unbudgeted.forced_token is None


def test_a_grammar_that_does_not_admit_the_end_tag_wins() -> None:
    """A structured output held from the start (no reasoning read) may not admit the
    end tag: the grammar then holds, and the budget forces nothing."""
    import torch

    params = SamplingParams(max_tokens=8, temperature=0.0, thinking_token_budget=0)
    grammar = torch.zeros(16, dtype=torch.bool)
    grammar[[7, 8]] = True
    row = row_for(params, 1, 0, (), [1, 2], grammar_mask=grammar, thinking=TAGS)
    assert row.forced_token == 3 and sample(torch.zeros(1, 16), [row]) in ([7], [8])
    grammar[3] = True
    row = row_for(params, 1, 0, (), [1, 2], grammar_mask=grammar, thinking=TAGS)
    assert sample(torch.zeros(1, 16), [row]) == [3]


@pytest.fixture(scope="module")
def engine(tiny_dir) -> LLMEngine:
    return LLMEngine(engine_config(tiny_dir))


def _tags(engine: LLMEngine) -> tuple[list[int], list[int]]:
    budgeted = SamplingParams(max_tokens=1, thinking_token_budget=0)
    start, end = engine.thinking_tags(budgeted)
    assert start and end and engine.thinking_tags(SamplingParams(max_tokens=1)) is None
    return list(start), list(end)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_reasoning_opened_by_the_prompt_ends_after_its_budget(engine, temperature) -> None:
    """The prompt opens the reasoning and has two tokens of it: with a budget of 6 the
    output's tokens 4.. are the end tag; after it the model writes freely."""
    start, end = _tags(engine)
    prompt = [11, 12, 13, *start, 21, 22]
    params = SamplingParams(max_tokens=16, temperature=temperature, seed=5, ignore_eos=True,
                            thinking_token_budget=6)  # fmt: skip
    (out,) = engine.generate([prompt], params)
    assert list(out.token_ids[4 : 4 + len(end)]) == end
    free = SamplingParams(**{**params.__dict__, "thinking_token_budget": None})
    (unbudgeted,) = engine.generate([prompt], free)
    assert out.token_ids[:4] == unbudgeted.token_ids[:4]  # the same until it is spent
    engine.check_integrity()


def test_a_prompt_that_reasoned_past_the_budget_gets_the_whole_end_tag(engine) -> None:
    start, end = _tags(engine)
    prompt = [11, 12, *start, 21, 22, 23]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=2, ignore_eos=True,
                            thinking_token_budget=1)  # fmt: skip
    (out,) = engine.generate([prompt], params)
    assert list(out.token_ids[: len(end)]) == end


def test_outside_a_reasoning_a_budget_changes_nothing(engine) -> None:
    start, end = _tags(engine)
    for prompt in ([11, 12, 13, 14], [11, *start, 12, *end, 13]):  # none; one closed
        params = SamplingParams(max_tokens=12, temperature=1.0, seed=9, ignore_eos=True)
        budgeted = SamplingParams(**{**params.__dict__, "thinking_token_budget": 0})
        assert engine.generate([prompt], budgeted)[0].token_ids == (
            engine.generate([prompt], params)[0].token_ids
        )


def test_a_handoff_keeps_counting_where_the_prefill_left_off(tiny_dir) -> None:
    """The prefill engine samples the first token, the decode engine continues: the end
    tag lands where one engine puts it."""
    prefill, decode = LLMEngine(engine_config(tiny_dir)), LLMEngine(engine_config(tiny_dir))
    start, end = _tags(prefill)
    prompt = [11, 12, *start, 21]
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True,
                            thinking_token_budget=4)  # fmt: skip
    (whole,) = LLMEngine(engine_config(tiny_dir)).generate([prompt], params)
    assert list(whole.token_ids[3 : 3 + len(end)]) == end
    prefill.add_request("r", prompt, SamplingParams(**{**params.__dict__, "max_tokens": 1}),
                        keep_kv=True)  # fmt: skip
    prefill.step()
    decode.import_request(prefill.export_kv("r"), params)
    final = None
    while decode.has_unfinished_requests():
        for out in decode.step():
            final = out
    assert final.token_ids == whole.token_ids


def test_a_pipeline_stage_forces_the_first_token_too(tiny_dir) -> None:
    from halfmoon.engine.config import EngineConfig
    from halfmoon.engine.connector import LocalConnector

    connector = LocalConnector.create(EngineConfig(model=str(tiny_dir), kv_cache_mb=16,
                                                   num_threads=1))  # fmt: skip
    start, end = _tags(connector.engine)
    prompt = [(i * 29) % 4000 + 5 for i in range(30)] + start
    params = SamplingParams(max_tokens=4, temperature=0.0, thinking_token_budget=0)
    stages = [connector.pipeline_stage(2, s) for s in range(2)]
    hidden = None
    for stage in stages:
        assert stage.start("p", prompt, 0) == 0
    for stage in stages:
        hidden = stage.run_chunk("p", prompt, 0, len(prompt), hidden, len(prompt))
    token, _, _, _ = stages[-1].sample_first("p", prompt, params)
    for stage in stages:
        stage.release("p")
    assert token == end[0]


def test_drafted_tokens_are_held_to_the_budget_as_decoded_ones(tiny_dir, engine) -> None:
    """With prompt-lookup drafts (the prompt's earlier reasoning offers the end tag as a
    draft), each draft row counts as decoding would: the same tokens as without drafts."""
    from halfmoon.core.speculative import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    start, end = _tags(engine)
    prompt = [11, *start, 21, 22, *end, 30, *start, 21]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                            thinking_token_budget=3)  # fmt: skip
    (plain,) = engine.generate([prompt], params)
    assert list(plain.token_ids[2 : 2 + len(end)]) == end
    drafting = LLMEngine(engine_config(tiny_dir, speculative=spec))
    (drafted,) = drafting.generate([prompt], params)
    assert drafted.token_ids == plain.token_ids
    assert drafting.stats().spec_decode.num_accepted_tokens > 0  # (drafts were taken)
