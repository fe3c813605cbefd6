"""A step that fails does not end the engine: a failed batch's requests are computed
alone until each succeeds, so only the culprit fails (it leaves with its blocks, nothing
it computed cached) and the others lose a step, not their work; a run of failed steps
does end the engine. A failure after sampling fails its request alone."""

from __future__ import annotations

import dataclasses

import pytest
from engine_testlib import Reference, engine_config

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams
from halfmoon.engine import engine as engine_module
from halfmoon.engine.engine import FAIL_STEP_ENV, MAX_FAILED_STEPS_IN_A_ROW, LLMEngine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _fail_when(engine: LLMEngine, request_id: str) -> list[int]:
    """Make the model raise in every step that computes ``request_id``; returns the list
    of step sizes that raised (chunks per failed step)."""
    execute, failed = engine.runner.execute, []

    def flaky(inputs):
        if any(i.request_id == request_id for i in inputs):
            failed.append(len(inputs))
            raise RuntimeError("boom")
        return execute(inputs)

    engine.runner.execute = flaky
    return failed


def _finish(engine: LLMEngine) -> dict[str, tuple[int, ...]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        engine.check_integrity()
    return done


#: The poison request's seed: what the sampler sees of it.
POISON_SEED = 4242


def _fail_in_sampler(monkeypatch) -> list[int]:
    """Make the sampler raise in every step that draws for the request seeded
    :data:`POISON_SEED` (after the model ran and prompt log-probabilities were taken)."""
    sample, failed = engine_module.sample_with_logprobs, []

    def flaky(batch, rows, num_top):
        if any(row.seed == POISON_SEED for row in rows):
            failed.append(len(rows))
            raise RuntimeError("boom")
        return sample(batch, rows, num_top)

    monkeypatch.setattr(engine_module, "sample_with_logprobs", flaky)
    return failed


@pytest.mark.parametrize("where", ["model", "sampler"])
def test_a_failed_step_fails_its_culprit_alone_and_the_engine_goes_on(
    llama_ref: Reference, prompts, monkeypatch, where
) -> None:
    a, b, c = prompts(3, [40, 24, 33], llama_ref.vocab_size)
    with_logprobs = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True,
                                   prompt_logprobs=2, logprobs=1)  # fmt: skip
    fresh = LLMEngine(engine_config(llama_ref.path))
    expected_a, expected_c = fresh.generate([a, c], [GREEDY, with_logprobs])
    (first_expected,) = fresh.generate([c], dataclasses.replace(with_logprobs, max_tokens=1))
    engine = LLMEngine(engine_config(llama_ref.path))
    failed = _fail_when(engine, "poison") if where == "model" else _fail_in_sampler(monkeypatch)
    engine.add_request("a", a, GREEDY)
    engine.step()  # a's prompt: computed and committed before the poison arrives
    engine.add_request("poison", b, dataclasses.replace(GREEDY, seed=POISON_SEED))
    engine.add_request("c", c, with_logprobs)
    assert engine.step() == []  # a's decode, the poison's and c's prompts: one failed step
    assert engine.take_failures() == []  # each is computed alone now
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        engine.check_integrity()
    assert failed == [3, 1]  # the batch, then the poison alone
    (failure,) = engine.take_failures()
    assert failure.request_id == "poison" and failure.retryable and not failure.instance_failed
    assert failure.error == "engine step failed: RuntimeError: boom"
    done = {o.request_id: o for o in outputs if o.finished}
    assert sorted(done) == ["a", "c"]
    assert done["a"].token_ids == expected_a.token_ids
    assert done["c"].token_ids == expected_c.token_ids
    first_c = next(o for o in outputs if o.request_id == "c")
    for got, want in [(done["c"].new_logprobs, expected_c.new_logprobs),
                      (first_c.prompt_logprobs, first_expected.prompt_logprobs)]:  # fmt: skip
        assert len(got) == len(want)  # none counted twice
        assert [g.top[0][0] for g in got] == [w.top[0][0] for w in want]
        assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=1e-5)
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks  # every block came back
    assert not engine.abort_request("poison")  # gone from the engine
    # Nothing the failed steps computed of the poison is cached: its prompt is no hit.
    monkeypatch.undo()
    engine.runner.execute = type(engine.runner).execute.__get__(engine.runner)
    engine.add_request("again", b, GREEDY)
    assert engine.step()[0].num_cached_tokens == 0


def test_a_batch_that_fails_once_loses_nothing(llama_ref: Reference, prompts) -> None:
    """A passing fault (the batch failed, then each alone succeeds): nobody fails."""
    a, b = prompts(8, [30, 21], llama_ref.vocab_size)
    expected = LLMEngine(engine_config(llama_ref.path)).generate([a, b], GREEDY)
    engine = LLMEngine(engine_config(llama_ref.path))
    execute, calls = engine.runner.execute, []

    def once(inputs):
        calls.append(len(inputs))
        if len(calls) == 3:
            raise MemoryError("no room this time")
        return execute(inputs)

    engine.runner.execute = once
    engine.add_request("a", a, GREEDY)
    engine.add_request("b", b, GREEDY)
    done = _finish(engine)
    assert calls[:5] == [2, 2, 2, 1, 1]  # the third step failed; each went alone once
    assert done == {"a": expected[0].token_ids, "b": expected[1].token_ids}
    assert engine.take_failures() == []


def test_steps_failing_in_a_row_end_the_engine(llama_ref: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(llama_ref.path))
    _fail_when(engine, "poison")
    (prompt,) = prompts(4, [20], llama_ref.vocab_size)
    for i in range(MAX_FAILED_STEPS_IN_A_ROW - 1):
        engine.add_request("poison", prompt, GREEDY)
        assert engine.step() == []
        assert [f.request_id for f in engine.take_failures()] == ["poison"], i
    engine.add_request("poison", prompt, GREEDY)
    with pytest.raises(HalfmoonError, match=f"failed {MAX_FAILED_STEPS_IN_A_ROW} steps in a row"):
        engine.step()


def test_a_step_that_succeeds_resets_the_count(llama_ref: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(llama_ref.path))
    _fail_when(engine, "poison")
    a, b = prompts(5, [20, 17], llama_ref.vocab_size)
    for i in range(2 * MAX_FAILED_STEPS_IN_A_ROW):
        engine.add_request("poison", a, GREEDY)
        assert engine.step() == []
        engine.add_request(f"ok-{i}", b, SamplingParams(max_tokens=1))
        assert [o.request_id for o in engine.step()] == [f"ok-{i}"]
    assert len(engine.take_failures()) == 2 * MAX_FAILED_STEPS_IN_A_ROW


def test_a_failure_after_sampling_fails_that_request_alone(llama_ref: Reference, prompts) -> None:
    a, b = prompts(6, [20, 30], llama_ref.vocab_size)
    expected = LLMEngine(engine_config(llama_ref.path)).generate([a], GREEDY)
    engine = LLMEngine(engine_config(llama_ref.path))
    append = engine._append  # noqa: SLF001

    def broken(seq, tokens):
        if seq.request_id == "b" and seq.num_output_tokens >= 2:
            raise ValueError("no text for it")
        return append(seq, tokens)

    engine._append = broken  # noqa: SLF001
    engine.add_request("a", a, GREEDY)
    engine.add_request("b", b, GREEDY)
    done = _finish(engine)
    assert done == {"a": expected[0].token_ids}
    (failure,) = engine.take_failures()
    assert failure.request_id == "b" and not failure.retryable
    assert failure.error == "request failed in the engine: ValueError: no text for it"
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_generate_raises_what_failed(llama_ref: Reference, prompts, monkeypatch) -> None:
    a, b = prompts(7, [20, 30], llama_ref.vocab_size)
    monkeypatch.setenv(FAIL_STEP_ENV, str(b[5]))
    engine = LLMEngine(engine_config(llama_ref.path))
    assert len(engine.generate([a], GREEDY)[0].token_ids) == 6  # without the token: fine
    with pytest.raises(HalfmoonError, match=f"token {b[5]} computed"):
        engine.generate([a, b], GREEDY)
    assert not engine.has_unfinished_requests()
    assert engine.take_failures() == []  # generate took its own
