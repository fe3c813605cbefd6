"""The sending end of a layer-wise stream session (see :mod:`halfmoon.transfer.streams`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from halfmoon.transfer.errors import ProtocolError, RemoteError, TransferError
from halfmoon.transfer.link import Link, as_bytes_view, deadline_after
from halfmoon.transfer.memcopy import copy_blocks
from halfmoon.transfer.protocol import Kind


class StreamSender:
    """Sends layers of one session over a dedicated link, in any order, each at most once.

    With ``remote`` (a view of the receiver's region through shared memory or in-process)
    the blocks are copied straight into place and only a small frame travels; otherwise
    the layer's blocks are the frame's payload. Receiver-side failures (cancelled, bad
    data) are noticed at the next ``send_layer`` without waiting, or at ``finish``.
    """

    def __init__(
        self,
        link: Link,
        session_id: str,
        layout: tuple[int, int, int],
        offsets: Sequence[int],
        remote: memoryview | None,
        timeout_s: float,
        on_done: Callable[[Link, bool], None],
    ) -> None:
        self.session_id = session_id
        self.num_layers, self.num_blocks, self.block_bytes = layout
        self._link = link
        self._offsets = offsets
        self._remote = remote
        self._timeout_s = timeout_s
        self._on_done = on_done
        self._sent = [False] * self.num_layers
        self._closed = False

    @property
    def placed(self) -> bool:
        """Whether blocks are copied straight into the receiver's memory."""
        return self._remote is not None

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"stream {self.session_id!r} is already finished or cancelled")

    def _raise_pending_error(self) -> None:
        """The receiver speaks mid-stream only to report an error: surface it now."""
        if not self._link.readable():
            return
        frame = self._link.recv(deadline_after(self._timeout_s))
        self._close(ok=False)
        if frame.kind == Kind.ERROR:
            raise RemoteError(
                f"stream {self.session_id!r}: {frame.meta.get('message', 'receiver error')}"
            )
        raise ProtocolError(f"unexpected {frame.kind.name} during stream {self.session_id!r}")

    def send_layer(
        self, layer: int, blocks: Sequence[object], timeout_s: float | None = None
    ) -> None:
        """Send ``layer``'s ``num_blocks`` blocks (any buffers). A block fills its slot of
        ``block_bytes`` or, for payloads of varying size (compressed KV), a prefix of it:
        the lengths then travel with the layer (``StreamReceiver.lengths``)."""
        self._check_open()
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        if self._sent[layer]:
            raise ValueError(f"layer {layer} of stream {self.session_id!r} was already sent")
        views = [as_bytes_view(b) for b in blocks]
        if len(views) != self.num_blocks or any(v.nbytes > self.block_bytes for v in views):
            raise ValueError(
                f"layer {layer} needs {self.num_blocks} blocks of at most {self.block_bytes} "
                f"bytes, got {[v.nbytes for v in views]}"
            )
        deadline = deadline_after(self._timeout_s if timeout_s is None else timeout_s)
        try:
            self._raise_pending_error()
            meta = {"session": self.session_id, "layer": layer, "placed": self._remote is not None}
            if any(v.nbytes != self.block_bytes for v in views):
                meta["lengths"] = [v.nbytes for v in views]
            if self._remote is not None:
                base = layer * self.num_blocks
                offsets = self._offsets[base : base + self.num_blocks]
                copy_blocks(self._remote, zip(offsets, views, strict=True))
                self._link.send(Kind.STREAM_LAYER, meta, deadline=deadline)
            else:
                self._link.send(Kind.STREAM_LAYER, meta, views, deadline)
        except TransferError:
            self._close(ok=False)
            raise
        self._sent[layer] = True

    def finish(self, timeout_s: float | None = None) -> None:
        """End the session and wait for the receiver's verdict (raises if it failed)."""
        self._check_open()
        deadline = deadline_after(self._timeout_s if timeout_s is None else timeout_s)
        try:
            self._link.send(Kind.STREAM_END, {"session": self.session_id}, deadline=deadline)
            while True:
                frame = self._link.recv(deadline)
                if frame.kind == Kind.STREAM_ACK:
                    break
                if frame.kind != Kind.ERROR or frame.meta.get("session") != self.session_id:
                    raise ProtocolError(
                        f"unexpected {frame.kind.name} ending stream {self.session_id!r}"
                    )
        except TransferError:
            self._close(ok=False)
            raise
        self._close(ok=True)
        if not frame.meta.get("ok"):
            raise RemoteError(
                f"stream {self.session_id!r} failed at the receiver: {frame.meta.get('error')}"
            )

    def cancel(self) -> None:
        """Abandon the session; the receiver's waiters get ``TransferCancelled``."""
        if self._closed:
            return
        try:
            self._link.send(Kind.CANCEL, {"session": self.session_id}, deadline=deadline_after(1.0))
        except TransferError:
            pass  # the receiver learns from the closed connection instead
        self._close(ok=False)

    def _close(self, ok: bool) -> None:
        if not self._closed:
            self._closed = True
            self._on_done(self._link, ok)

    def __enter__(self) -> StreamSender:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None:
            self.cancel()
        elif not self._closed:
            self.finish()
