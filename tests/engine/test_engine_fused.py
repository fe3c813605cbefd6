"""The fused decode call (RoPE + pool write + paged attention, one compiled package per
layer call) against the separate steps it replaces."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_kernels import SHAPE, needs_compiler, random_case

from halfmoon.core.request import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.fused import FusedDecodeAttention, load_fused_decode
from halfmoon.engine.glue import split_and_rotate
from halfmoon.engine.kernels import KernelShape, PagedDecodeAttention


def fused_case(seed: int, lengths: list[int], shape: KernelShape):
    """A random pool and tables (as the kernel tests'), one q|k|v row per sequence, its
    RoPE tables, and each sequence's new slot: its last position."""
    _, keys, values, group, tables = random_case(seed, lengths, shape)
    gen = torch.Generator().manual_seed(1000 + seed)
    num_heads = shape.num_kv_heads * shape.group
    width = (num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    qkv = torch.randn(len(lengths), width, generator=gen).to(shape.dtype)
    angles = torch.rand(len(lengths), 1, shape.head_dim // 2, generator=gen) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(shape.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(shape.dtype)
    bs = shape.block_size
    slots = torch.tensor([tables[i, (n - 1) // bs] * bs + (n - 1) % bs
                          for i, n in enumerate(lengths)])  # fmt: skip
    return qkv, cos, sin, keys, values, slots, tables, group.context_lens


def separate_steps(qkv, cos, sin, keys, values, slots, tables, lens, shape: KernelShape):
    """What a layer did before: split + RoPE, two index_copy_ into the pool, the kernel."""
    num_heads = shape.num_kv_heads * shape.group
    q, k, v = split_and_rotate(qkv, cos, sin, num_heads, shape.num_kv_heads, shape.head_dim)
    flat = (-1, shape.num_kv_heads, shape.head_dim)
    keys.view(flat).index_copy_(0, slots, k)
    values.view(flat).index_copy_(0, slots, v)
    qg = q.view(q.shape[0], shape.num_kv_heads, shape.group, shape.head_dim)
    scale = torch.tensor(shape.head_dim**-0.5)
    out = PagedDecodeAttention()(qg, keys, values, tables, lens, scale)
    return out.reshape(q.shape[0], -1)


CASES = [[1], [16], [17, 5, 48, 33, 1], [200] * 3 + [7] * 29, [511, 3]]


def run_both(fused, seed: int, lengths: list[int], shape: KernelShape):
    """(fused output, its pool) and (separate steps' output, their pool) of one case."""
    case = fused_case(seed, lengths, shape)
    qkv, cos, sin, keys, values, slots, tables, lens = case
    want_keys, want_values = keys.clone(), values.clone()
    want = separate_steps(qkv, cos, sin, want_keys, want_values, slots, tables, lens, shape)
    scale = torch.tensor(shape.head_dim**-0.5)
    got = fused(qkv, cos, sin, keys, values, slots, tables, lens, scale)
    if isinstance(got, tuple):  # the eager module also returns the rotated q
        got = got[0]
    return (got, keys, values), (want, want_keys, want_values)


def test_eager_fused_math_is_the_separate_steps_exactly() -> None:
    shape = KernelShape(3, 3, 32, 8, torch.float32, "cpu")
    module = FusedDecodeAttention(9, 3, 32)
    for seed, lengths in enumerate(CASES):
        (got, keys, values), (want, want_keys, want_values) = run_both(module, seed, lengths, shape)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


@needs_compiler
def test_compiled_fused_call_writes_the_pool_in_place_and_matches() -> None:
    fused = load_fused_decode(SHAPE)
    for seed, lengths in enumerate(CASES * 2):
        before = fused_case(50 + seed, lengths, SHAPE)[3].clone()
        (got, keys, values), (want, want_keys, want_values) = run_both(
            fused, 50 + seed, lengths, SHAPE
        )
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # The new rows went into the caller's pool (a view with a storage offset), with
        # RoPE's rounding only; nothing else in it changed.
        torch.testing.assert_close(keys, want_keys, atol=1e-5, rtol=1e-5)
        assert torch.equal(values, want_values)  # V is copied as it is
        changed = (keys != before).any(-1).any(-1).sum().item()
        assert 0 < changed <= len(lengths)


@needs_compiler
def test_an_engine_with_the_fused_call_generates_the_separate_calls_tokens(
    tiny_dir: Path,
) -> None:
    """Same greedy tokens with and without the fused call, sequences of different
    lengths joining a running batch (decode-only and mixed steps both occur)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), attention="compiled", kv_cache_mb=2.0,
                                    max_num_batched_tokens=96))  # fmt: skip
    assert engine.runner.fused_decode is not None
    assert engine.attention_backend.endswith(", fused decode attention")
    prompts = [[(11 * i + 5 * j) % 4000 + 5 for j in range(7 + 17 * i)] for i in range(5)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    fused = [list(o.token_ids) for o in engine.generate(prompts, params)]
    engine.runner.fused_decode = None
    separate = [list(o.token_ids) for o in engine.generate(prompts, params)]
    engine.check_integrity()
    assert fused == separate


@pytest.mark.parametrize("attention", ["reference"])
def test_the_reference_path_has_no_fused_call(tiny_dir: Path, attention: str) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_dir), attention=attention, kv_cache_mb=2.0))
    assert engine.runner.fused_decode is None
    assert "fused" not in engine.attention_backend
