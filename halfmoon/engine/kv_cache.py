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

Host and device: the pool lives on the engine's device, but everything a
:class:`KVCache` hands out (``layer_blocks``, ``export_blocks``, the bytes of
:func:`host_bytes`) is in host memory, and everything it takes (``import_blocks``,
``import_payloads``) may be host memory: the copies to and from the device happen here,
in :func:`to_host` and ``.to(pool.device)``. On the CPU both are no-ops, so the views that
were zero-copy stay zero-copy; on a GPU they are synchronous copies (the caller may reuse
or free its buffer as soon as the call returns).
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Sequence
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


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory: ``t`` itself when it already is (no copy), else a synchronous
    device -> host copy."""
    return t if t.device.type == "cpu" else t.to("cpu")


def host_bytes(t: torch.Tensor) -> memoryview:
    """The row-major bytes of ``t`` in host memory: a view without a copy for a contiguous
    CPU tensor, one device -> host copy for a device tensor. The view keeps its memory
    alive; for a view into a pool, the pool's owner says how long the values stay valid."""
    flat = to_host(t.detach()).contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def from_bytes(data: bytes | bytearray | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A flat CPU tensor of ``dtype`` over ``data``, without a copy. Read-only buffers
    (``bytes``) are fine: the engine only reads what it is given."""
    raw = memoryview(data).cast("B")
    if raw.nbytes == 0:
        return torch.empty(0, dtype=dtype)
    with warnings.catch_warnings():
        # torch warns that a read-only buffer gives a tensor it cannot protect from writes.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(raw, dtype=dtype)


def trim_heap() -> bool:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``): a pool
    that the allocator carved out of its free lists, as a long-running process's may be,
    goes back to them when freed, not to the system. Whether any memory went back (False
    too where the C library has no such call)."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    return bool(trim(0))


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
        # Each layer's views, made once: indexing the pool costs ~8 us a view, and a decode
        # step asks for two per layer (30 layers of SmolLM2: ~0.5 ms of a 40 ms step).
        self._views = [(self.pool[i, 0], self.pool[i, 1]) for i in range(layout.num_layers)]
        rows = (-1, layout.num_kv_heads, layout.head_dim)
        self._slot_views = [(k.view(rows), v.view(rows)) for k, v in self._views]
        #: The pool's bytes while its memory is released (:meth:`release`), else 0, and
        #: where each of its tensors lay in it.
        self._released_bytes = 0
        self._layout_of_views: list[tuple[int, torch.Size, tuple[int, ...]]] = []

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

    @property
    def released(self) -> bool:
        """Whether the pool's memory is released (:meth:`release`)."""
        return self._released_bytes > 0

    def _tensors(self) -> list[torch.Tensor]:
        """The pool and every view made of it (what :meth:`release` re-points)."""
        return [self.pool, *(t for pair in (*self._views, *self._slot_views) for t in pair)]

    def release(self) -> int:
        """Free the pool's memory (what its blocks held is lost): the pool and its views
        stay, empty, until :meth:`restore`; the bytes freed, 0 when released already.
        Until then every method here that reads or writes blocks raises HalfmoonError.
        (The tensors are re-pointed, not their storage resized: a storage whose bytes
        were once lent to a reader as a numpy array cannot be resized. Such a reader
        still alive keeps the old memory until it lets go.)"""
        if self.released:
            return 0
        self._layout_of_views = [(t.storage_offset(), t.size(), t.stride())
                                 for t in self._tensors()]  # fmt: skip
        self._released_bytes = self.pool.untyped_storage().nbytes()
        with torch.inference_mode(self.pool.is_inference()):
            empty = torch.empty(0, dtype=self.pool.dtype, device=self.pool.device)
            for tensor in self._tensors():
                tensor.set_(empty)
        if self.pool.device.type == "cuda":
            torch.cuda.empty_cache()  # (back to the device, not only to torch's cache)
        else:
            trim_heap()
        return self._released_bytes

    def restore(self) -> None:
        """The pool's memory again after :meth:`release`, zero-filled (the same tensor and
        views, at a new address)."""
        if not self.released:
            return
        with torch.inference_mode(self.pool.is_inference()):
            element = self.pool.element_size()
            fresh = torch.zeros(self._released_bytes // element, dtype=self.pool.dtype,
                                device=self.pool.device).untyped_storage()  # fmt: skip
            for tensor, (offset, size, stride) in zip(
                self._tensors(), self._layout_of_views, strict=True
            ):
                tensor.set_(fresh, offset, size, stride)
        self._released_bytes = 0

    def _held(self) -> None:
        if self.released:
            raise HalfmoonError("the KV pool's memory is released (the engine sleeps)")

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(K, V)`` of one layer, each ``[num_blocks, block_size, H_kv, D]``."""
        self._held()
        return self._views[layer]

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same views flat over slots, each ``[num_blocks * block_size, H_kv, D]``:
        row ``block * B + offset`` is one token's K (V)."""
        self._held()
        return self._slot_views[layer]

    def layer_blocks(self, layer: int, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)`` of ``block_ids`` in one layer, ``[n, block_size, H_kv, D]`` each, in
        host memory: on the CPU, views into the pool when the ids are consecutive and
        gathered copies otherwise; on a device, copies to the host."""
        keys, values = self.layer(layer)
        if block_ids and block_ids == list(range(block_ids[0], block_ids[0] + len(block_ids))):
            first, last = block_ids[0], block_ids[-1] + 1
            return to_host(keys[first:last]), to_host(values[first:last])
        index = torch.tensor(block_ids, dtype=torch.long, device=self.pool.device)
        return to_host(keys.index_select(0, index)), to_host(values.index_select(0, index))

    def layer_bytes(self, layer: int, block_ids: list[int]) -> tuple[list, list]:
        """Host byte views of one layer's K blocks and V blocks ``block_ids`` (one
        ``memoryview`` per block): zero copy for a CPU pool's consecutive blocks, valid
        while their owner holds the blocks; copies otherwise."""
        keys, values = self.layer_blocks(layer, block_ids)
        return [host_bytes(k) for k in keys], [host_bytes(v) for v in values]

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        self._held()
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise HalfmoonError(f"block ids out of range [0, {self.num_blocks}): {bad[:5]}")
        return torch.tensor(block_ids, dtype=torch.long, device=self.pool.device)

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A new contiguous host tensor ``[L, 2, n, B, H_kv, D]`` with the blocks' KV (one
        copy; on a device, a gather there and one copy to the host)."""
        return to_host(self.pool[:, :, self._index(block_ids)])

    def export_bytes(self, block_ids: list[int]) -> memoryview:
        """:meth:`export_blocks` as host bytes (no further copy)."""
        return host_bytes(self.export_blocks(block_ids))

    def import_blocks(self, block_ids: list[int], data: torch.Tensor | bytes | memoryview) -> None:
        """Write an export buffer (tensor in the pool's dtype on any device, or raw host
        bytes) into ``block_ids``.

        Raw bytes are viewed without a copy (:func:`from_bytes`) and copied once into the
        pool (on a device: synchronously, so the buffer may be freed when this returns).
        """
        shape = self.layout.buffer_shape(len(block_ids))
        expected_bytes = len(block_ids) * self.layout.bytes_per_block
        if not isinstance(data, torch.Tensor):
            data = from_bytes(data, torch.uint8)
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

    def import_payloads(
        self, block_ids: list[int], payloads: Sequence[bytes | bytearray | memoryview]
    ) -> None:
        """Write one-block export buffers of the whole model (host bytes
        ``[L, 2, 1, B, H_kv, D]`` each, what a block store holds) into ``block_ids``, one
        payload per block, copying each once; a pool of a layer slice keeps its layers."""
        if len(payloads) != len(block_ids):
            raise HalfmoonError(f"{len(payloads)} KV payloads for {len(block_ids)} blocks")
        self._index(block_ids)  # range check before anything is written
        first, last, total = self.payload_layers()
        block_shape = self.layout.buffer_shape(1)[1:]  # [2, 1, B, H_kv, D]
        expected_bytes = total * self.layout.bytes_per_block // self.layout.num_layers
        for block, payload in zip(block_ids, payloads, strict=True):
            data = from_bytes(payload, torch.uint8)
            if data.numel() != expected_bytes:
                raise HalfmoonError(
                    f"a KV payload holds {data.numel()} bytes; a block of the "
                    f"{total}-layer model has {expected_bytes}"
                )
            full = data.view(self.pool.dtype).view(total, *block_shape)
            self.pool[:, :, block] = full[first:last, :, 0].to(self.pool.device)

    def import_encoded(self, block_id: int, payload: memoryview, codec: Any) -> None:
        """Decode ``payload``, ``codec``'s encoding (a
        :class:`~halfmoon.engine.kvcodec.KVCodec`) of a one-block export buffer of the
        whole model, straight into block ``block_id`` (no buffer in between where the
        pool is on the host and holds every layer; else through one)."""
        self._index([block_id])
        first, last, total = self.payload_layers()
        if self.pool.device.type == "cpu" and (first, last) == (0, total):
            codec.decode_into(payload, self.pool[:, :, block_id])
            return
        raw = total * self.layout.bytes_per_block // self.layout.num_layers
        buffer = torch.empty(raw, dtype=torch.uint8)
        codec.decode(payload, memoryview(buffer.numpy()))
        self.import_payloads([block_id], [memoryview(buffer.numpy())])

    def payload_layers(self) -> tuple[int, int, int]:
        """``(first, last, total)``: this pool holds layers ``first..last-1`` of a
        ``total``-layer model (all of them here)."""
        return 0, self.layout.num_layers, self.layout.num_layers


def export_to_bytes(data: torch.Tensor) -> memoryview:
    """The host bytes of an export buffer (:func:`host_bytes`: zero copy for a contiguous
    CPU tensor)."""
    return host_bytes(data)
