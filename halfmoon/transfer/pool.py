"""Authenticated connections to one peer, and batched sends over several of them.

A batch (push or put) is cut into frames of about ``total / num_connections`` bytes at
block boundaries; frames go round-robin to up to ``num_connections`` links, each on its
own thread, with at most ``_ACK_WINDOW`` unacknowledged frames per link (acks are tiny,
but an unbounded backlog could fill socket buffers in both directions and deadlock).
"""

from __future__ import annotations

import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from halfmoon.transfer.auth import check_secret, client_handshake
from halfmoon.transfer.endpoint import Endpoint
from halfmoon.transfer.errors import ProtocolError, RemoteError, TransferCancelled, TransferError
from halfmoon.transfer.handles import CancelFlag
from halfmoon.transfer.hub import InProcessHub
from halfmoon.transfer.link import Link
from halfmoon.transfer.protocol import Frame, Kind

#: ``auto`` is ``shm`` when the peer sees the same shared memory as this process (it says
#: so in the handshake), else ``tcp``.
TRANSPORTS = ("auto", "tcp", "shm", "inproc")


def default_num_connections() -> int:
    """Parallel connections per batch: 4, or fewer on machines with fewer cores (more
    connections than cores only add context switches; measured on a 2-core host)."""
    return max(1, min(4, os.cpu_count() or 1))


MAX_FRAME_BYTES = 64 << 20
#: Blocks per frame at most: 1,024 (a 64 MiB batch of 64 KiB blocks is one frame per
#: connection, as one of 1 MiB blocks is; at 256 it took two, ~5% slower).
MAX_FRAME_SEGMENTS = 1024
_ACK_WINDOW = 8


class OutFrame:
    """A request frame of a batch. ``prepare``, when set, runs on the frame's connection
    thread right before it is sent (so one frame is prepared while another is on the
    wire): it may copy the blocks in place (shm) or fill ``meta`` and ``payloads``.
    ``joined``: the payloads went through :func:`~halfmoon.transfer.link.coalesce`.
    ``acks`` collects the peer's ack of the frame. (A plain class: a frozen dataclass
    cost ~1.4 us to build, a one-block write builds one.)"""

    __slots__ = ("kind", "meta", "payloads", "prepare", "joined", "acks")

    def __init__(
        self,
        kind: Kind,
        meta: dict[str, Any],
        payloads: list[memoryview],
        prepare: Callable[[], None] | None = None,
        joined: bool = False,
    ) -> None:
        self.kind, self.meta, self.payloads = kind, meta, payloads
        self.prepare, self.joined = prepare, joined
        self.acks: list[dict[str, Any]] = []


def split_batch(sizes: Sequence[int], num_connections: int) -> list[range]:
    """Cut item indices into consecutive groups of about ``sum(sizes)/num_connections``
    bytes (at most ``MAX_FRAME_SEGMENTS`` items each)."""
    if len(sizes) == 1:  # a one-block write (latency-bound: skip the arithmetic)
        return [range(1)]
    target = max(1, min(MAX_FRAME_BYTES, math.ceil(sum(sizes) / max(1, num_connections))))
    groups: list[range] = []
    start = group_bytes = 0
    for i, size in enumerate(sizes):
        if i > start and (group_bytes + size > target or i - start >= MAX_FRAME_SEGMENTS):
            groups.append(range(start, i))
            start, group_bytes = i, 0
        group_bytes += size
    if sizes:
        groups.append(range(start, len(sizes)))
    return groups


class LinkPool:
    """Idle authenticated links to ``endpoint``, opened on demand (thread-safe)."""

    def __init__(
        self,
        endpoint: str,
        secret: bytes,
        transport: str,
        num_connections: int,
        hub: InProcessHub | None,
        busy_poll_s: float = 0.0,
        checksum: bool = True,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(
                f"unknown transport {transport!r}; choose from {', '.join(TRANSPORTS)}"
            )
        if transport == "inproc" and hub is None:
            raise ValueError("the inproc transport needs an InProcessHub")
        if num_connections < 1:
            raise ValueError(f"num_connections must be >= 1, got {num_connections}")
        self.endpoint = str(Endpoint.parse(endpoint))
        self.transport = transport
        self._resolved: str | None = None if transport == "auto" else transport
        self.num_connections = num_connections
        self.busy_poll_s = busy_poll_s  # for replies, before sleeping (see Link)
        self.checksum = checksum  # hash the payloads we send (see Link)
        self.client_id = secrets.token_hex(8)
        self._secret = check_secret(secret)
        self._hub = hub
        self._lock = threading.Lock()
        self._idle: list[Link] = []
        self._workers = ThreadPoolExecutor(
            max_workers=num_connections, thread_name_prefix="hm-xfer"
        )
        self._closed = False

    # ------------------------------------------------------------ links
    def _open(self, deadline: float) -> Link:
        if self.transport == "inproc":
            assert self._hub is not None
            mine, theirs = socket.socketpair()
            self._hub.get(self.endpoint).serve_socket(theirs, f"inproc:{self.client_id}")
            link = Link(mine, self.endpoint, self.busy_poll_s, self.checksum)
        else:
            address = Endpoint.parse(self.endpoint)
            timeout_s = max(0.01, deadline - time.monotonic())
            try:
                sock = socket.create_connection((address.host, address.port), timeout=timeout_s)
            except OSError as exc:
                reason = exc.strerror or str(exc) or type(exc).__name__
                raise TransferError(f"cannot connect to peer {self.endpoint}: {reason}") from exc
            link = Link(sock, self.endpoint, self.busy_poll_s, self.checksum)
        hello = client_handshake(link, self._secret, self.client_id, deadline)
        if self._resolved is None:
            self._resolved = "shm" if hello.shares_memory() else "tcp"
        return link

    @property
    def resolved_transport(self) -> str | None:
        """The transport in use; None while ``auto`` has not connected yet."""
        return self._resolved

    def resolve_transport(self, deadline: float) -> str:
        """The transport in use: the one asked for or, for ``auto``, what the first
        connection's handshake showed (connects once if no link is open yet)."""
        if self._resolved is None:
            self.checkin(self.checkout(deadline), ok=True)
        assert self._resolved is not None
        return self._resolved

    def checkout(self, deadline: float) -> Link:
        """An idle link, or a new one (connect + handshake)."""
        with self._lock:
            if self._closed:
                raise TransferError(f"client for peer {self.endpoint} is closed")
            if self._idle:
                return self._idle.pop()
        return self._open(deadline)

    def checkin(self, link: Link, ok: bool) -> None:
        """Return a healthy link; a failed one (its frame position is unknown) is closed."""
        with self._lock:
            if ok and not link.closed and not self._closed:
                self._idle.append(link)
                return
        link.close()

    def borrowed(self, deadline: float) -> _Borrowed:
        """A link for the ``with`` block (:meth:`checkout`); back to the idle ones when
        the block ends normally, closed when it raises (its frame position is unknown)."""
        return _Borrowed(self, self.checkout(deadline))

    def expect(self, link: Link, reply_kind: Kind, deadline: float) -> Frame:
        """Receive the reply to a request: ``reply_kind``, or raise the peer's error."""
        frame = link.recv(deadline)
        if frame.kind == Kind.ERROR:
            raise RemoteError(f"peer {self.endpoint}: {frame.meta.get('message', 'error')}")
        if frame.kind != reply_kind:
            raise ProtocolError(
                f"expected {reply_kind.name} from {self.endpoint}, got {frame.kind.name}"
            )
        return frame

    def request(self, kind: Kind, meta: dict[str, Any], reply_kind: Kind, deadline: float) -> Frame:
        """One small request and its reply (no payloads) on any idle link."""
        with self.borrowed(deadline) as link:
            link.send(kind, meta, deadline=deadline)
            return self.expect(link, reply_kind, deadline)

    def run_parallel(
        self, jobs: Sequence[Callable[[], None]], on_error: Callable[[], None] = lambda: None
    ) -> None:
        """Run ``jobs`` (the first on this thread) and raise the most telling error, if any."""
        futures = [self._workers.submit(job) for job in jobs[1:]]
        errors: list[BaseException] = []
        try:
            if jobs:
                jobs[0]()
        except BaseException as exc:
            errors.append(exc)
            on_error()
        for future in futures:
            error = future.exception()
            if error is not None:
                errors.append(error)
        if errors:
            raise next((e for e in errors if not isinstance(e, TransferCancelled)), errors[0])

    # ------------------------------------------------------------ batches
    def send_frames(
        self,
        frames: list[OutFrame],
        ack_kind: Kind,
        deadline: float,
        cancel: CancelFlag,
        xfer: str,
    ) -> None:
        """Send ``frames`` over up to ``num_connections`` links in parallel; collect acks."""
        num_links = min(self.num_connections, len(frames))
        if num_links == 1:  # one connection: on this thread, nothing to run beside it
            self._send_group(frames, ack_kind, deadline, cancel, xfer)
            return
        groups = [frames[i::num_links] for i in range(num_links)]
        jobs = [_bind(self._send_group, g, ack_kind, deadline, cancel, xfer) for g in groups]
        self.run_parallel(jobs, on_error=cancel.set)

    def _send_group(
        self,
        frames: list[OutFrame],
        ack_kind: Kind,
        deadline: float,
        cancel: CancelFlag,
        xfer: str,
    ) -> None:
        unacked: list[OutFrame] = []
        with self.borrowed(deadline) as link:
            for frame in frames:
                if cancel.is_set():
                    link.send(Kind.CANCEL, {"xfer": xfer}, deadline=deadline)
                    raise TransferCancelled(f"transfer {xfer} to {self.endpoint} was cancelled")
                if frame.prepare is not None:
                    frame.prepare()
                link.send(frame.kind, frame.meta, frame.payloads, deadline, frame.joined)
                unacked.append(frame)
                if len(unacked) >= _ACK_WINDOW:
                    unacked.pop(0).acks.append(self.ack(link, ack_kind, deadline, cancel))
            while unacked:
                unacked.pop(0).acks.append(self.ack(link, ack_kind, deadline, cancel))

    def ack(
        self, link: Link, ack_kind: Kind, deadline: float, cancel: CancelFlag
    ) -> dict[str, Any]:
        """Wait for a sent frame's ack (``ack_kind``); :class:`TransferCancelled` once
        ``cancel`` is set, the peer's refusal as an error."""
        link.wait_readable(deadline, cancel)
        meta = self.expect(link, ack_kind, deadline).meta
        if not meta.get("ok", True):
            raise TransferError(
                f"peer {self.endpoint} rejected transfer {meta.get('xfer')}: {meta.get('error')}"
            )
        return meta

    def close(self) -> None:
        """Close every idle link and stop the worker threads."""
        with self._lock:
            self._closed = True
            links, self._idle = self._idle, []
        for link in links:
            link.close()
        self._workers.shutdown(wait=False)


class _Borrowed:
    """:meth:`LinkPool.borrowed`'s context (a class: a generator-based context manager
    costs ~1.5 us a use, and every request borrows a link)."""

    __slots__ = ("_pool", "_link")

    def __init__(self, pool: LinkPool, link: Link) -> None:
        self._pool, self._link = pool, link

    def __enter__(self) -> Link:
        return self._link

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self._pool.checkin(self._link, ok=exc_type is None)


def _bind(fn: Callable[..., None], *args: Any) -> Callable[[], None]:
    return lambda: fn(*args)
