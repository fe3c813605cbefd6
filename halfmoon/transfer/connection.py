"""The serving side of one peer connection: executes the peer's requests in order.

One thread per connection reads frames in order and writes payloads straight into their
destinations (region slices, reserved store slots, stream layouts). Requests:

- ``PUSH``: blocks into a registered region (inline payload, or already placed by a
  co-located sender through shared memory); acked per frame. A push split across several
  connections completes when all its frames arrived.
- ``PUT`` / ``PUT_RESERVE`` + ``PUT_COMMIT`` / ``PULL`` / ``RELEASE``: the attached
  store (see :mod:`halfmoon.transfer.store_service`).
- ``STREAM_OPEN`` / ``STREAM_LAYER`` / ``STREAM_END``: layer-wise sessions (see
  :mod:`halfmoon.transfer.streams`). A connection that drops mid-stream fails its
  sessions at once with :class:`PeerClosedError`.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from halfmoon.store import StoreError
from halfmoon.transfer.auth import server_handshake
from halfmoon.transfer.errors import (
    PeerClosedError,
    ProtocolError,
    RemoteError,
    TransferCancelled,
    TransferError,
)
from halfmoon.transfer.link import Link, deadline_after
from halfmoon.transfer.messages import (
    CompletionListener,
    TransferCompleted,
)
from halfmoon.transfer.protocol import Frame, Kind
from halfmoon.transfer.store_service import StoreSession
from halfmoon.transfer.streams import StreamReceiver

if TYPE_CHECKING:
    from halfmoon.transfer.server import TransferServer


class PushTracker:
    """Counts frames of multi-connection pushes; reports each push once complete."""

    def __init__(self, notify: CompletionListener | None) -> None:
        self._notify = notify
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, str], list[int]] = {}

    def add(
        self, client_id: str, xfer: str, num_parts: int, num_blocks: int, num_bytes: int, peer: str
    ) -> None:
        """Count one acked frame of push ``xfer``; notify when all ``num_parts`` arrived."""
        if num_parts == 1:  # the whole push in one frame: nothing to count
            if self._notify is not None:
                self._notify(TransferCompleted("push", xfer, peer, num_blocks, num_bytes))
            return
        key = (client_id, xfer)
        with self._lock:
            done = self._pending.setdefault(key, [0, 0, 0])
            done[0] += 1
            done[1] += num_blocks
            done[2] += num_bytes
            if done[0] < num_parts:
                return
            del self._pending[key]
        if self._notify is not None:
            self._notify(TransferCompleted("push", xfer, peer, done[1], done[2]))

    def cancel(self, client_id: str, xfer: str) -> None:
        """Forget a cancelled push (it will never be reported)."""
        with self._lock:
            self._pending.pop((client_id, xfer), None)


class PeerConnection:
    """One authenticated peer connection, served by its own thread."""

    def __init__(self, server: TransferServer, link: Link) -> None:
        self.server = server
        self.link = link
        self.client_id = ""
        self.streams: dict[str, StreamReceiver] = {}
        self.reported: set[str] = set()
        self.store_session = StoreSession(link, server, self.deadline)

    def run(self) -> None:
        """Authenticate, then serve requests until the peer leaves or misbehaves."""
        server = self.server
        try:
            self.client_id = server_handshake(
                self.link, server.secret, deadline_after(server.handshake_timeout_s)
            ).client_id
            while True:
                frame = self.link.recv(None)
                self.dispatch(frame)
        except TransferError:
            pass  # a dropped or misbehaving peer: clean up below, the server keeps running
        finally:
            self.link.close()
            self.cleanup()

    def cleanup(self) -> None:
        """Fail this connection's open streams; abort its puts; drop its pull leases."""
        for receiver in self.streams.values():
            receiver.fail(
                PeerClosedError(
                    f"sender {self.link.peer} closed the connection after "
                    f"{receiver.num_layers_done} of {receiver.layout.num_layers} layers of "
                    f"stream {receiver.session_id!r}"
                )
            )
        self.streams.clear()
        self.store_session.cleanup(self.server.store)

    def deadline(self) -> float:
        """Deadline of the next I/O step."""
        return deadline_after(self.server.io_timeout_s)

    def reply_error(self, exc: Exception, **ids: Any) -> None:
        """Skip the request's unread payload and answer with an ERROR frame."""
        self.link.discard_pending(self.deadline())  # keep the stream aligned on frames
        self.link.send(Kind.ERROR, {"message": str(exc), **ids}, deadline=self.deadline())

    def dispatch(self, frame: Frame) -> None:
        """Run the request's handler; a bad request gets an ERROR reply, not a dropped link."""
        handler = _HANDLERS.get(frame.kind)
        if handler is None:
            raise ProtocolError(f"unexpected frame {frame.kind.name} from {self.link.peer}")
        try:
            handler(self, frame)
            if self.link.unread_bytes:  # a payload the request did not need
                self.link.discard_pending(self.deadline())
        except KeyError as exc:
            error = RemoteError(f"malformed {frame.kind.name} request: no {exc}")
            self.reply_error(error, xfer=frame.meta.get("xfer"), session=frame.meta.get("session"))
        except (RemoteError, StoreError, ValueError, TypeError) as exc:
            self.reply_error(exc, xfer=frame.meta.get("xfer"), session=frame.meta.get("session"))

    # ------------------------------------------------------------ push / put / pull
    def on_push(self, frame: Frame) -> None:
        """Write an inline or already placed batch into a region; ack it."""
        meta = frame.meta
        region = self.server.regions.get(meta["region"])
        ack: dict[str, Any] = {"xfer": meta["xfer"], "ok": True}
        if meta.get("placed"):  # the sender copied the blocks in (ranges checked there)
            num_blocks, num_bytes = int(meta["blocks"]), int(meta["bytes"])
        else:
            segs = meta["segs"]
            dests, num_bytes = region.slices(segs)
            num_blocks = meta.get("blocks", len(segs))  # a segment may hold many blocks
            if type(num_blocks) is not int or num_blocks < 0:
                raise RemoteError(f"malformed block count {num_blocks!r}")
            try:
                self.link.recv_payload_into(frame, dests, self.deadline())
            except TransferError as exc:
                if self.link.closed:
                    raise
                ack = {"xfer": meta["xfer"], "ok": False, "error": str(exc)}
        self.link.send(Kind.PUSH_ACK, ack, deadline=self.deadline())
        if ack["ok"]:
            self.server.pushes.add(
                self.client_id,
                meta["xfer"],
                int(meta["parts"]),
                num_blocks,
                num_bytes,
                self.link.peer,
            )

    def store_request(self, frame: Frame) -> None:
        """PUT / PUT_RESERVE / PUT_COMMIT / RELEASE go to the store session."""
        _STORE_HANDLERS[frame.kind](self.store_session, frame)

    def on_pull(self, frame: Frame) -> None:
        """PULL goes straight to the store session (the latency-critical request)."""
        self.store_session.on_pull(frame)

    def on_region(self, frame: Frame) -> None:
        """Describe a region (its shared-memory name) to a co-located sender."""
        region = self.server.regions.get(frame.meta["region"])
        info = {"region": region.name, "size": region.size_bytes, "segment": region.segment_name}
        self.link.send(Kind.REGION_INFO, info, deadline=self.deadline())

    def on_cancel(self, frame: Frame) -> None:
        """The sender gave up a stream or a push."""
        session = frame.meta.get("session")
        if session is not None and session in self.streams:
            self.streams.pop(session).fail(
                TransferCancelled(f"stream {session!r} cancelled by the sender")
            )
        if frame.meta.get("xfer") is not None:
            self.server.pushes.cancel(self.client_id, frame.meta["xfer"])

    # ------------------------------------------------------------ streams
    def on_stream_open(self, frame: Frame) -> None:
        """Attach the sender to an announced session; send its layout."""
        meta = frame.meta
        session = meta["session"]
        wait_s = min(float(meta.get("wait_s", 0.0)), self.server.io_timeout_s)
        wanted = (int(meta["num_layers"]), int(meta["num_blocks"]), int(meta["block_bytes"]))
        receiver = self.server.streams.attach(session, deadline_after(wait_s), wanted)
        if receiver is None:
            raise RemoteError(f"no stream session {session!r} was announced within {wait_s} s")
        layout = receiver.layout
        if wanted != (layout.num_layers, layout.num_blocks, layout.block_bytes):
            receiver.fail(
                TransferError(f"stream {session!r}: sender layout {wanted} does not match")
            )
            raise RemoteError(
                f"stream {session!r} expects {layout.num_layers} layers x {layout.num_blocks} blocks "
                f"x {layout.block_bytes} bytes, sender offered {wanted[0]} x {wanted[1]} x {wanted[2]}"
            )
        self.streams[session] = receiver
        ready = {
            "session": session,
            "region": receiver.region.name,
            "segment": receiver.region.segment_name,
            "offsets": list(layout.offsets),
        }
        self.link.send(Kind.STREAM_READY, ready, deadline=self.deadline())

    def on_stream_layer(self, frame: Frame) -> None:
        """Receive one layer into its destinations (or report the session's error once)."""
        session, layer = frame.meta["session"], int(frame.meta["layer"])
        receiver = self.streams.get(session)
        if (
            receiver is None
            or receiver.error is not None
            or not 0 <= layer < receiver.layout.num_layers
        ):
            reason = receiver.error if receiver is not None and receiver.error else None
            reason = reason or RemoteError(
                f"stream {session!r} is not open or layer {layer} is invalid"
            )
            self.link.discard_pending(self.deadline())
            if session not in self.reported:  # tell the sender once, without waiting for END
                self.reported.add(session)
                self.link.send(
                    Kind.ERROR,
                    {"session": session, "message": str(reason)},
                    deadline=self.deadline(),
                )
            return
        try:
            dests = receiver.dests(layer)
            lengths = frame.meta.get("lengths")
            if lengths is not None:
                try:
                    dests = receiver.set_lengths(layer, lengths)
                except ProtocolError:
                    self.link.discard_pending(self.deadline())  # keep the stream position
                    raise
            if not frame.meta.get("placed"):
                self.link.recv_payload_into(frame, dests, self.deadline())
        except TransferError as exc:
            receiver.fail(exc)
            if self.link.closed:
                raise
            self.reported.add(session)
            self.link.send(
                Kind.ERROR, {"session": session, "message": str(exc)}, deadline=self.deadline()
            )
            return
        receiver.mark_layer(layer)

    def on_stream_end(self, frame: Frame) -> None:
        """Close the session; tell the sender whether every layer arrived."""
        session = frame.meta["session"]
        receiver = self.streams.pop(session, None)
        self.reported.discard(session)
        error = (
            receiver.finish()
            if receiver is not None
            else RemoteError(f"stream {session!r} is not open")
        )
        reply = {"session": session, "ok": error is None, "error": str(error) if error else ""}
        self.link.send(Kind.STREAM_ACK, reply, deadline=self.deadline())
        if error is None and receiver is not None and self.server.on_complete is not None:
            layout = receiver.layout
            num_blocks = layout.num_layers * layout.num_blocks
            self.server.on_complete(
                TransferCompleted(
                    "stream", session, self.link.peer, num_blocks, num_blocks * layout.block_bytes
                )
            )


_STORE_HANDLERS = {
    Kind.PUT: StoreSession.on_put,
    Kind.PUT_RESERVE: StoreSession.on_put_reserve,
    Kind.PUT_COMMIT: StoreSession.on_put_commit,
    Kind.RELEASE: StoreSession.on_release,
}

_HANDLERS = {
    Kind.PUSH: PeerConnection.on_push,
    Kind.PUT: PeerConnection.store_request,
    Kind.PUT_RESERVE: PeerConnection.store_request,
    Kind.PUT_COMMIT: PeerConnection.store_request,
    Kind.PULL: PeerConnection.on_pull,
    Kind.RELEASE: PeerConnection.store_request,
    Kind.REGION: PeerConnection.on_region,
    Kind.CANCEL: PeerConnection.on_cancel,
    Kind.STREAM_OPEN: PeerConnection.on_stream_open,
    Kind.STREAM_LAYER: PeerConnection.on_stream_layer,
    Kind.STREAM_END: PeerConnection.on_stream_end,
}
