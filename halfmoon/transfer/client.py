"""The requesting side: one :class:`PeerClient` per remote engine.

Transports (same operations, same frames):

- ``tcp``: block bytes are frame payloads, sent zero-copy with ``sendmsg`` and received
  with ``recv_into`` into the destination; a batch is split over several connections.
- ``shm``: control frames over TCP, but block bytes are copied straight into the peer's
  shared-memory region (push, streams) or straight out of its shared DRAM arena (pull);
  a destination not in shared memory falls back to inline payloads.
- ``inproc``: like ``shm`` within one process; connections are socket pairs found
  through an :class:`~halfmoon.transfer.hub.InProcessHub`.
- ``auto`` (the engine's default): ``shm`` when the peer sees the same shared memory as
  this process (same kernel, same /dev/shm; the handshake says), else ``tcp``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from halfmoon.store.meta import BlockMeta
from halfmoon.transfer.busypoll import DEFAULT_BUSY_POLL_S
from halfmoon.transfer.errors import RemoteError, TransferCancelled
from halfmoon.transfer.handles import CancelFlag, TransferHandle, TransferResult
from halfmoon.transfer.hub import InProcessHub
from halfmoon.transfer.link import as_bytes_view, coalesce, deadline_after
from halfmoon.transfer.memcopy import copy_blocks
from halfmoon.transfer.messages import PutBlock
from halfmoon.transfer.pool import (
    TRANSPORTS,
    LinkPool,
    OutFrame,
    default_num_connections,
    split_batch,
)
from halfmoon.transfer.protocol import Kind
from halfmoon.transfer.regions import SegmentCache
from halfmoon.transfer.sender import StreamSender
from halfmoon.transfer.store_client import StoreClient
from halfmoon.transfer.store_service import PullDecoder

__all__ = ["TRANSPORTS", "PeerClient"]


class PeerClient:
    """Operations on one peer: push, put, pull, streams (thread-safe)."""

    def __init__(
        self,
        endpoint: str,
        secret: bytes,
        transport: str = "tcp",
        num_connections: int | None = None,
        timeout_s: float = 30.0,
        hub: InProcessHub | None = None,
        segments: SegmentCache | None = None,
        busy_poll_s: float = DEFAULT_BUSY_POLL_S,
        checksum: bool = True,
    ) -> None:
        """``checksum``: hash the payloads this client sends (False: TCP's own checks only;
        see :mod:`halfmoon.transfer.protocol`)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        num_connections = default_num_connections() if num_connections is None else num_connections
        self._links = LinkPool(
            endpoint, secret, transport, num_connections, hub, busy_poll_s, checksum
        )
        self.endpoint = self._links.endpoint
        self.timeout_s = timeout_s
        self._hub = hub
        self._owns_segments = segments is None
        self._segments = segments if segments is not None else SegmentCache()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)  # next() on a count is atomic under the GIL
        self._region_views: dict[str, memoryview | None] = {}
        self._store = StoreClient(
            self._links, self._segments, lambda: self.transport, self._next_id
        )

    @property
    def transport(self) -> str:
        """``tcp``, ``shm`` or ``inproc``; ``auto`` is resolved by the first connection
        (made here if there is none yet)."""
        resolved = self._links.resolved_transport
        return resolved or self._links.resolve_transport(self._deadline(None))

    def _next_id(self) -> str:
        return f"{self._links.client_id}-{next(self._ids)}"

    def _deadline(self, timeout_s: float | None) -> float:
        return deadline_after(self.timeout_s if timeout_s is None else timeout_s)

    # ------------------------------------------------------------ direct placement
    def _remote_region(self, region: str, deadline: float) -> memoryview | None:
        """The peer's region mapped into this process, or None (send bytes inline)."""
        if self.transport == "tcp":
            return None
        if self.transport == "inproc":
            assert self._hub is not None
            return self._hub.get(self.endpoint).regions.get(region).view
        with self._lock:
            if region in self._region_views:
                return self._region_views[region]
        info = self._links.request(Kind.REGION, {"region": region}, Kind.REGION_INFO, deadline).meta
        segment = info.get("segment")
        view = self._segments.view(segment)[: int(info["size"])] if segment else None
        with self._lock:
            self._region_views[region] = view
        return view

    # ------------------------------------------------------------ push
    def _push_frames(
        self, region: str, items: list[tuple[int, memoryview]], xfer: str, deadline: float
    ) -> list[OutFrame]:
        remote = self._remote_region(region, deadline)
        groups = split_batch([v.nbytes for _, v in items], self._links.num_connections)
        frames = []
        for group in groups:
            chunk = items[group.start : group.stop]
            meta = _push_meta(xfer, region, len(groups), len(chunk), remote is not None)
            if remote is None:  # the blocks are the payload, gathered on the frame's thread
                payloads: list[memoryview] = []
                prepare = _inliner(chunk, meta, payloads)
                frames.append(OutFrame(Kind.PUSH, meta, payloads, prepare, joined=True))
            else:  # the bytes are in place before the frame goes: it only counts them
                frames.append(OutFrame(Kind.PUSH, meta, [], _placer(remote, chunk, region, meta)))
        return frames

    def _push(
        self,
        region: str,
        items: list[tuple[int, memoryview]],
        xfer: str,
        deadline: float,
        cancel: CancelFlag,
    ) -> TransferResult:
        started = time.perf_counter()
        if len(items) == 1 and self._remote_region(region, deadline) is None:
            self._push_one(region, items[0], xfer, deadline, cancel)
            return TransferResult(xfer, 1, items[0][1].nbytes, time.perf_counter() - started)
        frames = self._push_frames(region, items, xfer, deadline)
        self._links.send_frames(frames, Kind.PUSH_ACK, deadline, cancel, xfer)
        num_bytes = sum(v.nbytes for _, v in items)
        return TransferResult(xfer, len(items), num_bytes, time.perf_counter() - started)

    def _push_one(
        self,
        region: str,
        item: tuple[int, memoryview],
        xfer: str,
        deadline: float,
        cancel: CancelFlag,
    ) -> None:
        """One block inline: one frame on one link, sent and acknowledged on this thread.
        (The batch path's frame objects, gathering and runner cost ~5 us, an eighth of a
        one-block write's round trip here.)"""
        offset, view = item
        meta = _push_meta(xfer, region, 1, 1, False)
        meta["segs"] = [[offset, view.nbytes]]
        if cancel.is_set():
            raise TransferCancelled(f"transfer {xfer} to {self.endpoint} was cancelled")
        with self._links.borrowed(deadline) as link:
            link.send(Kind.PUSH, meta, (view,), deadline)
            self._links.ack(link, Kind.PUSH_ACK, deadline, cancel)

    def push(
        self, region: str, blocks: Sequence[tuple[int, object]], timeout_s: float | None = None
    ) -> TransferResult:
        """Write ``blocks`` (``(offset in the peer's region, buffer)``) and wait for the acks."""
        items = [(int(off), as_bytes_view(buf)) for off, buf in blocks]
        return self._push(region, items, self._next_id(), self._deadline(timeout_s), CancelFlag())

    def push_async(
        self, region: str, blocks: Sequence[tuple[int, object]], timeout_s: float | None = None
    ) -> TransferHandle:
        """Start a push; the handle waits, cancels, or calls back when done.

        Source buffers must stay unchanged until the handle is done. The peer reports one
        ``TransferCompleted("push")`` once every byte has landed.
        """
        xfer, cancel = self._next_id(), CancelFlag()
        items = [(int(off), as_bytes_view(buf)) for off, buf in blocks]
        deadline = self._deadline(timeout_s)
        future: Future[TransferResult] = Future()

        def run() -> None:
            try:
                future.set_result(self._push(region, items, xfer, deadline, cancel))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=run, name=f"hm-push-{xfer}", daemon=True).start()
        return TransferHandle(xfer, future, cancel)

    # ------------------------------------------------------------ store put / pull
    def put_blocks(self, blocks: Sequence[PutBlock], timeout_s: float | None = None) -> int:
        """Store blocks in the peer's store, received straight into its slots.

        Over ``shm`` / ``inproc`` the blocks are copied straight into the store's shared
        DRAM arena (two small round trips per group, no bytes through the socket; small
        blocks pipelined on one connection, see :mod:`halfmoon.transfer.store_client`).
        Returns how many were new there (hashes already present are skipped).
        """
        return self._store.put_blocks(blocks, self._deadline(timeout_s))

    def pull(
        self,
        block_hashes: Sequence[int],
        dests: Sequence[object],
        timeout_s: float | None = None,
        decode: PullDecoder | None = None,
        on_block: Callable[[int], None] | None = None,
        take_encoded: Callable[[int, memoryview], bool] | None = None,
    ) -> list[BlockMeta | None]:
        """Read blocks of the peer's store into ``dests`` (one ``block_bytes`` buffer each).

        Returns each block's metadata, None where the peer lacks it (that dest is left
        untouched). Large batches are split over several connections. With ``decode``
        (over tcp) the peer may send its blocks encoded by its pull encoder (compressed KV:
        :meth:`~halfmoon.transfer.engine.TransferEngine.set_pull_encoder`); ``decode``
        turns each back into its destination. ``on_block(i)`` is called as soon as block
        ``i`` is whole in its destination (on the connection's thread, before this
        returns), so a caller can use a block while the rest is still on the wire.
        ``take_encoded(i, payload)`` sees an encoded block before ``decode``: returning
        True, it decoded the block where it keeps blocks and ``dests[i]`` is untouched.
        """
        return self._store.pull(
            block_hashes, dests, self._deadline(timeout_s), decode, on_block, take_encoded
        )

    # ------------------------------------------------------------ streams
    def open_stream(
        self,
        session_id: str,
        num_layers: int,
        num_blocks: int,
        block_bytes: int,
        timeout_s: float | None = None,
        wait_s: float = 5.0,
    ) -> StreamSender:
        """Open a layer-wise session the peer announced with ``expect_stream``.

        Waits up to ``wait_s`` for the announcement (the sender may be a little early);
        ``timeout_s`` bounds each later step (every layer send, the final ack).
        """
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = deadline_after(timeout_s + wait_s)
        request = {
            "session": session_id,
            "num_layers": num_layers,
            "num_blocks": num_blocks,
            "block_bytes": block_bytes,
            "wait_s": wait_s,
        }
        link = self._links.checkout(deadline)
        try:
            link.send(Kind.STREAM_OPEN, request, deadline=deadline)
            ready = self._links.expect(link, Kind.STREAM_READY, deadline).meta
        except BaseException:
            self._links.checkin(link, ok=not link.closed)  # an ERROR reply leaves it aligned
            raise
        remote = None
        if self.transport == "inproc":
            assert self._hub is not None
            remote = self._hub.get(self.endpoint).regions.get(ready["region"]).view
        elif self.transport == "shm" and ready.get("segment"):
            remote = self._segments.view(ready["segment"])
        layout = (num_layers, num_blocks, block_bytes)
        return StreamSender(
            link, session_id, layout, ready["offsets"], remote, timeout_s, self._links.checkin
        )

    def close(self) -> None:
        """Close every connection; in-flight operations fail."""
        self._links.close()
        if self._owns_segments:
            self._segments.close()


def _push_meta(xfer: str, region: str, parts: int, num_blocks: int, placed: bool) -> dict[str, Any]:
    """A PUSH frame's meta (an inline frame adds its ``segs``)."""
    return {"xfer": xfer, "region": region, "parts": parts, "placed": placed, "blocks": num_blocks}


def _inliner(
    chunk: list[tuple[int, memoryview]], meta: dict[str, Any], payloads: list[memoryview]
) -> Callable[[], None]:
    """A function, run on the frame's connection thread, that puts ``chunk``'s views
    (joined where they lie back to back: :func:`~halfmoon.transfer.link.coalesce`) into
    ``payloads`` and its destinations into ``meta["segs"]`` as ``[offset, length]`` runs:
    blocks that land back to back in the region make one run, so a frame of 512
    adjacent 64 KiB blocks names one segment, not 512 (the receiver reads the count
    from ``meta["blocks"]``)."""

    def gather() -> None:
        segs: list[list[int]] = []
        end = -1
        for offset, view in chunk:
            if offset == end:
                end += view.nbytes
                segs[-1][1] += view.nbytes
            else:
                end = offset + view.nbytes
                segs.append([offset, view.nbytes])
        meta["segs"] = segs
        payloads.extend(coalesce([view for _, view in chunk]))

    return gather


def _placer(
    remote: memoryview, chunk: list[tuple[int, memoryview]], region: str, meta: dict[str, Any]
) -> Callable[[], None]:
    """A function, run on the frame's connection thread, that copies ``chunk`` into the
    peer's mapped region and counts its bytes into ``meta``. Every range is checked first:
    nothing of the frame is copied if one is out of range (as a tcp receiver does)."""

    def place() -> None:
        try:
            meta["bytes"] = copy_blocks(remote, chunk)
        except ValueError:
            bad = next((b for b in chunk if b[0] < 0 or b[0] + b[1].nbytes > remote.nbytes), None)
            if bad is None:
                raise
            offset, view = bad
            raise RemoteError(
                f"range [{offset}, {offset + view.nbytes}) is outside region {region!r} "
                f"of {remote.nbytes} bytes"
            ) from None

    return place
