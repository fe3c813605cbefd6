"""The paged KV pool and its export / import byte layout.

One tensor holds every layer's keys and values::

    pool[layer, kind, block, slot, kv_head, dim]      kind 0 = K, 1 = V
         L      2     N      B     H_kv     D

A token at position ``p`` of a sequence lives in block ``table[p // B]``, slot ``p % B``,
so the flat slot index ``block * B + slot`` addresses one ``[H_kv, D]`` row of
``pool[l, k].view(-1, H_kv, D)``.

Export layout, version 1 (what the store and transfer engine move): the blocks of one
sequence, *layer-major*, K before V, blocks in table order, each block ``[B, H_kv, D]``
row-major in the pool's dtype, native (little-endian) byte order::

    buffer = [ L0.K.b0 L0.K.b1 ... L0.V.b0 L0.V.b1 ... L1.K.b0 ... ]

i.e. exactly ``pool[:, :, block_ids]`` made contiguous, shape ``[L, 2, n, B, H_kv, D]``;
``KVLayout.bytes_per_block`` is the size of one block across all layers and both kinds.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

from halfmoon.core.errors import HalfmoonError

#: Version of the export layout above; bump it when the byte order changes.
KV_LAYOUT_VERSION = 1

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (``float32``, ``bfloat16``, ``float16``)."""
    try:
        return _DTYPES[name]
    except KeyError:
        raise HalfmoonError(f"unknown dtype {name!r}; choose from {', '.join(_DTYPES)}") from None


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV of one block; travels with exported buffers so the importer can
    check it holds the same model's KV in the same layout version."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    version: int = KV_LAYOUT_VERSION

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one K or V element."""
        return torch.empty((), dtype=torch_dtype(self.dtype)).element_size()

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies: all layers, K and V."""
        per_kind = self.block_size * self.num_kv_heads * self.head_dim * self.bytes_per_element
        return self.num_layers * 2 * per_kind

    def buffer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of an export buffer holding ``num_blocks`` blocks."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        """A JSON/msgpack-friendly form."""
        return {
            "version": self.version,
            "num_layers": self.num_layers,
            "block_size": self.block_size,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)

    def check_compatible(self, other: KVLayout) -> None:
        """Raise :class:`HalfmoonError` naming the first field where ``other`` differs."""
        for name in ("version", "num_layers", "block_size", "num_kv_heads", "head_dim", "dtype"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise HalfmoonError(
                    f"KV layout mismatch: {name} is {theirs}, this engine has {mine}"
                )


class KVCache:
    """The KV block pool of one engine (see the module docstring for the layout)."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: str | torch.device = "cpu"):
        if num_blocks < 1:
            raise HalfmoonError(f"the KV pool needs at least one block, got {num_blocks}")
        self.layout = layout
        self.num_blocks = num_blocks
        # Zero-filled, not empty: padded decode attention reads unused slots (masked out),
        # and masked garbage NaNs would still poison the softmax-weighted sum.
        self.pool = torch.zeros(
            layout.buffer_shape(num_blocks), dtype=torch_dtype(layout.dtype), device=device
        )

    @classmethod
    def from_budget(
        cls, layout: KVLayout, kv_cache_mb: float, device: str | torch.device = "cpu"
    ) -> KVCache:
        """A pool of as many blocks as ``kv_cache_mb`` MiB hold."""
        num_blocks = int(kv_cache_mb * 2**20) // layout.bytes_per_block
        if num_blocks < 1:
            raise HalfmoonError(
                f"--kv-cache-mb {kv_cache_mb} holds no block; one block needs "
                f"{layout.bytes_per_block / 2**20:.3f} MiB"
            )
        return cls(layout, num_blocks, device)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(K, V)`` of one layer, each ``[num_blocks, block_size, H_kv, D]``."""
        return self.pool[layer, 0], self.pool[layer, 1]

    def layer_blocks(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)`` of ``block_ids`` in one layer, ``[n, block_size, H_kv, D]`` each:
        views into the pool when the ids are consecutive, gathered copies otherwise."""
        keys, values = self.layer(layer)
        if block_ids and block_ids == list(range(block_ids[0], block_ids[0] + len(block_ids))):
            first, last = block_ids[0], block_ids[-1] + 1
            return keys[first:last], values[first:last]
        index = torch.tensor(block_ids, dtype=torch.long, device=self.pool.device)
        return keys.index_select(0, index), values.index_select(0, index)

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise HalfmoonError(f"block ids out of range [0, {self.num_blocks}): {bad[:5]}")
        return torch.tensor(block_ids, dtype=torch.long, device=self.pool.device)

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A new contiguous tensor ``[L, 2, n, B, H_kv, D]`` with the blocks' KV (one copy)."""
        return self.pool[:, :, self._index(block_ids)]

    def import_blocks(self, block_ids: list[int], data: torch.Tensor | bytes | memoryview) -> None:
        """Write an export buffer (tensor in the pool's dtype or raw bytes) into ``block_ids``.

        Raw bytes are viewed without a copy (``torch.frombuffer``) and copied once into the pool.
        """
        shape = self.layout.buffer_shape(len(block_ids))
        expected_bytes = len(block_ids) * self.layout.bytes_per_block
        if not isinstance(data, torch.Tensor):
            with warnings.catch_warnings():
                # Read-only buffers (bytes) are fine: the pool copy below only reads them.
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(memoryview(data).cast("B"), dtype=torch.uint8)
        num_bytes = data.numel() * data.element_size()
        if num_bytes != expected_bytes:
            raise HalfmoonError(
                f"KV buffer holds {num_bytes} bytes; {len(block_ids)} blocks need {expected_bytes}"
            )
        if data.dtype == torch.uint8:
            data = data.reshape(-1).view(self.pool.dtype)
        if data.dtype != self.pool.dtype:
            raise HalfmoonError(
                f"KV buffer dtype {data.dtype} differs from the pool's {self.pool.dtype}"
            )
        self.pool[:, :, self._index(block_ids)] = data.reshape(shape).to(self.pool.device)


def export_to_bytes(data: torch.Tensor) -> memoryview:
    """The bytes of an export buffer (zero-copy for a contiguous CPU tensor)."""
    flat = data.detach().contiguous().cpu().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())
