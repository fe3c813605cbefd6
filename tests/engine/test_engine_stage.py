"""Pipeline stages (CPP): layer slices over chunks give the whole model's logits."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import Reference, engine_config
from test_engine_reference import assert_logits_close, hf_logits, prefill

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.stage import LayerSlice, StageExecutor


def test_split_is_contiguous_and_balanced() -> None:
    slices = LayerSlice.split(10, 3)
    assert [(s.first, s.last) for s in slices] == [(0, 4), (4, 7), (7, 10)]
    assert slices[0].is_first and slices[-1].is_last and not slices[1].is_last
    assert [s.size for s in LayerSlice.split(4, 4)] == [1, 1, 1, 1]
    with pytest.raises(HalfmoonError, match="cannot split"):
        LayerSlice.split(2, 3)
    with pytest.raises(ValueError, match="not inside"):
        LayerSlice(3, 3, 4)


def pipeline(engine: LLMEngine, stages: int, tokens: list[int], chunk: int,
             cached: list[bytes] | None = None) -> tuple[torch.Tensor, list[StageExecutor]]:  # fmt: skip
    """Run ``tokens`` through ``stages`` executors chunk by chunk, stage after stage (what a
    CPP group does across processes); returns every new position's final hidden rows."""
    model = engine.runner.model
    execs = [
        StageExecutor(model, engine.kv_layout, s, 64)
        for s in LayerSlice.split(engine.model_config.num_layers, stages)
    ]
    for ex in execs:
        assert ex.start("r", tokens) == 0
        if cached:
            ex.load_prefix("r", cached)
    start = len(cached or []) * engine.kv_layout.block_size
    return run_chunks(execs, "r", tokens, start, chunk), execs


def run_chunks(execs: list[StageExecutor], rid: str, tokens: list[int], start: int,
               chunk: int) -> torch.Tensor:  # fmt: skip
    finals = []
    while start < len(tokens):
        piece = tokens[start : start + chunk]
        hidden = None
        for ex in execs:
            hidden = ex.run(rid, piece, start, hidden)
            ex.commit(rid, tokens, start + len(piece))
        finals.append(hidden)
        start += len(piece)
    return torch.cat(finals)


def test_stages_match_transformers(reference: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(reference.path))
    (tokens,) = prompts(3, [70], reference.vocab_size)
    hidden, execs = pipeline(engine, 2, tokens, chunk=24)  # chunks off the block grid
    logits = execs[-1].logits(hidden)
    assert_logits_close(logits, hf_logits(reference, tokens))
    for ex in execs:
        ex.release("r")
        ex.blocks.check_integrity()
        assert ex.blocks.num_free_blocks == 64


@pytest.mark.parametrize("stages", [3, 4])
def test_more_stages_match_the_engine(tiny_dir, prompts, stages: int) -> None:
    engine = LLMEngine(engine_config(tiny_dir))
    assert engine.model_config.num_layers == 4
    (tokens,) = prompts(6, [90], engine.model_config.vocab_size)
    hidden, execs = pipeline(engine, stages, tokens, chunk=32)
    whole = prefill(engine, "whole", tokens, [90])
    assert_logits_close(execs[-1].logits(hidden), whole)


def test_stage_greedy_token_matches_the_engine(llama_ref: Reference, prompts) -> None:
    engine = LLMEngine(engine_config(llama_ref.path))
    (tokens,) = prompts(4, [53], llama_ref.vocab_size)
    hidden, execs = pipeline(engine, 2, tokens, chunk=16)
    first = int(execs[-1].logits(hidden[-1:]).argmax())
    (out,) = engine.generate([tokens], SamplingParams(max_tokens=1, temperature=0.0))
    assert out.token_ids == (first,)


def test_cached_prefix_blocks_are_reused_per_stage(llama_ref: Reference, prompts) -> None:
    """Whole-model blocks from the engine (what the store holds) seed each stage's slice."""
    engine = LLMEngine(engine_config(llama_ref.path))
    (tokens,) = prompts(5, [60], llama_ref.vocab_size)
    engine.generate([tokens[:40]], SamplingParams(max_tokens=1))
    hits = engine.block_manager.match_prefix(tokens)
    assert len(hits) == 2  # 32 of the 40 tokens sit in full blocks
    payloads = [
        bytes(engine.kv_cache.export_blocks([b]).contiguous().view(torch.uint8).numpy())
        for b in hits
    ]
    hidden, execs = pipeline(engine, 2, tokens, chunk=16, cached=payloads)
    assert hidden.shape[0] == len(tokens) - 32
    assert_logits_close(execs[-1].logits(hidden), hf_logits(llama_ref, tokens)[32:])


def test_stage_errors_are_clear(llama_ref: Reference) -> None:
    engine = LLMEngine(engine_config(llama_ref.path))
    second = LayerSlice.split(engine.model_config.num_layers, 2)[1]
    ex = StageExecutor(engine.runner.model, engine.kv_layout, second, 4)
    with pytest.raises(HalfmoonError, match="free blocks"):
        ex.start("big", list(range(10_000)))
    assert ex.blocks.num_free_blocks == 4
    ex.start("r", list(range(8)))
    with pytest.raises(HalfmoonError, match="hidden states"):
        ex.run("r", [1, 2, 3], 0)
    first = LayerSlice.split(engine.model_config.num_layers, 2)[0]
    with pytest.raises(HalfmoonError, match="only the last stage"):
        StageExecutor(engine.runner.model, engine.kv_layout, first, 4).logits(torch.zeros(1, 8))
    with pytest.raises(HalfmoonError, match="outside this stage"):
        ex.kv_cache.layer(0)


def test_stage_cache_reuses_a_prefix_up_to_the_agreed_token(llama_ref: Reference, prompts) -> None:
    """A stage's own pool caches its slice of earlier prompts; a group agrees on a start
    token, and a stage never reuses past it."""
    engine = LLMEngine(engine_config(llama_ref.path))
    (tokens,) = prompts(7, [75], llama_ref.vocab_size)
    _, execs = pipeline(engine, 2, tokens[:50], chunk=16)
    for ex in execs:
        ex.release("r")
        assert ex.match_blocks(tokens) == 3  # 48 of the 50 tokens sit in full blocks
    assert execs[0].start("s", tokens, max_cached_tokens=32) == 32  # capped by agreement
    assert execs[1].start("s", tokens, max_cached_tokens=48) == 48
    execs[1].release("s")
    assert execs[1].start("s", tokens, max_cached_tokens=32) == 32
    hidden = run_chunks(execs, "s", tokens, 32, 16)
    assert_logits_close(execs[-1].logits(hidden), hf_logits(llama_ref, tokens)[32:])
    for ex in execs:
        ex.release("s")
        ex.blocks.check_integrity()


def test_hidden_states_cross_stages_as_host_bytes(llama_ref: Reference, prompts) -> None:
    """What a CPP stage sends on (``hidden_bytes``, padded to a stream slot) is what the
    next stage's ``run`` takes, extra rows ignored; the result equals passing tensors."""
    engine = LLMEngine(engine_config(llama_ref.path))
    (tokens,) = prompts(8, [40], llama_ref.vocab_size)
    expected, _ = pipeline(engine, 2, tokens, chunk=40)
    first, second = (
        StageExecutor(engine.runner.model, engine.kv_layout, s, 16)
        for s in LayerSlice.split(engine.model_config.num_layers, 2)
    )
    for ex in (first, second):
        ex.start("b", tokens)
    out = first.run("b", tokens, 0)
    raw = first.hidden_bytes(out, 48)
    assert isinstance(raw, memoryview)
    assert raw.nbytes == 48 * first.hidden_size * first.dtype.itemsize
    assert bytes(raw[out.numel() * first.dtype.itemsize :]) == bytes(raw.nbytes - out.nbytes)
    assert torch.equal(second.run("b", tokens, 0, raw), expected)
    with pytest.raises(HalfmoonError, match="hidden states"):
        second.run("b", tokens, 0, raw[: 10 * first.hidden_size * first.dtype.itemsize])
