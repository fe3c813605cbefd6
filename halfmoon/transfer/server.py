"""The listening side of a transfer engine: accepts peers, one thread per connection.

Binds 127.0.0.1 by default. Every connection must pass the HMAC handshake within
``handshake_timeout_s`` before any request is read (see :mod:`halfmoon.transfer.auth`).
In-process peers hand over one end of a ``socketpair`` (``serve_socket``) instead of
connecting through TCP.
"""

from __future__ import annotations

import contextlib
import socket
import threading

from halfmoon.core.errors import HalfmoonError
from halfmoon.store import TieredStore
from halfmoon.transfer.auth import check_secret
from halfmoon.transfer.busypoll import DEFAULT_BUSY_POLL_S
from halfmoon.transfer.connection import PeerConnection, PushTracker
from halfmoon.transfer.endpoint import DEFAULT_HOST, Endpoint
from halfmoon.transfer.errors import RemoteError
from halfmoon.transfer.link import Link
from halfmoon.transfer.messages import CompletionListener
from halfmoon.transfer.regions import RegionTable
from halfmoon.transfer.store_service import EncodedBlocks, PullEncoder, StoreFallback
from halfmoon.transfer.streams import StreamTable

#: Connections served at once (each has a thread); more are closed as they come. A peer
#: keeps a few (its pool); a flood of strangers is cut here and by the handshake's
#: deadline and frame caps.
MAX_CONNECTIONS = 1024


class TransferServer:
    """Serves pushes, puts, pulls and streams for one engine."""

    def __init__(
        self,
        secret: bytes,
        regions: RegionTable,
        streams: StreamTable,
        store: TieredStore | None = None,
        host: str = DEFAULT_HOST,
        port: int = 0,
        on_complete: CompletionListener | None = None,
        handshake_timeout_s: float = 5.0,
        io_timeout_s: float = 30.0,
        busy_poll_s: float = DEFAULT_BUSY_POLL_S,
        max_connections: int = MAX_CONNECTIONS,
        checksum: bool = True,
    ) -> None:
        self.secret = check_secret(secret)
        self.regions = regions
        self.streams = streams
        self.store = store
        #: Reads a pulled block the store lacks (see :mod:`~halfmoon.transfer.store_service`).
        self.store_fallback: StoreFallback | None = None
        #: Encodes pulled blocks for clients that decode (compressed KV on the wire).
        self.pull_encoder: PullEncoder | None = None
        #: Payloads ``pull_encoder`` wrote, kept for later pulls of the same blocks.
        self.encoded_blocks: EncodedBlocks | None = None
        self.on_complete = on_complete
        self.pushes = PushTracker(on_complete)
        self.handshake_timeout_s = handshake_timeout_s
        self.io_timeout_s = io_timeout_s
        self.busy_poll_s = busy_poll_s  # for the next request, before sleeping (see Link)
        self.max_connections = max_connections
        self.checksum = checksum  # hash the payloads we send (pull replies; see Link)
        self.num_refused = 0
        self._host, self._port = host, port
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._connections: set[PeerConnection] = set()
        self._closed = False

    def start(self) -> Endpoint:
        """Bind and start accepting; returns the bound endpoint (port 0 picks a free one)."""
        try:
            listener = socket.create_server((self._host, self._port), backlog=128)
        except OSError as exc:
            raise HalfmoonError(
                f"cannot listen on {self._host}:{self._port}: {exc.strerror}"
            ) from exc
        self._listener = listener
        self.endpoint = Endpoint(self._host, listener.getsockname()[1])
        threading.Thread(
            target=self._accept_loop, name=f"hm-accept-{self.endpoint}", daemon=True
        ).start()
        return self.endpoint

    def require_store(self) -> TieredStore:
        """The attached store; :class:`RemoteError` for a peer when there is none."""
        if self.store is None:
            raise RemoteError("this peer has no block store")
        return self.store

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, address = self._listener.accept()
            except OSError:
                return  # listener shut down by close()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            self.serve_socket(sock, f"{address[0]}:{address[1]}")

    def serve_socket(self, sock: socket.socket, peer: str) -> None:
        """Serve one connected socket on a new thread (TCP accept or in-process pair)."""
        connection = PeerConnection(self, Link(sock, peer, self.busy_poll_s, self.checksum))
        with self._lock:
            full = len(self._connections) >= self.max_connections
            if self._closed or full:
                self.num_refused += full
                connection.link.close()
                return
            self._connections.add(connection)
        threading.Thread(
            target=self._serve, args=(connection,), name=f"hm-peer-{peer}", daemon=True
        ).start()

    def _serve(self, connection: PeerConnection) -> None:
        try:
            connection.run()
        finally:
            with self._lock:
                self._connections.discard(connection)

    def close(self) -> None:
        """Stop accepting and drop every connection (their streams fail at once)."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
            self._listener.close()
        for connection in connections:
            connection.link.close()
