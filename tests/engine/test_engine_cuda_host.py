"""The engine's host/device boundary on a GPU: what the serving side gets from the engine
(exported KV, the layer hook's K/V and byte views, a stage's hidden states) is host
memory, and what it gives (bytes from a transfer or a store, hidden states) may be host
memory; the engine moves it. Skipped where torch sees no CUDA device.

``HALFMOON_TEST_DEVICE=cpu`` runs the same checks with the engine on the CPU (a dry run
of the tests themselves on a machine without a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch
from engine_testlib import Reference, engine_config
from test_engine_reference import hf_logits

from halfmoon.core.request import SamplingParams
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.kv_cache import export_to_bytes
from halfmoon.engine.sampling import row_for, sample_with_logprobs
from halfmoon.engine.stage import LayerSlice, StageExecutor

DEVICE = os.environ.get("HALFMOON_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE.startswith("cuda") and not torch.cuda.is_available(), reason="needs a CUDA device"
)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    """TF32 would move fp32 logits by ~1e-3: keep them comparable with the CPU's."""
    if not torch.cuda.is_available():
        yield
        return
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.device.type == "cpu"
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3 * theirs.abs().max().item())


def test_exported_kv_is_host_memory_and_bytes_import_on_any_device(
    llama_ref: Reference, prompts
) -> None:
    (prompt,) = prompts(40, [45], llama_ref.vocab_size)
    (reference,) = LLMEngine(engine_config(llama_ref.path)).generate([prompt], GREEDY)
    prefill = LLMEngine(engine_config(llama_ref.path, device=DEVICE))
    assert prefill.kv_cache.pool.device.type == torch.device(DEVICE).type
    prefill.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0), keep_kv=True)
    (first,) = prefill.step()
    handoff = prefill.export_kv("r")
    assert handoff.data.device.type == "cpu" and handoff.data.is_contiguous()
    raw = export_to_bytes(handoff.data)  # what a transfer delivers
    assert raw.nbytes == 3 * prefill.kv_bytes_per_block
    for device in (DEVICE, "cpu"):
        decode = LLMEngine(engine_config(llama_ref.path, device=device))
        as_bytes = type(handoff)(**{**handoff.__dict__, "data": bytes(raw)})
        decode.import_request(as_bytes, GREEDY)
        outs = []
        while decode.has_unfinished_requests():
            outs += decode.step()
        assert outs[-1].token_ids == reference.token_ids, device
        decode.check_integrity()
    assert first.token_ids == reference.token_ids[:1]
    prefill.check_integrity()


def test_layer_hook_kv_and_byte_views_are_host_memory(llama_ref: Reference, prompts) -> None:
    seen: list[tuple[int, object, torch.Tensor, torch.Tensor, list, list]] = []

    def hook(request_id: str, layer: int, block_ids: list[int], kv) -> None:
        keys, values = engine.kv_cache.layer_bytes(layer, block_ids)  # what a prefill sends
        seen.append((layer, kv, kv.key, kv.value, [bytes(k) for k in keys], values))

    engine = LLMEngine(
        engine_config(llama_ref.path, device=DEVICE, prefill_chunk_tokens=16), kv_layer_hook=hook
    )
    (prompt,) = prompts(41, [40], llama_ref.vocab_size)
    engine.add_request("a", prompt, SamplingParams(max_tokens=1), keep_kv=True)
    while engine.has_unfinished_requests():
        engine.step()
    exported = engine.export_kv("a").data  # [L, 2, n, B, H, D], host
    block = engine.kv_layout.block_size
    assert len(seen) == 3 * engine.model_config.num_layers  # 3 chunks x layers
    for layer, kv, key, value, key_bytes, value_views in seen:
        assert key.device.type == "cpu" and value.device.type == "cpu"
        base = (kv.start_token // block) * block
        rows = slice(kv.start_token - base, kv.end_token - base)
        tokens = slice(kv.start_token, kv.end_token)
        assert torch.equal(key.flatten(0, 1)[rows], exported[layer, 0].flatten(0, 1)[tokens])
        assert torch.equal(value.flatten(0, 1)[rows], exported[layer, 1].flatten(0, 1)[tokens])
        assert all(isinstance(v, memoryview) for v in value_views)
        assert key_bytes == [bytes(export_to_bytes(k)) for k in key]
    engine.check_integrity()


def test_stage_takes_host_hidden_states_and_store_payloads(llama_ref: Reference, prompts) -> None:
    """A 2-stage pipeline on the device, fed the way a CPP worker feeds it: prefix blocks
    as store payloads, hidden states as padded host bytes; then the first token."""
    engine = LLMEngine(engine_config(llama_ref.path, device=DEVICE))
    (tokens,) = prompts(42, [60], llama_ref.vocab_size)
    engine.generate([tokens[:40]], SamplingParams(max_tokens=1))
    hits = engine.block_manager.match_prefix(tokens)
    assert len(hits) == 2
    payloads = [bytes(engine.kv_cache.export_bytes([b])) for b in hits]  # what the store holds
    stages = [
        StageExecutor(engine.runner.model, engine.kv_layout, s, 16)
        for s in LayerSlice.split(engine.model_config.num_layers, 2)
    ]
    for ex in stages:
        ex.start("r", tokens)
        ex.load_prefix("r", payloads)
        ex.commit("r", tokens, 32)
    chunk, finals = 16, []
    for lo in range(32, len(tokens), chunk):
        piece = tokens[lo : lo + chunk]
        hidden = stages[0].run("r", piece, lo)
        sent = stages[0].hidden_bytes(hidden, chunk)  # a whole stream slot, host bytes
        assert isinstance(sent, memoryview) and sent.nbytes == chunk * hidden[0].nbytes
        finals.append(stages[1].run("r", piece, lo, sent))
        for ex in stages:
            ex.commit("r", tokens, lo + len(piece))
    logits = stages[1].logits(torch.cat(finals))
    _close(logits.cpu(), hf_logits(llama_ref, tokens)[32:])
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2)
    row = row_for(params, 0, 0, (), tokens)
    (token,), (entry,) = sample_with_logprobs(logits[-1:], [row], [2])
    (out,) = engine.generate([tokens], params)
    assert out.token_ids == (token,) and entry is not None and len(entry.top) == 2


def test_sampling_penalties_bias_and_logprobs_on_the_device() -> None:
    vocab = 50
    logits = 3 * torch.randn(3, vocab, generator=torch.Generator().manual_seed(3))
    history = tuple(range(5, 25)) + (7, 7, 9)
    params = [
        SamplingParams(max_tokens=9, temperature=0.0, presence_penalty=0.5,
                       frequency_penalty=0.3, repetition_penalty=1.3, logprobs=3),
        SamplingParams(max_tokens=9, temperature=0.0, logit_bias=((11, 40.0), (12, -5.0)),
                       min_tokens=5),
        SamplingParams(max_tokens=9, temperature=0.8, top_k=10, top_p=0.9, seed=4,
                       repetition_penalty=0.7, logit_bias=((3, 2.0),), logprobs=0),
    ]  # fmt: skip
    rows = [row_for(p, 4, 3, (1, 2), history) for p in params]
    num_top = [p.logprobs for p in params]
    on_cpu = sample_with_logprobs(logits.clone(), rows, num_top)
    on_device = sample_with_logprobs(logits.to(DEVICE), rows, num_top)
    assert on_device[0] == on_cpu[0]
    assert on_cpu[0][1] == 11  # the bias took effect
    for ours, theirs in zip(on_device[1], on_cpu[1], strict=True):
        assert (ours is None) == (theirs is None)
        if ours is not None:
            assert abs(ours.logprob - theirs.logprob) < 1e-4
            assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
