"""LLMEngine behaviour: stepping, prefix reuse, preemption, limits, stops, sampling, hooks,
and the prefill -> decode KV handoff."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import BLOCK_SIZE, Reference, engine_config

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams
from halfmoon.engine.attention import LayerKV
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.kv_cache import export_to_bytes
from halfmoon.engine.sampling import EngineSamplingParams, row_for, sample

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Bytes of one block of the reference checkpoint: 2 layers x K,V x 16 x 2 heads x 16 x 4.
REF_BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4


def run_checked(engine: LLMEngine) -> dict[str, list]:
    """Step to completion, checking the pool after every step; outputs per request."""
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
        engine.check_integrity()
    return seen


def test_step_streams_tokens_until_length(llama_ref: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(llama_ref.path))
    a, b = prompts(10, [12, 30], llama_ref.vocab_size)
    engine.add_request("a", a, GREEDY)
    engine.add_request("b", b, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    seen = run_checked(engine)
    assert [len(o.token_ids) for o in seen["a"]] == list(range(1, 9))
    assert all(len(o.new_token_ids) == 1 for o in seen["a"])
    assert seen["a"][-1].finished and seen["a"][-1].finish_reason == "length"
    assert not any(o.finished for o in seen["a"][:-1])
    assert len(seen["b"][-1].token_ids) == 3
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_stats_count_the_prompt_tokens_still_to_prefill(llama_ref: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(llama_ref.path, prefill_chunk_tokens=16))
    a, b = prompts(13, [40, 24], llama_ref.vocab_size)
    assert engine.stats().num_prefill_tokens == 0
    engine.add_request("a", a, GREEDY)
    engine.add_request("b", b, GREEDY)
    assert engine.stats().num_prefill_tokens == 64
    left = [engine.stats().num_prefill_tokens]
    while engine.stats().num_prefill_tokens:
        engine.step()
        left.append(engine.stats().num_prefill_tokens)
    assert left == sorted(left, reverse=True) and len(left) > 2  # chunk by chunk
    assert engine.has_unfinished_requests()  # decoding now: no prompt left to compute
    run_checked(engine)
    assert engine.stats().num_prefill_tokens == 0


def test_shared_prefix_is_served_from_cache(llama_ref: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(llama_ref.path))
    base, tail = prompts(11, [40, 9], llama_ref.vocab_size)
    (first,) = engine.generate([base], GREEDY)
    assert first.num_cached_tokens == 0
    (second,) = engine.generate([base[:36] + tail], GREEDY)
    assert second.num_cached_tokens == 2 * BLOCK_SIZE
    # Same greedy continuation as a cold engine.
    (cold,) = LLMEngine(engine_config(llama_ref.path)).generate([base[:36] + tail], GREEDY)
    assert second.token_ids == cold.token_ids
    engine.check_integrity()


def test_preemption_under_a_tight_pool_gives_the_same_tokens(llama_ref: Reference, prompts) -> None:
    batch = prompts(12, [20, 22, 25, 28], llama_ref.vocab_size)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    roomy = LLMEngine(engine_config(llama_ref.path)).generate(batch, params)
    # 10 blocks: all four start (2 blocks each), none can finish without preempting.
    tight = LLMEngine(engine_config(llama_ref.path, kv_cache_mb=10 * REF_BLOCK_BYTES / 2**20))
    assert tight.stats().num_blocks == 10
    for i, prompt in enumerate(batch):
        tight.add_request(f"r{i}", prompt, params)
    seen = run_checked(tight)
    assert tight.stats().num_preemptions > 0
    assert [list(seen[f"r{i}"][-1].token_ids) for i in range(4)] == [
        list(o.token_ids) for o in roomy
    ]


def test_request_that_can_never_fit_is_refused(llama_ref: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(llama_ref.path, kv_cache_mb=4 * REF_BLOCK_BYTES / 2**20))
    (prompt,) = prompts(13, [60], llama_ref.vocab_size)
    with pytest.raises(HalfmoonError, match="more than the whole pool"):
        engine.add_request("big", prompt, SamplingParams(max_tokens=10))
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_context_limits(llama_ref: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(llama_ref.path))
    (too_long,) = prompts(14, [512], llama_ref.vocab_size)  # max_position_embeddings = 512
    with pytest.raises(HalfmoonError, match="does not fit the context of 512"):
        engine.add_request("x", too_long, GREEDY)
    short = LLMEngine(engine_config(llama_ref.path, max_model_len=40))
    (prompt,) = prompts(15, [30], llama_ref.vocab_size)
    (out,) = short.generate(
        [prompt], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    )
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    with pytest.raises(HalfmoonError, match="token ids must lie"):
        engine.add_request("bad", [1, 2, llama_ref.vocab_size], GREEDY)
    with pytest.raises(HalfmoonError, match="does not fit"):
        engine.generate([prompt, too_long], GREEDY)
    assert not engine.has_unfinished_requests()  # the good prompt was withdrawn too
    engine.check_integrity()


def test_abort_frees_blocks(llama_ref: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(llama_ref.path, prefill_chunk_tokens=16))
    (prompt,) = prompts(16, [50], llama_ref.vocab_size)
    engine.add_request("a", prompt, GREEDY)
    assert engine.step() == []  # first 16-token chunk: nothing sampled yet
    assert engine.stats().num_free_blocks < engine.stats().num_blocks
    assert engine.abort_request("a")
    assert not engine.abort_request("a")
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    engine.check_integrity()


def test_stop_token_ids_and_min_tokens(llama_ref: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(llama_ref.path))
    (prompt,) = prompts(17, [20], llama_ref.vocab_size)
    base = EngineSamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (free_run,) = engine.generate([prompt], base)
    stop_id = free_run.token_ids[3]
    first = free_run.token_ids.index(stop_id)
    params = EngineSamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                  stop_token_ids=(stop_id,))  # fmt: skip
    (stopped,) = engine.generate([prompt], params)
    assert stopped.token_ids == free_run.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    late = EngineSamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                stop_token_ids=(stop_id,), min_tokens=first + 2)  # fmt: skip
    (held,) = engine.generate([prompt], late)
    assert stop_id not in held.token_ids[: first + 2]
    assert len(held.token_ids) >= first + 2
    engine.check_integrity()


def test_stop_strings_truncate_text(tiny_dir, prompts) -> None:
    engine = LLMEngine(engine_config(tiny_dir))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    (free_run,) = engine.generate(["The quick brown fox"], params)
    assert len(free_run.text) > 12
    stop = free_run.text[6:10]
    stop_params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=(stop,))
    (stopped,) = engine.generate(["The quick brown fox"], stop_params)
    assert stopped.finish_reason == "stop"
    assert stopped.text == free_run.text[: free_run.text.index(stop)]
    assert len(stopped.token_ids) < len(free_run.token_ids)
    engine.check_integrity()


def _contains(seq: tuple[int, ...] | list[int], part: tuple[int, ...]) -> bool:
    return any(tuple(seq[i : i + len(part)]) == part for i in range(len(seq) - len(part) + 1))


def test_bad_words_are_never_generated(tiny_dir) -> None:
    """vLLM's ``bad_words``: a word's token sequences (alone and after a space) never
    appear in the output, whether one token or several; the rest of the run is the
    model's own choice."""
    engine = LLMEngine(engine_config(tiny_dir))
    prompt = "The quick brown fox"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    (free_run,) = engine.generate([prompt], params)
    ids = free_run.token_ids
    one = engine.tokenizer.decode([ids[2]])  # a token the model picks, as a word
    two = engine.tokenizer.decode(list(ids[4:6]))  # and a pair of them
    words = (one, two)
    banned = engine.tokenizer.bad_word_ids(words)
    assert banned[0] == tuple(engine.tokenizer.encode(one.lstrip(), add_special_tokens=False))
    assert any(_contains(ids, seq) for seq in banned)
    (held,) = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0,
                                                       ignore_eos=True, bad_words=words))  # fmt: skip
    assert held.token_ids != ids and len(held.token_ids) == 24
    assert not any(_contains(held.token_ids, seq) for seq in banned)
    with pytest.raises(ValueError, match="non-blank"):
        SamplingParams(bad_words=(" ",))


def test_seeded_sampling_is_reproducible_and_batch_independent(
    llama_ref: Reference, prompts
) -> None:
    engine = LLMEngine(engine_config(llama_ref.path))
    a, b, c = prompts(18, [10, 25, 40], llama_ref.vocab_size)
    sampled = EngineSamplingParams(max_tokens=10, temperature=1.0, seed=42, ignore_eos=True)
    (alone,) = engine.generate([a], sampled)
    batched = engine.generate([b, a, c], [GREEDY, sampled, sampled])
    assert batched[1].token_ids == alone.token_ids
    other_seed = EngineSamplingParams(max_tokens=10, temperature=1.0, seed=43, ignore_eos=True)
    assert engine.generate([a], other_seed)[0].token_ids != alone.token_ids
    greedy = engine.generate([a], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    for narrow in (EngineSamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True),
                   EngineSamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, ignore_eos=True),
                   EngineSamplingParams(max_tokens=10, temperature=1.5, min_p=1.0, ignore_eos=True)):  # fmt: skip
        assert engine.generate([a], narrow)[0].token_ids == greedy[0].token_ids
    engine.check_integrity()


def test_a_top_p_below_float32s_range_keeps_the_likeliest_token() -> None:
    """top_p 5e-324 (valid: > 0) is 0 in float32: the likeliest token is still kept (it
    once dropped every token, and the draw failed, taking its worker down)."""
    logits = torch.tensor([[0.1, 2.0, 0.5]])
    row = row_for(SamplingParams(temperature=1.0, top_p=5e-324), 3, 0, ())
    assert sample(logits, [row]) == [1]


@pytest.mark.parametrize("temperature", [1e-300, 1e-38, 9e-6])
def test_a_vanishing_temperature_is_greedy(temperature: float) -> None:
    """Temperatures below 1e-5 are greedy (as vLLM's): 1e-300 once made the scaled
    logits infinite and the draw fail."""
    logits = torch.tensor([[0.1, 2.0, 0.5, 1.9]])
    row = row_for(SamplingParams(temperature=temperature), 3, 0, ())
    assert sample(logits, [row]) == [1]


@pytest.mark.parametrize("penalty", [5e-324, 1e-40])
def test_a_vanishing_repetition_penalty_still_draws(penalty: float) -> None:
    """A repetition penalty in (0, 2] as small as 1e-40 divides positive logits into
    +inf: the draw still gives one of them (it once failed on NaNs)."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.5]])
    row = row_for(SamplingParams(temperature=1.0, repetition_penalty=penalty), 4, 1, (),
                  [1, 3])  # fmt: skip
    assert sample(logits, [row])[0] in (1, 3)


def test_a_row_without_a_valid_distribution_is_drawn_greedily(caplog) -> None:
    """Logits the model made NaN (never expected) give the row's argmax and a warning,
    not an exception that would end the worker and every request on it."""
    logits = torch.tensor([[0.5, float("nan"), 1.0], [0.1, 0.2, 30.0]])
    rows = [row_for(SamplingParams(temperature=1.0), s, 0, ()) for s in (1, 2)]
    with caplog.at_level("WARNING", logger="halfmoon.engine.sampling"):
        tokens = sample(logits, rows)
    assert tokens[1] == 2 and 0 <= tokens[0] < 3
    assert "drawn greedily" in caplog.text


def test_a_bad_words_last_token_is_banned_only_after_the_rest() -> None:
    """A one-token bad word is always banned; a longer one's last token only where the
    output (not the prompt) already ends with its other tokens."""
    logits = torch.zeros(1, 8)
    logits[0, 4], logits[0, 5] = 2.0, 3.0
    params = SamplingParams(temperature=0.0)
    words = ((5,), (3, 4))

    def greedy(prompt: tuple[int, ...], output: tuple[int, ...]) -> int:
        row = row_for(params, 0, len(output), (), prompt + output, bad_words=words)
        return sample(logits.clone(), [row])[0]

    assert greedy((1,), ()) == 4  # 5 banned, 4 free: nothing generated yet
    assert greedy((1,), (3,)) not in (4, 5)  # after 3, 4 is banned too
    assert greedy((3,), ()) == 4  # a 3 in the prompt does not count
    assert greedy((1,), (3, 2)) == 4


def test_min_p_draws_only_tokens_near_the_likeliest() -> None:
    """Probabilities 0.5, 0.3, 0.15, 0.05: min_p 0.5 keeps the tokens at >= 0.25 (the
    first two), in their proportion; 0 keeps all four."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))

    def draws(min_p: float) -> list[int]:
        rows = [row_for(SamplingParams(temperature=1.0, min_p=min_p), seed, 0, ())
                for seed in range(400)]  # fmt: skip
        return sample(logits.repeat(len(rows), 1), rows)

    kept = draws(0.5)
    assert set(kept) == {0, 1} and 0.55 < kept.count(0) / len(kept) < 0.7  # 0.5 / 0.8
    assert set(draws(0.0)) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)


def test_allowed_token_ids_are_the_only_ones_drawn() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))

    def draws(**options) -> list[int]:
        params = SamplingParams(**options)
        rows = [row_for(params, seed, 0, (3,)) for seed in range(200)]  # stop id 3
        return sample(logits.repeat(len(rows), 1), rows)

    assert set(draws(temperature=0.0, allowed_token_ids=(2, 3))) == {2}  # greedy: the likelier
    assert set(draws(temperature=1.0, allowed_token_ids=(1, 2))) == {1, 2}
    # only the stop token allowed, but min_tokens bans it: the allowed token still wins
    assert set(draws(temperature=1.0, allowed_token_ids=(3,), min_tokens=2)) == {3}
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=(-1,))


def test_layer_hook_sees_each_chunk_per_layer(llama_ref: Reference, prompts) -> None:
    calls: list[tuple[str, int, list[int], LayerKV]] = []

    def hook(request_id: str, layer: int, block_ids: list[int], kv: LayerKV) -> None:
        calls.append((request_id, layer, block_ids, kv))

    engine = LLMEngine(engine_config(llama_ref.path, prefill_chunk_tokens=16), kv_layer_hook=hook)
    (prompt,) = prompts(19, [40], llama_ref.vocab_size)
    engine.add_request("a", prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.step()
    assert engine.block_manager.block_table("a") == [0]  # blocks are allocated chunk by chunk
    assert [(c[0], c[1], c[2]) for c in calls] == [("a", 0, [0]), ("a", 1, [0])]
    assert [(c[3].start_token, c[3].end_token) for c in calls] == [(0, 16), (0, 16)]
    run_checked(engine)  # two more prefill chunks, then decode steps (no hook calls)
    spans = [(c[1], c[2], c[3].start_token, c[3].end_token) for c in calls]
    assert spans == [
        (0, [0], 0, 16), (1, [0], 0, 16),
        (0, [1], 16, 32), (1, [1], 16, 32),
        (0, [2], 32, 40), (1, [2], 32, 40),
    ]  # fmt: skip
    # Views hold exactly what the pool holds for those blocks in that layer.
    fresh = LLMEngine(engine_config(llama_ref.path))
    fresh.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0.0), keep_kv=True)
    run_checked(fresh)
    exported = fresh.export_kv("a").data  # [L, 2, n, B, H, D]
    for _, layer, _, kv in calls[4:]:
        torch.testing.assert_close(kv.key[0, :8], exported[layer, 0, 2, :8])
        torch.testing.assert_close(kv.value[0, :8], exported[layer, 1, 2, :8])


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_handoff_continues_exactly(llama_ref: Reference, prompts, temperature: float) -> None:
    (prompt,) = prompts(20, [45], llama_ref.vocab_size)
    params = SamplingParams(max_tokens=10, temperature=temperature, seed=5, ignore_eos=True)
    (uninterrupted,) = LLMEngine(engine_config(llama_ref.path)).generate([prompt], params)

    prefill = LLMEngine(engine_config(llama_ref.path))
    first_token = SamplingParams(max_tokens=1, temperature=temperature, seed=5, ignore_eos=True)
    prefill.add_request("r", prompt, first_token, keep_kv=True)
    (out,) = prefill.step()
    assert out.finished and out.token_ids == uninterrupted.token_ids[:1]
    handoff = prefill.export_kv("r")
    assert handoff.num_computed_tokens == 45 and len(handoff.token_ids) == 46
    assert prefill.stats().num_free_blocks == prefill.stats().num_blocks
    prefill.check_integrity()

    decode = LLMEngine(engine_config(llama_ref.path))
    decode.generate([[5, 6, 7]], GREEDY)  # leave cached blocks around: import must not mind
    as_bytes = type(handoff)(**{**handoff.__dict__, "data": export_to_bytes(handoff.data)})
    decode.import_request(as_bytes, params)
    seen = run_checked(decode)
    assert seen["r"][-1].token_ids == uninterrupted.token_ids
    assert seen["r"][-1].finish_reason == "length"


def test_export_without_data_only_hands_over_the_state(llama_ref: Reference, prompts) -> None:
    """What a prefill worker does once the KV went by its stream: no copy, blocks back."""
    engine = LLMEngine(engine_config(llama_ref.path))
    (prompt,) = prompts(22, [40], llama_ref.vocab_size)
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, seed=9), keep_kv=True)
    (out,) = engine.step()
    handoff = engine.export_kv("r", with_data=False)
    assert handoff.data == b"" and handoff.seed == 9
    assert handoff.token_ids == (*prompt, *out.token_ids) and handoff.num_computed_tokens == 40
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
    engine.check_integrity()


def test_import_checks_layout(llama_ref: Reference, prompts) -> None:
    source = LLMEngine(engine_config(llama_ref.path))
    (prompt,) = prompts(21, [20], llama_ref.vocab_size)
    source.add_request("r", prompt, SamplingParams(max_tokens=1), keep_kv=True)
    source.step()
    handoff = source.export_kv("r")
    # (the reference attention: a kernel for 8-token blocks would be built just for this)
    other = LLMEngine(engine_config(llama_ref.path, block_size=8, attention="reference"))
    with pytest.raises(HalfmoonError, match="block_size"):
        other.import_request(handoff, GREEDY)
    other.check_integrity()
    same = LLMEngine(engine_config(llama_ref.path))
    with pytest.raises(HalfmoonError, match="already generated"):
        same.import_request(handoff, SamplingParams(max_tokens=1))
    truncated = type(handoff)(**{**handoff.__dict__, "data": export_to_bytes(handoff.data)[:-4]})
    with pytest.raises(HalfmoonError, match="blocks need"):
        same.import_request(truncated, GREEDY)
    assert not same.has_unfinished_requests()
    same.check_integrity()


def test_prompt_logprobs_survive_preemption(llama_ref: Reference, prompts) -> None:
    """A request preempted in the middle of its prompt recomputes what it lost but keeps
    the prompt log-probabilities it had: the same entries as in a roomy pool."""
    batch = prompts(13, [20, 22, 25, 28], llama_ref.vocab_size)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, prompt_logprobs=2)

    def first_outputs(engine: LLMEngine) -> dict[str, object]:
        for i, prompt in enumerate(batch):
            engine.add_request(f"r{i}", prompt, params)
        seen = run_checked(engine)
        return {rid: outs[0].prompt_logprobs for rid, outs in seen.items()}

    roomy = first_outputs(LLMEngine(engine_config(llama_ref.path, prefill_chunk_tokens=7)))
    tight = LLMEngine(engine_config(llama_ref.path, prefill_chunk_tokens=7,
                                    kv_cache_mb=10 * REF_BLOCK_BYTES / 2**20))  # fmt: skip
    got = first_outputs(tight)
    assert tight.stats().num_preemptions > 0
    for rid, entries in roomy.items():
        assert entries is not None and len(entries) == len(batch[int(rid[1:])]) - 1
        for ours, theirs in zip(got[rid], entries, strict=True):
            assert ours.rank == theirs.rank and abs(ours.logprob - theirs.logprob) < 1e-4
