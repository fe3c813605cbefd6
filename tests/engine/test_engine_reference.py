"""Logits and greedy tokens against transformers' own Llama and Qwen2 implementations."""

from __future__ import annotations

import torch
from engine_testlib import BLOCK_SIZE, Reference, assert_logits_close, engine_config, prefill

from halfmoon.core.request import SamplingParams
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.kv_cache import export_to_bytes
from halfmoon.engine.runner import LOGITS_ALL, LOGITS_LAST, ChunkInput


def hf_logits(ref: Reference, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits for every position of ``token_ids``."""
    with torch.no_grad():
        return ref.hf_model(torch.tensor([token_ids])).logits[0]


def test_full_prefill_matches(reference: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(reference.path))
    (tokens,) = prompts(0, [45], reference.vocab_size)
    assert_logits_close(prefill(engine, "a", tokens, [45]), hf_logits(reference, tokens))
    engine.block_manager.free("a")
    engine.check_integrity()


def test_chunked_prefill_matches(reference: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(reference.path))
    (tokens,) = prompts(1, [70], reference.vocab_size)
    # Chunk edges off the 16-token block grid, one chunk of a single token.
    ours = prefill(engine, "a", tokens, [16, 5, 1, 29, 19])
    assert_logits_close(ours, hf_logits(reference, tokens))
    engine.block_manager.free("a")
    engine.check_integrity()


def test_prefill_reusing_cached_prefix(reference: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(reference.path))
    first, tail = prompts(2, [50, 20], reference.vocab_size)
    prefill(engine, "a", first, [50])
    table_a = engine.block_manager.block_table("a")
    engine.block_manager.free("a")
    second = first[:40] + tail
    num_cached = engine.block_manager.admit("b", second, len(second))
    assert num_cached == 2 * BLOCK_SIZE
    table_b = engine.block_manager.block_table("b")
    assert table_b[:2] == table_a[:2]
    chunk = ChunkInput("b", second[num_cached:], num_cached, table_b, LOGITS_ALL)
    ours = engine.runner.execute([chunk])[0]
    assert_logits_close(ours, hf_logits(reference, second)[num_cached:])
    engine.block_manager.free("b")
    engine.check_integrity()


def test_batched_decode_with_mixed_lengths(reference: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(reference.path))
    bm = engine.block_manager
    lengths = [5, 17, 33, 60]
    seqs = prompts(3, lengths + [23], reference.vocab_size)
    # One step prefills four prompts together.
    for i, tokens in enumerate(seqs[:4]):
        assert bm.admit(f"s{i}", tokens, len(tokens)) == 0
    chunks = [ChunkInput(f"s{i}", t, 0, bm.block_table(f"s{i}"), LOGITS_LAST)
              for i, t in enumerate(seqs[:4])]  # fmt: skip
    for i, logits in enumerate(engine.runner.execute(chunks)):
        assert_logits_close(logits, hf_logits(reference, seqs[i])[-1:])
        seqs[i].append(int(logits.argmax()))
    # Two decode steps for all four; the first also prefills a fifth prompt (mixed step).
    assert bm.admit("s4", seqs[4], len(seqs[4])) == 0
    for step in range(2):
        chunks = []
        for i, tokens in enumerate(seqs[:4]):
            assert bm.grow(f"s{i}", len(tokens))
            chunks.append(
                ChunkInput(f"s{i}", tokens[-1:], len(tokens) - 1, bm.block_table(f"s{i}"))
            )
        if step == 0:
            chunks.insert(2, ChunkInput("s4", seqs[4], 0, bm.block_table("s4"), LOGITS_ALL))
        outs = engine.runner.execute(chunks)
        if step == 0:
            assert_logits_close(outs.pop(2), hf_logits(reference, seqs[4]))
        for i, logits in enumerate(outs):
            assert_logits_close(logits, hf_logits(reference, seqs[i])[-1:])
            seqs[i].append(int(logits.argmax()))
    for i in range(5):
        bm.free(f"s{i}")
    engine.check_integrity()


def test_export_import_then_decode_matches(reference: Reference, prompts) -> None:
    source = LLMEngine(engine_config(reference.path))
    target = LLMEngine(engine_config(reference.path))
    (tokens,) = prompts(4, [37], reference.vocab_size)
    logits = prefill(source, "a", tokens, [37])
    tokens.append(int(logits[-1].argmax()))
    table = source.block_manager.block_table("a")
    data = source.kv_cache.export_blocks(table)
    # Occupy some blocks first so the import lands on different block ids.
    target.block_manager.allocate("filler", 3 * BLOCK_SIZE)
    new_table = target.block_manager.allocate("a", len(tokens))
    assert new_table is not None and new_table[0] != table[0]
    target.kv_cache.import_blocks(new_table[: len(table)], export_to_bytes(data))
    chunk = ChunkInput("a", tokens[-1:], len(tokens) - 1, new_table, LOGITS_LAST)
    assert_logits_close(target.runner.execute([chunk])[0], hf_logits(reference, tokens)[-1:])
    source.block_manager.free("a")
    for rid in ("a", "filler"):
        target.block_manager.free(rid)
    source.check_integrity()
    target.check_integrity()


def test_greedy_tokens_match_hf_generate(reference: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(reference.path, max_num_batched_tokens=64))
    batch = prompts(5, [3, 29, 50], reference.vocab_size)
    num_new = 12
    # min_tokens == max_tokens on both sides: EOS is masked identically, never stops early.
    params = SamplingParams(max_tokens=num_new, temperature=0.0, min_tokens=num_new)
    outputs = engine.generate(batch, params)
    for tokens, out in zip(batch, outputs, strict=True):
        expected = reference.hf_model.generate(
            torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
            max_new_tokens=num_new, min_new_tokens=num_new, do_sample=False,
        )[0, len(tokens) :].tolist()  # fmt: skip
        assert list(out.token_ids) == expected
        assert out.finish_reason == "length"
    engine.check_integrity()


def test_logprobs_match_the_reference_distribution(llama_ref: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(llama_ref.path))
    (tokens,) = prompts(11, [30], llama_ref.vocab_size)
    params = SamplingParams(max_tokens=5, temperature=0.8, seed=3, logprobs=3)
    engine.add_request("lp", tokens, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    generated = [t for out in outs for t in out.new_token_ids]
    entries = [lp for out in outs for lp in out.new_logprobs]
    assert len(entries) == len(generated) == 5
    for i, (token, entry) in enumerate(zip(generated, entries, strict=True)):
        # the model's own distribution at that position (not the temperature-scaled one)
        theirs = torch.log_softmax(hf_logits(llama_ref, tokens + generated[:i])[-1], dim=-1)
        assert abs(entry.logprob - theirs[token].item()) < 1e-3
        top_values, top_ids = torch.topk(theirs, 3)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        for (_, ours), ref in zip(entry.top, top_values.tolist(), strict=True):
            assert abs(ours - ref) < 1e-3
    # Without the option nothing is computed or returned.
    engine.add_request("plain", tokens, SamplingParams(max_tokens=2, temperature=0))
    plain = []
    while engine.has_unfinished_requests():
        plain += engine.step()
    assert all(out.new_logprobs == () for out in plain)


def test_penalties_match_a_manual_greedy_loop(llama_ref: Reference, prompts) -> None:
    # OpenAI's presence/frequency penalties on the output, vLLM's repetition penalty on
    # prompt + output, applied to the model's logits before the greedy choice.
    presence, frequency, repetition = 0.7, 0.4, 1.6
    (tokens,) = prompts(12, [25], llama_ref.vocab_size)
    engine = LLMEngine(engine_config(llama_ref.path))
    params = SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, presence_penalty=presence,
        frequency_penalty=frequency, repetition_penalty=repetition,
    )  # fmt: skip
    ours = list(engine.generate([tokens], params)[0].token_ids)
    expected: list[int] = []
    for _ in range(8):
        logits = hf_logits(llama_ref, tokens + expected)[-1].clone()
        counts = torch.bincount(torch.tensor(expected, dtype=torch.long), minlength=len(logits))
        logits -= frequency * counts + presence * (counts > 0)
        seen = torch.tensor(sorted(set(tokens + expected)))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / repetition,
                                   logits[seen] * repetition)  # fmt: skip
        expected.append(int(torch.argmax(logits)))
    assert ours == expected
    plain = list(engine.generate([tokens], SamplingParams(max_tokens=8, temperature=0,
                                                          ignore_eos=True))[0].token_ids)  # fmt: skip
    assert plain != ours  # the penalties changed the choice somewhere


def test_logit_bias_forces_and_bans_tokens(llama_ref: Reference, prompts) -> None:
    (tokens,) = prompts(13, [20], llama_ref.vocab_size)
    engine = LLMEngine(engine_config(llama_ref.path))

    def greedy(bias=()):
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logit_bias=bias)
        return list(engine.generate([tokens], params)[0].token_ids)

    plain = greedy()
    assert greedy(((7, 100.0),)) == [7, 7, 7, 7]
    banned = greedy(((plain[0], -100.0),))
    assert banned[0] != plain[0] and plain[0] not in banned
    expected = torch.log_softmax(hf_logits(llama_ref, tokens)[-1], dim=-1)
    expected[plain[0]] = float("-inf")
    assert banned[0] == int(torch.argmax(expected))


def test_prompt_logprobs_match_the_reference(llama_ref: Reference, prompts) -> None:
    """Every prompt token's log-probability, rank and top alternatives, against
    transformers' logits of the whole prompt: computed over chunks whose edges lie off
    the block grid, and never taken from the prefix cache (the prompt is cached by an
    earlier request)."""
    engine = LLMEngine(engine_config(llama_ref.path, prefill_chunk_tokens=13))
    (tokens,) = prompts(12, [53], llama_ref.vocab_size)
    engine.generate([tokens], SamplingParams(max_tokens=1, temperature=0))  # caches the prompt
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=4)
    engine.add_request("p", tokens, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[0].num_cached_tokens == 0
    entries = outs[0].prompt_logprobs
    assert entries is not None and len(entries) == len(tokens) - 1
    assert all(out.prompt_logprobs is None for out in outs[1:])
    theirs = torch.log_softmax(hf_logits(llama_ref, tokens), dim=-1)
    for i, entry in enumerate(entries, start=1):
        row = theirs[i - 1]
        assert abs(entry.logprob - row[tokens[i]].item()) < 1e-3
        assert entry.rank == int((row > row[tokens[i]]).sum()) + 1
        top_values, top_ids = torch.topk(row, 4)
        assert [t for t, _ in entry.top] == top_ids.tolist()
        assert (
            max(abs(a - b) for (_, a), b in zip(entry.top, top_values.tolist(), strict=True)) < 1e-3
        )
    # The first token is still the greedy one.
    assert outs[0].new_token_ids[0] == int(theirs[-1].argmax())
    # The request's own blocks went into the cache as usual: a later one hits them.
    (later,) = engine.generate([tokens], SamplingParams(max_tokens=1, temperature=0))
    assert later.num_cached_tokens == (len(tokens) - 1) // BLOCK_SIZE * BLOCK_SIZE
    engine.check_integrity()
