"""Store requests of one connection: puts (inline, or placed through shared memory) and
pulls (inline, or read in place from the store's shared DRAM arena).

Placed puts take two round trips so the client can copy straight into reserved slots::

    PUT_RESERVE {xfer, blocks, block_bytes}  ->  PUT_SLOTS {xfer, segment, slots}
        slot: an offset >= 0 in the shared segment (place it there), -1 present,
        -2 send it inline
    (client copies the blocks with an offset into the segment)
    PUT_COMMIT {xfer} + inline payloads  ->  PUT_ACK {stored}

Pulls take one round trip, plus a RELEASE when blocks are read in place::

    PULL {xfer, hashes, direct, block_bytes}  ->  PULL_REPLY {xfer, items, segment} + inline
        item: [False] missing, [True, meta] inline, [True, meta, offset] in place
        (at ``offset`` in the shared ``segment``, leased until the client's RELEASE)

Reserved slots of an unfinished put are aborted when the connection ends. A pull of a
block the store lacks may be served by the engine's fallback reader
(:meth:`~halfmoon.transfer.engine.TransferEngine.set_store_fallback`: a prefill worker
whose blocks reach its store only when its pool evicts them reads the others from the
pool), always inline. A tcp client that can decode may get its blocks encoded by the
engine's pull encoder (``set_pull_encoder``: compressed KV), each with its size.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from halfmoon.core.buffers import uninitialized
from halfmoon.store import BlockMeta, PendingPut, StoreError, TieredStore
from halfmoon.transfer.errors import RemoteError, TransferError
from halfmoon.transfer.link import Link
from halfmoon.transfer.messages import (
    TransferCompleted,
    meta_to_wire,
    put_items_from_wire,
)
from halfmoon.transfer.protocol import Frame, Kind, hash_from_wire, hashes_from_wire

if TYPE_CHECKING:
    from halfmoon.transfer.server import TransferServer

#: ``reader(block_hash, dest)``: copy a block the store lacks into ``dest`` (the store's
#: block size) and return its metadata, or None when it has none either.
StoreFallback = Callable[[int, memoryview], BlockMeta | None]
#: ``encode(block) -> payload``: a pulled block as it goes on the wire (compressed KV),
#: in new memory (the block's buffer is reused for the next one).
PullEncoder = Callable[[memoryview], memoryview]
#: ``decode(payload, dest)``: a :data:`PullEncoder`'s payload back into ``dest``.
PullDecoder = Callable[[memoryview, memoryview], None]
#: PUT_SLOTS entries other than an offset in the shared segment (one int per block: a
#: list of small ints costs a fraction of per-block lists on both sides).
SLOT_PRESENT, SLOT_INLINE = -1, -2
#: Inline pulls up to this size are copied out under the store lock instead of pinned.
_COPY_PULL_MAX_BYTES = 256 << 10
#: A co-located client's pull up to this size comes inline too: for a few small blocks the
#: extra RELEASE message and the lease cost more than copying through the socket.
_DIRECT_INLINE_MAX_BYTES = 64 << 10


class EncodedBlocks:
    """Pulled blocks as the pull encoder wrote them, kept for the next pull of the same
    block (at most ``max_bytes`` of payloads, the least recently used dropped first).

    A block's hash names its content, so a kept payload stays right for as long as it is
    kept, whatever the store does with the block meanwhile; a prefix that many workers
    pull (a shared system prompt) is encoded once instead of once per pull. Shared by
    the server's connection threads."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self._items: OrderedDict[int, tuple[list[Any], memoryview]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, block_hash: int) -> tuple[list[Any], memoryview] | None:
        """``(meta on the wire, payload)`` of a kept block, or None."""
        with self._lock:
            found = self._items.get(block_hash)
            if found is None:
                self.misses += 1
                return None
            self._items.move_to_end(block_hash)
            self.hits += 1
            return found

    def put(self, block_hash: int, wire_meta: list[Any], payload: memoryview) -> None:
        """Keep ``payload`` (never written again) for ``block_hash``."""
        size = payload.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(block_hash, None)
            if old is not None:
                self.bytes -= old[1].nbytes
            while self._items and self.bytes + size > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self.bytes -= dropped.nbytes
            self._items[block_hash] = (wire_meta, payload)
            self.bytes += size

    def clear(self) -> None:
        """Forget every kept payload."""
        with self._lock:
            self._items.clear()
            self.bytes = 0


class StoreSession:
    """Executes one connection's store requests against its server's store (and its
    fallback reader and pull encoder, read at each request: they may be set later)."""

    def __init__(self, link: Link, server: TransferServer, deadline: Callable[[], float]) -> None:
        self._link = link
        self._server = server
        self._store = server.require_store
        self._deadline = deadline
        self._on_complete = server.on_complete
        self._reserved: dict[str, list[PendingPut | None]] = {}
        self._leases: dict[str, int] = {}
        self._scratch = memoryview(bytearray(0))  # reused by small inline pulls

    def _begin(self, store: TieredStore, blocks: list[list[Any]]) -> list[PendingPut | None]:
        """Reserve a slot per block (None: already stored); all or nothing."""
        return store.begin_puts(put_items_from_wire(blocks))

    def _finish(
        self,
        store: TieredStore,
        xfer: str,
        frame: Frame,
        pendings: list[PendingPut | None],
        inline: list[memoryview],
    ) -> None:
        """Receive the inline payloads, commit every reservation, ack and notify."""
        try:
            self._link.recv_payload_into(frame, inline, self._deadline())
        except TransferError:
            _abort(store, pendings)
            if self._link.closed:
                raise
            raise RemoteError(f"put {xfer} failed its checksum; nothing stored") from None
        stored = store.commit_puts(pendings)
        self._link.send(Kind.PUT_ACK, {"xfer": xfer, "stored": stored}, deadline=self._deadline())
        if self._on_complete is not None:
            num_bytes = len(pendings) * store.block_bytes
            self._on_complete(
                TransferCompleted("put", xfer, self._link.peer, len(pendings), num_bytes)
            )

    def on_put(self, frame: Frame) -> None:
        """All block bytes inline in this frame; duplicates are received and dropped."""
        store = self._store()
        blocks = frame.meta["blocks"]
        if frame.payload_len != len(blocks) * store.block_bytes:
            raise RemoteError(
                f"put carries {frame.payload_len} bytes for {len(blocks)} blocks; "
                f"this store's blocks have {store.block_bytes} bytes"
            )
        pendings = self._begin(store, blocks)
        scratch = memoryview(bytearray(store.block_bytes))
        dests = [p.view if p is not None else scratch for p in pendings]
        self._finish(store, frame.meta["xfer"], frame, pendings, dests)

    def on_put_reserve(self, frame: Frame) -> None:
        """Reserve slots and tell the client where to place each block (blocks of the
        store's size only: the client copies them into slots of that size)."""
        store = self._store()
        xfer = frame.meta["xfer"]
        if int(frame.meta["block_bytes"]) != store.block_bytes:
            raise RemoteError(
                f"this store's blocks have {store.block_bytes} bytes, the put's "
                f"{frame.meta['block_bytes']}"
            )
        pendings = self._begin(store, frame.meta["blocks"])
        self._reserved[xfer] = pendings
        segment = store.segment_name
        slots: list[int] = []
        size = store.block_bytes  # a slot's offset in the arena is slot * block_bytes
        for p in pendings:
            if p is None:
                slots.append(SLOT_PRESENT)
            elif segment is not None and p.dram_slot is not None:
                slots.append(p.dram_slot * size)
            else:
                slots.append(SLOT_INLINE)
        reply = {"xfer": xfer, "segment": segment, "slots": slots}
        self._link.send(Kind.PUT_SLOTS, reply, deadline=self._deadline())

    def on_put_commit(self, frame: Frame) -> None:
        """The client placed its blocks: take the inline rest, commit, ack."""
        store = self._store()
        xfer = frame.meta["xfer"]
        pendings = self._reserved.pop(xfer, None)
        if pendings is None:
            raise RemoteError(f"put {xfer} has no reserved slots")
        segment = store.segment_name
        inline = [
            p.view for p in pendings if p is not None and (segment is None or p.dram_slot is None)
        ]
        self._finish(store, xfer, frame, pendings, inline)

    def on_pull(self, frame: Frame) -> None:
        """Serve blocks inline, or (co-located client) as places in our shared arena.

        Small pulls (the latency-critical reads) are copied out of the store into a reused
        buffer and sent inline, also to a co-located client (below 64 KiB in all).

        Blocks read in place are covered by a store lease until the client's RELEASE, the
        connection's end or the lease's expiry, so a stuck client cannot pin them forever.
        """
        store = self._store()
        meta = frame.meta
        xfer, direct = meta["xfer"], bool(meta.get("direct"))
        block_bytes = store.block_bytes
        if int(meta.get("block_bytes", block_bytes)) != block_bytes:
            raise RemoteError(
                f"this store's blocks have {block_bytes} bytes, the destinations "
                f"{meta['block_bytes']}"
            )
        hashes = meta["hashes"]
        encoder = self._server.pull_encoder if meta.get("encoded") and not direct else None
        if encoder is not None:
            self._pull_encoded(store, xfer, hashes, encoder)
            return
        num_bytes = len(hashes) * block_bytes
        if num_bytes <= (_DIRECT_INLINE_MAX_BYTES if direct else _COPY_PULL_MAX_BYTES):
            self._pull_copied(store, xfer, hashes)
            return
        block_hashes = hashes_from_wire(hashes)
        lease, blocks = store.lease_reads(block_hashes)
        in_place = False  # the client reads some blocks in place, then sends RELEASE
        try:
            items: list[list[Any]] = []
            inline: list[memoryview] = []
            segment = store.segment_name
            fallback = self._server.store_fallback
            for block_hash, block in zip(block_hashes, blocks, strict=True):
                if block is None:
                    found = _from_fallback(fallback, block_hash, block_bytes)
                    if found is None:
                        items.append([False])
                    else:
                        inline.append(found[1])
                        items.append([True, meta_to_wire(found[0])])
                elif direct and block.arena_offset is not None:
                    in_place = True
                    items.append([True, meta_to_wire(block.meta), block.arena_offset])
                else:
                    inline.append(block.view)
                    items.append([True, meta_to_wire(block.meta)])
            reply = {"xfer": xfer, "items": items, "segment": segment if in_place else None}
            self._link.send(Kind.PULL_REPLY, reply, inline, self._deadline())
        except BaseException:
            if lease is not None:
                store.release_lease(lease.lease_id)
            raise
        if lease is not None:  # the client's RELEASE comes on this connection, after this
            if in_place:
                self._leases[xfer] = lease.lease_id
            else:  # inline bytes are in the socket now
                store.release_lease(lease.lease_id)

    def _pull_copied(self, store: TieredStore, xfer: str, hashes: list[bytes]) -> None:
        """Small inline pulls: copy the hits into a reused buffer under one store lock each
        (cheaper than pinning and unpinning: this is the latency-critical remote read)."""
        block_bytes = store.block_bytes
        needed = len(hashes) * block_bytes
        if self._scratch.nbytes < needed:
            self._scratch = memoryview(bytearray(needed))
        items: list[list[Any]] = []
        inline: list[memoryview] = []
        offset = 0
        fallback = self._server.store_fallback
        for raw_hash in hashes:
            dest = self._scratch[offset : offset + block_bytes]
            block_meta = _read_block(store, hash_from_wire(raw_hash), dest, fallback)
            if block_meta is None:
                items.append([False])
                continue
            items.append([True, meta_to_wire(block_meta)])
            inline.append(dest)
            offset += block_bytes
        self._link.send(Kind.PULL_REPLY, {"xfer": xfer, "items": items}, inline, self._deadline())

    def _pull_encoded(
        self, store: TieredStore, xfer: str, hashes: list[bytes], encoder: PullEncoder
    ) -> None:
        """A pull whose client decodes: a block encoded before comes from the server's
        :class:`EncodedBlocks`; any other hit is encoded straight from the store's memory
        (pinned under a lease meanwhile; a miss the fallback serves is copied out first)
        and kept there. Sent inline, each payload with its size (``lengths``)."""
        block_hashes = hashes_from_wire(hashes)
        fallback = self._server.store_fallback
        kept = self._server.encoded_blocks
        ready = {}
        if kept is not None:
            for block_hash in block_hashes:
                found = kept.get(block_hash)
                if found is not None:
                    ready[block_hash] = found
        to_read = [h for h in block_hashes if h not in ready]
        items: list[list[Any]] = []
        payloads: list[memoryview] = []
        lease, blocks = store.lease_reads(to_read) if to_read else (None, [])
        read = dict(zip(to_read, blocks, strict=True))
        try:
            for block_hash in block_hashes:
                if block_hash in ready:
                    wire_meta, payload = ready[block_hash]
                elif (block := read[block_hash]) is not None:
                    wire_meta, payload = meta_to_wire(block.meta), encoder(block.view)
                else:
                    found = _from_fallback(fallback, block_hash, store.block_bytes)
                    if found is None:
                        items.append([False])
                        continue
                    wire_meta, payload = meta_to_wire(found[0]), encoder(found[1])
                if kept is not None and block_hash not in ready:
                    kept.put(block_hash, wire_meta, payload)
                items.append([True, wire_meta])
                payloads.append(payload)
            reply = {"xfer": xfer, "items": items, "encoded": True,
                     "lengths": [p.nbytes for p in payloads]}  # fmt: skip
            self._link.send(Kind.PULL_REPLY, reply, payloads, self._deadline())
        finally:
            if lease is not None:
                store.release_lease(lease.lease_id)

    def on_release(self, frame: Frame) -> None:
        """The client finished reading in place: drop the pull's lease."""
        lease_id = self._leases.pop(frame.meta["xfer"], None)
        if lease_id is not None:
            self._store().release_lease(lease_id)

    def cleanup(self, store: TieredStore | None) -> None:
        """The connection ended: abort unfinished puts, release pull leases (nothing to
        give back if the store closed first, as it may while its process shuts down:
        its slots and pins went with it)."""
        if store is None:
            return
        try:
            for pendings in self._reserved.values():
                _abort(store, pendings)
            for lease_id in self._leases.values():
                store.release_lease(lease_id)
        except StoreError:
            if not store.closed:
                raise
        finally:
            self._reserved.clear()
            self._leases.clear()


def _from_fallback(
    fallback: StoreFallback | None, block_hash: int, block_bytes: int
) -> tuple[BlockMeta, memoryview] | None:
    """A block the store lacks, read by ``fallback`` (a prefill worker's pool, with
    ``--prefix-store demote``) into a fresh buffer: (its meta, the buffer), or None."""
    if fallback is None:
        return None
    buf = uninitialized(block_bytes)
    found = fallback(block_hash, buf)
    return None if found is None else (found, buf)


def _read_block(
    store: TieredStore, block_hash: int, dest: memoryview, fallback: StoreFallback | None
) -> BlockMeta | None:
    """Copy a block into ``dest`` from the store, else through ``fallback``; its meta."""
    block_meta = store.read_into(block_hash, dest)
    if block_meta is None and fallback is not None:
        block_meta = fallback(block_hash, dest)
    return block_meta


def _abort(store: TieredStore, pendings: list[PendingPut | None]) -> None:
    for pending in pendings:
        if pending is not None:
            store.abort_put(pending)
