"""vLLM's paged KV layout as halfmoon's connector sees it, and the check that refuses
layouts it does not move.

vLLM hands the connector one tensor per attention layer (``register_kv_caches``). Its
shape is the attention backend's: the CPU backend's is ``[num_blocks, kv_heads,
block_size, 2 * head_size]`` (a block is contiguous), FlashAttention's ``[2, num_blocks,
block_size, kv_heads, head_size]`` (a block is two strided halves). The connector treats a
block of a layer as the sub-tensor at one index of the *block dimension* (the one of size
``num_blocks``): its bytes, in vLLM's own element order, are the unit on the wire (one
``(layer, block)`` of a stream) and, concatenated over the layers, one block of the store.
Both ends must therefore run the same layout; :attr:`PagedLayout.fingerprint` names it,
and a stream or a stored block of another fingerprint is refused.
"""

from __future__ import annotations

import hashlib
import re
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


class UnsupportedLayout(ValueError):
    """A vLLM configuration whose KV the connector cannot move (the message names it)."""


def check_config(vllm_config: Any, kv_cache_config: Any, hash_block_size: int) -> None:
    """Refuse what the connector does not support, naming the mismatch: latent (MLA)
    attention, a quantized KV cache, blocks that are not whole halfmoon blocks, more than
    one KV-cache group (hybrid / sliding-window models), tensor or pipeline parallelism."""
    model, cache, parallel = (
        vllm_config.model_config,
        vllm_config.cache_config,
        vllm_config.parallel_config,
    )
    problems = []
    if model is not None and getattr(model, "use_mla", False):
        problems.append("the model uses MLA (latent KV), whose cache is not per-head K and V")
    dtype = str(getattr(cache, "cache_dtype", "auto"))
    if dtype != "auto":
        problems.append(
            f"--kv-cache-dtype {dtype}: quantized KV caches are not supported (use auto)"
        )
    block_size = int(cache.block_size or 0)
    if block_size <= 0 or block_size % hash_block_size:
        problems.append(
            f"vLLM's block size {block_size} is not a multiple of halfmoon's hash block size "
            f"{hash_block_size}"
        )
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) > 1:
        problems.append(
            f"the model has {len(groups)} KV-cache groups (hybrid or sliding-window "
            "attention); only one full-attention group is supported"
        )
    elif groups:
        spec = type(groups[0].kv_cache_spec).__name__
        if spec != "FullAttentionSpec":
            problems.append(f"KV-cache spec {spec}: only FullAttentionSpec is supported")
    tp = int(getattr(parallel, "tensor_parallel_size", 1))
    pp = int(getattr(parallel, "pipeline_parallel_size", 1))
    if tp > 1 or pp > 1:
        problems.append(f"tensor/pipeline parallel size {tp}/{pp}: only 1/1 is supported")
    if problems:
        raise UnsupportedLayout("halfmoon's KV connector refuses this vLLM: " + "; ".join(problems))


def _layer_index(name: str) -> int:
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    if not numbers:
        raise UnsupportedLayout(f"cannot tell the layer index of KV cache {name!r}")
    return int(numbers[0])


@dataclass(frozen=True)
class PagedLayout:
    """The registered KV tensors: layer names in model order, the block dimension, and
    the bytes of one (layer, block)."""

    layer_names: tuple[str, ...]
    block_dim: int
    block_shape: tuple[int, ...]
    dtype: str
    num_blocks: int
    block_size: int

    @classmethod
    def of(
        cls, kv_caches: dict[str, torch.Tensor], num_blocks: int, block_size: int
    ) -> PagedLayout:
        """The layout of ``register_kv_caches``' tensors; refuses mixed shapes or dtypes."""
        if not kv_caches:
            raise UnsupportedLayout("vLLM registered no KV cache tensors")
        names = tuple(sorted(kv_caches, key=_layer_index))
        shapes = {tuple(t.shape) for t in kv_caches.values()}
        dtypes = {t.dtype for t in kv_caches.values()}
        if len(shapes) != 1 or len(dtypes) != 1:
            raise UnsupportedLayout(
                f"KV tensors differ across layers (shapes {sorted(shapes)}, dtypes {sorted(map(str, dtypes))})"
            )
        shape = shapes.pop()
        dims = [d for d in (0, 1) if d < len(shape) and shape[d] == num_blocks]
        if not dims:
            raise UnsupportedLayout(
                f"no dimension of the KV tensor {shape} has the pool's {num_blocks} blocks"
            )
        dim = dims[0]
        block_shape = shape[:dim] + shape[dim + 1 :]
        return cls(
            names,
            dim,
            block_shape,
            str(dtypes.pop()).removeprefix("torch."),
            num_blocks,
            block_size,
        )

    @property
    def num_layers(self) -> int:
        """Attention layers with a KV cache."""
        return len(self.layer_names)

    @property
    def layer_block_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return (
            int(np.prod(self.block_shape))
            * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over every layer (one block of the store)."""
        return self.num_layers * self.layer_block_bytes

    @property
    def fingerprint(self) -> str:
        """Names this layout: equal fingerprints can exchange blocks byte for byte."""
        text = (
            f"{self.num_layers}|{self.block_dim}|{self.block_shape}|{self.dtype}|{self.block_size}"
        )
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def store_version(self) -> int:
        """The ``BlockMeta.layout_version`` of this layout's blocks in a store (never 1,
        halfmoon's own engine layout, so neither side reads the other's blocks)."""
        return 0x8000 | (int(self.fingerprint, 16) & 0x7FFF)


def block_view(tensor: torch.Tensor, layout: PagedLayout, block: int) -> torch.Tensor:
    """One block of one layer (a view; strided on backends whose block is not contiguous)."""
    return tensor.select(layout.block_dim, block)


def read_block(tensor: torch.Tensor, layout: PagedLayout, block: int) -> memoryview:
    """The bytes of one block of one layer: a view of the pool when contiguous on the CPU,
    else a contiguous host copy."""
    view = block_view(tensor, layout, block)
    if view.device.type != "cpu" or not view.is_contiguous():
        view = view.contiguous().cpu()
    return memoryview(view.view(torch.uint8).numpy()).cast("B")


def write_block(tensor: torch.Tensor, layout: PagedLayout, block: int, data: Any) -> None:
    """Write ``data`` (``layer_block_bytes``, vLLM's element order) into one block of one layer."""
    with warnings.catch_warnings():  # a read-only payload is only ever read here
        warnings.simplefilter("ignore", UserWarning)
        src = torch.frombuffer(data, dtype=torch.uint8)
    if src.numel() != layout.layer_block_bytes:
        raise ValueError(
            f"block payload of {src.numel()} bytes, expected {layout.layer_block_bytes}"
        )
    dst = block_view(tensor, layout, block)
    dst.copy_(src.view(dst.dtype).view(dst.shape), non_blocking=False)


def write_blocks(tensor: torch.Tensor, layout: PagedLayout, blocks: list[int], data: Any) -> None:
    """Write ``data`` (``len(blocks)`` payloads of ``layer_block_bytes`` back to back) into
    those blocks of one layer, in one indexed copy."""
    with warnings.catch_warnings():  # a read-only payload is only ever read here
        warnings.simplefilter("ignore", UserWarning)
        src = torch.frombuffer(data, dtype=torch.uint8)
    if src.numel() != len(blocks) * layout.layer_block_bytes:
        raise ValueError(
            f"{src.numel()} bytes for {len(blocks)} blocks of {layout.layer_block_bytes}"
        )
    values = src.view(tensor.dtype).view(len(blocks), *layout.block_shape)
    index = torch.tensor(blocks, dtype=torch.long, device=tensor.device)
    tensor.index_copy_(
        layout.block_dim, index, values.movedim(0, layout.block_dim).to(tensor.device)
    )
