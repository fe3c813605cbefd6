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

from halfmoon.core.errors import HalfmoonError
from halfmoon.store.meta import BlockMeta
from halfmoon.transfer.busypoll import DEFAULT_BUSY_POLL_S
from halfmoon.transfer.errors import ProtocolError, RemoteError
from halfmoon.transfer.handles import TransferHandle, TransferResult
from halfmoon.transfer.hub import InProcessHub
from halfmoon.transfer.link import Link, as_bytes_view, deadline_after
from halfmoon.transfer.memcopy import copy_blocks, copy_into
from halfmoon.transfer.messages import PutBlock, meta_from_wire, meta_to_wire
from halfmoon.transfer.pool import (
    TRANSPORTS,
    LinkPool,
    OutFrame,
    default_num_connections,
    split_batch,
)
from halfmoon.transfer.protocol import Frame, Kind, hash_to_wire
from halfmoon.transfer.regions import SegmentCache
from halfmoon.transfer.sender import StreamSender
from halfmoon.transfer.store_service import SLOT_INLINE, SLOT_PLACE, PullDecoder

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
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        num_connections = default_num_connections() if num_connections is None else num_connections
        self._links = LinkPool(endpoint, secret, transport, num_connections, hub, busy_poll_s)
        self.endpoint = self._links.endpoint
        self.timeout_s = timeout_s
        self._hub = hub
        self._owns_segments = segments is None
        self._segments = segments if segments is not None else SegmentCache()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)  # next() on a count is atomic under the GIL
        self._region_views: dict[str, memoryview | None] = {}

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
            meta: dict[str, Any] = {
                "xfer": xfer,
                "region": region,
                "parts": len(groups),
                "placed": remote is not None,
            }
            if remote is None:
                meta["segs"] = [[off, v.nbytes] for off, v in chunk]
                frames.append(OutFrame(Kind.PUSH, meta, [v for _, v in chunk]))
            else:  # the bytes are in place before the frame goes: it only counts them
                meta["blocks"] = len(chunk)
                frames.append(OutFrame(Kind.PUSH, meta, [], _placer(remote, chunk, region, meta)))
        return frames

    def _push(
        self,
        region: str,
        items: list[tuple[int, memoryview]],
        xfer: str,
        deadline: float,
        cancel: threading.Event,
    ) -> TransferResult:
        started = time.perf_counter()
        frames = self._push_frames(region, items, xfer, deadline)
        self._links.send_frames(frames, Kind.PUSH_ACK, deadline, cancel, xfer)
        num_bytes = sum(v.nbytes for _, v in items)
        return TransferResult(xfer, len(items), num_bytes, time.perf_counter() - started)

    def push(
        self, region: str, blocks: Sequence[tuple[int, object]], timeout_s: float | None = None
    ) -> TransferResult:
        """Write ``blocks`` (``(offset in the peer's region, buffer)``) and wait for the acks."""
        items = [(int(off), as_bytes_view(buf)) for off, buf in blocks]
        return self._push(
            region, items, self._next_id(), self._deadline(timeout_s), threading.Event()
        )

    def push_async(
        self, region: str, blocks: Sequence[tuple[int, object]], timeout_s: float | None = None
    ) -> TransferHandle:
        """Start a push; the handle waits, cancels, or calls back when done.

        Source buffers must stay unchanged until the handle is done. The peer reports one
        ``TransferCompleted("push")`` once every byte has landed.
        """
        xfer, cancel = self._next_id(), threading.Event()
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
        DRAM arena (two small round trips per group, no bytes through the socket).
        Returns how many were new there (hashes already present are skipped).
        """
        xfer = self._next_id()
        deadline = self._deadline(timeout_s)
        views = [as_bytes_view(b.payload) for b in blocks]
        groups = split_batch([v.nbytes for v in views], self._links.num_connections)
        wire = [[hash_to_wire(b.block_hash), meta_to_wire(b.meta), b.position] for b in blocks]
        if self.transport != "tcp":
            stored = [0] * len(groups)

            def job(k: int) -> Callable[[], None]:
                def run() -> None:
                    group = groups[k]
                    chunk = (wire[group.start : group.stop], views[group.start : group.stop])
                    stored[k] = self._put_placed(f"{xfer}.{k}", *chunk, deadline)

                return run

            self._links.run_parallel([job(k) for k in range(len(groups))])
            return sum(stored)
        frames = [
            OutFrame(
                Kind.PUT, {"xfer": xfer, "blocks": [wire[i] for i in g]}, [views[i] for i in g]
            )
            for g in groups
        ]
        self._links.send_frames(frames, Kind.PUT_ACK, deadline, threading.Event(), xfer)
        return sum(int(f.acks[0]["stored"]) for f in frames)

    def _put_placed(
        self, xfer: str, wire: list[list[Any]], views: list[memoryview], deadline: float
    ) -> int:
        """Reserve slots, copy into the shared arena, commit (inline for the rest)."""
        link = self._links.checkout(deadline)
        ok = False
        try:
            link.send(Kind.PUT_RESERVE, {"xfer": xfer, "blocks": wire}, deadline=deadline)
            items = self._links.expect(link, Kind.PUT_SLOTS, deadline).meta["items"]
            if len(items) != len(views):
                raise ProtocolError(
                    f"peer {self.endpoint} reserved {len(items)} of {len(views)} slots"
                )
            inline = []
            placed: dict[str, list[tuple[int, memoryview]]] = {}  # by segment
            for item, view in zip(items, views, strict=True):
                if item[0] == SLOT_PLACE:
                    placed.setdefault(item[1], []).append((int(item[2]), view))
                elif item[0] == SLOT_INLINE:
                    inline.append(view)
            for segment, blocks in placed.items():
                try:  # slots reserved back to back take one copy (see copy_blocks)
                    copy_blocks(self._segments.view(segment), blocks)
                except ValueError as exc:
                    raise ProtocolError(f"peer {self.endpoint} reserved a bad slot: {exc}") from exc
            link.send(Kind.PUT_COMMIT, {"xfer": xfer}, inline, deadline)
            stored = int(self._links.expect(link, Kind.PUT_ACK, deadline).meta["stored"])
            ok = True
            return stored
        finally:
            self._links.checkin(link, ok)

    def pull(
        self,
        block_hashes: Sequence[int],
        dests: Sequence[object],
        timeout_s: float | None = None,
        decode: PullDecoder | None = None,
    ) -> list[BlockMeta | None]:
        """Read blocks of the peer's store into ``dests`` (one ``block_bytes`` buffer each).

        Returns each block's metadata, None where the peer lacks it (that dest is left
        untouched). Large batches are split over several connections. With ``decode``
        (over tcp) the peer may send its blocks encoded by its pull encoder (compressed KV:
        :meth:`~halfmoon.transfer.engine.TransferEngine.set_pull_encoder`); ``decode``
        turns each back into its destination.
        """
        if len(block_hashes) != len(dests):
            raise ValueError(f"{len(block_hashes)} hashes but {len(dests)} destination buffers")
        deadline = self._deadline(timeout_s)
        if self.transport != "tcp":
            decode = None  # blocks come through shared memory: nothing to save on the wire
        if len(dests) == 1:  # the latency-critical single read: no grouping, no threads
            return self._pull_group([block_hashes[0]], [as_bytes_view(dests[0])], deadline, decode)
        views = [as_bytes_view(d) for d in dests]
        if len({v.nbytes for v in views}) > 1:
            raise ValueError("pull destinations must all have the store's block size")
        results: list[BlockMeta | None] = [None] * len(views)

        def job(group: range) -> Callable[[], None]:
            def run() -> None:
                hashes = [block_hashes[i] for i in group]
                metas = self._pull_group(hashes, [views[i] for i in group], deadline, decode)
                for i, meta in zip(group, metas, strict=True):
                    results[i] = meta

            return run

        groups = split_batch([v.nbytes for v in views], self._links.num_connections)
        if len(groups) == 1:  # the common small pull: no thread hand-off
            return self._pull_group(list(block_hashes), views, deadline, decode)
        self._links.run_parallel([job(g) for g in groups])
        return results

    def _pull_group(
        self,
        block_hashes: list[int],
        views: list[memoryview],
        deadline: float,
        decode: PullDecoder | None = None,
    ) -> list[BlockMeta | None]:
        xfer = self._next_id()
        link = self._links.checkout(deadline)
        ok = False
        try:
            request = {
                "xfer": xfer,
                "hashes": [hash_to_wire(h) for h in block_hashes],
                "direct": self.transport != "tcp",  # blocks may be read in place
                "block_bytes": views[0].nbytes,
            }
            if decode is not None:
                request["encoded"] = True  # the peer may encode (it has a pull encoder)
            link.send(Kind.PULL, request, deadline=deadline)
            reply = self._links.expect(link, Kind.PULL_REPLY, deadline)
            items: list[list[Any]] = reply.meta["items"]
            if len(items) != len(views):
                raise ProtocolError(
                    f"peer {self.endpoint} answered {len(items)} of {len(views)} pulls"
                )
            metas: list[BlockMeta | None] = []
            inline: list[memoryview] = []
            in_place: list[int] = []
            for i, item in enumerate(items):  # [False] | [True, meta] | [True, meta, seg, off]
                if not item[0]:
                    metas.append(None)
                    continue
                metas.append(meta_from_wire(item[1]))
                if len(item) == 4:  # in the peer's shared arena: copied out below
                    in_place.append(i)
                else:
                    inline.append(views[i])
            if reply.meta.get("encoded"):
                self._recv_encoded(link, reply, inline, decode, deadline)
                ok = True
                return metas
            link.recv_payload_into(reply, inline, deadline)
            if in_place:
                self._copy_in_place(link, xfer, views, items, in_place, deadline)
            ok = True
            return metas
        finally:
            self._links.checkin(link, ok)

    def _recv_encoded(
        self,
        link: Link,
        reply: Frame,
        dests: list[memoryview],
        decode: PullDecoder | None,
        deadline: float,
    ) -> None:
        """Receive encoded blocks (one payload each, sizes in the reply) and decode each
        into its destination."""
        lengths = [int(n) for n in reply.meta.get("lengths", [])]
        if decode is None or len(lengths) != len(dests) or any(n <= 0 for n in lengths):
            link.close()  # an answer we cannot read: its payload's end is unknown
            raise ProtocolError(f"peer {self.endpoint} sent encoded blocks we did not ask for")
        payloads = [memoryview(bytearray(n)) for n in lengths]
        link.recv_payload_into(reply, payloads, deadline)
        for payload, dest in zip(payloads, dests, strict=True):
            try:
                decode(payload, dest)
            except (HalfmoonError, ValueError) as exc:
                raise ProtocolError(
                    f"a block pulled from {self.endpoint} does not decode: {exc}"
                ) from exc

    def _copy_in_place(
        self,
        link: Link,
        xfer: str,
        views: list[memoryview],
        items: list[list[Any]],
        in_place: list[int],
        deadline: float,
    ) -> None:
        """Copy blocks out of the peer's shared arena, then let the peer drop their lease."""
        try:
            arenas: dict[str, memoryview] = {}
            for i in in_place:
                name, start, dest = items[i][2], int(items[i][3]), views[i]
                arena = arenas.get(name)
                if arena is None:
                    arena = arenas[name] = self._segments.view(name)
                if start < 0 or start + dest.nbytes > arena.nbytes:
                    raise ProtocolError(f"peer {self.endpoint} pointed past its arena's end")
                copy_into(dest, 0, arena[start : start + dest.nbytes])
        finally:
            link.send(Kind.RELEASE, {"xfer": xfer}, deadline=deadline)

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
