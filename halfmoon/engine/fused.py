"""One compiled call per decoder layer for the attention half of a decode-only step.

Between a layer's q|k|v projection and its output projection, a decode step does:
split q|k|v and apply RoPE (the compiled glue), write the new K and V into the paged
pool (two ``index_copy_``), and run the paged decode-attention kernel
(:mod:`halfmoon.engine.kernels`) over the pool. At batch 1 that is four dispatches and a
few views per layer for very little arithmetic: SmolLM2's step spends ~11 ms of ~40
outside its matrix multiplies, where vLLM, whose one-row matmuls stream the weights as
fast as ours, spends ~7 (docs/benchmarks.md, #20).

:class:`FusedDecodeAttention` is those steps as one exported module, AOT-compiled like
the kernel into one package per attention shape. It updates the pool in place: the
exported program mutates its ``keys`` / ``values`` inputs, and the compiled code writes
the new rows straight into them (measured: one row into a 300 MB pool, 14 us a call,
no copy). The math is the eager reference's (:func:`halfmoon.engine.glue.split_and_rotate`,
the same scatter, :class:`halfmoon.engine.kernels.PagedDecodeAttention`); compiled, it
differs by float rounding only. Used on the CPU for decode-only steps whenever the
compiled kernel and glue are (see :func:`select_fused_decode`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from halfmoon.engine.glue import split_and_rotate
from halfmoon.engine.kernels import (
    CompiledPiece,
    KernelShape,
    PagedDecodeAttention,
    Recipe,
    example_inputs,
    package_key,
)
from halfmoon.engine.packages import PackageSpec, failure_reason

logger = logging.getLogger(__name__)

#: Bump when the fused module's code or signature changes.
FUSED_VERSION = 1

#: ``(qkv, cos, sin, keys, values, slot_mapping, block_tables, context_lens, scale)`` ->
#: the attention output ``[S, H * D]``; writes the step's K/V into ``keys`` / ``values``.
FusedDecode = Callable[..., torch.Tensor]


class FusedDecodeAttention(nn.Module):
    """RoPE + pool write + paged decode attention (runnable eagerly: tests compare it).

    ``qkv`` ``[S, (H + 2 H_kv) D]`` (one row per sequence), ``cos`` / ``sin`` ``[S, 1, D]``,
    ``keys`` / ``values`` one layer of the pool ``[N, B, H_kv, D]`` (written in place at
    ``slot_mapping`` ``[S]``, flat slots ``block * B + offset``), then as
    :class:`~halfmoon.engine.kernels.PagedDecodeAttention` (whose ``context_lens``
    include the new token). Returns the attention output ``[S, H * D]`` and the rotated
    ``q`` ``[S, H, D]``: as an output of the compiled program q is computed once into a
    buffer, where otherwise inductor folded RoPE into the score loop and redid it for
    every key (batch 1 x 2,048: 0.90x the separate calls, instead of faster).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.attention = PagedDecodeAttention()

    def forward(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = split_and_rotate(qkv, cos, sin, h, h_kv, d)
        block_size = keys.shape[1]
        # Indexing the pool itself (not a flat view of it): the exported program then
        # mutates the input, which the compiled code does in place.
        where = (slot_mapping // block_size, slot_mapping % block_size)
        keys.index_put_(where, k)
        values.index_put_(where, v)
        num_seqs = qkv.shape[0]
        qg = q.view(num_seqs, h_kv, h // h_kv, d)
        out = self.attention(qg, keys, values, block_tables, context_lens, scale)
        return out.reshape(num_seqs, h * d), q


def uses_fused(shape: KernelShape) -> bool:
    """Whether an engine running the compiled kernel of ``shape`` also fuses (the CPU)."""
    return shape.device == "cpu"


def fused_key(shape: KernelShape) -> str:
    """File-name key of the fused package for ``shape`` (versions and source included)."""
    spec = shape.spec()
    return package_key(
        f"fused-decode-{spec}-{shape.device}", f"v{FUSED_VERSION}-{spec}", shape.device
    )


def _example_inputs(shape: KernelShape) -> tuple[torch.Tensor, ...]:
    """The kernel's export inputs (its size hints) plus a q|k|v row, RoPE tables and
    a new slot per sequence."""
    q, keys, values, tables, lens, scale = example_inputs(shape)
    num_seqs, h_kv, d = q.shape[0], shape.num_kv_heads, shape.head_dim
    width = (h_kv * shape.group + 2 * h_kv) * d
    slots = torch.randperm(keys.shape[0] * shape.block_size)[:num_seqs].to(q.device)
    row = torch.randn(num_seqs, 1, d).to(q.device, q.dtype)
    qkv = torch.randn(num_seqs, width).to(q.device, q.dtype)
    return qkv, row, row.clone(), keys, values, slots, tables, lens, scale


def fused_recipe(shape: KernelShape) -> Recipe:
    """:class:`FusedDecodeAttention` for ``shape``: its example inputs and dynamic sizes."""
    dim = torch.export.Dim
    seqs, blocks, pool = dim("num_seqs", min=1), dim("max_blocks", min=1), dim("pool", min=1)
    per_seq = {0: seqs}
    dynamic = (per_seq, per_seq, per_seq, {0: pool}, {0: pool}, per_seq,
               {0: seqs, 1: blocks}, per_seq, {})  # fmt: skip
    module = FusedDecodeAttention(shape.num_kv_heads * shape.group, shape.num_kv_heads,
                                  shape.head_dim)  # fmt: skip
    # Planned for many threads, like the kernel: a batch of one splits over blocks.
    return Recipe(module, _example_inputs(shape), dynamic, 32)


def fused_decode_piece(shape: KernelShape) -> CompiledPiece:
    """The fused call of ``shape`` as a compiled piece."""
    return CompiledPiece(fused_key(shape), lambda: fused_recipe(shape))


def fused_decode_spec(shape: KernelShape) -> PackageSpec:
    """The fused package of ``shape`` (see :func:`halfmoon.engine.packages.build_missing`)."""
    return fused_decode_piece(shape).package()


def load_fused_decode(shape: KernelShape, directory: Path | None = None) -> FusedDecode:
    """The compiled fused call for ``shape`` (from the cache, built first when missing, or
    compiled in process). Raises on failure."""
    return fused_decode_piece(shape).load_function(directory)


def select_fused_decode(shape: KernelShape) -> FusedDecode | None:
    """The fused call for a CPU engine that runs the compiled kernel and glue; None (the
    separate calls) on other devices, or with a warning when it cannot be built."""
    if not uses_fused(shape):
        return None
    try:
        return load_fused_decode(shape)
    except Exception as exc:  # noqa: BLE001 - a compiler problem must not stop serving
        logger.warning("fused decode attention unavailable (%s); using separate calls",
                       failure_reason(exc))  # fmt: skip
        return None
