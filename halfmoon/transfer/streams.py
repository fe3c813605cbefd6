"""Layer-wise stream sessions, receiving side.

A receiver announces a session (``TransferEngine.expect_stream``) with a region and a
layout of ``num_layers x num_blocks`` destinations; the sender then sends layer ``i`` as
soon as it is computed. The receiver sees each layer complete (``wait_layer``, or the
``on_layer`` callback on the server thread) and then the whole session (``wait``).
Destination of (layer l, block b) is ``offsets[l * num_blocks + b]`` in the region::

    contiguous layout, base 0, B = bytes per (layer, block):
    | l0 b0 | l0 b1 | ... | l0 bM-1 | l1 b0 | ... | lN-1 bM-1 |
      0       B             (M-1)B    MB            (NM-1)B
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from halfmoon.transfer.errors import (
    ProtocolError,
    RemoteError,
    TransferCancelled,
    TransferError,
    TransferTimeout,
)
from halfmoon.transfer.regions import MemoryRegion


@dataclass(frozen=True)
class StreamLayout:
    """Where each (layer, block) of a stream lands in the receiver's region."""

    num_layers: int
    num_blocks: int
    block_bytes: int
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or self.num_blocks <= 0 or self.block_bytes <= 0:
            raise ValueError("a stream needs positive num_layers, num_blocks and block_bytes")
        if len(self.offsets) != self.num_layers * self.num_blocks:
            raise ValueError(
                f"stream layout needs {self.num_layers * self.num_blocks} offsets, got {len(self.offsets)}"
            )

    @classmethod
    def contiguous(
        cls, num_layers: int, num_blocks: int, block_bytes: int, base_offset: int = 0
    ) -> StreamLayout:
        """Layer-major, back to back from ``base_offset`` (see the module diagram)."""
        count = num_layers * num_blocks
        return cls(
            num_layers,
            num_blocks,
            block_bytes,
            tuple(base_offset + i * block_bytes for i in range(count)),
        )


LayerCallback = Callable[["StreamReceiver", int], None]
#: Announces a session a sender opened unannounced: ``(session_id, num_layers, num_blocks,
#: block_bytes) -> receiver`` (already added to the table), or raises to refuse it.
StreamAcceptor = Callable[[str, int, int, int], "StreamReceiver"]


class StreamReceiver:
    """The receiving end of one session; thread-safe."""

    def __init__(
        self,
        session_id: str,
        region: MemoryRegion,
        layout: StreamLayout,
        on_layer: LayerCallback | None = None,
    ) -> None:
        self.session_id = session_id
        self.region = region
        self.layout = layout
        self._on_layer = on_layer
        self._cond = threading.Condition()
        self._layer_done = [False] * layout.num_layers
        self._lengths: dict[int, list[int]] = {}
        self._num_layers_done = 0
        self._finished = False
        self._error: TransferError | None = None
        self.sender_attached = False
        #: Called once with the session id when the session completes or fails.
        self.on_end: Callable[[str], None] | None = None
        # Validate every destination now: a bad layout fails at expect_stream, not mid-stream.
        for offset in layout.offsets:
            if offset < 0 or offset + layout.block_bytes > region.size_bytes:
                raise ValueError(
                    f"stream {session_id!r}: block at offset {offset} is outside region "
                    f"{region.name!r} of {region.size_bytes} bytes"
                )

    # ------------------------------------------------------------ server side
    def dests(self, layer: int) -> list[memoryview]:
        """Destination views of ``layer``'s blocks, in block order."""
        m, size = self.layout.num_blocks, self.layout.block_bytes
        offsets = self.layout.offsets[layer * m : (layer + 1) * m]
        return [self.region.slice(offset, size) for offset in offsets]

    def set_lengths(self, layer: int, lengths: object) -> list[memoryview]:
        """Record that ``layer``'s blocks fill only the first ``lengths[i]`` bytes of their
        slots (a sender's payloads of varying size); returns those destination views.
        Raises :class:`ProtocolError` for lengths that do not fit the layout."""
        m, size = self.layout.num_blocks, self.layout.block_bytes
        if (
            not isinstance(lengths, list)
            or len(lengths) != m
            or not all(isinstance(n, int) and 0 <= n <= size for n in lengths)
        ):
            raise ProtocolError(
                f"stream {self.session_id!r} layer {layer}: block lengths must be {m} "
                f"integers in [0, {size}]"
            )
        self._lengths[layer] = list(lengths)
        return [dest[:n] for dest, n in zip(self.dests(layer), lengths, strict=True)]

    def lengths(self, layer: int) -> list[int]:
        """Bytes of each of ``layer``'s blocks (``block_bytes`` unless the sender sent
        shorter payloads)."""
        return self._lengths.get(layer, [self.layout.block_bytes] * self.layout.num_blocks)

    def mark_layer(self, layer: int) -> None:
        """Record that ``layer`` fully arrived, then run ``on_layer``."""
        with self._cond:
            if self._layer_done[layer] or self._error is not None:
                return
            self._layer_done[layer] = True
            self._num_layers_done += 1
            self._cond.notify_all()
        if self._on_layer is not None:
            self._on_layer(self, layer)

    def finish(self) -> TransferError | None:
        """Mark the session complete; returns the error instead when layers are missing."""
        with self._cond:
            if self._error is not None:
                return self._error
            if self._num_layers_done < self.layout.num_layers:
                self._error = TransferError(
                    f"stream {self.session_id!r} ended after {self._num_layers_done} of "
                    f"{self.layout.num_layers} layers"
                )
            else:
                self._finished = True
            self._cond.notify_all()
            error = self._error
        self._ended()
        return error

    def _ended(self) -> None:
        if self.on_end is not None:
            self.on_end(self.session_id)

    def fail(self, error: TransferError) -> None:
        """End the session with ``error`` (peer died, cancelled, bad data); first error wins."""
        with self._cond:
            if self._finished or self._error is not None:
                return
            self._error = error
            self._cond.notify_all()
        self._ended()

    # ------------------------------------------------------------ user side
    @property
    def num_layers_done(self) -> int:
        """Layers fully received so far."""
        with self._cond:
            return self._num_layers_done

    @property
    def error(self) -> TransferError | None:
        """Why the session failed, or None."""
        with self._cond:
            return self._error

    @property
    def done(self) -> bool:
        """Whether every layer arrived and the sender closed the session."""
        with self._cond:
            return self._finished

    def is_layer_done(self, layer: int) -> bool:
        """Whether ``layer`` fully arrived."""
        with self._cond:
            return self._layer_done[layer]

    def _wait(self, ready: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not ready():
                if self._error is not None:
                    raise self._error
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeout(
                        f"stream {self.session_id!r}: {what} not received within {timeout_s} s"
                    )
                self._cond.wait(remaining)

    def wait_layer(self, layer: int, timeout_s: float) -> None:
        """Block until ``layer`` arrived; raises the session's error or a timeout."""
        if not 0 <= layer < self.layout.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.layout.num_layers})")
        self._wait(lambda: self._layer_done[layer], f"layer {layer}", timeout_s)

    def wait(self, timeout_s: float) -> None:
        """Block until the whole session completed; raises its error or a timeout."""
        self._wait(lambda: self._finished, "the final layer", timeout_s)

    def cancel(self) -> None:
        """Give up on the session; the sender is told at its next layer or at the end."""
        self.fail(TransferCancelled(f"stream {self.session_id!r} cancelled by the receiver"))


class StreamTable:
    """Live sessions by id; a sender may open one a little before the receiver announces it.

    Ended sessions leave the table; the last ``num_remembered`` ended ids are kept so a
    late sender is refused at once instead of waiting for its timeout. With an
    ``acceptor`` set, a session nobody announced is announced by it when a sender opens
    it (the receiver places it on demand, e.g. in an inbox region).
    """

    def __init__(self, num_remembered: int = 1024) -> None:
        self._sessions: dict[str, StreamReceiver] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._num_remembered = num_remembered
        self._cond = threading.Condition()
        self.acceptor: StreamAcceptor | None = None

    def add(self, receiver: StreamReceiver) -> None:
        """Announce a session."""
        with self._cond:
            if receiver.session_id in self._sessions:
                raise ValueError(f"stream session {receiver.session_id!r} already exists")
            self._ended.pop(receiver.session_id, None)
            self._sessions[receiver.session_id] = receiver
            receiver.on_end = self.remove
            self._cond.notify_all()

    def attach(
        self, session_id: str, deadline: float, shape: tuple[int, int, int] | None = None
    ) -> StreamReceiver | None:
        """Wait until ``session_id`` is announced, mark it taken; None on timeout.

        ``shape`` (layers, blocks, block bytes) lets the acceptor announce it at once.
        """
        with self._cond:
            acceptor = self.acceptor
            if session_id in self._sessions or session_id in self._ended:
                acceptor = None
        if acceptor is not None and shape is not None:
            acceptor(session_id, *shape)  # raises to refuse; adds the receiver otherwise
        with self._cond:
            while session_id not in self._sessions:
                if session_id in self._ended:
                    raise RemoteError(
                        f"stream session {session_id!r} already ended at the receiver"
                    )
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            receiver = self._sessions[session_id]
            if receiver.sender_attached:
                raise RemoteError(f"stream session {session_id!r} already has a sender")
            receiver.sender_attached = True
            return receiver

    def remove(self, session_id: str) -> None:
        """Forget an ended session (called by the receiver when it completes or fails)."""
        with self._cond:
            if self._sessions.pop(session_id, None) is not None:
                self._ended[session_id] = None
                while len(self._ended) > self._num_remembered:
                    self._ended.popitem(last=False)
            self._cond.notify_all()

    def fail_all(self, error: TransferError) -> None:
        """Fail every session (the engine is closing)."""
        with self._cond:
            sessions, self._sessions = list(self._sessions.values()), {}
        for receiver in sessions:
            receiver.fail(error)
