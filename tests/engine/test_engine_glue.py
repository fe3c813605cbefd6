"""The decoder layer's elementwise glue: eager is the old math exactly, compiled matches it."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from halfmoon.core.errors import HalfmoonError
from halfmoon.engine import glue
from halfmoon.engine.glue import EAGER_GLUE, GlueShape, load_glue, select_glue
from halfmoon.engine.loader import preset_config
from halfmoon.engine.model import RMSNorm
from halfmoon.engine.rope import apply_rope

needs_compiler = pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++")), reason="no C++ compiler to build glue"
)

#: The tiny preset's shape, which the engine tests compile too (one build per machine).
TINY = preset_config("tiny")
SHAPE = GlueShape(
    TINY.hidden_size, TINY.intermediate_size, TINY.num_heads, TINY.num_kv_heads, TINY.head_dim,
    TINY.rms_norm_eps, torch.float32, "cpu",
)  # fmt: skip


def rows(seed: int, num_tokens: int, width: int) -> torch.Tensor:
    return torch.randn(num_tokens, width, generator=torch.Generator().manual_seed(seed))


def norm_module(seed: int) -> RMSNorm:
    norm = RMSNorm(SHAPE.hidden_size, SHAPE.eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * rows(seed, 1, SHAPE.hidden_size)[0])
    return norm


def rope_inputs(seed: int, num_tokens: int):
    width = (SHAPE.num_heads + 2 * SHAPE.num_kv_heads) * SHAPE.head_dim
    angles = rows(seed + 1, num_tokens, SHAPE.head_dim).unsqueeze(1) * 3
    return rows(seed, num_tokens, width), angles.cos(), angles.sin()


def test_eager_glue_is_the_plain_math_bit_for_bit() -> None:
    x, residual = rows(0, 5, SHAPE.hidden_size), rows(1, 5, SHAPE.hidden_size)
    norm = norm_module(2)
    normed, total = EAGER_GLUE.add_rms_norm(x, residual, norm)
    assert torch.equal(total, x + residual)
    assert torch.equal(normed, F.rms_norm(x + residual, norm.weight.shape, norm.weight, SHAPE.eps))
    qkv, cos, sin = rope_inputs(3, 7)
    heads, kv_heads, dim = SHAPE.num_heads, SHAPE.num_kv_heads, SHAPE.head_dim
    q, k, v = EAGER_GLUE.rope_split(qkv, cos, sin, heads, kv_heads, dim)
    qk = apply_rope(qkv[:, : (heads + kv_heads) * dim].view(7, -1, dim), cos, sin)
    assert torch.equal(q, qk[:, :heads]) and torch.equal(k, qk[:, heads:])
    assert torch.equal(v, qkv[:, (heads + kv_heads) * dim :].view(7, kv_heads, dim))
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    gate_up = rows(4, 3, 2 * SHAPE.intermediate_size)
    gate, up = gate_up[:, : SHAPE.intermediate_size], gate_up[:, SHAPE.intermediate_size :]
    assert torch.equal(EAGER_GLUE.silu_mul(gate_up), F.silu(gate) * up)


@needs_compiler
def test_compiled_glue_matches_the_eager_glue() -> None:
    compiled = load_glue(SHAPE)
    assert compiled.description == "compiled"
    dims = (SHAPE.num_heads, SHAPE.num_kv_heads, SHAPE.head_dim)
    for seed, num_tokens in enumerate([1, 2, 5, 33, 300]):
        x, residual = rows(seed, num_tokens, SHAPE.hidden_size), rows(seed + 50, num_tokens, 256)
        norm = norm_module(seed)
        for got, want in zip(
            compiled.add_rms_norm(x, residual, norm),
            EAGER_GLUE.add_rms_norm(x, residual, norm),
            strict=True,
        ):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        qkv, cos, sin = rope_inputs(seed + 100, num_tokens)
        for got, want in zip(
            compiled.rope_split(qkv, cos, sin, *dims),
            EAGER_GLUE.rope_split(qkv, cos, sin, *dims),
            strict=True,
        ):
            assert got.shape == want.shape and got.is_contiguous()
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        gate_up = rows(seed + 200, num_tokens, 2 * SHAPE.intermediate_size)
        torch.testing.assert_close(
            compiled.silu_mul(gate_up), EAGER_GLUE.silu_mul(gate_up), atol=1e-6, rtol=1e-5
        )


def test_auto_falls_back_to_eager_and_compiled_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(shape: GlueShape, directory: Path | None = None) -> glue.Glue:
        raise RuntimeError("C++ compile error: g++ not found")

    monkeypatch.setattr(glue, "load_glue", broken)
    assert select_glue("auto", SHAPE) is EAGER_GLUE
    with pytest.raises(HalfmoonError, match="compiled glue is unavailable.*g\\+\\+"):
        select_glue("compiled", SHAPE)


@needs_compiler
def test_in_bfloat16_the_compiled_glue_is_the_eager_glue_bit_for_bit() -> None:
    """Compiled with inductor's ``emulate_precision_casts``, the glue rounds each
    intermediate where the eager ops do: in bfloat16 its results are the eager ones
    exactly (without it, 20-30% of the elements differ by a rounding, and over 30 layers
    SmolLM2's first two answer tokens to "What is the capital of France?" tied, so that
    the compiled path answered "L'Étoile..." where the eager one, transformers and vLLM
    say "The capital of France is Paris.")."""
    shape = dataclasses.replace(SHAPE, dtype=torch.bfloat16)
    compiled = load_glue(shape)
    dims = (shape.num_heads, shape.num_kv_heads, shape.head_dim)
    for seed, num_tokens in enumerate([1, 5, 33]):
        x = rows(seed, num_tokens, shape.hidden_size).bfloat16()
        residual = rows(seed + 50, num_tokens, shape.hidden_size).bfloat16()
        norm = norm_module(seed).to(torch.bfloat16)
        got, want = (
            compiled.add_rms_norm(x, residual, norm),
            EAGER_GLUE.add_rms_norm(x, residual, norm),
        )
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        qkv, cos, sin = (t.bfloat16() for t in rope_inputs(seed + 100, num_tokens))
        got, want = (
            compiled.rope_split(qkv, cos, sin, *dims),
            EAGER_GLUE.rope_split(qkv, cos, sin, *dims),
        )
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        gate_up = rows(seed + 200, num_tokens, 2 * shape.intermediate_size).bfloat16()
        assert torch.equal(compiled.silu_mul(gate_up), EAGER_GLUE.silu_mul(gate_up))
