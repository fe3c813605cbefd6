"""The engine on a CUDA device (skipped where torch sees none)."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import Reference, engine_config

from halfmoon.core.request import SamplingParams
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.runner import LOGITS_ALL, ChunkInput

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cuda_prefill_logits_match_transformers(reference: Reference, prompts) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = LLMEngine(engine_config(reference.path, device="cuda"))
    (tokens,) = prompts(30, [40], reference.vocab_size)
    engine.block_manager.admit("a", tokens, 40)
    chunk = ChunkInput("a", tokens, 0, engine.block_manager.block_table("a"), LOGITS_ALL)
    ours = engine.runner.execute([chunk])[0].cpu()
    with torch.no_grad():
        theirs = reference.hf_model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3 * theirs.abs().max().item())
    engine.block_manager.free("a")
    engine.check_integrity()


def test_cuda_greedy_and_handoff_match_cpu(reference: Reference, prompts) -> None:
    batch = prompts(31, [9, 33, 50], reference.vocab_size)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cpu = LLMEngine(engine_config(reference.path)).generate(batch, params)
    gpu_engine = LLMEngine(engine_config(reference.path, device="cuda"))
    gpu = gpu_engine.generate(batch, params)
    assert [o.token_ids for o in gpu] == [o.token_ids for o in cpu]
    gpu_engine.add_request(
        "r", batch[1], SamplingParams(max_tokens=1, temperature=0.0), keep_kv=True
    )
    gpu_engine.step()
    handoff = gpu_engine.export_kv("r")
    cpu_engine = LLMEngine(engine_config(reference.path))
    cpu_engine.import_request(handoff, params)
    while cpu_engine.has_unfinished_requests():
        outs = cpu_engine.step()
    assert outs[-1].token_ids == cpu[1].token_ids
    gpu_engine.check_integrity()
    cpu_engine.check_integrity()


def test_cuda_compiled_attention_gives_the_reference_tokens(reference: Reference, prompts) -> None:
    """The compiled decode kernel and glue on the GPU (Triton; compiled in process where
    torch is older than 2.13), with and without CUDA graphs: the reference path's greedy
    tokens. ``auto`` keeps the reference on a GPU until this has passed on one."""
    torch.backends.cuda.matmul.allow_tf32 = False
    batch = prompts(32, [9, 33, 50], reference.vocab_size)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref_engine = LLMEngine(engine_config(reference.path, device="cuda", attention="reference"))
    want = [o.token_ids for o in ref_engine.generate(batch, params)]
    for graphs in (False, True):
        engine = LLMEngine(
            engine_config(reference.path, device="cuda", attention="compiled", cuda_graphs=graphs)
        )
        assert engine.attention_backend.startswith("compiled"), engine.attention_backend
        assert ", compiled glue" in engine.attention_backend
        assert [o.token_ids for o in engine.generate(batch, params)] == want, graphs
        engine.check_integrity()
        if graphs:
            assert engine.runner.decode_graphs is not None
            assert engine.runner.decode_graphs.num_replays > 0
