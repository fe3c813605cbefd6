"""The elementwise work between a decoder layer's matrix multiplies, eager or compiled.

A decode step at small batch is a chain of small ops: per layer a residual add and an
RMS norm before each half, RoPE on q and k, slicing q|k|v apart. Each op costs an eager
dispatch (5-40 us: ``F.rms_norm`` on one 576-float row measured 20-40 us), which at
batch 1 is as much as the arithmetic of the whole layer. :class:`Glue` bundles the three
pieces that cost most:

- ``add_rms_norm(x, residual, norm)`` -> ``(norm(x + residual), x + residual)``: the
  residual add fused with the next norm (the layer passes its residual stream along
  un-added, as vLLM's layers do);
- ``rope_split(qkv, cos, sin)`` -> ``(q, k, v)``: q|k|v split and RoPE applied to q and k,
  each returned contiguous (``q`` ``[T, H, D]``, ``k`` / ``v`` ``[T, H_kv, D]``);
- ``silu_mul(gate_up)`` -> ``silu(gate) * up``: the SwiGLU between the MLP's matmuls
  (eager, on the strided halves of gate|up, it is slow at every size: 2,048 rows of the
  small preset 31 -> 4.5 ms compiled, 8 rows 148 -> 20 us).

:data:`EAGER_GLUE` is the exact-math reference (the same ops as before, bit for bit).
:func:`load_glue` AOT-compiles all three (:mod:`halfmoon.engine.kernels`' package cache;
one package each per model shape, batch dynamic; ~17 s each to build, once): one call of
~12 us each. Measured on one 576-wide row: add + norm 45 -> 12 us. The compiled math
differs from the eager by float rounding only (the norm's reduction order); in
bfloat16 / float16 it is the eager math bit for bit (``emulate_precision_casts``, see
:func:`halfmoon.engine.kernels.inductor_options`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.kernels import CompiledPiece, Recipe, package_key
from halfmoon.engine.packages import PackageSpec, failure_reason
from halfmoon.engine.rope import apply_rope

logger = logging.getLogger(__name__)

#: Bump when the compiled glue's code or signature changes.
GLUE_VERSION = 2


class AddRMSNorm(nn.Module):
    """``(weight * rms_norm(x + residual), x + residual)``, the norm in float32."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + residual
        x32 = total.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * normed.to(x.dtype), total


class SiluMul(nn.Module):
    """``silu(gate) * up`` of the fused gate|up rows."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """The math of ``silu_mul`` (eager and exported alike)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RopeSplit(nn.Module):
    """q|k|v rows split into heads, RoPE on q and k; all three contiguous."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def forward(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return split_and_rotate(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)


def split_and_rotate(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The math of ``rope_split`` (eager and exported alike)."""
    num_tokens = qkv.shape[0]
    qk_dim = (num_heads + num_kv_heads) * head_dim
    # RoPE on q and k together (one set of elementwise kernels instead of two).
    qk = apply_rope(qkv[:, :qk_dim].view(num_tokens, -1, head_dim), cos, sin)
    q = qk[:, :num_heads].contiguous()
    k = qk[:, num_heads:].contiguous()
    v = qkv[:, qk_dim:].reshape(num_tokens, num_kv_heads, head_dim).contiguous()
    return q, k, v


AddNormFn = Callable[[torch.Tensor, torch.Tensor, nn.Module], tuple[torch.Tensor, torch.Tensor]]
#: ``(qkv, cos, sin, num_heads, num_kv_heads, head_dim) -> (q, k, v)``.
RopeSplitFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Glue:
    """The decoder layer's fused elementwise steps (see the module docstring)."""

    add_rms_norm: AddNormFn
    rope_split: RopeSplitFn
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    description: str


def _eager_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + residual
    return norm(total), total


#: The exact-math reference: the model's own norm modules and eager RoPE.
EAGER_GLUE = Glue(_eager_add_rms_norm, split_and_rotate, silu_mul, "eager")


@dataclass(frozen=True)
class GlueShape:
    """What one model's glue packages are specialised for."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    dtype: torch.dtype
    device: str

    def key(self, part: str) -> str:
        """File-name key of ``part`` (``add-rms-norm``, ``rope-split``, ``silu-mul``)."""
        dtype = str(self.dtype).removeprefix("torch.")
        spec = (
            f"v{GLUE_VERSION}-{part}-{self.hidden_size}-{self.intermediate_size}-"
            f"{self.num_heads}x{self.num_kv_heads}x{self.head_dim}-eps{self.eps!r}-{dtype}"
        )
        return package_key(
            f"glue-{part}-{self.hidden_size}-{dtype}-{self.device}", spec, self.device
        )


def _add_rms_norm_recipe(shape: GlueShape) -> Recipe:
    device = torch.device(shape.device)
    rows = torch.randn(8, shape.hidden_size).to(device, shape.dtype)
    weight = torch.randn(shape.hidden_size).to(device, shape.dtype)
    tokens = torch.export.Dim("num_tokens", min=1)
    dynamic = ({0: tokens}, {0: tokens}, {})
    return Recipe(AddRMSNorm(shape.eps), (rows, rows.clone(), weight), dynamic)


def _rope_split_recipe(shape: GlueShape) -> Recipe:
    device = torch.device(shape.device)
    width = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    qkv = torch.randn(8, width).to(device, shape.dtype)
    cos = torch.randn(8, 1, shape.head_dim).to(device, shape.dtype)
    tokens = torch.export.Dim("num_tokens", min=1)
    dynamic = ({0: tokens}, {0: tokens}, {0: tokens})
    module = RopeSplit(shape.num_heads, shape.num_kv_heads, shape.head_dim)
    return Recipe(module, (qkv, cos, cos.clone()), dynamic)


def _silu_mul_recipe(shape: GlueShape) -> Recipe:
    device = torch.device(shape.device)
    gate_up = torch.randn(8, 2 * shape.intermediate_size).to(device, shape.dtype)
    tokens = torch.export.Dim("num_tokens", min=1)
    return Recipe(SiluMul(), (gate_up,), ({0: tokens},))


def glue_pieces(shape: GlueShape) -> list[CompiledPiece]:
    """The three glue steps of ``shape`` (norm, rope, silu) as compiled pieces."""
    return [
        CompiledPiece(shape.key("add-rms-norm"), lambda: _add_rms_norm_recipe(shape)),
        CompiledPiece(shape.key("rope-split"), lambda: _rope_split_recipe(shape)),
        CompiledPiece(shape.key("silu-mul"), lambda: _silu_mul_recipe(shape)),
    ]


def glue_specs(shape: GlueShape) -> list[PackageSpec]:
    """The three glue packages of ``shape`` (see
    :func:`halfmoon.engine.packages.build_missing`)."""
    return [piece.package() for piece in glue_pieces(shape)]


def load_glue(shape: GlueShape, directory: Path | None = None) -> Glue:
    """The glue steps compiled for ``shape`` (built once and cached like the kernels, or
    compiled in process: :func:`halfmoon.engine.kernels.compile_mode`). Raises on any
    failure."""
    norm_run, rope_run, silu_run = (piece.load(directory) for piece in glue_pieces(shape))

    def add_rms_norm(
        x: torch.Tensor, residual: torch.Tensor, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        normed, total = norm_run([x, residual, norm.weight])
        return normed, total

    def rope_split(
        qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *_dims: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = rope_run([qkv, cos, sin])
        return q, k, v

    def compiled_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        return silu_run([gate_up])[0]

    return Glue(add_rms_norm, rope_split, compiled_silu_mul, "compiled")


def select_glue(backend: str, shape: GlueShape) -> Glue:
    """The glue for attention backend ``backend`` once its compiled kernel is in use:
    compiled when it builds or loads; else (``auto``) eager with a warning naming the
    reason, or (``compiled``) an error."""
    try:
        return load_glue(shape)
    except Exception as exc:  # noqa: BLE001 - a compiler problem must not stop serving
        reason = failure_reason(exc)
        if backend == "compiled":
            raise HalfmoonError(f"the compiled glue is unavailable: {reason}") from exc
        logger.warning("compiled glue unavailable (%s); using the eager ops", reason)
        return EAGER_GLUE
