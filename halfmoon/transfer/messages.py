"""Small frozen messages of the transfer engine, and the block-metadata wire codec."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from halfmoon.store.meta import BlockMeta, trusted_meta
from halfmoon.transfer.errors import ProtocolError
from halfmoon.transfer.protocol import hash_to_wire

_U32_MAX = 2**32 - 1


@dataclass(frozen=True)
class TransferCompleted:
    """Receiver-side notification: a push, a put or a stream fully arrived.

    ``kind`` is ``"push"``, ``"put"`` or ``"stream"``; ``transfer_id`` the push/put id or
    the stream session id; ``peer`` the sender's address.
    """

    kind: str
    transfer_id: str
    peer: str
    num_blocks: int
    num_bytes: int


CompletionListener = Callable[[TransferCompleted], None]


class PutBlock(NamedTuple):
    """One block to store remotely: hash, payload (``block_bytes``), metadata, position
    (a tuple: a put makes one per block, and a tuple costs less than half a frozen
    dataclass to build)."""

    block_hash: int
    payload: Any
    meta: BlockMeta
    position: int = 0


def meta_to_wire(meta: BlockMeta) -> list[Any]:
    """``BlockMeta`` as a msgpack-friendly list (the parent hash as 16 bytes)."""
    return [meta.num_tokens, hash_to_wire(meta.parent_hash), meta.layout_version]


def meta_from_wire(raw: Any) -> BlockMeta:
    """Inverse of :func:`meta_to_wire`; :class:`ProtocolError` when malformed."""
    try:
        num_tokens, parent, layout = raw
        return _meta(num_tokens, parent, layout)
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed block metadata on the wire: {exc}") from exc


def _meta(num_tokens: Any, parent: Any, layout: Any) -> BlockMeta:
    """One wire metadata entry, every range checked here (then built unchecked: this is
    per block on both sides of every store batch). ``ValueError`` / ``TypeError`` /
    :class:`ProtocolError` when malformed."""
    if type(parent) is not bytes or len(parent) != 16:
        raise ProtocolError("a parent hash on the wire must be 16 bytes")
    if type(num_tokens) is not int or not 0 <= num_tokens <= _U32_MAX:
        raise ValueError(f"num_tokens {num_tokens!r} is not in [0, 2**32)")
    if type(layout) is not int or not 0 <= layout <= 0xFFFF:
        raise ValueError(f"layout_version {layout!r} is not in [0, 65535]")
    return trusted_meta(num_tokens, int.from_bytes(parent, "little"), layout)


def put_items_to_wire(blocks: Sequence[PutBlock]) -> list[list[Any]]:
    """The blocks' ``[hash, meta, position]`` entries as a put request carries them
    (:func:`hash_to_wire` and :func:`meta_to_wire` inlined: this is per block)."""
    out = []
    for b in blocks:
        meta = b.meta
        parent = meta.parent_hash.to_bytes(16, "little")
        wire_meta = [meta.num_tokens, parent, meta.layout_version]
        out.append([b.block_hash.to_bytes(16, "little"), wire_meta, b.position])
    return out


def put_items_from_wire(blocks: Any) -> list[tuple[int, BlockMeta, int]]:
    """A put request's ``[hash, meta, position]`` entries as ``(hash, BlockMeta,
    position)``, in one loop (this is most of a put's decoding on the server's critical
    path). :class:`ProtocolError` when an entry is malformed."""
    out = []
    from_bytes, meta = int.from_bytes, _meta
    try:
        for raw_hash, (num_tokens, parent, layout), position in blocks:
            if type(raw_hash) is not bytes or len(raw_hash) != 16:
                raise ProtocolError("a block hash on the wire must be 16 bytes")
            if type(position) is not int:
                raise ValueError(f"position {position!r} is not an integer")
            out.append((from_bytes(raw_hash, "little"), meta(num_tokens, parent, layout), position))
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed block in a put request: {exc}") from exc
    return out
