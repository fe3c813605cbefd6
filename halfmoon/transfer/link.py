"""A framed, checksummed, bidirectional channel over one connected stream socket.

Sends are zero-copy scatter-gather (``sendmsg`` of the header plus the caller's
memoryviews); payloads are received with ``recv_into`` straight into the caller's
preallocated buffers and verified against the frame's xxh3 checksum (hashed chunk by
chunk while the data is in cache), unless the sender's link runs ``checksum=False``. Small frames (the latency-critical requests and
replies) go out in one ``sendmsg`` and come in whole through one ``recv`` into a receive
buffer. Every blocking call takes a deadline (``time.monotonic()`` seconds), so a silent
or dead peer produces :class:`TransferTimeout` or :class:`PeerClosedError`, never a hang.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import xxhash

from halfmoon.core.buffers import buffer_address, span_at
from halfmoon.transfer.busypoll import BusyPoller
from halfmoon.transfer.deadline_socket import IOV_BATCH, DeadlineSocket
from halfmoon.transfer.errors import (
    ChecksumError,
    PeerClosedError,
    TransferCancelled,
    TransferError,
    TransferTimeout,
)
from halfmoon.transfer.handles import CancelFlag
from halfmoon.transfer.protocol import (
    FLAG_UNCHECKED,
    HEADER_BYTES,
    MAX_META_BYTES,
    MAX_PAYLOAD_BYTES,
    TRAILER_BYTES,
    Frame,
    Kind,
    decode_meta,
    decode_prefix,
    decode_trailer,
    encode_header,
    encode_trailer,
)

_DISCARD_CHUNK_BYTES = 1 << 20
#: Payloads are hashed and sent / received and hashed in chunks that stay in cache (L2).
_CHUNK_BYTES = 1 << 20
_CANCEL_POLL_S = 0.02
_RBUF_BYTES = 64 << 10
_ZERO_TRAILER = encode_trailer(0)


#: Pieces up to this size are joined with their neighbours in memory (:func:`coalesce`).
#: It is also the size up to which xxhash keeps the GIL (python-xxhash 4.1, measured:
#: two threads hashing 64 KiB pieces took twice one thread's time, 96 KiB pieces the same).
_COALESCE_MAX_BYTES = 64 << 10


def coalesce(pieces: Sequence[memoryview]) -> list[memoryview]:
    """``pieces`` with every run of pieces of up to 64 KiB that lie back to back in
    writable memory (blocks of one array, slices of one region) joined into one view.

    The joined views point at the pieces' memory without owning it: use them only while
    ``pieces`` are alive (within the send or receive). A payload of 1,024 blocks of
    64 KiB is then a few views, not 1,024: one slice, one hash call and one iovec per
    MiB instead of sixteen, and the hash of a joined run (over 64 KiB) runs without the
    GIL, where a 64 KiB piece's held it while the batch's other connection thread waited
    to return from its ``sendmsg`` / ``recvmsg_into``. Costs ~0.45 us a piece (finding
    an address through ctypes is most of it).
    """
    out: list[memoryview] = []
    first: memoryview | None = None  # the current run's first piece, spanning [start, end)
    start = end = 0
    for piece in pieces:
        size = piece.nbytes
        # None: too large to join, or read-only or empty (not joinable)
        address = buffer_address(piece) if size <= _COALESCE_MAX_BYTES else None
        if address == end and first is not None:
            end += size
            continue
        if first is not None:
            out.append(first if end - start == first.nbytes else span_at(start, end - start))
            first = None
        if address is None:
            out.append(piece)
        else:
            first, start, end = piece, address, address + size
    if first is not None:
        out.append(first if end - start == first.nbytes else span_at(start, end - start))
    return out


def as_bytes_view(buffer: object) -> memoryview:
    """A flat unsigned-byte view of any contiguous buffer (bytes, bytearray, numpy, mmap)."""
    view = memoryview(buffer)  # type: ignore[arg-type]
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def deadline_after(timeout_s: float) -> float:
    """The monotonic time ``timeout_s`` from now."""
    return time.monotonic() + timeout_s


class Link:
    """One authenticated-or-not connection; safe for one sender and one receiver thread."""

    def __init__(
        self, sock: socket.socket, peer: str, busy_poll_s: float = 0.0, checksum: bool = True
    ) -> None:
        """``busy_poll_s``: poll this long for an awaited frame before sleeping (0: never;
        see :mod:`halfmoon.transfer.busypoll`). ``checksum``: hash the payloads this link
        sends (False: they go unchecked, see :data:`~halfmoon.transfer.protocol.FLAG_UNCHECKED`;
        received payloads are verified whenever their sender hashed them)."""
        self.peer = peer
        self.checksum = checksum
        self._poller = BusyPoller(sock, busy_poll_s)
        self._sock = sock
        self._send_lock = threading.Lock()
        self._packer = msgpack.Packer(use_bin_type=True)
        self._unread_bytes = 0  # payload of the last received frame not consumed yet
        # Receive buffer for small reads (headers, metas, small payloads): [_rstart, _rend).
        self._rbuf = memoryview(bytearray(_RBUF_BYTES))
        self._rstart = self._rend = 0
        self._closed = False
        self._io = DeadlineSocket(sock, peer)

    @property
    def closed(self) -> bool:
        """Whether ``close`` was called (or a failure closed the link)."""
        return self._closed

    @property
    def unread_bytes(self) -> int:
        """Payload bytes of the last received frame that nobody has consumed yet."""
        return self._unread_bytes

    def _fail(self, exc: BaseException, doing: str) -> TransferError:
        """Close the link (its stream position is unknown now) and describe the failure."""
        self.close()
        if isinstance(exc, TransferError):
            return exc
        if isinstance(exc, socket.timeout):
            return TransferTimeout(f"timed out {doing} peer {self.peer}")
        if isinstance(exc, (ConnectionError, EOFError)):
            return PeerClosedError(f"peer {self.peer} closed the connection while {doing} it")
        return TransferError(f"connection to peer {self.peer} failed while {doing} it: {exc}")

    # ------------------------------------------------------------ sending
    def send(
        self,
        kind: Kind,
        meta: dict[str, Any],
        payloads: Sequence[memoryview] = (),
        deadline: float | None = None,
        joined: bool = False,
    ) -> None:
        """Send one frame whose payload is the concatenation of ``payloads`` (no copy).
        ``joined``: the caller already ran them through :func:`coalesce`."""
        if not payloads:
            total = 0
        elif len(payloads) == 1:
            total = payloads[0].nbytes
        else:
            total = sum(v.nbytes for v in payloads)
        with self._send_lock:
            if self._closed:
                raise PeerClosedError(f"connection to peer {self.peer} is closed")
            # The packer is reused (it is not thread-safe: only under the send lock).
            flags = 0 if self.checksum or not total else FLAG_UNCHECKED
            header = memoryview(encode_header(kind, meta, total, self._packer.pack, flags))
            try:
                if not total:
                    self._io.send_all([header], deadline)
                else:
                    if len(payloads) > 1 and not joined:
                        payloads = coalesce(payloads)
                    if not self.checksum:
                        self._send_unchecked(header, payloads, deadline)
                    elif total <= _CHUNK_BYTES:
                        self._send_small(header, payloads, deadline)
                    else:
                        self._send_payload(header, payloads, deadline)
            except (OSError, TransferError) as exc:
                raise self._fail(exc, "sending to") from exc

    def _send_small(
        self, header: memoryview, payloads: Sequence[memoryview], deadline: float | None
    ) -> None:
        """A payload of at most one chunk: hash it, then one ``sendmsg`` for the whole frame."""
        if len(payloads) == 1:
            checksum = xxhash.xxh3_64_intdigest(payloads[0])
        else:
            hasher = xxhash.xxh3_64()
            for view in payloads:
                hasher.update(view)
            checksum = hasher.intdigest()
        self._io.send_all([header, *payloads, memoryview(encode_trailer(checksum))], deadline)

    def _send_unchecked(
        self, header: memoryview, payloads: Sequence[memoryview], deadline: float | None
    ) -> None:
        """The payload without hashing (``IOV_BATCH`` pieces per ``sendmsg``), then a
        zero trailer."""
        self._io.send_all([header, *payloads, memoryview(_ZERO_TRAILER)], deadline)

    def _send_payload(
        self, header: memoryview, payloads: Sequence[memoryview], deadline: float | None
    ) -> None:
        """Hash each chunk right before the kernel copies it, then send the checksum trailer."""
        hasher = xxhash.xxh3_64()
        batch, batch_bytes = [header], 0
        for view in payloads:
            for start in range(0, view.nbytes, _CHUNK_BYTES):
                chunk = view[start : start + _CHUNK_BYTES]
                hasher.update(chunk)
                batch.append(chunk)
                batch_bytes += chunk.nbytes
                if batch_bytes >= _CHUNK_BYTES or len(batch) >= IOV_BATCH:
                    self._io.send_all(batch, deadline)
                    batch, batch_bytes = [], 0
        batch.append(memoryview(encode_trailer(hasher.intdigest())))
        self._io.send_all(batch, deadline)

    # ------------------------------------------------------------ receiving
    def _recv_exact(self, view: memoryview, deadline: float | None) -> None:
        """Fill ``view``: buffered bytes first; big remainders straight from the socket
        (no copy), small ones through the buffer (one syscall for a whole small frame)."""
        got = min(self._rend - self._rstart, view.nbytes)
        if got:
            view[:got] = self._rbuf[self._rstart : self._rstart + got]
            self._rstart += got
        while got < view.nbytes:
            if view.nbytes - got >= _RBUF_BYTES // 2:
                got += self._io.recv_into(view[got:], deadline)
                continue
            self._rstart, self._rend = 0, self._io.recv_into(self._rbuf, deadline)
            take = min(self._rend, view.nbytes - got)
            view[got : got + take] = self._rbuf[:take]
            self._rstart = take
            got += take

    def _recv_scatter(self, pieces: Sequence[memoryview], deadline: float | None) -> None:
        """Fill ``pieces`` in order: buffered bytes first, then scatter receives of up to
        ``IOV_BATCH`` pieces per call (a payload of 64 KiB blocks costs a syscall per MiB,
        not one per block)."""
        todo = list(pieces)  # trimmed as it fills; the caller's views stay whole
        i = 0
        while self._rend > self._rstart and i < len(todo):
            take = min(self._rend - self._rstart, todo[i].nbytes)
            todo[i][:take] = self._rbuf[self._rstart : self._rstart + take]
            self._rstart += take
            if take == todo[i].nbytes:
                i += 1
            else:
                todo[i] = todo[i][take:]
        while i < len(todo):
            n = self._io.recv_into_many(todo[i : i + IOV_BATCH], deadline)
            while n:
                if n >= todo[i].nbytes:
                    n -= todo[i].nbytes
                    i += 1
                else:
                    todo[i] = todo[i][n:]
                    n = 0

    def _buffer_at_least(self, num_bytes: int, deadline: float | None) -> None:
        """Read until ``num_bytes`` (at most ``_RBUF_BYTES``) are buffered: a small frame
        usually arrives whole, so header, meta and payload cost one ``recv``."""
        rbuf, start, end = self._rbuf, self._rstart, self._rend
        if start == end:  # empty: read from the front, with the whole buffer's room
            start = end = self._rstart = 0
        elif start + num_bytes > _RBUF_BYTES:  # move the buffered bytes to the front
            rbuf[: end - start] = rbuf[start:end]
            start, end = 0, end - start
            self._rstart = 0
        if end - start < num_bytes:  # nothing buffered yet: poll briefly before sleeping
            end += self._poller.poll_into(rbuf[end:])
        while end - start < num_bytes:
            self._rend = end
            end += self._io.recv_into(rbuf[end:], deadline)
        self._rend = end

    def recv(
        self,
        deadline: float | None = None,
        max_meta_bytes: int = MAX_META_BYTES,
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
    ) -> Frame:
        """Receive the next frame's header and meta (its payload is read separately).
        A header declaring more than the caps fails before its meta is read (an
        unauthenticated peer gets tight ones: see :mod:`halfmoon.transfer.auth`)."""
        try:
            if self._rend - self._rstart < HEADER_BYTES:
                self._buffer_at_least(HEADER_BYTES, deadline)
            start = self._rstart
            header = bytes(self._rbuf[start : start + HEADER_BYTES])
            kind, meta_len, payload_len, head_check, flags = decode_prefix(
                header, max_meta_bytes, max_payload_bytes
            )
            self._rstart = start + HEADER_BYTES
            if meta_len <= _RBUF_BYTES - HEADER_BYTES:  # the meta comes from the buffer
                if self._rend - self._rstart < meta_len:
                    self._buffer_at_least(meta_len, deadline)
                start = self._rstart
                packed = bytes(self._rbuf[start : start + meta_len])
                self._rstart = start + meta_len
            else:
                big = bytearray(meta_len)
                self._recv_exact(memoryview(big), deadline)
                packed = bytes(big)
            meta = decode_meta(header, packed, head_check)
        except (OSError, EOFError, TransferError) as exc:
            raise self._fail(exc, "receiving from") from exc
        self._unread_bytes = payload_len
        return Frame(kind, meta, payload_len, not flags & FLAG_UNCHECKED)

    def _take_buffered_payload(self, dests: Sequence[memoryview], total: int, checked: bool) -> int:
        """Copy a payload that is entirely buffered (with its trailer) into ``dests``;
        returns its checksum as computed over the destinations (0 unless ``checked``)."""
        rbuf, start = self._rbuf, self._rstart
        checksum = 0
        if len(dests) == 1:
            dest = dests[0]
            dest[:] = rbuf[start : start + total]
            if checked:
                checksum = xxhash.xxh3_64_intdigest(dest)
        else:
            hasher = xxhash.xxh3_64() if checked else None
            offset = start
            for dest in dests:
                dest[:] = rbuf[offset : offset + dest.nbytes]
                if hasher is not None:
                    hasher.update(dest)
                offset += dest.nbytes
            if hasher is not None:
                checksum = hasher.intdigest()
        self._rstart = start + total
        return checksum

    def recv_payload_into(
        self, frame: Frame, dests: Sequence[memoryview], deadline: float | None = None
    ) -> None:
        """Receive the frame's payload into ``dests`` in order and verify its checksum
        (when its sender hashed it: ``frame.checked``).

        The sizes of ``dests`` must add up to the payload length (else the link is closed:
        the stream position would be lost). A checksum mismatch raises
        :class:`ChecksumError` after the whole payload is consumed, so the link survives.
        """
        total = dests[0].nbytes if len(dests) == 1 else sum(d.nbytes for d in dests)
        self._unread_bytes = 0
        if total != frame.payload_len:
            self.close()
            raise TransferError(
                f"payload from {self.peer} has {frame.payload_len} bytes, destinations {total}"
            )
        if not total:
            return
        if total + TRAILER_BYTES <= _RBUF_BYTES // 2:  # small: one recv, one hash, no chunks
            try:
                if self._rend - self._rstart < total + TRAILER_BYTES:
                    self._buffer_at_least(total + TRAILER_BYTES, deadline)
            except (OSError, EOFError, TransferError) as exc:
                raise self._fail(exc, "receiving from") from exc
            checksum = self._take_buffered_payload(dests, total, frame.checked)
            expected = decode_trailer(self._rbuf[self._rstart : self._rstart + TRAILER_BYTES])
            self._rstart += TRAILER_BYTES
            if frame.checked and checksum != expected:
                raise ChecksumError(f"payload from {self.peer} failed its xxh3 checksum")
            return
        if not frame.checked:
            self._recv_unchecked(dests, deadline)
            return
        hasher = xxhash.xxh3_64()
        trailer = memoryview(bytearray(TRAILER_BYTES))
        group: list[memoryview] = []  # about a chunk's bytes, received in one go, then hashed
        group_bytes = 0
        try:
            for dest in coalesce(dests) if len(dests) > 1 else dests:
                for start in range(0, dest.nbytes, _CHUNK_BYTES):
                    chunk = dest[start : start + _CHUNK_BYTES]
                    group.append(chunk)
                    group_bytes += chunk.nbytes
                    if group_bytes >= _CHUNK_BYTES or len(group) >= IOV_BATCH:
                        self._recv_scatter(group, deadline)
                        for piece in group:
                            hasher.update(piece)  # still in cache from the kernel's copy
                        group, group_bytes = [], 0
            self._recv_scatter([*group, trailer], deadline)
            for piece in group:
                hasher.update(piece)
        except (OSError, EOFError, TransferError) as exc:
            raise self._fail(exc, "receiving from") from exc
        if hasher.intdigest() != decode_trailer(trailer):
            raise ChecksumError(f"payload from {self.peer} failed its xxh3 checksum")

    def _recv_unchecked(self, dests: Sequence[memoryview], deadline: float | None) -> None:
        """An unchecked payload straight into ``dests`` (scatter receives of up to
        ``IOV_BATCH`` pieces, joined where they lie back to back), then its zero trailer."""
        trailer = memoryview(bytearray(TRAILER_BYTES))
        try:
            self._recv_scatter([*(coalesce(dests) if len(dests) > 1 else dests), trailer], deadline)
        except (OSError, EOFError, TransferError) as exc:
            raise self._fail(exc, "receiving from") from exc

    def discard_pending(self, deadline: float | None = None) -> None:
        """Read and drop the unread payload of the last frame (after rejecting it)."""
        if not self._unread_bytes:
            return
        remaining, self._unread_bytes = self._unread_bytes, 0
        remaining += TRAILER_BYTES if remaining else 0
        if not remaining or self._closed:
            return
        scratch = memoryview(bytearray(min(remaining, _DISCARD_CHUNK_BYTES)))
        try:
            while remaining:
                chunk = scratch[: min(remaining, scratch.nbytes)]
                self._recv_exact(chunk, deadline)
                remaining -= chunk.nbytes
        except (OSError, EOFError, TransferError) as exc:
            raise self._fail(exc, "receiving from") from exc

    def wait_readable(self, deadline: float | None, cancel: CancelFlag) -> None:
        """Block until a frame (or EOF) is waiting; raise on timeout or once ``cancel`` is set.

        Polls ``cancel`` every few milliseconds so a cancelled transfer stops promptly even
        while the peer is slow to answer.
        """
        if self._closed or self._rend > self._rstart or self._poll_buffer():
            return
        while not self.readable():
            if cancel.is_set():
                self.close()
                raise TransferCancelled(f"transfer to peer {self.peer} was cancelled")
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                self.close()
                raise TransferTimeout(f"timed out waiting for peer {self.peer}")
            select.select([self._sock], [], [], min(_CANCEL_POLL_S, remaining or _CANCEL_POLL_S))

    def _poll_buffer(self) -> bool:
        """Busy-poll briefly for bytes into the empty receive buffer (the awaited reply of
        a peer that is awake comes sooner than a sleeping thread would wake for it)."""
        self._rstart = self._rend = 0
        try:
            self._rend = self._poller.poll_into(self._rbuf)
        except EOFError:
            return True  # the next receive reports the closed connection
        return self._rend > 0

    def readable(self) -> bool:
        """Whether a frame (or EOF) is waiting, without blocking."""
        if self._closed or self._rend > self._rstart:
            return True
        ready, _, _ = select.select([self._sock], [], [], 0)
        return bool(ready)

    def close(self) -> None:
        """Close the socket; pending and later calls fail with :class:`PeerClosedError`."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):  # the peer may already be gone
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
