"""A connected stream socket whose blocking calls give up at a deadline.

The socket stays in blocking mode and deadlines become kernel timeouts
(``SO_RCVTIMEO`` / ``SO_SNDTIMEO``): Python's own socket timeouts ``poll()`` before every
call, which measurably costs throughput. TCP sockets get ``TCP_NODELAY`` and the kernel's
buffer autotuning; socket pairs (no autotuning) get fixed 1 MiB buffers.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable

from halfmoon.transfer.errors import TransferTimeout

#: sendmsg takes at most IOV_MAX (1024 on Linux) buffers per call.
IOV_BATCH = 512
#: Buffers of local (socket-pair) links; TCP's are left to the kernel's autotuning, which
#: with 1 MiB chunks measured 6% faster on loopback than fixed 1 MiB buffers with 256 KiB
#: chunks (and 80% faster over one connection; benchmarks/dataplane/transfer.py, docs/benchmarks.md).
_SOCKET_BUFFER_BYTES = 1 << 20
#: An armed timeout at least this long is left in place for a call without a deadline.
_IDLE_WAKE_MIN_S = 1.0


class DeadlineSocket:
    """Whole sends and single receives on ``sock`` that raise once their deadline passes
    (``TimeoutError``, or :class:`TransferTimeout` before a call starts); EOF raises
    ``EOFError``."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self._sock = sock
        self._peer = peer
        sock.settimeout(None)
        self._armed_s = {socket.SO_RCVTIMEO: 0.0, socket.SO_SNDTIMEO: 0.0}  # 0: no timeout
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        else:  # no autotuning: the default (~200 KiB) would cut a payload into many calls
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER_BYTES)

    def _arm(self, deadline: float | None, option: int) -> None:
        """Make the next blocking call give up by ``deadline`` (plus a little slack).

        The kernel timeout is only rewritten when it would overshoot the deadline by more
        than ``max(50 ms, 10%)`` of the time left, so a transfer costs a few setsockopt
        calls, not one per recv. A timeout shorter than needed just wakes the loop early.
        """
        armed_s = self._armed_s[option]
        if deadline is None:
            # A timeout armed for an earlier call only wakes this one now and then (the
            # callers retry until their deadline): rewriting it would cost two setsockopt
            # calls per request on a server that waits for each next one without a
            # deadline. Only a short one, which would wake an idle wait often, is cleared.
            if armed_s == 0.0 or armed_s >= _IDLE_WAKE_MIN_S:
                return
            want_s = 0.0
        else:
            want_s = deadline - time.monotonic()
            if want_s <= 0:
                raise TransferTimeout(f"timed out waiting for peer {self._peer}")
            if armed_s != 0.0 and armed_s <= want_s + max(0.05, 0.1 * want_s):
                return  # the armed timeout fires close enough to the deadline
        sec = int(want_s)
        usec = max(1000, int((want_s - sec) * 1e6)) if want_s else 0
        self._sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", sec, usec))
        self._armed_s[option] = want_s

    @staticmethod
    def _expired(deadline: float | None) -> bool:
        return deadline is not None and time.monotonic() >= deadline

    def send_all(self, views: list[memoryview], deadline: float | None) -> None:
        """Send every byte of ``views`` (scatter-gather; trims ``views`` as it goes)."""
        index = 0
        while index < len(views):
            self._arm(deadline, socket.SO_SNDTIMEO)
            # A small frame goes whole in the first call, without slicing the list.
            small = not index and len(views) <= IOV_BATCH
            batch = views if small else views[index : index + IOV_BATCH]
            try:
                sent = self._sock.sendmsg(batch)
            except BlockingIOError:  # the kernel timeout fired
                if self._expired(deadline):
                    raise TimeoutError from None
                continue
            # Skip fully sent buffers; keep the unsent tail of a partially sent one.
            while index < len(views) and sent >= views[index].nbytes:
                sent -= views[index].nbytes
                index += 1
            if sent:
                views[index] = views[index][sent:]

    def recv_into_many(self, views: list[memoryview], deadline: float | None) -> int:
        """One scatter receive (``recvmsg_into``) filling ``views`` in order (at most
        ``IOV_BATCH`` of them) honouring the deadline; returns the bytes received."""
        return self._receive(lambda: self._sock.recvmsg_into(views)[0], deadline)

    def recv_into(self, view: memoryview, deadline: float | None) -> int:
        """One ``recv_into`` honouring the deadline; EOF raises."""
        return self._receive(lambda: self._sock.recv_into(view), deadline)

    def _receive(self, receive: Callable[[], int], deadline: float | None) -> int:
        """``receive()`` (one receive call, returning its byte count) honouring the
        deadline; EOF raises."""
        while True:
            self._arm(deadline, socket.SO_RCVTIMEO)
            try:
                n = receive()
            except BlockingIOError:  # the kernel timeout fired
                if self._expired(deadline):
                    raise TimeoutError from None
                continue
            if n == 0:
                raise EOFError
            return n
