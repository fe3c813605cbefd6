"""Helpers of the engine tests: reference checkpoints written by transformers itself.

Weights use a large initializer range (0.2) and random norm weights and biases, so a
wrong position, mask, bias or norm mapping moves the logits far beyond the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.runner import LOGITS_ALL, ChunkInput

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Reference:
    """A checkpoint directory and transformers' own model of it."""

    name: str
    path: Path
    hf_model: torch.nn.Module
    vocab_size: int


def build_reference(name: str, out_dir: Path) -> Reference:
    import transformers

    common = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        tie_word_embeddings=False,
        eos_token_id=2,
        bos_token_id=1,
    )
    if name == "llama":
        config = transformers.LlamaConfig(
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
            },
            **common,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    elif name == "mistral":
        config = transformers.MistralConfig(rope_theta=20000.0, sliding_window=None, **common)
        model = transformers.MistralForCausalLM(config)
    else:
        config = transformers.Qwen2Config(rope_theta=5000.0, **common)
        model = transformers.Qwen2ForCausalLM(config)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
            elif pname.endswith(".bias"):
                param.copy_(0.5 * torch.randn(param.shape, generator=generator))
    model.eval()
    model.save_pretrained(out_dir)
    return Reference(name, out_dir, model, common["vocab_size"])


def engine_config(model: Path | str, **overrides: object) -> EngineConfig:
    """A small-pool engine config for tests."""
    fields: dict[str, object] = dict(
        model=str(model), block_size=BLOCK_SIZE, kv_cache_mb=4.0, num_threads=None
    )
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]


def random_prompt(generator: torch.Generator, length: int, vocab_size: int) -> list[int]:
    """``length`` random token ids (avoiding the special ids 0..3)."""
    return torch.randint(4, vocab_size, (length,), generator=generator).tolist()


def assert_logits_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    # 1e-4 of the logit scale: fp32 reorderings stay ~1e-6; a position, mask or weight
    # mix-up moves logits by O(1).
    scale = theirs.abs().max().item()
    assert scale > 1.0, "reference logits too flat to catch bugs"
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4 * scale)


def prefill(engine: LLMEngine, rid: str, tokens: list[int], chunk_sizes: list[int]) -> torch.Tensor:
    """Prefill ``tokens`` in chunks through the runner; all positions' logits."""
    assert engine.block_manager.admit(rid, tokens, chunk_sizes[0]) == 0
    outs, start = [], 0
    for size in chunk_sizes:
        assert engine.block_manager.grow(rid, start + size)
        chunk = ChunkInput(rid, tokens[start : start + size], start,
                           engine.block_manager.block_table(rid), LOGITS_ALL)  # fmt: skip
        outs.append(engine.runner.execute([chunk])[0])
        start += size
        engine.block_manager.commit(rid, tokens, start)
    assert start == len(tokens)
    return torch.cat(outs)
