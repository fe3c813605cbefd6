"""Decode steps replayed from graphs (halfmoon/engine/graphs.py) against eager steps.

On the CPU the buckets' plumbing (static inputs, padding rows, block-table padding, the
logits handed back) runs with a capture that replays by calling the recorded forward
again on the bucket's static inputs, which is what a CUDA graph's replay computes; the
last test runs the real CUDA-graph capture where torch sees a GPU.
"""

from __future__ import annotations

import logging

import pytest
import torch
from engine_testlib import Reference, engine_config

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.graphs import DecodeGraphs, buckets


def rerun(forward):
    """A capture whose replay recomputes the forward from the static inputs."""
    forward()  # the warm-up run, as the CUDA capture does
    return forward


def attach_graphs(engine: LLMEngine, capture=rerun) -> DecodeGraphs:
    blocks = -(-engine.max_model_len // engine.config.block_size)
    graphs = DecodeGraphs(
        engine.runner.model, engine.kv_cache, engine.config.max_num_seqs, blocks,
        engine.runner.decode_kernel, capture,
    )  # fmt: skip
    engine.runner.decode_graphs = graphs
    return graphs


def staggered_run(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Greedy tokens of three requests of different lengths, the third arriving after a
    few steps: decode batches of 1, 2 and 3 sequences, and mixed prefill + decode steps."""
    lengths = {"a": 14, "b": 9, "c": 6}
    tokens: dict[str, list[int]] = {}

    def add(rid: str, prompt: list[int]) -> None:
        params = SamplingParams(max_tokens=lengths[rid], temperature=0.0, ignore_eos=True)
        engine.add_request(rid, prompt, params)

    add("a", prompts[0])
    add("b", prompts[1])
    steps = 0
    while engine.has_unfinished_requests() or "c" not in tokens:
        if steps == 4:
            add("c", prompts[2])
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = list(out.token_ids)
        steps += 1
    engine.check_integrity()
    return tokens


def test_buckets_are_powers_of_two_up_to_the_limit() -> None:
    assert buckets(1) == (1,)
    assert buckets(5) == (1, 2, 4, 8)
    assert buckets(64) == (1, 2, 4, 8, 16, 32, 64)


def test_graph_steps_give_the_eager_tokens(llama_ref: Reference, prompts) -> None:
    batch = prompts(41, [9, 40, 23], llama_ref.vocab_size)
    eager = staggered_run(LLMEngine(engine_config(llama_ref.path)), batch)
    engine = LLMEngine(engine_config(llama_ref.path))
    graphs = attach_graphs(engine)
    assert graphs.bucket_for(3, 3) == (4, 4)
    assert graphs.bucket_for(engine.config.max_num_seqs + 1, 1) is None
    replayed = staggered_run(engine, batch)
    assert replayed == eager
    assert graphs.disabled_reason is None
    # Batches of 1, 2 and 3 sequences (3 padded to 4), contexts up to 4 blocks of 16.
    assert {n for n, _ in graphs._buckets} >= {1, 2, 4}
    assert graphs.num_replays >= 14 - 1 - 2  # every decode-only step, a few mixed ones not


def test_graph_logits_match_an_eager_step(llama_ref: Reference, prompts) -> None:
    """One decode step of three sequences (padded to four) in both ways: the same logits
    up to float rounding, and the padding rows leave the pool as the eager step does."""
    from halfmoon.engine.runner import ChunkInput

    batch = prompts(42, [17, 5, 33], llama_ref.vocab_size)
    engines = [LLMEngine(engine_config(llama_ref.path)) for _ in range(2)]
    graphs = attach_graphs(engines[1])
    results = []
    for engine in engines:
        chunks = []
        for i, tokens in enumerate(batch):
            rid = f"r{i}"
            engine.block_manager.admit(rid, tokens, len(tokens) + 1)
            table = engine.block_manager.block_table(rid)
            engine.runner.execute([ChunkInput(rid, tokens[:-1], 0, table)])  # the prompt
            chunks.append(ChunkInput(rid, tokens[-1:], len(tokens) - 1, table))
        logits = torch.cat(engine.runner.execute(chunks))
        results.append((logits, engine.kv_cache.pool.clone()))
    assert graphs.num_replays == 1 and list(graphs._buckets) == [(4, 4)]
    (eager_logits, eager_pool), (graph_logits, graph_pool) = results
    assert graph_logits.shape == eager_logits.shape == (3, llama_ref.vocab_size)
    torch.testing.assert_close(graph_logits, eager_logits, rtol=0, atol=1e-5)
    torch.testing.assert_close(graph_pool, eager_pool, rtol=0, atol=1e-5)


def test_a_failed_capture_switches_graphs_off_and_steps_eagerly(
    llama_ref: Reference, prompts, caplog
) -> None:
    def broken(forward):
        raise RuntimeError("operation not permitted when stream is capturing")

    batch = prompts(43, [9, 40, 23], llama_ref.vocab_size)
    eager = staggered_run(LLMEngine(engine_config(llama_ref.path)), batch)
    engine = LLMEngine(engine_config(llama_ref.path))
    graphs = attach_graphs(engine, broken)
    with caplog.at_level(logging.WARNING, logger="halfmoon.engine.graphs"):
        assert staggered_run(engine, batch) == eager
    assert graphs.disabled_reason == (
        "RuntimeError: operation not permitted when stream is capturing"
    )
    assert graphs.num_replays == 0
    assert "CUDA graph capture failed" in caplog.text


def test_cuda_graphs_need_a_cuda_device() -> None:
    with pytest.raises(HalfmoonError, match="needs a cuda device"):
        EngineConfig(cuda_graphs=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_on_a_gpu_give_the_eager_tokens(llama_ref: Reference, prompts) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    batch = prompts(44, [9, 40, 23], llama_ref.vocab_size)
    eager = staggered_run(LLMEngine(engine_config(llama_ref.path, device="cuda")), batch)
    engine = LLMEngine(engine_config(llama_ref.path, device="cuda", cuda_graphs=True))
    assert engine.attention_backend.endswith("CUDA graphs for decode")
    assert staggered_run(engine, batch) == eager
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.disabled_reason is None
    assert graphs.num_captured >= 3 and graphs.num_replays >= 10
