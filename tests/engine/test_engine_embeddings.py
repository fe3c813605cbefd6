"""Embedding requests in the engine (``SamplingParams(embed=True)``): the prompt's last
token's final hidden state, against transformers' own, through prefix reuse, chunked
prefills and batches mixed with generation."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import Reference, engine_config

from halfmoon.core.request import SamplingParams
from halfmoon.engine.engine import LLMEngine

EMBED = SamplingParams(max_tokens=1, embed=True)


def hf_embedding(ref: Reference, token_ids: list[int]) -> torch.Tensor:
    """transformers' last hidden state (after the final norm) at the last position."""
    with torch.no_grad():
        out = ref.hf_model(torch.tensor([token_ids]), output_hidden_states=True)
    return out.hidden_states[-1][0, -1]


def run(engine: LLMEngine, items: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (tokens, params) in items.items():
        engine.add_request(rid, tokens, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def assert_embedding(ours: tuple[float, ...] | None, theirs: torch.Tensor) -> None:
    assert ours is not None
    got = torch.tensor(ours)
    # A position or weight mix-up moves the state by O(1); float32 reorderings ~1e-6.
    torch.testing.assert_close(got, theirs, rtol=0, atol=1e-4 * theirs.abs().max().item())


def test_embedding_matches_transformers(reference: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(reference.path))
    a, b = prompts(11, [37, 5], reference.vocab_size)
    final = run(engine, {"a": (a, EMBED), "b": (b, EMBED)})
    for rid, tokens in (("a", a), ("b", b)):
        out = final[rid]
        assert out.finish_reason == "stop" and out.token_ids == () and out.new_token_ids == ()
        assert out.num_prompt_tokens == len(tokens)
        assert_embedding(out.embedding, hf_embedding(reference, tokens))
    engine.check_integrity()
    assert not engine.has_unfinished_requests()


def test_embedding_from_a_cached_prefix_and_chunks(llama_ref: Reference, prompts) -> None:
    # A prompt whose first blocks are cached computes only its tail; a long one is
    # prefilled in chunks (a 24-token step budget): the same state either way.
    engine = LLMEngine(engine_config(llama_ref.path, max_num_batched_tokens=24))
    (tokens,) = prompts(12, [70], llama_ref.vocab_size)
    first = run(engine, {"warm": (tokens[:48], SamplingParams(max_tokens=2))})["warm"]
    assert first.finished
    out = run(engine, {"e": (tokens, EMBED)})["e"]
    assert out.num_cached_tokens == 48
    assert_embedding(out.embedding, hf_embedding(llama_ref, tokens))
    again = run(engine, {"e2": (tokens, EMBED)})["e2"]  # fully cached but its last token
    assert again.num_cached_tokens >= 64
    assert_embedding(again.embedding, hf_embedding(llama_ref, tokens))
    engine.check_integrity()


def test_embeddings_batched_with_generation(llama_ref: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(llama_ref.path))
    g, e = prompts(13, [20, 30], llama_ref.vocab_size)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = run(engine, {"g0": (g, greedy)})["g0"].token_ids
    final = run(engine, {"g": (g, greedy), "e": (e, EMBED)})
    assert final["g"].token_ids == alone and final["g"].embedding is None
    assert_embedding(final["e"].embedding, hf_embedding(llama_ref, e))
    engine.check_integrity()


def test_embedding_refuses_prompt_logprobs() -> None:
    with pytest.raises(ValueError, match="embedding"):
        SamplingParams(embed=True, prompt_logprobs=1)
